"""What a collective costs: bytes each rank sends, and the alpha-beta time model.

A link costs ``alpha`` seconds per message plus ``beta`` seconds per byte. A ring
all-reduce over N ranks is a reduce-scatter then an all-gather, each N-1 steps of a
message of size/N, so every rank sends 2(N-1)/N of the message and pays 2(N-1) alphas.

Two refinements, each one formula here and used wherever a collective is timed:

- latency by algorithm: each collective pays its algorithm's steps (:func:`ring_steps`,
  :func:`tree_steps`); an all-reduce runs as NCCL's tree where the ring's latency makes the
  tree faster (:func:`nccl_algorithm`), so a collective over hundreds of ranks pays
  2 log2 N alphas, not 2(N-1). Reduce-scatter and all-gather stay rings: at 256 ranks, three
  of them a layer over 64 layers cost 0.49 s a step in latency alone at 10 us a step.
- bandwidth by message size: past its latency a small collective still reaches only part of
  the link's bus bandwidth (:func:`size_efficiency`; the presets' half size, about 1.8 MiB,
  is fitted to a measured curve with the latency charged as here,
  :func:`parlib.cost.efficiency.fitted_half_bandwidth_bytes`), so a collective of a few
  hundred KB is charged at the share of the link its size reaches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_ONE_PASS = ("reduce_scatter", "all_gather")


def predicted_sent_bytes(op: str, nbytes: float, n: int) -> float | None:
    """Bytes one rank sends for ``op`` on a message of ``nbytes`` in a ring of ``n`` ranks.

    ``nbytes`` is the full message: the tensor for all-reduce and broadcast, the *input* of
    reduce-scatter, the *output* of all-gather. All-reduce sends 2(n-1)/n of it,
    reduce-scatter and all-gather (n-1)/n each. ``None`` for an operation with no single
    textbook figure.
    """
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in _ONE_PASS:
        return (n - 1) / n * nbytes
    if op in ("send", "isend"):
        return float(nbytes)
    if op in ("recv", "irecv", "barrier"):
        return 0.0
    return None


def message_time(nbytes: float, alpha: float, beta: float) -> float:
    """One message over one link: alpha + beta x bytes (seconds)."""
    return alpha + beta * nbytes


# NCCL's tuning model (NVIDIA/nccl, src/graph/tuning.cc, ncclTopoTuneModel) charges a tree
# all-reduce 0.92 of the ring's bus bandwidth, and latency per level of the tree.
TREE_BANDWIDTH = 0.92
_RING_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}


def ring_steps(op: str, n: int) -> int:
    """Latency steps of ``op`` on a ring of ``n`` ranks: 2(n-1) for all-reduce (a
    reduce-scatter then an all-gather), n-1 for reduce-scatter, all-gather and all-to-all."""
    if op not in _RING_STEPS:
        raise ValueError(f"no ring time for {op!r}: pick one of {', '.join(_RING_STEPS)}")
    return _RING_STEPS[op] * max(0, n - 1)


def tree_steps(n: int) -> int:
    """Latency steps of a tree all-reduce over ``n`` ranks: up a binary tree and back down,
    2 x ceil(log2 n). NCCL's double binary tree moves the ring's bytes (each half of the
    message goes up and down one of two trees) at :data:`TREE_BANDWIDTH` of its rate."""
    return 2 * math.ceil(math.log2(n)) if n > 1 else 0


def nccl_algorithm(op: str, nbytes: float, n: int, alpha: float, beta: float,
                   half_bytes: float = 0.0) -> str:
    """The algorithm an ``op`` runs as, by a stated, simple version of NCCL's choice (it
    times every algorithm with its tuning model and keeps the fastest): an all-reduce takes
    the tree (2 ceil(log2 n) steps, the bytes at 0.92 of the ring's rate) where that is
    faster than the ring (2(n-1) steps): many ranks and small messages; the ring otherwise.
    Reduce-scatter, all-gather and all-to-all have no tree in NCCL (its tuning lists Tree for
    AllReduce only; NVLS and CollNet need switch support the presets do not model): always
    "ring"."""
    if op != "all_reduce" or n <= 2:
        return "ring"
    ring = collective_time(op, nbytes, n, alpha, beta, half_bytes=half_bytes)
    tree = collective_time(op, nbytes, n, alpha, beta, half_bytes=half_bytes,
                           algorithm="tree")
    return "tree" if tree < ring else "ring"


def size_efficiency(nbytes: float, half_bytes: float) -> float:
    """The share of a link's large-message bus bandwidth a collective of ``nbytes`` reaches:
    nbytes / (nbytes + half_bytes), half at ``half_bytes`` (the message size at which a
    measured nccl-tests curve reaches half its peak; 0: every size at the peak)."""
    if half_bytes < 0:
        raise ValueError(f"half_bytes must be >= 0, got {half_bytes!r}")
    if not half_bytes:
        return 1.0
    if nbytes <= 0:
        return 0.0
    return nbytes / (nbytes + half_bytes)


def collective_time(op: str, nbytes: float, n: int, alpha: float, beta: float, *,
                    half_bytes: float = 0.0, algorithm: str = "ring") -> float:
    """Time of ``op`` on ``nbytes`` over ``n`` ranks: latency steps x alpha plus the bytes
    one rank sends x beta.

    ``algorithm`` "ring" (:func:`ring_steps`: 2(n-1) steps for all-reduce, n-1 for
    reduce-scatter and all-gather, each a message of nbytes/n), "tree" (all-reduce only,
    :func:`tree_steps`) or "nccl" (whichever :func:`nccl_algorithm` picks). An all-to-all of
    an ``nbytes`` input split evenly: n-1 pairwise messages of nbytes/n (the n-th stays).
    ``half_bytes`` > 0 charges the bytes at the bus bandwidth of the message's size,
    :func:`size_efficiency` of the link's (``nbytes`` is the size that counts: the whole
    tensor, as nccl-tests reports its sizes)."""
    if n <= 1:
        return 0.0
    if algorithm == "nccl":
        algorithm = nccl_algorithm(op, nbytes, n, alpha, beta, half_bytes)
    if algorithm == "tree":
        if op != "all_reduce":
            raise ValueError(f"NCCL has no tree {op!r}: only all_reduce runs as a tree")
        steps = tree_steps(n)
    elif algorithm == "ring":
        steps = ring_steps(op, n)
    else:
        raise ValueError(f"algorithm must be 'ring', 'tree' or 'nccl', got {algorithm!r}")
    if op == "all_to_all":  # no ring: every rank sends its n-1 pieces for the others
        sent = (n - 1) / n * nbytes
    else:
        sent = predicted_sent_bytes(op, nbytes, n)
    rate = size_efficiency(nbytes, half_bytes) if nbytes > 0 else 1.0
    if algorithm == "tree":
        rate *= TREE_BANDWIDTH
    return steps * alpha + (sent * beta / rate if sent else 0.0)


def bus_bandwidth(nbytes: float, seconds: float, n: int) -> float:
    """All-reduce bus bandwidth in bytes/s: algorithm bandwidth (nbytes / seconds) x
    2(n-1)/n, the rate each rank's link really carried."""
    return predicted_sent_bytes("all_reduce", nbytes, n) / seconds


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float], *,
                   what: str = "time") -> tuple[float, float]:
    """Least-squares fit of t = a + b x n: returns (a seconds, b seconds per byte).

    For one message, a is alpha and b is beta. For a ring all-reduce over N ranks the same
    line has a = 2(N-1) alpha and b = 2(N-1)/N beta: divide before comparing links.
    Each point is weighted by 1/t, so the relative error is minimised and small messages
    count as much as big ones. ``what`` names the times in an error (a time that is not
    positive was measured wrongly: no line through it means anything).
    """
    n = [float(x) for x in sizes_bytes]
    t = [float(x) for x in seconds]
    if len(n) != len(t) or len(n) < 2:
        raise ValueError("need at least two (size, time) pairs of equal length")
    for size, x in zip(n, t):
        if not x > 0:  # also refuses NaN
            raise ValueError(f"cannot fit a line to a {what} of {x * 1e3:.3g} ms at "
                             f"{size:.0f} bytes: times must be positive (a measured time "
                             f"at or below zero means the clocks were read out of order)")
    if any(x < 0 for x in n):
        raise ValueError(f"sizes must be non-negative, got {min(n):.0f} bytes")
    # Minimise sum(((a + b n - t) / t)^2): normal equations of a 2x2 system.
    w = [1.0 / x**2 for x in t]
    s0 = sum(w)
    s1 = sum(wi * ni for wi, ni in zip(w, n))
    s2 = sum(wi * ni * ni for wi, ni in zip(w, n))
    r0 = sum(wi * ti for wi, ti in zip(w, t))
    r1 = sum(wi * ni * ti for wi, ni, ti in zip(w, n, t))
    det = s0 * s2 - s1 * s1
    if det <= 0:
        raise ValueError("need at least two different message sizes")
    return (r0 * s2 - r1 * s1) / det, (s0 * r1 - s1 * r0) / det


def per_link_alpha_beta(a: float, b: float, n: int) -> tuple[float, float]:
    """Undo a ring all-reduce fit: the line a + b x n_bytes fitted to all-reduce times on
    ``n`` ranks has a = 2(n-1) alpha and b = 2(n-1)/n beta; returns (alpha, beta) of one
    link, read off :func:`collective_time` so the ring formula stays in one place."""
    if n < 2:
        raise ValueError(f"an all-reduce fit needs n >= 2 ranks, got n={n!r}")
    return (a / collective_time("all_reduce", 0.0, n, 1.0, 0.0),
            b / predicted_sent_bytes("all_reduce", 1.0, n))


__all__ = ["TREE_BANDWIDTH", "bus_bandwidth", "collective_time", "fit_alpha_beta",
           "message_time", "nccl_algorithm", "per_link_alpha_beta", "predicted_sent_bytes",
           "ring_steps", "size_efficiency", "tree_steps"]
