"""Uneven pipeline stages, memory-bound operations, the achievable-rate table, ZeRO-3 with a
pipeline refused, and the planner naming what binds: each against a hand-worked case."""

import math

import pytest

from parlib.cost import ACHIEVABLE, Hardware, Layout, Link, Model, achievable_fraction, estimate
from parlib.cost.memory import (
    loss_bytes_per_token,
    memory_bound_bytes_per_layer,
    optimizer_step_bytes_per_param,
)
from parlib.cost.planner import best_layouts, binding_constraint, candidate_layouts
from parlib.cost.stages import stage_imbalance, stage_layers


def test_126_layers_in_16_stages_lighten_the_first_and_last():
    # ceil(126 / 16) = 8; 16 x 8 = 128 is 2 too many: one off the first, one off the last
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]
    assert stage_imbalance(126, 16) == 8 * 16 / 126
    # 10 in 4: ceil = 3, 12 - 10 = 2 too many -> [2, 3, 3, 2]; 9 in 4: 3 too many, the
    # third taken from the second stage -> [2, 2, 3, 2]
    assert stage_layers(10, 4) == [2, 3, 3, 2] and stage_layers(9, 4) == [2, 2, 3, 2]
    assert stage_layers(32, 8) == [4] * 8 and stage_imbalance(32, 8) == 1
    with pytest.raises(ValueError, match="at least one layer each"):
        stage_layers(4, 5)


TOY = Model(4, 8, 2, 4, 16)  # L=4, h=8, a=2, s=4, V=16, f=32
TOY_HW = Hardware(4, 2, 1e9, 1e9, Link(1e-6, 1e9), Link(1e-5, 1e8))


def test_memory_bound_bytes_by_hand():
    # s=4, b=1, h=8, a=2, f=32, 2-byte elements, no dropout, scores stored, t = 1. Per token:
    # norms 4h + residual adds 6h = 80 elements; GELU 2f = 64; softmax 2as = 16: 160 elements
    # x 2 bytes = 320 B; x 4 tokens = 1280 B
    assert memory_bound_bytes_per_layer(4, 1, 8, 2, dtype_bytes=2) == 1280
    # fused attention (no scores): (80 + 64) x 2 x 4 = 1152 B
    assert memory_bound_bytes_per_layer(4, 1, 8, 2, scores_stored=False) == 1152
    # t = 2 with sequence parallelism: everything halves -> 640 B; without it only the
    # split part: (80 + (64 + 16) / 2) x 2 x 4 = 960 B
    assert memory_bound_bytes_per_layer(4, 1, 8, 2, t=2, sequence_parallel=True) == 640
    assert memory_bound_bytes_per_layer(4, 1, 8, 2, t=2) == 960
    # gated: 3f = 96 instead of 64 -> (80 + 96 + 16) x 2 x 4 = 1536 B
    assert memory_bound_bytes_per_layer(4, 1, 8, 2, gated_mlp=True) == 1536


def test_loss_and_optimizer_step_bytes_by_hand():
    # bf16 logits: upcast (2 + 4), log-softmax (4 + 4), its backward (4 + 4), cast back
    # (4 + 2) = 28 B a logit; V = 50,368: 1,410,304 B a token. fp32: 16 B a logit.
    assert loss_bytes_per_token(50368) == 28 * 50368 == 1_410_304
    assert loss_bytes_per_token(16, dtype_bytes=4) == 256
    assert loss_bytes_per_token(16, t=2) == 28 * 8
    # Adam: fp32 reads weight, grad, two moments (4 + 4 + 8), writes weight and moments
    # (4 + 8); mixed reads grad and state (2 + 12), writes state and the bf16 weight (12 + 2)
    assert optimizer_step_bytes_per_param(False) == optimizer_step_bytes_per_param(True) == 28


def test_estimate_charges_memory_bound_time_beside_compute():
    # TOY (3808 parameters) on one device, fp32 (4-byte elements), b = 2, m = 1, nothing
    # recomputed (scores stored): per layer forward 2 x 4 tokens x 160 elements x 4 B =
    # 5120 B; forward plus a backward of twice it: 3 x 5120 = 15360 B a layer, 4 layers =
    # 61440 B; the loss: 8 tokens x 256 B = 2048 B; at 1 GB/s 63.488 us of memory_bound.
    # Adam's step, its own part: 3808 x 28 = 106624 B, 106.624 us
    hw = TOY_HW.with_(n_devices=1, devices_per_node=1, memory_bandwidth=1e9)
    est = estimate(TOY, hw, Layout(), m=1, global_batch=2, mixed_precision=False)
    assert TOY.n_params == 3808
    assert est.time["memory_bound"] == pytest.approx(63.488e-6)
    assert est.time["optimizer"] == pytest.approx(106.624e-6)
    # full recomputation runs the layers' forward again: 4 x 5120 x 4 layers = 81.92 us
    full = estimate(TOY, hw, Layout(), m=1, global_batch=2, mixed_precision=False,
                    recompute=True)
    assert full.time["memory_bound"] == pytest.approx((81.92 + 2.048) * 1e-6)
    # two microbatches: the layers and the loss twice, the optimizer step once
    two = estimate(TOY, hw, Layout(), m=2, global_batch=4, mixed_precision=False)
    assert two.time["memory_bound"] == pytest.approx(2 * 63.488e-6)
    assert two.time["optimizer"] == pytest.approx(106.624e-6)
    # half the efficiency, twice the time; no bandwidth given, no charge
    slow = estimate(TOY, hw.with_(memory_efficiency=0.5), Layout(), m=1, global_batch=2,
                    mixed_precision=False)
    assert slow.time["memory_bound"] == pytest.approx(2 * 63.488e-6)
    # the optimizer step is one large streaming kernel: its own efficiency
    assert slow.time["optimizer"] == pytest.approx(106.624e-6)
    streaming = estimate(TOY, hw.with_(streaming_efficiency=0.5), Layout(), m=1,
                         global_batch=2, mixed_precision=False)
    assert streaming.time["optimizer"] == pytest.approx(2 * 106.624e-6)
    assert streaming.time["memory_bound"] == pytest.approx(63.488e-6)
    free = estimate(TOY, hw.with_(memory_bandwidth=math.inf), Layout(), m=1, global_batch=2)
    assert free.time["memory_bound"] == free.time["optimizer"] == 0
    assert est.step_time == pytest.approx(est.time["compute"] + 170.112e-6)
    # on one device nothing waits on a link: the step is the devices' own work
    assert est.device_work == pytest.approx(est.step_time)
    two_ranks = estimate(TOY, TOY_HW.with_(n_devices=2, memory_bandwidth=1e9), Layout(dp=2), m=1,
                         global_batch=4, mixed_precision=False, dp_overlap=False)
    assert two_ranks.step_time == pytest.approx(two_ranks.device_work
                                                + two_ranks.time["dp_sync"])


def test_zero_shards_the_optimizer_step():
    # d = 2: each rank's loss covers its own 8 tokens; without ZeRO every rank updates all
    # 3808 parameters, with ZeRO-1 half of them
    hw = TOY_HW.with_(n_devices=2, devices_per_node=2, memory_bandwidth=1e9)
    zero0 = estimate(TOY, hw, Layout(dp=2), m=1, global_batch=4, mixed_precision=False)
    zero1 = estimate(TOY, hw, Layout(dp=2), m=1, global_batch=4, mixed_precision=False,
                     zero=1)
    assert zero0.time["memory_bound"] == zero1.time["memory_bound"] == pytest.approx(63.488e-6)
    assert zero0.time["optimizer"] == pytest.approx(106.624e-6)
    assert zero1.time["optimizer"] == pytest.approx(53.312e-6)


def test_presets_run_at_their_generations_achievable_fraction():
    h100 = Hardware.dgx_h100(8)
    assert h100.generation == "H100" and h100.memory_bandwidth == 3.35e12
    # the best measured matmul (MAMF) times the fraction of it a training step reaches
    assert achievable_fraction("H100") == pytest.approx(0.801, abs=1e-3)
    assert h100.compute_efficiency == pytest.approx(
        792.1 / 989 * ACHIEVABLE["H100"].training_matmul)
    assert Hardware.dgx_a100(8).compute_efficiency == pytest.approx(
        267.9 / 312 * ACHIEVABLE["A100"].training_matmul)
    assert all(row.source and 0 < row.matmul_fraction <= 1 for row in ACHIEVABLE.values())
    assert h100.at_peak.compute_efficiency == 1.0 == h100.at_peak.memory_efficiency
    with pytest.raises(ValueError, match="no achievable-fraction row for generation 'Z9'"):
        achievable_fraction("Z9")
    # compute time scales as 1 / efficiency: at peak it is MAMF x training fraction as long
    model = Model(32, 4096, 32, 2048, 51200)
    kw = dict(m=1, global_batch=8)
    # (with a shape-independent rate: multiprocessors 0; the shapes' part is tested in
    # test_matmul_shape.py)
    flat = h100.with_(multiprocessors=0)
    real = estimate(model, flat, Layout(dp=8), **kw)
    peak = estimate(model, flat.at_peak, Layout(dp=8), **kw)
    assert peak.time["compute"] / real.time["compute"] == pytest.approx(h100.compute_efficiency)
    # nothing recomputed: HFU = MFU
    assert real.mfu < peak.mfu and real.hfu == pytest.approx(real.mfu)


def test_uneven_stages_follow_the_slowest_and_the_worst_stage():
    # 10 layers in 4 stages: [2, 3, 3, 2]; the layers' compute stretches by 3 x 4 / 10 = 1.2
    model = Model(10, 64, 4, 32, 128, dropout=False)
    hw = Hardware(4, 4, 1e12, 1e9, Link(1e-6, 1e9), Link(1e-6, 1e9))
    est = estimate(model, hw, Layout(pp=4), m=4, global_batch=4, mixed_precision=False)
    assert est.stage_layers == [2, 3, 3, 2]
    tokens = 4 * 32
    layers_flops = model.flops_per_token * tokens - 6 * 128 * 64 * tokens
    head_flops = 6 * 128 * 64 * tokens
    assert est.time["compute"] == pytest.approx((layers_flops * 1.2 + head_flops) / 4 / 1e9)
    # memory: the second stage (3 layers, 3 microbatches in flight) holds 9 layers' worth of
    # activations, the first (2 layers, 4 in flight) 8: the second is the worst
    assert est.stage == "stage 2 of 4", est.stage
    # a HFU of recomputation: full recompute reruns the layers' forward
    full = estimate(model, hw, Layout(pp=4), m=4, global_batch=4, recompute=True)
    assert full.hfu > full.mfu


def test_zero3_with_a_pipeline_is_refused_and_never_planned():
    model = Model(32, 4096, 32, 2048, 51200)
    hw = Hardware.dgx_h100(64)
    with pytest.raises(ValueError, match=r"ZeRO-3 with a pipeline \(p = 8\) is refused"):
        estimate(model, hw, Layout(dp=8, pp=8), m=64, global_batch=512, zero=3, v=2)
    assert estimate(model, hw, Layout(dp=64), m=1, global_batch=512, zero=3).zero == 3
    picks = best_layouts(model, hw, global_batch=512, top=50)
    assert picks and not [e for e in picks if e.zero == 3 and e.layout.pp > 1]
    assert any(lay.pp > 1 for lay, _, _ in candidate_layouts(model, hw, 512))


def test_the_planner_names_the_binding_constraint():
    small = Model(12, 768, 12, 1024, 50257)
    # a small model on fast links, with a fused loss: compute binds (little else is left)
    fast = Hardware.dgx_h100(8).with_(memory_bandwidth=math.inf)
    roomy = best_layouts(small, fast, global_batch=512, loss="fused")[0]
    assert roomy.binding == "compute", roomy.binding
    # PyTorch's unfused loss holds 12 bytes a logit of 50,257 words at its peak: the same
    # pick fills the memory
    unfused = best_layouts(small, fast, global_batch=512)[0]
    assert (unfused.name, unfused.m) == (roomy.name, roomy.m)
    assert unfused.binding.startswith("memory"), unfused.binding
    # memory bandwidth: the same model where memory-bound work is counted
    counted = best_layouts(small, Hardware.dgx_h100(8), global_batch=512)[0]
    assert counted.binding.startswith("memory bandwidth"), counted.binding
    assert "binds: memory bandwidth" in counted.reason
    # memory: a 7B model on 14.2 GB devices has to split or shard to fit
    llama = Model(32, 4096, 32, 4096, 32000, ffn_dim=11008, gated_mlp=True, bias=False,
                  learned_positions=False)
    tight = best_layouts(llama, Hardware.dgx_h100(8, memory_bytes=14.2e9), global_batch=8)[0]
    assert tight.binding.startswith("memory ("), tight.binding
    # a link: the gradient sync over a 1 GB/s inter-node link, with memory to spare
    slow = Hardware.dgx_h100(16).with_(inter_node=Link(10e-6, 1e9))
    est = estimate(small, slow, Layout(dp=16), m=1, global_batch=64)
    assert binding_constraint(est) == (
        f"the data-parallel link (inter-node) ({est.time['dp_sync'] / est.step_time:.0%} "
        "of the step)")


def test_mfu_counts_the_model_and_hfu_the_recomputation_too():
    # TOY: a token multiplies 4 layers x 768 weights + the output 16 x 8 = 128: 3200; its
    # forward is 2 x 3200 + attention 4 x s x h x L = 512: 6912; training 3 x that = 20736
    assert TOY.flops_per_token == 3 * (2 * (4 * 768 + 128) + 512) == 20736
    kw = dict(m=1, global_batch=4, mixed_precision=False)
    none = estimate(TOY, TOY_HW, Layout(dp=4), **kw)
    selective = estimate(TOY, TOY_HW, Layout(dp=4), recompute="selective", **kw)
    full = estimate(TOY, TOY_HW, Layout(dp=4), recompute=True, **kw)
    assert none.hfu == none.mfu
    # selective reruns the scores' 512 FLOPs a token: HFU / MFU = 21248 / 20736
    assert selective.hfu / selective.mfu == pytest.approx(21248 / 20736)
    # full reruns the layers' forward, 2 x 4 x 768 + 512 = 6656: 27392 / 20736
    assert full.hfu / full.mfu == pytest.approx(27392 / 20736)
    # MFU: model FLOPs (20736 x 16 tokens) over step x 4 devices x 1 GFLOP/s peak
    assert none.mfu == pytest.approx(20736 * 16 / (none.step_time * 4 * 1e9))


def test_every_uneven_layout_the_planner_tries_is_one_estimate_accepts():
    # 126 layers (Llama 3 405B's count) on 16 devices: p = 16 does not divide 126
    model = Model(126, 256, 8, 256, 1000, gated_mlp=True, bias=False)
    hw = Hardware.dgx_h100(16)
    tried = list(candidate_layouts(model, hw, 32))
    assert any(lay.pp == 16 for lay, _, _ in tried)
    # uneven p = 16: v divides the 8 layers of the fullest stage, and 16 v chunks fit in 126
    # layers (v = 8 would need 128); the chunks by rank_layers
    assert {v for lay, _, v in tried if lay.pp == 16} == {1, 2, 4}
    for layout, m, v in tried:
        est = estimate(model, hw, layout, m=m, v=v, global_batch=32)
        assert sum(est.stage_layers) == 126 and len(est.stage_layers) == layout.pp
    est = estimate(model, hw, Layout(pp=16), m=32, global_batch=32)
    assert est.stage_layers == [7] + [8] * 14 + [7]


def test_new_hardware_fields_are_validated_and_shown():
    fast, slow = Link(1e-6, 1e11), Link(1e-5, 1e10)
    with pytest.raises(ValueError, match="memory_efficiency must be in"):
        Hardware(8, 8, 80e9, 1e15, fast, slow, memory_efficiency=0)
    with pytest.raises(ValueError, match="memory_bandwidth must be > 0"):
        Hardware(8, 8, 80e9, 1e15, fast, slow, memory_bandwidth=-1.0)
    plain = Hardware(8, 8, 80e9, 1e15, fast, slow)  # the old fields alone: nothing changes
    assert plain.achievable_flops == 1e15 and math.isinf(plain.achievable_memory_bandwidth)
    h100 = Hardware.dgx_h100(8)
    assert "achievable" not in str(plain) and (
        f"({h100.compute_efficiency:.0%} achievable), memory 3.35 TB/s" in str(h100))
    # the H200 has no published run to fit: its memory-bound work runs at the H100's bytes/s
    assert Hardware.dgx_h200(8).achievable_memory_bandwidth == pytest.approx(
        h100.achievable_memory_bandwidth)


def test_interleaved_uneven_chunks_follow_the_same_rule_per_chunk():
    from parlib.cost.stages import rank_layers

    # 126 layers in 16 x 2 chunks: 32 x 4 = 128, first and last chunk 3: rank 1 holds chunks
    # 1 and 17 (3 + 4), rank 16 chunks 16 and 32 (4 + 3), the others 8
    assert rank_layers(126, 16, 2) == [7] + [8] * 14 + [7] == rank_layers(126, 16)
    # 10 layers in 2 x 2 chunks: [2, 3, 3, 2]; rank 1: chunks 1, 3 -> 5, rank 2: 2, 4 -> 5
    assert rank_layers(10, 2, 2) == [5, 5]
    # 9 in 2 x 2: [2, 2, 3, 2] -> rank 1: 2 + 3 = 5, rank 2: 2 + 2 = 4
    assert rank_layers(9, 2, 2) == [5, 4]
    assert rank_layers(32, 4, 2) == [8] * 4  # even: the chunks' layers per rank
    with pytest.raises(ValueError, match="p x v = 4 x 3 = 12 model chunks need at least one"):
        rank_layers(10, 4, 3)
    # the estimate: Llama 3 405B's 126 layers on 16 stages interleaved, bubble (p - 1) /
    # (v m + p - 1) of the step, the slowest rank's 8 layers
    model = Model(126, 16384, 128, 8192, 128000, ffn_dim=53248, n_kv_heads=8, gated_mlp=True)
    kw = dict(m=16, global_batch=16, zero=1, recompute="selective")
    one, two = (estimate(model, Hardware.dgx_h100(128), Layout(tp=8, pp=16), v=v, **kw)
                for v in (1, 2))
    assert two.stage_layers == [7] + [8] * 14 + [7]
    busy = sum(two.time[k] for k in ("compute", "memory_bound", "tp_comm"))
    assert two.time["pp_bubble"] == pytest.approx(busy * 15 / (2 * 16 + 15) / (1 - 15 / 47))
    assert two.time["compute"] == pytest.approx(one.time["compute"])
    assert two.step_time < one.step_time
