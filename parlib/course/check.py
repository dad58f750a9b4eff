"""``parlib.check`` and ``parlib.explain``: the auto-checks the exercise notebooks call.

A chapter declares its questions in ``parlib/course/questions/chNN`` (a module, or a
package of one module per exercise) with :func:`parlib.course.registry.register`. A
notebook answers one with ``parlib.check("00.ring_bytes", my_answer)``, which returns a
:class:`CheckResult` that renders as one short line (pass) or the first failing case and a
hint (fail).
``parlib.explain(id)`` shows the worked answer once the question has been attempted.

``check`` never raises unless asked to through the environment:

* ``PARLIB_CHECK_MODE=strict``: raise :class:`CheckError` on anything but a pass (CI on
  ``solutions/``);
* ``PARLIB_CHECK_MODE=expect-fail``: raise :class:`CheckError` if a check passes (CI on the
  untouched ``exercises/``);
* ``PARLIB_CHECK_LOG=/path/file.jsonl``: append one JSON line per check: the verdict and
  the answer as plain data (for a function, its source bundle; see
  :mod:`parlib.course.answers`). ``python -m parlib grade`` ignores the verdict and
  re-checks the answer in its own process (:func:`recheck`); CI's ``--verify-logs`` reads
  the verdicts of its own solutions.

Every answer but a function is judged as plain data (:func:`~parlib.course.answers.to_plain`
then ``from_plain``), here as in the grader, so the verdict a learner sees is the one the
grader will give; a function is run as it is here, and from its source in the grader.

Graders of :class:`~parlib.course.question_types.Implementation` questions receive the
learner's function and raise :class:`CheckFailed` with a learner-facing message on the
first failing case. They call ``parlib.launch`` themselves with
:func:`~parlib.course.question_types.current_timeout` as its ``timeout``; a
:class:`RankError` from it becomes a verdict (:mod:`parlib.course.on_ranks`).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

from parlib.course.answers import capture_function, from_plain, to_plain
from parlib.course.on_ranks import verdict_from_rank_error
from parlib.course.question_types import DEFAULT_TIMEOUT_HINT, Question, _current_timeout
from parlib.course.registry import get_question, unknown_id_message
from parlib.course.results import (
    ERROR,
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    CheckError,
    CheckFailed,
    CheckResult,
    LearnerError,
    NotAttempted,
    Summary,
)
from parlib.runtime.errors import RankError, trim_traceback

MODE_ENV = "PARLIB_CHECK_MODE"
LOG_ENV = "PARLIB_CHECK_LOG"

_SESSION: dict[str, CheckResult] = {}


def _evaluate(question: Question, answer: Any, timeout: float | None) -> CheckResult:
    qid, pts = question.id, question.points
    t = timeout if timeout is not None else (question.timeout or 120.0)
    token = _current_timeout.set(t)
    try:
        try:
            question.grade(answer)
        except RankError as exc:  # a rank failed: what does that say about the answer?
            hint = getattr(question, "timeout_hint", DEFAULT_TIMEOUT_HINT)
            raise verdict_from_rank_error(exc, t, hint) from None
    except NotAttempted:
        hint = {
            "function": "replace raise NotImplementedError(...) with your code",
        }.get(question.kind, "replace the ... with your answer")
        return CheckResult(qid, NOT_ATTEMPTED, 0, pts, f"{hint}, then run this cell again")
    except CheckFailed as exc:
        return CheckResult(qid, FAILED, 0, pts, str(exc),
                           diagnosis=getattr(exc, "diagnosis", ""))
    except LearnerError as exc:
        return CheckResult(qid, ERROR, 0, pts, str(exc), exc.tb)
    except NotImplementedError:
        return CheckResult(qid, NOT_ATTEMPTED, 0, pts,
                           "your function still raises NotImplementedError: write its body, "
                           "then run this cell again")
    except RecursionError as exc:
        return CheckResult(qid, ERROR, 0, pts, f"your function raised {exc!r}",
                           trim_traceback(exc))
    except Exception as exc:  # noqa: BLE001 - the learner's code raised: report it
        tb = trim_traceback(exc)
        last = tb.strip().splitlines()[-1] if tb.strip() else repr(exc)
        return CheckResult(qid, ERROR, 0, pts, f"your answer raised {last}", tb)
    finally:
        _current_timeout.reset(token)
    return CheckResult(qid, PASSED, pts, pts, "correct")


def answer_payload(question: Question | None, answer: Any) -> Any:
    """The answer as plain JSON data: a function's source bundle, anything else
    :func:`~parlib.course.answers.to_plain`."""
    if question is not None and question.kind == "function" and callable(answer):
        return capture_function(answer)
    return to_plain(answer)


def recheck(question: Question, payload: Any, *, timeout: float | None = None) -> CheckResult:
    """Judge an answer collected from a notebook (plain data) in this process; the score
    is clamped to the question's points. Never raises (but KeyboardInterrupt)."""
    try:
        value = from_plain(payload)
        result = _evaluate(question, value, timeout)
        if result.status == ERROR and "NameError" in result.message:
            missing = getattr(value, "missing", None) or {}
            names = [n for n in missing if repr(n) in result.message]
            if names:
                result.message += (f" (the grader rebuilds your function from its source; "
                                   f"{names[0]}, a {missing[names[0]]} defined elsewhere in "
                                   f"the notebook, cannot be carried over: define it inside "
                                   f"the function)")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - one bad answer must not stop the batch
        result = CheckResult(question.id, ERROR, 0, question.points,
                             f"the grader could not judge this answer "
                             f"({type(exc).__name__}: {exc})")
    result.max_score = question.points
    result.score = min(max(float(result.score), 0.0), float(question.points)) \
        if result.status == PASSED else 0
    return result


def check(question_id: str, answer: Any, *, timeout: float | None = None) -> CheckResult:
    """Check ``answer`` against question ``question_id`` and return a :class:`CheckResult`.

    Never raises unless ``PARLIB_CHECK_MODE`` is ``strict`` or ``expect-fail``.
    ``timeout`` overrides the question's time limit for launches (seconds).
    """
    payload: Any = None
    try:
        try:
            question = get_question(question_id)
        except (KeyError, TypeError):
            result = CheckResult(str(question_id), ERROR, 0, 0, unknown_id_message(question_id))
        else:
            if question.kind != "function":
                answer = from_plain(to_plain(answer))  # judged as plain data, as when graded
            if os.environ.get(LOG_ENV):
                payload = answer_payload(question, answer)
            result = _evaluate(question, answer, timeout)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a bug in a grader must not crash the notebook
        result = CheckResult(str(question_id), ERROR, 0, 1,
                             f"the checker itself failed ({type(exc).__name__}: {exc}); "
                             f"please report this")
    _record(result, payload)
    mode = os.environ.get(MODE_ENV, "").strip().lower()
    if mode == "strict" and not result.passed:
        raise CheckError(f"strict mode: {result!r}")
    if mode in ("expect-fail", "expect_fail") and result.passed:
        raise CheckError(f"expect-fail mode: a check passed: {result!r}")
    return result


def _record(result: CheckResult, payload: Any = None) -> None:
    _SESSION[result.question_id] = result
    path = os.environ.get(LOG_ENV)
    if path:
        try:
            line = json.dumps({**result.to_json(), "answer": payload}, sort_keys=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except (OSError, ValueError, TypeError, RecursionError) as exc:  # never raise
            warnings.warn(f"parlib: could not write the check log {path}: {exc}")


def _summary() -> Summary:
    """Score table of the checks run so far in this process (latest result per question)."""
    return Summary(list(_SESSION.values()))


def _reset() -> None:
    """Forget this process's check results (tests)."""
    _SESSION.clear()


check.summary = _summary  # type: ignore[attr-defined]
check.reset = _reset  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- explain


def explain(question_id: str, *, force: bool = False) -> None:
    """Show the worked answer of a question (markdown), once it has been attempted.

    In a notebook the working is displayed; elsewhere it is printed. Pass ``force=True``
    to see it without attempting the question first.
    """
    try:
        q = get_question(question_id)
    except (KeyError, TypeError):
        text = unknown_id_message(question_id)
    else:
        tried = _SESSION.get(q.id)
        if not force and (tried is None or tried.status == NOT_ATTEMPTED):
            text = (f"Try question {q.id} first: call parlib.check({q.id!r}, your_answer), "
                    f"then run parlib.explain({q.id!r}) again "
                    f"(or parlib.explain({q.id!r}, force=True)).")
        else:
            text = f"**Working for {q.id}**\n\n{q.working}"
    if _in_ipython():
        from IPython.display import Markdown, display

        display(Markdown(text))
        return
    print(text)
    return


def _in_ipython() -> bool:
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    try:
        shell = ip.get_ipython()
    except Exception:  # noqa: BLE001
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


__all__ = ["answer_payload", "check", "explain", "recheck"]
