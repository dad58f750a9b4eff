"""3-D parallelism (dp x tp x pp) trains exactly like one device, for four layouts."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import parlib
from parlib import verify
from parlib.cost import Layout, mesh_sent_bytes_per_step
from parlib.cost.layout import EP_OVER_TP
from parlib.experiments import combined as C
from parlib.model import ModelConfig

# heads and widths divide t = 1, 2, 4; layers divide p = 1, 2, 4
CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
STEPS, BATCH, M = 2, 8, 2


def check(results, reference):
    got, want = C.pair_with_reference(results, reference)
    return verify.compare(got, want), len(got)


@pytest.fixture(scope="module")
def reference():
    return verify.reference_run(CFG, steps=STEPS, batch=BATCH)


@pytest.mark.parametrize("d,t,p", [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1)])
def test_3d_training_equals_single_device(d, t, p, reference):
    results = parlib.launch(C.rank_train_3d, Layout(dp=d, tp=t, pp=p), cfg=CFG, steps=STEPS,
                            global_batch=BATCH, m=M, world_size=d * t * p, timeout=300)
    verdict, checked = check(results, reference)
    assert verdict.ok, str(verdict)
    # every rank, every step, every gradient and parameter it holds, and the losses
    n_params = len(reference.params)
    assert checked >= (STEPS + 1) * n_params * d * t
    losses = [r["losses"] for r in results if r["coord"]["pp"] == p - 1]
    assert len(losses) == d * t and all(len(x) == STEPS and None not in x for x in losses)
    if t > 1:  # the matrices really are split
        r0 = results[0]
        assert r0["grads"][0]["blocks.0.mlp.up.weight"].shape[0] == 4 * CFG.d_model // t


def test_the_check_rejects_wrong_results():
    results = parlib.launch(C.rank_train_3d, Layout(dp=2, tp=2, pp=2), cfg=CFG, steps=1,
                            global_batch=BATCH, m=M, world_size=8, timeout=300)
    ref = verify.reference_run(CFG, steps=1, batch=BATCH)
    assert check(results, ref)[0].ok
    # DP gradients summed instead of averaged
    doubled = copy.deepcopy(results)
    g = doubled[3]["grads"][0]
    g["blocks.0.attn.q.weight"] = 2 * g["blocks.0.attn.q.weight"]
    assert not check(doubled, ref)[0].ok
    # tensor-parallel shards in the wrong order
    swapped = copy.deepcopy(results)
    for r in swapped:
        r["coord"]["tp"] = 1 - r["coord"]["tp"]
    assert not check(swapped, ref)[0].ok
    # one rank's step lost
    stale = copy.deepcopy(results)
    stale[6]["params"] = {n: v + 1e-3 for n, v in stale[6]["params"].items()}
    bad = check(stale, ref)[0]
    assert not bad.ok and bad.where.startswith("rank 6")


# --------------------------------------------------------------------------- four, five axes
# A mixture of experts (4 experts, top 2, no capacity limit: nothing dropped) on 2 layers,
# one per stage; s = 16 cuts into 2 x cp = 4 zig-zag chunks.
MOE = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4,
                  top_k=2, expert_hidden=32)
ND_STEPS = 3


@pytest.fixture(scope="module")
def moe_reference():
    return verify.reference_run(MOE, steps=ND_STEPS, batch=BATCH)


def run_nd(layout):
    return parlib.launch(C.rank_train_nd, layout, cfg=MOE, steps=ND_STEPS, global_batch=BATCH,
                         m=M, record=True, schedule="1f1b", sequence_layout="zigzag",
                         world_size=layout.world, timeout=600)


def check_nd(layout, results, reference):
    verdict, checked = check(results, reference)
    assert verdict.ok, str(verdict)
    assert checked >= ND_STEPS * len(reference.params)
    # the experts really are split: each rank holds E / ep of them
    expert_names = {n for n in results[0]["params"] if ".experts." in n}
    held = {n.split(".experts.")[1].split(".")[0] for n in expert_names}
    assert len(held) == MOE.n_experts // layout.ep
    # bytes per axis per step, as cost predicts, exactly: tp, cp, dp, pp per rank, ep
    # (what a rank puts into its all-to-alls, which depends on the routing) as the mean
    # over each ep group, whatever the routing
    table = C.bytes_per_axis(layout, results, MOE, BATCH, M)
    expected = {"tp", "cp", "pp", "ep"} | ({"dp"} if layout.dp > 1 else set())
    for rank, axes in table.items():
        assert set(axes) == expected
        for axis, (got, want) in axes.items():
            assert got == want > 0, (rank, axis, got, want)


def test_four_axes_with_experts_equal_single_device(moe_reference):
    """pp = 2 x cp = 2 x tp = 2 on 8 ranks, ep = 2 over the cp ranks, zig-zag, 1F1B."""
    layout = Layout(pp=2, cp=2, tp=2, ep=2)
    results = run_nd(layout)
    check_nd(layout, results, moe_reference)
    assert results[0]["groups"]["ep"] == results[0]["groups"]["cp"] == [0, 2]
    # an expert's gradient summed over the context-parallel ranks instead of averaged
    summed = copy.deepcopy(results)
    g = summed[2]["grads"][1]
    name = next(n for n in g if ".experts." in n)
    g[name] = 2 * g[name]
    assert not check(summed, moe_reference)[0].ok


@pytest.mark.slow
def test_five_axes_with_experts_equal_single_device(moe_reference):
    """pp = 2 x dp = 2 x cp = 2 x tp = 2 on 16 ranks, ep = 2 (an expert's copies on dp)."""
    layout = Layout(pp=2, dp=2, cp=2, tp=2, ep=2)
    results = run_nd(layout)
    check_nd(layout, results, moe_reference)
    assert all(r["traffic"]["dp"]["sent_bytes"] > 0 for r in results)


def test_bad_input_gets_a_clear_error():
    from parlib.strategies import combined as S

    # a Layout has the sizes build_nd's check reads off the mesh
    with pytest.raises(ValueError, match="ep=4: build_nd places ep over the cp ranks"):
        S._check_mesh(Layout(dp=4, cp=2, ep=4), MOE, "zigzag")
    with pytest.raises(ValueError, match="the model is dense"):
        S._check_mesh(Layout(cp=2, ep=2), CFG, "zigzag")
    # torchtitan's placement puts a tp pair in one ep group: the same tokens sent twice
    with pytest.raises(ValueError, match="ep cannot borrow the tp ranks"):
        S._check_mesh(Layout(cp=2, tp=2, ep=2, ep_borrows=EP_OVER_TP), MOE, "zigzag")
    S._check_mesh(Layout(cp=2, tp=1, ep=2, ep_borrows=EP_OVER_TP), MOE, "zigzag")  # t = 1
    # the bytes' formulas assume the same placements
    bytes_of = dict(b=1, s=16, h=32, m=2, layers=1, stage=0, shared_param_bytes=4.0,
                    n_experts=4, top_k=2)
    with pytest.raises(ValueError, match="pick one of those e"):
        mesh_sent_bytes_per_step(Layout(dp=4, cp=2, ep=4), **bytes_of)
    with pytest.raises(ValueError, match="leave ep_borrows at its default"):
        mesh_sent_bytes_per_step(Layout(cp=2, tp=2, ep=2, ep_borrows=EP_OVER_TP), **bytes_of)
    assert mesh_sent_bytes_per_step(Layout(cp=2, tp=2, ep=2), **bytes_of)["ep"] > 0
    with pytest.raises(ValueError, match=r"pp=3 does not divide .* pick pp from \[1, 2\]"):
        S._check_mesh(Layout(pp=3), MOE, "zigzag")
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        S._check_mesh(Layout(cp=4, ep=4), dataclasses.replace(MOE, seq_len=12), "zigzag")
    with pytest.raises(ValueError, match="one chunk per rank"):
        S.train_step_nd(None, None, None, None, None, 2, schedule="interleaved")
    with pytest.raises(ValueError, match="zb-h1, whose W repeats"):
        C.bytes_per_axis(Layout(pp=2), [{"schedule": "zb-h1"}], MOE, BATCH, M)


def test_mesh_bytes_name_the_axes_that_split_and_an_moe_halves_tp():
    from parlib import cost

    sizes = dict(b=2, s=16, h=32, m=2, layers=1, stage=0, shared_param_bytes=1000)
    assert set(cost.mesh_sent_bytes_per_step(Layout(tp=2, pp=2), **sizes)) == {"tp", "pp"}
    dense = cost.mesh_sent_bytes_per_step(Layout(tp=2, cp=2), **sizes)
    moe = cost.mesh_sent_bytes_per_step(Layout(tp=2, cp=2, ep=2), **sizes, n_experts=4,
                                        top_k=2)
    assert moe["tp"] == dense["tp"] / 2 and moe["cp"] == dense["cp"] and "ep" in moe
    # the loss is all-reduced on the last stage only
    last = cost.mesh_sent_bytes_per_step(Layout(dp=2, pp=2), **{**sizes, "stage": 1})
    assert last["dp"] - cost.mesh_sent_bytes_per_step(Layout(dp=2, pp=2), **sizes)["dp"] == 4
