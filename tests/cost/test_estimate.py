"""estimate(): one hand-worked layout term by term, the directions every knob must move
things, and a clear error for every impossible input."""

import pytest

from parlib.cost import Hardware, Layout, Link, Model, estimate
from parlib.cost.estimate import MEMORY_PARTS, STEP_PARTS, check_layout

# Round numbers to work by hand: 4 devices in nodes of 2, 1 GFLOP/s each,
# 1 us + 1 GB/s inside a node, 10 us + 100 MB/s between nodes.
TOY = Model(4, 8, 2, 4, 16)  # L=4, h=8, a=2, s=4, V=16, f=32; 3808 parameters
TOY_HW = Hardware(4, 2, 1e9, 1e9, Link(1e-6, 1e9), Link(1e-5, 1e8))


def test_hand_worked_layout():
    # d=2, t=2, p=1, m=2, global batch 8 -> microbatch b = 2; fp32 throughout.
    est = estimate(TOY, TOY_HW, Layout(dp=2, tp=2), m=2, global_batch=8,
                   mixed_precision=False)
    assert TOY.n_params == 3808 and est.micro_batch == 2
    assert est.links == {"tp": "intra-node", "dp": "inter-node", "pp": "none", "cp": "none"}
    assert est.time["cp_comm"] == est.bytes_sent["cp"] == 0
    # compute: 20736 FLOPs/token x 32 tokens / 4 devices / 1e9 = 165.888 us
    assert est.time["compute"] == pytest.approx(165.888e-6)
    # TP: message b*s*h*4 = 256 B; all-reduce on 2: 2 alphas + 256 B x 1 ns = 2.256 us;
    # 4 per layer x 4 layers x 2 microbatches = 32 of them
    assert est.time["tp_comm"] == pytest.approx(32 * 2.256e-6)
    assert est.bytes_sent["tp"] == pytest.approx(32 * 256)
    # DP: 3808 / 2 = 1904 params per device, fp32 grads 7616 B, all-reduce on 2 over the
    # slow link: 2 x 10 us + 7616 B x 10 ns = 96.16 us
    assert est.time["dp_sync_total"] == pytest.approx(96.16e-6)
    # hidden behind the last microbatch's backward: (165.888 + 72.192) / 2 x 2/3 = 79.36 us
    assert est.time["dp_sync_hidden"] == pytest.approx(79.36e-6)
    assert est.time["dp_sync"] == pytest.approx(16.8e-6)
    assert est.time["pp_bubble"] == est.time["pp_send"] == 0
    assert est.step_time == pytest.approx((165.888 + 72.192 + 16.8) * 1e-6)
    # memory: 16 B per parameter in fp32 Adam: 1904 x (4 + 4 + 8)
    assert (est.memory["params"], est.memory["grads"], est.memory["optimizer"]) == (
        7616, 7616, 15232)
    # activations, per layer with t = 2 and sequence parallelism, fp32, no dropout:
    # (kept whole 1024 B + split 3072 B + scores 256 B) / 2 = 2176 B; 4 layers, plus the
    # unfused loss's backward peak over the logits, s*b*V x 12 / 2 = 768 B
    assert est.memory["activations"] == 4 * 2176 + 768
    assert est.memory["pipeline_in_flight"] == 0
    assert est.fits and est.memory_total == 7616 * 2 + 15232 + 9472
    # MFU: model FLOPs over (step x devices x peak)
    assert est.mfu == pytest.approx(663552 / (est.step_time * 4 * 1e9))


def test_sync_after_backward_hides_nothing():
    kw = dict(m=2, global_batch=8, mixed_precision=False)
    overlapped = estimate(TOY, TOY_HW, Layout(dp=2, tp=2), **kw)
    after = estimate(TOY, TOY_HW, Layout(dp=2, tp=2), dp_overlap=False, **kw)
    assert after.time["dp_sync_hidden"] == 0
    assert after.time["dp_sync"] == after.time["dp_sync_total"] == pytest.approx(96.16e-6)
    assert after.step_time == pytest.approx(overlapped.step_time + 79.36e-6)


def test_zero3_hides_each_phase_behind_its_own_compute():
    # d=4, one device per node (10 us + 100 MB/s each), m=1, b=4: 64 tokens, mixed
    # precision, gradients reduce-scattered in fp32. All 3808 parameters on every device:
    # 4 layers (units) of 872 and a root unit of 320 (embedding 160, head 160).
    kw = dict(m=1, global_batch=16, zero=3)
    one_per_node = TOY_HW.with_(devices_per_node=1)
    est = estimate(TOY, one_per_node, Layout(dp=4), grad_reduce_bytes=4, **kw)
    assert est.time["memory_bound"] == est.time["tp_comm"] == 0
    # compute: 20736 FLOPs/token x 64 tokens / 4 devices / 1e9 = 331.776 us; forward a third
    assert est.time["compute"] == pytest.approx(331.776e-6)
    # one collective per unit, each paying its ring's 3 alphas (30 us): a layer's bf16
    # gather, 1744 B: 30 + 3/4 x 1744 x 10 ns = 43.08 us; the root's, 640 B: 34.8 us;
    # forward 4 x 43.08 + 34.8 = 207.12 us, backward the same; fp32 reduce-scatters of
    # 3488 B (56.16 us) and 1280 B (39.6 us): 264.24 us
    assert est.time["dp_sync_total"] == pytest.approx((2 * 207.12 + 264.24) * 1e-6)
    assert est.bytes_sent["dp"] == pytest.approx(2 * 0.75 * 7616 + 0.75 * 15232)
    # forward: 207.12 us behind 110.592 us; backward: 207.12 + 264.24 us behind 221.184 us:
    # 331.776 us hidden, 346.704 us exposed (one collective for the whole model, as before
    # the units, paid 3 alphas instead of 15 and exposed 10.176 us)
    assert est.time["dp_sync_hidden"] == pytest.approx(331.776e-6)
    assert est.time["dp_sync"] == pytest.approx(346.704e-6)
    # in bf16 the reduce-scatters are 43.08 and 34.8 us: 621.36 us in all, 289.584 exposed
    bf16 = estimate(TOY, one_per_node, Layout(dp=4), **kw)
    assert bf16.time["dp_sync_total"] == pytest.approx(3 * 207.12e-6)
    assert bf16.time["dp_sync"] == pytest.approx((621.36 - 331.776) * 1e-6)


def test_zero3_cannot_hide_the_first_gathers_and_the_last_scatter():
    # ten times the tokens (b=40): 3317.76 us of compute, forward 1105.92 us, enough to hide
    # all 678.48 us of the sync; but each microbatch's first forward gather and first
    # backward gather (43.08 us each) and its last reduce-scatter (56.16 us) wait for no
    # compute: 142.32 us stay exposed
    est = estimate(TOY, TOY_HW.with_(devices_per_node=1), Layout(dp=4), m=1,
                   global_batch=160, zero=3, grad_reduce_bytes=4)
    assert est.time["compute"] == pytest.approx(3317.76e-6)
    assert est.time["dp_sync_total"] == pytest.approx(678.48e-6)
    assert est.time["dp_sync"] == pytest.approx(142.32e-6)
    # two microbatches: twice the units' collectives, twice the floor
    two = estimate(TOY, TOY_HW.with_(devices_per_node=1), Layout(dp=4), m=2,
                   global_batch=160, zero=3, grad_reduce_bytes=4)
    assert two.time["dp_sync_total"] == pytest.approx(2 * 678.48e-6)
    assert two.time["dp_sync"] == pytest.approx(2 * 142.32e-6)


def test_a_ring_across_nodes_shares_the_nodes_links():
    # d=4 over two nodes of 2, fp32, no ZeRO: each rank all-reduces 3808 x 4 = 15232 B.
    # Two ranks a node send half their ring bytes over the 100 MB/s links, two links at
    # once: 200 MB/s (5 ns a byte), 10 us a step. A ring: 6 x 10 us + 2 x 3/4 x 15232 B x
    # 5 ns = 174.24 us; NCCL's tree: 4 x 10 us + 114.24 us / 0.92 = 164.17 us, the pick
    est = estimate(TOY, TOY_HW, Layout(dp=4), m=1, global_batch=4, mixed_precision=False)
    assert est.time["dp_sync_total"] == pytest.approx((40 + 114.24 / 0.92) * 1e-6)
    assert est.bytes_sent["dp"] == pytest.approx(2 * 0.75 * 15232)
    assert est.crossing["dp"] == 0.5
    assert est.inter_node_bytes == pytest.approx(0.75 * 15232)  # half of it leaves the node
    # one rank a node: every byte over its own link, 100 MB/s: ring 60 + 228.48 = 288.48 us,
    # tree 40 + 228.48 / 0.92 = 288.35 us
    apart = estimate(TOY, TOY_HW.with_(devices_per_node=1), Layout(dp=4), m=1,
                     global_batch=4, mixed_precision=False)
    assert apart.time["dp_sync_total"] == pytest.approx((40 + 228.48 / 0.92) * 1e-6)
    assert apart.crossing["dp"] == 1 and apart.inter_node_bytes == apart.bytes_sent["dp"]


def test_extra_recomputed_flops_are_hardware_flops():
    kw = dict(m=2, global_batch=8, mixed_precision=False, recompute="selective")
    base = estimate(TOY, TOY_HW, Layout(dp=2, tp=2), **kw)
    more = estimate(TOY, TOY_HW, Layout(dp=2, tp=2), extra_recompute_flops_per_token=1000,
                    **kw)
    # 1000 FLOPs x 32 tokens / 4 devices / 1e9 = 8 us more compute; MFU's FLOPs unchanged
    assert more.time["compute"] == pytest.approx(base.time["compute"] + 8e-6)
    assert more.model_flops == base.model_flops
    assert more.hardware_flops == base.hardware_flops + 32_000
    assert more.mfu < base.mfu and more.hfu > more.mfu
    for bad, match in ((-1, ">= 0"), (True, ">= 0"), ("1e9", ">= 0")):
        with pytest.raises(ValueError, match=match):
            estimate(TOY, TOY_HW, Layout(dp=2, tp=2), extra_recompute_flops_per_token=bad, **kw)
    with pytest.raises(ValueError, match="already reruns"):
        estimate(TOY, TOY_HW, Layout(dp=2, tp=2), m=2, global_batch=8, recompute=True,
                 extra_recompute_flops_per_token=1000)
    with pytest.raises(ValueError, match="grad_reduce_bytes"):
        estimate(TOY, TOY_HW, Layout(dp=2, tp=2), grad_reduce_bytes=3, **kw)


def test_parts_add_up_and_dicts_are_complete():
    est = estimate(TOY, TOY_HW, Layout(tp=2, pp=2), m=4, global_batch=8, zero=0,
                   recompute="selective")
    assert set(MEMORY_PARTS) == set(est.memory)
    assert set(STEP_PARTS) < set(est.time)
    assert est.step_time == pytest.approx(sum(est.time[k] for k in STEP_PARTS))
    assert (est.layout, est.m, est.v, est.zero, est.recompute) == (
        Layout(tp=2, pp=2), 4, 1, 0, "selective")
    assert est.reason.startswith("fits")
    assert str(est).startswith("t=2 x p=2 m=4, selective recompute: ")


def test_a_mapping_of_axis_sizes_is_taken_as_a_layout():
    as_layout = estimate(TOY, TOY_HW, Layout(dp=2, tp=2), m=2, global_batch=8)
    as_dict = estimate(TOY, TOY_HW, {"dp": 2, "tp": 2}, m=2, global_batch=8)
    assert as_dict.layout == as_layout.layout and as_dict.time == as_layout.time
    with pytest.raises(ValueError, match=r"must be a Layout \(e.g. Layout\(dp=2, tp=2\)\)"):
        estimate(TOY, TOY_HW, (2, 2, 1), m=2, global_batch=8)
    with pytest.raises(ValueError, match=r"layout must be a parlib.cost.Layout"):
        check_layout(TOY, 4, {"dp": 4}, m=1, global_batch=4)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        estimate(TOY, TOY_HW, {"xp": 4}, m=1, global_batch=4)
    with pytest.raises(ValueError, match=r"ep = 4 does not divide d x c = 1"):
        estimate(TOY, TOY_HW, {"ep": 4}, m=1, global_batch=4)
    with pytest.raises(ValueError, match=r"c = 4 needs the sequence length 4 to split into "
                                         r"2c = 8 equal chunks"):
        estimate(TOY, TOY_HW, {"cp": 4}, m=1, global_batch=4)


def test_hand_worked_context_parallel_layout():
    # d=2, c=2, m=2, global batch 8 -> b = 2 sequences of s = 4, 2 positions per cp rank
    est = estimate(TOY, TOY_HW, Layout(dp=2, cp=2), m=2, global_batch=8,
                   mixed_precision=False)
    assert est.micro_batch == 2
    assert est.links == {"pp": "none", "dp": "inter-node", "cp": "intra-node", "tp": "none"}
    assert est.time["compute"] == pytest.approx(165.888e-6)  # cp moves work, adds none
    # one K/V block: 2 x b x s/c x kv_dim x 4 B = 2 x 2 x 2 x 8 x 4 = 256 B; per layer one
    # forward step (1 us + 256 ns) and one backward step (block + gradient: 1 us + 512 ns)
    assert est.time["cp_comm_total"] == pytest.approx(2 * 4 * (1.256 + 1.512) * 1e-6)
    # each step hides behind its attention block: 4sh x b x s/c / c FLOPs = 256 ns forward,
    # twice that backward; exposed 1.0 + 1.0 us per layer, 8 layer-microbatches
    assert est.time["cp_comm_hidden"] == pytest.approx(8 * (0.256 + 0.512) * 1e-6)
    assert est.time["cp_comm"] == pytest.approx(16e-6)
    assert est.bytes_sent["cp"] == 8 * 3 * 256  # 3 blocks sent per layer, 8 layer-mbs
    # cp ranks hold the same weights: the gradients sync over d x c = 4 ranks
    flat = estimate(TOY, TOY_HW, Layout(dp=4), m=1, global_batch=8, mixed_precision=False)
    assert est.time["dp_sync_total"] == pytest.approx(flat.time["dp_sync_total"])
    # activations per layer at s/c = 2, fp32, no scores: kept 512 B + split 1536 B, plus
    # the fp32 log-sum-exp a x s/c x b x 4 = 32 B; 4 layers and the loss's peak over the
    # logits s/c x b x V x 12
    assert est.memory["activations"] == 4 * (512 + 1536 + 32) + 768
    assert est.memory["params"] == 3808 * 4  # not split: cp splits the sequence only


def test_context_parallelism_divides_activations_and_hides_behind_long_attention():
    model = Model(8, 1024, 16, 32768, 32000)  # one long sequence per step
    hw = Hardware(8, 8, 80e9, 1e15, Link(5e-6, 300e9), Link(2e-5, 25e9))
    one = estimate(model, hw, Layout(dp=8), m=1, global_batch=8, recompute="selective")
    # one sequence per data-parallel rank (b = 1) whatever c takes of the 8 devices
    acts = {c: estimate(model, hw, Layout(dp=8 // c, cp=c), m=1, global_batch=8 // c,
                        recompute="selective").memory["activations"] for c in (1, 2, 4, 8)}
    assert acts[1] == one.memory["activations"]
    for c in (2, 4, 8):  # a bit more than 1/c: the log-sum-exp rows
        assert acts[1] / c < acts[c] < 1.01 * acts[1] / c
    est = estimate(model, hw, Layout(dp=1, cp=8), m=1, global_batch=8, recompute="selective")
    assert est.time["cp_comm_total"] > 0 and est.time["cp_comm"] == 0  # all of it hidden
    assert est.links["dp"] == est.links["cp"] == "intra-node"


BIG = Model(32, 4096, 32, 4096, 32000)  # a GPT-style 6.6B model
H100 = Hardware.dgx_h100(16)
BASE = dict(dp=2, tp=8, pp=1, m=8, global_batch=64)


def split(kw):
    """(Layout, the other settings) of BASE updated with kw."""
    settings = {**BASE, **kw}
    return Layout(**{a: settings.pop(a) for a in ("dp", "tp", "pp")}), settings


def run(**kw):
    layout, settings = split(kw)
    return estimate(BIG, H100.with_(n_devices=layout.world), layout, **settings)


def test_each_knob_moves_memory_and_time_the_right_way():
    base = run()
    # ZeRO shards the optimizer state (1), then gradients (2), then weights (3)
    z = [run(zero=k) for k in range(4)]
    assert z[0].memory["optimizer"] > z[1].memory["optimizer"] == z[2].memory["optimizer"]
    assert z[1].memory["grads"] > z[2].memory["grads"]
    assert z[2].memory["params"] > z[3].memory["params"]
    assert z[3].time["dp_sync_total"] > z[1].time["dp_sync_total"]
    # recomputation trades activation memory for compute
    sel, full = run(recompute="selective"), run(recompute=True)
    assert base.memory["activations"] > sel.memory["activations"] > full.memory["activations"]
    assert base.time["compute"] < sel.time["compute"] < full.time["compute"]
    assert base.mfu > full.mfu and full.hfu > full.mfu
    # more microbatches: smaller bubble; interleaving: smaller still, more in flight
    p4 = [run(tp=2, pp=4, m=m) for m in (4, 16)]
    assert p4[0].time["pp_bubble"] > p4[1].time["pp_bubble"] > 0
    inter = run(tp=2, pp=4, m=16, v=2)
    assert inter.name == "t=2 x d=2 x p=4 v=2" and p4[1].name == str(p4[1].layout)
    assert inter.time["pp_bubble"] < p4[1].time["pp_bubble"]
    assert inter.memory["pipeline_in_flight"] > p4[1].memory["pipeline_in_flight"]
    # a pipeline holds min(p, m) microbatches on its first stage
    assert p4[1].stage == "first"
    assert p4[1].memory["pipeline_in_flight"] == pytest.approx(3 * p4[1].memory["activations"])
    # TP across nodes costs more than inside one: its rings leave both nodes through all
    # eight NICs (8 x 50 GB/s, about NVLink's 368), but pay twice the ring steps at twice
    # the latency
    sixteen, eight = run(dp=1, tp=16), run(dp=1, tp=8)
    assert sixteen.links["tp"] == "inter-node"
    assert sixteen.time["tp_comm"] > eight.time["tp_comm"]
    assert sixteen.crossing["tp"] == 1 / 8 and eight.crossing["tp"] == 0


def test_sequence_parallel_splits_what_tensor_parallelism_keeps_whole():
    sp, no_sp = run(sequence_parallel=True), run(sequence_parallel=False)
    assert sp.memory["activations"] < no_sp.memory["activations"]
    assert sp.time["tp_comm"] == no_sp.time["tp_comm"]  # the same bytes on the wire


def test_too_big_does_not_fit_and_says_why():
    est = estimate(BIG, Hardware.dgx_h100(1, memory_bytes=16e9), Layout(), m=1,
                   global_batch=1)
    assert not est.fits
    assert est.reason.startswith("does not fit") and "optimizer" in est.reason


def test_wrong_kinds_of_model_and_hardware_are_named():
    from parlib.model import ModelConfig

    with pytest.raises(ValueError, match=r"Model.from_config\(cfg\)"):
        estimate(ModelConfig(), TOY_HW, Layout(dp=4), m=1, global_batch=4)
    with pytest.raises(ValueError, match="parlib.cost.Hardware describes the machines"):
        estimate(TOY, object(), Layout(dp=4), m=1, global_batch=4)


@pytest.mark.parametrize("kw, message", [
    (dict(dp=3), r"the layout t=8 x d=3 is 24 devices, but the hardware has 16"),
    (dict(dp=16, tp=1, pp=1, global_batch=48, m=1), None),  # valid: control case
    (dict(dp=1, tp=16, m=1, global_batch=8), None),
    (dict(dp=0), r"layout size dp=0 must be a whole number >= 1"),
    (dict(m=-1), r"m must be a positive integer"),
    (dict(global_batch=0), r"global_batch must be a positive integer"),
    (dict(tp=3, dp=1, pp=1, n=3), r"t = 3 does not divide the model's 32 attention heads"),
    (dict(tp=1, pp=3, dp=1, n=3, m=3, global_batch=3), None),  # uneven stages: 11, 11, 10
    (dict(tp=1, pp=64, dp=1, n=64, m=64, global_batch=64),
     r"p = 64 stages need at least one layer each, but the model has 32 layers"),
    (dict(tp=1, pp=3, dp=1, n=3, v=2, m=3, global_batch=3), None),  # 6 chunks: 5,6,5,5,6,5
    (dict(tp=1, pp=16, dp=1, n=16, v=3, m=16, global_batch=16),
     r"v = 3: p x v = 48 model chunks need at least one layer each, but the model has 32"),
    (dict(tp=2, pp=2, dp=4, zero=3), r"ZeRO-3 with a pipeline \(p = 2\) is refused"),
    (dict(global_batch=60), r"global_batch = 60 is not divisible by d x m = 2 x 8 = 16"),
    (dict(zero=4), r"zero must be 0, 1, 2 or 3"),
    (dict(recompute="yes"), r"recompute must be False, 'selective', True or 'op'"),
    (dict(recompute="op"), r"recompute='op' is torchtitan's policy .* pass fused_attention=True"),
    (dict(recompute="op", fused_attention=True), None),
    (dict(v=2), r"v = 2 model chunks per rank need a pipeline"),
    (dict(tp=2, pp=4, v=3, m=4, global_batch=16), None),  # 12 chunks of 3 or 2 layers
    (dict(tp=2, pp=4, v=2, m=2), r"needs m a multiple of p"),
])
def test_impossible_inputs_are_named(kw, message):
    hardware = H100.with_(n_devices=kw.pop("n", 16))
    if message is None:
        layout, settings = split(kw)
        assert estimate(BIG, hardware, layout, **settings).step_time > 0
        return
    with pytest.raises(ValueError, match=message):
        layout, settings = split(kw)
        estimate(BIG, hardware, layout, **settings)


def test_the_sync_is_one_collective_per_bucket_or_unit():
    from parlib.cost.estimate import bucket_elements, sync_collectives
    # Megatron's buckets: max(40M, 1M x ranks) elements
    assert bucket_elements(8) == 40_000_000 and bucket_elements(64) == 64_000_000
    # 100M elements (10 layers of 9M + a root of 10M) over 64 ranks in bf16: a bucket of 64M
    # and one of 36M, one all-reduce each
    ops = sync_collectives(10, 9e6, 10e6, 64, 0, 4, 2, 2)
    assert ops == [(1, "all_reduce", 128e6), (1, "all_reduce", 72e6)]
    # ZeRO-1: a reduce-scatter and an all-gather per bucket, once a step
    assert sync_collectives(10, 9e6, 10e6, 64, 1, 4, 2, 2) == [
        (1, "reduce_scatter", 128e6), (1, "reduce_scatter", 72e6),
        (1, "all_gather", 128e6), (1, "all_gather", 72e6)]
    # ZeRO-2: sharded gradients cannot accumulate whole: every microbatch reduce-scatters
    assert sync_collectives(10, 9e6, 10e6, 64, 2, 4, 2, 2)[:2] == [
        (4, "reduce_scatter", 128e6), (4, "reduce_scatter", 72e6)]
    # ZeRO-3: per microbatch, per layer and for the root, two gathers and a reduce-scatter
    # (gradients in fp32, 4 bytes; weights in bf16, 2)
    assert sync_collectives(10, 9e6, 10e6, 64, 3, 4, 4, 2) == [
        (40, "all_gather", 18e6), (4, "all_gather", 20e6),
        (40, "all_gather", 18e6), (4, "all_gather", 20e6),
        (40, "reduce_scatter", 36e6), (4, "reduce_scatter", 40e6)]


def test_zero2_with_a_pipeline_pays_a_reduce_scatter_per_microbatch():
    # d=2 x p=2 of TOY, m=4, fp32, one device per node (10 us + 100 MB/s): a stage holds 2
    # layers (1744 elements) plus the embedding's 160 (first stage, the worst's memory):
    # 1904 elements, 7616 B. ZeRO-1: one reduce-scatter (one step, 10 us, + 7616 B / 2 x
    # 10 ns = 48.08 us) and one all-gather (48.08 us); ZeRO-2: four reduce-scatters and the
    # gather, 5 x 48.08 us
    kw = dict(m=4, global_batch=16, mixed_precision=False)
    hw = TOY_HW.with_(devices_per_node=1)
    one = estimate(TOY, hw, Layout(dp=2, pp=2), zero=1, **kw)
    two = estimate(TOY, hw, Layout(dp=2, pp=2), zero=2, **kw)
    per = (10 + 0.5 * 4 * (2 * 872 + 160) * 10e-3) * 1e-6
    assert one.time["dp_sync_total"] == pytest.approx(2 * per)
    assert two.time["dp_sync_total"] == pytest.approx(5 * per)


def test_hidden_communication_slows_the_compute_beside_it():
    # the floor case above (536.16 us of the sync hidden, 142.32 us exposed) with compute
    # 18.9% slower while a collective runs beside it: 0.189 x 536.16 = 101.33 us more
    hw = TOY_HW.with_(devices_per_node=1, overlap_slowdown=0.189)
    est = estimate(TOY, hw, Layout(dp=4), m=1, global_batch=160, zero=3, grad_reduce_bytes=4)
    assert est.time["dp_sync_hidden"] == pytest.approx(536.16e-6)
    assert est.time["dp_overlap_cost"] == pytest.approx(0.189 * 536.16e-6)
    assert est.time["dp_sync"] == pytest.approx((142.32 + 0.189 * 536.16) * 1e-6)
    # nothing hidden (dp_overlap=False): nothing slowed
    none = estimate(TOY, hw, Layout(dp=4), m=1, global_batch=160, zero=3,
                    grad_reduce_bytes=4, dp_overlap=False)
    assert none.time["dp_overlap_cost"] == 0
    assert none.time["dp_sync"] == pytest.approx(678.48e-6)
    # the presets carry the published figure
    from parlib.cost import Hardware
    assert Hardware.dgx_h100(8).overlap_slowdown == 0.189
    assert Hardware.dgx_h100(8).at_peak.overlap_slowdown == 0
