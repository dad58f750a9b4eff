"""Expert parallelism in the estimate and the planner: a hand-worked MoE layout on 4 ranks."""

import pytest

from parlib.cost import (
    Hardware,
    Layout,
    Link,
    Model,
    best_layouts,
    candidate_layouts,
    estimate,
    expert_flops_per_token,
    moe_params_per_rank,
)

# L=2, h=8, a=2, s=4, V=16; 4 experts of width 16, top 2; biases (GPT-style)
MOE = Model(2, 8, 2, 4, 16, n_experts=4, top_k=2, expert_ffn_dim=16)
HW = Hardware(4, 4, 1e9, 1e9, Link(1e-6, 1e9), Link(1e-5, 1e8))  # one node of 4


def test_moe_model_counts_experts_in_params_and_k_of_them_in_flops():
    # one expert: 2 x 8 x 16 weights + 16 + 8 biases = 280; 4 of them 1120; the layer adds
    # attention 4 x 64 = 256, router 8 x 4 = 32, attention biases 32, two LayerNorms 32
    assert MOE.expert_params_each == 280 and MOE.layer_params == 256 + 32 + 32 + 1120 + 32
    assert MOE.moe_layer_params_per_rank(2) == moe_params_per_rank(4, 2, 8, 16) == 2 * 280 + 32
    # the MLP forward of a token: k = 2 experts of 2 x 2 x 8 x 16 and the router 2 x 8 x 4
    assert MOE.layer_forward_flops_per_token()[1] == expert_flops_per_token(8, 16, 2, 4) == 1088
    dense = Model(2, 8, 2, 4, 16)
    assert not dense.is_moe and dense.expert_params_each == 0
    with pytest.raises(ValueError, match="top_k=5 is more than the 4 experts"):
        Model(2, 8, 2, 4, 16, n_experts=4, top_k=5)


def test_hand_worked_expert_parallel_layout():
    # d = 4 ranks, e = 4 (the experts split 4 ways, one each), m = 1, global batch 4: b = 1,
    # fp32. All-to-alls per layer: 4 tokens x k = 2 choices x h = 8 x 4 bytes = 256 B each,
    # dispatch and combine, forward and backward: 4 of them, 1024 B
    est = estimate(MOE, HW, Layout(dp=4, ep=4), m=1, global_batch=4, mixed_precision=False)
    # each: 3 pairwise messages of alpha + 64 B x 1 ns = 3.192 us; 4 per layer x 2 layers
    assert est.time["ep_comm"] == pytest.approx(8 * 3.192e-6)
    # 3/4 of the 1024 B a layer leaves the rank: 768 B x 2 layers
    assert est.bytes_sent["ep"] == 1536 and est.links["ep"] == "intra-node"
    # params: dense 2 x (1472 - 1120) + embedding 160 + head 160 = 1024, experts 2 x 280,
    # 4 bytes each = 6336 B
    assert est.memory["params"] == 4 * (1024 + 560)
    # gradient sync: only the dense part (each expert has one copy: d / e = 1): all-reduce
    # of 4096 B over 4: a ring takes 6 alphas + 2 x 3/4 x 4096 B x 1 ns = 12.144 us, NCCL's
    # tree 4 alphas + 6.144 us / 0.92 = 10.678 us: the tree is picked
    assert est.time["dp_sync_total"] == pytest.approx((4 + 6.144 / 0.92) * 1e-6)
    # e = 2: two copies of each expert sync too: 4480 B over 2, 2 alphas + 4480 ns = 6.48 us
    half = estimate(MOE, HW, Layout(dp=4, ep=2), m=1, global_batch=4, mixed_precision=False)
    assert half.time["dp_sync_total"] == pytest.approx((4 + 6.144 / 0.92 + 6.48) * 1e-6)
    assert half.memory["params"] == 4 * (1024 + 1120)
    # e = 1: no all-to-all; ep in the time parts, not in the links of a layout without it
    whole = estimate(MOE, HW, Layout(dp=4), m=1, global_batch=4, mixed_precision=False)
    assert whole.time["ep_comm"] == 0 and "ep" not in whole.links
    assert est.step_time == pytest.approx(whole.step_time - whole.time["dp_sync"]
                                          + est.time["dp_sync"] + est.time["ep_comm"])


def test_ep_is_refused_for_dense_models_and_uneven_expert_splits():
    with pytest.raises(ValueError, match="expert parallelism needs a mixture-of-experts"):
        estimate(Model(2, 8, 2, 4, 16), HW, Layout(dp=4, ep=2), m=1, global_batch=4)
    three = Model(2, 8, 2, 4, 16, n_experts=6, top_k=2)
    with pytest.raises(ValueError, match="e = 4 does not divide the model's 6 experts"):
        estimate(three, HW, Layout(dp=4, ep=4), m=1, global_batch=4)
    # ep borrowing tp too (torchtitan's placement) holds whole experts: not what it prices
    with pytest.raises(ValueError, match="prices ep over dp x cp"):
        estimate(MOE, HW, Layout(dp=2, tp=2, ep=2, ep_borrows=("dp", "cp", "tp")), m=1,
                 global_batch=2)


def test_the_planner_searches_ep_for_mixtures_only():
    dense = Model(24, 2048, 16, 4096, 32000, gated_mlp=True, bias=False)
    moe = Model(24, 2048, 16, 4096, 32000, gated_mlp=True, bias=False, n_experts=64, top_k=6,
                expert_ffn_dim=1408)
    hw = Hardware.dgx_h100(64)
    assert all(lay.ep == 1 for lay, _, _ in candidate_layouts(dense, hw, 512))
    tried = {lay.ep for lay, _, _ in candidate_layouts(moe, hw, 512)}
    assert tried == {1, 2, 4, 8, 16, 32, 64}  # every divisor of d x c that divides 64
    ranked = best_layouts(moe, hw, global_batch=512, top=10)
    assert ranked and any(e.layout.ep > 1 for e in ranked)
    for e in ranked:
        if e.layout.ep > 1:
            assert e.time["ep_comm"] > 0 and "experts split" in e.reason
