"""Auto-graded questions for the course notebooks: ``parlib.check`` and ``parlib.explain``.

A chapter declares its questions in ``parlib/questions/chNN.py`` with :func:`register`.
A notebook answers one with ``parlib.check("00.ring_bytes", my_answer)``, which returns a
:class:`CheckResult` that renders as one short line (pass) or the first failing case and
a hint (fail). ``parlib.explain(id)`` shows the worked answer once the question has been
attempted.

``check`` never raises unless asked to through the environment:

* ``PARLIB_CHECK_MODE=strict``: raise :class:`CheckError` on anything but a pass (CI on
  ``solutions/``);
* ``PARLIB_CHECK_MODE=expect-fail``: raise :class:`CheckError` if a check passes (CI on the
  untouched ``exercises/``);
* ``PARLIB_CHECK_LOG=/path/file.jsonl``: append one JSON line per check (used by
  ``python -m parlib grade``).

Graders of :class:`Implementation` questions receive the learner's function and raise
:class:`CheckFailed` with a learner-facing message on the first failing case. They may
call ``parlib.launch`` themselves (use :func:`current_timeout` for its ``timeout``) or
:func:`launch_ranks`; a rank that raises ``NotImplementedError`` makes the question
"not attempted", a timeout becomes a failure with a hint about unmatched sends, any other
learner exception an "error" with the traceback trimmed to the learner's own frames.
"""

from __future__ import annotations

import ast
import contextvars
import difflib
import html
import importlib
import inspect
import json
import math
import numbers
import operator
import os
import random
import re
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CheckError",
    "CheckFailed",
    "CheckResult",
    "Choice",
    "Expression",
    "Implementation",
    "Numeric",
    "Question",
    "check",
    "current_timeout",
    "explain",
    "is_stub",
    "launch_ranks",
    "questions",
    "register",
    "trim_traceback",
]

PASSED = "passed"
FAILED = "failed"
NOT_ATTEMPTED = "not attempted"
ERROR = "error"
STATUSES = (PASSED, FAILED, NOT_ATTEMPTED, ERROR)

MODE_ENV = "PARLIB_CHECK_MODE"
LOG_ENV = "PARLIB_CHECK_LOG"


class CheckFailed(Exception):
    """Raised by a grader: the message names the first failing case and gives a hint."""


class CheckError(AssertionError):
    """Raised by :func:`check` in ``strict`` / ``expect-fail`` mode (never by default)."""


class _NotAttempted(Exception):
    """Internal: the answer is still a stub."""


class _LearnerError(Exception):
    """Internal: the learner's code raised; carries the trimmed traceback."""

    def __init__(self, message: str, tb: str) -> None:
        super().__init__(message)
        self.tb = tb


# --------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    """The outcome of one :func:`check` call."""

    question_id: str
    status: str
    score: float = 0.0
    max_score: float = 1.0
    message: str = ""
    traceback: str = ""

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
        pts = f"{_fmt_points(self.score)}/{_fmt_points(self.max_score)}"
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


def _fmt_points(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


# --------------------------------------------------------------------------- stubs


def is_stub(answer: Any) -> bool:
    """True for an unanswered placeholder: ``...``, ``None``, or a function whose body is
    only a docstring, ``pass`` or ``...``."""
    if answer is Ellipsis or answer is None:
        return True
    if callable(answer) and inspect.isfunction(answer):
        return _function_body_is_empty(answer)
    return False


def _function_body_is_empty(fn: Callable) -> bool:
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = list(node.body)
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    return all(
        isinstance(stmt, ast.Pass)
        or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            and stmt.value.value is Ellipsis)
        for stmt in body
    )


# --------------------------------------------------------------------------- tracebacks

_INTERNAL_PATTERNS = (
    os.sep + "torch" + os.sep,
    os.sep + "cloudpickle" + os.sep,
    os.sep + "multiprocessing" + os.sep,
    os.sep + "concurrent" + os.sep,
    os.sep + "IPython" + os.sep,
    os.sep + "ipykernel" + os.sep,
    os.sep + "threading.py",
    os.sep + "runpy.py",
    "<frozen ",
)
_PARLIB_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_internal(filename: str) -> bool:
    if filename.startswith(_PARLIB_DIR + os.sep) or filename == _PARLIB_DIR:
        return True
    # the parlib package seen from a rank (same path, but be lenient about symlinks)
    if re.search(r"[\\/]parlib[\\/][^\\/]+\.py$", filename):
        return True
    return any(p in filename for p in _INTERNAL_PATTERNS)


_FRAME_RE = re.compile(r'^  File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<name>.*)$')


def trim_traceback(tb: str | BaseException) -> str:
    """Keep only the learner's frames of a traceback (text or exception).

    Frames from parlib, torch, cloudpickle, multiprocessing and IPython are dropped; the
    final ``Type: message`` lines are kept. If no learner frame is left the last frame is
    kept so the message still says where it came from.
    """
    if isinstance(tb, BaseException):
        tb = "".join(traceback.format_exception(type(tb), tb, tb.__traceback__))
    lines = tb.rstrip("\n").splitlines()
    # only the last chained traceback matters for the learner
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if starts:
        lines = lines[starts[-1]:]
    header: list[str] = []
    frames: list[tuple[str, list[str]]] = []
    tail: list[str] = []
    i = 0
    if lines and lines[0].startswith("Traceback"):
        header = [lines[0]]
        i = 1
    while i < len(lines):
        m = _FRAME_RE.match(lines[i])
        if m:
            block = [lines[i]]
            i += 1
            while i < len(lines) and lines[i].startswith("    "):
                block.append(lines[i])
                i += 1
            frames.append((m.group("file"), block))
        else:
            tail = lines[i:]
            break
    kept = [b for f, b in frames if not _is_internal(f)]
    if not kept and frames:
        kept = [frames[-1][1]]
    out = header + [ln for b in kept for ln in b] + tail
    return "\n".join(out)


# --------------------------------------------------------------------------- questions


class Question:
    """Base class: ``grade(answer)`` returns ``(score_fraction, message)`` or raises."""

    kind = "question"

    def __init__(self, id: str, *, prompt: str, working: str, points: float = 1) -> None:
        if not re.fullmatch(r"\d\d\.[A-Za-z0-9_]+", id):
            raise ValueError(f"question id must look like '00.ring_bytes', got {id!r}")
        self.id = id
        self.prompt = textwrap.dedent(prompt).strip()
        self.working = textwrap.dedent(working).strip()
        self.points = points
        self.timeout = None

    @property
    def chapter(self) -> str:
        return self.id.split(".", 1)[0]

    def grade(self, answer: Any) -> str:
        """Return a pass message, raise CheckFailed / _NotAttempted otherwise."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


def _as_number(answer: Any, what: str = "a number") -> float:
    """Coerce a learner's answer to float, or raise CheckFailed saying what is wrong."""
    if isinstance(answer, str):
        raise CheckFailed(
            f"you gave the string {answer!r}: give {what}, not a string "
            f"(write 0.5, not '0.5')"
        )
    if isinstance(answer, bool):
        raise CheckFailed(f"you gave {answer!r}: give {what}, not True/False")
    if isinstance(answer, numbers.Real):
        value = float(answer)
    elif hasattr(answer, "shape") and hasattr(answer, "tolist"):  # numpy / torch
        shape = tuple(answer.shape)
        n = 1
        for s in shape:
            n *= s
        if n != 1:
            raise CheckFailed(
                f"you gave an array of shape {shape}: give a single number"
            )
        try:
            value = float(answer.reshape(-1)[0].item())
        except Exception:  # noqa: BLE001 - complex, non-numeric dtype
            raise CheckFailed(
                f"you gave {type(answer).__name__} {answer!r}: give {what}"
            ) from None
    elif isinstance(answer, (list, tuple, set, dict)):
        raise CheckFailed(
            f"you gave a {type(answer).__name__} of {len(answer)} items: give a single number"
        )
    elif isinstance(answer, complex):
        raise CheckFailed(f"you gave the complex number {answer!r}: give a real number")
    else:
        raise CheckFailed(f"you gave a {type(answer).__name__}: give {what}")
    if math.isnan(value) or math.isinf(value):
        raise CheckFailed(f"your answer is {value}: give a finite number")
    return value


# Factors that betray a unit slip (answer / expected)
_FACTOR_HINTS = (
    (2.0, "you are a factor of 2 too high: did you count something twice (send and receive?)"),
    (0.5, "you are a factor of 2 too low: did you leave out one of two phases?"),
    (8.0, "you are 8x too high: the answer is in bytes, not bits"),
    (0.125, "you are 8x too low: the answer is in bytes, not bits"),
    (2**20 / 1e6, "you are 4.9% off: MiB is 2^20 bytes, MB is 10^6 bytes"),
    (1e6 / 2**20, "you are 4.9% off: MiB is 2^20 bytes, MB is 10^6 bytes"),
    (1e3, "you are 1000x too high: check the unit"),
    (1e-3, "you are 1000x too low: check the unit"),
    (1e6, "you are 10^6x too high: check the unit"),
    (1e-6, "you are 10^6x too low: check the unit"),
    (2**20, "you are 2^20x too high: check the unit (bytes vs MiB)"),
    (2.0**-20, "you are 2^20x too low: check the unit (bytes vs MiB)"),
)


class Numeric(Question):
    """A number, compared with ``math.isclose(answer, expected, rel_tol=rtol, abs_tol=atol)``.

    ``unit`` is the unit the answer is given in (a plain number in that unit is expected).
    ``mistakes`` maps known wrong values to hints; they are matched with the same tolerance.
    """

    kind = "number"

    def __init__(self, id, answer, *, prompt, working, rtol=1e-3, atol=0.0, unit=None,
                 mistakes: dict[float, str] | None = None, points=1) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.answer = float(answer)
        self.rtol = rtol
        self.atol = atol
        self.unit = unit
        self.mistakes = dict(mistakes or {})

    def _close(self, a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=self.rtol, abs_tol=self.atol)

    def grade(self, answer):
        if is_stub(answer):
            raise _NotAttempted
        what = f"a number in {self.unit}" if self.unit else "a number"
        value = _as_number(answer, what)
        if self._close(value, self.answer):
            return "correct"
        unit = f" {self.unit}" if self.unit else ""
        for wrong, hint in self.mistakes.items():
            if self._close(value, float(wrong)):
                raise CheckFailed(f"{value:g}{unit} is not right: {hint}")
        if self.answer != 0 and value != 0:
            ratio = value / self.answer
            for factor, hint in _FACTOR_HINTS:
                if math.isclose(ratio, factor, rel_tol=self.rtol):
                    raise CheckFailed(f"{value:g}{unit} is not right: {hint}")
        direction = "too high" if value > self.answer else "too low"
        raise CheckFailed(f"{value:g}{unit} is not right ({direction}); check your working")


class Choice(Question):
    """A letter from ``options`` (case-insensitive; "b", "B", "(b)" all accepted).

    ``hints`` optionally maps wrong letters to a hint.
    """

    kind = "letter"

    def __init__(self, id, answer: str, *, options: dict[str, str], prompt, working,
                 points=1, hints: dict[str, str] | None = None) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.options = {k.strip().upper(): v for k, v in options.items()}
        self.answer = answer.strip().upper()
        if self.answer not in self.options:
            raise ValueError(f"{id}: answer {answer!r} is not one of the options")
        self.hints = {k.strip().upper(): v for k, v in (hints or {}).items()}

    def grade(self, answer):
        if is_stub(answer):
            raise _NotAttempted
        letters = ", ".join(self.options)
        if not isinstance(answer, str):
            raise CheckFailed(f"you gave a {type(answer).__name__}: give one letter as a "
                              f"string, one of {letters}")
        letter = answer.strip().strip("()").strip().upper()
        if letter not in self.options:
            raise CheckFailed(f"{answer!r} is not one of the options: give one letter, "
                              f"one of {letters}")
        if letter == self.answer:
            return "correct"
        hint = self.hints.get(letter, "re-read the options and think about what is exchanged")
        raise CheckFailed(f"{letter} is not right: {hint}")


# Safe evaluation of short formulas for Expression questions
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"log": math.log, "log2": math.log2, "sqrt": math.sqrt, "ceil": math.ceil,
          "floor": math.floor, "min": min, "max": max}


def _eval_expr(node: ast.AST, env: dict[str, float]) -> float:
    if isinstance(node, ast.Expression):
        return _eval_expr(node.body, env)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise CheckFailed(f"unknown name {node.id!r} in your formula: use only "
                              f"{', '.join(sorted(k for k in env if k not in _FUNCS))}")
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_expr(node.left, env), _eval_expr(node.right, env))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval_expr(node.operand, env))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*[_eval_expr(a, env) for a in node.args])
    raise CheckFailed("your formula may use numbers, the variables, + - * / ** and "
                      "parentheses only")


class Expression(Question):
    """A short formula as a string, e.g. ``"(p-1)/(m+p-1)"``, compared with the expected
    formula at random sample points of its ``variables`` (positive integers by default,
    from ``samples`` if given: a list of dicts)."""

    kind = "formula"

    def __init__(self, id, answer: str, *, variables, prompt, working, samples=None,
                 rtol=1e-6, mistakes: dict[str, str] | None = None, points=1) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.answer = answer
        self.variables = list(variables)
        self.rtol = rtol
        if samples is None:
            rng = random.Random(id)
            samples = [{v: rng.randint(2, 64) for v in self.variables} for _ in range(6)]
        self.samples = samples
        self.mistakes = dict(mistakes or {})
        self._parse(answer)  # the expected formula must parse

    def _parse(self, text: str) -> ast.Expression:
        try:
            return ast.parse(text.replace("^", "**").strip(), mode="eval")
        except SyntaxError:
            raise CheckFailed(f"{text!r} is not a formula Python can read "
                              f"(use * for products and ** for powers)") from None

    def _values(self, text: str) -> list[float | None]:
        tree = self._parse(text)
        out = []
        for s in self.samples:
            try:
                out.append(float(_eval_expr(tree, {**_FUNCS, **s})))
            except (ZeroDivisionError, OverflowError, ValueError):
                out.append(None)
        return out

    def _same(self, a: list, b: list) -> bool:
        return all(x is not None and y is not None and math.isclose(x, y, rel_tol=self.rtol)
                   for x, y in zip(a, b))

    def grade(self, answer):
        if is_stub(answer):
            raise _NotAttempted
        if not isinstance(answer, str):
            raise CheckFailed(f"you gave a {type(answer).__name__}: give the formula as a "
                              f"string in {', '.join(self.variables)}, e.g. \"2*(N-1)/N\"")
        got = self._values(answer)
        if self._same(got, self._values(self.answer)):
            return "correct"
        for wrong, hint in self.mistakes.items():
            if self._same(got, self._values(wrong)):
                raise CheckFailed(f"{answer!r} is not right: {hint}")
        s = self.samples[0]
        where = ", ".join(f"{k}={v}" for k, v in s.items())
        exp = self._values(self.answer)[0]
        raise CheckFailed(f"{answer!r} is not right: at {where} it gives {got[0]}, "
                          f"expected {exp:g}")


_current_timeout: contextvars.ContextVar[float] = contextvars.ContextVar(
    "parlib_check_timeout", default=120.0)


def current_timeout() -> float:
    """The timeout (s) the question being checked allows for each launch."""
    return _current_timeout.get()


class Implementation(Question):
    """A function, judged by ``grader(fn)`` which raises :class:`CheckFailed` on the
    first failing case and returns None on a pass."""

    kind = "function"

    def __init__(self, id, grader, *, prompt, working, timeout=120.0, points=1) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.grader = grader
        self.timeout = timeout

    def grade(self, answer):
        if is_stub(answer):
            raise _NotAttempted
        if not callable(answer):
            raise CheckFailed(f"you gave a {type(answer).__name__}: pass the function "
                              f"itself (its name, without calling it)")
        self.grader(answer)
        return "correct"


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Question] = {}
_LOADED = False


def register(question: Question) -> Question:
    """Add a question to the registry (keyed by id) and return it."""
    _REGISTRY[question.id] = question
    return question


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    importlib.import_module("parlib.questions")


def questions(chapter: str | None = None) -> dict[str, Question]:
    """All registered questions (of one chapter, e.g. ``"00"``), ordered by id."""
    _load_all()
    items = sorted(_REGISTRY.items())
    return {k: q for k, q in items if chapter is None or q.chapter == chapter}


def get_question(question_id: str) -> Question:
    _load_all()
    return _REGISTRY[question_id]


def _unknown_id_message(question_id: Any) -> str:
    ids = list(questions())
    if not isinstance(question_id, str):
        return f"the question id must be a string like '00.ring_bytes', got {question_id!r}"
    near = difflib.get_close_matches(question_id, ids, n=5, cutoff=0.5)
    chapter = question_id.split(".", 1)[0]
    same = [i for i in ids if i.startswith(chapter + ".")]
    near += [i for i in same if i not in near]
    msg = f"there is no question {question_id!r}."
    if near:
        msg += " Did you mean: " + ", ".join(near[:8]) + "?"
    else:
        msg += " Known questions: " + ", ".join(ids[:12]) + ("..." if len(ids) > 12 else "")
    return msg


# --------------------------------------------------------------------------- launch helpers


def launch_ranks(fn: Callable, *args: Any, world_size: int, **kwargs: Any) -> list:
    """``parlib.launch`` with the timeout of the question being checked."""
    from parlib.launcher import launch

    return launch(fn, *args, world_size=world_size, timeout=current_timeout(), **kwargs)


def _from_rank_error(err: Exception, timeout: float | None) -> Exception:
    """Turn a launcher RankError into _NotAttempted / CheckFailed / _LearnerError."""
    exc_type = getattr(err, "exc_type", "") or ""
    rank = getattr(err, "rank", None)
    remote = getattr(err, "remote_traceback", "") or ""
    where = f"rank {rank}" if rank is not None else "a rank"
    if exc_type == "NotImplementedError":
        return _NotAttempted()
    if exc_type.lower() in ("timeout", "timeouterror"):
        t = f" after {timeout:g} s" if timeout else ""
        return CheckFailed(
            f"your function did not finish{t} ({where} was still waiting). A send with no "
            f"matching recv (or a recv with no matching send) blocks forever: check that "
            f"each rank sends to (rank + 1) % N and receives from (rank - 1) % N, and "
            f"that sends and receives are ordered so that neighbours do not both wait"
        )
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
    return _LearnerError(f"your function raised on {where}: {last}", tb)


# --------------------------------------------------------------------------- check

_SESSION: dict[str, CheckResult] = {}


def _evaluate(question: Question, answer: Any, timeout: float | None) -> CheckResult:
    qid, pts = question.id, question.points
    t = timeout if timeout is not None else (question.timeout or 120.0)
    token = _current_timeout.set(t)
    try:
        try:
            question.grade(answer)
        except Exception as exc:  # translate the launcher's error first
            if type(exc).__name__ == "RankError":
                raise _from_rank_error(exc, t) from None
            raise
    except _NotAttempted:
        hint = {
            "function": "replace raise NotImplementedError(...) with your code",
        }.get(question.kind, "replace the ... with your answer")
        return CheckResult(qid, NOT_ATTEMPTED, 0, pts, f"{hint}, then run this cell again")
    except CheckFailed as exc:
        return CheckResult(qid, FAILED, 0, pts, str(exc))
    except _LearnerError as exc:
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


def check(question_id: str, answer: Any, *, timeout: float | None = None) -> CheckResult:
    """Check ``answer`` against question ``question_id`` and return a :class:`CheckResult`.

    Never raises unless ``PARLIB_CHECK_MODE`` is ``strict`` or ``expect-fail``.
    ``timeout`` overrides the question's time limit for launches (seconds).
    """
    try:
        try:
            question = get_question(question_id)
        except (KeyError, TypeError):
            result = CheckResult(str(question_id), ERROR, 0, 0, _unknown_id_message(question_id))
        else:
            result = _evaluate(question, answer, timeout)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a bug in a grader must not crash the notebook
        result = CheckResult(str(question_id), ERROR, 0, 1,
                             f"the checker itself failed ({type(exc).__name__}: {exc}); "
                             f"please report this")
    _record(result)
    mode = os.environ.get(MODE_ENV, "").strip().lower()
    if mode == "strict" and not result.passed:
        raise CheckError(f"strict mode: {result!r}")
    if mode in ("expect-fail", "expect_fail") and result.passed:
        raise CheckError(f"expect-fail mode: a check passed: {result!r}")
    return result


def _record(result: CheckResult) -> None:
    _SESSION[result.question_id] = result
    path = os.environ.get(LOG_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(result.to_json(), sort_keys=True) + "\n")
        except OSError as exc:
            warnings.warn(f"parlib: could not write the check log {path}: {exc}")


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
                         f"{_fmt_points(r.score)}/{_fmt_points(r.max_score)}")
        lines.append(f"{'total':<{w}}  {'':<13}  "
                     f"{_fmt_points(self.score)}/{_fmt_points(self.max_score)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>No checks run yet.</p>"
        rows = "".join(
            f"<tr><td>{html.escape(r.question_id)}</td><td>{html.escape(r.status)}</td>"
            f"<td>{_fmt_points(r.score)}/{_fmt_points(r.max_score)}</td></tr>"
            for r in self.rows
        )
        return (
            "<table><tr><th>question</th><th>status</th><th>score</th></tr>"
            f"{rows}<tr><td><b>total</b></td><td></td>"
            f"<td><b>{_fmt_points(self.score)}/{_fmt_points(self.max_score)}</b></td></tr>"
            "</table>"
        )


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
        text = _unknown_id_message(question_id)
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
