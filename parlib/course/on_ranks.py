"""Running a learner's function on ranks for a check: what a rank's failure means.

A question's grader launches the learner's function with ``parlib.launch`` and the
question's timeout, reading what the ranks send back as plain data only
(``plain_replies=True``: the learner's code runs on the ranks and could change how they
reply; nothing they send is run in the grader). When a rank fails,
:func:`verdict_from_rank_error` reads the :class:`RankError` (by its ``exc_type`` and
traceback) and turns it into a verdict: a stub (``NotImplementedError``) is "not
attempted", a hang is a failure with a hint, a :class:`CheckFailed` raised on a rank is
that failure, a reply that is not plain data is a failure saying so, anything else is the
learner's error with their own frames.

:class:`RankExercise` is the question type "implement this on ranks": the probe that runs
the learner's function on each rank, the worlds it runs on, the single-device reference,
named diagnoses (first match wins) and the worked solution, with the launch -> diagnose ->
raise loop written once here.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from parlib.course.question_types import DEFAULT_TIMEOUT_HINT, Implementation, current_timeout
from parlib.course.results import CheckFailed, LearnerError, NotAttempted
from parlib.runtime.errors import RankError, trim_traceback
from parlib.verify import close


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
    if exc_type.lower() in ("timeout", "timeouterror", "deadlock"):
        t = f" after {timeout:g} s" if timeout and exc_type == "Timeout" else ""
        return CheckFailed(f"your function did not finish{t} ({where} was still waiting): "
                           f"{timeout_hint}")
    if exc_type == "Exited" and "SIGABRT" in str(err):
        return CheckFailed(
            f"{where} crashed inside gloo (SIGABRT). This usually means a send and its "
            f"matching recv used tensors of different sizes (see the rank's message above): "
            f"check which chunk each rank sends and receives at each step"
        )
    if exc_type == "UnreadableReply":  # the learner's code changed how its rank replies
        return CheckFailed(str(err).split("UnreadableReply: ", 1)[-1].splitlines()[0])
    if exc_type in ("CheckFailed",):
        last = remote.strip().splitlines()[-1] if remote.strip() else str(err)
        return CheckFailed(last.split(": ", 1)[-1])
    first = str(err).strip().splitlines()[0] if str(err).strip() else exc_type
    last = first.split(" failed: ", 1)[1] if " failed: " in first else first
    tb = trim_traceback(remote) if remote.strip() else ""
    if not tb.rstrip().endswith(last):
        tb = (tb.rstrip() + "\n" + last).strip()
    return LearnerError(f"your function raised on {where}: {last}", tb)



# --------------------------------------------------------------------------- rank exercises


@dataclass(frozen=True)
class World:
    """One launch of a rank exercise: ``size`` ranks, the probe's extra ``args`` (after the
    learner's function), and ``where`` (how a hint names the launch, formatted with
    ``world`` and the first wrong ``rank``; empty: the exercise's)."""

    size: int
    args: tuple = ()
    where: str = ""


@dataclass(frozen=True)
class Case:
    """What a diagnosis looks at: one launch on ``world`` ranks (``results``, one report per
    rank), the single-device ``reference`` for that world, and where the first wrong number
    is (``rank`` and ``step``, a step number or the name of a part; both None when every
    number is right)."""

    world: int
    results: list[Any]
    reference: Any
    rank: int | None = None
    step: int | str | None = None
    setting: World | None = None

    @property
    def report(self) -> Any:
        """The report of the first wrong rank (rank 0 when every number is right)."""
        return self.results[self.rank or 0]


@dataclass(frozen=True)
class Diagnosis:
    """A named mistake: ``when(case)`` says whether the launch shows it, ``hint`` (a string,
    formatted with ``world``, ``rank`` and ``step`` (a step counted from 1), or a function
    of the case) says what to change. ``right`` diagnoses are looked at only
    when every number is right (a correct result reached the wrong way: too many bytes, the
    wrong collective); the others only when a number is wrong."""

    name: str
    when: Callable[[Case], bool]
    hint: str | Callable[[Case], str]
    right: bool = False

    def message(self, case: Case) -> str:
        if callable(self.hint):
            return self.hint(case)
        step = case.step + 1 if isinstance(case.step, int) else case.step
        return self.hint.format(world=case.world, rank=case.rank, step=step)


def always(case: Case) -> bool:
    """The predicate of a last, catch-all diagnosis."""
    return True


def off_by(got: Any, want: Any, factor: float, origin: Any = None) -> bool:
    """Is ``got`` the answer ``want`` scaled by ``factor`` (about ``origin``: ``got - origin
    == factor x (want - origin)``)? Tensors or lists of tensors, compared with
    :func:`parlib.verify.close`; with ``origin`` a training step that moved ``factor``
    times as far as it should."""
    if isinstance(got, (list, tuple)):
        origins = origin if origin is not None else [None] * len(got)
        return len(got) == len(want) and all(
            off_by(g, w, factor, o) for g, w, o in zip(got, want, origins))
    if origin is None:
        return close(got, factor * want)
    return close(got, origin + factor * (want - origin))


def factor_mistakes(answer: float, hints: Mapping[float, str]) -> dict[float, str]:
    """{wrong value: hint} for answers off by a known factor (x N, / N, 8 for bits...): the
    ``mistakes`` of a :class:`~parlib.course.question_types.Numeric`."""
    return {answer * factor: hint for factor, hint in hints.items()}


def working_text(explanation: str, solution: str, after: str = "") -> str:
    """A rank exercise's worked answer: the explanation, the solution's code, what follows."""
    text = textwrap.dedent(explanation).strip() + "\n\n```python\n" + solution + "```"
    after = textwrap.dedent(after).strip()
    return text + ("\n\n" + after if after else "")


# A rank error that means "the ranks' collectives did not match": a hang, or a peer's
# collective torn down when another rank left.
_STUCK_WORDS = ("connection closed", "connection reset", "gloo", "broken pipe", "sigabrt")


def rank_error_is_stuck(err: RankError) -> bool:
    """Does the rank error mean the ranks' communication did not match (a hang, a peer torn
    down)?"""
    kind = (err.exc_type or "").lower()
    text = f"{err} {err.remote_traceback or ''}".lower()
    if kind == "notimplementederror":
        return False
    return (kind in ("timeout", "timeouterror", "deadlock", "exited")
            or any(w in text for w in _STUCK_WORDS))


class RankExercise(Implementation):
    """The question "implement this on ranks": the learner's function runs on every world
    in ``worlds`` inside ``probe(fn, *world.args)`` (a rank function returning that rank's
    report), and is judged against ``reference(world)`` (built from
    :func:`parlib.verify.reference_run`; None where the probe compares on the ranks).

    ``first_wrong(case)`` finds the first wrong number: ``(rank, step)``, or None when all
    are right. Then the ``diagnoses`` are tried in order and the first that matches is the
    verdict (those marked ``right`` when nothing is wrong). ``hang_hint`` (formatted with
    ``t`` and ``where``), when given, is the verdict for ranks whose collectives did not
    match; without it a rank's failure is read by :func:`verdict_from_rank_error`.
    ``rank_error(err, world, fn)``, when given, may name a rank's failure first: a
    (diagnosis, message) out of ``rank_error_names``, or None.
    ``backend``: the process group's (None: :func:`parlib.launch`'s default for the device).
    ``solution`` is the worked answer's code; the working is ``explanation``, the code,
    ``after``."""

    def __init__(self, id: str, *, probe: Callable[..., Any], worlds: Sequence[int | World],
                 reference: Callable[[World], Any], first_wrong: Callable[[Case], Any],
                 diagnoses: Sequence[Diagnosis], solution: str, explanation: str,
                 after: str = "", where: str = "on {world} ranks", prompt: str,
                 points: float = 1, timeout: float = 120.0, hang_hint: str | None = None,
                 timeout_hint: str = DEFAULT_TIMEOUT_HINT, backend: str | None = "gloo",
                 rank_error: Callable[[RankError, World, Callable],
                                      tuple[str, str] | None] | None = None,
                 rank_error_names: Sequence[str] = ()) -> None:
        super().__init__(id, self._run, prompt=prompt, points=points, timeout=timeout,
                         timeout_hint=timeout_hint,
                         working=working_text(explanation, solution, after))
        names = [d.name for d in diagnoses]
        if len(set(names)) != len(names):
            raise ValueError(f"{id}: two diagnoses share a name: {names}")
        self.worlds = tuple(w if isinstance(w, World) else World(w) for w in worlds)
        self.probe, self.reference = probe, reference
        self.first_wrong, self.diagnoses = first_wrong, tuple(diagnoses)
        self.solution, self.where, self.hang_hint = solution, where, hang_hint
        self.backend = backend
        self.rank_error, self.rank_error_names = rank_error, list(rank_error_names)

    def diagnosis_names(self) -> list[str]:
        """Every verdict this exercise can give: its diagnoses, the rank errors it names
        (and "hang" with a hang hint)."""
        return ([d.name for d in self.diagnoses] + self.rank_error_names
                + (["hang"] if self.hang_hint else []))

    def _fail(self, name: str, message: str) -> CheckFailed:
        failure = CheckFailed(message)
        failure.diagnosis = name  # which verdict: the tests show every one is reachable
        return failure

    def _launch(self, fn: Callable, world: World) -> list[Any]:
        from parlib.runtime import launch

        try:
            return launch(self.probe, fn, *world.args, world_size=world.size,
                          backend=self.backend, timeout=current_timeout(), plain_replies=True)
        except RankError as err:
            named = self.rank_error(err, world, fn) if self.rank_error is not None else None
            if named is not None:
                raise self._fail(*named) from None
            if self.hang_hint is None or not rank_error_is_stuck(err):
                raise
            kind = (err.exc_type or "").lower()
            t = f" after {current_timeout():g} s" if kind.startswith("timeout") else ""
            where = (f"rank {err.rank} stopped first" if err.rank is not None
                     else f"{world.size} ranks")
            if kind == "deadlock":
                where = f"rank {err.rank} was left waiting in a collective its peers never made"
            raise self._fail("hang", self.hang_hint.format(t=t, where=where)) from None

    def _run(self, fn: Callable) -> None:
        for world in self.worlds:
            case = Case(world.size, self._launch(fn, world), self.reference(world),
                        setting=world)
            found = self.first_wrong(case)
            if found is not None:
                case = replace(case, rank=found[0], step=found[1])
            where = (world.where or self.where).format(world=world.size, rank=case.rank)
            where = f"{where}: " if where else ""  # "": the hints say where themselves
            for diagnosis in self.diagnoses:
                if diagnosis.right == (found is None) and diagnosis.when(case):
                    raise self._fail(diagnosis.name, f"{where}{diagnosis.message(case)}")
            if found is not None:
                raise self._fail("wrong", f"{where}rank {case.rank}'s numbers are wrong")


# --------------------------------------------------------------------------- case exercises


def run_cases(report: Callable[[Callable, str], dict[str, Any]], names: Sequence[str],
              fn: Callable) -> list[dict[str, Any]]:
    """In the child process: ``report(fn, name)`` for each case in turn, up to the first
    with a "problem"."""
    from parlib.course.answers import no_process_exit

    out = []
    for name in names:
        with no_process_exit():
            out.append({"name": name, **report(fn, name)})
        if "problem" in out[-1]:
            break
    return out


class CaseExercise(RankExercise):
    """A function with no collectives of its own, judged on named cases: ``report(fn,
    name)`` (a module-level function returning a dict, with a "problem" key when the
    answer is wrong on that case) runs for every name in ``cases`` in one child process,
    never in the grader; the first wrong case goes through ``diagnoses`` (first match
    wins), its message prefixed by ``where(case)``. ``refuse(fn)``, run in the grader on
    the function object only (never calling it), may return a (diagnosis name, message)
    for an answer that is not the learner's own work."""

    def __init__(self, id: str, *, cases: Sequence[str],
                 report: Callable[[Callable, str], dict[str, Any]],
                 diagnoses: Sequence[Diagnosis], solution: str, explanation: str,
                 prompt: str, after: str = "", timeout: float = 60.0,
                 where: Callable[[Case], str] = lambda case: "",
                 refuse: Callable[[Callable], tuple[str, str] | None] | None = None,
                 refusals: Sequence[str] = ()) -> None:
        super().__init__(id, probe=functools.partial(run_cases, report, tuple(cases)),
                         worlds=[World(1)], reference=lambda world: None,
                         first_wrong=lambda case: None, diagnoses=diagnoses,
                         solution=solution, explanation=explanation, after=after, where="",
                         prompt=prompt, timeout=timeout)
        self.describe, self.refuse, self.refusals = where, refuse, list(refusals)

    def diagnosis_names(self) -> list[str]:
        return self.refusals + [d.name for d in self.diagnoses]

    def _run(self, fn: Callable) -> None:
        refused = self.refuse(fn) if self.refuse is not None else None
        if refused is not None:
            raise self._fail(*refused)
        reports = self._launch(fn, self.worlds[0])[0]
        wrong = [r for r in reports if "problem" in r]
        if not wrong:
            return
        case = Case(1, [wrong[0]], None, rank=0, step=wrong[0]["name"])
        for diagnosis in self.diagnoses:
            if diagnosis.when(case):
                prefix = self.describe(case)
                raise self._fail(diagnosis.name, f"{prefix}: {diagnosis.message(case)}"
                                 if prefix else diagnosis.message(case))
