"""Running a learner's function on ranks for a check: what a rank's failure means.

A question's grader launches the learner's function with ``parlib.launch`` and the
question's timeout. When a rank fails, :func:`verdict_from_rank_error` reads the
:class:`RankError` (by its ``exc_type`` and traceback) and turns it into a verdict: a stub
(``NotImplementedError``) is "not attempted", a hang is a failure with a hint, a
:class:`CheckFailed` raised on a rank is that failure, anything else is the learner's
error with their own frames.
"""

from __future__ import annotations

from parlib.course.question_types import DEFAULT_TIMEOUT_HINT
from parlib.course.results import CheckFailed, LearnerError, NotAttempted
from parlib.runtime.errors import RankError, trim_traceback


def verdict_from_rank_error(err: RankError, timeout: float | None,
                            timeout_hint: str = DEFAULT_TIMEOUT_HINT) -> Exception:
    """Turn a rank's failure into NotAttempted / CheckFailed / LearnerError.

    ``timeout_hint`` (the question's) says what usually makes that function hang."""
    exc_type = err.exc_type or ""
    rank = err.rank
    remote = err.remote_traceback or ""
    where = f"rank {rank}" if rank is not None else "a rank"
    if exc_type == "NotImplementedError":
        return NotAttempted()
    if exc_type.lower() in ("timeout", "timeouterror"):
        t = f" after {timeout:g} s" if timeout else ""
        return CheckFailed(f"your function did not finish{t} ({where} was still waiting): "
                           f"{timeout_hint}")
    if exc_type == "Exited" and "SIGABRT" in str(err):
        return CheckFailed(
            f"{where} crashed inside gloo (SIGABRT). This usually means a send and its "
            f"matching recv used tensors of different sizes (see the rank's message above): "
            f"check which chunk each rank sends and receives at each step"
        )
    if exc_type in ("CheckFailed",):
        last = remote.strip().splitlines()[-1] if remote.strip() else str(err)
        return CheckFailed(last.split(": ", 1)[-1])
    first = str(err).strip().splitlines()[0] if str(err).strip() else exc_type
    last = first.split(" failed: ", 1)[1] if " failed: " in first else first
    tb = trim_traceback(remote) if remote.strip() else ""
    if not tb.rstrip().endswith(last):
        tb = (tb.rstrip() + "\n" + last).strip()
    return LearnerError(f"your function raised on {where}: {last}", tb)


__all__ = ["verdict_from_rank_error"]
