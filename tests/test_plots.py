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
