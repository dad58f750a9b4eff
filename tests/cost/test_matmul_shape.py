"""The matmul rate depends on shape (parlib.cost.efficiency.matmul_time): output tiles of
256 x 128 in waves over the SMs, half a wave's tail, at least one wave. Hand-worked cases,
then the estimate charging each layer's per-device matmuls at their shapes' rate."""

import pytest

from parlib.cost import Hardware, Layout, Model, estimate
from parlib.cost.efficiency import (
    ACHIEVABLE,
    TILE,
    WAVE_TAIL,
    Achievable,
    matmul_fraction,
    matmul_time,
    shape_efficiency,
)


def test_tiles_run_in_waves_with_half_a_wave_of_tail():
    assert TILE == (256, 128) and WAVE_TAIL == 0.5
    # BLOOM's QKV at TP 8, microbatch 1: rows 2048, cols 3 x 14336 / 8 = 5376:
    # 8 x 42 = 336 tiles over 108 SMs = 3.111 waves, charged 3.611
    assert shape_efficiency(2048, 14336, 5376, multiprocessors=108) == pytest.approx(
        (336 / 108) / (336 / 108 + 0.5))
    assert shape_efficiency(2048, 14336, 5376, multiprocessors=108) == pytest.approx(
        0.8615, abs=1e-4)
    # microbatch 4: 32 x 42 = 1344 tiles = 12.44 waves: 12.44 / 12.94 = 0.961
    assert shape_efficiency(8192, 14336, 5376, multiprocessors=108) == pytest.approx(
        0.9614, abs=1e-4)
    # the A100's MAMF best shape 6912 x 16384: 27 x 128 = 3456 tiles = 32 whole waves
    assert shape_efficiency(6912, 2048, 16384, multiprocessors=108) == pytest.approx(32 / 32.5)


def test_seconds_partial_tiles_tiny_matmuls_and_batches():
    # one wave of 108 tiles of 256 x 128 x 1024 at 1e12 FLOP/s: 2 x 256 x 128 x 1024 x 108
    one_wave = 2 * 256 * 128 * 1024 * 108 / 1e12
    assert matmul_time(256 * 12, 1024, 128 * 9, flops_per_second=1e12,
                       multiprocessors=108) == pytest.approx(1.5 * one_wave)
    # 257 rows need 2 row tiles (tile quantization): 2 x 9 = 18 tiles, still one wave
    assert matmul_time(257, 1024, 128 * 9, flops_per_second=1e12,
                       multiprocessors=108) == pytest.approx(one_wave)
    # a single tile occupies one SM for a whole wave: 1/108 of the rate
    assert shape_efficiency(256, 1024, 128, multiprocessors=108) == pytest.approx(1 / 108)
    # a batch counts its tiles together: 108 one-tile matmuls make one full wave + tail
    assert shape_efficiency(256, 1024, 128, multiprocessors=108, batch=108) == pytest.approx(
        1 / 1.5)
    # no multiprocessors: FLOPs over the rate, whatever the shape
    assert matmul_time(3, 5, 7, flops_per_second=10.0, multiprocessors=0) == 2 * 3 * 5 * 7 / 10
    assert shape_efficiency(3, 5, 7, multiprocessors=0) == 1.0
    for bad in (dict(rows=0), dict(inner=-1), dict(batch=0)):
        args = dict(rows=8, inner=8, cols=8, batch=1) | bad
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be > 0"):
            matmul_time(args["rows"], args["inner"], args["cols"], flops_per_second=1.0,
                        multiprocessors=108, batch=args["batch"])


def test_generations_carry_their_sm_counts():
    assert ACHIEVABLE["A100"].multiprocessors == 108 and ACHIEVABLE["H100"].multiprocessors == 132
    assert ACHIEVABLE["measured"].multiprocessors == 0  # a measured rate: no shape curve
    assert Hardware.dgx_a100(8).multiprocessors == 108
    assert Hardware.dgx_h100(8).at_peak.multiprocessors == 0
    # the fraction of datasheet peak = best fraction x shape efficiency
    assert matmul_fraction("A100", 2048, 14336, 5376) == pytest.approx(
        267.9 / 312 * 0.8615, abs=1e-4)
    with pytest.raises(ValueError, match="multiprocessors must be an integer >= 0"):
        Achievable("X", 0.5, 0.5, "test", multiprocessors=-1)
    with pytest.raises(ValueError, match="multiprocessors must be an integer >= 0"):
        Hardware.dgx_a100(8, multiprocessors=1.5)


def _efficiency(shapes):
    flops = [2 * m * k * n * batch for m, k, n, batch in shapes]
    seconds = [f / shape_efficiency(m, k, n, batch=batch, multiprocessors=108)
               for f, (m, k, n, batch) in zip(flops, shapes)]
    return sum(flops) / sum(seconds)


def test_estimate_charges_each_layers_matmuls_at_their_shape():
    # 4 layers, h 4096, 32 heads (head_dim 128), s 2048, V 51200, f 16384, on 8 A100, t = 8,
    # one sequence: rows = 2048; the shapes as estimate's docstring lists them
    model = Model(4, 4096, 32, 2048, 51200)
    a100 = Hardware.dgx_a100(8)
    est = estimate(model, a100, Layout(tp=8), m=1, global_batch=1)
    flat = estimate(model, a100.with_(multiprocessors=0), Layout(tp=8), m=1, global_batch=1)
    layer = _efficiency([(2048, 4096, 3 * 4096 // 8, 1), (2048, 512, 4096, 1),
                         (2048, 128, 2048, 4), (2048, 2048, 128, 4),
                         (2048, 4096, 16384 // 8, 1), (2048, 16384 // 8, 4096, 1)])
    head = shape_efficiency(2048, 4096, 51200 // 8, multiprocessors=108)
    head_flops = 3 * 2 * 51200 * 4096 * 2048
    expected = ((est.hardware_flops - head_flops) / layer + head_flops / head) / 8 / (
        a100.achievable_flops)
    assert est.time["compute"] == pytest.approx(expected)
    assert flat.time["compute"] == pytest.approx(est.hardware_flops / 8 / a100.achievable_flops)
    assert 1.1 < est.time["compute"] / flat.time["compute"] < 1.5  # small matmuls: slower


def test_bigger_microbatches_run_nearer_the_best_rate():
    # BigScience's sweep: microbatch 4 makes 4x taller matmuls than microbatch 1, so the same
    # 2048 sequences compute faster; without a shape curve the compute is the same
    model = Model(72, 14336, 64, 2048, 250880, tied_embeddings=True)
    kw = dict(global_batch=2048, zero=1, recompute=True, sequence_parallel=False)
    for hardware, faster in ((Hardware.dgx_a100(384), True),
                             (Hardware.dgx_a100(384, multiprocessors=0), False)):
        one, four = (estimate(model, hardware, Layout(dp=4, tp=8, pp=12), m=2048 // (4 * mbs),
                              **kw).time["compute"] for mbs in (1, 4))
        assert (four < 0.95 * one) if faster else four == pytest.approx(one)


def test_experts_matmuls_are_charged_at_their_tokens_per_expert():
    # 8 experts, top 2, ep = 8 over 8 data-parallel ranks: each rank holds 1 expert, which
    # receives 8 ranks x 2048 tokens x 2 choices / 8 experts = 4096 rows
    model = Model(2, 2048, 16, 2048, 32000, n_experts=8, top_k=2, expert_ffn_dim=4096)
    a100 = Hardware.dgx_a100(8)
    est = estimate(model, a100, Layout(dp=8, ep=8), m=1, global_batch=8)
    layer = _efficiency([(2048, 2048, 3 * 2048, 1), (2048, 2048, 2048, 1),
                         (2048, 128, 2048, 16), (2048, 2048, 128, 16),
                         (4096, 2048, 4096, 1), (4096, 4096, 2048, 1)])
    head = shape_efficiency(2048, 2048, 32000, multiprocessors=108)
    head_flops = 3 * 2 * 32000 * 2048 * 2048 * 8
    expected = ((est.hardware_flops - head_flops) / layer + head_flops / head) / 8 / (
        a100.achievable_flops)
    assert est.time["compute"] == pytest.approx(expected)
