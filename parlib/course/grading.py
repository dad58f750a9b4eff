"""``python -m parlib grade NB [NB ...] [--json FILE]``: run notebooks headless and score them.

Each notebook is graded in its own grader process (``--one``), so a notebook that kills
or wedges that process costs only its own row. There it runs top to bottom in a fresh
kernel (the current environment's ``python3`` kernel, working directory = the notebook's
folder) with ``PARLIB_CHECK_LOG`` pointing at a temporary file and ``PARLIB_CHECK_MODE``
unset. The notebook only *collects* answers: every ``parlib.check`` call appends the
answer as plain data (a function as its source) to that log. When the kernel has gone,
the grader process re-checks each answer with its own registry (:func:`recheck`): the
verdicts and scores the notebook wrote are ignored, and every score is clamped to its
question's points. The report lists every question the chapter declares (the ``NN`` of
the notebook's name ``NN_*.ipynb``): a question whose check never ran is "not run".

Every notebook becomes a row whatever happens to it (missing, unreadable, stopped with
an error, timed out, kernel or grader process killed, grading interrupted). ``--json``
is rewritten (atomically) after each notebook, so a crash loses at most the notebook in
progress. What this does and does not protect against: README, "For instructors".

Exit status: 0 when every notebook ran to the end, 1 when one did not (its row says
why), 2 for a usage error, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from parlib.course.check import LOG_ENV, MODE_ENV, recheck
from parlib.course.registry import questions
from parlib.course.results import NOT_ATTEMPTED, fmt_points

NOT_RUN = "not run"
LOG_DELETED = ("the notebook deleted its check log, so none of its answers could be read: "
               "every question scores 0")


def chapter_of(path: Path) -> str | None:
    m = re.match(r"^(\d\d)_", Path(path).name)
    return m.group(1) if m else None


def execute(path: Path, log: Path, timeout: float = 600.0, nb: Any = None) -> str | None:
    """Run the notebook in a fresh kernel; return None, or a description of the error."""
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    if nb is None:
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
    """Latest line per question id from a check log (unreadable lines are skipped)."""
    latest: dict[str, dict[str, Any]] = {}
    if not log.exists():
        return latest
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(row, dict) and "id" in row:
            latest[str(row["id"])] = row
    return latest


def _row(qid: str, status: str, score: float, max_score: float, message: str) -> dict[str, Any]:
    return {"id": qid, "status": status, "score": score, "max_score": max_score,
            "message": message}


def recheck_log(log: Path, chapter: str | None, *, deleted: bool = False,
                timeout: float | None = None) -> list[dict[str, Any]]:
    """One row per question: declared by the chapter, or answered in the log and known to
    the registry. Each answer is judged here by :func:`recheck`; the log's own verdicts
    are ignored."""
    declared = questions(chapter) if chapter else {}
    known = questions()
    answers = {} if deleted else read_log(log)
    ids = list(declared) + [q for q in answers if q in known and q not in declared]
    rows = []
    for qid in ids:
        q = known[qid]
        line = answers.get(qid)
        if line is None or "answer" not in line:
            why = LOG_DELETED if deleted else "this check never ran"
            rows.append(_row(qid, NOT_RUN, 0, q.points, why))
            continue
        result = recheck(q, line["answer"], timeout=timeout)
        rows.append(_row(qid, result.status, result.score, q.points, result.message))
    return rows


def report_for(path: Path, rows: list[dict[str, Any]], error: str | None,
               seconds: float) -> dict[str, Any]:
    """A notebook's row of the batch; scores are clamped to each question's points."""
    known = questions()
    clean = []
    for r in rows:
        q = known.get(str(r.get("id")))
        if q is None:
            continue
        try:
            score = min(max(float(r.get("score") or 0), 0.0), float(q.points))
        except (TypeError, ValueError):
            score = 0.0
        clean.append(_row(q.id, str(r.get("status")), score, q.points,
                          str(r.get("message") or "")))
    return {
        "notebook": str(path),
        "chapter": chapter_of(path),
        "error": error,
        "seconds": round(seconds, 1),
        "questions": clean,
        "score": sum(r["score"] for r in clean),
        "max_score": sum(r["max_score"] for r in clean),
    }


def _failed_report(path: Path, error: str, seconds: float = 0.0) -> dict[str, Any]:
    chapter = chapter_of(Path(path))
    rows = [_row(qid, NOT_RUN, 0, q.points, "the notebook was not graded")
            for qid, q in (questions(chapter) if chapter else {}).items()]
    return report_for(Path(path), rows, error, seconds)


def grade(path: Path, timeout: float = 600.0) -> dict[str, Any]:
    """Execute one notebook in this process's kernel, then re-check its answers here;
    return its report (a JSON-able dict). Never raises (but KeyboardInterrupt)."""
    import nbformat

    path = Path(path)
    t0 = time.monotonic()
    if not path.is_file():
        return _failed_report(path, "no such notebook (missing, or deleted before its turn)")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - not JSON, not a notebook, unreadable
        return _failed_report(path, f"the notebook could not be read: {type(exc).__name__}: "
                                    f"{str(exc)[:300]}")
    with tempfile.TemporaryDirectory(prefix="parlib-grade-") as tmp:
        log = Path(tmp) / "checks.jsonl"
        log.touch()
        error = execute(path, log, timeout=timeout, nb=nb)
        deleted = not log.exists()
        if deleted:
            error = f"{error}; {LOG_DELETED}" if error else LOG_DELETED
        rows = recheck_log(log, chapter_of(path), deleted=deleted)
    return report_for(path, rows, error, time.monotonic() - t0)


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


def verify_logs(solutions_log: Path, exercises_log: Path, root: Path = Path("."),
                recheck_answers: bool = False) -> list[str]:
    """CI's proof that the checks ran: every question declared for a chapter that has a
    ``solutions/NN_*.ipynb`` reported in both runs, passed in the solutions run and did not
    pass in the exercises run. With ``recheck_answers`` the logged answers are also judged
    again here, as ``grade`` does (solutions must pass, exercises must not). Returns the
    problems found (empty when all is well)."""
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
            if not recheck_answers:
                continue
            for where, log, want in (("solutions", solved, True), ("exercises", attempted,
                                                                    False)):
                if qid in log and "answer" in log[qid]:
                    r = recheck(declared[qid], log[qid]["answer"])
                    if r.passed != want:
                        problems.append(f"{qid}: re-checked from the {where}/ log: {r!r}")
    return problems


def _write_json(path: Path, reports: list[dict[str, Any]], complete: bool) -> None:
    """Write the batch atomically (a temp file in the same folder, then os.replace)."""
    data = {"notebooks": reports, "complete": complete,
            "score": sum(r["score"] for r in reports),
            "max_score": sum(r["max_score"] for r in reports)}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _grade_one(path: Path, timeout: float) -> dict[str, Any]:
    """Grade one notebook in a child grader process; a row whatever happens to it."""
    t0 = time.monotonic()
    if not Path(path).is_file():  # no process to start for that
        return _failed_report(path, "no such notebook (missing, or deleted before its turn)")
    with tempfile.TemporaryDirectory(prefix="parlib-grade-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "parlib.course.grading", "--one", str(path),
               "--out", str(out), "--timeout", repr(timeout)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait()
        except BaseException:  # interrupted: stop the child and its kernel, then say so
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        try:
            rep = json.loads(out.read_text(encoding="utf-8"))
            return report_for(Path(path), rep["questions"], rep["error"], rep["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            return _failed_report(path, f"the grader's process for this notebook died ({how}) "
                                        f"before it reported: did the notebook kill it?",
                                  time.monotonic() - t0)


def _one(argv: list[str]) -> int:
    """``--one NB --out FILE --timeout S``: the child that grades a single notebook."""
    parser = argparse.ArgumentParser(prog="python -m parlib.course.grading --one")
    parser.add_argument("--one", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    questions()  # the registry is loaded before any of the notebook's code runs
    signal_to_interrupt()
    rep = grade(Path(args.one), timeout=args.timeout)
    Path(args.out).write_text(json.dumps(rep), encoding="utf-8")
    return 0


def signal_to_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt, so nbclient shuts the kernel down on the way out."""
    import signal

    def handler(signum, frame):  # noqa: ANN001, ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m parlib grade NB [NB ...] [--json FILE] [--timeout S]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--verify-logs"]:
        again = "--recheck" in argv
        argv = [a for a in argv if a != "--recheck"]
        if len(argv) != 3:
            print("usage: python -m parlib.course.grading --verify-logs SOLUTIONS_LOG "
                  "EXERCISES_LOG [--recheck]", file=sys.stderr)
            return 2
        problems = verify_logs(Path(argv[1]), Path(argv[2]), recheck_answers=again)
        for problem in problems:
            print(f"FAIL {problem}")
        counted = len(read_log(Path(argv[1])))
        print(f"{counted} questions reported in solutions/; {len(problems)} problem(s)")
        return 1 if problems else 0
    if argv[:1] == ["--one"]:
        return _one(argv)
    parser = argparse.ArgumentParser(
        prog="python -m parlib grade",
        description="Run notebooks headless in a fresh kernel, re-check their answers in the "
                    "grader and print a score table.",
    )
    parser.add_argument("notebooks", nargs="+", help="notebooks to grade (NN_*.ipynb)")
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write the reports to this JSON file (rewritten after "
                             "each notebook)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="per-cell time limit in seconds (default 600)")
    args = parser.parse_args(argv)
    paths = [Path(n) for n in args.notebooks]
    questions()
    reports = [_failed_report(p, "not graded: the grader stopped before this notebook")
               for p in paths]
    if all(not p.is_file() for p in paths):
        print(f"no such notebook: {', '.join(map(str, paths))}", file=sys.stderr)
        if args.json_path:
            reports = [_failed_report(p, "no such notebook") for p in paths]
            _write_json(Path(args.json_path), reports, complete=True)
        return 2
    interrupted = False
    for i, path in enumerate(paths):
        try:
            reports[i] = _grade_one(path, args.timeout)
        except KeyboardInterrupt:
            interrupted = True
            reports[i] = _failed_report(path, "grading was interrupted while this notebook ran")
            for j in range(i + 1, len(paths)):
                reports[j] = _failed_report(paths[j], "not graded: grading was interrupted")
        print(format_report(reports[i]), flush=True)
        if args.json_path:
            done = not interrupted and i == len(paths) - 1
            _write_json(Path(args.json_path), reports, complete=done)
        if interrupted:
            break
    total = sum(r["score"] for r in reports)
    maximum = sum(r["max_score"] for r in reports)
    if len(reports) > 1:
        print(f"total over {len(reports)} notebooks: "
              f"{fmt_points(total)}/{fmt_points(maximum)}")
    if interrupted:
        print("grading was interrupted: the notebooks not graded are marked so", file=sys.stderr)
        return 130
    return 1 if any(r["error"] for r in reports) else 0


__all__ = ["NOT_ATTEMPTED", "NOT_RUN", "format_report", "grade", "main", "recheck_log"]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
