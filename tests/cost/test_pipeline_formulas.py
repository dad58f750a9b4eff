"""Pipeline formulas: the bubble, the ideal step time, the boundary bytes."""

import pytest

from parlib import cost


def test_bubble_numbers_from_the_lesson():
    assert cost.bubble_fraction(4, 1) == 0.75
    assert cost.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert cost.min_microbatches(8, 0.1) == 63  # <= 10%; strictly under needs 64
    assert cost.bubble_fraction(8, 64) < 0.1 <= cost.bubble_fraction(8, 63) + 1e-12


def test_ideal_step_time_and_bubble_ratio():
    # 4 stages, 8 microbatches of 30 + 60 ms: (8 + 3) x 90 ms
    assert cost.ideal_step_time(4, 8, 0.09) == pytest.approx(0.99)
    assert cost.ideal_step_time(4, 8, 0.09, v=3) == pytest.approx(0.81)
    assert cost.bubble_ratio(4, 8) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        cost.bubble_fraction(0, 8)
    with pytest.raises(ValueError):
        cost.min_microbatches(4, 1.5)


def test_boundary_bytes_is_b_s_h_dtype():
    assert cost.boundary_bytes(8, 64, 128) == 8 * 64 * 128 * 4
    assert cost.boundary_bytes(8, 64, 128, dtype_bytes=2) == 8 * 64 * 128 * 2
