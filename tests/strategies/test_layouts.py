"""The choosing chapter's experiment: layouts predicted, then run on emulated devices and
checked."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

import parlib
from parlib import verify
from parlib.cost import Hardware, Layout, Link, Model, estimate
from parlib.experiments import layouts as L
from parlib.measure.emulation import PacedCost, StageCost
from parlib.model import ModelConfig

SMALL = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
TWO_RANKS = (L.Run(Layout(dp=2), m=1), L.Run(Layout(tp=2), m=1), L.Run(Layout(pp=2), m=2))


def test_the_six_layouts_are_every_split_of_four():
    every = {(d, t, p) for d, t, p in itertools.product((1, 2, 4), repeat=3) if d * t * p == 4}
    got = {(x.layout.dp, x.layout.tp, x.layout.pp) for x in L.LAYOUTS}
    assert got == every and len(L.LAYOUTS) == 6
    assert [str(x.layout) for x in L.LAYOUTS[:2]] == ["d=4", "t=2 x d=2"]


@pytest.mark.parametrize("bad, message", [
    (lambda: L.Run(Layout(dp=2), m=1), "d=2: p x d x c x t = 2, not the 4 ranks"),
    (lambda: L.Run(Layout(dp=4), m=3), "d=4: .*not divisible"),
    (lambda: L.Run(Layout(pp=4), m=0), "p=4: m=0 microbatches must be"),
    (lambda: {"dp": 1, "pp": 4}, "a layout to run is a Run"),
])
def test_impossible_layouts_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        L._check_layouts([bad()], 4, ModelConfig(), 8)


@pytest.mark.parametrize("t, p, last", [(1, 1, True), (2, 1, True), (4, 1, True),
                                        (2, 2, False), (2, 2, True)])
def test_emulated_device_does_the_ranks_flops(t, p, last):
    model = Model.from_config(ModelConfig())
    device = L.emulated_device(model, Layout(tp=t, pp=p), last=last, flops_per_second=1e9)
    forward = model.rank_forward_flops_per_token(layers=4 // p, t=t, head=last) * 64 / 1e9
    assert device.duration("forward", 3) == pytest.approx(3 * forward)
    assert device.duration("backward", 3) == pytest.approx(6 * forward)
    if t == 1:
        assert isinstance(device, StageCost)
    else:  # one piece more than the two all-reduces per layer, each way
        assert isinstance(device, PacedCost)
        assert len(device.pieces["forward"]) == len(device.pieces["backward"]) == 2 * 4 // p + 1


def test_agreement_counts_pairs_and_band():
    est = [SimpleNamespace(step_time=x) for x in (1.0, 2.0, 2.1, 4.0)]
    rows = [{"step_time": x} for x in (1.2, 2.6, 2.4, 3.9)]  # the close pair swapped
    agree = L.agreement(est, rows, band=0.25)
    assert agree["within"] == 3                       # 1.3 is outside 1 +- 0.25
    assert L.agreement(est, rows)["within"] == 2      # and 1.2 outside the default 15%
    assert (agree["pairs"], agree["pairs_same"]) == (6, 5)
    assert (agree["separated"], agree["separated_same"]) == (5, 5)  # 2.0 vs 2.1 is close
    assert agree["best"] == (0, 0)


def test_rate_is_measured_with_the_threads_asked_for_and_restores_them():
    before = torch.get_num_threads()
    rate = L.measure_rate(SMALL, repeats=3, threads=1)
    assert torch.get_num_threads() == before
    assert rate.threads == 1 and len(rate.samples) == 3 and all(r > 0 for r in rate.samples)
    low, high = rate.quartiles
    assert low <= rate.median <= high and rate.spread >= 0
    assert "1 thread" in rate.describe() and "median of 3 steps" in rate.describe()
    with pytest.raises(ValueError, match="repeats=0"):
        L.measure_rate(SMALL, repeats=0)
    with pytest.raises(ValueError, match="threads=0"):
        L.measure_rate(SMALL, threads=0)


def test_slow_link_costs_the_same_flops_per_byte_at_any_rate():
    for rate in (1e9, 4e9):
        assert L.slow_link_beta(rate) * rate == pytest.approx(L.SLOW_LINK_FLOPS_PER_BYTE)
    assert L.slow_link_beta(2e9, flops_per_byte=100) == pytest.approx(5e-8)
    with pytest.raises(ValueError, match="flops_per_second > 0"):
        L.slow_link_beta(0.0)


def test_measured_takes_the_slowest_rank_per_step():
    def result(seconds, params):
        return [{"layout": Layout(dp=2), "m": 1, "seconds": seconds,
                 "parts": [{"compute": s, "other": 0.0} for s in seconds],
                 "memory": {"params": params}, "ok": True, "worst": 0.0, "pieces": 2,
                 "overruns": 0}]
    rows = L.measured([result([1.0, 3.0, 2.0], 10), result([2.0, 1.0, 2.5], 20)])
    assert rows[0]["steps"] == [2.0, 3.0, 2.5] and rows[0]["step_time"] == 2.5
    assert rows[0]["memory"] == {"params": 20} and rows[0]["pieces"] == 4


def test_two_rank_layouts_match_one_device_and_take_their_emulated_time():
    reference = verify.reference_step(SMALL)
    rate = 2e9
    cluster = Hardware.measured_here(2, allreduce_fit=(1e-4, 1e-9), fit_ranks=2,
                                     flops_per_second=rate)
    results = parlib.launch(L.rank_time_layouts, TWO_RANKS, cfg=SMALL, flops_per_second=rate,
                            reference=reference,
                            repeats=2, warmup=0, world_size=2, timeout=120)
    rows = L.measured(results)
    assert all(r["ok"] for r in rows), [r["worst"] for r in rows]
    for est, row in zip(L.predict(TWO_RANKS, cluster, cfg=SMALL), rows):
        assert row["step_time"] >= 0.95 * est.time["compute"]  # padded to the device's time
        assert row["pieces"] > 0
    # model states: parameters, gradients and Adam's two moments, 16 bytes per parameter
    whole = Model.from_config(SMALL).n_params * 4
    states = rows[0]["memory"]
    assert states["params"] == states["grads"] == whole
    assert states["optimizer"] >= 2 * whole


def test_a_wrong_reference_is_rejected():
    reference = verify.reference_step(SMALL)
    name = next(iter(reference["grads"]))
    reference["grads"][name] = reference["grads"][name] + 1e-3 * torch.ones_like(
        reference["grads"][name])
    results = parlib.launch(L.rank_time_layouts, TWO_RANKS[1:2], cfg=SMALL,
                            flops_per_second=None, reference=reference,
                            repeats=1, warmup=0,
                            world_size=2, timeout=120)
    row = L.measured(results)[0]
    assert not row["ok"] and row["worst"] >= 1e-3 * 0.99


def test_slowed_cluster_prediction_uses_both_links():
    cluster = Hardware.measured_here(4, allreduce_fit=(1e-3, 1e-9), fit_ranks=4,
                                     flops_per_second=1e9)
    slowed = cluster.slowed_by(0.0, 1e-7)
    assert slowed.inter_node == slowed.intra_node == Link(cluster.intra_node.alpha,
                                                          1 / (cluster.intra_node.beta + 1e-7))
    fast, slower = (L.predict(L.LAYOUTS, c) for c in (cluster, slowed))
    assert all(b.step_time > a.step_time for a, b in zip(fast, slower))


def test_tables_spell_out_their_columns():
    est = SimpleNamespace(step_time=0.2, memory={"params": 2**20, "grads": 2**20,
                                                 "optimizer": 2**21, "activations": 2**20,
                                                 "pipeline_in_flight": 0},
                          time={"compute": 0.1, "tp_comm": 0.05, "pp_bubble": 0.0,
                                "pp_send": 0.0, "dp_sync": 0.05})
    row = {"layout": Layout(dp=4), "step_time": 0.3, "spread": 0.1,
           "memory": {"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                      "activations": 2**20},
           "parts": {"compute": 0.1, "tp": 0.1, "recv": 0.0, "dp": 0.05, "other": 0.05}}
    text = L.table([est], [row])
    for words in ("step time, ms", "model states, MiB", "activations, MiB", "predicted",
                  "measured", "interquartile range", "1.50"):
        assert words in text, words
    parts = L.parts_table([est], [row])
    for words in ("tensor-parallel all-reduces", "predicted / measured", "100/100"):
        assert words in parts, words


def test_paced_link_fit_times_woken_all_reduces_and_fits_the_line():
    fit = L.paced_link_fit(parlib.launch, 2, sizes=(2**10, 2**16, 2**20), rounds=2,
                           pause=1e-3, timeout=60)
    assert fit.n == 2 and fit.sizes == [2**10, 2**16, 2**20] and fit.backend == "gloo"
    assert len(fit.seconds) == 3 and all(s > 0 for s in fit.seconds)
    with pytest.raises(ValueError, match="rounds >= 1"):
        L.rank_time_paced_all_reduce([1024], rounds=0)


def test_paced_link_fit_averages_the_slowest_rank_of_each_round():
    sizes = (1000, 100_000, 1_000_000)
    # per rank: per size, one time per round; a long call (4 ms) in one round
    per_rank = [([[1e-3, 0.5e-3, 4e-3], [2e-3, 2e-3, 2e-3], [5e-3, 6e-3, 5e-3]], "cpu", "gloo"),
                ([[0.5e-3, 1e-3, 1e-3], [1e-3, 3e-3, 1e-3], [6e-3, 5e-3, 7e-3]], "cpu", "gloo")]

    def fake_launch(fn, *args, world_size, **kwargs):
        assert fn is L.rank_time_paced_all_reduce and world_size == 2
        return per_rank

    fit = L.paced_link_fit(fake_launch, 2, sizes=sizes)
    # slowest per round (1, 1, 4), (2, 3, 2), (6, 6, 7) ms: their means, not their medians
    assert fit.seconds == pytest.approx([2e-3, 7e-3 / 3, 19e-3 / 3])
    assert fit.sizes == list(sizes) and len(fit.spread) == 3
    assert fit.b == pytest.approx((19e-3 / 3 - 2e-3) / (1_000_000 - 1000), rel=0.2)


def test_prediction_charges_the_output_layer_where_the_emulated_device_does():
    # the course's tensor-parallel copy keeps the output layer whole on every tp rank of the
    # last stage: the prediction's compute is the busiest rank's emulated compute
    model = Model.from_config(ModelConfig())
    cluster = Hardware.measured_here(4, allreduce_fit=(1e-3, 1e-9), fit_ranks=4,
                                     flops_per_second=1e9)
    for run, est in zip(L.LAYOUTS, L.predict(L.LAYOUTS, cluster)):
        layout = run.layout
        rows = 8 // layout.dp  # every microbatch of this dp rank
        devices = [L.emulated_device(model, layout, last=last, flops_per_second=1e9)
                   for last in (False, True)]  # a rank of an earlier stage, of the last
        busiest = max(d.duration("forward", rows) + d.duration("backward", rows)
                      for d in devices)
        assert est.time["compute"] == pytest.approx(busiest), layout
    # the cost model's general rule (a vocabulary-parallel head, spread evenly) is unchanged
    # and differs here, where the head is 11% of a t = 4 rank's compute
    general = estimate(model, cluster, Layout(tp=4), m=1, global_batch=8,
                       mixed_precision=False, sequence_parallel=False, dp_overlap=False)
    here = L.predict([L.Run(Layout(tp=4))], cluster)[0]
    assert here.time["compute"] == pytest.approx(1.11 * general.time["compute"], rel=0.01)
    assert here.memory["params"] > general.memory["params"]  # the head held whole
    # a pipeline's fill and drain pass through the lighter stages: p = 4's bubble is the
    # first stages' compute x (p - 1) / m, not the last stage's
    p4 = L.predict([L.Run(Layout(pp=4), m=4)], cluster)[0]
    light = L.emulated_device(model, Layout(pp=4), last=False, flops_per_second=1e9)
    light_time = light.duration("forward", 8) + light.duration("backward", 8)
    assert p4.time["pp_bubble"] == pytest.approx(light_time * 3 / 4)
    assert p4.time["pp_bubble"] < 3 / 4 * p4.time["compute"]


def test_other_holds_what_no_counted_span_covers_a_pipelines_sends_too():
    """The choosing chapter said 'other' grows with the parameters a rank holds; in the run it was
    largest for p = 4, whose ranks hold the fewest: a pipeline's sends (and the wait for
    them at the end of the step) are in no counted part, so they land in other."""
    from parlib.measure.timeline import Span

    rec = SimpleNamespace(spans=[Span(0, "forward", 0.0, 0.10, 0), Span(0, "send", 0.10, 0.13, 0),
                                 Span(0, "recv", 0.13, 0.15, 1),
                                 Span(0, "backward", 0.15, 0.35, 0)])
    parts = L._parts(rec, took=0.40)
    assert parts["compute"] == pytest.approx(0.30) and parts["recv"] == pytest.approx(0.02)
    assert parts["other"] == pytest.approx(0.40 - 0.30 - 0.02)  # the send's 0.03 and the rest
