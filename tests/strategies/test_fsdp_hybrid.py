"""HSDP: parlib.FSDP with a shard group and a replicate group, on 4 ranks as a 2 x 2 mesh.

Two meshes: shard groups of consecutive ranks ([0, 1], [2, 3]; copies [0, 2], [1, 3]) and
strided ones ([0, 2], [1, 3]; copies [0, 1], [2, 3]), both built as torch's DeviceMesh
("replicate", "shard") so that ours and FSDP2 (``fully_shard(..., mesh=mesh)``) use the
same groups. Every rank starts from a different seed (ours broadcasts rank 0's weights;
FSDP2 does not, so it starts from seed 0 everywhere). After three Adam steps on this rank's
quarter of each batch: ours equals one device by verify's rule and FSDP2 to the same rule;
the bytes counted on each axis equal :func:`parlib.cost.sharded.hsdp_sent_bytes_per_step`.
Groups that do not form a grid, and a rank outside a group, are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import verify
from parlib.cost.sharded import hsdp_sent_bytes_per_step
from parlib.measure.traffic import axis_traffic
from parlib.model import ModelConfig, build_model, loss_fn, make_batch
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP

CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
STEPS, BATCH, WORLD = 3, 8, 4
ADAM = {"lr": 1e-2, "eps": 1e-4}  # eps: see tests/strategies/test_sharded.py
MESHES = {"consecutive": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]]}  # rows: shard groups


def _mesh(rows: list[list[int]]):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.tensor(rows), mesh_dim_names=("replicate", "shard"))


def _wrap(kind: str, mesh) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = build_model(CFG, seed=0)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    model = build_model(CFG, seed=dist.get_rank())  # ours broadcasts rank 0's (seed 0)
    return FSDP(model, group=mesh.get_group("shard"), replicate_group=mesh.get_group("replicate"))


def _train(kind: str, rows: list[list[int]]) -> dict:
    mesh = _mesh(rows)
    groups = {"dp_shard": mesh.get_group("shard"), "dp_replicate": mesh.get_group("replicate")}
    net = _wrap(kind, mesh)
    opt = torch.optim.Adam(net.parameters(), **ADAM)
    rank = dist.get_rank()
    for step in range(STEPS):
        x, y = (shard_rows(t, rank, WORLD) for t in make_batch(BATCH, CFG, step, 0))
        with axis_traffic(groups) as counts:
            loss_fn(net(x), y).backward()
            if isinstance(net, FSDP):
                net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    res = {"sent": {axis: c["sent_bytes"] for axis, c in counts.items()},
           "groups": {axis: dist.get_process_group_ranks(g) for axis, g in groups.items()}}
    if isinstance(net, FSDP):
        res["params"] = net.gather_full_params()
        res["padded"] = sum(u.total for u in net.units) * net.world_size
        res["shape"] = (net.replicas, net.world_size)
    else:
        res["params"] = {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}
    return res


def _refusal(make) -> str:
    try:
        make()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def _refusals() -> dict:
    """Each rank's error for groups that do not form a grid, and for a rank outside one."""
    rank, model = dist.get_rank(), build_model(CFG, seed=0)
    rows = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    crossed = [dist.new_group(r) for r in ([0, 3], [1, 2])]  # rank 0 first, rank 3 second
    only_even = dist.new_group([0, 2])
    mine = rows[rank // 2]
    out = {"same group": _refusal(lambda: FSDP(model, group=mine, replicate_group=mine)),
           "not a grid": _refusal(lambda: FSDP(model, group=mine,
                                               replicate_group=crossed[rank in (1, 2)]))}
    columns = [dist.new_group(c) for c in ([0, 2], [1, 3])]
    out["off the grid"] = _refusal(lambda: FSDP(model, group=mine,
                                                replicate_group=columns[rank % 2],
                                                broadcast_from=WORLD))
    if rank % 2:  # only the ranks outside the group try: the others would wait for them
        out["outside"] = _refusal(lambda: FSDP(model, group=mine, replicate_group=only_even))
    return out


def _all_runs() -> dict:
    out = {(kind, name): _train(kind, rows)
           for name, rows in MESHES.items() for kind in ("ours", "fsdp2")}
    out["refusals"] = _refusals()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return parlib.launch(_all_runs, world_size=WORLD, timeout=600)


@pytest.fixture(scope="module")
def one_device() -> dict[str, torch.Tensor]:
    return verify.reference_run(CFG, steps=STEPS, batch=BATCH,
                                optimizer=lambda ps: torch.optim.Adam(ps, **ADAM)).params


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("kind", ["ours", "fsdp2"])
def test_three_steps_equal_one_device(results, one_device, kind, mesh):
    for rank, res in enumerate(results):
        cmp = verify.compare(res[(kind, mesh)]["params"], one_device)
        assert cmp, f"{kind} on the {mesh} mesh, rank {rank}: {cmp}"


@pytest.mark.parametrize("mesh", MESHES)
def test_ours_equals_fsdp2_on_the_same_mesh(results, mesh):
    for res in results:
        ours, theirs = res[("ours", mesh)], res[("fsdp2", mesh)]
        assert ours["groups"] == theirs["groups"]
        cmp = verify.compare(ours["params"], theirs["params"])
        assert cmp, f"{mesh}: {cmp}"


@pytest.mark.parametrize("mesh", MESHES)
def test_groups_are_the_mesh_rows_and_columns(results, mesh):
    rows = MESHES[mesh]
    for rank, res in enumerate(results):
        groups = res[("ours", mesh)]["groups"]
        assert groups["dp_shard"] == next(r for r in rows if rank in r)
        assert groups["dp_replicate"] == next(list(c) for c in zip(*rows) if rank in c)
        assert res[("ours", mesh)]["shape"] == (2, 2)


@pytest.mark.parametrize("mesh", MESHES)
def test_bytes_per_axis_equal_the_formula(results, mesh):
    """Gathers and reduce-scatters inside the shard group, one all-reduce of the half
    gradient across the copies: measured per axis on every rank, equal to the formula."""
    for res in results:
        ours = res[("ours", mesh)]
        want = hsdp_sent_bytes_per_step(ours["padded"], 2, 2)
        assert ours["sent"] == pytest.approx(want, rel=1e-12)
        assert want["dp_shard"] > 0 and want["dp_replicate"] > 0


def test_groups_that_are_not_a_grid_or_leave_a_rank_out_are_refused(results):
    for rank, res in enumerate(results):
        got = res["refusals"]
        assert got["same group"].startswith("ValueError") and "share ranks" in got["same group"]
        assert "position in the shard group differs" in got["not a grid"], got["not a grid"]
        assert f"broadcast_from={WORLD} is in none of the shard groups [[0, 1], [2, 3]]: " \
               "pass a global rank of the grid" in got["off the grid"], got["off the grid"]
        if rank % 2:
            want = f"FSDP (replicate_group=): global rank {rank} is not a member of the group"
            assert want in got["outside"], got["outside"]
