"""Pipeline formulas: the bubble, the ideal step time, the bytes crossing a boundary.

p stages, m microbatches per step, v model chunks per rank (interleaved schedules).
GPipe and 1F1B keep each stage busy m of the m + p - 1 slots of a step; 1F1B also caps
the microbatches a stage holds in flight at p.
"""

from __future__ import annotations

from parlib.cost.collectives import message_time


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


# ------------------------------------------------------------------ messages and step time

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
# The runner sends a small header (kind, microbatch, chunk: three int64) before each
# payload, so that neighbours that disagree on the order fail loudly; it is a message too.
HEADER_BYTES = 3 * 8


def _check_schedule(name: str, p: int, m: int, v: int) -> None:
    if name not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; pick one of {PIPELINE_SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}")
    if name == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs m to be a multiple of p "
                         f"(m={m}, p={p})")
    if name != "interleaved" and v != 1:
        raise ValueError(f"{name} runs one model chunk per rank: v must be 1, got v={v}")


def messages_per_rank(name: str, p: int, m: int, v: int = 1, *,
                      headers: bool = False) -> dict[int, int]:
    """Point-to-point messages each rank sends in one step: ``{rank: count}``.

    Every forward sends its activation on and every backward (B; a W sends nothing) sends
    its input's gradient back, except at the model's two ends: rank r sends m activations
    unless it holds the last stage and m gradients unless it holds the first, so 1F1B,
    GPipe and ZB-H1 give m, 2m, ..., 2m, m. With v chunks per rank each rank holds v
    virtual stages and sends v times as many: 2vm, less m on the first and the last rank.
    ``headers``: count the runner's header message before each payload too (twice as many).
    Example: p = 4, m = 8 gives {0: 8, 1: 16, 2: 16, 3: 8}; interleaved v = 2 {0: 24, 1: 32,
    2: 32, 3: 24}.
    """
    _check_schedule(name, p, m, v)
    per_header = 2 if headers else 1
    if p == 1 and v == 1:
        return {0: 0}
    out = {}
    for r in range(p):
        sends = 2 * v * m - (m if r == 0 else 0) - (m if r == p - 1 else 0)
        out[r] = sends * per_header
    return out


def critical_path_messages(name: str, p: int, m: int, v: int = 1) -> int:
    """Boundary crossings on a step's critical path: how many message times a step of
    ``name`` takes longer than its compute alone, when a crossing takes c, at most half the
    shortest op (read off the longest path of the simulator's replay with message time c,
    and equal to it for p = 2..5, m = 1..12 and several op times; see the tests).

    * GPipe: 2(p - 1), whatever m: the first microbatch crosses p - 1 boundaries going
      forward and its gradient p - 1 coming back; every later one queues behind it, so its
      messages overlap the compute of the microbatch ahead.
    * 1F1B: 2(p - 1) + 2 floor((p - 1)(m - 1)/p). Each rank may hold only p microbatches,
      so in the steady state a stage waits for gradients: the loop from stage 0 to the last
      stage and back crosses 2(p - 1) boundaries and carries p microbatches, about
      2(p - 1)/p crossings per microbatch after the first. Grows with m.
    * Interleaved (v chunks): 2(vp - 1): the fill and drain of a pipeline of vp virtual
      stages, v times as many boundaries as GPipe's (less the model's ends). The staggered
      warm-up keeps a chunk of work ready while a message travels, so it does not grow with m.
    * ZB-H1: 1F1B's count, but at most 4(p - 1): the deferred W ops fill the waits of the
      steady state, so once m > p no more crossings are added.

    Each crossing in the runner is a header and the payload, in flight together: charge
    :func:`crossing_time` per crossing.
    """
    _check_schedule(name, p, m, v)
    if name == "gpipe":
        return 2 * (p - 1)
    if name == "interleaved":
        return 2 * (v * p - 1)
    one_f_one_b = 2 * (p - 1) + 2 * ((p - 1) * (m - 1) // p)
    if name == "1f1b":
        return one_f_one_b
    return min(one_f_one_b, 4 * (p - 1))


def crossing_time(payload_bytes: float, alpha: float, beta: float,
                  header_bytes: float = HEADER_BYTES) -> float:
    """Time one boundary crossing of the runner takes: its header and its payload travel
    together (the receiver posts both receives an op ahead, the sender sends both at once),
    so one message time of their bytes, alpha + beta x (header + payload) (the launching
    chapter's model, ``message_time``)."""
    if payload_bytes < 0 or alpha < 0 or beta < 0:
        raise ValueError(f"need bytes, alpha, beta >= 0, got {payload_bytes}, {alpha}, {beta}")
    return message_time(header_bytes + payload_bytes, alpha, beta)


def schedule_compute_time(name: str, p: int, m: int, t_f: float, t_b: float,
                          t_w: float = 0.0, v: int = 1) -> float:
    """Step time of ``name`` with instant messages; t_f, t_b, t_w: the time of one F, B and
    W op (one microbatch on one chunk; t_b is the full backward, or only the input's
    gradient for ZB-H1, whose W takes t_w).

    * GPipe, 1F1B: (m + p - 1)(t_f + t_b): every rank works m of m + p - 1 slots.
    * Interleaved: (vm + p - 1)(t_f + t_b): vm ops per rank, each 1/v of a stage's work,
      so the fill costs (p - 1)/v of a stage's slot.
    * ZB-H1: (m + p - 1)(t_f + t_b) + max(1, m - p + 1) t_w: the Ws of the first p - 1
      microbatches fill the bubble of the cool-down; only the last rank's remaining Ws
      (and, for m <= p, one W on the first rank at the very end) add to the step.
    """
    _check_schedule(name, p, m, v)
    if min(t_f, t_b, t_w) < 0:
        raise ValueError(f"op times must be >= 0, got t_f={t_f}, t_b={t_b}, t_w={t_w}")
    if name == "interleaved":
        return (v * m + p - 1) * (t_f + t_b)
    base = (m + p - 1) * (t_f + t_b)
    if name == "zb-h1":
        return base + max(1, m - p + 1) * t_w
    return base


def messages_per_op(p: int, v: int = 1) -> int:
    """Messages a forward or backward op of the busiest rank handles itself: a receive and a
    send (2) on a rank inside the pipeline; 1 when both ranks are ends (p x v = 2); 0 on one
    stage. A W op handles none."""
    if p < 1 or v < 1:
        raise ValueError(f"need p, v >= 1, got p={p}, v={v}")
    return min(2, p * v - 1)


def schedule_step_time(name: str, p: int, m: int, t_f: float, t_b: float, t_w: float = 0.0,
                       v: int = 1, t_cross: float = 0.0, t_local: float = 0.0) -> float:
    """Predicted step time of ``name``: :func:`schedule_compute_time` plus
    :func:`critical_path_messages` x ``t_cross`` (the time of one boundary crossing,
    :func:`crossing_time`). Equals the simulator's step while t_cross is at most half the
    shortest op; a slower link turns more of the schedule into waiting (more crossings
    surface).

    ``t_local``: the time a rank itself spends in each send or receive, serial with its
    compute (a receive is posted and collected, a send hands the message to the
    transport). Each F and B op then takes :func:`messages_per_op` x t_local longer (the
    busiest ranks' ops, which set the pace), so this part grows with the number of ops:
    (m + p - 1) slots of 2 x 2 messages for GPipe and 1F1B. Default 0: messages cost
    latency only."""
    if t_cross < 0 or t_local < 0:
        raise ValueError(f"t_cross and t_local must be >= 0, got {t_cross}, {t_local}")
    extra = messages_per_op(p, v) * t_local
    return (schedule_compute_time(name, p, m, t_f + extra, t_b + extra, t_w, v)
            + critical_path_messages(name, p, m, v) * t_cross)


def op_times(batch: int, m: int, forward: float, backward: float, per_call: float = 0.0,
             v: int = 1, weight_share: float = 0.0) -> tuple[float, float, float]:
    """(t_f, t_b, t_w) of one op when a batch of ``batch`` rows is cut into m microbatches
    under the emulated stage cost: a stage's forward of b rows takes b x ``forward`` +
    ``per_call`` seconds and its backward b x ``backward`` + ``per_call``. An op of one of
    v chunks takes 1/v of that (per-call part included: the chunk is a v-th of the stage);
    ``weight_share`` > 0 splits the backward into B, (1 - share) of it, and W, the rest.
    Example: B = 8, m = 4, 10 / 20 ms per row, 2 ms per call: (22 ms, 42 ms, 0)."""
    if batch % m:
        raise ValueError(f"a batch of {batch} rows does not split into m={m} microbatches")
    if v < 1:
        raise ValueError(f"v must be >= 1, got {v}")
    if not 0 <= weight_share < 1:
        raise ValueError(f"weight_share must be in [0, 1), got {weight_share}")
    rows = batch / m
    t_f = microbatch_time(rows, forward, per_call) / v
    full_backward = microbatch_time(rows, backward, per_call) / v
    return t_f, full_backward * (1 - weight_share), full_backward * weight_share


__all__ = ["HEADER_BYTES", "PIPELINE_SCHEDULES", "best_microbatches", "boundary_bytes",
           "bubble_fraction", "bubble_ratio", "critical_path_messages", "crossing_time",
           "fixed_batch_step_time", "ideal_step_time", "imbalanced_step_time",
           "in_flight_microbatches", "messages_per_op", "messages_per_rank",
           "microbatch_time", "min_microbatches", "op_times", "schedule_compute_time",
           "schedule_step_time"]
