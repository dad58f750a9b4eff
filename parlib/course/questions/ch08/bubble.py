"""The choosing chapter's practice set: what the pipeline bubble is and how to shrink it."""

from __future__ import annotations

from parlib.cost import (
    bubble_fraction,
    ideal_step_time,
)
from parlib.course.question_types import Choice, Numeric, RoundedFraction
from parlib.course.registry import register

# --------------------------------------------------------------------------- the bubble

register(RoundedFraction(
    "08.seed_bubble",
    bubble_fraction(4, 8),
    prompt="""
        Four stages in a line, one batch cut into eight microbatches, GPipe or 1F1B. What
        fraction of the step is each stage idle? Give a number between 0 and 1, to two
        digits or more (an answer is judged by the rounding of the digits you give).
    """,
    working="""
        The step lasts m + p - 1 = 11 slots of one microbatch's forward + backward and
        every stage works in m = 8 of them: (p - 1) / (m + p - 1) = 3 / 11 = **0.273**.
    """,
    mistakes={
        3 / 8: "(p-1)/m = 3/8 is the bubble relative to the ideal time; as a fraction of "
               "the whole step it is (p-1)/(m+p-1)",
        8 / 11: "that is the busy fraction",
        3 / 12: "the step lasts m + p - 1 slots, not m + p",
        0.75: "that is with one microbatch",
    },
))

register(Numeric(
    "08.microbatch_speedup",
    ideal_step_time(4, 1, 1.0) / ideal_step_time(4, 8, 1 / 8),
    prompt="""
        The same four-stage pipeline and the same batch: first run as one batch (m = 1),
        then cut into m = 8 microbatches (each doing 1/8 of the work). Ignoring per-call
        overheads and communication, how many times faster is the step with m = 8?
        Give a number.
    """,
    working="""
        Let T be one stage's forward + backward of the whole batch. With m microbatches a
        slot takes T/m and the step lasts (m + p - 1) slots:

        m = 1: 4 T;  m = 8: 11 T / 8 = 1.375 T;  speed-up 4 / 1.375 = **2.91x**.

        The limit for large m is p = 4x. On a real device tiny microbatches under-use it
        (a fixed cost per call), which stops the gain before that.
    """,
    mistakes={
        8.0: "the fill and drain (p - 1 slots) remain, each now T/m long",
        4.0: "that is the limit for very many microbatches",
        11 / 8: "that is the m = 8 step time in units of T; compare it with m = 1's 4 T",
    },
))

register(Choice(
    "08.shrink_bubble",
    "A",
    options={
        "A": "more, smaller microbatches per step, or v interleaved chunks per rank",
        "B": "more pipeline stages, so that each stage does less of the work",
        "C": "fewer, larger microbatches, so each stage computes longer between waits",
        "D": "a faster link between the stages, so activations arrive sooner",
    },
    prompt="""
        A pipeline of p stages runs m microbatches per step and its stages sit idle for
        part of every step. Which change shrinks that idle fraction? Give one letter.
    """,
    working="""
        **A.** The bubble is (p - 1) / (v m + p - 1) of the step: the p - 1 slots of fill
        and drain are shared by more slots of work when m grows, and interleaving gives
        every rank v chunks, so the fill and drain slots are v times shorter. More stages
        (B) add fill/drain slots, fewer microbatches (C) share them among less work, and a
        faster link (D) shortens the sends, not the idle slots.
    """,
    hints={
        "B": "each extra stage adds a slot of fill and of drain",
        "C": "fewer microbatches share the same fill/drain among less work",
        "D": "the bubble is idle compute slots; a faster link shortens the sends only",
    },
))
