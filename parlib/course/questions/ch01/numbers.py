"""The data-parallel chapter's numbers and choices: ring all-reduce bytes, model-state memory
under data parallelism and ZeRO-1, the memory wall, overlap. The formulas are
:mod:`parlib.cost`'s; the wrong answers are those formulas off by a known factor."""

from __future__ import annotations

from parlib.cost.collectives import predicted_sent_bytes
from parlib.cost.memory import model_state_bytes, model_state_bytes_per_param
from parlib.course.on_ranks import factor_mistakes
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30

# --------------------------------------------------------------------------- numeric

_P_RING = 350_000_000  # parameters
_N_RING = 8
_GRAD_BYTES = 4 * _P_RING  # fp32 gradients
_RING_BYTES = predicted_sent_bytes("all_reduce", _GRAD_BYTES, _N_RING)
register(
    Numeric(
        "01.ring_bytes_model",
        _RING_BYTES,
        unit="bytes",
        prompt="""
        A model with P = 350 million parameters trains with data parallelism on N = 8 ranks.
        Its gradients are fp32. Each step, the ranks average the gradients with one ring
        all-reduce. How many bytes does each rank send per step? Give a number in bytes.
    """,
        working="""
        The gradients take 4 bytes per parameter: 4 x 350e6 = 1.4e9 bytes.

        A ring all-reduce is a reduce-scatter followed by an all-gather. Each phase has
        N - 1 = 7 steps, and in each step a rank sends one chunk of 1.4e9 / 8 bytes. So
        each rank sends

        2 (N-1)/N x 1.4e9 = 2 x 7/8 x 1.4e9 = **2.45e9 bytes** (about 2.28 GiB) per step.

        On a 100 GB/s link that is about 25 ms, whatever N is: the factor 2(N-1)/N is
        close to 2 for any sizeable N.
    """,
        mistakes=factor_mistakes(_RING_BYTES, {
            1 / 4: "that counts one byte per parameter; fp32 gradients take 4 bytes each",
            1 / 2: "those are bf16 (2-byte) gradients; these are fp32",
            _N_RING / (_N_RING - 1): "that is the limit for N -> infinity; with N = 8 the "
            "factor is 2(N-1)/N = 1.75",
            _N_RING: "each of the 2(N-1) steps sends one chunk of bytes/N, not the whole "
            "gradient",
        }),
    )
)


_P_MEM = 1_500_000_000
_N_MEM = 8
_FP32 = model_state_bytes_per_param()  # bytes per parameter: params, grads, optimizer (Adam)
_DP_GIB = model_state_bytes(_P_MEM, _N_MEM, zero_stage=0) / GiB
_ZERO1_GIB = model_state_bytes(_P_MEM, _N_MEM, zero_stage=1) / GiB
register(
    Numeric(
        "01.dp_memory",
        _DP_GIB,
        unit="GiB",
        rtol=2e-3,
        prompt="""
        A model with P = 1.5 billion parameters trains with Adam in fp32 under plain data
        parallelism on N = 8 GPUs. How much memory does each GPU need for the model states
        (weights, gradients and Adam's two moments; leave out activations)? Give a number
        in GiB (2^30 bytes).
    """,
        working="""
        Per parameter, in fp32: 4 bytes of weight + 4 of gradient + 4 + 4 for Adam's first
        and second moments = 16 bytes.

        Data parallelism keeps a full copy on every GPU, so N does not appear:
        16 x 1.5e9 = 24e9 bytes = 24e9 / 2^30 = **22.35 GiB per GPU**.

        Mixed precision does not help here: bf16 weights (2) and gradients (2) plus an
        fp32 master copy (4) and two fp32 moments (8) is 16 bytes per parameter too.
    """,
        mistakes=factor_mistakes(_DP_GIB, {
            1 / 4: "that is the weights alone; the gradients and Adam's two moments need "
            "memory too",
            1 / 2: "that is weights and gradients; Adam also keeps two moments per parameter",
            3 / 4: "count four fp32 numbers per parameter: weight, gradient and Adam's two "
            "moments",
            1 / _N_MEM: "data parallelism does not split the model: every GPU holds the full "
            "copy",
            GiB / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
        }),
    )
)


register(
    Numeric(
        "01.zero1_memory",
        _ZERO1_GIB,
        unit="GiB",
        rtol=2e-3,
        prompt="""
        The same model (P = 1.5 billion parameters, Adam, fp32) now trains with ZeRO-1 on
        N = 8 GPUs: the optimizer state is split evenly over the ranks, while weights and
        gradients stay whole on every rank. How much memory does each GPU need for the
        model states? Give a number in GiB (2^30 bytes).
    """,
        working="""
        ZeRO-1 shards only the optimizer state. Per parameter, per GPU:

        * weights, full copy: 4 bytes
        * gradients, full copy: 4 bytes
        * Adam's moments, 1/N of 8 bytes: 8 / 8 = 1 byte

        9 bytes x 1.5e9 = 13.5e9 bytes = **12.57 GiB per GPU**, down from 22.35 GiB. ZeRO-2
        would also shard the gradients (4 + 12/8 = 5.5 bytes per parameter) and ZeRO-3
        (FSDP) the weights too (16/8 = 2 bytes per parameter).
    """,
        mistakes={
            _DP_GIB: "that is plain data parallelism; ZeRO-1 splits the optimizer state over "
            "the N ranks",
            model_state_bytes(_P_MEM, _N_MEM, zero_stage=3) / GiB: "that shards everything "
            "(ZeRO-3 / FSDP); ZeRO-1 shards only the optimizer state",
            model_state_bytes(_P_MEM, _N_MEM, zero_stage=2) / GiB: "that also shards the "
            "gradients (ZeRO-2); ZeRO-1 keeps them whole",
            (_ZERO1_GIB + _FP32["params"] * _P_MEM / _N_MEM / GiB): "in fp32 the weights are "
            "the master copy: the optimizer state is the two moments, 8 bytes per parameter",
            _ZERO1_GIB * GiB / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
        },
    )
)


register(
    Choice(
        "01.memory_wall",
        "A",
        options={
            "A": "It does not fit: each GPU must hold all 320 GB by itself.",
            "B": "It fits: 64 GPUs x 80 GB = 5,120 GB, far more than 320 GB.",
            "C": "It fits once the per-GPU batch is cut to one example.",
            "D": "It fits, because the all-reduce averages the memory across the GPUs.",
        },
        prompt="""
        A 20-billion-parameter model, trained with Adam in mixed precision, needs
        16 bytes x 20e9 = 320 GB of model states. You have 64 GPUs with 80 GB each and
        use plain data parallelism. What happens? Give one letter.
    """,
        working="""
        **A**. Data parallelism copies the whole model (weights, gradients, optimizer state)
        onto every device and splits only the batch. Each GPU would need the full 320 GB,
        four times its 80 GB, however many GPUs you add. This is the memory wall: past it
        you must split the model itself, with ZeRO/FSDP sharding of the model states,
        tensor parallelism or pipeline parallelism. (Cutting the batch, C, shrinks only the
        activations; the all-reduce, D, averages gradients, not memory.)
    """,
        hints={
            "B": "under data parallelism memory does not pool: what does each single GPU hold?",
            "C": "a smaller batch shrinks the activations, but the 320 GB of model states stay",
            "D": "the all-reduce averages the gradients' values; every GPU still stores "
            "all of them",
        },
    )
)

register(
    Choice(
        "01.overlap",
        "C",
        options={
            "A": "It sends fewer bytes than one all-reduce at the end of backward.",
            "B": "It lets each rank skip the all-reduce of gradients that are already small.",
            "C": "Late layers' gradients are reduced while backward computes earlier ones.",
            "D": "It makes the all-reduce exact, where one big all-reduce rounds.",
        },
        prompt="""
        Overlapped data parallelism registers a hook on every parameter and launches an
        asynchronous all-reduce per bucket as soon as the bucket's gradients are ready.
        Where does its speed-up come from? Give one letter.
    """,
        working="""
        **C**. Backward produces gradients from the last layer to the first. A bucket of
        late-layer gradients is complete long before backward ends, so its all-reduce can
        run while autograd computes the rest. The bytes are the same as one all-reduce of
        every gradient (A is wrong), every gradient is still averaged (B), and the numbers
        are the same up to summation order (D). With perfect overlap the step costs
        max(compute, communication) instead of their sum.
    """,
        hints={
            "A": "count the bytes: every gradient is still all-reduced once",
            "B": "every gradient must be averaged, or the copies drift apart",
            "D": "both are floating-point sums; overlap changes when, not what",
        },
    )
)
