"""The tensor-parallel chapter's numbers and choices: bytes and memory per layer, slow links,
the MLP's split."""

from __future__ import annotations

from parlib.cost.model import Model
from parlib.cost.tensor import tp_layer_params, tp_sent_bytes_per_layer
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

GiB = 2**30

# --------------------------------------------------------------------------- numeric

_B, _S, _H, _T = 4, 2048, 8192, 8
register(Numeric(
    "03.bytes_per_layer",
    tp_sent_bytes_per_layer(_B, _S, _H, _T, dtype_bytes=2),
    unit="bytes",
    prompt=f"""
        A transformer layer with hidden size h = {_H} runs with t = {_T}-way tensor
        parallelism (Megatron's split: attention by heads, MLP column then row). A
        microbatch holds b = {_B} sequences of s = {_S} tokens, and the activations are
        bf16 (2 bytes). How many bytes does one rank send for this layer in one training
        step (forward and backward of the microbatch), with ring all-reduces? Give a
        number in bytes.
    """,
    working=f"""
        One message is the layer's activations (or their gradient):
        b x s x h x 2 bytes = {_B} x {_S} x {_H} x 2 = {_B * _S * _H * 2:,} bytes.

        Forward all-reduces it twice (g after attention, g after the MLP) and backward
        twice (f before attention, f before the MLP): 4 all-reduces.

        A ring all-reduce sends 2(t-1)/t of the message from each rank: 2 x 7/8 = 1.75.

        4 x 1.75 x {_B * _S * _H * 2:,} = **{tp_sent_bytes_per_layer(_B, _S, _H, _T, 2):,.0f}
        bytes** (about 0.88 GiB) per layer per microbatch. With 80 layers that is 70 GiB per
        microbatch on every rank: why the t ranks need NVLink-class links.
    """,
    mistakes={
        # 2 all-reduces x 2(t-1)/t and 4 all-reduces x (t-1)/t give the same number: the
        # hint names both ways to reach it
        tp_sent_bytes_per_layer(_B, _S, _H, _T, 2, passes=("forward",)):
            "that is half the answer. With the ring factor (t-1)/t you counted only one of "
            "the ring's two passes: a ring all-reduce is a reduce-scatter and an all-gather, "
            "each sending (t-1)/t of the message, 2(t-1)/t in all. Or it is the forward "
            "only: backward all-reduces the gradients twice more",
        4 * _B * _S * _H * 2: "a ring all-reduce sends 2(t-1)/t of the message from each "
                              "rank, not the message once",
        tp_sent_bytes_per_layer(_B, _S, _H, _T, 4): "the activations are bf16: 2 bytes "
                                                    "each, not 4",
        tp_sent_bytes_per_layer(_B, _S, _H, _T, 2) / _T: "every rank sends 2(t-1)/t of the "
            "whole (b, s, h) message; it is not divided by t once more",
        4 * 2 * (_T - 1) * _B * _S * _H * 2: "each of the 2(t-1) ring steps sends a "
                                            "chunk of 1/t of the message, not all of it",
    },
))

_HM, _TM = 8192, 8
_LAYER_PARAMS = tp_layer_params(  # the split part, 12 h^2 / t without biases
    Model(n_layers=1, d_model=_HM, n_heads=64, seq_len=1, vocab_size=1, bias=False),
    _TM)["split"]
register(Numeric(
    "03.layer_memory",
    _LAYER_PARAMS * 16 / GiB,
    unit="GiB",
    rtol=2e-3,
    prompt=f"""
        A transformer layer has hidden size h = {_HM} and MLP width 4h; leave out biases
        and LayerNorms. It trains with Adam in mixed precision (16 bytes of model state
        per parameter) under t = {_TM}-way tensor parallelism (q, k, v, out, up and down
        all split). How much memory does one rank need for this layer's model states?
        Give a number in GiB (2^30 bytes).
    """,
    working=f"""
        Parameters of the layer: q, k, v and out are h x h each (4h^2), up and down
        h x 4h each (8h^2): 12h^2 = 12 x {_HM}^2 = {12 * _HM**2:,}.

        Tensor parallelism splits all six matrices, so one rank holds 12h^2 / t =
        {_LAYER_PARAMS:,.0f} parameters.

        At 16 bytes each (bf16 weight and gradient, fp32 master weight and Adam's two
        moments): {_LAYER_PARAMS * 16:,.0f} bytes = **{_LAYER_PARAMS * 16 / GiB:.2f} GiB**.
        On one device the same layer needs {12 * _HM**2 * 16 / GiB:.0f} GiB.
    """,
    mistakes={
        12 * _HM**2 * 16 / GiB: "that is the whole layer; each of the t ranks holds 1/t "
                                "of its matrices",
        8 * _HM**2 * 16 / _TM / GiB: "that is the MLP alone; attention adds q, k, v and "
                                     "out, 4h^2 more",
        4 * _HM**2 * 16 / _TM / GiB: "that is attention alone; the MLP's two h x 4h "
                                     "matrices add 8h^2 more",
        _LAYER_PARAMS * 2 / GiB: "that is the bf16 weights only; count 16 bytes per "
                                 "parameter for weights, gradients and Adam's state",
        _LAYER_PARAMS * 16 / 1e9: "that is in GB (10^9 bytes); give GiB (2^30 bytes)",
    },
))

register(Choice(
    "03.slow_link",
    "D",
    options={
        "A": "t = 16 tensor parallelism over all 16 GPUs: the most memory saved per GPU.",
        "B": "Any of them: the bytes per step are the same, so the link does not matter.",
        "C": "data parallelism (N = 8) inside each node, t = 2 tensor parallelism across "
             "the two nodes.",
        "D": "t = 8 tensor parallelism inside each node, data parallelism (N = 2) across "
             "the two nodes.",
    },
    prompt="""
        You have 2 nodes of 8 GPUs. Inside a node the GPUs share NVLink (hundreds of GB/s);
        between the nodes there is one 100 Gb/s network link. The model fits in memory
        when split 8 ways. How do you lay out the 16 GPUs? Give one letter.
    """,
    working="""
        **D.** Tensor parallelism all-reduces the activations 4 times per layer for every
        microbatch, and each all-reduce sits on the critical path: the next matmul waits
        for it. It needs the fastest link, so keep its t ranks inside a node. Data
        parallelism sends the gradients once per step, in a few large buckets that can
        overlap with backward: it tolerates the slow link between nodes. C puts the
        chatty traffic on the slow link and the patient traffic on the fast one, the
        worst of both; A puts half of every all-reduce's ring on the slow link; B is
        wrong because the two strategies send different things at different rates (and
        time per byte is what differs between the links).
    """,
    hints={
        "A": "every tensor-parallel all-reduce would then cross the 100 Gb/s link, "
             "4 times per layer per microbatch",
        "C": "which traffic is on the critical path of every layer, and which once per "
             "step and overlappable?",
        "B": "the link's time per byte differs by orders of magnitude, and so does when "
             "each strategy sends",
    },
))

register(Choice(
    "03.t_within_node",
    "A",
    options={
        "A": "Its all-reduces sit on every layer's critical path, so they need in-node "
             "links.",
        "B": "Data parallelism already uses the links between nodes, so t must leave them "
             "free.",
        "C": "Beyond 8 ways each rank's share of the weights stops shrinking, so nothing "
             "is saved.",
        "D": "t must divide the number of layers, and 8 divides most layer counts.",
    },
    prompt="""
        Megatron-LM and its successors normally keep the tensor-parallel degree t at or
        below the number of GPUs in one node (often 8). Why? Give one letter.
    """,
    working="""
        **A.** Under tensor parallelism every layer waits for 2 all-reduces in forward
        and 2 in backward, each of the (b, s, h) activations, and nothing can run until
        they finish. Inside a node NVLink moves hundreds of GB/s; between nodes a
        network link moves tens. Past one node the all-reduces slow every layer down.
        The matrices also get thinner as t grows, so each GPU's matmuls become too small
        to run efficiently. Data parallelism shares the links between nodes well (B): it
        sends once per step and can overlap; what makes tensor parallelism different is
        *when* it sends. Each rank holds 1/t of every split matrix, so memory keeps
        shrinking with t (C). And t divides the heads and the hidden size, not the number
        of layers (D): that is the pipeline's constraint.
    """,
    hints={
        "B": "data parallelism's once-per-step sync shares those links well; what is special "
             "about tensor parallelism's traffic is when it is sent",
        "C": "each rank holds 1/t of every split matrix: its share keeps shrinking as t grows",
        "D": "tensor parallelism splits the matrices inside a layer: what must t divide?",
    },
))

register(Choice(
    "03.mlp_split",
    "C",
    options={
        "A": "Cut by rows, each rank's slice of A would need more memory than a column "
             "slice.",
        "B": "Either cut works with no communication in between; columns are a "
             "convention.",
        "C": "GELU acts on each element: it applies to column slices, not to partial "
             "sums.",
        "D": "Cutting A by columns halves the bytes of the all-reduce the MLP ends with.",
    },
    prompt="""
        Megatron's MLP computes GELU(XA) B and splits A by columns and B by rows. Why not
        A by rows? Give one letter.
    """,
    working="""
        **C.** With A = [A_1 A_2] by columns, rank r computes GELU(XA_r), which is exactly
        its slice of GELU(XA): no talking. Its slice is also the input rows that B_r
        needs, so rank r computes the partial sum GELU(XA_r) B_r and one all-reduce (g)
        finishes the MLP. With A split by rows, XA would be a sum of partial products
        over the ranks, and GELU(P_1 + P_2) is not GELU(P_1) + GELU(P_2): the ranks would
        have to all-reduce before the GELU, a second all-reduce per MLP. The weights take
        the same memory either way (A), and the all-reduce that remains carries the same
        (b, s, h) output (D).
    """,
    hints={
        "A": "both cuts give each rank 1/t of A's elements",
        "B": "what does each rank hold after X A_r when A is cut by rows: a slice, or a "
             "partial sum?",
        "D": "the all-reduce after B carries the (b, s, h) output either way",
    },
))
