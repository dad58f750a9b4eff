"""The device mesh: the layout's groups as process groups, the same groups as torch's own."""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib.cost import Layout
from parlib.cost.layout import AXIS_NAMES, EP_OVER_TP, EP_PLACEMENTS
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


# ---- where ep lives: parlib's placement (dp x cp) and torchtitan's (dp x cp x tp)

def _shapes():
    for pp, dp, cp, tp in itertools.product((1, 2), (1, 2, 4), (1, 2), (1, 2, 4)):
        for borrows in EP_PLACEMENTS:
            block = math.prod({"dp": dp, "cp": cp, "tp": tp}[a] for a in borrows)
            for ep in range(2, block + 1):
                if block % ep == 0:
                    yield Layout(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, ep_borrows=borrows)


def _torchtitan_groups(layout):
    """Every rank's ep group as torchtitan's DeviceMesh recipe builds it, one fake
    process group per rank (no processes: the groups' ranks are all it reads)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    groups = []
    for rank in range(layout.world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
        try:
            mesh = M.torchtitan_ep_mesh(layout)
            groups.append(dist.get_process_group_ranks(mesh.get_group()))
        finally:
            dist.destroy_process_group()
    return groups


def test_layout_ep_groups_equal_torchtitans_over_many_shapes():
    compared = refused = 0
    for layout in _shapes():
        inner = math.prod(layout[a] for a in layout.ep_borrows if a != "dp")
        if layout.ep % inner:  # torchtitan takes whole cp (x tp) blocks only
            with pytest.raises(ValueError, match="must be a multiple of"):
                M.torchtitan_ep_mesh(layout)
            refused += 1
            continue
        want = _torchtitan_groups(layout)
        assert [layout.axis_ranks("ep", r) for r in range(layout.world)] == want, layout
        compared += 1
    assert compared > 100 and refused > 10


def test_the_two_placements_of_ep():
    # the issue's example: c = 2, t = 4, e = 2; rank 0's group [0, 4] in parlib's
    # placement, [0, 1] borrowing tp too (torchtitan would ask e to be a multiple of c x t)
    ours, titans = Layout(cp=2, tp=4, ep=2), Layout(cp=2, tp=4, ep=2, ep_borrows=EP_OVER_TP)
    assert ours.axis_ranks("ep", 0) == [0, 4] and titans.axis_ranks("ep", 0) == [0, 1]
    assert (ours.stride("ep"), ours.span("ep")) == (4, 8)  # t apart: across a 4-GPU node
    assert (titans.stride("ep"), titans.span("ep")) == (1, 2)  # consecutive: inside it
    assert ours.expert_replica_groups() == [[r] for r in range(8)]  # d x c / e = 1 copy
    assert titans.expert_replica_ranks(0) == [0, 2, 4, 6]  # d x c x t / e = 4 copies
    assert titans != ours and str(titans) == "t=4 x c=2 e=2 over d x c x t"
    assert pickle.loads(pickle.dumps(titans)) == titans and titans.with_(pp=2).ep_borrows \
        == EP_OVER_TP
    assert Layout(dp=2, ep_borrows=EP_OVER_TP) == Layout(dp=2)  # no ep: no placement
    with pytest.raises(ValueError, match=r"ep = 3 does not divide d x c x t = 8"):
        Layout(cp=2, tp=4, ep=3, ep_borrows=EP_OVER_TP)
    with pytest.raises(ValueError, match=r"ep = 4 does not divide d x c = 2.*pick ep from "
                                         r"\[1, 2\], or give dp x cp more ranks"):
        Layout(cp=2, tp=4, ep=4)
    with pytest.raises(ValueError, match=r"ep_borrows=\('tp',\).*pass one of them "
                                         r"\(parlib.cost.layout.EP_OVER_DP_CP or EP_OVER_TP"):
        Layout(tp=2, ep=2, ep_borrows=("tp",))


PLACED = [Layout(cp=2, tp=4, ep=2), Layout(cp=2, tp=4, ep=8, ep_borrows=EP_OVER_TP),
          Layout(dp=2, cp=2, tp=2, ep=4, ep_borrows=EP_OVER_TP), Layout(dp=4, tp=2, ep=2)]


def _placed_groups():
    out = []
    for layout in PLACED:
        mesh = M.Mesh(layout)
        x = torch.tensor([1.0], device=parlib.device())
        dist.all_reduce(x, group=mesh.expert_replica_group())
        out.append((mesh.ranks("ep"), M.torch_device_mesh_ranks(layout)["ep"],
                    mesh.expert_replica_ranks(), x.item(), mesh.coord("ep")))
    try:
        M.Mesh(dp=8).group("ep")
        out.append(None)
    except ValueError as e:  # no ep: no groups, and the error says how to get them
        out.append(str(e))
    return out


def test_mesh_builds_either_placement_as_torchtitan_does_on_real_ranks():
    results = parlib.launch(_placed_groups, world_size=8, timeout=300)
    for rank, (*per_layout, no_ep) in enumerate(results):
        assert "has no expert-parallel groups" in no_ep and "ep > 1" in no_ep
        for layout, (ours, titans, replicas, n, coord) in zip(PLACED, per_layout):
            assert ours == titans == layout.axis_ranks("ep", rank), (layout, rank)
            assert replicas == layout.expert_replica_ranks(rank) and n == len(replicas)
            assert coord == ours.index(rank)
