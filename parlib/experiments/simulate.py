"""Ideal timelines of pipeline schedules: each op takes a fixed time and messages are
instant (or take ``t_comm``), so a schedule's bubble can be drawn without running it.
"""

from __future__ import annotations

from parlib.measure.timeline import Span
from parlib.strategies.schedules import BACKWARD, FORWARD, Op, schedule


def simulate(
    name: str | dict[int, list[Op]],
    p: int,
    m: int,
    *,
    v: int = 2,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_comm: float = 0.0,
) -> list[list[Span]]:
    """Ideal timeline of a schedule: each op starts as soon as its rank is free and its
    input has arrived (``t_comm`` after the producing op ended). Returns spans per rank.

    ``name`` is a schedule name or a dict rank -> op list. Forward of one microbatch on
    one stage takes ``t_f``, backward ``t_b`` (an interleaved chunk takes 1/v of that).
    Raises ``ValueError`` if the orders deadlock (some op's input can never arrive).
    """
    if isinstance(name, str):
        vv = v if name == "interleaved" else 1
        orders = {r: schedule(name, p, m, r, v) for r in range(p)}
    else:
        orders = dict(name)
        vv = 1 + max((op.chunk for ops in orders.values() for op in ops), default=0)
    n_virtual = p * vv
    scale = 1.0 / vv
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> end time
    free = [0.0] * p
    nxt = [0] * p
    spans: list[list[Span]] = [[] for _ in range(p)]

    def ready(rank: int, op: Op) -> float | None:
        s = op.chunk * p + rank
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
                end = start + (t_f if op.kind == FORWARD else t_b) * scale
                free[r] = end
                done[(op.kind, op.chunk * p + r, op.mb)] = end
                spans[r].append(Span(r, op.kind, start, end, op.mb, op.chunk))
                nxt[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {r: orders[r][nxt[r]] for r in range(p) if nxt[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks: ranks wait forever at {stuck}")
    return spans


__all__ = ["simulate"]
