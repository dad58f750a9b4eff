"""parlib.cost formulas against hand-worked cases: activations, ZeRO states, the pipeline's
in-flight count, the per-link alpha-beta, parameter counts and FLOPs."""

import pytest

from parlib.cost import (
    Model,
    activation_bytes_per_layer,
    collective_time,
    in_flight_microbatches,
    logits_bytes,
    model_state_bytes,
    model_state_bytes_by_kind,
    per_link_alpha_beta,
)

# GPT-3 175B's layer (Korthikanti et al. 2022 use it too): s = 2048, b = 1, h = 12288, a = 96.
S, B, H, A = 2048, 1, 12288, 96
SBH = S * B * H  # 25,165,824


def test_activations_match_korthikanti_16_bit():
    # s*b*h*(34 + 5*a*s/h) = SBH * (34 + 80)
    assert activation_bytes_per_layer(S, B, H, A) == SBH * 114 == 2_868_903_936
    # t = 8 without sequence parallelism: SBH * (10 + 24/8 + 80/8) = SBH * 23
    assert activation_bytes_per_layer(S, B, H, A, t=8) == SBH * 23
    # t = 8 with sequence parallelism: everything / 8
    assert activation_bytes_per_layer(S, B, H, A, t=8, sequence_parallel=True) == SBH * 114 / 8
    # selective recomputation drops the 5as/h term: SBH * 34 / 8
    assert activation_bytes_per_layer(S, B, H, A, t=8, sequence_parallel=True,
                                      recompute="selective") == SBH * 34 / 8
    # full recomputation keeps the layer input: 2 * SBH, / t with sequence parallelism
    assert activation_bytes_per_layer(S, B, H, A, recompute="full") == 2 * SBH
    assert activation_bytes_per_layer(S, B, H, A, t=8, sequence_parallel=True,
                                      recompute="full") == 2 * SBH / 8


def test_activations_other_dtypes_and_shapes():
    # fp32 without dropout, one tiny layer: s=4, b=2, h=8, a=2, f=32.
    # kept whole: 4 tensors of s*b*h = 64 elements x 4 bytes = 1024
    # split: Q K V out (4 x 64) + two MLP hidden (2 x 4*2*32 = 512) = 768 elements = 3072 B
    # scores: a*s*s*b = 64 elements = 256 B
    assert activation_bytes_per_layer(4, 2, 8, 2, dtype_bytes=4, dropout=False) == 1024 + 3072 + 256
    # grouped KV (kv_dim 2) and a gated MLP (three hidden tensors of f = 32)
    # split: Q + out (2 x 64) + K, V (2 x 4*2*2 = 32) + 3 x 256 = 928 elements = 3712 B
    assert activation_bytes_per_layer(4, 2, 8, 2, dtype_bytes=4, dropout=False, kv_dim=2,
                                      gated_mlp=True) == 1024 + 3712 + 256
    # bigger microbatch, more bytes, exactly in proportion for the parts linear in b
    assert activation_bytes_per_layer(S, 4, H, A) == 4 * activation_bytes_per_layer(S, 1, H, A)
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(S, B, H, A, recompute="some")
    with pytest.raises(ValueError, match="micro_batch"):
        activation_bytes_per_layer(S, 0, H, A)


def test_logits_bytes():
    # (b, s, V) in bf16 plus an fp32 copy: 8192 * 128000 * (2 + 4), split 8 ways
    assert logits_bytes(8192, 1, 128000) == 6_291_456_000
    assert logits_bytes(8192, 1, 128000, t=8) == 6_291_456_000 / 8


def test_model_state_by_kind_shards_per_zero_stage():
    p = 1000
    assert model_state_bytes_by_kind(p, 4, 0, True) == {"optimizer": 12000, "grads": 2000,
                                                       "params": 2000}
    assert model_state_bytes_by_kind(p, 4, 1, True) == {"optimizer": 3000, "grads": 2000,
                                                       "params": 2000}
    assert model_state_bytes_by_kind(p, 4, 2, False) == {"optimizer": 2000, "grads": 1000,
                                                        "params": 4000}
    assert model_state_bytes_by_kind(p, 4, 3, False) == {"optimizer": 2000, "grads": 1000,
                                                        "params": 1000}
    for stage in range(4):  # the total is still the old function's
        assert sum(model_state_bytes_by_kind(p, 8, stage).values()) == model_state_bytes(p, 8,
                                                                                         stage)


def test_in_flight_microbatches():
    assert in_flight_microbatches(4, 8) == 4  # 1F1B holds p
    assert in_flight_microbatches(4, 2) == 2  # or all m if fewer
    # interleaved, p = 4, v = 2: warm-up 2*3 + 1*4 = 10, plus one = 11 chunks of L/8 layers
    assert in_flight_microbatches(4, 8, 2) == 11
    assert in_flight_microbatches(4, 1, 2) == 2  # capped at v*m
    with pytest.raises(ValueError):
        in_flight_microbatches(0, 1)


def test_per_link_alpha_beta_inverts_the_ring_line():
    alpha, beta = 20e-6, 1e-9
    n = 4
    # an all-reduce time line on 4 ranks: 6 alpha + 1.5 beta x bytes
    a = collective_time("all_reduce", 0.0, n, alpha, beta)
    b = collective_time("all_reduce", 1e6, n, alpha, beta) - a
    assert (a, b / 1e6) == pytest.approx((6 * alpha, 1.5 * beta))
    assert per_link_alpha_beta(a, b / 1e6, n) == pytest.approx((alpha, beta))
    with pytest.raises(ValueError, match="n >= 2"):
        per_link_alpha_beta(a, b, 1)


def test_tiny_model_parameter_count_matches_torch():
    from parlib.model import ModelConfig, build_model

    for cfg in (ModelConfig(), ModelConfig(n_layers=2, d_model=64, n_heads=2, mlp_ratio=2,
                                           vocab_size=100, seq_len=16)):
        real = sum(p.numel() for p in build_model(cfg).parameters())
        assert Model.from_config(cfg).n_params == real
    assert Model.from_config(ModelConfig()).n_params == 867_328  # 4 x 198,272 + 40,960 + 33,280


def test_rank_flops_split_the_model_flops():
    from parlib.model import ModelConfig

    tiny = Model.from_config(ModelConfig())
    whole = tiny.rank_forward_flops_per_token(layers=tiny.n_layers, head=True)
    assert whole == tiny.forward_flops_per_token
    attention, mlp = tiny.layer_forward_flops_per_token()
    # h = 128, s = 64: attention 2 x 4h^2 + 4sh = 163,840; MLP 2 x 8h^2 = 262,144
    assert (attention, mlp) == (163_840, 262_144)
    assert tiny.layer_forward_flops_per_token(4) == (attention / 4, mlp / 4)
    # p = 2, t = 2: each rank 2 layers split 2 ways; the last stage adds the whole head
    first = tiny.rank_forward_flops_per_token(layers=2, t=2)
    last = tiny.rank_forward_flops_per_token(layers=2, t=2, head=True)
    assert first == 2 * (attention + mlp) / 2 and last - first == 2 * 256 * 128
    with pytest.raises(ValueError, match="layers"):
        tiny.rank_forward_flops_per_token(layers=5)


def test_llama_3_405b_parameter_count():
    # Dubey et al. 2024, Table 3: 126 layers, 16384, FFN 53248, 128 heads, 8 KV heads, 128K vocab
    llama = Model(126, 16384, 128, 8192, 128000, ffn_dim=53248, n_kv_heads=8, gated_mlp=True,
                  bias=False, learned_positions=False)
    # per layer: q, o 16384^2 each, k, v 16384 x 1024 each, MLP 3 x 16384 x 53248, 2 norms
    layer = 2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384
    assert llama.layer_params == layer == 3_187_703_808
    assert llama.n_params == 126 * layer + 128000 * 16384 + (16384 + 128000 * 16384)
    assert llama.n_params == pytest.approx(405e9, rel=0.005)


def test_flops_per_token():
    # L=4, h=8, a=2, s=4, V=16, f=32: matrices per layer 4*64 + 2*8*32 = 768, x4 + V*h = 3200
    m = Model(4, 8, 2, 4, 16)
    assert m.matmul_params == 3200
    assert m.attention_flops_per_token == 4 * 4 * 4 * 8  # 4 s h per layer
    assert m.flops_per_token == 6 * 3200 + 12 * 4 * 4 * 8 == 20736
    assert m.layers_forward_flops_per_token == 2 * 4 * 768 + 512


def test_flops_match_megatron_formula_with_recomputation():
    """Narayanan et al. 2021 count 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs per step
    with activation recomputation; our model FLOPs plus the recomputed forward agree."""
    from parlib.cost import Hardware, Layout, estimate

    gpt = Model(96, 12288, 96, 2048, 51200, tied_embeddings=True)
    est = estimate(gpt, Hardware.dgx_a100(1024), Layout(dp=16, tp=8, pp=8), m=96,
                   global_batch=1536, recompute=True)
    b, s, layers, h, v = 1536, 2048, 96, 12288, 51200
    megatron = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    assert est.hardware_flops == pytest.approx(megatron, rel=1e-12)
    recomputed = 2 * b * s * (layers * 12 * h**2 + 2 * layers * s * h)  # one more forward
    assert est.model_flops == pytest.approx(megatron - recomputed, rel=1e-12)


def test_model_rejects_bad_sizes():
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=3"):
        Model(2, 10, 3, 8, 16)
    with pytest.raises(ValueError, match="n_layers must be a positive integer"):
        Model(0, 8, 2, 8, 16)
    with pytest.raises(ValueError, match="n_kv_heads"):
        Model(2, 8, 4, 8, 16, n_kv_heads=3)
