"""Timeline: recorder, alignment, bubble measurement and the Gantt chart."""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from parlib import cost  # noqa: E402
from parlib.experiments.simulate import simulate  # noqa: E402
from parlib.measure.timeline import (  # noqa: E402
    Recorder,
    Span,
    align,
    busy_time,
    idle_spans,
    makespan,
    measured_bubble,
)
from parlib.plots import COLORS, draw_timeline  # noqa: E402


def test_recorder_spans_in_order():
    rec = Recorder(rank=2)
    with rec.span("forward", mb=0):
        time.sleep(0.01)
    with rec.span("recv", mb=1):
        pass
    assert [(s.rank, s.kind, s.mb) for s in rec.spans] == [(2, "forward", 0), (2, "recv", 1)]
    assert rec.spans[0].duration >= 0.009
    assert rec.spans[1].start >= rec.spans[0].end
    assert rec.spans[1].end <= rec.now()  # the clock the spans are stamped with
    rec.count(3, 100, sent=True)
    rec.count(3, 50, sent=True)
    rec.count(1, 7, sent=False)
    assert rec.sent == {3: 150} and rec.received == {1: 7}
    with pytest.raises(ValueError):
        with rec.span("lunch"):
            pass


def test_recorder_keeps_span_when_body_raises():
    rec = Recorder(rank=0)
    with pytest.raises(KeyError):
        with rec.span("backward", mb=4):
            raise KeyError
    assert rec.spans[0].kind == "backward"


def test_align_and_makespan():
    spans = [[Span(0, "forward", 10.0, 11.0, 0)], [Span(1, "forward", 11.0, 12.5, 0)]]
    aligned = align(spans)
    assert aligned[0][0].start == 0.0 and aligned[1][0].end == pytest.approx(2.5)
    assert makespan(spans) == pytest.approx(2.5)


def test_measured_bubble_and_idle():
    # two stages, one microbatch: stage 1 idle for 1 of 3, stage 0 idle for 1 of 3
    spans = [[Span(0, "forward", 0, 1, 0), Span(0, "recv", 1, 2), Span(0, "backward", 2, 3, 0)],
             [Span(1, "recv", 0, 1), Span(1, "forward", 1, 1.5, 0), Span(1, "backward", 1.5, 2, 0)]]
    assert busy_time(spans[0]) == 2 and busy_time(spans[1]) == 1
    assert measured_bubble(spans) == pytest.approx(1 - 3 / 6)
    idle = idle_spans(spans)
    assert [(s.start, s.end) for s in idle[0]] == [(1, 2)]
    assert [(s.start, s.end) for s in idle[1]] == [(0, 1), (2, 3)]
    total = sum(s.duration for row in idle for s in row)
    assert total == pytest.approx(2 * makespan(spans) - 3)


def test_simulated_gpipe_bubble_is_formula():
    for m in (1, 4, 8):
        assert measured_bubble(simulate("gpipe", 4, m)) == pytest.approx(
            cost.bubble_fraction(4, m))


def test_draw_gantt(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    spans = simulate("gpipe", 4, 8)
    ax = draw_timeline(spans, unit="t", title="GPipe", caption="simulated", ideal=33.0)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["stage 3", "stage 2", "stage 1", "stage 0"]  # stage 0 on top
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("7") == 8  # forward + backward of microbatch 7 on 4 stages
    colours = {to_hex(c.get_facecolor()[0]) for c in ax.collections}
    for kind in ("forward", "backward", "idle"):
        assert to_hex(COLORS[kind]) in colours
    assert "GPipe" in ax.get_title() and "simulated" in ax.get_title()
    ax.figure.savefig(tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 1000
    plt.close(ax.figure)
