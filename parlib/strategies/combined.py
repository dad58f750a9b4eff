"""Data x tensor x pipeline parallelism at once (3-D parallelism), on a :class:`Mesh`.

Each rank holds one pipeline stage's layers (pp), with those layers' matrices split over
its tensor-parallel group (tp), and is one of d copies that see different rows of the
batch (dp). One training step:

1. take this data-parallel rank's B/d rows of the batch;
2. run the stage's 1F1B schedule over m microbatches, sending activations and their
   gradients to the neighbouring stages (``mesh.pp_prev`` / ``mesh.pp_next``), with the
   tensor-parallel all-reduces inside every layer (over ``mesh.group("tp")``);
3. average the gradients over ``mesh.group("dp")``, then step the optimizer.

Every piece is an earlier chapter's, handed its group: :func:`build_3d` cuts a
:class:`~parlib.strategies.pipeline.Stage` and splits its blocks with
:func:`~parlib.strategies.tensor.tensor_parallel_block`; :func:`train_step_3d` runs
:func:`~parlib.strategies.pipeline.run_schedule` and
:func:`~parlib.strategies.data.allreduce_gradients`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.model import ModelConfig, build_model
from parlib.strategies.data import allreduce_gradients, shard_rows
from parlib.strategies.mesh import Mesh
from parlib.strategies.pipeline import PipelineHooks, Stage, run_schedule
from parlib.strategies.schedules import one_f_one_b
from parlib.strategies.tensor import tensor_parallel_block


def build_3d(mesh: Mesh, cfg: ModelConfig | None = None, seed: int = 0,
             device: Any = None) -> Stage:
    """This rank's part of ``build_model(cfg, seed)``: stage ``mesh.coord("pp")`` of
    ``mesh.pp`` (peers ``mesh.pp_prev`` / ``mesh.pp_next``), its blocks split over
    ``mesh.group("tp")``. Every rank builds the whole tiny model and keeps its part."""
    cfg = cfg or ModelConfig()
    if cfg.n_layers % mesh.pp:
        raise ValueError(f"pp={mesh.pp} does not divide the model's {cfg.n_layers} layers")
    stage = Stage(build_model(cfg, seed), mesh.coord("pp"), mesh.pp, mesh.pp_prev,
                  mesh.pp_next, mesh.group("pp"))
    if mesh.tp > 1:
        # Same attribute names, so Stage's local-to-global parameter names still hold.
        stage.blocks = nn.ModuleList(tensor_parallel_block(b, mesh.group("tp"))
                                     for b in stage.blocks)
    return stage.to(device) if device is not None else stage


def train_step_3d(stage: Stage, mesh: Mesh, optimizer: torch.optim.Optimizer,
                  tokens: torch.Tensor, targets: torch.Tensor, m: int, *,
                  hooks: PipelineHooks | None = None,
                  sync: Callable[[], Any] | None = None,
                  mean_loss: bool = True) -> float | None:
    """One 3-D step on the global batch (tokens, targets): this dp rank's rows, 1F1B over
    m microbatches, gradients averaged over the dp group, optimizer step. Returns the
    global batch's mean loss on the last stage's ranks, None on the others.

    ``hooks``: handed to :func:`run_schedule` (``parlib.experiments`` records and pads with them).
    ``sync``: pools the gradients instead of one all-reduce per parameter (for example a
    :class:`~parlib.strategies.data.Bucketed` over ``mesh.group("dp")``).
    ``mean_loss=False`` skips the loss's all-reduce and returns this rank's own loss."""
    optimizer.zero_grad(set_to_none=True)
    x = shard_rows(tokens, mesh.coord("dp"), mesh.dp)
    y = shard_rows(targets, mesh.coord("dp"), mesh.dp)
    ops = one_f_one_b(mesh.pp, m, mesh.coord("pp"))
    loss = run_schedule(stage, ops, x, y, m, hooks=hooks)
    if sync is not None:
        sync()
    else:
        allreduce_gradients(stage, group=mesh.group("dp"))
    optimizer.step()
    if loss is None or not mean_loss:
        return loss
    total = torch.tensor([loss], device=next(stage.parameters()).device)
    dist.all_reduce(total, group=mesh.group("dp"))  # the mean of d equal-sized means
    return total.item() / mesh.dp


__all__ = ["build_3d", "train_step_3d"]
