"""Emulated devices: StageCost.for_flops and PacedCost pad compute to its FLOPs' time."""

from __future__ import annotations

import time

import pytest

from parlib.measure.emulation import PacedCost, StageCost


def test_for_flops_backward_costs_twice_the_forward():
    cost = StageCost.for_flops(2e6, 1e9)  # 2 MFLOP per row on a 1 GFLOP/s device
    assert cost.duration("forward", 3) == pytest.approx(6e-3)
    assert cost.duration("backward", 3) == pytest.approx(12e-3)
    with pytest.raises(ValueError, match="flops_per_second"):
        StageCost.for_flops(1.0, 0.0)


def test_pad_does_not_count_excluded_communication():
    cost = StageCost.for_flops(20e6, 1e9)  # 20 ms per row forward
    started = time.perf_counter()
    time.sleep(0.015)  # "communication" inside the forward
    slept = time.perf_counter() - started  # as long as the machine made it (load oversleeps)
    left = cost.pad("forward", started, 1, excluded=slept)
    assert left == pytest.approx(0.020, abs=0.004)  # the whole 20 ms still to compute
    assert time.perf_counter() - started >= 0.035


def test_pad_reports_an_overrun():
    cost = StageCost.for_flops(1e6, 1e9)  # 1 ms
    started = time.perf_counter()
    time.sleep(0.005)
    assert cost.pad("forward", started, 1) < 0


def test_paced_cost_reaches_each_point_on_time():
    # three pieces of 10, 20 and 5 ms around two communication points
    paced = PacedCost([10e6, 20e6, 5e6], [0.0, 0.0, 0.0], 1e9)
    started = paced.start("forward", 1)
    reached, comm = [], 0.0
    for _ in range(2):
        paced.before_point(comm)
        reached.append(time.perf_counter() - started)
        begin = time.perf_counter()
        time.sleep(0.010)  # the all-reduce
        comm += time.perf_counter() - begin
    left = paced.pad("forward", started, 1, excluded=0.020)
    total = time.perf_counter() - started
    assert reached[0] >= 0.010 and reached[1] >= 0.010 + 0.010 + 0.020
    assert left > 0 and total >= 0.035 + 0.020
    assert paced.points == 2 and paced.late == 0


def test_paced_cost_counts_late_points_and_ignores_points_outside_a_span():
    paced = PacedCost([1e6, 1e6], [0.0, 0.0], 1e9)
    paced.before_point(0.0)  # no span started: nothing to pace
    assert paced.points == 0
    started = paced.start("forward", 1)
    time.sleep(0.005)  # real compute far beyond its 1 ms
    paced.before_point(0.0)
    paced.pad("forward", started, 1)
    assert paced.late == 1
    assert paced.duration("forward", 2) == pytest.approx(4e-3)
    with pytest.raises(ValueError):
        PacedCost([-1.0], [0.0], 1e9)
