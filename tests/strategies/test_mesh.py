"""The device mesh: the layout's groups as process groups, the same groups as torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib.cost import Layout
from parlib.cost.layout import AXIS_NAMES
from parlib.strategies import mesh as M

LAYOUTS = [Layout(dp=2, tp=2, pp=2), Layout(tp=2, pp=4), Layout(dp=4, pp=2), Layout(dp=2, tp=4)]


def test_mesh_needs_ranks_and_one_way_to_give_the_layout():
    with pytest.raises(RuntimeError, match=r"Mesh needs torch.distributed.*\(parlib.launch"):
        M.Mesh(dp=1, pp=1, tp=1)
    with pytest.raises(ValueError, match="not both"):
        M.Mesh(Layout(dp=2), tp=2)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        M.Mesh(xp=2)


def _mesh_on_ranks(layouts):
    out = []
    for layout in layouts:
        mesh = M.Mesh(layout)
        sugar = M.Mesh(**dict(layout))  # keyword sugar: the same layout, the same groups
        ours = {a: mesh.ranks(a) for a in AXIS_NAMES}
        groups = {a: dist.get_process_group_ranks(mesh.group(a)) for a in AXIS_NAMES}
        torch_ranks = M.torch_device_mesh_ranks(layout)
        # the groups really work: an all-reduce over tp sums the tp coordinates
        x = torch.tensor([float(mesh.coord("tp"))], device=parlib.device())
        dist.all_reduce(x, group=mesh.group("tp"))
        out.append({"ours": ours, "groups": groups, "torch": torch_ranks,
                    "sugar": {a: sugar.ranks(a) for a in AXIS_NAMES},
                    "coord": {a: mesh.coord(a) for a in AXIS_NAMES},
                    "sizes": {a: (mesh.size(a), getattr(mesh, a)) for a in AXIS_NAMES},
                    "layout": mesh.layout, "describe": mesh.describe(),
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
        assert "12 ranks, but the world has 8" in wrong
        for layout, got in zip(LAYOUTS, per_layout):
            assert got["ours"] == got["torch"] == got["groups"] == got["sugar"]
            assert got["layout"] == layout
            assert got["coord"] == layout.coords(rank)
            assert got["sizes"] == {a: (n, n) for a, n in layout.items()}
            assert got["peers"] == layout.pipeline_neighbours(rank)
            assert got["tp_sum"] == sum(range(layout.tp))
            assert got["describe"].startswith(f"rank {rank}: pp={got['coord']['pp']} ")


def _ep_groups():
    mesh = M.Mesh(dp=4, ep=2)
    return mesh.ranks("ep"), mesh.coord("ep"), mesh.size("ep"), mesh.ep, mesh.ranks("dp")


def test_mesh_builds_the_expert_parallel_groups_it_borrows_from_dp():
    # ep = 2 inside d = 4: the groups are the layout's (parlib.cost.Layout.groups("ep"))
    want = Layout(dp=4, ep=2).groups("ep")
    results = parlib.launch(_ep_groups, world_size=4, timeout=120)
    for rank, (ranks, coord, size, ep, dp) in enumerate(results):
        assert ranks in want and rank in ranks
        assert coord == ranks.index(rank) and size == ep == 2
        assert dp == [0, 1, 2, 3]
