"""The choosing chapter's practice set: which strategy a memory-bound and a
bandwidth-bound run need."""

from __future__ import annotations

from parlib.cost import (
    model_state_bytes,
    tp_sent_bytes_per_layer,
)
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30


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
