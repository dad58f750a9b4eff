"""``python -m parlib grade NB [NB ...] [--json FILE]``: run notebooks headless and score them.

Each notebook is graded in its own grader process (``--one``, started through
:mod:`parlib.course.boot`: ``python -I -B -S``, the grader imported only from the sources
the batch hashed when it started), inside its own bubblewrap sandbox where ``bwrap`` works
(:mod:`parlib.course.sandbox`; ``--no-sandbox`` opts out, and the row and the summary say
so), so a notebook that kills or wedges that process costs only
its own row. There it runs top to bottom in a fresh kernel (the current environment's
``python3`` kernel) with ``PARLIB_CHECK_LOG`` pointing at a temporary file and
``PARLIB_CHECK_MODE`` unset. The notebook only *collects* answers: every ``parlib.check``
call appends the answer as plain data (a function as its source) to that log. When the
kernel has gone (and, in the sandbox, every process it left), the grader process re-checks
each answer with its own registry (:func:`recheck`); a function runs only on ranks, child
processes. The verdicts and scores the notebook wrote are ignored. The report lists every
question the notebook's chapter declares (the ``NN`` of its name ``NN_*.ipynb``), each
once, in the order the notebook's cells name them, and only those count: a question
whose check never ran is "not run", an answer to another chapter's question is ignored.

Every notebook becomes a row whatever happens to it (missing, unreadable, stopped with
an error, past a time limit, kernel or grader process killed, grading interrupted). The
limits (per cell, per re-check, per notebook) are kept by the batch grader, outside the
notebook's processes. The grader process reports to the batch on a pipe the batch handed
it (:mod:`parlib.course.channel`), read as capped JSON data; what it and the notebook
print goes to the row's "output", never to the batch's terminal, and every text in a row
is capped at :data:`TEXT_LIMIT` characters. ``--json`` is rewritten (atomically) after
each notebook, so a crash loses at most the notebook in progress. The table shows each
hint whole, wrapped, or cut past :data:`HINT_LINES` lines with a pointer to ``--json``;
nothing the re-checks' ranks print reaches it. What this does and does not protect
against: README, "For instructors".

Exit status: 0 when every notebook ran to the end, 1 when one did not (its row says
why), 2 for a usage error, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from parlib.course.boot import CHANGED
from parlib.course.channel import Channel, Output
from parlib.course.check import LOG_ENV, MODE_ENV, recheck
from parlib.course.ci_logs import chapter_of, read_log
from parlib.course.registry import questions
from parlib.course.results import NOT_ATTEMPTED, fmt_points
from parlib.course.sandbox import (
    COURSE,
    Limits,
    become_subreaper,
    bwrap,
    course_digest,
    descendants,
    grader_command,
    kill_descendants,
    kill_others_in_namespace,
    sandboxed,
    stop,
    watch,
)

NOT_RUN = "not run"
SANDBOXED = "each notebook was graded in its own bubblewrap sandbox"
NOT_SANDBOXED = ("WARNING: graded WITHOUT a sandbox ({why}): a notebook could read or change "
                 "files of this user while it ran; see the README, 'For instructors'")
COURSE_CHANGED = ("the grader's files changed on disk since the batch started (did a notebook "
                  "edit them?): not graded")
LOG_DELETED = ("the notebook deleted its check log, so none of its answers could be read: "
               "every question scores 0")
TEXT_LIMIT = 2000  # characters of any message, error or output in a row
INVALID = "invalid"


def cap(text: str, limit: int = TEXT_LIMIT, keep_end: bool = False) -> str:
    """``text`` cut to about ``limit`` characters (its start, or with ``keep_end`` its
    end), saying that it was cut and how long it was."""
    if len(text) <= limit:
        return text
    note = f" [cut: {len(text)} characters in all]"
    return note.strip() + " " + text[-limit:] if keep_end else text[:limit] + note


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


def _row(qid: str, status: str, score: float, max_score: float, message: str) -> dict[str, Any]:
    return {"id": qid, "status": status, "score": score, "max_score": max_score,
            "message": message}


def recheck_log(log: Path, chapter: str | None, *, deleted: bool = False,
                timeout: float | None = None, progress: TextIO | None = None
                ) -> list[dict[str, Any]]:
    """One row per question the chapter declares, each once; an answer in the log to
    another chapter's question is ignored (it counts in that chapter's notebook only). Each
    answer is judged here by :func:`recheck`; the log's own verdicts are ignored. With
    ``progress`` (the channel to the batch grader), a line is sent before and after each
    re-check, so the batch grader can stop one that runs past its limit and keep the rows
    already done."""
    declared = questions(chapter) if chapter else {}
    answers = {} if deleted else read_log(log)
    rows = []
    for qid, q in declared.items():
        line = answers.get(qid)
        if line is None or "answer" not in line:
            why = LOG_DELETED if deleted else "this check never ran"
            rows.append(_row(qid, NOT_RUN, 0, q.points, why))
        else:
            _progress(progress, {"start": qid})
            result = recheck(q, line["answer"], timeout=timeout)
            rows.append(_row(qid, result.status, result.score, q.points,
                             cap(str(result.message))))
        _progress(progress, {"row": rows[-1]})
    return rows


def _progress(channel: TextIO | None, item: dict[str, Any]) -> None:
    if channel is not None:
        channel.write(json.dumps(item) + "\n")
        channel.flush()


def report_for(path: Path, rows: list[dict[str, Any]], error: str | None,
               seconds: float, sandboxed: bool | None = None,
               output: str | None = None) -> dict[str, Any]:
    """A notebook's row of the batch: the questions of its own chapter only, each once (the
    first row for it), scores clamped to each question's points (one that is not a finite
    number scores 0, marked invalid), every text capped at :data:`TEXT_LIMIT` characters;
    ``output``, what its grader process printed, is kept (its end) under "output"."""
    own = questions(chapter_of(path)) if chapter_of(path) else {}
    clean, seen = [], set()
    for r in rows:
        q = own.get(str(r.get("id")))
        if q is None or q.id in seen:
            continue
        seen.add(q.id)
        clean.append(_clean_row(q.id, r, float(q.points)))
    order = {qid: i for i, qid in enumerate(notebook_order(path, own))}
    clean.sort(key=lambda r: (order.get(r["id"], len(order)), r["id"]))  # the rest by id
    report = {
        "notebook": str(path),
        "chapter": chapter_of(path),
        "error": None if error is None else cap(str(error)),
        "seconds": round(seconds, 1),
        "sandboxed": sandboxed,
        "questions": clean,
        "score": sum(r["score"] for r in clean),
        "max_score": sum(r["max_score"] for r in clean),
    }
    if output is not None:
        report["output"] = cap(output, keep_end=True)
    return report


def _clean_row(qid: str, row: dict[str, Any], points: float) -> dict[str, Any]:
    """``row`` as data: its score a finite number within ``points`` (else 0, and the row
    marked invalid), its status and message strings, capped."""
    status, message = cap(str(row.get("status")), 40), cap(str(row.get("message") or ""))
    try:
        score = float(row.get("score") or 0)
    except (TypeError, ValueError, OverflowError):
        score = math.nan
    if not math.isfinite(score):
        status, message = INVALID, f"the grader reported a score that is not a finite number " \
                                   f"({cap(repr(row.get('score')), 40)}): it counts 0"
        score = 0.0
    return _row(qid, status, min(max(score, 0.0), points), points, message)


_QUOTED_ID = re.compile(r"""["'](\d\d\.[A-Za-z0-9_]+)["']""")


def notebook_order(path: Path, declared: dict[str, Any]) -> list[str]:
    """The ``declared`` question ids in the order the notebook's code cells first name them
    (``parlib.check("00.ring_bytes", ...)``): the order a learner meets them. Empty when
    the notebook cannot be read."""
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8")).get("cells", [])
        sources = ["".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code"]
    except (OSError, ValueError, AttributeError, TypeError):
        return []
    seen: dict[str, None] = {}
    for src in sources:
        seen.update((qid, None) for qid in _QUOTED_ID.findall(src) if qid in declared)
    return list(seen)


def _failed_report(path: Path, error: str, seconds: float = 0.0) -> dict[str, Any]:
    chapter = chapter_of(Path(path))
    rows = [_row(qid, NOT_RUN, 0, q.points, "the notebook was not graded")
            for qid, q in (questions(chapter) if chapter else {}).items()]
    return report_for(Path(path), rows, error, seconds)


def grade(path: Path, timeout: float = 600.0,
          progress: TextIO | None = None) -> dict[str, Any]:
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
        kill_others_in_namespace()  # in the sandbox: the notebook's leftovers, before judging
        deleted = not log.exists()
        if deleted:
            error = f"{error}; {LOG_DELETED}" if error else LOG_DELETED
        with _quiet():  # parlib's launch banner and the ranks' output: not the table's
            rows = recheck_log(log, chapter_of(path), deleted=deleted, progress=progress)
    return report_for(path, rows, error, time.monotonic() - t0)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` to /dev/null meanwhile: what a learner's function
    prints on its ranks during a re-check (its verdict says what went wrong); an
    exception still propagates, and is printed once the streams are back."""
    with open(os.devnull, "w", encoding="utf-8") as null, \
            contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


HINT_LINES = 6  # at most this many lines of a hint; --json holds it whole


def format_report(rep: dict[str, Any], json_path: str | None = None,
                  width: int | None = None) -> str:
    """A notebook's rows as a table, in the order the notebook asks its questions; a hint
    is wrapped under its column to ``width`` (default: the terminal's, 120 when not a
    terminal), and a very long one cut with a pointer to ``--json`` (``json_path`` when it
    was given)."""
    width = width or max(80, shutil.get_terminal_size((120, 24)).columns)
    lines = [f"{rep['notebook']}  ({_chapter_name(rep['chapter'])})"]
    rows = rep["questions"]
    w = max([len(r["id"]) for r in rows] + [8])
    for r in rows:
        pts = f"{fmt_points(float(r['score'] or 0))}/{fmt_points(float(r['max_score'] or 0))}"
        head = f"  {r['id']:<{w}}  {r['status']:<13}  {pts:>7}  "
        msg = (r.get("message") or "") if r["status"] != "passed" else ""
        hint = _wrap(msg, max(40, width - len(head)), json_path)
        lines.append((head + hint[0]).rstrip())
        lines.extend(" " * len(head) + more for more in hint[1:])
    if not rows:
        lines.append("  (no questions declared for this chapter, and no checks ran)")
    total = f"{fmt_points(rep['score'])}/{fmt_points(rep['max_score'])}"
    lines.append(f"  {'total':<{w}}  {'':<13}  {total:>7}")
    if rep["error"]:
        lines.append(f"  ERROR: {rep['error']}")
    if rep.get("sandboxed") is False:
        lines.append("  graded without a sandbox")
    return _CONTROL.sub(_escaped, "\n".join(lines))


# control characters (but tab and newline): a notebook's text must not move the cursor, set the
# terminal's title or clear the rows above it
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escaped(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def _wrap(message: str, width: int, json_path: str | None) -> list[str]:
    """``message`` in lines of ``width``, at most :data:`HINT_LINES` of them: a longer one
    ends with where to read it whole."""
    lines = [part for para in message.splitlines() or [""]
             for part in textwrap.wrap(para, width) or [""]]
    if len(lines) <= HINT_LINES:
        return lines
    where = f"in {json_path}" if json_path else "with --json FILE"
    return lines[:HINT_LINES - 1] + [f"[cut after {HINT_LINES - 1} lines: read it whole {where}]"]


def _write_json(path: Path, reports: list[dict[str, Any]], complete: bool) -> None:
    """Write the batch atomically (a temp file in the same folder, then os.replace); if the
    path has become something else (a folder), write next to it and say so."""
    try:
        _write_json_at(Path(path), reports, complete)
    except OSError as exc:
        other = Path(path).with_name(f"{Path(path).name}.{os.getpid()}.json")
        print(f"could not write {path} ({exc}): wrote {other} instead", file=sys.stderr)
        _write_json_at(other, reports, complete)


def _write_json_at(path: Path, reports: list[dict[str, Any]], complete: bool) -> None:
    data = {"notebooks": reports, "complete": complete,
            "score": sum(r["score"] for r in reports),
            "max_score": sum(r["max_score"] for r in reports)}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _grade_one(path: Path, limits: Limits, sandbox: bool, digest: str) -> dict[str, Any]:
    """Grade one notebook in a child grader process (in bwrap with ``sandbox``); a row
    whatever happens to it. The limits are kept here: past one, the child's whole process
    tree is killed and the rows it finished are kept. The child reports on a pipe of ours
    (:mod:`parlib.course.channel`); what it prints goes to the row, not to our terminal."""
    t0 = time.monotonic()
    if not Path(path).is_file():  # no process to start for that
        return _failed_report(path, "no such notebook (missing, or deleted before its turn)")
    with tempfile.TemporaryDirectory(prefix="parlib-grade-") as tmp, \
            Channel.pipe() as channel, Output.pipe() as output:
        cmd = grader_command(digest, [
            "--one", str(Path(path).resolve()), "--channel", str(channel.write_fd),
            "--timeout", repr(limits.cell), "--digest", digest])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(COURSE.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                os.pathsep) if p])}
        if sandbox:
            cmd = sandboxed(cmd, Path(tmp), (Path(path).resolve().parent,), env)
        ours = set() if sandbox else descendants()  # the caller's own processes, spared
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=output.write_fd,
                                stderr=subprocess.STDOUT, pass_fds=(channel.write_fd,),
                                start_new_session=True, env=env)
        channel.close_write()  # the child's ends only: each pipe ends when its writers do
        output.close_write()
        stopped = None
        try:
            stopped = watch(proc, channel, limits, t0, output)
        except BaseException:  # interrupted: stop the child and its kernel, then say so
            stop(proc, gently=True)
            raise
        finally:
            if proc.poll() is None:
                stop(proc)
            if not sandbox:
                kill_descendants(ours)  # whatever the notebook left running, detached or not
            channel.drain()
            output.drain()
        return _row_of(path, proc.returncode, channel, stopped, sandbox, output.text(),
                       time.monotonic() - t0)


def _row_of(path: Path, code: int, channel: Channel, stopped: tuple[str, str | None] | None,
            sandbox: bool, output: str, seconds: float) -> dict[str, Any]:
    """The row from what the child sent: its rows so far when it was stopped, else its
    report; it died when it sent none."""
    if stopped is not None:
        rows = channel.rows() + _stopped_rows(path, stopped[1])
        return report_for(Path(path), rows, stopped[0], seconds, sandbox, output)
    rep = channel.report()
    try:
        return report_for(Path(path), rep["questions"], rep["error"], seconds, sandbox,
                          output)
    except (ValueError, KeyError, TypeError, AttributeError):
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        error = (COURSE_CHANGED if code == CHANGED  # its bootstrap refused: see boot.py
                 else f"the grader's process for this notebook died ({how}) before it "
                      f"reported: did the notebook kill it?")
        rep = _failed_report(path, error, seconds)
        rep.update(sandboxed=sandbox, output=cap(output, keep_end=True))
        return rep


def _chapter_name(number: str | None) -> str:
    """ "the launching chapter" for "00" (the course names chapters, never numbers them)."""
    from parlib.chapters import chapter

    try:
        return chapter(number).name if number else "no chapter in its name"
    except KeyError:
        return f"no chapter numbered {number}"


def _stopped_rows(path: Path, current: str | None) -> list[dict[str, Any]]:
    chapter = chapter_of(Path(path))
    rows = []
    for qid, q in (questions(chapter) if chapter else {}).items():
        why = ("its re-check ran past the time limit" if qid == current
               else "not graded: the notebook was stopped at its time limit")
        rows.append(_row(qid, "timed out" if qid == current else NOT_RUN, 0, q.points, why))
    return rows


def _one(argv: list[str]) -> int:
    """``--one NB --channel FD``: the child that grades a single notebook and reports on
    the pipe ``FD`` the batch grader gave it (see :mod:`parlib.course.channel`)."""
    parser = argparse.ArgumentParser(prog="python -m parlib.course.grading --one")
    parser.add_argument("--one", required=True)
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--digest", default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    os.set_inheritable(args.channel, False)  # the kernel the notebook runs in never has it
    not_dumpable()
    with os.fdopen(args.channel, "w", encoding="utf-8") as channel:
        if args.digest and course_digest() != args.digest:
            rep = _failed_report(Path(args.one), COURSE_CHANGED)
        else:
            questions()  # the registry is loaded before any of the notebook's code runs
            signal_to_interrupt()
            rep = grade(Path(args.one), timeout=args.timeout, progress=channel)
        _progress(channel, {"report": rep})
    return 0


def not_dumpable() -> None:
    """Mark this process not dumpable (Linux): another process of the same user, without
    CAP_SYS_PTRACE (dropped in the sandbox), can then neither trace it, read its memory nor
    open its file descriptors through /proc (the channel among them); the kernel, a new
    program, is dumpable again."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def signal_to_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt, so nbclient shuts the kernel down on the way out."""
    def handler(signum, frame):  # noqa: ANN001, ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m parlib grade NB [NB ...] [--json FILE] [--timeout S] [--no-sandbox]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--verify-logs"]:
        again = "--recheck" in argv
        argv = [a for a in argv if a != "--recheck"]
        if len(argv) != 3:
            print("usage: python -m parlib.course.grading --verify-logs SOLUTIONS_LOG "
                  "EXERCISES_LOG [--recheck]", file=sys.stderr)
            return 2
        from parlib.course.ci_logs import verify_logs

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
    parser.add_argument("--notebook-timeout", type=float, default=1800.0,
                        help="limit for a notebook and all its re-checks (default 1800 s)")
    parser.add_argument("--question-timeout", type=float, default=None,
                        help="limit for one re-check (default: 30 s plus twice the "
                             "question's own launch limit)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="grade without bubblewrap (each row says so)")
    args = parser.parse_args(argv)
    paths = [Path(n) for n in args.notebooks]
    limits = Limits(args.timeout, args.notebook_timeout, args.question_timeout)
    sandbox = not args.no_sandbox and bwrap() is not None
    if not sandbox:
        become_subreaper()  # a notebook's detached processes still come back to us
    digest = course_digest()  # the question modules as they were before any notebook ran
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
            reports[i] = _grade_one(path, limits, sandbox, digest)
        except KeyboardInterrupt:
            interrupted = True
            reports[i] = _failed_report(path, "grading was interrupted while this notebook ran")
            for j in range(i + 1, len(paths)):
                reports[j] = _failed_report(paths[j], "not graded: grading was interrupted")
        print(format_report(reports[i], args.json_path), flush=True)
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
    print(SANDBOXED if sandbox else NOT_SANDBOXED.format(
        why="--no-sandbox was given" if args.no_sandbox else "bwrap (bubblewrap) is not "
        "installed or does not work here"), flush=True)
    if interrupted:
        print("grading was interrupted: the notebooks not graded are marked so", file=sys.stderr)
        return 130
    return 1 if any(r["error"] for r in reports) else 0


__all__ = ["NOT_ATTEMPTED", "NOT_RUN", "format_report", "grade", "main", "recheck_log"]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
