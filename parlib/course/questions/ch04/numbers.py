"""The pipeline chapter's numbers and choices: bubbles, microbatches, in-flight activations,
boundary bytes, more stages, the data-parallel sync of a pipeline."""

from __future__ import annotations

from parlib.cost import bubble_fraction, min_microbatches, predicted_sent_bytes
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

MiB = 2**20

# --------------------------------------------------------------------------- numeric

register(Numeric(
    "04.bubble_naive",
    bubble_fraction(4, 1),
    prompt="""
        Four stages in a line run one batch with no microbatches (m = 1): each stage does
        its forward, then the backward comes back. What fraction of the step is each
        stage idle? Give a number between 0 and 1.
    """,
    working="""
        Count time in slots of one stage's forward + backward of the batch. The step lasts
        m + p - 1 = 1 + 3 = 4 slots (the work passes through the 4 stages one after the
        other) and each stage works in 1 of them, so the idle fraction is

        (p - 1) / (m + p - 1) = 3 / 4 = **0.75**.

        Three quarters of the machine you pay for waits: that is the pipeline bubble.
    """,
    mistakes={
        0.25: "that is the fraction each stage is busy; the question asks for the idle part",
        3.0: "give a fraction of the step (between 0 and 1), not a number of slots",
        1.0: "each stage does work in one slot of the step: it is not idle all the time",
    },
))

register(Numeric(
    "04.bubble",
    bubble_fraction(4, 8),
    prompt="""
        The same four stages now cut the batch into m = 8 microbatches and run GPipe (all
        forwards, then all backwards). What fraction of the step is a stage idle? Give a
        number between 0 and 1 (a fraction such as 1/5 is fine).
    """,
    working="""
        The step now lasts m + p - 1 = 8 + 3 = 11 slots of one microbatch's forward +
        backward, and every stage works in m = 8 of them:

        bubble = (p - 1) / (m + p - 1) = 3 / 11 = **0.2727**.

        Compare 3/4 with m = 1: the p - 1 = 3 slots of filling and draining stay, but they
        are now shared by 8 slots of work instead of 1.
    """,
    mistakes={
        3 / 8: "3/8 = (p-1)/m is the bubble relative to the ideal (bubble-free) time; the "
               "question asks for the fraction of the whole step, (p-1)/(m+p-1)",
        8 / 11: "that is the fraction a stage is busy; the idle part is 1 minus it",
        4 / 12: "the step lasts m + p - 1 slots, not m + p",
        3 / 12: "the step lasts m + p - 1 = 11 slots, not m + p = 12",
        0.75: "that is the bubble with m = 1; with 8 microbatches the fill/drain is shared",
    },
))

# "the bubble under 10%" read as the other definition, bubble / ideal time = (p-1)/m
_MIN_M_RELATIVE = min_microbatches(8, 0.1 - 1e-9, relative=True)

register(Numeric(
    "04.min_microbatches",
    min_microbatches(8, 0.1 - 1e-9),
    rtol=0.0,
    atol=0.0,
    unit="microbatches",
    prompt="""
        A pipeline has p = 8 stages and runs GPipe (or 1F1B). What is the smallest number of
        microbatches m that keeps the bubble under 10% of the step (strictly below 0.1)?
        Give a whole number.
    """,
    working="""
        The bubble here is the idle fraction **of the step**, (p - 1) / (m + p - 1) (not the
        bubble relative to the ideal time, (p - 1) / m). Solve
        (p - 1) / (m + p - 1) < 0.1 with p = 8:

        7 / (m + 7) < 0.1  <=>  m + 7 > 70  <=>  m > 63, so **m = 64**.

        With m = 63 the bubble is 7/70 = exactly 10%. A rule of thumb follows: m must be
        about 9 x (p - 1) for a 10% bubble, so deep pipelines need many microbatches, and
        each microbatch must stay large enough to keep a device busy.
    """,
    mistakes={
        63: "with m = 63 the bubble is 7/70 = 0.1 exactly, not under it",
        70: "70 is m + p - 1; subtract p - 1 = 7",
        _MIN_M_RELATIVE: "that solves (p-1)/m < 0.1, the bubble relative to the ideal "
                         "(bubble-free) time; this question uses the fraction of the whole "
                         "step, (p-1)/(m+p-1) < 0.1",
        7: "7 = p - 1 is the number of fill/drain slots, not the microbatches needed",
    },
))

register(Numeric(
    "04.gpipe_inflight",
    8,
    rtol=0.0,
    unit="microbatches",
    prompt="""
        p = 4 stages, m = 8 microbatches, GPipe. At its peak, how many microbatches'
        activations does the first stage (rank 0) hold for the backward? Give a whole
        number of microbatches.
    """,
    working="""
        GPipe runs every forward before any backward, so all m = **8** microbatches have
        saved their activations when the first backward starts: the peak, counted in
        microbatches, is m. In bytes it depends on how the batch is cut: with the batch
        fixed, m microbatches of B/m rows add up to the whole batch's activations for any
        m; with the microbatch size fixed (the usual way to grow m), the bytes grow with m.
    """,
    mistakes={
        4: "that is 1F1B's peak on rank 0; GPipe starts no backward until all forwards ran",
        1: "GPipe keeps every microbatch's activations until its backward",
        3: "GPipe runs all m forwards before the first backward",
    },
))

register(Numeric(
    "04.1f1b_inflight",
    4,
    rtol=0.0,
    unit="microbatches",
    prompt="""
        The same pipeline (p = 4, m = 8) runs 1F1B instead: rank r does p - 1 - r warm-up
        forwards, then alternates one forward and one backward. At its peak, how many
        microbatches' activations does the first stage (rank 0) hold? Give a whole number.
    """,
    working="""
        Rank 0 does p - 1 - 0 = 3 warm-up forwards, then the forward of a 4th microbatch
        before its first backward (of microbatch 0). From then on every forward is followed
        by a backward, so the count never goes above **4** = p - rank. The last stage holds
        1 at a time. Unlike GPipe (8 here), the peak does not grow with m.
    """,
    mistakes={
        3: "after the 3 warm-up forwards, rank 0 runs one more forward before its first "
           "backward",
        8: "that is GPipe's peak: 1F1B starts backwards before all forwards have run",
        1: "that is the last stage's peak; rank 0 has p - 1 = 3 warm-up forwards",
        2: "count the warm-up forwards (p - 1 - rank) plus the one before the first backward",
    },
))

_B, _S, _H = 16, 1024, 4096
register(Numeric(
    "04.boundary_bytes",
    2 * _B * _S * _H * 2,
    unit="bytes",
    prompt="""
        A pipeline stage boundary on a model with hidden size h = 4096, sequence length
        s = 1024, a global batch of B = 16 sequences cut into m = 8 microbatches, with
        activations and their gradients in bf16 (2 bytes). How many bytes cross that one
        boundary per training step, counting both directions? Give a number in bytes.
    """,
    working="""
        Forward: each microbatch sends its hidden states, (B/m) x s x h values; the m
        microbatches add up to the batch: B x s x h = 16 x 1024 x 4096 = 67,108,864 values,
        x 2 bytes = 128 MiB.

        Backward: the gradient of those hidden states has the same shape: another 128 MiB.

        Total **268,435,456 bytes** (256 MiB) per step, whatever m is. Compare data
        parallelism, whose bill (an all-reduce of every gradient) grows with the number of
        parameters instead.
    """,
    mistakes={
        _B * _S * _H * 2: "that is one direction; the gradients come back the same way "
                          "(or, if you counted values in both directions, multiply by 2 "
                          "bytes per bf16 value)",
        2 * _B * _S * _H * 2 * 8: "the microbatches are slices of the batch: m does not "
                                  "multiply the bytes",
        2 * _B * _S * _H * 4: "bf16 is 2 bytes per value, not 4",
        2 * _B * _S * _H * 2 // 8: "each microbatch carries B/m rows; all m of them cross",
        256: "that is in MiB; give bytes",
    },
))

register(Choice(
    "04.more_stages",
    "B",
    options={
        "A": "Adding stages removes the bubble, as long as every stage gets the same number "
             "of layers.",
        "B": "Each extra stage adds a slot of fill and of drain: the idle fraction grows "
             "with p.",
        "C": "The bubble is caused by slow links between stages; more stages do not make "
             "links faster.",
        "D": "The bubble is caused by the gradient all-reduce at the end of the step, which "
             "more stages do not shorten.",
    },
    prompt="""
        A colleague proposes to remove the bubble by cutting the model into more, shorter
        stages ("each stage then finishes sooner"). Why does that not work? Give one letter.
    """,
    working="""
        **B**. With p stages, the first microbatch needs p - 1 slots to reach the last
        stage, and the last one needs p - 1 slots to come back: the fill and drain do not
        depend on how short a stage is, only on how many there are. Shorter stages shrink
        each slot, and the whole step with it, but the idle fraction (p-1)/(m+p-1) grows
        with p: with m = 8, p = 4 gives 3/11 = 27%, p = 8 gives 7/15 = 47%. The bubble
        exists even with infinitely fast links (C) and without any all-reduce (D).
    """,
    hints={
        "A": "try p = 8 instead of 4 with m = 8 in (p-1)/(m+p-1): does the bubble shrink?",
        "C": "the bubble appears in the timelines even with instant links: it is stages "
             "waiting for work, not for bytes",
        "D": "a pipeline alone has no all-reduce; the bubble is the pipe filling and draining",
    },
))

_P_DP, _D_DP, _PARAMS_DP = 4, 2, 8_000_000_000
_DP_BYTES = predicted_sent_bytes("all_reduce", 4 * _PARAMS_DP / _P_DP, _D_DP)
register(Choice(
    "04.dp_pp_sync",
    "C",
    options={
        "A": "After every microbatch's backward, all 8 ranks all-reduce all their gradients.",
        "B": "Once per step, all 8 ranks all-reduce the whole model's gradients together.",
        "C": "Once per step: each stage with its twin stage in the other copy.",
        "D": "Never: the pipeline's send and recv already carry the gradients between the "
             "copies.",
    },
    prompt="""
        You run d = 2 copies of a p = 4 stage pipeline on 8 ranks (data parallelism on top
        of pipeline parallelism). When, and between which ranks, are the gradients
        averaged? Give one letter.
    """,
    working=f"""
        **C**. Stage i of both copies holds the same layers, so only those two ranks share
        parameters: they form a data-parallel group of d = 2 ranks, one group per stage.
        A stage's gradients are complete only after the flush, when the last microbatch's
        backward has run on it; syncing after each microbatch (A) would send them m times.
        Each group all-reduces 1/p of the parameters. For a model of P = 8e9 parameters
        with fp32 gradients, a rank sends 2(d-1)/d x 4 bytes x P/p = {_DP_BYTES:,.0f}
        bytes per step: 1/p of what plain data parallelism on the whole model sends. A
        stage can start its all-reduce as soon as its own last backward ends, overlapping
        the drain of the stages before it. The pipeline's messages (D) carry activations and their
        gradients between stages of one copy, never parameter gradients between copies.
    """,
    hints={
        "A": "a stage's gradients accumulate over the m microbatches: they are complete "
             "only after the last backward of the step",
        "B": "only ranks that hold the same layers share parameters: which ranks hold "
             "stage 2's layers?",
        "D": "send and recv in a pipeline move activations and their gradients along one "
             "copy; which ranks hold the same parameters?",
    },
))
