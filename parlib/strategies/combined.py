"""Pipeline, data, context, tensor and expert parallelism at once, on a :class:`Mesh`.

Each rank holds one pipeline stage's layers (pp), with those layers' matrices split over
its tensor-parallel group (tp), its share of every sequence (cp: the context-parallel
chapter's split, zig-zag by default), and is one of d copies that see different rows of
the batch (dp). In a mixture-of-experts model each MoE layer keeps only this rank's
experts of its expert-parallel group (ep, which borrows the dp x cp ranks, as
:class:`~parlib.cost.Layout` places it). One training step:

1. take this data-parallel rank's B/d rows of the batch and this context-parallel rank's
   positions of them;
2. run the stage's schedule (1F1B by default) over m microbatches, sending activations and
   their gradients to the neighbouring stages (``mesh.pp_prev`` / ``mesh.pp_next``); inside
   every layer the tensor-parallel all-reduces run over ``mesh.group("tp")``, ring
   attention passes K/V blocks of this rank's heads round ``mesh.group("cp")``, and each
   MoE layer's all-to-alls run over ``mesh.group("ep")``;
3. average the gradients (:class:`MeshGradientSync`), then step the optimizer.

Every piece is an earlier chapter's, handed its group: :func:`build_nd` cuts a
:class:`~parlib.strategies.pipeline.Stage`, splits its blocks with
:func:`~parlib.strategies.tensor.tensor_parallel_block`, wraps their attention in the
context-parallel chapter's ring and their MoE in
:class:`~parlib.strategies.experts.ExpertParallelMoE`; :func:`train_step_nd` runs
:func:`~parlib.strategies.pipeline.run_schedule`. :func:`build_3d` / :func:`train_step_3d`
are the same on a mesh without cp and ep (the combining chapter's 3-D runs).

A mixture of experts is not split over tp: every tensor-parallel rank runs the whole MoE
layer on the same tokens, and its ep group (the ranks of its tp index) dispatches them
(Megatron-LM's expert_tensor_parallel_size = 1 without its token split over tp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.model import ModelConfig, build_model
from parlib.strategies import tensor_ops
from parlib.strategies.context import (
    ContextParallelAttention,
    ContextParallelEmbed,
    sequence_positions,
    split_sequence,
)
from parlib.strategies.data import Bucketed, shard_rows
from parlib.strategies.experts import ExpertParallelMoE, is_expert_parameter
from parlib.strategies.mesh import Mesh
from parlib.strategies.pipeline import PipelineHooks, Stage, run_schedule
from parlib.strategies.schedules import schedule as schedule_ops
from parlib.strategies.tensor import tensor_parallel_block

SCHEDULES = ("gpipe", "1f1b", "zb-h1")  # one chunk per rank: what a Stage runs


class TensorContextAttention(ContextParallelAttention):
    """Attention with its heads split over tp and its sequence over cp: this rank's heads
    (column-parallel q, k, v behind one f; row-parallel out, whose g sums the heads) attend
    by ring over the cp group, on this rank's positions. ``tp_group`` None: all heads."""

    def __init__(self, attn: nn.Module, tp_group: Any, cp_group: Any,
                 layout: str = "zigzag") -> None:
        super().__init__(attn, cp_group, layout, "ring")
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:  # f: identity forward, all-reduce of the grad backward
            x = tensor_ops.copy_to_tensor_parallel_region(x, self.tp_group)
        return super().forward(x)


def _check_mesh(mesh: Mesh, cfg: ModelConfig, sequence_layout: str) -> None:
    if cfg.n_layers % mesh.pp:
        fits = [p for p in range(1, cfg.n_layers + 1) if cfg.n_layers % p == 0]
        raise ValueError(f"pp={mesh.pp} does not divide the model's {cfg.n_layers} layers: "
                         f"pick pp from {fits} (equal stages)")
    if mesh.ep > 1 and not cfg.n_experts:
        raise ValueError(f"ep={mesh.ep} splits experts, but the model is dense: build it "
                         f"with ModelConfig(n_experts=E, ...)")
    layout = getattr(mesh, "layout", mesh)  # a Mesh, or a bare Layout in the tests
    if mesh.ep > 1 and mesh.tp > 1 and "tp" in layout.ep_borrows:
        raise ValueError(f"{layout!r}: build_nd runs each MoE layer whole on every tp rank, "
                         f"on the same tokens, so ep cannot borrow the tp ranks (they would "
                         f"send their experts the same tokens twice); leave ep_borrows at "
                         f"its default, ep over dp x cp")
    if mesh.ep > 1 and mesh.ep not in (mesh.cp, mesh.dp * mesh.cp):
        raise ValueError(f"ep={mesh.ep}: build_nd places ep over the cp ranks (ep = cp = "
                         f"{mesh.cp}) or over all dp x cp ranks (ep = {mesh.dp * mesh.cp}), "
                         f"where an expert's copies are the dp group or none")
    if mesh.cp > 1:  # raises ValueError naming the sizes if the sequence does not split
        sequence_positions(0, mesh.cp, cfg.seq_len, sequence_layout)


def build_nd(mesh: Mesh, cfg: ModelConfig | None = None, seed: int = 0, device: Any = None,
             *, sequence_layout: str = "zigzag") -> Stage:
    """This rank's part of ``build_model(cfg, seed)``: stage ``mesh.coord("pp")`` of
    ``mesh.pp``, its blocks split over ``mesh.group("tp")``, its attention a ring over
    ``mesh.group("cp")`` on this rank's positions (``sequence_layout``: "zigzag" or
    "contiguous"), its MoE layers' experts split over ``mesh.group("ep")``. Every rank
    builds the whole tiny model and keeps its part; parameter names stay the model's."""
    cfg = cfg or ModelConfig()
    _check_mesh(mesh, cfg, sequence_layout)
    stage = Stage(build_model(cfg, seed), mesh.coord("pp"), mesh.pp, mesh.pp_prev,
                  mesh.pp_next, mesh.group("pp"))
    # Same attribute names, so Stage's local-to-global parameter names still hold.
    stage.blocks = nn.ModuleList(_split_block(b, mesh, sequence_layout) for b in stage.blocks)
    if mesh.cp > 1:
        if stage.embed is not None:
            stage.embed = ContextParallelEmbed(stage.embed, sequence_positions(
                mesh.coord("cp"), mesh.cp, cfg.seq_len, sequence_layout))
        stage.row_shape = (cfg.seq_len // mesh.cp, cfg.d_model)  # what crosses a boundary
    return stage.to(device) if device is not None else stage


def _split_block(block: nn.Module, mesh: Mesh, sequence_layout: str) -> nn.Module:
    tp_group = mesh.group("tp") if mesh.tp > 1 else None
    if tp_group is not None:
        block = tensor_parallel_block(block, tp_group)
    if mesh.cp > 1:
        block.attn = TensorContextAttention(block.attn, tp_group, mesh.group("cp"),
                                            sequence_layout)
    if mesh.ep > 1:
        block.mlp = ExpertParallelMoE.from_moe(block.mlp, mesh.group("ep"))
    return block


def build_3d(mesh: Mesh, cfg: ModelConfig | None = None, seed: int = 0,
             device: Any = None) -> Stage:
    """:func:`build_nd` on a pp x dp x tp mesh: stage ``mesh.coord("pp")`` of ``mesh.pp``
    (peers ``mesh.pp_prev`` / ``mesh.pp_next``), its blocks split over
    ``mesh.group("tp")``. Every rank builds the whole tiny model and keeps its part."""
    return build_nd(mesh, cfg, seed, device)


class MeshGradientSync:
    """The gradients of this rank's stage made those of the whole batch's mean loss, after
    the step's last backward. Every rank's loss is the mean over its own rows and
    positions, equal shares, so the whole loss's gradient is the mean over the d x c ranks:

    - a shared parameter (all of a dense model; attention, norms, router, embeddings of an
      MoE) is averaged over ``mesh.group("dp")``, then over ``mesh.group("cp")``;
    - an expert's gradient already sums the contributions of its ep group's tokens (they
      came back through the all-to-all): summed over its copies (the dp group when ep = c,
      none when ep = d x c), then divided by d x c.

    Each group's parameters go in the data-parallel chapter's buckets (:class:`Bucketed`,
    DDP's sizes by default): one all-reduce per bucket."""

    def __init__(self, stage: nn.Module, mesh: Mesh, bucket_mb: float = 25.0,
                 first_bucket_mb: float | None = 1.0) -> None:
        named = list(stage.named_parameters())
        split = mesh.ep > 1
        experts = [p for n, p in named if split and is_expert_parameter(n)]
        shared = [p for n, p in named if not (split and is_expert_parameter(n))]
        copies_on_dp = mesh.ep == mesh.cp and mesh.dp > 1
        sizes = {"bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb}
        on_dp = shared + (experts if copies_on_dp else [])
        self.buckets = [Bucketed(ps, group=mesh.group(axis), **sizes)
                        for axis, ps, n in (("dp", on_dp, mesh.dp), ("cp", shared, mesh.cp))
                        if n > 1 and ps]
        # what the buckets leave undivided: the dp average divided experts by d (or nothing)
        self.experts = experts
        self.expert_divisor = mesh.cp if copies_on_dp else mesh.dp * mesh.cp

    def __call__(self) -> None:
        for bucketed in self.buckets:
            bucketed.sync()
        for p in self.experts:
            if p.grad is not None:
                p.grad /= self.expert_divisor


def train_step_nd(stage: Stage, mesh: Mesh, optimizer: torch.optim.Optimizer,
                  tokens: torch.Tensor, targets: torch.Tensor, m: int, *,
                  schedule: str = "1f1b", sequence_layout: str = "zigzag",
                  hooks: PipelineHooks | None = None,
                  sync: Callable[[], Any] | None = None,
                  mean_loss: bool = True) -> float | None:
    """One step on the global batch (tokens, targets): this dp rank's rows, this cp rank's
    positions of them (``sequence_layout``, as :func:`build_nd` was given), ``schedule``
    (one of :data:`SCHEDULES`) over m microbatches, gradients averaged
    (:class:`MeshGradientSync`), optimizer step. Returns the global batch's mean loss on
    the last stage's ranks, None on the others.

    ``hooks``: handed to :func:`run_schedule` (``parlib.experiments`` records and pads
    with them). ``sync``: the gradient sync (default: a :class:`MeshGradientSync` made
    for this step; make one once and pass it). ``mean_loss=False`` skips the loss's
    all-reduces and returns this rank's own loss."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: a stage of build_nd runs one of "
                         f"{', '.join(SCHEDULES)} (one chunk per rank)")
    optimizer.zero_grad(set_to_none=True)
    x = shard_rows(tokens, mesh.coord("dp"), mesh.dp)
    y = shard_rows(targets, mesh.coord("dp"), mesh.dp)
    if mesh.cp > 1:
        x, y = (split_sequence(t, mesh.group("cp"), sequence_layout) for t in (x, y))
    ops = schedule_ops(schedule, mesh.pp, m, mesh.coord("pp"))
    loss = run_schedule(stage, ops, x, y, m, hooks=hooks)
    (sync or MeshGradientSync(stage, mesh))()
    optimizer.step()
    if loss is None or not mean_loss:
        return loss
    total = torch.tensor([loss], device=next(stage.parameters()).device)
    for axis in ("dp", "cp"):  # the mean of d x c equal-sized means
        if mesh.size(axis) > 1:
            dist.all_reduce(total, group=mesh.group(axis))
    return total.item() / (mesh.dp * mesh.cp)


def train_step_3d(stage: Stage, mesh: Mesh, optimizer: torch.optim.Optimizer,
                  tokens: torch.Tensor, targets: torch.Tensor, m: int, *,
                  hooks: PipelineHooks | None = None,
                  sync: Callable[[], Any] | None = None,
                  mean_loss: bool = True) -> float | None:
    """:func:`train_step_nd` with 1F1B on a pp x dp x tp mesh: this dp rank's rows, 1F1B
    over m microbatches, gradients averaged over the dp group, optimizer step. Returns the
    global batch's mean loss on the last stage's ranks, None on the others.

    ``sync``: pools the gradients instead (for example a
    :class:`~parlib.strategies.data.Bucketed` over ``mesh.group("dp")``).
    ``mean_loss=False`` skips the loss's all-reduce and returns this rank's own loss."""
    return train_step_nd(stage, mesh, optimizer, tokens, targets, m, hooks=hooks, sync=sync,
                         mean_loss=mean_loss)


__all__ = ["MeshGradientSync", "SCHEDULES", "TensorContextAttention", "build_3d", "build_nd",
           "train_step_3d", "train_step_nd"]
