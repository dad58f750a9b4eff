"""The choosing chapter's practice set: which strategy a memory-bound and a
bandwidth-bound run need."""

from __future__ import annotations

from parlib.cost import (
    Hardware,
    Layout,
    Link,
    Model,
    best_layouts,
    estimate,
    model_state_bytes,
    predicted_sent_bytes,
    tp_sent_bytes_per_layer,
)
from parlib.cost.estimate import RECOMPUTE
from parlib.cost.hardware import GB
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30


# --------------------------------------------------------------------------- memory or bandwidth

register(Choice(
    "08.memory_bound",
    "B",
    options={
        "A": "more data-parallel copies, so that each one processes less of the batch",
        "B": "split the model (t in a node, then p) or shard its states (ZeRO-3)",
        "C": "a smaller batch per device, with gradient accumulation to keep the step's batch",
        "D": "more microbatches per step, so that each holds fewer activations",
    },
    prompt="""
        A run is memory-bound: the weights, gradients and Adam state of the model alone
        need several times the memory of one device, before any activation. Which change
        makes it fit? Give one letter.
    """,
    working="""
        **B.** Data parallelism copies the whole model to every device, so adding copies
        (A) leaves each device's model states unchanged, and a smaller batch per device
        (C) or more microbatches (D) only shrink the activations. Splitting the model
        divides the parameters (and their gradients and optimizer state) by t x p; ZeRO-3
        divides them by the data-parallel degree at the price of about 1.5x data
        parallelism's traffic.
    """,
    hints={
        "A": "every data-parallel copy holds the whole model: copies do not shrink it",
        "C": "the batch per device changes activation memory, not the model states, which "
             "alone are several devices' worth",
        "D": "microbatches change activation memory and the bubble, not the model states",
    },
))

# The bandwidth-bound case of the chapter's link sweep: GPT-3 6.7B's shape on 8 nodes of
# 8 GPUs, 512 sequences of 2048 tokens per step, bf16, 5 GB/s per GPU between nodes. Every
# number below is the chapter's cost model at that setting (its link sweep prints the same
# estimates): the bytes each choice puts on the slow links per GPU and step.
_BW_MODEL = Model(32, 4096, 32, 2048, 51200, name="6.7B")
_BW_BATCH, _BW_D_INSIDE, _BW_GBS = 512, 8, 5
_BW_HW = Hardware.dgx_h100(64).with_(inter_node=Link(alpha=10e-6, bandwidth=_BW_GBS * GB))


def _fastest(layout: Layout, zeros: tuple[int, ...]):
    """The layout at its fastest (m, ZeRO stage, recomputation) that fits."""
    per = _BW_BATCH // layout.dp
    options = [estimate(_BW_MODEL, _BW_HW, layout, m=m, global_batch=_BW_BATCH, zero=z,
                        recompute=r)
               for m in range(1, per + 1) if per % m == 0 for z in zeros for r in RECOMPUTE]
    return min((o for o in options if o.fits), key=lambda o: o.step_time)


# B as the chapter's link sweep prints it: d = 64, ZeRO-1, one sequence per microbatch
BW_PLAIN = estimate(_BW_MODEL, _BW_HW, Layout(dp=64), m=_BW_BATCH // 64, zero=1,
                    recompute="selective", global_batch=_BW_BATCH)
BW_TENSOR = _fastest(Layout(dp=_BW_D_INSIDE, tp=8), (0, 1, 2))
BW_PIPELINE = _fastest(Layout(dp=_BW_D_INSIDE, pp=8), (0, 1, 2))
BW_ZERO3 = _fastest(Layout(dp=64), (3,))
BW_PICK = best_layouts(_BW_MODEL, _BW_HW, global_batch=_BW_BATCH, top=1)[0]
# bytes per GPU on the slow links: the ring collectives' share that leaves the node; for A,
# tensor parallelism's all-reduces with the t group spread over the nodes (all of them)
BW_SLOW_BYTES = {"A": BW_TENSOR.bytes_sent["tp"], "B": BW_PLAIN.inter_node_bytes,
                 "C": BW_PIPELINE.inter_node_bytes, "D": BW_ZERO3.inter_node_bytes}
BW_KEY = min(BW_SLOW_BYTES, key=BW_SLOW_BYTES.get)
_GB = {k: v / GB for k, v in BW_SLOW_BYTES.items()}
_RING_GB = predicted_sent_bytes("all_reduce", 2 * _BW_MODEL.n_params, 64) / GB
_PER_PIPE = _BW_BATCH // _BW_D_INSIDE
_PICK_HIDDEN = BW_PICK.time["dp_sync_hidden"] / max(BW_PICK.time["dp_sync_total"], 1e-30)

register(Choice(
    "08.bandwidth_bound",
    BW_KEY,
    options={
        "A": "tensor parallelism across the nodes, data parallelism inside each node",
        "B": "data parallelism across the nodes: it syncs once per step, overlapped with "
             "backward",
        "C": "pipeline stages across the nodes, and data parallelism inside each node",
        "D": "ZeRO-3 across the nodes, to cut each GPU's memory by the number of nodes",
    },
    prompt="""
        GPT-3 6.7B's shape (with ZeRO-1 a copy fits on one 80 GB GPU) trains on 64 GPUs in
        8 nodes, 512 sequences of 2048 tokens per step, in bf16. NVLink inside a node is
        fast; the links between nodes are slow, 5 GB/s per GPU. Each choice below puts one
        kind of traffic on the slow links. Which puts the fewest bytes on them per step?
        Give one letter.
    """,
    working=f"""
        **{BW_KEY}.** Count the bytes each choice puts on the slow links, per GPU and step,
        as the chapter's cost model does. A data-parallel sync across the nodes (B) sends
        about 2 x the gradient per rank, 2(N-1)/N x 2 bytes x P = {_RING_GB:.1f} GB,
        **whatever the batch**; but its rings have 8 ranks in each node, and only 1/8 of a
        rank's ring bytes leave the node: {_GB["B"]:.2f} GB per GPU on the slow links, a
        sync of {BW_PLAIN.time["dp_sync_total"]:.2f} s at {_BW_GBS} GB/s. A pipeline across
        the nodes (C) sends only the boundary activations: with d = {_BW_D_INSIDE} inside
        the nodes each pipeline carries {_PER_PIPE} sequences, forward and back, 2 x
        {_PER_PIPE} x 2048 x 4096 x 2 bytes = {_GB["C"]:.2f} GB per step,
        {_GB["B"] / _GB["C"]:.1f}x fewer than B, at the price of a bubble. ZeRO-3 (D) gathers
        the weights twice and reduce-scatters once for every microbatch (at its fastest
        here, {BW_ZERO3.m} microbatches of {BW_ZERO3.micro_batch} sequences): {_GB["D"]:.2f} GB,
        {_GB["D"] / _GB["B"]:.1f}x B's, to save memory the run does not need. Tensor
        parallelism across the nodes (A) would send {_GB["A"]:.0f} GB of activations, in
        every layer, on the critical path. Fewest bytes is not fastest: at this link the
        chapter's planner picks {BW_PICK.name} with {BW_PICK.sharding or "no ZeRO"} (step
        {BW_PICK.step_time:.2f} s), which puts {BW_PICK.inter_node_bytes / GB:.2f} GB on the
        slow links and hides {_PICK_HIDDEN:.0%} of its sync behind compute; the pipeline,
        at its best setting, takes {BW_PIPELINE.step_time:.2f} s. Bytes decide when the
        link is slow enough that nothing hides them: the chapter's sweep shows where.
    """,
    hints={
        "A": "tensor parallelism talks inside every layer: the slow link is on its "
             f"critical path many times per step ({_GB['A']:.0f} GB per GPU here)",
        "B": f"the gradient sync moves about 2 x the gradient's bytes per step whatever the "
             f"batch: of its {_RING_GB:.0f} GB per GPU, 1/8 leaves each node, "
             f"{_GB['B']:.2f} GB, {BW_PLAIN.time['dp_sync_total']:.2f} s at {_BW_GBS} GB/s. "
             f"What does a stage boundary send instead?",
        "D": f"ZeRO-3 trades extra traffic (about {_GB['D'] / _GB['B']:.1f}x data "
             f"parallelism's: {_GB['D']:.2f} GB per GPU here) for memory, and memory is not "
             f"the problem here",
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
