"""The pipeline crossing, timed the way the runner pays it: the fit's arithmetic by hand,
and a short real measurement on two ranks."""

from __future__ import annotations

import pytest

import parlib
from parlib import cost
from parlib.measure.crossings import CrossingFit, measure_crossings, time_crossings, trimmed_mean


def test_trimmed_mean_drops_the_ends():
    # 10 values, 10% off each end: 1 and 100 go, the mean of 2..9 stays
    assert trimmed_mean([1, 2, 3, 4, 5, 6, 7, 8, 9, 100]) == pytest.approx(5.5)
    assert trimmed_mean([4.0]) == 4.0
    with pytest.raises(ValueError, match="no times"):
        trimmed_mean([])


def test_fit_prices_header_and_payload_together():
    fit = CrossingFit(alpha=5e-4, beta=4e-9, send_alpha=2e-4, send_beta=2e-9, receive=1e-4)
    # whole crossing: 500 us + (1000 + 24) B x 4 ns/B; send: 200 us + 1024 B x 2 ns/B
    assert fit.whole(1000) == pytest.approx(504.096e-6)
    assert fit.whole(1000) == pytest.approx(cost.crossing_time(1000, 5e-4, 4e-9))
    assert fit.send(1000) == pytest.approx(202.048e-6)
    # the latency after the sends return: the whole crossing less the posting
    assert fit.latency(1000) == pytest.approx(504.096e-6 - 202.048e-6)
    # a rank inside the pipeline handles a send and a receive per op: their mean per message
    assert fit.own_time(1000) == pytest.approx((202.048e-6 + 100e-6) / 2)
    text = fit.describe()
    assert "500 us + 4.00 ns/B from before the sends" in text
    assert "receive 100 us" in text and "send 200 us" in text


def test_a_message_there_before_the_sends_returned_has_no_latency_left():
    # a sender descheduled inside isend: its posting took longer than the whole crossing
    fit = CrossingFit(alpha=3e-4, beta=0.0, send_alpha=1e-3, send_beta=0.0, receive=1e-4)
    assert fit.latency(0) == 0.0 and fit.whole(0) == pytest.approx(3e-4)


def test_the_fit_only_sees_times_that_cannot_go_negative(monkeypatch):
    # what rank 0 returns: whole crossings (from before the sends) and the sends' posting
    got = {"latency": [3e-4, 5e-4], "send": [4e-4, 4.5e-4], "receive": [1e-4]}

    def fake_launch(fn, *args, world_size, **kwargs):
        assert fn is time_crossings and world_size == 2
        return [got, None]

    fit = measure_crossings(launch=fake_launch, sizes_bytes=(0, 1000), rounds=3)
    # the posting outlasted the whole crossing at 0 bytes: latency 0, not a crash
    assert fit.whole(0) == pytest.approx(3e-4) and fit.latency(0) == 0.0
    assert fit.latency(1000) == pytest.approx(5e-4 - 4.5e-4)


def test_measured_on_two_ranks():
    fit = measure_crossings(launch=parlib.launch, backend="gloo", sizes_bytes=(0, 64 * 1024),
                            rounds=3, op_seconds=0.002)
    assert fit.sizes == [0, 64 * 1024] and fit.rounds == 3
    assert len(fit.latencies) == len(fit.sends) == 2
    assert all(t > 0 for t in fit.latencies + fit.sends)
    # a rank's own part of a message: positive, well under an op here
    assert 0 < fit.receive < 0.05
    assert fit.send(64 * 1024) > 0 and fit.latency(0) >= 0
    # the whole crossing holds the posting: it can never be shorter than the latency
    assert fit.whole(64 * 1024) >= fit.latency(64 * 1024)


def test_needs_two_ranks():
    with pytest.raises(parlib.RankError, match="2 ranks"):
        parlib.launch(time_crossings, [0], 1, 0.001, world_size=3, backend="gloo")
