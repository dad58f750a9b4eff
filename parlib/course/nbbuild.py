"""Build ``solutions/`` and ``exercises/`` notebooks from one source in ``authoring/``.

``python -m parlib build`` (this module's :func:`main`) reads every
``authoring/NN_*.ipynb`` and writes ``solutions/NN_*.ipynb`` and ``exercises/NN_*.ipynb``.

Markers in the source notebook:

* code, a region::

      # BEGIN SOLUTION
      ...answer lines...
      # END SOLUTION

  solutions: the marker lines are removed. exercises: the region becomes
  ``raise NotImplementedError("your code here")`` at the marker's indentation (inside a
  function body), or ``# your code here`` at the top level of a cell.
* code, one line: ``x = value  # SOLUTION`` becomes ``x = value`` (solutions) and
  ``x = ...  # your answer`` (exercises). Inside a function, a non-assignment line ending in
  ``# SOLUTION`` becomes ``raise NotImplementedError("your code here")``.
* a code cell whose first line is ``# SOLUTION CELL`` and a markdown cell whose first line
  is ``<!-- SOLUTION -->`` appear only in solutions (without that line).
* markdown, a region ``<!-- BEGIN SOLUTION -->`` ... ``<!-- END SOLUTION -->``: kept
  (without the markers) in solutions, dropped from exercises.

Both outputs have outputs and execution counts stripped and normalised metadata, so a
rebuild is byte-identical. ``--check`` writes nothing: it exits 1 listing the generated
files that differ from what is on disk, and any notebook under ``notebooks/``,
``solutions/``, ``exercises/`` or ``authoring/`` that carries outputs.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

# The metadata JupyterLab writes, so that an opened notebook is not marked modified.
from parlib.course.nbform import KERNELSPEC, LANGUAGE_INFO, dumps

SOURCE_DIR = "authoring"
TARGETS = ("solutions", "exercises")
CHECKED_DIRS = ("notebooks", "solutions", "exercises", "authoring")
NB_NAME = re.compile(r"^\d\d_[A-Za-z0-9_\-]+\.ipynb$")

STUB_RAISE = 'raise NotImplementedError("your code here")'

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN SOLUTION\s*$")
_END = re.compile(r"^[ \t]*#\s*END SOLUTION\s*$")
_LINE = re.compile(r"^(?P<body>.*?)\s*#\s*SOLUTION\s*$")
_MD_BEGIN = re.compile(r"^\s*<!--\s*BEGIN SOLUTION\s*-->\s*$")
_MD_END = re.compile(r"^\s*<!--\s*END SOLUTION\s*-->\s*$")
_MD_CELL = re.compile(r"^\s*<!--\s*SOLUTION\s*-->\s*$")
_CODE_CELL = re.compile(r"^\s*#\s*SOLUTION CELL\s*$")


class BuildError(ValueError):
    """A source notebook's markers are malformed."""


# --------------------------------------------------------------------------- cells


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _strip_line_marker(line: str) -> str:
    m = _LINE.match(line)
    return m.group("body").rstrip() if m else line


def _stub_line(line: str, where: str) -> str:
    """``lhs = value  # SOLUTION`` -> ``lhs = ...  # your answer``."""
    body = _LINE.match(line).group("body")
    indent = body[: len(body) - len(body.lstrip())]
    code = body.strip()
    try:
        stmt = ast.parse(code).body[0]
    except (SyntaxError, IndexError):
        stmt = None
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
        value = stmt.value
        lhs = code[: value.col_offset].rstrip()
        return f"{indent}{lhs} ...  # your answer"
    if indent:
        return f"{indent}{STUB_RAISE}"
    raise BuildError(f"{where}: a top-level line marked '# SOLUTION' must be an assignment: "
                     f"{line.strip()!r}")


def _code(src: str, solution: bool, where: str) -> str:
    out: list[str] = []
    lines = src.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _BEGIN.match(line)
        if m:
            j = i + 1
            while j < len(lines) and not _END.match(lines[j]):
                if _BEGIN.match(lines[j]):
                    raise BuildError(f"{where}: nested '# BEGIN SOLUTION' (line {j + 1})")
                j += 1
            if j == len(lines):
                raise BuildError(f"{where}: '# BEGIN SOLUTION' on line {i + 1} has no "
                                 f"'# END SOLUTION'")
            region = lines[i + 1:j]
            if solution:
                out.extend(_strip_line_marker(x) for x in region)
            else:
                indent = m.group("indent")
                out.append(f"{indent}{STUB_RAISE}" if indent else "# your code here")
            i = j + 1
            continue
        if _END.match(line):
            raise BuildError(f"{where}: '# END SOLUTION' on line {i + 1} has no "
                             f"'# BEGIN SOLUTION'")
        if _LINE.match(line):
            out.append(_strip_line_marker(line) if solution else _stub_line(line, where))
        else:
            out.append(line)
        i += 1
    return "\n".join(out)


def _markdown(src: str, solution: bool, where: str) -> str:
    out: list[str] = []
    inside = False
    for n, line in enumerate(src.split("\n"), 1):
        if _MD_BEGIN.match(line):
            if inside:
                raise BuildError(f"{where}: nested '<!-- BEGIN SOLUTION -->' (line {n})")
            inside = True
            continue
        if _MD_END.match(line):
            if not inside:
                raise BuildError(f"{where}: '<!-- END SOLUTION -->' without BEGIN (line {n})")
            inside = False
            continue
        if inside and not solution:
            continue
        out.append(line)
    if inside:
        raise BuildError(f"{where}: '<!-- BEGIN SOLUTION -->' has no END")
    return "\n".join(out)


def _clean_cell(cell: dict, source: str, index: int) -> dict:
    kind = cell["cell_type"]
    meta = {}
    tags = cell.get("metadata", {}).get("tags")
    if tags:
        meta["tags"] = list(tags)
    cid = cell.get("id")
    if not (isinstance(cid, str) and re.fullmatch(r"[a-zA-Z0-9\-_]{1,64}", cid)):
        cid = f"cell-{index:03d}"
    new: dict[str, Any] = {"cell_type": kind, "id": cid, "metadata": meta,
                           "source": source}
    if kind == "code":
        new["execution_count"] = None
        new["outputs"] = []
    return new


def transform(nb: dict, solution: bool, name: str = "notebook") -> dict:
    """The solution (``solution=True``) or exercise version of a source notebook (a dict)."""
    cells = []
    seen: set[str] = set()
    for index, cell in enumerate(nb.get("cells", [])):
        kind = cell.get("cell_type")
        src = _source(cell)
        where = f"{name} cell {index}"
        first, _, rest = src.partition("\n")
        marked = _MD_CELL.match(first) if kind == "markdown" else _CODE_CELL.match(first)
        if kind in ("markdown", "code") and marked:
            if not solution:
                continue
            src = rest
        if kind == "code":
            src = _code(src, solution, where)
        elif kind == "markdown":
            src = _markdown(src, solution, where)
        new = _clean_cell(cell, src, index)
        if new["id"] in seen:
            new["id"] = f"cell-{index:03d}"
        seen.add(new["id"])
        cells.append(new)
    return {
        "cells": cells,
        "metadata": {"kernelspec": dict(KERNELSPEC), "language_info": dict(LANGUAGE_INFO)},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def build_one(src: Path) -> dict[str, str]:
    """{'solutions': text, 'exercises': text} for one source notebook."""
    nb = json.loads(src.read_text(encoding="utf-8"))
    return {t: dumps(transform(nb, solution=(t == "solutions"), name=src.name))
            for t in TARGETS}


def has_outputs(path: Path) -> bool:
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code" and (cell.get("outputs") or
                                                cell.get("execution_count") is not None):
            return True
    return False


def sources(root: Path, only: list[str] | None = None) -> list[Path]:
    found = sorted(p for p in (root / SOURCE_DIR).glob("*.ipynb") if NB_NAME.match(p.name))
    if only:
        wanted = {Path(o).name for o in only}
        found = [p for p in found if p.name in wanted]
    return found


def build(root: Path, check: bool = False, only: list[str] | None = None,
          out=sys.stdout) -> int:
    root = Path(root)
    problems: list[str] = []
    srcs = sources(root, only)
    if not srcs:
        print(f"no source notebooks matching {SOURCE_DIR}/NN_*.ipynb under {root}", file=out)
        return 1 if only else 0
    for src in srcs:
        try:
            texts = build_one(src)
        except (BuildError, json.JSONDecodeError, KeyError) as exc:
            problems.append(f"{src.relative_to(root)}: {exc}")
            continue
        for target, text in texts.items():
            dest = root / target / src.name
            current = dest.read_text(encoding="utf-8") if dest.exists() else None
            if current == text:
                continue
            rel = dest.relative_to(root)
            if check:
                problems.append(f"{rel} differs from what {SOURCE_DIR}/{src.name} builds "
                                f"({'missing' if current is None else 'out of date'})")
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text, encoding="utf-8")
                print(f"wrote {rel}", file=out)
    if check:
        for d in CHECKED_DIRS:
            for p in sorted((root / d).rglob("*.ipynb")):
                if ".ipynb_checkpoints" in p.parts:
                    continue
                try:
                    if has_outputs(p):
                        problems.append(f"{p.relative_to(root)} carries outputs or execution "
                                        f"counts (strip them: nbstripout, or rebuild)")
                except (json.JSONDecodeError, OSError) as exc:
                    problems.append(f"{p.relative_to(root)}: unreadable ({exc})")
    for line in problems:
        print(line, file=out)
    if problems:
        if check:
            print("run `python -m parlib build` and commit the result", file=out)
        return 1
    if check:
        print(f"{len(srcs)} source notebook(s): solutions/ and exercises/ up to date", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m parlib build [--check] [--root DIR] [NB ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m parlib build",
        description="Build solutions/ and exercises/ notebooks from authoring/NN_*.ipynb.",
    )
    parser.add_argument("notebooks", nargs="*",
                        help="only these source notebooks (names or paths)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated notebook is out of date "
                             "or any notebook carries outputs")
    parser.add_argument("--root", default=None,
                        help="course root holding authoring/ (default: the current folder "
                             "or the nearest parent with an authoring/ folder)")
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else _find_root(Path.cwd())
    return build(root, check=args.check, only=args.notebooks or None)


def _find_root(start: Path) -> Path:
    for p in [start, *start.parents]:
        if (p / SOURCE_DIR).is_dir():
            return p
    return start


__all__ = ["BuildError", "build", "main", "transform"]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
