"""Pipeline stages and schedules on real ranks: gradients, bytes, memory, timing."""

from __future__ import annotations

import pytest
import torch

import parlib
from parlib import cost, verify
from parlib.measure import SavedActivations
from parlib.measure.emulation import StageCost
from parlib.measure.timeline import makespan
from parlib.model import ModelConfig, build_model, make_batch
from parlib.strategies import pipeline
from parlib.strategies import schedules as S

CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)


def test_partition():
    assert pipeline.partition(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert pipeline.partition(5, 2) == [range(0, 3), range(3, 5)]
    assert pipeline.partition(4, 1) == [range(0, 4)]
    with pytest.raises(ValueError):
        pipeline.partition(2, 3)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_stages_chain_to_the_full_model(p):
    model = build_model(CFG, 1)
    tokens, _ = make_batch(4, CFG, 0, 1)
    x = tokens
    names = []
    for r in range(p):
        stage = pipeline.Stage(model, r, p)
        assert stage.is_first == (r == 0) and stage.is_last == (r == p - 1)
        x = stage(x)
        names += list(stage.grads())  # full-model names
    assert torch.equal(x, model(tokens))
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_saved_bytes_peak_and_release():
    model = build_model(CFG, 0)
    tokens, targets = make_batch(4, CFG, 0, 0)
    tracker = SavedActivations(model)
    with tracker:
        y1 = model(tokens[:2]).sum()
    one = tracker.peak
    with tracker:
        y2 = model(tokens[2:]).sum()
    assert one > 0 and tracker.peak == pytest.approx(2 * one, rel=0.05)
    y1.backward()
    y2.backward()
    del y1, y2
    assert tracker.live == 0


def test_run_schedule_rejects_interleaved_ops():
    stage = pipeline.Stage(build_model(CFG, 0), 0, 1)
    tokens, targets = make_batch(4, CFG, 0, 0)
    with pytest.raises(ValueError, match="one chunk"):
        pipeline.run_schedule(stage, S.interleaved(1, 2, 0, v=2), tokens, targets, 2)


def test_single_rank_schedule_equals_reference():
    stage = pipeline.Stage(build_model(CFG, 0), 0, 1)
    tokens, targets = make_batch(8, CFG, 0, 0)
    loss = pipeline.run_schedule(stage, S.gpipe(1, 4, 0), tokens, targets, 4)
    ref = verify.reference_step(CFG, seed=0, batch_size=8)
    assert loss == pytest.approx(ref["loss"], rel=1e-5)
    assert verify.compare(stage.grads(), ref["grads"])


def _run(p, name, m, **kw):
    return parlib.launch(pipeline.rank_step, CFG, schedule_name=name, m=m, batch_size=8,
                         world_size=p,
                         timeout=60, **kw)


@pytest.mark.parametrize("p,name,m", [(2, "gpipe", 4), (4, "1f1b", 4), (4, "gpipe", 1)])
def test_pipeline_gradients_equal_single_device(p, name, m):
    res = _run(p, name, m, memory=True, warmup=0)
    ref = verify.reference_step(CFG, seed=0, batch_size=8)
    assert res[-1]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    got = pipeline.gather_grads(res)
    assert sorted(got) == sorted(ref["grads"])
    same = verify.compare(got, ref["grads"])
    assert same, same
    # bytes: every boundary carries B x s x h fp32 each way, whatever m is
    nbytes = cost.boundary_bytes(8, CFG.seq_len, CFG.d_model)
    for r in range(p):
        want = {q: nbytes for q in (r - 1, r + 1) if 0 <= q < p}
        assert res[r]["sent"] == want and res[r]["received"] == want


def test_1f1b_holds_fewer_activations_than_gpipe():
    g = _run(4, "gpipe", 4, memory=True, warmup=0)
    f = _run(4, "1f1b", 4, memory=True, warmup=0)
    for r in range(4):
        ratio = f[r]["peak_saved"] / g[r]["peak_saved"]
        assert ratio == pytest.approx(min(4 - r, 4) / 4, abs=0.03), (r, ratio)


def test_emulated_cost_shows_pipelining():
    stage_cost = StageCost(0.02, 0.04)
    res = _run(2, "gpipe", 4, cost=stage_cost, repeats=2)
    spans = pipeline.median_run(res)
    ideal = cost.ideal_step_time(2, 4, stage_cost.per_microbatch)
    assert ideal * 0.99 <= makespan(spans) <= ideal * 1.35
    assert all(s.duration >= 0.0199 for row in spans for s in row if s.kind == "forward")
