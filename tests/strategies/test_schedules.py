"""Schedules: op orders, the bubble formulas, peak activations and the ideal simulator."""

from __future__ import annotations

import pytest

from parlib import cost
from parlib.experiments.simulate import ideal_run, simulate
from parlib.measure.timeline import busy_time, makespan, measured_bubble
from parlib.strategies import schedules as S
from parlib.strategies.schedule_check import ScheduleError, validate
from parlib.strategies.schedules import BACKWARD, FORWARD, WEIGHT, B, F, Op, W


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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (4, 4), (4, 8), (3, 6)])
def test_every_op_once_forward_before_backward(name, p, m):
    kinds = (FORWARD, BACKWARD, WEIGHT) if name == "zb-h1" else (FORWARD, BACKWARD)
    for r in range(p):
        ops = S.schedule(name, p, m, r, v=2)
        v = 2 if name == "interleaved" else 1
        chunks = {op.chunk for op in ops}
        assert sorted(ops, key=lambda o: (o.kind, o.mb, o.chunk)) == sorted(
            [Op(k, i, c) for k in kinds for i in range(m) for c in chunks],
            key=lambda o: (o.kind, o.mb, o.chunk))
        assert len(chunks) == v
        for op in ops:
            if op.kind == BACKWARD:
                assert ops.index(Op(FORWARD, op.mb, op.chunk)) < ops.index(op)
            if op.kind == WEIGHT:
                assert ops.index(Op(BACKWARD, op.mb, op.chunk)) < ops.index(op)


def test_op_notation():
    assert [F(3), B(3), W(3), F(3, 1)] == [Op(FORWARD, 3), Op(BACKWARD, 3), Op(WEIGHT, 3),
                                           Op(FORWARD, 3, 1)]
    assert ops_str([F(3), B(3), W(3), F(3, 1), B(0, 2)]) == "F3 B3 W3 F3.1 B0.2"
    assert S.all_ranks("1f1b", 3, 4) == {r: S.one_f_one_b(3, 4, r) for r in range(3)}
    assert S.all_ranks("interleaved", 2, 4, 3)[1] == S.interleaved(2, 4, 1, 3)
    with pytest.raises(ValueError, match="unknown schedule"):
        S.all_ranks("zigzag", 2, 2)


def test_zb_h1_order():
    # 1F1B's F and B order; rank r runs each W r Bs late (the last rank's Ws fill its tail)
    assert ops_str(S.zb_h1(4, 6, 0)) == \
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    assert ops_str(S.zb_h1(4, 6, 3)) == \
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"
    for r in range(4):
        unsplit = [op for op in S.zb_h1(4, 6, r) if op.kind != WEIGHT]
        assert unsplit == S.one_f_one_b(4, 6, r)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 6), (8, 16), (4, 2)])
def test_zb_h1_holds_what_1f1b_holds_on_its_first_rank(p, m):
    # ZB-H1 keeps a pipeline's memory where 1F1B has it: no rank holds more than 1F1B's
    # first rank, min(p, m) microbatches (from F to W). Its later ranks hold more than
    # 1F1B's (p - rank): that is where the Ws that fill the bubble wait.
    one = S.peaks(S.all_ranks("1f1b", p, m))
    zb = S.peaks(S.all_ranks("zb-h1", p, m))
    assert max(zb.values()) == max(one.values()) == min(p, m)
    assert zb == {r: min(p, m) for r in range(p)}
    validate(S.all_ranks("zb-h1", p, m), p, m, max_in_flight=min(p, m))
    if p > 2 and m >= p:
        with pytest.raises(ScheduleError) as err:
            validate(S.all_ranks("zb-h1", p, m), p, m, max_in_flight=one)
        assert err.value.problem == "memory" and err.value.rank == 1


@pytest.mark.parametrize("t_w", [1.0, 0.8, 0.5])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 6), (8, 16)])
def test_zb_h1_bubble_is_the_zero_bubble_papers(p, m, t_w):
    # Qi et al. count the bubble (idle time per rank) from the critical path: 1F1B waits
    # (p-1)(t_F + t_B + t_W) in all, its backward being B + W. ZB-H1 waits (p-1)(t_F + t_B
    # - t_W): the Ws of the cool-down fill a t_W of each step of the gradient's way back
    # (for t_W <= t_F). With t_F = t_B = t_W that is a third of 1F1B's.
    t_f, t_b = 1.0, 2.0
    t_B = t_b - t_w
    one = simulate("1f1b", p, m, t_f=t_f, t_b=t_b)
    zb = simulate("zb-h1", p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    work = m * (t_f + t_b)
    assert all(busy_time(row) == pytest.approx(work) for row in zb)  # B + W = one backward
    assert makespan(one) - work == pytest.approx((p - 1) * (t_f + t_B + t_w))
    assert makespan(zb) - work == pytest.approx((p - 1) * (t_f + t_B - t_w))
    if t_w == t_f == t_B:
        assert (makespan(zb) - work) == pytest.approx((makespan(one) - work) / 3)
    assert measured_bubble(zb) < measured_bubble(one)


def test_simulate_splits_the_backward_and_scales_chunks():
    sched = {0: [F(0), B(0), W(0)], 1: [F(0), B(0), W(0)]}
    run = ideal_run(sched, 2, 1, t_f=1.0, t_b=3.0, t_w=1.0)
    # F0 F0' B0' (W0' | B0) W0: B takes t_b - t_w = 2
    assert [(s.kind, s.start, s.end) for s in run.spans[1]] == [
        (FORWARD, 1.0, 2.0), (BACKWARD, 2.0, 4.0), (WEIGHT, 4.0, 5.0)]
    assert [(s.kind, s.start, s.end) for s in run.spans[0]] == [
        (FORWARD, 0.0, 1.0), (BACKWARD, 4.0, 6.0), (WEIGHT, 6.0, 7.0)]
    assert run.makespan == 7.0 and run.peak_in_flight == {0: 1, 1: 1}
    assert run.messages == {0: 1, 1: 1}
    chunked = ideal_run("interleaved", 2, 2, v=2, t_f=1.0, t_b=2.0)
    assert {round(s.duration, 9) for row in chunked.spans for s in row} == {0.5, 1.0}
    with pytest.raises(ValueError, match="t_w"):
        ideal_run(sched, 2, 1, t_b=1.0, t_w=2.0)


def test_simulate_validates_first():
    with pytest.raises(ScheduleError, match="never runs") as err:
        simulate({0: [F(0)], 1: [F(0), B(0)]}, 2, 1)
    assert err.value.problem == "missing"


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
