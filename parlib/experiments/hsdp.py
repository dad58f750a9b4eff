"""HSDP on ranks: :class:`parlib.FSDP` over a grid of shard groups (rows) and their copies
(columns), trained beside one device, with the bytes each axis sends counted apart."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from parlib.cost.sharded import hsdp_sent_bytes_per_step
from parlib.measure.traffic import axis_traffic
from parlib.model import ModelConfig, build_model, loss_fn, make_batch, make_optimizer
from parlib.runtime.policy import device as this_device
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP


def grid_groups(rows: list[list[int]]) -> tuple[Any, Any]:
    """This rank's shard group (its row) and replicate group (its column). Every rank
    creates every group, in the same order, as ``dist.new_group`` requires."""
    rank = dist.get_rank()
    columns = [list(c) for c in zip(*rows)]
    made = {tuple(r): dist.new_group(r) for r in [*rows, *columns]}
    return (made[tuple(next(r for r in rows if rank in r))],
            made[tuple(next(c for c in columns if rank in c))])


def hsdp_run(cfg: ModelConfig, batch: int, rows: list[list[int]], *, steps: int = 2,
             lr: float = 0.1) -> dict[str, Any]:
    """Every rank of the grid ``rows`` (each row a shard group) trains ``steps`` SGD steps
    on its rows of each batch (every rank starts from its own seed; FSDP broadcasts rank
    0's). Returns the full weights after, the bytes this rank sent per axis in the last
    step (``"dp_shard"``, ``"dp_replicate"``), the formula's
    (:func:`parlib.cost.sharded.hsdp_sent_bytes_per_step` on the padded shards) and the
    rank's two groups."""
    shard, copies = grid_groups(rows)
    rank, world, dev = dist.get_rank(), dist.get_world_size(), this_device()
    net = FSDP(build_model(cfg, seed=rank).to(dev), group=shard, replicate_group=copies)
    opt = make_optimizer(net.parameters(), "sgd", lr)
    for step in range(steps):
        x, y = (shard_rows(t, rank, world).to(dev) for t in make_batch(batch, cfg, step, 0))
        with axis_traffic({"dp_shard": shard, "dp_replicate": copies}) as counts:
            loss_fn(net(x), y).backward()
            net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    padded = sum(u.total for u in net.units) * net.world_size
    return {"params": {k: v.cpu() for k, v in net.gather_full_params().items()},
            "sent": {axis: c["sent_bytes"] for axis, c in counts.items()},
            "formula": hsdp_sent_bytes_per_step(padded, net.world_size, net.replicas),
            "groups": {"dp_shard": dist.get_process_group_ranks(shard),
                       "dp_replicate": dist.get_process_group_ranks(copies)}}


__all__ = ["grid_groups", "hsdp_run"]
