"""Pipeline schedules as plain lists of operations.

A schedule says, for one rank, in which order it runs the forward and backward of each
microbatch. Everything here is pure computation (no ranks, no torch), so the notebook's
explorer can redraw a schedule instantly and tests can check the bubble formulas.

* :func:`gpipe` -- all m forwards, then all m backwards (last microbatch first).
* :func:`one_f_one_b` -- 1F1B: p-1-rank warm-up forwards, then one forward / one backward.
* :func:`interleaved` -- v virtual stages (model chunks) per rank, Megatron's interleaved 1F1B.
The timeline these orders give with fixed op times (``simulate``) is in
:mod:`parlib.experiments.simulate`; the formulas (bubble fraction, ideal step time) are in
:mod:`parlib.cost.pipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD = "forward"
BACKWARD = "backward"
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Op:
    """One unit of work on a rank: the forward or backward of microbatch ``mb``.

    ``chunk`` is the model chunk (virtual stage) on this rank; 0 unless interleaved. With
    v chunks per rank, chunk c of rank r is virtual stage c*p + r of the model.
    """

    kind: str  # FORWARD or BACKWARD
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        tag = "F" if self.kind == FORWARD else "B"
        return f"{tag}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


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


def schedule(name: str, p: int, m: int, rank: int, v: int = 2) -> list[Op]:
    """The op list of ``name`` (one of :data:`SCHEDULES`) for one rank."""
    if name == "naive":
        return naive(p, m, rank)
    if name == "gpipe":
        return gpipe(p, m, rank)
    if name == "1f1b":
        return one_f_one_b(p, m, rank)
    if name == "interleaved":
        return interleaved(p, m, rank, v)
    raise ValueError(f"unknown schedule {name!r}; pick one of {SCHEDULES}")


def in_flight(ops: list[Op]) -> list[int]:
    """Microbatches whose activations are held after each op (forward done, backward not)."""
    live: set[tuple[int, int]] = set()
    counts = []
    for op in ops:
        key = (op.mb, op.chunk)
        if op.kind == FORWARD:
            live.add(key)
        else:
            live.discard(key)
        counts.append(len(live))
    return counts


def peak_in_flight(ops: list[Op]) -> int:
    """Most microbatch activations (in chunk units) a rank holds at once under ``ops``."""
    return max(in_flight(ops), default=0)


# --------------------------------------------------------------------------- simulation


__all__ = [
    "FORWARD",
    "BACKWARD",
    "SCHEDULES",
    "Op",
    "gpipe",
    "naive",
    "one_f_one_b",
    "warmup_forwards",
    "interleaved",
    "schedule",
    "in_flight",
    "peak_in_flight",
]
