"""Pipeline stages and schedules on real ranks: gradients, bytes, memory, timing."""

from __future__ import annotations

import pytest
import torch

import parlib
from parlib import cost, verify
from parlib.experiments import pipeline as runs
from parlib.measure import SavedActivations
from parlib.measure.emulation import StageCost
from parlib.measure.timeline import align, makespan
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
    return parlib.launch(runs.rank_step, CFG, schedule_name=name, m=m, batch_size=8,
                         world_size=p,
                         timeout=60, **kw)


@pytest.mark.parametrize("p,name,m", [(2, "gpipe", 4), (4, "1f1b", 4), (4, "gpipe", 1)])
def test_pipeline_gradients_equal_single_device(p, name, m):
    res = _run(p, name, m, memory=True, warmup=0)
    ref = verify.reference_step(CFG, seed=0, batch_size=8)
    assert res[-1]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    got = runs.gather_grads(res)
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
    stage_cost = StageCost(0.010, 0.020, 0.002)  # per row, per row, per call
    res = _run(2, "gpipe", 4, cost=stage_cost, repeats=2)
    spans = runs.median_run(res)
    ideal = cost.ideal_step_time(2, 4, stage_cost.stage_time(2))  # 8 rows / 4 = 2 per mb
    # upper bound: room for late wake-ups on a busy 2-core machine (1.41 x measured at a load
    # of 40), still well under the unpipelined p x m x t = 1.6 x ideal
    assert ideal * 0.99 <= makespan(spans) <= ideal * 1.5
    want = stage_cost.duration("forward", 2) * 0.99
    assert all(s.duration >= want for row in spans for s in row if s.kind == "forward")


def test_fixed_batch_more_microbatches_shorter_step():
    # B = 8 on p = 4 stages: m = 8 should take ideal(8) / ideal(1) of m = 1's time (0.38
    # with these costs; 11/32 = 0.34 without the per-call time; a cost that ignored the
    # rows would give 11/4 = 2.75). Messages and late wake-ups on a busy machine add more
    # to the 88 short ops of m = 8 than to the 8 long ones of m = 1: the fastest of the
    # repeats is compared, with room for that noise.
    stage_cost = StageCost(0.010, 0.020, 0.002)
    steps, predicted = {}, {}
    for m in (1, 8):
        res = _run(4, "gpipe", m, cost=stage_cost, repeats=3)
        steps[m] = min(makespan(align([r["spans"][k] for r in res])) for k in range(3))
        predicted[m] = cost.ideal_step_time(4, m, stage_cost.stage_time(8 // m))
        assert predicted[m] == pytest.approx(
            cost.fixed_batch_step_time(4, m, 8, stage_cost.per_row, 2 * stage_cost.per_call))
        assert steps[m] >= 0.98 * predicted[m], (m, steps[m], predicted[m])
    want = predicted[8] / predicted[1]
    got = steps[8] / steps[1]
    assert want < 0.4
    assert got <= 2.0 * want, (steps, predicted)


def test_slow_stage_sets_the_pace():
    # p = 2, stage 1 twice as slow: 3t + 3 x 2t = 9t, against (m + p - 1) t = 5t balanced
    base = StageCost(0.010, 0.020, 0.002)
    slow = base.with_slow_stage(1, 2.0)
    res = _run(2, "gpipe", 4, cost=slow, repeats=2)
    step = makespan(runs.median_run(res))
    predicted = cost.imbalanced_step_time([slow.stage_time(2, r) for r in range(2)], 4)
    assert predicted == pytest.approx(9 / 5 * cost.ideal_step_time(2, 4, base.stage_time(2)))
    assert 0.97 * predicted <= step <= 1.3 * predicted, (step, predicted)


def test_neighbours_that_order_microbatches_differently_get_a_clear_error():
    # Each op list is valid on its own; together they would pair rank 0's microbatch 0
    # with rank 1's microbatch 1. That must be an error naming both, never silent.
    from tests.helpers.rank_fns import pipeline_mixed_orders

    with pytest.raises(parlib.RankError, match=r"(?s)microbatch 1.*microbatch 0"):
        parlib.launch(pipeline_mixed_orders, world_size=2, timeout=60)
