"""What a check returns: a verdict per question, and the score table of a session."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

PASSED = "passed"
FAILED = "failed"
NOT_ATTEMPTED = "not attempted"
ERROR = "error"
STATUSES = (PASSED, FAILED, NOT_ATTEMPTED, ERROR)


class CheckFailed(Exception):
    """Raised by a grader: the message names the first failing case and gives a hint."""


class CheckError(AssertionError):
    """Raised by :func:`parlib.check` in ``strict`` / ``expect-fail`` mode (never by default)."""


class NotAttempted(Exception):
    """The answer is still a stub."""


class LearnerError(Exception):
    """The learner's code raised; carries the traceback trimmed to their own frames."""

    def __init__(self, message: str, tb: str) -> None:
        super().__init__(message)
        self.tb = tb


@dataclass
class CheckResult:
    """The outcome of one :func:`check` call."""

    question_id: str
    status: str
    score: float = 0.0
    max_score: float = 1.0
    message: str = ""
    traceback: str = ""
    # the name of the diagnosis that gave the verdict, when the question names its mistakes
    diagnosis: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __bool__(self) -> bool:
        return self.passed

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.question_id,
            "status": self.status,
            "score": self.score,
            "max_score": self.max_score,
            "message": self.message,
        }

    def _headline(self) -> str:
        pts = f"{fmt_points(self.score)}/{fmt_points(self.max_score)}"
        qid = self.question_id
        if self.status == PASSED:
            return f"[passed] {qid} ({pts}). See the working: parlib.explain({qid!r})"
        if self.status == NOT_ATTEMPTED:
            return f"[not attempted] {qid} ({pts}): {self.message}"
        return f"[{self.status}] {qid} ({pts}): {self.message}"

    def __repr__(self) -> str:
        text = self._headline()
        if self.traceback:
            text += "\n" + self.traceback.rstrip()
        return text

    __str__ = __repr__

    def _repr_html_(self) -> str:
        colour = {
            PASSED: "#2e7d32",
            FAILED: "#c62828",
            ERROR: "#c62828",
            NOT_ATTEMPTED: "#6d6d6d",
        }[self.status]
        body = html.escape(self._headline()).replace("\n", "<br>")
        out = f'<div><span style="color:{colour};font-weight:bold">{body}</span>'
        if self.traceback:
            out += f"<pre>{html.escape(self.traceback.rstrip())}</pre>"
        return out + "</div>"


def fmt_points(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


@dataclass
class Summary:
    """Score table of the checks run in this process."""

    rows: list[CheckResult] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(r.score for r in self.rows)

    @property
    def max_score(self) -> float:
        return sum(r.max_score for r in self.rows)

    def __repr__(self) -> str:
        if not self.rows:
            return "No checks run yet."
        w = max(len(r.question_id) for r in self.rows)
        lines = [f"{'question':<{w}}  {'status':<13}  score"]
        for r in self.rows:
            lines.append(f"{r.question_id:<{w}}  {r.status:<13}  "
                         f"{fmt_points(r.score)}/{fmt_points(r.max_score)}")
        lines.append(f"{'total':<{w}}  {'':<13}  "
                     f"{fmt_points(self.score)}/{fmt_points(self.max_score)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>No checks run yet.</p>"
        rows = "".join(
            f"<tr><td>{html.escape(r.question_id)}</td><td>{html.escape(r.status)}</td>"
            f"<td>{fmt_points(r.score)}/{fmt_points(r.max_score)}</td></tr>"
            for r in self.rows
        )
        return (
            "<table><tr><th>question</th><th>status</th><th>score</th></tr>"
            f"{rows}<tr><td><b>total</b></td><td></td>"
            f"<td><b>{fmt_points(self.score)}/{fmt_points(self.max_score)}</b></td></tr>"
            "</table>"
        )


__all__ = ["CheckError", "CheckFailed", "CheckResult", "Summary"]
