"""parlib.cost.experts: parameters per ep rank, all-to-all bytes, capacity and drops, compute
per token, imbalance; collective_time of an all-to-all. Checked against numbers worked by hand
and against the model itself."""

import pytest

from parlib import cost
from parlib.cost.experts import (
    ep_all_to_all_bytes_per_layer,
    ep_count_bytes_per_layer,
    ep_expected_sent_fraction,
    expert_capacity,
    expert_flops_per_token,
    expert_params,
    load_imbalance,
    moe_params_per_rank,
    tokens_dropped,
)


def test_parameters_per_rank_by_hand():
    # h = 4, f = 8: 2*4*8 + 8 + 4 = 76 per expert; E = 8 over ep = 2: 4 experts + router 32
    assert expert_params(4, 8) == 76
    assert expert_params(4, 8, bias=False) == 64
    assert moe_params_per_rank(8, 2, 4, 8) == 4 * 76 + 32
    assert moe_params_per_rank(8, 8, 4, 8) == 76 + 32
    with pytest.raises(ValueError, match="E must be divisible by ep"):
        moe_params_per_rank(8, 3, 4, 8)


def test_parameters_match_the_model():
    from parlib.model import ModelConfig, MoE
    cfg = ModelConfig(d_model=16, n_heads=2, n_experts=4, top_k=2, expert_hidden=24)
    moe = MoE(cfg)
    assert sum(p.numel() for p in moe.parameters()) == moe_params_per_rank(4, 1, 16, 24)


def test_all_to_all_bytes_by_hand():
    # 10 tokens x k=2 choices x h=8 x 4 bytes = 640 per direction; out and back = 1280 a pass
    assert ep_all_to_all_bytes_per_layer(10, 8, 2, passes=("forward",)) == 1280
    assert ep_all_to_all_bytes_per_layer(10, 8, 2) == 2560
    assert ep_all_to_all_bytes_per_layer(10, 8, 2, dropped=3) == 2 * 2 * 17 * 8 * 4
    assert ep_all_to_all_bytes_per_layer(10, 8, 1, dtype_bytes=2) == 2 * 2 * 10 * 8 * 2
    with pytest.raises(ValueError, match="passes"):
        ep_all_to_all_bytes_per_layer(10, 8, 2, passes=("sideways",))
    assert ep_count_bytes_per_layer(8) == 64
    assert ep_expected_sent_fraction(4) == 0.75 and ep_expected_sent_fraction(1) == 0


def test_capacity_and_drops_by_hand():
    # 16 tokens x k = 2 over E = 4: fair share 8 choices per expert
    assert expert_capacity(32, 4, 1.0) == 8
    assert expert_capacity(32, 4, 1.25) == 10
    assert expert_capacity(32, 4, 2.0) == 16
    assert expert_capacity(30, 4, 1.0) == 8  # 7.5 rounds up
    assert expert_capacity(32, 4, None) is None
    load = [14, 10, 6, 2]  # 32 choices
    assert tokens_dropped(load, 1.0) == 6 + 2
    assert tokens_dropped(load, 1.25) == 4
    assert tokens_dropped(load, 2.0) == 0
    assert tokens_dropped(load, None) == 0
    assert tokens_dropped([8, 8, 8, 8], 1.0) == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        tokens_dropped(load, 0)


def test_compute_per_token_does_not_grow_with_experts():
    assert expert_flops_per_token(4, 8, 2) == 2 * 4 * 4 * 8
    # more experts: the same expert work, only the router grows
    assert (expert_flops_per_token(4, 8, 2, n_experts=64)
            - expert_flops_per_token(4, 8, 2, n_experts=8)) == 2 * 4 * 56


def test_imbalance():
    assert load_imbalance([10, 10, 10, 10]) == 1
    assert load_imbalance([40, 0, 0, 0]) == 4
    assert load_imbalance([30, 10]) == 1.5
    with pytest.raises(ValueError):
        load_imbalance([0, 0])


def test_collective_time_knows_all_to_all():
    # 4 ranks, a 1 MB input split evenly: 3 messages of 250 kB leave each rank
    t = cost.collective_time("all_to_all", 1e6, 4, alpha=1e-5, beta=1e-9)
    assert t == pytest.approx(3 * 1e-5 + 7.5e5 * 1e-9)
    assert cost.collective_time("all_to_all", 1e6, 1, 1e-5, 1e-9) == 0
    # half the bytes of an all-reduce of the same message, a third of its alphas less
    assert t < cost.collective_time("all_reduce", 1e6, 4, 1e-5, 1e-9)


def test_exported_from_the_cost_package():
    for name in ("ep_all_to_all_bytes_per_layer", "moe_params_per_rank", "tokens_dropped",
                 "expert_capacity", "load_imbalance"):
        assert name in cost.__all__ and getattr(cost, name) is globals()[name]
