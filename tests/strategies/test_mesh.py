"""The device mesh: rank order, groups, pipeline peers; the same groups as torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib.strategies import mesh as M

LAYOUTS = [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1)]  # (d, t, p)


def test_rank_order_tp_fastest_pp_slowest():
    # (p, d, t) = (2, 2, 2): rank = (pp * d + dp) * t + tp
    assert M.coords(0, dp=2, pp=2, tp=2) == {"pp": 0, "dp": 0, "tp": 0}
    assert M.coords(1, dp=2, pp=2, tp=2) == {"pp": 0, "dp": 0, "tp": 1}
    assert M.coords(2, dp=2, pp=2, tp=2) == {"pp": 0, "dp": 1, "tp": 0}
    assert M.coords(4, dp=2, pp=2, tp=2) == {"pp": 1, "dp": 0, "tp": 0}
    assert M.coords(11, dp=3, pp=2, tp=2) == {"pp": 1, "dp": 2, "tp": 1}


@pytest.mark.parametrize("d,t,p", LAYOUTS + [(3, 2, 2), (2, 1, 3)])
def test_groups_partition_the_world_and_round_trip(d, t, p):
    n = d * t * p
    for axis, size in (("dp", d), ("tp", t), ("pp", p)):
        groups = M.all_groups(axis, dp=d, pp=p, tp=t)
        assert len(groups) == n // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(n))
    for r in range(n):
        c = M.coords(r, dp=d, pp=p, tp=t)
        assert M.rank_at(dp=d, pp=p, tp=t, coord=c) == r
        tp_group = M.axis_ranks("tp", r, dp=d, pp=p, tp=t)
        assert tp_group == list(range(r - c["tp"], r - c["tp"] + t))  # adjacent ranks
        pp_group = M.axis_ranks("pp", r, dp=d, pp=p, tp=t)
        assert pp_group == [r + (i - c["pp"]) * d * t for i in range(p)]
        prev, nxt = M.pipeline_neighbours(r, dp=d, pp=p, tp=t)
        assert prev == (r - d * t if c["pp"] > 0 else None)
        assert nxt == (r + d * t if c["pp"] < p - 1 else None)


def test_bad_sizes_and_axes_are_named():
    with pytest.raises(ValueError, match="outside a mesh of 8"):
        M.coords(8, dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match="tp=0"):
        M.coords(0, dp=2, pp=2, tp=0)
    with pytest.raises(ValueError, match="unknown mesh axis 'cp'"):
        M.axis_ranks("cp", 0, dp=2, pp=2, tp=2)
    with pytest.raises(RuntimeError, match="inside parlib.launch"):
        M.Mesh(dp=1, pp=1, tp=1)


def _mesh_on_ranks(layouts):
    out = []
    for d, t, p in layouts:
        mesh = M.Mesh(dp=d, pp=p, tp=t)
        ours = {a: mesh.ranks(a) for a in M.AXES}
        groups = {a: dist.get_process_group_ranks(mesh.group(a)) for a in M.AXES}
        torch_ranks = M.torch_device_mesh_ranks(dp=d, pp=p, tp=t)
        # the groups really work: an all-reduce over tp sums the tp coordinates
        x = torch.tensor([float(mesh.coord("tp"))], device=parlib.device())
        dist.all_reduce(x, group=mesh.group("tp"))
        out.append({"ours": ours, "groups": groups, "torch": torch_ranks,
                    "coord": {a: mesh.coord(a) for a in M.AXES},
                    "peers": (mesh.pp_prev, mesh.pp_next), "tp_sum": x.item()})
    try:
        M.Mesh(dp=3, pp=2, tp=2)
        wrong = None
    except ValueError as e:
        wrong = str(e)
    return out, wrong


def test_mesh_groups_equal_init_device_mesh():
    results = parlib.launch(_mesh_on_ranks, LAYOUTS, world_size=8, timeout=300)
    for rank, (per_layout, wrong) in enumerate(results):
        assert "must equal the world size" in wrong
        for (d, t, p), got in zip(LAYOUTS, per_layout):
            assert got["ours"] == got["torch"] == got["groups"]
            assert got["coord"] == M.coords(rank, dp=d, pp=p, tp=t)
            assert got["peers"] == M.pipeline_neighbours(rank, dp=d, pp=p, tp=t)
            assert got["tp_sum"] == sum(range(t))
