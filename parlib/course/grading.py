"""``python -m parlib grade NB [NB ...] [--json FILE]``: run notebooks headless and score them.

Each notebook runs top to bottom in a fresh kernel (the current environment's ``python3``
kernel, working directory = the notebook's folder) with ``PARLIB_CHECK_LOG`` pointing at a
temporary file and ``PARLIB_CHECK_MODE`` unset. Every ``parlib.check`` call appends a line
to that log; the report lists every question the chapter declares (the ``NN`` of the
notebook's name ``NN_*.ipynb``): a question whose check never ran is "not run". A notebook
that stops with an error still gets a report for what ran, plus the error.

Exit status: 0 when every notebook ran to the end, 1 when one stopped with an error (its
report is still printed), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from parlib.course.check import LOG_ENV, MODE_ENV
from parlib.course.registry import questions
from parlib.course.results import NOT_ATTEMPTED, fmt_points

NOT_RUN = "not run"


def chapter_of(path: Path) -> str | None:
    m = re.match(r"^(\d\d)_", Path(path).name)
    return m.group(1) if m else None


def execute(path: Path, log: Path, timeout: float = 600.0) -> str | None:
    """Run the notebook in a fresh kernel; return None, or a description of the error."""
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    saved = {k: os.environ.get(k) for k in (LOG_ENV, MODE_ENV)}
    os.environ[LOG_ENV] = str(log)
    os.environ.pop(MODE_ENV, None)
    from parlib.course.nbclient import notebook_client

    client = notebook_client(
        nb, timeout=timeout, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(Path(path).resolve().parent)}},
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        cell = _failing_cell(nb)
        where = f"cell {cell}" if cell is not None else "a cell"
        ename = getattr(exc, "ename", "") or "Error"
        evalue = getattr(exc, "evalue", "") or ""
        return f"the notebook stopped at {where}: {ename}: {evalue}".rstrip(": ")
    except CellTimeoutError:
        return f"the notebook stopped: a cell ran longer than {timeout:g} s"
    except DeadKernelError as exc:
        return f"the kernel died: {exc}"
    except Exception as exc:  # noqa: BLE001 - report, don't crash the grader
        return f"the notebook could not run: {type(exc).__name__}: {exc}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return None


def _failing_cell(nb) -> int | None:
    """Index (0-based, among all cells) of the code cell with an error output."""
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return i
    return None


def read_log(log: Path) -> dict[str, dict[str, Any]]:
    """Latest result per question id from a check log."""
    latest: dict[str, dict[str, Any]] = {}
    if not log.exists():
        return latest
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "id" in row:
            latest[str(row["id"])] = row
    return latest


def report_for(path: Path, results: dict[str, dict[str, Any]], error: str | None,
               seconds: float) -> dict[str, Any]:
    chapter = chapter_of(path)
    declared = questions(chapter) if chapter else {}
    rows = []
    for qid, q in declared.items():
        r = results.get(qid)
        if r is None:
            rows.append({"id": qid, "status": NOT_RUN, "score": 0, "max_score": q.points,
                         "message": "this check never ran"})
        else:
            rows.append({"id": qid, "status": r.get("status"), "score": r.get("score", 0),
                         "max_score": q.points, "message": r.get("message", "")})
    for qid, r in results.items():  # checks of questions outside this chapter
        if qid not in declared:
            rows.append({"id": qid, "status": r.get("status"), "score": r.get("score", 0),
                         "max_score": r.get("max_score", 0), "message": r.get("message", "")})
    return {
        "notebook": str(path),
        "chapter": chapter,
        "error": error,
        "seconds": round(seconds, 1),
        "questions": rows,
        "score": sum(float(r["score"] or 0) for r in rows),
        "max_score": sum(float(r["max_score"] or 0) for r in rows),
    }


def grade(path: Path, timeout: float = 600.0) -> dict[str, Any]:
    """Execute one notebook and return its report (a JSON-able dict)."""
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="parlib-grade-") as tmp:
        log = Path(tmp) / "checks.jsonl"
        log.touch()
        t0 = time.monotonic()
        error = execute(path, log, timeout=timeout)
        results = read_log(log)
    return report_for(path, results, error, time.monotonic() - t0)


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"{rep['notebook']}  (chapter {rep['chapter'] or '?'})"]
    rows = rep["questions"]
    w = max([len(r["id"]) for r in rows] + [8])
    for r in rows:
        pts = f"{fmt_points(float(r['score'] or 0))}/{fmt_points(float(r['max_score'] or 0))}"
        msg = (r.get("message") or "").splitlines()[0] if r["status"] != "passed" else ""
        if len(msg) > 90:
            msg = msg[:87] + "..."
        lines.append(f"  {r['id']:<{w}}  {r['status']:<13}  {pts:>7}  {msg}".rstrip())
    if not rows:
        lines.append("  (no questions declared for this chapter, and no checks ran)")
    total = f"{fmt_points(rep['score'])}/{fmt_points(rep['max_score'])}"
    lines.append(f"  {'total':<{w}}  {'':<13}  {total:>7}")
    if rep["error"]:
        lines.append(f"  ERROR: {rep['error']}")
    return "\n".join(lines)


def verify_logs(solutions_log: Path, exercises_log: Path, root: Path = Path(".")) -> list[str]:
    """CI's proof that the checks ran: every question declared for a chapter that has a
    ``solutions/NN_*.ipynb`` reported in both runs, passed in the solutions run and did not
    pass in the exercises run. Returns the problems found (empty when all is well)."""
    solved, attempted = read_log(Path(solutions_log)), read_log(Path(exercises_log))
    problems = []
    chapters = sorted({chapter_of(p) for p in (root / "solutions").glob("[0-9][0-9]_*.ipynb")})
    if not chapters:
        problems.append(f"no solutions notebooks under {root / 'solutions'}")
    for chapter in chapters:
        declared = questions(chapter)
        if not declared:
            problems.append(f"chapter {chapter} declares no questions")
        for qid in sorted(declared):
            if qid not in solved:
                problems.append(f"{qid}: its check never ran in solutions/")
            elif solved[qid].get("status") != "passed":
                problems.append(f"{qid}: {solved[qid].get('status')} in solutions/")
            if qid not in attempted:
                problems.append(f"{qid}: its check never ran in exercises/")
            elif attempted[qid].get("status") == "passed":
                problems.append(f"{qid}: passed in the untouched exercises/")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``python -m parlib grade NB [NB ...] [--json FILE] [--timeout S]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--verify-logs"]:
        if len(argv) != 3:
            print("usage: python -m parlib.course.grading --verify-logs SOLUTIONS_LOG "
                  "EXERCISES_LOG", file=sys.stderr)
            return 2
        problems = verify_logs(Path(argv[1]), Path(argv[2]))
        for problem in problems:
            print(f"FAIL {problem}")
        counted = len(read_log(Path(argv[1])))
        print(f"{counted} questions reported in solutions/; {len(problems)} problem(s)")
        return 1 if problems else 0
    parser = argparse.ArgumentParser(
        prog="python -m parlib grade",
        description="Run notebooks headless in a fresh kernel and print a score table.",
    )
    parser.add_argument("notebooks", nargs="+", help="notebooks to grade (NN_*.ipynb)")
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write the reports to this JSON file")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="per-cell time limit in seconds (default 600)")
    args = parser.parse_args(argv)
    missing = [n for n in args.notebooks if not Path(n).is_file()]
    if missing:
        print(f"no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    reports = []
    for nb in args.notebooks:
        rep = grade(Path(nb), timeout=args.timeout)
        reports.append(rep)
        print(format_report(rep), flush=True)
    total = sum(r["score"] for r in reports)
    maximum = sum(r["max_score"] for r in reports)
    if len(reports) > 1:
        print(f"total over {len(reports)} notebooks: "
              f"{fmt_points(total)}/{fmt_points(maximum)}")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"notebooks": reports, "score": total, "max_score": maximum},
                       indent=1) + "\n", encoding="utf-8")
    return 1 if any(r["error"] for r in reports) else 0


__all__ = ["NOT_ATTEMPTED", "NOT_RUN", "format_report", "grade", "main"]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
