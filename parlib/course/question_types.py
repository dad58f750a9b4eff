"""The kinds of question a chapter can ask: a number, a letter, a formula, a function.

Each ``grade(answer)`` returns on a pass and raises :class:`CheckFailed` (with a hint
naming the likely mistake) or :class:`NotAttempted` otherwise.
"""

from __future__ import annotations

import ast
import contextvars
import decimal
import inspect
import math
import numbers
import operator
import random
import re
import textwrap
from typing import Any

from parlib.course.answers import LearnerFunction, type_name
from parlib.course.results import CheckFailed, NotAttempted

# --------------------------------------------------------------------------- stubs


def is_stub(answer: Any) -> bool:
    """True for an unanswered placeholder: ``...``, ``None``, or a function with no code of
    its own: its body (after a docstring) only ``pass``, ``...`` or
    ``raise NotImplementedError(...)``, the stub ``python -m parlib build`` writes, or
    only classes whose methods are all such stubs and a ``return Cls.method(args)`` (the
    autograd-Function exercises). Decided from the source alone, so an unwritten answer is
    "not attempted" at once, before any rank starts."""
    if answer is Ellipsis or answer is None:
        return True
    if isinstance(answer, LearnerFunction):  # rebuilt from its source by the grader
        return _source_is_stub(answer.code, answer.__name__)
    if callable(answer) and inspect.isfunction(answer):
        try:
            return _source_is_stub(textwrap.dedent(inspect.getsource(answer)))
        except (OSError, TypeError):
            return False
    return False


def _source_is_stub(src: str, name: str | None = None) -> bool:
    try:
        tree = ast.parse(src)
    except (SyntaxError, IndentationError, ValueError):
        return False
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    named = [n for n in defs if n.name == name] if name else defs[:1]
    return bool(named) and _is_stub_def(named[-1])


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return body[1:]
    return body


def _is_stub_def(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = _without_docstring(list(node.body))
    if all(map(_is_stub_statement, body)):
        return True
    # the autograd-Function exercises: stub classes, then ``return Cls.apply(x, ...)``
    *classes, last = body
    stubs = {c.name for c in classes if isinstance(c, ast.ClassDef) and _is_stub_class(c)}
    return bool(stubs) and len(stubs) == len(classes) and _returns_call_of(last, stubs)


def _is_stub_statement(stmt: ast.stmt) -> bool:
    """``pass``, ``...``, or ``raise NotImplementedError`` with no argument or one string:
    a statement that can only mean "not written yet" (a raise under an ``if`` is code)."""
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis
    if not isinstance(stmt, ast.Raise) or stmt.cause is not None:
        return False
    exc = stmt.exc
    if isinstance(exc, ast.Call) and not exc.keywords and len(exc.args) <= 1 \
            and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                    for a in exc.args):
        exc = exc.func
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _is_stub_class(node: ast.ClassDef) -> bool:
    body = _without_docstring(list(node.body))
    methods = [s for s in body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return bool(methods) and all(
        _is_stub_def(s) if s in methods else _is_stub_statement(s) for s in body)


def _returns_call_of(stmt: ast.stmt, classes: set[str]) -> bool:
    """``return Cls.attr(a, b)`` with ``Cls`` one of ``classes`` and plain names as args."""
    call = stmt.value if isinstance(stmt, ast.Return) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id in classes
            and not call.keywords and all(isinstance(a, ast.Name) for a in call.args))


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
                f"you gave {type_name(answer)} {answer!r}: give {what}"
            ) from None
    elif isinstance(answer, (list, tuple, set, dict)):
        raise CheckFailed(
            f"you gave a {type(answer).__name__} of {len(answer)} items: give a single number"
        )
    elif isinstance(answer, complex):
        raise CheckFailed(f"you gave the complex number {answer!r}: give a real number")
    else:
        raise CheckFailed(f"you gave a {type_name(answer)}: give {what}")
    if math.isnan(value) or math.isinf(value):
        raise CheckFailed(f"your answer is {value}: give a finite number")
    return value


# --------------------------------------------------------------------------- unit slips

# a unit whose values come from bytes (sizes, and times computed from sizes and bandwidths)
_BYTE_UNIT = re.compile(r"\b(bytes?|[kKMGT]i?B|[kMG]B/s|ms|s|us|seconds)\b")
_PREFIXES = (("KiB", "kB", 10, 3), ("MiB", "MB", 20, 6), ("GiB", "GB", 30, 9),
             ("TiB", "TB", 40, 12))


def percent_hint(value: float) -> str:
    """What a learner who gave a percent for a fraction is told."""
    return (f"{value:g} looks like a percent: give the fraction, a number between 0 and 1 "
            f"({value:g}% is {value / 100:g})")


def _binary_decimal_slips() -> list[tuple[float, str]]:
    slips = []
    for binary, in_decimal, power2, power10 in _PREFIXES:
        gap = 2.0**power2 / 10.0**power10
        why = (f"{binary} is 2^{power2} bytes and {in_decimal} 10^{power10} bytes, "
               f"{100 * (gap - 1):.1f}% apart: check which one each number is in")
        slips += [(gap, f"you are {100 * (gap - 1):.1f}% too high: {why}"),
                  (1 / gap, f"you are {100 * (1 - 1 / gap):.1f}% too low: {why}")]
    return slips


def unit_slips(expected: float, unit: str | None) -> list[tuple[float, str]]:
    """(factor, hint): the slips that leave an answer off by a known factor (given /
    expected), for an answer ``expected`` in ``unit``. Bytes and times get bits, the binary
    and decimal prefixes (MiB vs MB, GiB vs GB) and powers of 1000; a fraction (no unit,
    between 0 and 1) a percent; any number a factor of 2."""
    slips = [
        (2.0, "you are a factor of 2 too high: did you count something twice "
              "(send and receive?)"),
        (0.5, "you are a factor of 2 too low: did you leave out one of two phases?"),
    ]
    if unit is None and 0 < expected < 1:
        slips.append((100.0, ""))  # percent_hint, worded with the value
    if unit is not None and _BYTE_UNIT.search(unit):
        slips += [(8.0, "you are 8x too high: the answer is in bytes, not bits"),
                  (0.125, "you are 8x too low: the answer is in bytes, not bits"),
                  *_binary_decimal_slips(),
                  (2**20, "you are 2^20x too high: check the unit (bytes vs MiB)"),
                  (2.0**-20, "you are 2^20x too low: check the unit (bytes vs MiB)"),
                  (2**30, "you are 2^30x too high: check the unit (bytes vs GiB)"),
                  (2.0**-30, "you are 2^30x too low: check the unit (bytes vs GiB)")]
    for power, name in ((3, "1000x"), (6, "10^6x"), (9, "10^9x")):
        slips += [(10.0**power, f"you are {name} too high: check the unit"),
                  (10.0**-power, f"you are {name} too low: check the unit")]
    return slips


def unit_slip(value: float, expected: float, unit: str | None, rtol: float) -> str | None:
    """The hint naming the unit slip that turns ``expected`` into ``value``, or None."""
    if expected == 0 or value == 0:
        return None
    ratio = value / expected
    for factor, hint in unit_slips(expected, unit):
        if math.isclose(ratio, factor, rel_tol=max(rtol, 1e-9)):
            return hint or percent_hint(value)
    return None


class Numeric(Question):
    """A number, compared with ``math.isclose(answer, expected, rel_tol=rtol, abs_tol=atol)``.

    ``unit`` is the unit the answer is given in (a plain number in that unit is expected).
    ``mistakes`` maps known wrong values to hints; they are matched with the same tolerance.
    A value off by a factor that betrays a unit slip (:func:`unit_slips`) is named as such;
    ``near`` = (rtol, hint) names a value close to the answer that no mistake explains (a
    count rounded where the exact one is asked, say).
    """

    kind = "number"

    def __init__(self, id, answer, *, prompt, working, rtol=1e-3, atol=0.0, unit=None,
                 mistakes: dict[float, str] | None = None, points=1,
                 near: tuple[float, str] | None = None) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.answer = float(answer)
        self.rtol = rtol
        self.atol = atol
        self.unit = unit
        self.mistakes = dict(mistakes or {})
        self.near = near  # (relative distance, hint): close, but not the exact answer asked

    def _close(self, a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=self.rtol, abs_tol=self.atol)

    def grade(self, answer):
        if is_stub(answer):
            raise NotAttempted
        what = f"a number in {self.unit}" if self.unit else "a number"
        value = _as_number(answer, what)
        if self._close(value, self.answer):
            return "correct"
        unit = f" {self.unit}" if self.unit else ""
        for wrong, hint in self.mistakes.items():
            if self._close(value, float(wrong)):
                raise CheckFailed(f"{value:g}{unit} is not right: {hint}")
        slip = unit_slip(value, self.answer, self.unit, self.rtol)
        if slip:
            raise CheckFailed(f"{value:g}{unit} is not right: {slip}")
        if self.near and math.isclose(value, self.answer, rel_tol=self.near[0]):
            raise CheckFailed(f"{value:g}{unit} is not right: {self.near[1]}")
        direction = "too high" if value > self.answer else "too low"
        raise CheckFailed(f"{value:g}{unit} is not right ({direction}); check your working")


def _half_unit(value: float) -> float:
    """Half a unit of the last digit written: 0.27 -> 0.005, 27 -> 0.5, 0.273 -> 0.0005."""
    exponent = decimal.Decimal(repr(value)).normalize().as_tuple().exponent
    return 0.5 * 10.0 ** min(int(exponent), 0) if isinstance(exponent, int) else 0.0


class RoundedFraction(Numeric):
    """A fraction between 0 and 1, judged with the rounding its digits state: 0.27 is 3/11
    to two digits, so it passes (and so does 0.273). Fewer than ``min_digits``
    significant digits are too coarse to tell the answer from its mistakes, and a number
    between 1 and 100 that is the answer x 100 is named as a percent. Every question that
    asks for a fraction uses it, so the same fraction is judged the same way everywhere."""

    def __init__(self, *args: Any, min_digits: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.min_digits = min_digits

    def _rounds_to(self, value: float, target: float) -> bool:
        if value == 0:  # "0" states no digits of the answer
            return self._close(value, target)
        return self._close(value, target) or abs(value - target) <= _half_unit(value) + 1e-12

    def _too_coarse(self, value: float) -> bool:
        if value == 0:
            return True
        return _half_unit(value) > 0.5 * 10.0 ** (
            math.floor(math.log10(abs(value))) - self.min_digits + 1) * (1 + 1e-9)

    def grade(self, answer: Any) -> str:
        if is_stub(answer):
            raise NotAttempted
        value = _as_number(answer, "a fraction between 0 and 1")
        if 1 < value <= 100 and self._rounds_to(value / 100, self.answer):
            raise CheckFailed(percent_hint(value))
        for wrong, hint in self.mistakes.items():  # a mistake itself, however few its digits
            if self._close(value, float(wrong)):
                raise CheckFailed(f"{value:g} is not right: {hint}")
        if self._rounds_to(value, self.answer):
            if self._too_coarse(value):
                raise CheckFailed(f"{value:g} is too coarse to judge: give at least "
                                  f"{self.min_digits} significant digits")
            return "correct"
        for wrong, hint in self.mistakes.items():
            if self._rounds_to(value, float(wrong)) and not self._too_coarse(value):
                raise CheckFailed(f"{value:g} is not right: {hint}")
        # no unit-slip factors (MiB vs MB, bits vs bytes) for a plain fraction
        direction = "too high" if value > self.answer else "too low"
        raise CheckFailed(f"{value:g} is not right ({direction}); check your working")


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
            raise NotAttempted
        letters = ", ".join(self.options)
        if not isinstance(answer, str):
            raise CheckFailed(f"you gave a {type_name(answer)}: give one letter as a "
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
        left, right = _eval_expr(node.left, env), _eval_expr(node.right, env)
        if isinstance(node.op, ast.Pow) and abs(right) > 64 and abs(left) > 1:
            raise CheckFailed("a power in your formula is far too large (exponent over 64): "
                              "no formula of this course needs one")
        if isinstance(left, int) and isinstance(right, int) \
                and max(abs(left), abs(right)).bit_length() > 4096:
            raise CheckFailed("a number in your formula has over a thousand digits")
        return _BINOPS[type(node.op)](left, right)
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
            raise NotAttempted
        if not isinstance(answer, str):
            raise CheckFailed(f"you gave a {type_name(answer)}: give the formula as a "
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


_COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}


class WholeNumbers(Question):
    """A tuple of whole numbers named ``names`` (a layout such as (d, t, p)), judged by
    ``problems(*values)``: None when the answer follows the rules, else the first rule it
    breaks. Every number must be at least ``minimum`` (``too_small`` says so)."""

    kind = "numbers"

    def __init__(self, id, problems, *, names: tuple[str, ...], example: tuple[int, ...],
                 prompt, working, minimum: int = 1,
                 too_small: str = "every number must be at least 1", points=1) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.problems, self.names, self.example = problems, tuple(names), tuple(example)
        self.minimum, self.too_small = minimum, too_small

    def grade(self, answer):
        if is_stub(answer):
            raise NotAttempted
        n = len(self.names)
        form = (f"give a tuple of {_COUNT_WORDS.get(n, n)} whole numbers "
                f"({', '.join(self.names)}), e.g. {self.example}")
        if not isinstance(answer, (tuple, list)):
            raise CheckFailed(f"you gave a {type_name(answer)} {answer!r}: {form}")
        if len(answer) != n:
            raise CheckFailed(f"you gave {len(answer)} items: {form}")
        odd = [x for x in answer if type(x) is not int]
        if odd:
            raise CheckFailed(f"{odd[0]!r} is not a whole number (a {type_name(odd[0])}): "
                              f"{form}")
        values = tuple(answer)
        if min(values) < self.minimum:
            raise CheckFailed(self.too_small)
        problem = self.problems(*values)
        if problem:
            raise CheckFailed(f"({', '.join(map(str, values))}): {problem}")
        return "correct"


_current_timeout: contextvars.ContextVar[float] = contextvars.ContextVar(
    "parlib_check_timeout", default=120.0)


def current_timeout() -> float:
    """The timeout (s) the question being checked allows for each launch."""
    return _current_timeout.get()


DEFAULT_TIMEOUT_HINT = (
    "every rank must issue the same collectives in the same order (a rank that skips a "
    "collective, or calls them in another order, leaves the others waiting forever)"
)


class Implementation(Question):
    """A function, judged by ``grader(fn)`` which raises :class:`CheckFailed` on the
    first failing case and returns None on a pass.

    ``timeout_hint`` is what a learner is told when their function did not finish in
    ``timeout`` seconds (default: :data:`DEFAULT_TIMEOUT_HINT`)."""

    kind = "function"

    def __init__(self, id, grader, *, prompt, working, timeout=120.0, points=1,
                 timeout_hint: str = DEFAULT_TIMEOUT_HINT) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.grader = grader
        self.timeout = timeout
        self.timeout_hint = timeout_hint

    def grade(self, answer):
        if is_stub(answer):
            raise NotAttempted
        if isinstance(answer, LearnerFunction) and answer.error:
            raise CheckFailed(f"the grader could not read your function: {answer.error}")
        if not callable(answer):
            raise CheckFailed(f"you gave a {type_name(answer)}: pass the function "
                              f"itself (its name, without calling it)")
        self.grader(answer)
        return "correct"


__all__ = ["DEFAULT_TIMEOUT_HINT", "Choice", "Expression", "Implementation", "Numeric",
           "Question", "RoundedFraction", "WholeNumbers", "current_timeout", "is_stub",
           "percent_hint", "unit_slip", "unit_slips"]
