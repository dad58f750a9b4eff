"""The form a notebook is committed in: what JupyterLab itself writes, outputs stripped.

Opening a notebook in JupyterLab starts its kernel, and the kernel's answer rewrites the
notebook's ``kernelspec`` and ``language_info``. If the committed file says anything else
(``"display_name": "Python 3"``, or a bare ``{"name": "python"}`` language) the notebook is
marked modified before the learner has touched it, and closing it asks to save. So the
committed form is the one JupyterLab would save right after opening:

- nbformat 4.5, every cell with an ``id`` (kept as they are: ids name cells in reviews and
  diffs, and ``nbstripout`` without ``--keep-id`` would renumber them 0, 1, 2, ...),
- the kernelspec and language_info of ipykernel's ``python3`` kernel (the same constants
  ``parlib build`` writes into exercises/ and solutions/),
- no outputs, no execution counts, no per-run metadata (what ``nbstripout --keep-id``
  removes), JSON as Jupyter writes it (indent 1, sorted keys, source split into lines).

    python -m parlib.course.nbform                 # rewrite every notebook in the course
    python -m parlib.course.nbform --check [FILES] # list the ones not in that form, exit 1

Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["KERNELSPEC", "LANGUAGE_INFO", "normal_form", "dumps", "problems", "main"]

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# What ipykernel answers in its kernel_info reply. JupyterLab leaves a notebook unmodified
# when all but the version agree; one fixed version keeps the files byte-stable.
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": "3.11.7",
}
# nbstripout's default extra keys: per-run state that editors add to a notebook.
RUN_METADATA = ("signature", "widgets")
CELL_RUN_METADATA = ("collapsed", "ExecuteTime", "execution", "heading_collapsed", "hidden",
                     "scrolled")
FOLDERS = ("notebooks", "exercises", "solutions", "authoring")


def _lines(text: str | list[str]) -> list[str]:
    return text.splitlines(keepends=True) if isinstance(text, str) else list(text)


def _new_id(path_hint: str, index: int, source: str) -> str:
    # Deterministic, so running the normaliser twice gives the same file.
    return hashlib.sha1(f"{path_hint}:{index}:{source}".encode()).hexdigest()[:8]


def normal_form(nb: dict[str, Any], path_hint: str = "") -> dict[str, Any]:
    """A copy of `nb` in the committed form (the content of every cell unchanged)."""
    nb = copy.deepcopy(nb)
    if nb.get("nbformat") != 4:
        raise ValueError(f"{path_hint or 'notebook'}: nbformat {nb.get('nbformat')}, expected 4")
    nb["nbformat_minor"] = 5
    meta = nb.setdefault("metadata", {})
    for key in RUN_METADATA:
        meta.pop(key, None)
    meta["kernelspec"] = dict(KERNELSPEC)
    meta["language_info"] = copy.deepcopy(LANGUAGE_INFO)
    seen: set[str] = set()
    for index, cell in enumerate(nb["cells"]):
        cell["source"] = _lines(cell.get("source", []))
        cell_id = cell.get("id")
        if not cell_id or cell_id in seen:
            cell_id = _new_id(path_hint, index, "".join(cell["source"]))
        cell["id"] = cell_id
        seen.add(cell_id)
        cell_meta = cell.setdefault("metadata", {})
        for key in CELL_RUN_METADATA:
            cell_meta.pop(key, None)
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
    return nb


def dumps(nb: dict[str, Any]) -> str:
    """The bytes Jupyter writes (nbformat.writes + a final newline); a cell's source given
    as one string is written as its list of lines, as Jupyter does. The course's one
    notebook writer (``nbbuild`` writes exercises and solutions with it too)."""
    out = copy.deepcopy(nb)
    for cell in out.get("cells", []):
        if isinstance(cell.get("source"), str):
            cell["source"] = _lines(cell["source"])
    return json.dumps(out, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def problems(path: Path) -> list[str]:
    """Why `path` is not in the committed form (empty when it is)."""
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    out = []
    meta = nb.get("metadata", {})
    if meta.get("kernelspec") != KERNELSPEC:
        out.append(f"kernelspec is {meta.get('kernelspec')}, JupyterLab writes {KERNELSPEC}")
    if meta.get("language_info") != LANGUAGE_INFO:
        out.append(f"language_info is {meta.get('language_info')}, the kernel answers "
                   f"{LANGUAGE_INFO}")
    if (nb.get("nbformat"), nb.get("nbformat_minor")) != (4, 5):
        out.append(f"nbformat {nb.get('nbformat')}.{nb.get('nbformat_minor')}, expected 4.5")
    cells = nb.get("cells", [])
    if any(not c.get("id") for c in cells):
        out.append("cells without an id")
    if any(c.get("outputs") or c.get("execution_count") is not None for c in cells):
        out.append("outputs or execution counts not stripped")
    if not out and dumps(normal_form(nb, str(path))) != text:
        out.append("not written the way Jupyter writes it (run python -m parlib.course.nbform)")
    return out


def course_notebooks(root: Path) -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (root / folder).glob("*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parlib.course.nbform",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report, change nothing")
    parser.add_argument("files", nargs="*", type=Path,
                        help=f"notebooks (default: every notebook in {', '.join(FOLDERS)})")
    args = parser.parse_args(argv)
    files = args.files or course_notebooks(Path.cwd())
    bad = 0
    for path in files:
        if args.check:
            found = problems(path)
            for problem in found:
                print(f"{path}: {problem}")
            bad += bool(found)
            continue
        text = path.read_text(encoding="utf-8")
        new = dumps(normal_form(json.loads(text), str(path)))
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote {path}")
    if args.check and bad:
        print(f"{bad} notebook(s) not in the committed form; python -m parlib.course.nbform "
              "rewrites them (outputs stripped, content unchanged)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
