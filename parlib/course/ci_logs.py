"""Check logs: reading one (:func:`read_log`, the grader's too), and CI's proof that the
checks ran in solutions/ and exercises/ (:func:`verify_logs`, run as
``python -m parlib.course.grading --verify-logs``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from parlib.course.check import recheck
from parlib.course.registry import questions


def chapter_of(path: Path) -> str | None:
    m = re.match(r"^(\d\d)_", Path(path).name)
    return m.group(1) if m else None


def read_log(log: Path) -> dict[str, dict[str, Any]]:
    """Latest line per question id from a check log (unreadable lines are skipped)."""
    latest: dict[str, dict[str, Any]] = {}
    if not log.exists():
        return latest
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or an int over Python's digit limit
            continue
        if isinstance(row, dict) and "id" in row:
            latest[str(row["id"])] = row
    return latest


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


__all__ = ["chapter_of", "read_log", "verify_logs"]
