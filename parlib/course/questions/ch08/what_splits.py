"""The choosing chapter's practice set: what each strategy splits and communicates, and
what a data-parallel step sends."""

from __future__ import annotations

from parlib.cost import (
    predicted_sent_bytes,
)
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30


# --------------------------------------------------------------------------- what splits

register(Choice(
    "08.what_tp_splits",
    "D",
    options={
        "A": "the batch; it all-reduces the gradients once per step, after the backward",
        "B": "the optimizer state and gradients; it gathers parameters before each use",
        "C": "the layers into consecutive stages; it sends activations across each "
             "stage boundary",
        "D": "the weight matrices in each layer; it all-reduces activations in every layer",
    },
    prompt="""
        What does tensor (model) parallelism split, and what must it communicate?
        Give one letter.
    """,
    working="""
        **D.** Every rank holds a slice of each weight matrix (columns of one matmul, rows
        of the next), computes a partial result and the ranks combine it inside the layer:
        two all-reduces of the (b, s, h) activations per transformer layer in forward and
        two in backward. That is why it "talks constantly and wants fast links".
        A is data parallelism, C pipeline parallelism, B ZeRO-3 / FSDP.
    """,
    hints={
        "A": "that is data parallelism: a whole copy of the model on every rank",
        "C": "that is pipeline parallelism: whole layers per rank",
        "B": "that is ZeRO-3 / FSDP, a memory-saving form of data parallelism",
    },
))

_P_DP, _N_DP = 1.3e9, 8
_DP_BYTES = predicted_sent_bytes("all_reduce", 2 * _P_DP, _N_DP)  # bf16 gradients

register(Numeric(
    "08.dp_bytes",
    _DP_BYTES,
    unit="bytes",
    prompt="""
        A 1.3-billion-parameter model trains with data parallelism on N = 8 ranks; the
        gradients are bf16 (2 bytes each) and are pooled with one ring all-reduce per step.
        How many bytes does each rank send per step? Give a number of bytes.
    """,
    working="""
        The message is the whole gradient: 2 bytes x 1.3e9 = 2.6e9 bytes. A ring
        all-reduce is a reduce-scatter plus an all-gather; each sends (N-1)/N of the
        message, so every rank sends

        2 (N-1)/N x 2.6e9 = 2 x 7/8 x 2.6e9 = **4.55e9 bytes** (about 4.2 GiB),

        whatever N is beyond a few ranks: the ring's bytes per rank barely grow with N.
    """,
    mistakes={
        _DP_BYTES / 2: "that is one pass of the ring; an all-reduce is a reduce-scatter "
                       "AND an all-gather: 2(N-1)/N of the message",
        2 * _DP_BYTES: "the gradients are bf16, 2 bytes each, not fp32",
        2.6e9: "that is the gradient's size; the ring sends 2(N-1)/N of it per rank",
        2 * 2.6e9: "close: the factor is 2(N-1)/N, not 2",
        7 * 2.6e9: "each ring step sends 1/N of the message, not all of it",
        _DP_BYTES / 1e9: "that is in GB; give the number of bytes",
        _DP_BYTES / GiB: "that is in GiB; give the number of bytes",
    },
))

_LINK_GBITS = 200
_DP_SECONDS = _DP_BYTES / (_LINK_GBITS * 1e9 / 8)

register(Numeric(
    "08.dp_seconds",
    _DP_SECONDS,
    unit="seconds",
    rtol=2e-3,
    prompt="""
        The ranks of the previous question sit in 8 different nodes joined by InfiniBand
        at 200 Gb/s (gigabits per second) per node. Ignoring latency, how long does the
        gradient all-reduce of one step take? Give seconds.
    """,
    working="""
        200 Gb/s is 200 / 8 = 25 GB/s = 25e9 bytes/s. Each rank sends 4.55e9 bytes, and
        the ring sends over every link at once, so the time is

        4.55e9 / 25e9 = **0.182 s** per step.

        If one step's backward takes less than that, the run is bandwidth-bound: overlap
        cannot hide the sync, and a bigger per-rank batch (or gradient accumulation) makes
        each synced byte pay for more compute.
    """,
    mistakes={
        _DP_SECONDS / 8: "200 Gb/s is gigaBITS per second: divide by 8 for bytes",
        _DP_SECONDS / 2: "each rank sends 2(N-1)/N of the gradient, not (N-1)/N",
        _DP_SECONDS * 8 / 7: "use the bytes a rank sends, 2(N-1)/N of the message",
    },
))
