"""Layout: the rank order worked by hand, the groups it implies, and its errors."""

from __future__ import annotations

import pickle

import pytest

from parlib.cost import Layout
from parlib.cost.layout import AXES, AXIS_NAMES, PIPELINE, axis

SHAPES = [dict(dp=2, tp=2, pp=2), dict(tp=2, pp=4), dict(dp=4, pp=2), dict(dp=2, tp=4),
          dict(dp=3, tp=2, pp=2), dict(dp=2, pp=3)]


def test_axes_are_data_in_rank_order():
    assert AXIS_NAMES == ("pp", "dp", "cp", "tp")  # slowest to fastest varying
    assert [a.symbol for a in AXES] == ["p", "d", "c", "t"]
    assert PIPELINE.name == "pp" and sum(a.pipeline for a in AXES) == 1
    assert axis("tp").title == "tensor"
    with pytest.raises(ValueError, match="unknown axis 'xp'; the axes are pp, dp, cp, tp, ep"):
        axis("xp")


def test_rank_order_by_hand_tp_fastest_pp_slowest():
    # (pp, dp, tp) = (2, 2, 2): rank = (pp * 2 + dp) * 2 + tp
    lay = Layout(dp=2, pp=2, tp=2)
    assert lay.coords(0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert lay.coords(1) == {"pp": 0, "dp": 0, "cp": 0, "tp": 1}
    assert lay.coords(2) == {"pp": 0, "dp": 1, "cp": 0, "tp": 0}
    assert lay.coords(4) == {"pp": 1, "dp": 0, "cp": 0, "tp": 0}
    # (pp, dp, tp) = (2, 3, 2): rank 11 = (1 * 3 + 2) * 2 + 1
    assert Layout(dp=3, pp=2, tp=2).coords(11) == {"pp": 1, "dp": 2, "cp": 0, "tp": 1}
    assert Layout(dp=3, pp=2, tp=2).rank_at({"pp": 1, "dp": 2, "tp": 1}) == 11
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.pipeline_neighbours(1) == (None, 5) and lay.pipeline_neighbours(6) == (2, None)
    assert [lay.stride(a) for a in AXIS_NAMES] == [4, 2, 2, 1]
    assert [lay.span(a) for a in AXIS_NAMES] == [8, 4, 2, 2]


def test_cp_sits_between_dp_and_tp():
    # (pp, dp, cp, tp) = (1, 2, 2, 2): rank = (dp * 2 + cp) * 2 + tp
    lay = Layout(dp=2, cp=2, tp=2)
    assert lay.coords(6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # t apart, inside d's block
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [lay.span(a) for a in AXIS_NAMES] == [8, 8, 4, 2]
    assert str(lay) == "t=2 x c=2 x d=2" and axis("cp").title == "context"


@pytest.mark.parametrize("sizes", SHAPES)
def test_groups_partition_the_world_and_round_trip(sizes):
    lay = Layout(**sizes)
    d, t, p = lay.dp, lay.tp, lay.pp
    n = lay.world
    assert n == d * t * p
    for name, size in lay.items():
        groups = lay.groups(name)
        assert len(groups) == n // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(n))
    for r in range(n):
        c = lay.coords(r)
        assert lay.rank_at(c) == r
        assert lay.axis_ranks("tp", r) == list(range(r - c["tp"], r - c["tp"] + t))  # adjacent
        assert lay.axis_ranks("pp", r) == [r + (i - c["pp"]) * d * t for i in range(p)]
        prev, nxt = lay.pipeline_neighbours(r)
        assert prev == (r - d * t if c["pp"] > 0 else None)
        assert nxt == (r + d * t if c["pp"] < p - 1 else None)


def test_a_mapping_of_axis_sizes():
    lay = Layout(tp=2, dp=2)
    assert list(lay) == ["pp", "dp", "cp", "tp"]
    assert dict(lay) == {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    assert lay["tp"] == lay.tp == 2 and lay.pp == lay.cp == 1 and "tp" in lay and "xp" not in lay
    assert lay == Layout(dp=2, tp=2) != Layout(dp=4) and len({lay, Layout(dp=2, tp=2)}) == 1
    assert Layout.of({"dp": 2, "tp": 2}) == lay and Layout.of(lay) is lay
    assert lay.with_(tp=4) == Layout(dp=2, tp=4) and lay.tp == 2
    assert pickle.loads(pickle.dumps(lay)) == lay  # it travels to ranks


def test_one_name_fastest_axis_first_size_one_left_out():
    assert str(Layout(dp=2, tp=2)) == "t=2 x d=2"
    assert str(Layout(dp=8, tp=8, pp=4)) == "t=8 x d=8 x p=4"
    assert str(Layout(dp=4)) == "d=4" and str(Layout()) == "one device"
    assert f"{Layout(pp=4):<5}|" == "p=4  |"
    assert repr(Layout(dp=2, tp=2)) == "Layout(dp=2, tp=2)"


def test_bad_layouts_and_coordinates_are_named():
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        Layout(xp=2)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"layout size tp=.* must be a whole number >= 1"):
            Layout(tp=bad)
    lay = Layout(dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match=r"rank 8 is outside a layout of 8 ranks"):
        lay.coords(8)
    with pytest.raises(ValueError, match="rank -1 is outside"):
        lay.axis_ranks("tp", -1)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        lay.axis_ranks("xp", 0)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        lay.groups("xp")
    with pytest.raises(ValueError, match=r"tp index 2 is outside \[0, 2\)"):
        lay.rank_at({"pp": 0, "dp": 0, "tp": 2})
    with pytest.raises(ValueError, match="lack axis 'dp'"):
        lay.rank_at({"pp": 0, "tp": 1})
    assert Layout(tp=2).rank_at({"tp": 1}) == 1  # a size-1 axis may be left out: index 0
    with pytest.raises(KeyError, match="unknown axis 'xp'"):
        lay["xp"]
    with pytest.raises(AttributeError, match="read-only"):
        lay.tp = 4
    with pytest.raises(ValueError, match="must be a Layout"):
        Layout.of((2, 2, 2))


def test_ep_borrows_data_and_context_parallel_ranks():
    # (pp, dp, cp, tp) = (1, 4, 2, 2), e = 4: 16 ranks (ep adds none). An ep group is 4
    # consecutive dp-then-cp indices j = dp * 2 + cp, at the same tp index: j = 0..3 is
    # (dp, cp) = (0, 0), (0, 1), (1, 0), (1, 1) -> ranks (dp * 2 + cp) * 2 + tp = 0, 2, 4, 6
    lay = Layout(dp=4, cp=2, tp=2, ep=4)
    assert lay.world == 16 and lay.ep == lay["ep"] == 4 and "ep" in lay
    assert lay.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert lay.stride("ep") == 2 and lay.span("ep") == 8  # t apart, 4 x 2 consecutive ranks
    assert dict(lay) == {"pp": 1, "dp": 4, "cp": 2, "tp": 2}  # the rank order's axes
    assert lay.sizes() == {**dict(lay), "ep": 4} and Layout(**lay.sizes()) == lay
    assert str(lay) == "t=2 x c=2 x d=4 e=4" and repr(lay) == "Layout(dp=4, cp=2, tp=2, ep=4)"
    assert lay != Layout(dp=4, cp=2, tp=2) and lay.with_(tp=1).ep == 4
    assert pickle.loads(pickle.dumps(lay)) == lay
    assert Layout(dp=2) == Layout(dp=2, ep=1) and hash(Layout(dp=2)) == hash(Layout(dp=2, ep=1))
    with pytest.raises(ValueError, match=r"ep = 3 does not divide d x c = 8"):
        Layout(dp=4, cp=2, ep=3)
