"""torchtitan's per-operation checkpointing policy (recompute="op"), worked by hand: what it
keeps, what it reruns, and what a step pays for it beside the other policies."""

import pytest

from parlib.cost import Hardware, Layout, Model, estimate
from parlib.cost.memory import LSE_BYTES_PER_HEAD, activation_bytes_per_layer

LLAMA_8B = Model(32, 4096, 32, 8192, 128256, ffn_dim=14336, n_kv_heads=8, gated_mlp=True,
                 bias=False, learned_positions=False, dropout=False, name="Llama 3 8B")


def test_the_policy_keeps_what_torchtitan_saves_by_hand():
    s, h, kv, f, a = 8192, 4096, 1024, 14336, 32
    kw = dict(ffn_dim=f, kv_dim=kv, gated_mlp=True, dropout=False)
    # kept whole: the layer's input and w2's output; split t ways: wq's and wv's outputs,
    # attention's output, w1's output (bf16), and a 4-byte log-sum-exp per head
    whole, split = 2 * h * 2, (h + kv + h + f) * 2 + a * LSE_BYTES_PER_HEAD
    assert LSE_BYTES_PER_HEAD == 4
    assert activation_bytes_per_layer(s, 1, h, a, recompute="op", **kw) == s * (whole + split)
    assert activation_bytes_per_layer(s, 2, h, a, recompute="op", **kw) == 2 * s * (whole + split)
    # tensor parallelism splits the second part; sequence parallelism the first too
    assert activation_bytes_per_layer(s, 1, h, a, recompute="op", t=4, **kw) == \
        s * (whole + split / 4)
    assert activation_bytes_per_layer(s, 1, h, a, recompute="op", t=4, sequence_parallel=True,
                                      **kw) == s * (whole + split) / 4
    # an ungated MLP's last matrix is the sixth matmul, rerun: only the input is kept whole
    ungated = dict(kw, gated_mlp=False)
    assert activation_bytes_per_layer(s, 1, h, a, recompute="op", **ungated) == \
        s * (h * 2 + split)
    # between full recomputation and keeping everything (no scores: a fused kernel)
    full = activation_bytes_per_layer(s, 1, h, a, recompute="full", **kw)
    kept = activation_bytes_per_layer(s, 1, h, a, recompute="selective", **kw)
    assert full < activation_bytes_per_layer(s, 1, h, a, recompute="op", **kw) < kept


def test_a_step_under_the_policy_reruns_half_the_matmuls_and_every_memory_bound_op():
    hardware = Hardware.dgx_a100(8)
    kw = dict(m=1, global_batch=8, zero=3, fused_attention=True)
    op = estimate(LLAMA_8B, hardware, Layout(dp=8), recompute="op", **kw)
    none = estimate(LLAMA_8B, hardware, Layout(dp=8), **kw)
    full = estimate(LLAMA_8B, hardware, Layout(dp=8), recompute=True, **kw)
    tokens = 8 * 8192
    # wk, wo and w3 rerun: 2 x 4096 x (1024 + 4096 + 14336) FLOPs a token per layer
    assert op.hardware_flops - none.hardware_flops == 32 * 2 * 4096 * 19456 * tokens
    assert op.model_flops == none.model_flops
    # the memory-bound ops run a second forward, as under full recomputation
    assert op.time["memory_bound"] == pytest.approx(full.time["memory_bound"])
    assert op.time["memory_bound"] > none.time["memory_bound"]
    # memory: the kept tensors of 32 layers plus, during one layer's backward, what it reruns
    kept = activation_bytes_per_layer(8192, 1, 4096, 32, recompute="op", ffn_dim=14336,
                                      kv_dim=1024, gated_mlp=True, dropout=False)
    whole = activation_bytes_per_layer(8192, 1, 4096, 32, recompute="selective", ffn_dim=14336,
                                       kv_dim=1024, gated_mlp=True, dropout=False)
    logits = none.memory["activations"] - 32 * whole
    assert op.memory["activations"] == pytest.approx(32 * kept + (whole - kept) + logits)
    assert full.memory["activations"] < op.memory["activations"] < none.memory["activations"]
    assert "per-op recompute" in str(op)


def test_the_policy_is_refused_where_it_is_not_defined():
    hardware = Hardware.dgx_a100(8)
    with pytest.raises(ValueError, match="pass fused_attention=True"):
        estimate(LLAMA_8B, hardware, Layout(dp=8), m=1, global_batch=8, recompute="op")
    moe = Model(4, 512, 8, 1024, 1000, n_experts=4, top_k=2, name="moe")
    with pytest.raises(ValueError, match="dense model"):
        estimate(moe, hardware, Layout(dp=8), m=1, global_batch=8, recompute="op",
                 fused_attention=True)
