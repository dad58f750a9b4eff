"""The sharded-data-parallel chapter's numbers and choices: model-state memory per rank
under ZeRO-1/2/3 in fp32 and mixed precision, ZeRO-3's bytes per step against plain data
parallelism, when recomputation pays, why ZeRO-3 wants fast links and large units. The
formulas are :mod:`parlib.cost`'s; the wrong answers are those formulas with a known slip."""

from __future__ import annotations

from parlib.cost.memory import model_state_bytes, model_state_bytes_per_param
from parlib.cost.sharded import zero_sent_bytes_per_step
from parlib.course.on_ranks import factor_mistakes
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30

# --------------------------------------------------------------------------- memory

_P = 7e9  # parameters
_N = 16  # data-parallel ranks


def _gib(stage: int, mixed: bool) -> float:
    return model_state_bytes(_P, _N, zero_stage=stage, mixed_precision=mixed) / GiB


_Z3_FP32 = _gib(3, False)
_MASTER = model_state_bytes_per_param(False)["params"]  # the fp32 master copy, bytes/param

register(Numeric(
    "02.zero3_memory",
    _Z3_FP32,
    unit="GiB",
    rtol=2e-3,
    prompt="""
        A model with P = 7 billion parameters trains with Adam in fp32 on N = 16 GPUs
        under ZeRO-3 (FSDP): weights, gradients and optimizer state all sharded evenly
        over the ranks. How much memory does each GPU need for the model states (leave
        out activations and the one unit gathered at a time)? Give a number in GiB
        (2^30 bytes).
    """,
    working="""
        Per parameter in fp32 with Adam: 4 bytes of weight, 4 of gradient, 4 + 4 for the two
        moments, 16 bytes. ZeRO-3 shards all of it, so each GPU holds 16 / N = 1 byte per
        parameter: 7e9 bytes = 7e9 / 2^30 = **6.52 GiB**.

        For comparison, on the same 16 GPUs: ZeRO-2 (weights whole) 4P + 12P/N = 30.97
        GiB, ZeRO-1 (weights and gradients whole) 8P + 8P/N = 55.41 GiB, plain data
        parallelism 16P = 104.3 GiB. The gathered unit adds its full weights on top while
        it computes: a block's worth, not the model's.
    """,
    mistakes={
        _gib(2, False): "that is ZeRO-2, whose weights stay whole on every rank; ZeRO-3 "
        "shards the weights too",
        _gib(1, False): "that is ZeRO-1, which shards only the optimizer state",
        _gib(0, False): "that is plain data parallelism, a full copy per GPU; ZeRO-3 "
        "divides every byte by N",
        _gib(3, False) / 2: "count four fp32 numbers per parameter: weight, gradient and "
        "Adam's two moments (16 bytes, not 8)",
        _gib(3, False) * GiB / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
    },
))

_Z2_MIXED = _gib(2, True)
register(Numeric(
    "02.zero2_mixed_memory",
    _Z2_MIXED,
    unit="GiB",
    rtol=2e-3,
    prompt="""
        The same model (P = 7 billion parameters, Adam, N = 16 GPUs) now trains in mixed
        precision (bf16 weights and gradients for compute, fp32 master weights and fp32
        moments in the optimizer) under ZeRO-2: gradients and optimizer state sharded,
        the bf16 weights whole on every rank. How much memory does each GPU need for the
        model states? Give a number in GiB (2^30 bytes).
    """,
    working="""
        Per parameter: 2 bytes of bf16 weight, 2 of bf16 gradient, and 12 of optimizer
        state (a 4-byte fp32 master weight and two 4-byte moments). ZeRO-2 keeps the
        weights whole and shards the rest:

        2P + (2 + 12) P / N = 14e9 + 14 x 7e9 / 16 = 20.125e9 bytes = **18.74 GiB**.

        In fp32 the same ZeRO-2 needs 4P + 12P/N = 30.97 GiB: mixed precision saves the
        bytes of the whole weights and gradients, not of the optimizer state, which grows
        by the master copy.
    """,
    mistakes={
        # fp32 ZeRO-2 and mixed-precision ZeRO-1 are the same 4P + 12P/N
        _gib(2, False): "that is 4P + 12P/N: fp32 weights kept whole (in mixed precision "
        "they are bf16, 2 bytes), or the bf16 gradients kept whole too (ZeRO-1; ZeRO-2 "
        "shards them)",
        _gib(3, True): "that is ZeRO-3, which shards the weights too; ZeRO-2 keeps the "
        "bf16 weights whole",
        _Z2_MIXED - _MASTER * _P / _N / GiB: "mixed precision keeps an fp32 master copy of "
        "the weights in the optimizer: 12 bytes of optimizer state per parameter, not 8",
        _Z2_MIXED * GiB / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
    },
))

# --------------------------------------------------------------------------- bytes

_P_BYTES = 2e9
_N_BYTES = 8
_Z3_BYTES = zero_sent_bytes_per_step(_P_BYTES, _N_BYTES, 3, dtype_bytes=2)
register(Numeric(
    "02.zero3_bytes",
    _Z3_BYTES,
    unit="bytes",
    prompt="""
        A model with P = 2 billion parameters trains under ZeRO-3 on N = 8 ranks with
        bf16 messages (2 bytes per element; every weight gathered once per unit before
        its forward and again before its backward, every gradient reduce-scattered once).
        How many bytes does each rank send per step, with ring collectives? Give a number
        in bytes.
    """,
    working="""
        A ring all-gather or reduce-scatter of a tensor of B bytes sends (N-1)/N x B per
        rank. The weights in bf16 are B = 2 x 2e9 = 4e9 bytes; ZeRO-3 moves them three
        times (gather for forward, gather again for backward, reduce-scatter of the
        gradients):

        3 x (N-1)/N x 4e9 = 3 x 7/8 x 4e9 = **1.05e10 bytes** per step.

        Plain data parallelism's all-reduce is a reduce-scatter plus an all-gather,
        2 x 7/8 x 4e9 = 7e9 bytes: ZeRO-3 sends 1.5 times as much, and in exchange holds
        1/N of the weights.
    """,
    mistakes=factor_mistakes(_Z3_BYTES, {
        2 / 3: "that is plain data parallelism (an all-reduce's 2(N-1)/N); ZeRO-3 frees "
        "the weights after forward and gathers them again for backward: three passes",
        1 / 3: "that is one pass; count the all-gather before forward, the one before "
        "backward and the gradients' reduce-scatter",
        2: "twice too many: the messages are bf16 (2 bytes per element), and an "
        "all-gather sends (N-1)/N of the tensor, not an all-reduce's 2(N-1)/N",
        _N_BYTES / (_N_BYTES - 1): "in a ring each rank sends N-1 of the N pieces: "
        "multiply by (N-1)/N",
        1 / 2: "the messages are bf16, 2 bytes per element, not 1",
    }),
))

# --------------------------------------------------------------------------- choices

register(Choice(
    "02.recompute_pays",
    "C",
    options={
        "A": "Shard over 16 GPUs instead of 8: ZeRO-3 then divides the memory per GPU "
             "by two.",
        "B": "Switch to mixed precision: the model states shrink from 16 to 8 bytes "
             "per parameter.",
        "C": "Recompute each block in backward from its stored input: roughly one more "
             "forward.",
        "D": "Nothing cheap helps: recomputing a block costs as much as the whole "
             "backward pass, so halve the batch.",
    },
    prompt="""
        A ZeRO-3 run on 8 GPUs of 40 GiB each needs, per GPU, 10 GiB of model states and
        60 GiB of activations stored for backward; each block's input alone is under
        1 GiB. The global batch is fixed. Which change makes it fit at the smallest cost?
        Give one letter.
    """,
    working="""
        **C.** The activations, not the model states, overflow the GPU. Full
        recomputation (torch.utils.checkpoint per block) stores only each block's input
        and reruns the block's forward in backward: the 60 GiB shrink to a few GiB, for
        about one extra forward pass, a third more compute (forward is about a third of
        forward + backward). Recomputation pays when activations are what does not fit
        and compute is cheaper than the alternatives.

        More GPUs (A) shard the model states, 10 GiB becoming 5, while each GPU's
        activations stay 60 GiB at the same per-GPU batch. Mixed precision (B) keeps 16
        bytes of model state per parameter (2 + 2 + 12). And recomputing is one forward,
        about half of a backward pass (D).
    """,
    hints={
        "A": "ZeRO-3 divides the model states by N; what divides the activations?",
        "B": "count mixed precision's bytes per parameter: bf16 weight and gradient, fp32 "
             "master and moments",
        "D": "backward costs about twice a forward: what does rerunning one forward cost?",
    },
))

register(Choice(
    "02.fast_links",
    "D",
    options={
        "A": "ZeRO-3 sends N times the bytes of plain data parallelism, so it needs N "
             "times the bandwidth, and large units split those bytes into fewer pieces.",
        "B": "The more units a model is cut into, the more bytes ZeRO-3 sends per step, "
             "and slow links make those extra bytes the bottleneck.",
        "C": "Large units need less memory while gathered, and fast links keep the "
             "gathered weights from going stale between the steps.",
        "D": "Each unit must wait for its weights' all-gather; prefetching hides it only "
             "behind the previous unit's compute.",
    },
    prompt="""
        FSDP / ZeRO-3 runs well on GPUs joined by fast links and with units of a block or
        more, and poorly on slow links or with many tiny units. Why? Give one letter.
    """,
    working="""
        **D.** A unit cannot compute until its full weights have arrived, in forward and
        again in backward. With prefetching, unit k+1's all-gather runs while unit k
        computes, so communication hides only if an all-gather takes less time than one
        unit's compute: a slow link stretches the gather past the window, and a tiny unit
        has a tiny window and a message dominated by the per-call latency.

        The bytes per step are 3 x P x (N-1)/N whatever the number of units (B), 1.5
        times plain data parallelism's, not N times (A). A larger unit needs *more*
        memory while gathered (C), and the gathered weights are fresh every time.
    """,
    hints={
        "A": "compare 3 x P x (N-1)/N with plain data parallelism's 2 x P x (N-1)/N",
        "C": "a gathered unit holds its full weights: does a larger unit need more memory "
             "or less?",
        "B": "count ZeRO-3's bytes per step: does the number of units appear in it?",
    },
))
