"""The pipeline chapter's numbers and choices: bubbles, microbatches, in-flight activations,
boundary bytes, more stages, the data-parallel sync of a pipeline."""

from __future__ import annotations

from parlib.cost import (
    bubble_fraction,
    bubble_ratio,
    messages_per_rank,
    min_microbatches,
    predicted_sent_bytes,
    schedule_compute_time,
)
from parlib.course.question_types import Choice, Numeric, RoundedFraction
from parlib.course.registry import register

MiB = 2**20

# --------------------------------------------------------------------------- numeric

register(RoundedFraction(
    "04.bubble_naive",
    bubble_fraction(4, 1),
    prompt="""
        Four stages in a line run one batch with no microbatches (m = 1): each stage does
        its forward, then the backward comes back. What fraction of the step is each
        stage idle? Give a number between 0 and 1, to two digits or more (an answer is
        judged by the rounding of the digits you give).
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

register(RoundedFraction(
    "04.bubble",
    bubble_fraction(4, 8),
    prompt="""
        The same four stages now cut the batch into m = 8 microbatches and run GPipe (all
        forwards, then all backwards). What fraction of the step is a stage idle? Give a
        number between 0 and 1, to two digits or more (an answer is judged by the rounding
        of the digits you give; a fraction such as 1/5 is fine).
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
    "A",
    options={
        "A": "Each extra stage adds one more slot of fill and one of drain: the idle "
             "fraction grows with p.",
        "B": "Adding stages removes the bubble, as long as every stage gets the same number "
             "of layers.",
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
        **A**. With p stages, the first microbatch needs p - 1 slots to reach the last
        stage, and the last one needs p - 1 slots to come back: the fill and drain do not
        depend on how short a stage is, only on how many there are. Shorter stages shrink
        each slot, and the whole step with it, but the idle fraction (p-1)/(m+p-1) grows
        with p: with m = 8, p = 4 gives 3/11 = 27%, p = 8 gives 7/15 = 47%. The bubble
        exists even with infinitely fast links (C) and without any all-reduce (D).
    """,
    hints={
        "B": "try p = 8 instead of 4 with m = 8 in (p-1)/(m+p-1): does the bubble shrink?",
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
        "C": "Once per step: each stage all-reduces with its twin stage in the other copy.",
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


# --------------------------------------------------------------------------- part two: schedules

_P_IL, _M_IL, _V_IL = 4, 8, 2

register(RoundedFraction(
    "04.interleaved_bubble",
    bubble_fraction(_P_IL, _M_IL, _V_IL),
    prompt="""
        p = 4 ranks, m = 8 microbatches, and each rank now holds v = 2 model chunks
        (interleaved 1F1B: rank r holds virtual stages r and r + 4, each half of its old
        stage's layers). In the ideal timeline (equal chunk times, instant messages), what
        fraction of the step is a rank idle? Give a number between 0 and 1, to two digits
        or more (an answer is judged by the rounding of the digits you give).
    """,
    working=f"""
        Count in slots of one chunk's forward + backward of one microbatch: half a stage's
        slot. A rank has v x m = 16 such slots of work per step. The fill and the drain
        still take p - 1 = 3 slots, but of a chunk, not of a whole stage, so the step lasts
        v m + p - 1 = 19 chunk slots:

        bubble = (p - 1) / (v m + p - 1) = 3 / 19 = **{bubble_fraction(_P_IL, _M_IL, _V_IL):.4f}**,

        against 3/11 = {bubble_fraction(_P_IL, _M_IL):.4f} with one chunk per rank. Relative to the
        ideal time, the bubble went from (p-1)/m = {bubble_ratio(_P_IL, _M_IL):.3f} to
        (p-1)/(v m) = {bubble_ratio(_P_IL, _M_IL, _V_IL):.4f}: divided by v.
    """,
    mistakes={
        bubble_fraction(_P_IL, _M_IL): "that is 1F1B's bubble with one chunk per rank: with v "
                                       "chunks each fill/drain slot lasts 1/v as long",
        bubble_ratio(_P_IL, _M_IL, _V_IL): "3/16 = (p-1)/(v m) is the bubble relative to the "
                                           "ideal (bubble-free) time; the question asks for "
                                           "the fraction of the whole step",
        bubble_fraction(_P_IL, _M_IL) / _V_IL: "the bubble time is divided by v, but so the "
                                               "step is shorter too: recount the step in "
                                               "chunk slots",
        bubble_fraction(_P_IL * _V_IL, _M_IL): "the fill takes p - 1 chunk slots, not "
                                               "p v - 1: the ranks work on the first chunks "
                                               "of the next microbatches meanwhile",
    },
))


# activations and gradients sent in one step by all ranks together (headers not counted)
_MSG_1F1B = sum(messages_per_rank("1f1b", _P_IL, _M_IL).values())
_MSG_IL = sum(messages_per_rank("interleaved", _P_IL, _M_IL, _V_IL).values())

register(Numeric(
    "04.interleaved_messages",
    _MSG_IL - _MSG_1F1B,
    rtol=0.0,
    unit="messages",
    prompt="""
        The same pipeline (p = 4, m = 8) runs interleaved 1F1B with v = 2 chunks per rank
        instead of 1F1B. Count the point-to-point messages of one step, all ranks
        together: each activation sent forward and each gradient sent back is one message
        (leave out any small header the runner sends with it). How many more messages does
        the interleaved step send than the 1F1B step? Give a whole number.
    """,
    working=f"""
        With one chunk per rank the model has p - 1 = 3 boundaries; each of the m = 8
        microbatches crosses each of them once forward and once back:
        2 x m x (p - 1) = {_MSG_1F1B} messages.

        With v = 2 chunks per rank the model is cut into p v = 8 virtual stages, so it has
        p v - 1 = 7 boundaries (rank 3's first chunk hands on to rank 0's second chunk: that
        boundary counts too): 2 x m x (p v - 1) = {_MSG_IL} messages.

        The interleaved step sends **{_MSG_IL - _MSG_1F1B}** more, {_MSG_IL / _MSG_1F1B:.2f} x as
        many: about v times as many, each half as large (a chunk's output is the same
        b x s x h activation). Total bytes grow by the same factor; where a message has a
        fixed latency the extra count costs time too.
    """,
    mistakes={
        _MSG_IL: f"that is the interleaved step's total; the question asks how many more "
                 f"than 1F1B's {_MSG_1F1B}",
        (_V_IL - 1) * _MSG_1F1B: "that assumes v times as many messages as 1F1B, v (p - 1) "
                                 "boundaries; the model cut in p v virtual stages has "
                                 "p v - 1 boundaries: the one from the last rank back to "
                                 "the first counts too",
        (_MSG_IL - _MSG_1F1B) // 2: "count both directions: each activation sent forward has "
                                    "a gradient sent back",
        2 * (_MSG_IL - _MSG_1F1B): "leave out the header: count one message per activation or "
                                   "gradient",
    },
))


def _idle_per_rank(name: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """A rank's idle time per step under ``name`` (t_b the full backward, t_w its weight
    part): the predicted step with instant messages less the rank's own work."""
    if name == "zb-h1":  # its B op is the input-gradient part only
        step = schedule_compute_time(name, p, m, t_f, t_b - t_w, t_w)
    else:
        step = schedule_compute_time(name, p, m, t_f, t_b)
    return step - m * (t_f + t_b)


_P_ZB, _M_ZB, _TF, _TB, _TW = 4, 8, 1.0, 2.0, 0.8
_IDLE_1F1B = _idle_per_rank("1f1b", _P_ZB, _M_ZB, _TF, _TB, _TW)
_IDLE_ZB = _idle_per_rank("zb-h1", _P_ZB, _M_ZB, _TF, _TB, _TW)
_IDLE_ZB_EQUAL = _idle_per_rank("zb-h1", _P_ZB, _M_ZB, _TF, _TB, _TB / 2)

register(RoundedFraction(
    "04.zb_removed",
    1 - _IDLE_ZB / _IDLE_1F1B,
    prompt="""
        p = 4 stages, m = 8 microbatches. On one stage a microbatch's forward takes
        t_f = 1 ms and its full backward t_b = 2 ms, of which t_w = 0.8 ms computes the
        weight gradients and 1.2 ms the input gradient. ZB-H1 splits the backward into
        B (input gradient) and W (weight gradients) and moves the W into the bubble,
        keeping 1F1B's memory. What fraction of 1F1B's bubble (a rank's idle time per
        step) does ZB-H1 remove? Give a number between 0 and 1, to two digits or more (an
        answer is judged by the rounding of the digits you give).
    """,
    working=f"""
        1F1B's idle time per rank is p - 1 = 3 slots of a stage's forward + full backward:
        3 x (1 + 2) = **{_IDLE_1F1B:g} ms**.

        ZB-H1 (Qi et al., 2023) shortens it twice. The gradient that travels back now
        leaves after B (t_b - t_w = 1.2 ms) instead of the full backward, and each rank
        fills the waits of the cool-down with its deferred W: each of the p - 1 slots loses
        t_w twice, leaving 3 x (1 + 2 - 2 x 0.8) = **{_IDLE_ZB:g} ms** (what
        `parlib.cost.schedule_compute_time` predicts, and the simulator draws for
        `schedules.zb_h1`).

        Removed: 1 - {_IDLE_ZB:g} / {_IDLE_1F1B:g} = **{1 - _IDLE_ZB / _IDLE_1F1B:.4f}**, i.e.
        2 t_w / (t_f + t_b). With B and W equal to the forward (t_w = 1 ms) it would remove
        {1 - _IDLE_ZB_EQUAL / _IDLE_1F1B:.3f}, leaving a third of the bubble, as the paper says.
    """,
    mistakes={
        _IDLE_ZB / _IDLE_1F1B: "that is the share of 1F1B's bubble that is left; the "
                               "question asks for the share removed",
        1 - _IDLE_ZB_EQUAL / _IDLE_1F1B: "2/3 holds when B, W and F all take the same time; "
                                         "here t_w = 0.8 ms of the 2 ms backward",
        _TW / (_TF + _TB): "the W are moved out of each of the p - 1 slots, and the gradient "
                           "also travels back sooner (after B, not after B + W): t_w counts "
                           "twice per slot",
        _IDLE_1F1B - _IDLE_ZB: "give a fraction of 1F1B's bubble, not the time in ms",
    },
))

_P_MEM, _M_MEM, _LIMIT = 4, 16, 4


def _schedule_peak(name: str, p: int, m: int, v: int = 2) -> int:
    from parlib.strategies.schedules import all_ranks, peak_in_flight

    return max(peak_in_flight(ops) for ops in all_ranks(name, p, m, v).values())


_PEAKS = {name: _schedule_peak(name, _P_MEM, _M_MEM)
          for name in ("gpipe", "1f1b", "zb-h1", "interleaved")}
_IL_PEAK, _IL_BUBBLE = _PEAKS["interleaved"], bubble_fraction(_P_MEM, _M_MEM, 2)

register(Choice(
    "04.schedule_for_memory",
    "D",
    options={
        "A": "GPipe: it keeps every microbatch until the flush, so it never stalls.",
        "B": "Interleaved 1F1B, v = 2: it divides the bubble by v at the same peak.",
        "C": "1F1B: no schedule with its bubble holds fewer than p microbatches.",
        "D": "ZB-H1: it keeps 1F1B's peak, and it fills the cool-down with the W.",
    },
    prompt="""
        p = 4 stages, m = 16 microbatches. Each rank has room for the saved activations of
        at most 4 microbatches of its stage (a chunk of an interleaved schedule holds half a
        stage's layers, so one of its microbatches counts as half). Of the schedules that
        fit, which has the smallest bubble? Give one letter.
    """,
    working=f"""
        **D**. Count the peak on the first rank, which holds the most. GPipe holds all
        m = {_PEAKS['gpipe']} microbatches: it does not fit. 1F1B holds p = {_PEAKS['1f1b']}: it
        fits, with a bubble of {bubble_fraction(_P_MEM, _M_MEM):.3f} of the step. ZB-H1 holds
        the same {_PEAKS['zb-h1']} (a microbatch counts until its W, and each W runs before
        the next forward) and its bubble is about a third of 1F1B's (t_f = B = W). Interleaved
        1F1B with v = 2 would have the smallest bubble ({_IL_BUBBLE:.3f}), but its first rank
        holds {_IL_PEAK} chunk-microbatches, {_IL_PEAK / 2:g} stage-microbatches' worth: its
        longer warm-up does not fit in 4.
    """,
    hints={
        "A": "GPipe holds the activations of all m microbatches at its peak: does 16 fit in 4?",
        "C": "1F1B fits, but another schedule holds exactly as much and waits less",
        "B": "count the interleaved schedule's warm-up forwards on rank 0: each chunk "
             "microbatch counts half, but there are more than 8 of them",
    },
))
