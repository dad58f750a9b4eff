"""What a collective costs: bytes each rank sends, and the alpha-beta time model.

A link costs ``alpha`` seconds per message plus ``beta`` seconds per byte. A ring
all-reduce over N ranks is a reduce-scatter then an all-gather, each N-1 steps of a
message of size/N, so every rank sends 2(N-1)/N of the message and pays 2(N-1) alphas.
"""

from __future__ import annotations

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


def collective_time(op: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring time of ``op`` on ``nbytes`` over ``n`` ranks: 2(n-1) steps for all-reduce,
    n-1 for reduce-scatter and all-gather, each a message of nbytes/n. An all-to-all of an
    ``nbytes`` input split evenly: n-1 pairwise messages of nbytes/n (the n-th stays)."""
    if n <= 1:
        return 0.0
    steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1,
             "all_to_all": n - 1}
    if op not in steps:
        raise ValueError(f"no ring time for {op!r}: pick one of {', '.join(steps)}")
    if op == "all_to_all":  # no ring: every rank sends its n-1 pieces for the others
        return steps[op] * alpha + (n - 1) / n * nbytes * beta
    return steps[op] * alpha + predicted_sent_bytes(op, nbytes, n) * beta


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


__all__ = ["bus_bandwidth", "collective_time", "fit_alpha_beta", "message_time",
           "per_link_alpha_beta", "predicted_sent_bytes"]
