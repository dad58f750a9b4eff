"""The long-runs chapter's numbers and choices: the bytes one rank writes to a checkpoint, how
often to write one (Young's interval, from a save time and a failure rate), and what a resume
that forgets Adam's step count does to the next updates."""

from __future__ import annotations

import math

from parlib.cost.checkpoint import checkpoint_bytes, young_daly_interval
from parlib.course.on_ranks import factor_mistakes
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

# --------------------------------------------------------------------------- bytes per rank

_P, _D = 7e9, 8
_FSDP = checkpoint_bytes(_P, "fsdp", {"dp": _D}, mixed_precision=True).per_rank
_ZERO1 = checkpoint_bytes(_P, "zero1", {"dp": _D}, mixed_precision=True).per_rank
_FP32 = checkpoint_bytes(_P, "fsdp", {"dp": _D}).per_rank

register(Numeric(
    "09.checkpoint_bytes",
    _FSDP,
    unit="bytes",
    prompt=f"""
        A model of P = {_P:.0e} parameters trains with Adam in mixed precision (bf16
        weights, fp32 master weights and both moments) under FSDP on d = {_D} ranks. A
        checkpoint holds what the next step needs and nothing it recomputes. How many
        bytes does one rank write to it? Leave out the step counters, the data position and
        the RNG states (a few bytes each). Give a number in bytes.
    """,
    working=f"""
        Saved per parameter: the bf16 weight (2 bytes), the fp32 master weight (4) and
        Adam's two fp32 moments (8): 14 bytes. The gradients are not saved: the next step
        recomputes them. FSDP shards all of it over the d = {_D} ranks:

        14 x {_P:.0e} / {_D} = **{_FSDP:,.0f} bytes** per rank
        (parlib.cost.checkpoint_bytes(P, "fsdp", {{"dp": {_D}}}, mixed_precision=True)),
        {14 * _P:,.0f} bytes in all. Under ZeRO-1 the bf16 weights stay whole on every rank
        (one copy of them is written): the busiest rank writes {_ZERO1:,.0f} bytes.
    """,
    mistakes={
        **factor_mistakes(_FSDP, {
            16 / 14: "that counts the gradients too (16 bytes a parameter): a checkpoint "
                     "leaves them out, the next step recomputes them",
            float(_D): "that is the whole checkpoint: FSDP shards the weights and the "
                       "optimizer state, so each rank writes 1/d of it",
            2 / 14: "that is only the bf16 weights: Adam's state (the fp32 master weights "
                    "and both moments) must be saved too, or the resumed run is not the same",
            6 / 14: "that is the bf16 weights and the fp32 master weights: Adam's two "
                    "moments are saved too",
            10 / 14: "that leaves out the fp32 master weights: in mixed precision the "
                     "optimizer steps them, and the bf16 copy alone cannot restore them",
        }),
        _ZERO1: "that is ZeRO-1, where the bf16 weights stay whole on every rank; FSDP "
                "shards them too",
        _FP32: "that is Adam in fp32 (12 bytes a parameter); mixed precision adds the bf16 "
               "copy of the weights (14)",
    },
))

# --------------------------------------------------------------------------- the interval

_GPUS, _GPU_YEARS, _SAVE = 1024, 5, 90.0
_MTBF = _GPU_YEARS * 365 * 24 * 3600 / _GPUS  # the job fails when any GPU fails
_TAU = young_daly_interval(_SAVE, _MTBF)

register(Numeric(
    "09.young_daly",
    _TAU,
    unit="s",
    rtol=1e-2,
    prompt=f"""
        A job runs on {_GPUS} GPUs. Assume each GPU fails on its own at random, on average
        once every {_GPU_YEARS} years (365-day years), and that any one failure stops the
        job. Writing a checkpoint stops training for {_SAVE:.0f} s. Every how many seconds
        of work should the job write a checkpoint, to lose the least time to saving and to
        the work redone after failures (Young's first-order rule)? Give a number in seconds
        (checked to 1%).
    """,
    working=f"""
        The job fails when any of its GPUs does: failures arrive {_GPUS} times as often,
        M = {_GPU_YEARS} x 365 x 24 x 3600 / {_GPUS} = {_MTBF:,.0f} s
        ({_MTBF / 3600:.1f} hours).

        Saving every tau seconds spends delta / tau of the time saving; a failure (rate
        1 / M) loses on average the tau / 2 since the last checkpoint. The sum
        delta / tau + tau / (2M) is smallest where its derivative -delta / tau^2 + 1 / (2M)
        is zero: tau = sqrt(2 delta M) (Young 1974; Daly 2006 adds higher-order terms,
        small while delta << M).

        sqrt(2 x {_SAVE:.0f} x {_MTBF:,.0f}) = **{_TAU:,.0f} s** ({_TAU / 60:.0f} minutes):
        parlib.cost.young_daly_interval({_SAVE:.0f}, M). At it, saving and lost work each
        cost delta / tau = {_SAVE / _TAU:.1%} of the time.
    """,
    mistakes={
        **factor_mistakes(_TAU, {
            math.sqrt(_GPUS): "that uses one GPU's mean time between failures: the job "
                              "stops when any of its GPUs fails, so its own is that "
                              f"divided by {_GPUS}",
            1 / math.sqrt(2): "the minimum of delta / tau + tau / (2M) is at "
                              "sqrt(2 delta M): a failure loses tau / 2 on average, not tau",
            math.sqrt(2): "a failure loses on average half the interval, tau / 2: that "
                          "puts the minimum at sqrt(2 delta M), not sqrt(4 delta M)",
        }),
        _MTBF: "that is the job's mean time between failures itself; the interval balances "
               "it against the save time: sqrt(2 delta M)",
    },
    near=(0.05, "close, but not within 1%: use M in seconds with 365-day years, and the "
                "square root of 2 delta M"),
))

# --------------------------------------------------------------------------- Adam's step


def resumed_update_scale(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """How much smaller (< 1) Adam's update is, t steps after its step count restarted at 0
    on warm moments, than the update of a run whose count is large: Adam divides m by
    1 - beta1^t and v by 1 - beta2^t (under a square root)."""
    return math.sqrt(1 - beta2**t) / (1 - beta1**t)


_SCALES = {t: resumed_update_scale(t) for t in (1, 10, 100, 1000, 5000)}
ADAM_STEP_OPTIONS = {
    "A": "Adam's bias correction starts over on moments that are already warm: the updates "
         "come out several times smaller than those of the uninterrupted run, for "
         "thousands of steps.",
    "B": "The moments start over as well: the first update is a step of the learning rate "
         "in the gradient's sign, as at the start of training.",
    "C": "Nothing changes: the step count only feeds the learning-rate schedule, and the "
         "rate here is constant.",
    "D": "The bias correction divides the warm moments by small numbers again, so the "
         "updates come out several times larger than those of the uninterrupted run, for "
         "thousands of steps.",
}

register(Choice(
    "09.adam_step",
    "A",
    options=ADAM_STEP_OPTIONS,
    prompt="""
        A run trained with Adam (beta1 = 0.9, beta2 = 0.999, a constant learning rate) for
        a week is resumed from a checkpoint that holds the weights, both of Adam's moments
        and the data position, but not Adam's step count: the optimizer counts from 0
        again. What happens to the updates after the resume? Give one letter.
    """,
    working=f"""
        Adam's step count is not only a counter: its update is lr x m_hat / sqrt(v_hat),
        with m_hat = m / (1 - beta1^t) and v_hat = v / (1 - beta2^t), the bias correction
        for moments that start at zero. After a week t is large and both corrections are 1.
        Restarted at t = 1 on moments that are already warm, the update is scaled by
        sqrt(1 - beta2^t) / (1 - beta1^t): {_SCALES[1]:.2f} at t = 1, {_SCALES[10]:.2f} at
        t = 10, {_SCALES[100]:.2f} at t = 100, {_SCALES[1000]:.2f} at t = 1000 and
        {_SCALES[5000]:.2f} at t = 5000. The v correction (beta2 = 0.999) is the larger and
        lasts longer: **A**, updates several times smaller for thousands of steps. The
        resumed run is not the run that never stopped; torch's Adam keeps the count in its
        state ("step"), and a checkpoint saves it with the moments.
    """,
    hints={
        "B": "the moments are in the checkpoint and are loaded; only the step count starts "
             "over",
        "C": "Adam's step count also feeds its bias correction, inside the optimizer: it "
             "divides the moments by 1 - beta^t",
        "D": "both moments are divided: m by 1 - beta1^t and v by 1 - beta2^t under a "
             "square root; with beta2 = 0.999 the second correction is the larger, and "
             "it is in the denominator",
    },
))

__all__ = ["ADAM_STEP_OPTIONS", "resumed_update_scale"]
