"""Pipeline formulas: the bubble, the ideal step time, the bytes crossing a boundary.

p stages, m microbatches per step, v model chunks per rank (interleaved schedules).
GPipe and 1F1B keep each stage busy m of the m + p - 1 slots of a step; 1F1B also caps
the microbatches a stage holds in flight at p.
"""

from __future__ import annotations


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1) / (v*m + p-1).

    With v = 1 this is GPipe's and 1F1B's (p-1)/(m+p-1): each stage works m of the
    m+p-1 time slots of a step. Example: p = 4 stages, m = 8 microbatches gives 3/11.
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}")
    return (p - 1) / (v * m + p - 1)


def bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Bubble time relative to the ideal (bubble-free) time: (p-1) / (v*m)."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}")
    return (p - 1) / (v * m)


def ideal_step_time(p: int, m: int, t_stage: float, v: int = 1) -> float:
    """Step time of GPipe / 1F1B: (m + (p-1)/v) x t_stage, with t_stage = t_f + t_b of one
    microbatch on one stage (all v chunks of it)."""
    return (m + (p - 1) / v) * t_stage


def min_microbatches(p: int, max_bubble: float, v: int = 1) -> int:
    """Smallest m with bubble_fraction(p, m, v) <= max_bubble."""
    if not 0 < max_bubble < 1:
        raise ValueError("max_bubble must be in (0, 1)")
    m = 1
    while bubble_fraction(p, m, v) > max_bubble + 1e-12:
        m += 1
    return m


def in_flight_microbatches(p: int, m: int, v: int = 1) -> int:
    """Microbatches whose activations the first stage holds at once under 1F1B: min(p, m).

    Interleaved (v > 1) this counts model chunks of L/(p*v) layers each: the warm-up
    forwards of Megatron-LM's interleaved schedule (schedules.py: 2(p-1) + (v-1)p on the
    first stage) plus one, at most v*m. Once m >= p that is the activations of
    L(1 + (p-1)/(p*v)) layers, a little more than the L of plain 1F1B.
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}")
    if v == 1:
        return min(p, m)
    return min(v * m, 2 * (p - 1) + (v - 1) * p + 1)


def boundary_bytes(batch: int, seq_len: int, d_model: int, dtype_bytes: int = 4) -> int:
    """Bytes one stage boundary carries per step in each direction: the (b, s, h) hidden
    states forward, and a gradient of the same shape backward."""
    return batch * seq_len * d_model * dtype_bytes


__all__ = ["boundary_bytes", "bubble_fraction", "bubble_ratio", "ideal_step_time",
           "in_flight_microbatches", "min_microbatches"]
