"""The drawings: who holds what before and after a collective."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from parlib.plots import draw_collective  # noqa: E402


def test_draw_collective_shapes():
    fig = draw_collective("all-gather", [[1], [2]], [[1, 2], [1, 2]], caption="2 ranks, CPU")
    assert len(fig.axes) == 2 and fig.axes[0].get_title() == "all-gather: before"
    with pytest.raises(ValueError, match="ranks"):
        draw_collective("x", [[1]], [[1], [2]])


def test_timeline_draws_each_axis_communication_above_or_below_its_row():
    import matplotlib.pyplot as plt

    from parlib.measure.timeline import AXES, KINDS, Span
    from parlib.plots import AXIS_STYLE, draw_timeline

    assert set(AXES) <= set(KINDS) and set(AXES) <= set(AXIS_STYLE)  # each axis is drawn
    spans = [[Span(0, "forward", 0.0, 1.0, 0), Span(0, "tp", 0.2, 0.3),
              Span(0, "dp", 1.0, 1.5)],
             [Span(1, "forward", 0.0, 1.0, 0), Span(1, "pp", 0.4, 0.6)]]
    ax = draw_timeline(spans, unit="s", row_labels=["rank 0 (tp 0)", "rank 1 (tp 1)"])
    boxes = {}  # (left, bottom, hatch) of every drawn strip
    for c in ax.collections:
        for path in c.get_paths():
            (x0, y0), (x1, _) = path.get_extents().get_points()
            boxes[round(x0, 3), round(y0, 2)] = c.get_hatch()
    assert boxes[0.2, 1.4] is None      # tp: above row 0 (y = 1, box top 1.4)
    assert boxes[1.0, 0.5] is None      # dp: below row 0 (box bottom 0.6, strip 0.1)
    assert boxes[0.4, -0.5] == "////"   # pp: below row 1, hatched (it shares dp's side)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 1 (tp 1)", "rank 0 (tp 0)"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "tp collectives (above the row)" in legend and "dp collectives (below the row)" \
        in legend and sorted(t.split()[0] for t in legend if "collectives" in t) == [
            "dp", "pp", "tp"]
    only_tp = draw_timeline([spans[0][:2]], unit="s")  # an axis not drawn has no legend entry
    assert [t.get_text() for t in only_tp.get_legend().get_texts() if "collectives" in
            t.get_text()] == ["tp collectives (above the row)"]
    with pytest.raises(ValueError, match="1 row labels for 2 rows"):
        draw_timeline(spans, row_labels=["one"])
    plt.close("all")


def test_tokens_per_expert_legend_is_clear_of_the_bars_and_capacity_lines():
    """The expert-parallel chapter's figure: the legend used to sit in the upper right corner,
    where a capacity line (or a tall bar) at the top of the axes ran through it. It now sits
    beside the axes."""
    import matplotlib.pyplot as plt

    from parlib.plots import draw_tokens_per_expert

    load = [13, 6, 8, 9, 7, 8, 6, 7]  # that chapter's rank 0: the busiest expert well above 1.0's 8
    ax = draw_tokens_per_expert(load, {1.0: 8, 1.25: 10, 2.0: 16}, caption="2 ranks, CPU, gloo")
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    drawn = [ax.get_window_extent(renderer)]  # the axes hold every bar and capacity line
    assert len(ax.lines) == 3 and all(not legend.overlaps(box) for box in drawn), (legend, drawn)
    # and the figure saved with a tight box (as the notebook shows it) keeps the whole legend
    tight = fig.get_tightbbox(renderer)
    assert tight.x1 >= legend.x1 / fig.dpi - 1e-6
    # counts of choices: whole-number ticks only
    assert all(float(t).is_integer() for t in ax.get_yticks()), ax.get_yticks()
    plt.close("all")


def test_timelines_on_a_shared_time_axis_show_every_step_in_full():
    """The pipeline chapter's GPipe figure: three rows share a time axis, drawn longest step first.
    Each call used to set the shared limit to its own step, so the last (shortest) one
    clipped the others and their "predicted end" labels floated outside the axes."""
    import matplotlib.pyplot as plt

    from parlib.measure.timeline import Span
    from parlib.plots import draw_timeline

    steps = [0.980, 0.462, 0.388]  # s: GPipe m = 1, 4, 8 in one run
    fig, axes = plt.subplots(3, 1, sharex=True)
    for ax, step in zip(axes, steps):
        draw_timeline([[Span(0, "forward", 0.0, step / 2, 0),
                        Span(0, "backward", step / 2, step, 0)]], ax, ideal=step)
    right = axes[-1].get_xlim()[1]
    assert right >= 1e3 * max(steps)  # the longest step in full, in every row
    assert right < 1.05e3 * max(steps)
    for ax, step in zip(axes, steps):  # each label inside, at its own step's end
        label = next(t for t in ax.texts if "predicted end" in t.get_text())
        assert label.get_position()[0] == pytest.approx(1e3 * step) and 1e3 * step <= right
    alone = draw_timeline([[Span(0, "forward", 0.0, 0.1, 0)]])  # not shared: its own step
    assert alone.get_xlim()[1] < 1e3 * 0.2
    plt.close("all")


def test_axis_rows_put_each_axis_traffic_on_its_own_row():
    import matplotlib.pyplot as plt

    from parlib.measure.timeline import Span
    from parlib.plots import draw_axis_rows

    spans = [Span(0, "forward", 0.0, 1.0, 0), Span(0, "tp", 0.2, 0.3), Span(0, "cp", 0.4, 0.5),
             Span(0, "cp", 0.6, 0.7), Span(0, "ep", 0.8, 0.9), Span(0, "send", 1.0, 1.1),
             Span(0, "backward", 1.1, 2.0, 0), Span(0, "dp", 2.0, 2.5)]
    ax = draw_axis_rows(spans, unit="s", title="one step", caption="1 rank, CPU, gloo",
                        bytes_by_axis={"cp": 2048})
    labels = [t.get_text() for t in ax.get_yticklabels()]
    # top first: compute, then tp, cp, ep, dp, pp (the pipeline's send)
    assert labels[::-1] == ["compute", "tp (1 call)", "cp (2 calls, 2.00 KiB)",
                            "ep (1 call)", "dp (1 call)", "pp (1 message)"]
    rows = {}  # y of each drawn box's centre -> its left edges
    for c in ax.collections:
        for path in c.get_paths():
            (x0, y0), (_, y1) = path.get_extents().get_points()
            rows.setdefault(round((y0 + y1) / 2), []).append(round(x0, 2))
    assert sorted(rows[5]) == [0.0, 1.1] and rows[3] == [0.4, 0.6] and rows[0] == [1.0]
    assert ax.get_title() == "one step\n1 rank, CPU, gloo"
    plt.close("all")
