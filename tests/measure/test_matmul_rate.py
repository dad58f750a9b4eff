"""The matmul-rate finder: the best shape's rate is the largest, saved and read back."""

import pytest

from parlib.measure import load_matmul_rate, matmul_flops, measure_matmul_rate, save_matmul_rate


def test_flops_of_a_matmul_by_hand():
    # (128, 512) x (512, 256): 128 x 256 dot products of length 512, 2 FLOPs per term
    assert matmul_flops(128, 256, 512) == 2 * 128 * 256 * 512 == 33_554_432


def test_the_best_shape_is_the_fastest_and_round_trips(tmp_path):
    shapes = [(64, 64, 64), (256, 256, 256), (32, 512, 16)]
    rate = measure_matmul_rate(shapes, threads=1, repeats=3, min_seconds=5e-4)
    assert rate.flops_per_second == max(rate.rates.values()) > 0
    assert rate.rates[" x ".join(map(str, rate.shape))] == rate.flops_per_second
    assert set(rate.rates) == {"64 x 64 x 64", "256 x 256 x 256", "32 x 512 x 16"}
    assert rate.threads == 1 and rate.spread >= 0 and "GFLOP/s best" in str(rate)
    path = save_matmul_rate(rate, tmp_path / "rate.json")
    back = load_matmul_rate("float32", threads=1, path=path)
    assert back == rate
    assert load_matmul_rate("float32", threads=7, path=path) is None  # not measured
    assert load_matmul_rate(path=tmp_path / "missing.json") is None


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="shapes is empty"):
        measure_matmul_rate([])
    with pytest.raises(ValueError, match=r"three positive integers \(m, n, k\), got \(4, 4\)"):
        measure_matmul_rate([(4, 4)])
    with pytest.raises(ValueError, match="dtype must be one of"):
        measure_matmul_rate([(4, 4, 4)], dtype="int8")
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        measure_matmul_rate([(4, 4, 4)], threads=0)
