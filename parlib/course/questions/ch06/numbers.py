"""The expert-parallel chapter's numbers and choices: an MoE layer's parameters per rank, the
all-to-all bytes of one layer, the choices dropped at a capacity factor, why DeepSeek-V3
could train without tensor parallelism."""

from __future__ import annotations

from parlib.cost.experts import (
    ep_all_to_all_bytes_per_layer,
    ep_expected_sent_fraction,
    expert_capacity,
    expert_params,
    moe_params_per_rank,
    tokens_dropped,
)
from parlib.course.on_ranks import factor_mistakes
from parlib.course.question_types import Choice, Numeric
from parlib.course.registry import register

# --------------------------------------------------------------------------- parameters

_E, _EP, _PH, _PF = 64, 8, 4096, 14336
_PER_RANK = moe_params_per_rank(_E, _EP, _PH, _PF, bias=False)
_EXPERT = expert_params(_PH, _PF, bias=False)
_ROUTER = _PH * _E  # 0.03% of the answer: only an exact count tells it apart

register(Numeric(
    "06.params_per_rank",
    _PER_RANK,
    unit="parameters",
    rtol=1e-7,  # an exact count: the router is 0.03% of it
    prompt=f"""
        One MoE layer has E = {_E} experts, each an MLP h -> f -> h of two weight matrices
        without biases (h = {_PH}, f = {_PF}), and a router, an h x E matrix. It is split
        over ep = {_EP} ranks by expert parallelism; the router is replicated. How many of
        this layer's parameters does one rank hold? Give the exact number of parameters
        (not rounded).
    """,
    working=f"""
        One expert: 2 x h x f = 2 x {_PH} x {_PF} = {_EXPERT:,} parameters. Each rank holds
        E/ep = {_E} / {_EP} = {_E // _EP} experts: {_E // _EP * _EXPERT:,}. Plus the router,
        h x E = {_PH * _E:,}, on every rank.

        **{_PER_RANK:,} parameters** ({_PER_RANK / 1e9:.2f} billion) per rank for this
        layer, against {moe_params_per_rank(_E, 1, _PH, _PF, bias=False) / 1e9:.1f} billion
        on one device: expert parallelism divides the experts, the bulk of an MoE model,
        by ep.
    """,
    mistakes={
        moe_params_per_rank(_E, 1, _PH, _PF, bias=False):
            "that is the whole layer: each rank holds only E/ep of the experts",
        _PER_RANK - _ROUTER: f"that leaves out the router: its h x E = {_ROUTER:,} "
                             f"parameters are replicated, on every rank",
        _PER_RANK - _ROUTER + _ROUTER / _EP: "the router is replicated, not split: every "
                                             "rank holds all of its h x E parameters",
        **factor_mistakes(_PER_RANK, {
            0.5: "an expert has two matrices, h x f and f x h: 2 h f parameters",
            1 / _EP: "each rank holds E/ep experts, not one",
            1.5: "these experts have two matrices each (h x f up, f x h down), not three",
        }),
    },
    near=(1e-3, "close, but give the exact count, every parameter (a slip as small as "
                "the router's is 0.03% of it)"),
))

# --------------------------------------------------------------------------- bytes

_T, _H, _K, _BYTES_EP = 4096, 7168, 8, 64
_A2A = ep_all_to_all_bytes_per_layer(_T, _H, _K, dtype_bytes=2)
_VECTOR = _H * 2

register(Numeric(
    "06.all_to_all_bytes",
    _A2A,
    unit="bytes",
    prompt=f"""
        A rank of an expert-parallel group (ep = {_BYTES_EP}) holds T = {_T} tokens in one
        MoE layer of hidden size h = {_H}; each token goes to its top k = {_K} experts
        (no capacity limit). The all-to-alls move bf16 (2-byte) vectors. How many bytes
        does this rank put into this layer's token all-to-alls in one training step
        (forward and backward)? Count every row it sends, those to its own experts too;
        leave out the small exchange of counts. Give a number in bytes.
    """,
    working=f"""
        One hidden vector: h x 2 bytes = {_VECTOR:,} bytes. The rank's T x k = {_T * _K:,}
        choices each send their vector out to the expert's rank (dispatch), and the
        output comes back (combine): 2 all-to-alls forward. Backward sends their gradients
        the same two ways: 4 in all.

        4 x T x k x h x 2 = 4 x {_T} x {_K} x {_H} x 2 = **{_A2A:,} bytes**
        ({_A2A / 2**30:.2f} GiB) per layer. With balanced routing a share
        1/ep of it stays on the rank; the rest, {ep_expected_sent_fraction(_BYTES_EP):.3f}
        of it, crosses the network, every layer: expert parallelism wants fast
        all-to-all links.
    """,
    mistakes=factor_mistakes(_A2A, {
        0.5: "that is half: each choice's vector goes out and comes back (dispatch and "
             "combine) in forward, and the gradients travel both ways again in backward",
        0.25: "that is one all-to-all: there are four per layer and step (dispatch and "
              "combine, in forward and in backward)",
        1 / _K: f"each token is sent once per chosen expert: k = {_K} rows per token",
        2.0: "bf16 is 2 bytes per element",
        ep_expected_sent_fraction(_BYTES_EP): "count every row, also those addressed to "
                                              "the rank's own experts",
    }),
))

# --------------------------------------------------------------------------- capacity

_LOAD = [10, 3, 7, 2, 6, 4, 9, 7]  # choices that picked each expert
_DT, _DK, _CF = 24, 2, 1.25  # sum(_LOAD) = T x k
_CAP = expert_capacity(_DT * _DK, len(_LOAD), _CF)
_DROPPED = tokens_dropped(_LOAD, _CF)


def _dropped_at(capacity: int) -> int:
    return sum(max(0, n - capacity) for n in _LOAD)


register(Numeric(
    "06.tokens_dropped",
    _DROPPED,
    unit="choices",
    rtol=0.0,
    atol=1e-9,
    prompt=f"""
        A batch of T = {_DT} tokens reaches an MoE layer with E = {len(_LOAD)} experts and
        top-k = {_DK}. The router's T x k choices pick the experts this many times:
        {_LOAD} (expert 0 first). Each expert accepts at most ceil(capacity factor x
        T x k / E) choices and drops the rest. With capacity factor {_CF}, how many
        choices are dropped in all? Give a whole number.
    """,
    working=f"""
        Capacity: ceil({_CF} x {_DT} x {_DK} / {len(_LOAD)}) = ceil({_CF * _DT * _DK /
        len(_LOAD)}) = {_CAP} choices per expert. Only the experts picked more often drop
        the excess: {" + ".join(f"({n} - {_CAP})" for n in _LOAD if n > _CAP)} =
        **{_DROPPED}**. Those choices contribute nothing; a token whose every choice is
        dropped passes through on the residual. At capacity factor 1.0 (capacity
        {expert_capacity(_DT * _DK, len(_LOAD), 1.0)}), {tokens_dropped(_LOAD, 1.0)} would be
        dropped.
    """,
    mistakes={
        _dropped_at(int(_CF * _DT * _DK / len(_LOAD))):
            "the capacity is rounded up (ceil), never down",
        _dropped_at(expert_capacity(_DT, len(_LOAD), _CF)):
            "the fair share is T x k / E choices per expert: every token makes k choices",
        tokens_dropped(_LOAD, 1.0): "apply the capacity factor: the fair share times "
                                    f"{_CF}",
        sum(n > _CAP for n in _LOAD): "that counts the experts that drop; count the "
                                      "choices they drop: load - capacity each",
    },
))

# --------------------------------------------------------------------------- choice

register(Choice(
    "06.why_no_tp",
    "B",
    options={
        "A": "The router's top-k choice cannot be split across GPUs, so tensor parallelism "
             "does not work in a mixture-of-experts layer at all.",
        "B": "Its experts, most of its weights, are divided over 64 ranks, and each expert "
             "is small enough to compute whole on one GPU.",
        "C": "Its all-to-alls move only the token ids to the expert's GPU, not hidden "
             "vectors, so they cost far less than tensor parallelism's all-reduces.",
        "D": "Each token uses 8 of the 256 experts, so a GPU stores only the 8 experts its "
             "tokens pick and the model's size never mattered.",
    },
    prompt="""
        DeepSeek-V3 (671 billion parameters; per MoE layer 256 routed experts of width
        2048 with h = 7168, 8 of them per token) was trained with pipeline parallelism,
        64-way expert parallelism and data parallelism, and no tensor parallelism. What
        made that possible? Give one letter.
    """,
    working="""
        **B.** Nearly all of the parameters are experts, and expert parallelism divides
        them by ep = 64; pipeline parallelism divides the layers. What tensor parallelism
        would still split, the attention and each expert's matrices, is small: an expert
        h -> 2048 -> h fits one GPU and computes fast enough alone. Tensor parallelism
        would add all-reduces of the activations to every layer, on the critical path,
        for little memory saved. A is wrong: an expert's matrices can be split like any
        MLP's. C is wrong: the all-to-alls move each token's hidden vector, k times. D is
        wrong: every expert is stored on some GPU, whichever tokens pick it.
    """,
    hints={
        "A": "an expert is an MLP: its matrices could be split like any other MLP's. What "
             "would splitting them gain here?",
        "C": "the expert computes on the token's hidden vector: what must travel to its "
             "GPU?",
        "D": "other tokens pick the other experts: every expert lives on some GPU",
    },
))

__all__: list[str] = []
