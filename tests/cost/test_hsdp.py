"""HSDP in the cost model: its bytes per axis by hand, one layout's sync worked term by term,
the planner picking it, and when it beats ZeRO-3 across nodes."""

import pytest

from parlib.cost import Hardware, Layout, Link, Model, estimate
from parlib.cost.hardware import GB
from parlib.cost.planner import best_layouts, hsdp_shard_group
from parlib.cost.sharded import hsdp_sent_bytes_per_step, zero_sent_bytes_per_step

# as tests/cost/test_estimate.py: 4 devices in nodes of 2, 1 us + 1 GB/s inside a node,
# 10 us + 100 MB/s between nodes; a 3808-parameter model of 4 layers of 872
TOY = Model(4, 8, 2, 4, 16)
TOY_HW = Hardware(4, 2, 1e9, 1e9, Link(1e-6, 1e9), Link(1e-5, 1e8))
MODEL_7B = Model(n_layers=32, d_model=4096, n_heads=32, seq_len=2048, vocab_size=32000)


def test_bytes_per_axis_by_hand():
    # P = 1000 fp32 on 2 copies x 4 shards: ZeRO-3 in the shard group, 3 x 4000 x 3/4;
    # the 250-element piece (1000 B) all-reduced over 2 copies, 2 x 1000 x 1/2
    assert hsdp_sent_bytes_per_step(1000, 4, 2) == {"dp_shard": 9000, "dp_replicate": 1000}
    assert hsdp_sent_bytes_per_step(1000, 4, 2, dtype_bytes=2) == {"dp_shard": 4500,
                                                                   "dp_replicate": 500}
    # one copy is ZeRO-3; shards of one rank are plain data parallelism's all-reduce
    assert hsdp_sent_bytes_per_step(1000, 4, 1) == {
        "dp_shard": zero_sent_bytes_per_step(1000, 4, 3), "dp_replicate": 0}
    assert sum(hsdp_sent_bytes_per_step(1000, 1, 4).values()) == zero_sent_bytes_per_step(
        1000, 4, 0)
    with pytest.raises(ValueError, match="shard_size and replicas"):
        hsdp_sent_bytes_per_step(1000, 0, 2)


def test_hand_worked_hsdp_layout():
    # d = 4, shard groups of 2 (one per node), 2 copies; m = 1, fp32. Units: 4 layers of
    # 872 and the root, 3808 - 4 x 872 = 320.
    est = estimate(TOY, TOY_HW, Layout(dp=4), m=1, global_batch=4, zero=3, shard_group=2,
                   mixed_precision=False)
    assert TOY.layer_params == 872 and est.shard_group == 2
    # shard group (inside a node): per unit two all-gathers and a reduce-scatter of its
    # 4w bytes over 2 ranks, each 1 us + 2w B x 1 ns: 15 us + 3 x 2 x 3808 ns = 37.848 us;
    # replicate group (one rank per node): per unit an all-reduce of its 2w-byte piece over
    # 2, 2 x 10 us + 2w B x 10 ns: 100 us + 2 x 3808 x 10 ns = 176.16 us
    assert est.time["dp_sync_total"] == pytest.approx(37.848e-6 + 176.16e-6)
    # bytes: 3 x 15232 x 1/2 = 22848 in the shard group, 2 x 7616 x 1/2 = 7616 across
    assert est.bytes_sent["dp"] == pytest.approx(22848 + 7616)
    assert est.bytes_sent["dp"] == pytest.approx(
        sum(hsdp_sent_bytes_per_step(TOY.n_params, 2, 2).values()))
    assert est.inter_node_bytes == pytest.approx(7616)  # only the all-reduces leave
    # the model state sharded 2 ways, not 4
    assert est.memory["params"] == est.memory["grads"] == 3808 * 4 / 2
    assert est.memory["optimizer"] == 3808 * 8 / 2
    # plain ZeRO-3 over all 4 (2 a node share the slow link: 2 x 100 MB/s): per unit 3
    # collectives of 3 x 10 us + 3/4 x 4w B / 200 MB/s: 450 us + 171.36 us
    plain = estimate(TOY, TOY_HW, Layout(dp=4), m=1, global_batch=4, zero=3,
                     mixed_precision=False)
    assert plain.time["dp_sync_total"] == pytest.approx(621.36e-6)
    assert plain.memory["params"] == 3808 * 4 / 4
    assert "HSDP (ZeRO-3 over 2, 2 copies)" in str(est)


def _sync_ratio(inter_node_gb: float) -> float:
    """ZeRO-3's step time over HSDP's (shard groups of one node), 4 DGX H100 nodes."""
    hw = Hardware.dgx_h100(32).with_(inter_node=Link(10e-6, inter_node_gb * GB))
    args = dict(m=1, global_batch=32, zero=3)
    return (estimate(MODEL_7B, hw, Layout(dp=32), **args).step_time
            / estimate(MODEL_7B, hw, Layout(dp=32), shard_group=8, **args).step_time)


def test_hsdp_beats_zero3_across_nodes_when_the_inter_node_link_is_slow():
    # a DGX's own 8 x 400 Gb/s: a flat ring sends 1/8 of its bytes through each NIC, and
    # ZeRO-3 wins; at an eighth of that, HSDP's fewer bytes between nodes win
    ratios = [_sync_ratio(gb) for gb in (50, 25, 12.5, 6.25, 1)]
    assert ratios[0] < 1 < ratios[2]
    assert ratios == sorted(ratios)


def test_the_planner_picks_hsdp_and_tries_it_only_across_nodes():
    # half a DGX's network (25 GB/s a GPU): at the full 50 GB/s ZeRO-1 hides its sync
    half = Hardware.dgx_h100(16).with_(inter_node=Link(10e-6, 25 * GB))
    best = best_layouts(MODEL_7B, half, global_batch=16, top=1)[0]
    assert best.shard_group and best.zero == 3, best
    assert "HSDP" in best.reason or "HSDP" in str(best)
    hw = Hardware.dgx_h100(16)
    assert hsdp_shard_group(Layout(dp=16), hw) == 8
    assert hsdp_shard_group(Layout(dp=8, tp=2), hw) == 4  # 4 x t = 8 ranks: one node
    assert hsdp_shard_group(Layout(dp=8), Hardware.dgx_h100(8)) is None  # one node
    assert hsdp_shard_group(Layout(dp=8, pp=2), hw) is None  # no ZeRO-3 with a pipeline


@pytest.mark.parametrize("kwargs,match", [
    ({"zero": 2, "shard_group": 2}, "pass zero=3"),
    ({"zero": 3, "shard_group": 3}, r"does not divide .* 4 .*: pick one of \[1, 2, 4\]"),
    ({"zero": 3, "shard_group": 0}, "whole number >= 1 .*the GPUs of a node"),
])
def test_bad_hsdp_input_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate(TOY, TOY_HW, Layout(dp=4), m=1, global_batch=4, **kwargs)
