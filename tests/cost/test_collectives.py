"""Collective formulas: ring bytes, alpha-beta time, the fit."""

import pytest

from parlib import cost
from parlib.cost import fit_alpha_beta


def test_fit_alpha_beta_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    a, b = fit_alpha_beta(sizes, [2e-4 + 3e-9 * n for n in sizes])
    assert a == pytest.approx(2e-4, rel=1e-6) and b == pytest.approx(3e-9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError, match="a time of 0 ms at 1 bytes"):
        fit_alpha_beta([1.0, 2.0], [0.0, 1.0])


def test_fit_names_a_negative_or_missing_time_and_what_it_was():
    # a latency read on two clocks out of order: named, with its size, not a bare crash
    with pytest.raises(ValueError, match=r"crossing of -0.7 ms at 32792 bytes.*out of order"):
        fit_alpha_beta([24, 32792], [3e-4, -7e-4], what="crossing")
    with pytest.raises(ValueError, match="a time of nan ms"):
        fit_alpha_beta([1.0, 2.0], [float("nan"), 1.0])
    with pytest.raises(ValueError, match="sizes must be non-negative, got -5 bytes"):
        fit_alpha_beta([-5.0, 2.0], [1.0, 1.0])


def test_ring_bytes_per_rank():
    assert cost.predicted_sent_bytes("all_reduce", 1000, 4) == 1500
    assert cost.predicted_sent_bytes("reduce_scatter", 1000, 4) == 750
    assert cost.predicted_sent_bytes("all_gather", 1000, 2) == 500
    assert cost.predicted_sent_bytes("all_reduce", 1000, 1) == 0
    assert cost.predicted_sent_bytes("send", 8, 2) == 8
    assert cost.predicted_sent_bytes("all_to_all", 8, 2) is None


def test_ring_time_is_steps_of_alpha_plus_bytes_of_beta():
    # 4 ranks, 1 MB: all-reduce is 6 messages of 250 kB each way
    t = cost.collective_time("all_reduce", 1e6, 4, alpha=1e-5, beta=1e-9)
    assert t == pytest.approx(6 * 1e-5 + 1.5e6 * 1e-9)
    assert cost.collective_time("all_gather", 1e6, 4, 1e-5, 1e-9) == pytest.approx(3e-5 + 7.5e-4)
    assert cost.collective_time("all_reduce", 1e6, 1, 1e-5, 1e-9) == 0
    with pytest.raises(ValueError, match="no ring time"):
        cost.collective_time("gossip", 1, 2, 1, 1)


def test_fit_weighs_small_messages():
    # a line with a 1% relative error on every point: the fit stays within a few percent
    sizes = [2**k for k in range(10, 25, 2)]
    times = [(5e-5 + 1e-9 * n) * (1.01 if i % 2 else 0.99) for i, n in enumerate(sizes)]
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(5e-5, rel=0.05) and b == pytest.approx(1e-9, rel=0.05)
    with pytest.raises(ValueError, match="different message sizes"):
        fit_alpha_beta([8, 8], [1e-3, 2e-3])


def test_bus_bandwidth():
    # 2 ranks: bus bandwidth equals algorithm bandwidth; 4 ranks: 1.5x
    assert cost.bus_bandwidth(1e9, 1.0, 2) == pytest.approx(1e9)
    assert cost.bus_bandwidth(1e9, 1.0, 4) == pytest.approx(1.5e9)
