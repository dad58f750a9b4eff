"""The launching chapter's numbers: ring and all-gather bytes, the alpha-beta time of a
message, the ring formula, the collective data parallelism pays for."""

from __future__ import annotations

from parlib.course.on_ranks import factor_mistakes
from parlib.course.question_types import Choice, Expression, Numeric
from parlib.course.registry import register

MiB = 2**20

# --------------------------------------------------------------------------- numeric

# Ring all-reduce of a float32 tensor of 2^20 elements (4 MiB) on N = 4 ranks.
_RING_N = 4
_RING_BYTES = 4 * MiB
_RING_ANSWER = 2 * (_RING_N - 1) / _RING_N * _RING_BYTES
register(Numeric(
    "00.ring_bytes",
    _RING_ANSWER,
    unit="bytes",
    prompt="""
        A ring all-reduce sums a float32 tensor of 2^20 elements (4 MiB) over N = 4 ranks.
        How many bytes does each rank send? Give a number in bytes.
    """,
    working="""
        The tensor is split into N = 4 chunks of 4 MiB / 4 = 1 MiB.

        * Reduce-scatter: N - 1 = 3 steps, each rank sends one chunk per step: 3 MiB.
        * All-gather: another N - 1 = 3 steps of one chunk: 3 MiB.

        Each rank sends 2(N-1)/N x 4 MiB = 6 MiB = **6,291,456 bytes** (and receives the
        same amount, which is not asked). The factor 2(N-1)/N tends to 2 for large N: the
        bytes per rank hardly grow with the number of ranks, which is why the ring is used.
    """,
    mistakes=factor_mistakes(_RING_ANSWER, {
        2: "you counted the bytes sent and the bytes received; count only sends",
        1 / 2: "that is only the reduce-scatter phase; the all-gather phase sends as much again",
        _RING_N: "each step sends one chunk of size bytes / N, not the whole tensor",
        _RING_N / (_RING_N - 1): "that is the N -> infinity limit 2 x bytes; the factor is "
                                 "2(N-1)/N",
        _RING_N / (2 * (_RING_N - 1)): "a rank sends more than its tensor once: two phases of "
                                       "N-1 chunks each",
        8: "that is in bits; give bytes",
        1 / MiB: "that is in MiB; the answer is asked in bytes",
    }),
))

# Alpha-beta time of one point-to-point message.
_ALPHA = 20e-6  # s
_BW = 10e9  # bytes/s, so beta = 1e-10 s/byte
_MSG = 16 * MiB
register(Numeric(
    "00.p2p_time",
    (_ALPHA + _MSG / _BW) * 1e3,
    unit="ms",
    rtol=2e-3,
    prompt="""
        A link has latency alpha = 20 us and bandwidth 10 GB/s (beta = 1/bandwidth). How
        long does one dist.send of a 16 MiB message take in the alpha-beta model? Give a
        number in milliseconds.
    """,
    working="""
        The alpha-beta model: T(n) = alpha + n beta, with beta = 1 / (10 x 10^9 B/s)
        = 10^-10 s/byte.

        n = 16 MiB = 16 x 2^20 = 16,777,216 bytes, so n beta = 1.6777 ms and

        T = 0.020 ms + 1.6777 ms = **1.6977 ms**.

        At this size the bandwidth term dominates; alpha matters for messages below about
        alpha / beta = 200 kB.
    """,
    mistakes={
        _MSG / _BW * 1e3: "you left out the latency alpha = 20 us = 0.020 ms",
        (_ALPHA + 16e6 / _BW) * 1e3: "16 MiB is 16 x 2^20 bytes, not 16 x 10^6",
        (_ALPHA + _MSG / (10 * 2**30)) * 1e3: "10 GB/s is 10 x 10^9 bytes/s, not 10 x 2^30",
        _ALPHA + _MSG / _BW: "that is in seconds; give milliseconds",
        (_ALPHA + 8 * _MSG / _BW) * 1e3: "the bandwidth is in bytes per second, not bits",
    },
))

# All-gather: bytes each rank receives.
_AG_N = 8
register(Numeric(
    "00.all_gather_mib",
    (_AG_N - 1) * 2,
    unit="MiB",
    prompt="""
        N = 8 ranks each hold a 2 MiB shard and run all_gather so that every rank ends with
        all 8 shards. How many MiB does each rank receive? Give a number in MiB.
    """,
    working="""
        Each rank already has its own shard and needs the other N - 1 = 7 shards of 2 MiB:
        it receives 7 x 2 MiB = **14 MiB**, whatever the algorithm (in a ring, one shard
        per step for 7 steps). The full result is 16 MiB; the all-gather moves
        (N-1)/N of it into each rank.
    """,
    mistakes={
        16: "each rank already holds its own shard: it receives only the other N - 1",
        2: "that is one shard; a rank needs every other rank's shard",
        28: "count what a rank receives only, not what it also sends",
        14 * MiB: "that is in bytes; give MiB",
    },
))

register(Expression(
    "00.ring_formula",
    "2*(N-1)/N*n",
    variables=["N", "n"],
    prompt="""
        Write, as a formula in N (ranks) and n (bytes in the tensor), the number of bytes
        each rank sends in a ring all-reduce. Give a string such as "n*(N+1)".
    """,
    working="""
        Two phases (reduce-scatter, then all-gather), each of N - 1 steps, each step sending
        one chunk of n / N bytes: 2 (N-1) n / N, written `2*(N-1)/N*n`.
    """,
    mistakes={
        "(N-1)/N*n": "that is one phase; the ring runs a reduce-scatter and then an all-gather",
        "2*(N-1)*n": "each step sends one chunk of n/N bytes, not the whole tensor",
        "4*(N-1)/N*n": "you counted sends and receives; count only sends",
    },
))

register(Choice(
    "00.dp_collective",
    "B",
    options={
        "A": "broadcast of the parameters from rank 0",
        "B": "all-reduce of the gradients",
        "C": "all-gather of the activations",
        "D": "send/recv of activations between neighbouring ranks",
    },
    prompt="""
        In data parallelism every rank holds the whole model and a slice of the batch.
        Which collective does it pay for on every training step? Give one letter.
    """,
    working="""
        **B**. Each rank computes gradients on its own slice of the batch; before the
        optimizer step every rank needs the same (average) gradient, so the gradients are
        all-reduced once per step: 2(N-1)/N x (bytes of the gradients) per rank with a ring.
        A broadcast of the parameters (A) happens once, at start-up, to give every rank the
        same initial weights. All-gathers (C) and send/recv between neighbours (D) are the
        traffic of tensor and pipeline parallelism.
    """,
    hints={
        "A": "the parameters are broadcast once at start-up; after that every rank applies "
             "the same update. What must every rank agree on each step?",
        "C": "in data parallelism each rank keeps its own activations; nothing about them "
             "is exchanged",
        "D": "neighbour send/recv of activations is pipeline parallelism",
    },
))
