"""Pipeline schedules as plain lists of operations.

A schedule says, for one rank, in which order it runs the forward and backward of each
microbatch. Everything here is pure computation (no ranks, no torch), so the notebook's
explorer can redraw a schedule instantly and tests can check the bubble formulas.

* :func:`gpipe` -- all m forwards, then all m backwards (last microbatch first).
* :func:`one_f_one_b` -- 1F1B: p-1-rank warm-up forwards, then one forward / one backward.
* :func:`interleaved` -- v virtual stages (model chunks) per rank, Megatron's interleaved 1F1B.
* :func:`zb_h1` -- ZB-H1 (zero bubble, 1F1B's memory): the backward split into B (the
  input's gradient, on the critical path) and W (the weights' gradients, run later to fill
  the bubble).

A learner writes a schedule by hand with :func:`F`, :func:`B` and :func:`W`:
``{0: [F(0), F(1), B(0), B(1)], 1: [F(0), B(0), F(1), B(1)]}``. In a schedule (all ranks)
that has any WEIGHT op, BACKWARD is the input-gradient part only and every (microbatch,
chunk) needs exactly one WEIGHT after its BACKWARD on the same rank; without WEIGHT ops
BACKWARD is the full backward. :func:`parlib.strategies.schedule_check.validate` checks a
schedule before anything runs it.
The timeline these orders give with fixed op times (``simulate``) is in
:mod:`parlib.experiments.simulate`; the formulas (bubble fraction, ideal step time) are in
:mod:`parlib.cost.pipeline`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

FORWARD = "forward"
BACKWARD = "backward"  # the full backward, or only the input's gradient when split
WEIGHT = "weight"  # the weights' gradients of a split backward
KINDS = (FORWARD, BACKWARD, WEIGHT)
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
_TAG = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}


@dataclass(frozen=True)
class Op:
    """One unit of work on a rank: the forward (F), backward (B) or weight gradient (W) of
    microbatch ``mb``. Shown as ``F3``, ``B3``, ``W3``; ``F3.1`` for chunk 1.

    ``chunk`` is the model chunk (virtual stage) on this rank; 0 unless interleaved. With
    v chunks per rank, chunk c of rank r is virtual stage c*p + r of the model.
    """

    kind: str  # FORWARD, BACKWARD or WEIGHT
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        tag = _TAG.get(self.kind, f"{self.kind}:")
        return f"{tag}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def F(mb: int, chunk: int = 0) -> Op:  # noqa: N802 (the schedule's own notation)
    """The forward of microbatch ``mb`` (on model chunk ``chunk``)."""
    return Op(FORWARD, mb, chunk)


def B(mb: int, chunk: int = 0) -> Op:  # noqa: N802
    """The backward of microbatch ``mb``: the full backward, or only the gradient of the
    stage's input when the schedule has W ops."""
    return Op(BACKWARD, mb, chunk)


def W(mb: int, chunk: int = 0) -> Op:  # noqa: N802
    """The weight gradients of microbatch ``mb`` (after its B, on the same rank)."""
    return Op(WEIGHT, mb, chunk)


def is_split(ops: Iterable[Op]) -> bool:
    """Whether ``ops`` split the backward into B and W (it has a WEIGHT op)."""
    return any(op.kind == WEIGHT for op in ops)


def _check(p: int, m: int, rank: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 and m >= 1, got p={p}, m={m}")
    if not 0 <= rank < p:
        raise ValueError(f"rank must be in [0, {p}), got {rank}")


def gpipe(p: int, m: int, rank: int) -> list[Op]:
    """GPipe: forwards of microbatches 0..m-1, then backwards m-1..0.

    The backward starts with the last microbatch because its activations are the newest:
    on the last stage it can start the moment its forward ends. m = 1 is the naive schedule.
    """
    _check(p, m, rank)
    return [Op(FORWARD, i) for i in range(m)] + [Op(BACKWARD, i) for i in reversed(range(m))]


def naive(p: int, m: int, rank: int) -> list[Op]:
    """One batch, no microbatches: the forward then the backward (GPipe with m = 1)."""
    if m != 1:
        raise ValueError("the naive schedule runs the whole batch at once: m must be 1")
    return gpipe(p, 1, rank)


def warmup_forwards(p: int, m: int, rank: int) -> int:
    """Forwards a 1F1B rank runs before its first backward: p-1-rank (at most m)."""
    return min(p - 1 - rank, m)


def one_f_one_b(p: int, m: int, rank: int) -> list[Op]:
    """1F1B (PipeDream-Flush): warm-up of p-1-rank forwards, then alternate F and B.

    Backwards run in microbatch order. A rank holds the activations of at most
    min(p - rank, m) microbatches at once, against m for GPipe.
    """
    _check(p, m, rank)
    w = warmup_forwards(p, m, rank)
    ops = [Op(FORWARD, i) for i in range(w)]
    for i in range(m - w):
        ops += [Op(FORWARD, w + i), Op(BACKWARD, i)]
    ops += [Op(BACKWARD, i) for i in range(m - w, m)]
    return ops


def interleaved(p: int, m: int, rank: int, v: int = 2) -> list[Op]:
    """Interleaved 1F1B (Narayanan et al., 2021, "Megatron-LM"): v model chunks per rank.

    Microbatches go through the chunks in groups of p, so m must be a multiple of p.
    Each op does 1/v of a stage's work; the bubble shrinks by v:
    (p-1)/(v*m) of the ideal time instead of (p-1)/m.
    """
    _check(p, m, rank)
    if v < 1:
        raise ValueError(f"v must be >= 1, got {v}")
    if v == 1:
        return one_f_one_b(p, m, rank)
    if m % p:
        raise ValueError(f"the interleaved schedule needs m to be a multiple of p (m={m}, p={p})")
    total = m * v

    def fwd(k: int) -> Op:
        return Op(FORWARD, (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Op:
        return Op(BACKWARD, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    w = min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops = [fwd(k) for k in range(w)]
    for i in range(total - w):
        ops += [fwd(w + i), bwd(i)]
    ops += [bwd(k) for k in range(total - w, total)]
    return ops


def zb_h1(p: int, m: int, rank: int) -> list[Op]:
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each
    backward split into B (the input's gradient, which the previous stage waits for) and
    W (the weights' gradients, which nobody waits for).

    Forwards and Bs run in 1F1B's order (warm-up of p-1-rank forwards, then one F, one
    B); rank r runs each W r Bs late, so the Ws fill the time rank r would wait in the
    cool-down for the next gradient. Every rank then holds min(p, m) microbatches (F to
    W): 1F1B's peak on its first rank, which is what bounds the memory of a pipeline of
    equal devices (1F1B's later ranks hold fewer: p - rank). For m >= p the bubble is
    (p-1)(t_F + t_B - t_W): with t_F = t_B = t_W a third of 1F1B's (p-1)(t_F + t_B + t_W).
    """
    _check(p, m, rank)
    w = warmup_forwards(p, m, rank)
    ops = [F(i) for i in range(w)]
    waiting: list[int] = []  # microbatches whose B ran and W has not
    for i in range(m):
        if w + i < m:
            ops.append(F(w + i))
        ops.append(B(i))
        waiting.append(i)
        if len(waiting) > rank:
            ops.append(W(waiting.pop(0)))
    return ops + [W(i) for i in waiting]


def schedule(name: str, p: int, m: int, rank: int, v: int = 2) -> list[Op]:
    """The op list of ``name`` (one of :data:`SCHEDULES`) for one rank (``v`` chunks per
    rank for the interleaved schedule)."""
    if name == "naive":
        return naive(p, m, rank)
    if name == "gpipe":
        return gpipe(p, m, rank)
    if name == "1f1b":
        return one_f_one_b(p, m, rank)
    if name == "interleaved":
        return interleaved(p, m, rank, v)
    if name == "zb-h1":
        return zb_h1(p, m, rank)
    raise ValueError(f"unknown schedule {name!r}; pick one of {SCHEDULES}")


def all_ranks(name: str, p: int, m: int, v: int = 2) -> dict[int, list[Op]]:
    """The op lists of schedule ``name`` for every rank: ``{rank: ops}``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; pick one of {SCHEDULES}")
    return {r: schedule(name, p, m, r, v) for r in range(p)}


def chunks_of(name: str, v: int = 2) -> int:
    """Model chunks per rank schedule ``name`` uses: v for the interleaved one, else 1."""
    return v if name == "interleaved" else 1


def in_flight(ops: Sequence[Op], split: bool | None = None) -> list[int]:
    """(Microbatch, chunk) pairs whose activations are held after each op: from the
    forward until the backward, or until the W when the backward is split (B still needs
    the activations W reads). ``split`` defaults to whether ``ops`` have a WEIGHT op."""
    split = is_split(ops) if split is None else split
    release = WEIGHT if split else BACKWARD
    live: set[tuple[int, int]] = set()
    counts = []
    for op in ops:
        key = (op.mb, op.chunk)
        if op.kind == FORWARD:
            live.add(key)
        elif op.kind == release:
            live.discard(key)
        counts.append(len(live))
    return counts


def peak_in_flight(ops: Sequence[Op], split: bool | None = None) -> int:
    """Most microbatch activations (in chunk units) a rank holds at once under ``ops``."""
    return max(in_flight(ops, split), default=0)


def peaks(sched: Mapping[int, Sequence[Op]]) -> dict[int, int]:
    """:func:`peak_in_flight` of every rank of a whole schedule (split if any rank has W)."""
    split = any(is_split(ops) for ops in sched.values())
    return {r: peak_in_flight(ops, split) for r, ops in sched.items()}


__all__ = [
    "FORWARD",
    "BACKWARD",
    "WEIGHT",
    "KINDS",
    "SCHEDULES",
    "Op",
    "F",
    "B",
    "W",
    "is_split",
    "zb_h1",
    "all_ranks",
    "chunks_of",
    "peaks",
    "gpipe",
    "naive",
    "one_f_one_b",
    "warmup_forwards",
    "interleaved",
    "schedule",
    "in_flight",
    "peak_in_flight",
]
