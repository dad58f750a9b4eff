"""parlib.experiments.experts: the expert-parallel chapter's harnesses report what they
measure (checks that can fail, bytes and drops equal to the formulas, EP and EP x DP
training equal to the reference run, the load-balancing loss balancing), and the
chapter's three drawings take their output."""

from __future__ import annotations

import functools

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import parlib  # noqa: E402
from parlib.cost.experts import (  # noqa: E402
    ep_all_to_all_bytes_per_layer,
    ep_count_bytes_per_layer,
    tokens_dropped,
)
from parlib.experiments import experts as X  # noqa: E402
from parlib.model import ModelConfig, MoE, route  # noqa: E402
from parlib.plots import (  # noqa: E402
    draw_balance_over_steps,
    draw_expert_imbalance,
    draw_tokens_per_expert,
)
from parlib.verify import compare, reference_run  # noqa: E402

E, K = 8, 2
CFG = ModelConfig(seq_len=8, d_model=16, n_heads=2, n_layers=2, n_experts=E, top_k=K,
                  expert_hidden=24)
TOKENS = 32


def _on_ranks():
    torch.set_num_threads(1)
    return {"traffic": X.layer_traffic(CFG, TOKENS, (None, 1.0)),
            "step": X.emulated_step(CFG, 32, skew=2.0, row_seconds=0.001)}


@functools.lru_cache(maxsize=None)
def _results():
    return parlib.launch(_on_ranks, world_size=2, timeout=240)


def test_layer_traffic_checks_bytes_and_drops_against_the_formulas():
    ranks = [r["traffic"] for r in _results()]
    for factor in (None, 1.0):
        got = [r[factor] for r in ranks]
        assert all(g["check"] for g in got), factor
        for g in got:
            assert [op for op, _ in g["records"]] == ["all_to_all"] * 5 and g["n_forward"] == 3
            assert g["records"][0][1] == ep_count_bytes_per_layer(E)
            assert sum(g["load"]) == TOKENS * K
            assert g["dropped"] == tokens_dropped(g["load"], factor)
        measured = sum(n for g in got for _, n in g["records"][1:])
        assert measured == sum(ep_all_to_all_bytes_per_layer(TOKENS, CFG.d_model, K,
                                                             dropped=g["dropped"])
                               for g in got)
        # what the ranks computed is what they kept, all of it
        assert sum(g["computed"] for g in got) == sum(TOKENS * K - g["dropped"] for g in got)
    assert sum(r[1.0]["dropped"] for r in ranks) > 0  # the drops were exercised


def test_emulated_step_sleeps_in_proportion_to_the_rows():
    steps = [r["step"] for r in _results()]
    rows = [s["rows"] for s in steps]
    assert sum(rows) == 2 * 32 * K
    for s in steps:
        assert s["busy"] >= s["rows"] * 0.001 and s["total"] >= s["busy"]
    slowest = max(steps, key=lambda s: s["rows"])
    assert all(s["total"] >= 0.9 * slowest["busy"] for s in steps)  # the combine waits


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_training_equals_the_reference(world, ep):
    ref = reference_run(CFG, steps=2, batch=8, lr=0.1)
    runs = parlib.launch(X.train_expert_parallel, CFG, ep, steps=2, batch=8, lr=0.1,
                         world_size=world, timeout=240)
    seen = set()
    for r in runs:
        assert compare(r["losses"], ref.losses)
        for k in range(2):
            assert compare(r["grads"][k], {n: ref.grads[k][n] for n in r["grads"][k]})
        assert compare(r["params"], {n: ref.params[n] for n in r["params"]})
        seen |= set(r["params"])
    assert seen == set(ref.params)
    tokens = 8 // world * CFG.seq_len
    assert sum(r["bytes"] for r in runs) == world * CFG.n_layers * \
        ep_all_to_all_bytes_per_layer(tokens, CFG.d_model, K)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_dense_reference_equals_the_layer_and_notices_a_dropped_choice(capacity_factor):
    torch.manual_seed(0)
    layer = MoE(ModelConfig(d_model=16, n_heads=2, n_experts=E, top_k=K,
                            capacity_factor=capacity_factor))
    x = torch.randn(24, 16)
    assert compare([layer(x)], [X.dense_moe_output(layer, x)])
    if capacity_factor is not None:  # the reference ignoring capacity would differ
        uncapped = MoE(ModelConfig(d_model=16, n_heads=2, n_experts=E, top_k=K))
        uncapped.load_state_dict(layer.state_dict())
        assert (~route(x, layer.router, K, capacity_factor).keep).any()
        assert not compare([layer(x)], [X.dense_moe_output(uncapped, x)])


@pytest.mark.parametrize("tokens", [3, 24])  # 3 tokens: most experts get no rows
def test_grouped_matmul_experts_equal_the_layer_forward_and_backward(tokens):
    torch.manual_seed(0)
    layer = MoE(ModelConfig(d_model=16, n_heads=2, n_experts=E, top_k=K, expert_hidden=32,
                            capacity_factor=1.0))
    x = torch.randn(tokens, 16)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = layer(want_x)
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    got = X.grouped_moe_output(layer, got_x)
    got.sum().backward()
    assert compare([got, got_x.grad], [want, want_x.grad])
    assert compare({n: p.grad for n, p in layer.named_parameters()}, want_grads)
    assert not compare([got], [X.grouped_moe_output(layer, x.flip(0))])


def test_the_load_balancing_loss_balances_the_router():
    cfg = ModelConfig(seq_len=8, d_model=16, n_heads=2, n_layers=1, n_experts=E, top_k=K,
                      expert_hidden=24)
    plain = X.router_balance(cfg, steps=120, aux_weight=0.0, batch=16, lr=0.2)
    balanced = X.router_balance(cfg, steps=120, aux_weight=0.5, batch=16, lr=0.2)
    assert len(plain["imbalance"]) == 120 and min(plain["imbalance"]) >= 1.0
    late = slice(-40, None)
    assert (sum(balanced["imbalance"][late]) < 0.9 * sum(plain["imbalance"][late]))
    assert balanced["aux"][-1] < plain["aux"][-1]


def test_the_drawings_take_the_harness_output():
    import matplotlib.pyplot as plt

    traffic = _results()[0]["traffic"]
    ax = draw_tokens_per_expert(traffic[None]["load"], {1.0: 8, 2.0: 16}, caption="2 ranks")
    assert len(ax.patches) == E and len(ax.lines) == 2 and ax.get_title() == "2 ranks"
    ax = draw_expert_imbalance({"skewed": [r["step"] for r in _results()]})
    assert len(ax.patches) >= 4  # busy and waiting, per rank
    ax = draw_balance_over_steps({"a": [1.5, 1.4, 1.3], "b": [1.2, 1.1, 1.0]}, window=2)
    assert len(ax.lines) == 5  # raw and smoothed per run, and the balanced line
    plt.close("all")
