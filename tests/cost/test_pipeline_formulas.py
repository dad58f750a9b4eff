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


def test_fixed_batch_step_shrinks_towards_the_bubble_free_time():
    # B = 8 rows at 15 ms per row (forward + backward), no per-call time: (m+p-1)/m x 120 ms
    steps = [cost.fixed_batch_step_time(4, m, 8, 0.015) for m in (1, 2, 4, 8)]
    assert steps == pytest.approx([(m + 3) / m * 0.12 for m in (1, 2, 4, 8)])
    assert steps == sorted(steps, reverse=True)
    assert cost.fixed_batch_step_time(4, 8, 8, 0.015) == pytest.approx(
        cost.ideal_step_time(4, 8, cost.microbatch_time(1, 0.015)))
    with pytest.raises(ValueError, match="does not split"):
        cost.fixed_batch_step_time(4, 3, 8, 0.015)


def test_per_call_time_makes_tiny_microbatches_stop_paying():
    # 1 s of work per batch, 10 ms per call: best m = sqrt(3 x 1 / 0.01) = 17.3
    best = cost.best_microbatches(4, 1.0, 0.01)
    assert best == pytest.approx(3**0.5 * 10)
    times = {m: cost.fixed_batch_step_time(4, m, 960, 1 / 960, 0.01) for m in (4, 16, 20, 96)}
    assert times[16] < times[4] and times[20] < times[96]
    assert cost.best_microbatches(4, 1.0, 0.0) == float("inf")
    assert cost.microbatch_time(4, 0.01, 0.002) == pytest.approx(0.042)
    with pytest.raises(ValueError):
        cost.microbatch_time(0, 0.01)


def _gpipe_flow_shop(stage_times, m):
    # brute force: forwards then backwards, each op starts when its stage is free and its
    # input is ready; forward and backward each take half of a stage's time here
    p = len(stage_times)
    end = [[0.0] * m for _ in range(p)]
    free = [0.0] * p
    for i in range(m):
        for s in range(p):
            start = max(free[s], end[s - 1][i] if s else 0.0)
            end[s][i] = free[s] = start + stage_times[s] / 2
    for i in reversed(range(m)):
        for s in reversed(range(p)):
            ready = end[s + 1][i] if s < p - 1 else end[s][i]
            end[s][i] = free[s] = max(free[s], ready) + stage_times[s] / 2
    return max(free)


@pytest.mark.parametrize("times", [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 2.0, 1.0], [3.0, 1.0]])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_imbalanced_step_time_the_slow_stage_sets_the_pace(times, m):
    assert cost.imbalanced_step_time(times, m) == pytest.approx(_gpipe_flow_shop(times, m))
    if len(set(times)) == 1:
        assert cost.imbalanced_step_time(times, m) == cost.ideal_step_time(len(times), m, 1.0)


def test_min_microbatches_either_bubble_definition():
    assert cost.min_microbatches(8, 0.1 - 1e-9) == 64               # 7 / (m + 7) < 0.1
    assert cost.min_microbatches(8, 0.1 - 1e-9, relative=True) == 71  # 7 / m < 0.1
    assert cost.min_microbatches(4, cost.bubble_fraction(4, 8) / 2) == 19  # 3/22
