"""Ideal timelines of pipeline schedules: each op takes a fixed time and messages are
instant (or take ``t_comm``), so a schedule's bubble can be drawn without running it.

Any schedule dict works, hand-written ones and split backwards (W ops) included; it is
validated first (:func:`parlib.strategies.schedule_check.validate`), so a schedule the
simulator draws is one the runner can run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from parlib.measure.timeline import Span, makespan
from parlib.strategies.schedule_check import messages, validate
from parlib.strategies.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Op,
    all_ranks,
    chunks_of,
    is_split,
    peaks,
)


@dataclass
class IdealRun:
    """An ideal timeline: ``spans`` per rank, the ``peak_in_flight`` activations per rank
    (in chunk units) and the point-to-point ``messages`` each rank sends."""

    spans: list[list[Span]]
    peak_in_flight: dict[int, int] = field(default_factory=dict)
    messages: dict[int, int] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return makespan(self.spans)


def _orders(name: str | Mapping[int, Sequence[Op]], p: int, m: int,
            v: int | None) -> tuple[dict[int, list[Op]], int]:
    if isinstance(name, str):
        vv = chunks_of(name, 2 if v is None else v)
        return all_ranks(name, p, m, vv), vv
    orders = {r: list(ops) for r, ops in name.items()}
    inferred = 1 + max((getattr(op, "chunk", 0) for ops in orders.values() for op in ops),
                       default=0)
    return orders, inferred if v is None else v


def ideal_run(
    name: str | Mapping[int, Sequence[Op]],
    p: int,
    m: int,
    *,
    v: int | None = None,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_w: float | None = None,
    t_comm: float = 0.0,
) -> IdealRun:
    """The ideal timeline of a schedule (see :func:`simulate`) with its peak in-flight
    activations and message counts per rank."""
    orders, vv = _orders(name, p, m, v)
    validate(orders, p, m, vv)
    split = any(is_split(ops) for ops in orders.values())
    t_w = t_b / 2 if t_w is None else t_w
    if split and not 0 <= t_w <= t_b:
        raise ValueError(f"t_w is the weight-gradient part of t_b: need 0 <= t_w <= t_b, "
                         f"got t_w={t_w}, t_b={t_b}")
    duration = {FORWARD: t_f / vv, BACKWARD: (t_b - t_w if split else t_b) / vv,
                WEIGHT: t_w / vv}
    n_virtual = p * vv
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> end time
    free = [0.0] * p
    nxt = [0] * p
    spans: list[list[Span]] = [[] for _ in range(p)]

    def ready(rank: int, op: Op) -> float | None:
        s = op.chunk * p + rank
        if op.kind == WEIGHT:
            return done.get((BACKWARD, s, op.mb))
        if op.kind == FORWARD:
            if s == 0:
                return 0.0
            dep = done.get((FORWARD, s - 1, op.mb))
            return None if dep is None else dep + t_comm
        if s == n_virtual - 1:
            return done.get((FORWARD, s, op.mb))
        dep = done.get((BACKWARD, s + 1, op.mb))
        return None if dep is None else dep + t_comm

    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progress = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                op = orders[r][nxt[r]]
                t_ready = ready(r, op)
                if t_ready is None:
                    break
                start = max(free[r], t_ready)
                end = start + duration[op.kind]
                free[r] = end
                done[(op.kind, op.chunk * p + r, op.mb)] = end
                spans[r].append(Span(r, op.kind, start, end, op.mb, op.chunk))
                nxt[r] += 1
                remaining -= 1
                progress = True
        if not progress:  # validate() rules this out; kept so a bug cannot loop forever
            stuck = {r: orders[r][nxt[r]] for r in range(p) if nxt[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks: ranks wait forever at {stuck}")
    return IdealRun(spans, peaks(orders), messages(orders, p, vv))


def simulate(
    name: str | Mapping[int, Sequence[Op]],
    p: int,
    m: int,
    *,
    v: int | None = None,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_w: float | None = None,
    t_comm: float = 0.0,
) -> list[list[Span]]:
    """Ideal timeline of a schedule: each op starts as soon as its rank is free and its
    input has arrived (``t_comm`` after the producing op ended). Returns spans per rank.

    ``name`` is a schedule name or a dict rank -> op list (validated first: raises
    :class:`~parlib.strategies.schedule_check.ScheduleError`, a ``ValueError``, for one
    that cannot run, a deadlock included). A forward of one microbatch on one stage takes
    ``t_f`` and a full backward ``t_b``; when the backward is split, B takes ``t_b - t_w``
    and W ``t_w`` (default ``t_b / 2``). With v chunks per rank (``v``: the interleaved
    schedule's, 2 by default; for a dict, one more than its largest chunk) every op takes
    1/v of that.
    """
    return ideal_run(name, p, m, v=v, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm).spans


__all__ = ["IdealRun", "ideal_run", "simulate"]
