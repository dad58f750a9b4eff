"""Schedules: op orders, the bubble formulas, peak activations and the ideal simulator."""

from __future__ import annotations

import pytest

from parlib import cost
from parlib.experiments.simulate import simulate
from parlib.measure.timeline import makespan, measured_bubble
from parlib.strategies import schedules as S
from parlib.strategies.schedules import BACKWARD, FORWARD, Op


def ops_str(ops):
    return " ".join(map(repr, ops))


def test_gpipe_order():
    assert ops_str(S.gpipe(4, 3, 2)) == "F0 F1 F2 B2 B1 B0"
    assert S.naive(4, 1, 0) == [Op(FORWARD, 0), Op(BACKWARD, 0)]
    with pytest.raises(ValueError):
        S.naive(4, 2, 0)


def test_1f1b_order_warmup_then_alternate():
    assert ops_str(S.one_f_one_b(4, 8, 0)) == \
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert ops_str(S.one_f_one_b(4, 8, 3)) == \
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert ops_str(S.one_f_one_b(4, 2, 0)) == "F0 F1 B0 B1"  # warm-up capped at m
    assert [S.warmup_forwards(4, 8, r) for r in range(4)] == [3, 2, 1, 0]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (4, 4), (4, 8), (3, 6)])
def test_every_op_once_forward_before_backward(name, p, m):
    for r in range(p):
        ops = S.schedule(name, p, m, r, v=2)
        v = 2 if name == "interleaved" else 1
        chunks = {op.chunk for op in ops}
        assert sorted(ops, key=lambda o: (o.kind, o.mb, o.chunk)) == sorted(
            [Op(k, i, c) for k in (FORWARD, BACKWARD) for i in range(m) for c in chunks],
            key=lambda o: (o.kind, o.mb, o.chunk))
        assert len(chunks) == v
        for op in ops:
            if op.kind == BACKWARD:
                assert ops.index(Op(FORWARD, op.mb, op.chunk)) < ops.index(op)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (4, 1), (4, 4), (4, 8), (8, 3)])
def test_simulated_step_matches_formula(name, p, m):
    spans = simulate(name, p, m, t_f=1.0, t_b=2.0)
    assert makespan(spans) == pytest.approx(cost.ideal_step_time(p, m, 3.0))
    assert measured_bubble(spans) == pytest.approx(cost.bubble_fraction(p, m))


@pytest.mark.parametrize("p,m,v", [(4, 4, 2), (4, 8, 2), (2, 4, 3), (4, 8, 4)])
def test_interleaved_shrinks_bubble_by_v(p, m, v):
    spans = simulate("interleaved", p, m, v=v, t_f=1.0, t_b=2.0)
    assert makespan(spans) == pytest.approx(cost.ideal_step_time(p, m, 3.0, v))
    assert measured_bubble(spans) == pytest.approx(cost.bubble_fraction(p, m, v))
    assert cost.bubble_ratio(p, m, v) == pytest.approx((p - 1) / (v * m))


def test_interleaved_needs_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of p"):
        S.interleaved(4, 6, 0, v=2)


def test_peak_in_flight():
    for r in range(4):
        assert S.peak_in_flight(S.gpipe(4, 8, r)) == 8
        assert S.peak_in_flight(S.one_f_one_b(4, 8, r)) == 4 - r
        assert S.peak_in_flight(S.one_f_one_b(4, 2, r)) == min(4 - r, 2)
    assert S.in_flight(S.gpipe(2, 2, 0)) == [1, 2, 1, 0]


def test_simulate_detects_deadlock():
    # rank 0 waits for B0's gradient, which rank 1 sends only after F1, which needs rank
    # 0's F1, which comes after B0 on rank 0
    orders = {0: [Op(FORWARD, 0), Op(BACKWARD, 0), Op(FORWARD, 1), Op(BACKWARD, 1)],
              1: [Op(FORWARD, 0), Op(FORWARD, 1), Op(BACKWARD, 0), Op(BACKWARD, 1)]}
    with pytest.raises(ValueError, match="deadlock"):
        simulate(orders, 2, 2)


def test_simulate_comm_delay_adds_to_critical_path():
    spans = simulate("gpipe", 4, 1, t_f=1.0, t_b=2.0, t_comm=0.5)
    assert makespan(spans) == pytest.approx(12.0 + 2 * 3 * 0.5)


def test_bad_arguments():
    with pytest.raises(ValueError):
        S.gpipe(4, 0, 0)
    with pytest.raises(ValueError):
        S.one_f_one_b(4, 2, 4)
    with pytest.raises(ValueError):
        S.schedule("zigzag", 4, 2, 0)
