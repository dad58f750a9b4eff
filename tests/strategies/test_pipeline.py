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
from parlib.model import IGNORE_INDEX, ModelConfig, build_model, loss_fn, make_batch
from parlib.strategies import pipeline
from parlib.strategies import schedules as S
from parlib.strategies.schedule_check import ScheduleError
from parlib.strategies.schedules import Op

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


def test_run_schedule_needs_chunks_for_interleaved_ops():
    stage = pipeline.Stage(build_model(CFG, 0), 0, 1)
    tokens, targets = make_batch(4, CFG, 0, 0)
    with pytest.raises(ValueError, match="one chunk"):
        pipeline.run_schedule(stage, S.interleaved(1, 2, 0, v=2), tokens, targets, 2)
    with pytest.raises(ValueError, match="microbatch 4 is not one of 0..3"):
        pipeline.run_schedule(stage, [S.F(4), S.B(4)], tokens, targets, 4)


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
    # with rank 1's microbatch 1. That must be an error naming both, never silent: the
    # ranks check their op lists together before any message.
    from tests.helpers.rank_fns import pipeline_mixed_orders

    with pytest.raises(parlib.RankError, match=r"(?s)F1.*rank 0.*F0.*same microbatch order"):
        parlib.launch(pipeline_mixed_orders, world_size=2, timeout=60)


# ------------------------------------------------- interleaved and split backward (ZB)

CFG8 = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=8)
EVERY_SCHEDULE = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("zb-h1", 4, 1)]


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_equals_single_device(p):
    from tests.helpers.pipeline_ranks import schedules_on_ranks

    res = parlib.launch(schedules_on_ranks, CFG8, EVERY_SCHEDULE, world_size=p, timeout=90)
    ref = verify.reference_step(CFG8, seed=0, batch_size=8)
    for k, (name, _, _) in enumerate(EVERY_SCHEDULE):
        assert res[-1][k]["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
        assert all(r[k]["loss"] is None for r in res[:-1])
        got = runs.gather_grads([r[k] for r in res])
        assert sorted(got) == sorted(ref["grads"]), name
        same = verify.compare(got, ref["grads"])
        assert same, (name, same)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (2, 3)])
def test_chunks_chain_to_the_full_model(p, v):
    model = build_model(CFG8, 1)
    tokens, _ = make_batch(4, CFG8, 0, 1)
    chunks = {r: pipeline.chunk_stages(model, r, p, v) for r in range(p)}
    x, names = tokens, []
    for s in range(p * v):  # virtual stage s = c*p + r
        stage = chunks[s % p][s // p]
        assert (stage.rank, stage.p, stage.chunk) == (s, p * v, s // p)
        assert stage.prev_rank == (None if s == 0 else (s - 1) % p)
        assert stage.next_rank == (None if s == p * v - 1 else (s + 1) % p)
        x = stage(x)
    for r in range(p):
        names += list(chunks[r].grads())
    assert torch.equal(x, model(tokens))
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="at least p\\*v blocks"):
        pipeline.chunk_stages(build_model(CFG, 0), 0, 4, 2)  # 4 blocks, 8 chunks


class _Seen(pipeline.PipelineHooks):
    def __init__(self):
        self.kinds = []

    def compute(self, kind, mb, rows):
        self.kinds.append((kind, mb))
        return super().compute(kind, mb, rows)


def test_split_backward_and_chunks_on_one_rank_equal_reference():
    # p = 1, v = 2: both chunks on one rank (it passes its activations to itself), the
    # backward split into B and W, Ws late; the hooks see every W
    F, B, W = S.F, S.B, S.W
    ops = [F(0), F(0, 1), F(1), B(0, 1), F(1, 1), B(0), B(1, 1), W(0, 1), B(1), W(0),
           W(1, 1), W(1)]
    from parlib.strategies.schedule_check import validate

    validate({0: ops}, 1, 2, 2)
    chunked = pipeline.chunk_stages(build_model(CFG, 0), 0, 1, 2)
    tokens, targets = make_batch(8, CFG, 0, 0)
    seen = _Seen()
    loss = pipeline.run_schedule(chunked, ops, tokens, targets, 2, hooks=seen)
    ref = verify.reference_step(CFG, seed=0, batch_size=8)
    assert loss == pytest.approx(ref["loss"], rel=1e-5)
    same = verify.compare(chunked.grads(), ref["grads"])
    assert same, same
    assert seen.kinds == [(op.kind, op.mb) for op in ops]
    # a W that never comes leaves weight gradients missing: an error before the step (the
    # schedule is validated first), not a silent step
    with pytest.raises(ScheduleError, match=r"W1 never runs"):
        pipeline.run_schedule(chunked, ops[:-1], tokens, targets, 2)


def test_run_pipeline_records_weight_spans_and_bytes():
    res = runs.run_pipeline(CFG8, "zb-h1", 2, 4, batch_size=8, warmup=0, memory=True)
    gp = runs.run_pipeline(CFG8, "gpipe", 2, 4, batch_size=8, warmup=0, memory=True)
    ref = verify.reference_step(CFG8, seed=0, batch_size=8)
    assert verify.compare(runs.gather_grads(res), ref["grads"])
    nbytes = cost.boundary_bytes(8, CFG8.seq_len, CFG8.d_model)
    for r in range(2):
        kinds = [s.kind for s in res[r]["spans"][0] if s.kind in ("forward", "backward",
                                                                   "weight")]
        assert kinds == [op.kind for op in S.zb_h1(2, 4, r)]
        assert res[r]["sent"] == {1 - r: nbytes} and res[r]["received"] == {1 - r: nbytes}
        # ZB-H1 holds min(p, m) = 2 microbatches (F to W) on both ranks, GPipe all 4
        ratio = res[r]["peak_saved"] / gp[r]["peak_saved"]
        assert ratio == pytest.approx(2 / 4, abs=0.03), (r, ratio)


def test_run_pipeline_interleaved_sends_each_boundary_once_each_way():
    res = runs.run_pipeline(CFG8, "interleaved", 2, 4, v=2, batch_size=8, warmup=0)
    ref = verify.reference_step(CFG8, seed=0, batch_size=8)
    assert verify.compare(runs.gather_grads(res), ref["grads"])
    nbytes = cost.boundary_bytes(8, CFG8.seq_len, CFG8.d_model)
    # virtual stages 0 1 2 3 on ranks 0 1 0 1: 3 boundaries, each crossed both ways;
    # rank 0 sends activations 0->1, 2->3 and the gradient 2->1
    for r in range(2):
        assert res[r]["sent"] == {1 - r: 3 * nbytes} == res[r]["received"]
        chunks = {s.chunk for s in res[r]["spans"][0] if s.kind == "forward"}
        assert chunks == {0, 1}


def test_run_pipeline_rejects_a_bad_schedule_before_launching():
    F, B = S.F, S.B
    bad = {0: [F(0), B(0), F(1), B(1)], 1: [F(0), F(1), B(0), B(1)]}
    from parlib.strategies.schedule_check import ScheduleError

    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at op 1"):
        runs.run_pipeline(CFG, bad, 2, 2, timeout=5)
    with pytest.raises(ScheduleError, match="multiple of p|never runs"):
        runs.run_pipeline(CFG8, {0: [F(0), B(0)], 1: [F(0)]}, 2, 1)


def test_emulated_split_and_chunk_costs():
    stage_cost = StageCost(0.010, 0.020, 0.0)
    hooks = runs.MeasuringHooks(0, None, stage_cost, v=2, split=True, weight_share=0.25)
    want = {"forward": 0.5 * 0.010, "backward": 0.5 * 0.75 * 0.020, "weight": 0.5 * 0.25 * 0.020}
    import time

    for kind, seconds in want.items():
        t0 = time.perf_counter()
        with hooks.compute_op(Op(kind, 0, 1), 1):
            pass
        assert seconds <= time.perf_counter() - t0 < seconds + 0.05, kind


def _padded_batch(batch_size=8):
    """A batch whose rows have different numbers of real targets (the rest IGNORE_INDEX),
    so that microbatches of it hold different token counts."""
    tokens, targets = make_batch(batch_size, CFG, 0, 0)
    targets = targets.clone()
    for row in range(batch_size):
        targets[row, CFG.seq_len - 2 * row:] = IGNORE_INDEX  # row r loses its last 2r
    return tokens, targets


def _one_device_padded(batch_size=8):
    model = build_model(CFG, 0)
    tokens, targets = _padded_batch(batch_size)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _rank_padded_step(schedule_name, m):
    import torch.distributed as dist
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = pipeline.build_stage(CFG, 0, rank, p, torch.device("cpu"))
    sched = {"gpipe": S.gpipe, "1f1b": S.one_f_one_b}[schedule_name](p, m, rank)
    tokens, targets = _padded_batch()
    loss = pipeline.run_schedule(stage, sched, tokens, targets, m)
    return {"loss": loss, "grads": stage.grads()}


@pytest.mark.parametrize("m", [1, 2, 4])
def test_one_rank_with_padding_equals_one_device_whatever_m(m):
    """Each microbatch's loss is its share of the batch's real tokens: with rows padded
    unevenly, the mean of per-microbatch means (the old loss / m) would weigh a token of a
    short microbatch more, and the gradients would change with m."""
    stage = pipeline.Stage(build_model(CFG, 0), 0, 1)
    tokens, targets = _padded_batch()
    loss = pipeline.run_schedule(stage, S.gpipe(1, m, 0), tokens, targets, m)
    ref_loss, ref_grads = _one_device_padded()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    same = verify.compare(stage.grads(), ref_grads)
    assert same, same


@pytest.mark.parametrize("name,m", [("gpipe", 4), ("1f1b", 2)])
def test_two_stages_with_padding_equal_one_device(name, m):
    res = parlib.launch(_rank_padded_step, name, m, world_size=2, timeout=60)
    ref_loss, ref_grads = _one_device_padded()
    assert res[-1]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    got = {k: v for r in res for k, v in r["grads"].items()}
    assert sorted(got) == sorted(ref_grads)
    same = verify.compare(got, ref_grads)
    assert same, same
