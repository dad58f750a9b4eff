"""Questions of the choosing chapter: the practice set on choosing a mix (notebook 08_choosing).

Eight-plus questions across the three outcomes of the course: what each strategy splits
and communicates; which strategy a memory-bound and a bandwidth-bound run need; what the
pipeline bubble is and how to shrink it. Every expected answer comes from
:mod:`parlib.cost`, the same formulas the chapters use.
"""

from __future__ import annotations

from parlib.cost import (
    bubble_fraction,
    ideal_step_time,
    model_state_bytes,
    predicted_sent_bytes,
    tp_sent_bytes_per_layer,
)
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30

# --------------------------------------------------------------------------- what splits

register(Choice(
    "08.what_tp_splits",
    "B",
    options={
        "A": "the batch; it sends the gradients once per step",
        "B": "the weight matrices inside each layer; it sends partial activations in "
             "every layer, forward and backward",
        "C": "the layers into consecutive stages; it sends activations across each stage "
             "boundary",
        "D": "the optimizer state; it gathers the parameters before each use",
    },
    prompt="""
        What does tensor (model) parallelism split, and what must it communicate?
        Give one letter.
    """,
    working="""
        **B.** Every rank holds a slice of each weight matrix (columns of one matmul, rows
        of the next), computes a partial result and the ranks combine it inside the layer:
        two all-reduces of the (b, s, h) activations per transformer layer in forward and
        two in backward. That is why it "talks constantly and wants fast links".
        A is data parallelism, C pipeline parallelism, D ZeRO-3 / FSDP.
    """,
    hints={
        "A": "that is data parallelism: a whole copy of the model on every rank",
        "C": "that is pipeline parallelism: whole layers per rank",
        "D": "that is ZeRO-3 / FSDP, a memory-saving form of data parallelism",
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

# --------------------------------------------------------------------------- memory or bandwidth

register(Choice(
    "08.memory_bound",
    "B",
    options={
        "A": "more data-parallel copies, so each holds less of the batch",
        "B": "split the model: tensor parallelism within a node, then pipeline stages "
             "(or shard the model states with ZeRO-3 / FSDP)",
        "C": "a larger global batch",
        "D": "more microbatches per step",
    },
    prompt="""
        A run is memory-bound: the weights, gradients and Adam state of the model alone
        need several times the memory of one device, before any activation. Which change
        makes it fit? Give one letter.
    """,
    working="""
        **B.** Data parallelism copies the whole model to every device, so adding copies
        (A) leaves each device's model states unchanged, and a batch (C) or microbatches
        (D) only change activations. Splitting the model divides the parameters (and their
        gradients and optimizer state) by t x p; ZeRO-3 divides them by the data-parallel
        degree at the price of about 1.5x data parallelism's traffic.
    """,
    hints={
        "A": "every data-parallel copy holds the whole model: copies do not shrink it",
        "C": "the batch changes activation memory, not the model states",
        "D": "microbatches change activation memory and the bubble, not the model states",
    },
))

register(Choice(
    "08.bandwidth_bound",
    "C",
    options={
        "A": "tensor parallelism across the nodes",
        "B": "pipeline parallelism with one microbatch per step",
        "C": "data parallelism, with enough work per synced byte (a larger batch per rank "
             "or gradient accumulation); split the model only as far as memory forces",
        "D": "ZeRO-3 across the nodes",
    },
    prompt="""
        The model fits on one device with room to spare, but the nodes are joined by a
        slow network. Which strategy should carry the scale-out? Give one letter.
    """,
    working="""
        **C.** Data parallelism sends its gradients once per step and can overlap them with
        backward; more samples per rank per step make the same bytes pay for more compute.
        Tensor parallelism (A) sends activations in every layer, forward and backward:
        fine-grained traffic punishes slow links most. A one-microbatch pipeline (B) idles
        (p-1)/p of the time. ZeRO-3 (D) sends about 1.5x data parallelism's bytes to save
        memory the run does not need.
    """,
    hints={
        "A": "tensor parallelism talks inside every layer: the slow link is on its "
             "critical path many times per step",
        "B": "with m = 1 each stage idles (p-1)/p of the step",
        "D": "ZeRO-3 trades extra traffic (about 1.5x data parallelism's) for memory, and "
             "memory is not the problem here",
    },
))

_P_ZERO, _N_ZERO = 7e9, 8
_ZERO1_GIB = model_state_bytes(_P_ZERO, _N_ZERO, 1, mixed_precision=True) / GiB

register(Numeric(
    "08.zero1_mixed",
    _ZERO1_GIB,
    unit="GiB",
    prompt="""
        A 7-billion-parameter model trains in mixed precision with Adam: bf16 weights and
        gradients (2 + 2 bytes per parameter) and an fp32 master copy plus two fp32
        moments (12 bytes). With ZeRO-1 over N = 8 data-parallel ranks, how many GiB of
        model states does each rank hold? Give GiB (2^30 bytes).
    """,
    working="""
        ZeRO-1 shards the optimizer state, which in mixed precision is the 12 bytes of
        master weight and moments; the bf16 weights and gradients stay whole:

        (2 + 2) x 7e9 + 12 x 7e9 / 8 = 28e9 + 10.5e9 = 38.5e9 bytes = **35.9 GiB**

        against 16 x 7e9 = 112e9 bytes (104 GiB) without ZeRO. As N grows it approaches
        4 bytes per parameter, the 4x saving of the ZeRO paper.
    """,
    mistakes={
        model_state_bytes(_P_ZERO, _N_ZERO, 1, mixed_precision=True) / 1e9:
            "that is in GB (10^9 bytes); the question asks for GiB (2^30 bytes)",
        model_state_bytes(_P_ZERO, _N_ZERO, 3, mixed_precision=True) / GiB:
            "that is ZeRO-3, which also shards weights and gradients",
        model_state_bytes(_P_ZERO, _N_ZERO, 2, mixed_precision=True) / GiB:
            "that is ZeRO-2, which also shards the gradients",
        model_state_bytes(_P_ZERO) / GiB: "that is with no sharding at all",
        model_state_bytes(_P_ZERO, _N_ZERO, 1) / GiB:
            "that counts fp32 training (4 + 4 + 8/N); here weights and gradients are bf16 "
            "and the optimizer state is 12 bytes",
    },
))

_TP_B, _TP_S, _TP_H, _TP_T = 1, 4096, 8192, 8
_TP_BYTES = tp_sent_bytes_per_layer(_TP_B, _TP_S, _TP_H, _TP_T, dtype_bytes=2)

register(Numeric(
    "08.tp_bytes_per_layer",
    _TP_BYTES,
    unit="bytes",
    prompt="""
        A transformer layer with hidden size h = 8192 runs on t = 8 tensor-parallel ranks
        (Megatron's split: attention by heads, MLP column then row), one sequence of
        s = 4096 tokens per microbatch (b = 1), bf16 activations. How many bytes does each
        rank send for this layer in one forward and backward pass? Give bytes.
    """,
    working="""
        Each all-reduce carries the (b, s, h) activations: 1 x 4096 x 8192 x 2 bytes =
        64 MiB. Forward needs 2 (after attention, after the MLP), backward 2 more; a ring
        all-reduce sends 2(t-1)/t of its message:

        4 x 2 x 7/8 x 64 MiB = **448 MiB = 469,762,048 bytes** per layer per microbatch.

        Across 80 layers that is 35 GiB per microbatch: why t stays inside a node.
    """,
    mistakes={
        _TP_BYTES / 2: "forward has 2 all-reduces per layer and backward 2 more",
        _TP_BYTES / 4: "there are 4 all-reduces per layer per step (2 forward, 2 backward)",
        _TP_BYTES * 2: "the activations are bf16, 2 bytes each",
        4 * 2 * _TP_B * _TP_S * _TP_H * 2: "a ring all-reduce sends 2(t-1)/t of the "
                                           "message, not twice all of it",
        4 * _TP_B * _TP_S * _TP_H * 2: "each all-reduce sends 2(t-1)/t of the message per "
                                       "rank, not the message once",
    },
))

# --------------------------------------------------------------------------- the bubble

register(Numeric(
    "08.seed_bubble",
    bubble_fraction(4, 8),
    prompt="""
        Four stages in a line, one batch cut into eight microbatches, GPipe or 1F1B. What
        fraction of the step is each stage idle? Give a number between 0 and 1.
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
        "A": "more (smaller) microbatches per step, or interleaved stages (v model chunks "
             "per rank)",
        "B": "more pipeline stages",
        "C": "fewer, larger microbatches",
        "D": "a faster link between the stages",
    },
    prompt="""
        Which change shrinks the pipeline bubble (p - 1) / (v m + p - 1)?
        Give one letter.
    """,
    working="""
        **A.** The p - 1 slots of fill and drain are shared by more slots of work when m
        grows; interleaving gives every rank v chunks, so the fill and drain slots are v
        times shorter: (p-1)/(v m + p - 1). More stages (B) add fill/drain slots, fewer
        microbatches (C) share them among less work, and a faster link (D) shortens the
        sends, not the idle slots.
    """,
    hints={
        "B": "each extra stage adds a slot of fill and of drain",
        "C": "fewer microbatches share the same fill/drain among less work",
        "D": "the bubble is idle compute slots; a faster link shortens the sends only",
    },
))
