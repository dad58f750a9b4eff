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


def microbatch_time(rows: int | float, per_row: float, per_call: float = 0.0) -> float:
    """Time of one stage's forward (or backward, or both) on a microbatch of ``rows``
    samples: rows x per_row + per_call. The fixed per_call part stands for what a call
    costs however small its input (kernel launches; on a GPU, a microbatch too small to
    fill the device takes about as long as a larger one)."""
    if rows <= 0 or per_row < 0 or per_call < 0:
        raise ValueError(f"need rows > 0 and times >= 0, got rows={rows}, "
                         f"per_row={per_row}, per_call={per_call}")
    return rows * per_row + per_call


def fixed_batch_step_time(p: int, m: int, batch: int, per_row: float,
                          per_call: float = 0.0) -> float:
    """Step time of GPipe / 1F1B when a batch of ``batch`` rows is cut into m microbatches:
    (m + p - 1) x (batch/m x per_row + per_call), per_row and per_call counting forward and
    backward together. Without per_call it is (m + p - 1)/m x the bubble-free time
    batch x per_row, so more microbatches shorten the step towards that time."""
    if batch % m:
        raise ValueError(f"a batch of {batch} rows does not split into m={m} microbatches")
    return ideal_step_time(p, m, microbatch_time(batch / m, per_row, per_call))


def best_microbatches(p: int, batch_time: float, per_call: float) -> float:
    """The m that minimises fixed_batch_step_time: sqrt((p-1) x batch_time / per_call),
    with batch_time = batch x per_row. Beyond it each extra microbatch costs more per-call
    time than it saves in bubble."""
    if per_call <= 0:
        return float("inf")
    return ((p - 1) * batch_time / per_call) ** 0.5


def imbalanced_step_time(stage_times: list[float], m: int) -> float:
    """GPipe step time when stage i takes stage_times[i] (forward + backward of one
    microbatch, the same stage slowest in both): sum(stage_times) + (m-1) x max(stage_times).
    The slowest stage sets the pace: every microbatch after the first waits for it. Equal
    times t give (m + p - 1) x t."""
    if not stage_times or m < 1:
        raise ValueError(f"need at least one stage and m >= 1, got {stage_times}, m={m}")
    return sum(stage_times) + (m - 1) * max(stage_times)


def min_microbatches(p: int, max_bubble: float, v: int = 1, relative: bool = False) -> int:
    """Smallest m with bubble_fraction(p, m, v) <= max_bubble (the idle fraction of the
    step); with ``relative``, bubble_ratio(p, m, v) <= max_bubble (bubble / ideal time)."""
    if not 0 < max_bubble < 1:
        raise ValueError("max_bubble must be in (0, 1)")
    bubble = bubble_ratio if relative else bubble_fraction
    m = 1
    while bubble(p, m, v) > max_bubble + 1e-12:
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


__all__ = ["best_microbatches", "boundary_bytes", "bubble_fraction", "bubble_ratio",
           "fixed_batch_step_time", "ideal_step_time", "imbalanced_step_time",
           "in_flight_microbatches", "microbatch_time", "min_microbatches"]
