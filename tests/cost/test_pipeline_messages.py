"""The pipeline step time that counts the messages: hand-worked cases and the simulator."""

from __future__ import annotations

import pytest

from parlib import cost
from parlib.experiments.simulate import ideal_run


def test_messages_per_rank_by_hand():
    # p = 4, m = 8: the ends send one direction only, the middle both
    assert cost.messages_per_rank("1f1b", 4, 8) == {0: 8, 1: 16, 2: 16, 3: 8}
    assert cost.messages_per_rank("gpipe", 4, 8) == {0: 8, 1: 16, 2: 16, 3: 8}
    assert cost.messages_per_rank("zb-h1", 4, 8) == {0: 8, 1: 16, 2: 16, 3: 8}  # W sends nothing
    # two chunks per rank: 2 x 2 x 8 = 32 sends, less the 8 at the model's two ends
    assert cost.messages_per_rank("interleaved", 4, 8, v=2) == {0: 24, 1: 32, 2: 32, 3: 24}
    assert cost.messages_per_rank("1f1b", 2, 4, headers=True) == {0: 8, 1: 8}
    assert cost.messages_per_rank("gpipe", 1, 4) == {0: 0}


def test_critical_path_messages_by_hand():
    # GPipe: the first microbatch's way down and back, 2(p - 1), for any m
    assert [cost.critical_path_messages("gpipe", 4, m) for m in (1, 4, 8)] == [6, 6, 6]
    # 1F1B: 6 + 2 floor(3(m-1)/4): m=4 -> 6 + 2*2, m=8 -> 6 + 2*5
    assert [cost.critical_path_messages("1f1b", 4, m) for m in (1, 2, 4, 8)] == [6, 6, 10, 16]
    # ZB-H1: 1F1B's, capped at 4(p-1) = 12
    assert [cost.critical_path_messages("zb-h1", 4, m) for m in (4, 8, 16)] == [10, 12, 12]
    # interleaved: 2(vp - 1) = 14 for p = 4, v = 2
    assert cost.critical_path_messages("interleaved", 4, 8, v=2) == 14


def test_step_time_by_hand():
    # GPipe p=4, m=8, t_f=1, t_b=2: 11 slots x 3 + 6 crossings x 0.1
    assert cost.schedule_step_time("gpipe", 4, 8, 1, 2, t_cross=0.1) == pytest.approx(33.6)
    # 1F1B: the same compute, 16 crossings
    assert cost.schedule_step_time("1f1b", 4, 8, 1, 2, t_cross=0.1) == pytest.approx(34.6)
    # interleaved v=2, ops of half a stage: (16 + 3) x 1.5 + 14 x 0.1
    assert cost.schedule_step_time("interleaved", 4, 8, 0.5, 1, v=2,
                                   t_cross=0.1) == pytest.approx(29.9)
    # ZB-H1, B = W = 1: 11 x 2 + (8 - 3) x 1 + 12 x 0.1
    assert cost.schedule_step_time("zb-h1", 4, 8, 1, 1, 1, t_cross=0.1) == pytest.approx(28.2)
    # without messages, 1F1B at a fixed batch is the old (m + p - 1)(B/m c + o)
    t_f, t_b, _ = cost.op_times(8, 4, 0.01, 0.02, 0.002)
    assert cost.schedule_step_time("1f1b", 4, 4, t_f, t_b) == pytest.approx(
        cost.fixed_batch_step_time(4, 4, 8, 0.03, 0.004))


def test_crossing_time_is_one_latency_for_header_and_payload():
    alpha, beta = 1e-4, 1e-9
    # hand-worked: 100 us + (1000 + 24) B x 1 ns/B = 101.024 us
    assert cost.crossing_time(1000, alpha, beta) == pytest.approx(101.024e-6)
    assert cost.crossing_time(0, alpha, beta) == pytest.approx(alpha + 24 * beta)
    with pytest.raises(ValueError, match="bytes, alpha, beta"):
        cost.crossing_time(-1, alpha, beta)


def test_op_times_split_and_chunks():
    t_f, t_b, t_w = cost.op_times(8, 4, 0.01, 0.02, 0.002)
    assert (t_f, t_b, t_w) == pytest.approx((0.022, 0.042, 0.0))
    # two chunks: half of each; split in halves: B and W a quarter of the stage's 42 ms
    t_f, t_b, t_w = cost.op_times(8, 4, 0.01, 0.02, 0.002, v=2, weight_share=0.5)
    assert (t_f, t_b, t_w) == pytest.approx((0.011, 0.0105, 0.0105))


@pytest.mark.parametrize("bad", [
    dict(name="interleaved", p=4, m=6, v=2),  # m not a multiple of p
    dict(name="1f1b", p=4, m=4, v=2),  # chunks only for the interleaved one
    dict(name="pipedream", p=4, m=4, v=1),
    dict(name="gpipe", p=0, m=4, v=1),
])
def test_bad_schedules_are_named(bad):
    with pytest.raises(ValueError, match=r"interleaved|v must be 1|unknown|p, m, v"):
        cost.critical_path_messages(bad["name"], bad["p"], bad["m"], bad["v"])


@pytest.mark.parametrize("name", cost.PIPELINE_SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("times", [(1.0, 2.0, 1.0), (2.0, 1.0, 0.3)])
def test_formula_equals_the_simulator_with_message_time(name, p, times):
    """The formula is checked against an independent replay: the simulator with t_comm."""
    tf, tb, tw = times
    v = 2 if name == "interleaved" else 1
    for m in range(1, 10):
        if name == "interleaved" and m % p:
            continue
        run = ideal_run(name, p, m, v=v if v > 1 else None, t_f=tf, t_b=tb, t_w=tw,
                        t_comm=0.05)
        f, b, w = (tf, tb - tw, tw) if name == "zb-h1" else (tf / v, tb / v, 0.0)
        assert cost.schedule_step_time(name, p, m, f, b, w, v, 0.05) == pytest.approx(
            run.makespan), (name, p, m)
        assert cost.messages_per_rank(name, p, m, v) == run.messages


def test_formula_would_catch_a_missing_message():
    """Without the message term the prediction misses the simulator by the crossings."""
    run = ideal_run("1f1b", 4, 8, t_f=1, t_b=2, t_comm=0.1)
    assert cost.schedule_compute_time("1f1b", 4, 8, 1, 2) == pytest.approx(run.makespan - 1.6)


def test_local_message_time_adds_per_op():
    assert [cost.messages_per_op(p) for p in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert cost.messages_per_op(1, v=2) == 1
    # GPipe p=4, m=8: 11 slots, each F and B 2 x 0.1 longer: + 11 x 0.4
    base = cost.schedule_step_time("gpipe", 4, 8, 1, 2, t_cross=0.1)
    assert cost.schedule_step_time("gpipe", 4, 8, 1, 2, t_cross=0.1,
                                   t_local=0.1) == pytest.approx(base + 4.4)
    # ZB-H1's W sends nothing: only F and B grow
    zb = cost.schedule_step_time("zb-h1", 4, 8, 1, 1, 1)
    assert cost.schedule_step_time("zb-h1", 4, 8, 1, 1, 1, t_local=0.1) == pytest.approx(
        zb + 11 * 0.4)
    with pytest.raises(ValueError, match="t_local"):
        cost.schedule_step_time("gpipe", 4, 8, 1, 2, t_local=-1)
