"""How each rank's tensors are described to DCP for :mod:`parlib.strategies.checkpoint`:
which tensors a rank holds under which names, and which piece of the whole each is.

**How each shard is described to DCP, and why that way.** Every sharded state in the course
splits a flat vector the same way: ``parlib.FSDP`` each trainable parameter, flattened;
``Zero1`` and ``Zero2`` the concatenation of their parameters (one ``FlatShard`` per group);
with S = ceil(numel / N), rank r holds elements [r x S, (r + 1) x S), padded with zeros past
the end, so the last ranks hold fewer real elements, or none. That is exactly the split of a
``DTensor`` sharded on dimension 0 over a 1-D mesh of the N ranks (``torch.chunk``'s rule).
So each shard is given to DCP as ``DTensor.from_local(shard[:real], mesh, [Shard(0)],
shape=(numel,))``: a view of the live tensor, no copy, nothing communicated, and DCP's own
planners record which rank holds which slice and, at load, read for each rank the slices its
new shard needs from whichever files hold them: resharding for free. The alternatives are
more code: ``ShardedTensor`` is deprecated in favour of DTensor (used only where DTensor
cannot say it, below), and a custom planner would rewrite what DCP's default one does.
Tensors held whole (a plain model, the weights under ``Zero1``, FSDP's replicated and frozen
parameters, buffers, Adam's step) are plain tensors: DCP writes one copy of each.

Every tensor is saved **flat**, under the unwrapped model's parameter names (a pipeline
``Stage``'s or ``ChunkedStage``'s under the full model's, so p = 4 stages load into p = 2),
so the same checkpoint loads into a plain model with a plain optimizer, ``DataParallel``,
``FSDP`` at any world size, pipeline stages or a tensor-parallel model. ``Zero1``'s and
``Zero2``'s optimizer state is keyed by flat vector (``optim.flat<i>.exp_avg``): it
reshards across world sizes of the same strategy.

Tensor parallelism (``TensorParallelGPT``) fits the same flat keys: a column-parallel
piece (rows [r x o/t, (r + 1) x o/t)) is a range of the flat vector, the DTensor split above;
a row-parallel weight's piece (columns [r x i/t, (r + 1) x i/t)) is one run of i/t elements
in each of the o rows, a stride apart, which no DTensor placement of a flat vector says. It
is given to DCP as a ``ShardedTensor`` with one local shard per row
(:class:`RowsOfColumnsPiece`): deprecated in favour of DTensor, but the one description DCP
takes of several pieces per rank. Each row is a write and a read of its own, so a
row-parallel weight costs DCP o items per rank where FSDP's costs one (why torch's FSDP2
shards dimension 0). Keys of the tensors' own shapes would instead need FSDP's flat piece of
a matrix described as up to three boxes (a partial row, whole rows, a partial row).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parlib.strategies.data_parallel import DataParallel
from parlib.strategies.fsdp import FSDP
from parlib.strategies.pipeline import ChunkedStage, Stage
from parlib.strategies.tensor import TensorParallelGPT, split_dims
from parlib.strategies.zero import FlatShard


@dataclass(frozen=True)
class FlatPiece:
    """How one rank's tensor maps onto a global flat vector of ``numel`` elements: whole
    (``mesh`` None) or piece ``mesh.get_local_rank()`` of ``mesh.size()``, padded to
    S = ceil(numel / N) elements."""

    numel: int
    mesh: DeviceMesh | None = None

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """What DCP saves from and loads into: a flat view of ``local`` (its real elements,
        as a DTensor when sharded), sharing its storage."""
        try:
            flat = local.detach().view(-1)
        except RuntimeError as err:
            raise ValueError(f"checkpoint: a tensor of shape {tuple(local.shape)} is not "
                             "contiguous; DCP loads into a flat view of it") from err
        if self.mesh is None:
            return flat
        size = math.ceil(self.numel / self.mesh.size())
        real = max(0, min(size, self.numel - self.mesh.get_local_rank() * size))
        return DTensor.from_local(flat[:real], self.mesh, [Shard(0)], run_check=False,
                                  shape=(self.numel,), stride=(1,))


@dataclass(frozen=True)
class RowsOfColumnsPiece:
    """A tensor-parallel row-parallel weight's piece: columns [r x c, (r + 1) x c) of an
    (rows, t x c) matrix, in the flat vector ``rows`` runs of c elements, one per row, a
    stride apart. DTensor cannot say that of a flat vector; a ``ShardedTensor`` with one
    local shard per row (views of this rank's rows) can."""

    rows: int
    columns: int  # this rank's
    group: Any

    @property
    def numel(self) -> int:
        """The whole matrix's elements."""
        return self.rows * self.columns * dist.get_world_size(self.group)

    def view(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard as LocalShard
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import (
            ShardedTensorMetadata,
            TensorProperties,
        )

        rank, t = dist.get_rank(self.group), dist.get_world_size(self.group)
        width, device = self.columns * t, local.device.type
        owners = dist.get_process_group_ranks(self.group or dist.group.WORLD)  # global ranks
        boxes = [[ShardMetadata([i * width + r * self.columns], [self.columns],
                                f"rank:{owners[r]}/{device}") for i in range(self.rows)]
                 for r in range(t)]
        mine = local.detach().view(self.rows, self.columns)
        metadata = ShardedTensorMetadata([b for per_rank in boxes for b in per_rank],
                                         torch.Size([self.rows * width]),
                                         TensorProperties(dtype=local.dtype))
        return ShardedTensor._init_from_local_shards_and_global_metadata(  # noqa: SLF001
            [LocalShard(mine[i], boxes[rank][i]) for i in range(self.rows)], metadata,
            process_group=self.group)


@contextlib.contextmanager
def sharded_tensors_quiet() -> Iterator[None]:
    """ShardedTensor (:class:`RowsOfColumnsPiece`) warns of its deprecation at every torch
    call DCP makes on it; DTensor cannot describe those pieces, so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead",
                                category=FutureWarning)
        yield


def _mesh(group: Any, device: torch.device) -> DeviceMesh:
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)


def unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DataParallel) else model


def _stage_name(stage: Stage, local: str) -> str:
    """A pipeline stage's tensor under its full-model name ("blocks.0.x" -> "blocks.2.x")."""
    if local in stage.global_names:
        return stage.global_names[local]
    head, _, rest = local.partition(".")
    if head == "blocks":  # a buffer: the parameters' rule
        index, _, rest = rest.partition(".")
        return f"blocks.{stage.layer_ids[int(index)]}.{rest}"
    return local


def model_pieces(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, FlatPiece]]:
    """(name, the tensor this rank holds, its piece) for every parameter and buffer, under
    the unwrapped model's names (a pipeline stage's under the full model's): FSDP's
    trainable shards sharded, everything else whole."""
    model = unwrapped(model)
    stages = list(model) if isinstance(model, ChunkedStage) else [model]
    if all(isinstance(s, Stage) for s in stages):
        for stage in stages:
            for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
                yield _stage_name(stage, name), t, FlatPiece(t.numel())
        return
    if isinstance(model, TensorParallelGPT):
        yield from _tensor_parallel_pieces(model)
        return
    sharded: set[int] = set()
    if isinstance(model, FSDP):
        mesh = None
        for unit in model.units:
            prefix = next(n for n, m in model.module.named_modules() if m is unit.module)
            for name, shard, numel in zip(unit.names, unit.shards, unit.numels):
                mesh = mesh or _mesh(model.group, shard.device)
                sharded.add(id(shard))
                yield f"{prefix}.{name}" if prefix else name, shard, FlatPiece(numel, mesh)
        model = model.module
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in sharded:
            yield name, t, FlatPiece(t.numel())


def _tensor_parallel_pieces(model: TensorParallelGPT
                            ) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """A tensor-parallel model's pieces: cut along dimension 0 (column-parallel), a range
    of the flat vector (t divides the rows, so torch.chunk's rule is the cut); along
    dimension 1 (row-parallel), every row's run of columns; the rest whole."""
    mesh, t = None, model.tp_size
    dims = split_dims(model)
    for name, p in model.named_parameters():
        if dims[name] == 0:
            mesh = mesh or _mesh(model.group, p.device)
            yield name, p, FlatPiece(p.numel() * t, mesh)
        elif dims[name] == 1:
            yield name, p, RowsOfColumnsPiece(p.shape[0], p.shape[1], model.group)
        else:
            yield name, p, FlatPiece(p.numel())
    for name, b in model.named_buffers():
        yield name, b, FlatPiece(b.numel())


def optimizer_pieces(optimizer: Any, model: nn.Module
                      ) -> list[tuple[str, torch.Tensor, FlatPiece]]:
    """(key prefix, the tensor the optimizer steps, its piece), one per stepped tensor."""
    shards = getattr(optimizer, "shards", None)
    if shards is not None and all(isinstance(s, FlatShard) for s in shards):  # Zero1, Zero2
        mesh = _mesh(optimizer.group, shards[0].tensor.device) if shards else None
        return [(f"flat{i}", s.tensor, FlatPiece(sum(p.numel() for p in s.params), mesh))
                for i, s in enumerate(shards)]
    by_id = {id(t): (name, t, piece) for name, t, piece in model_pieces(model)}
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(f"checkpoint: the optimizer steps a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the "
                                 f"{type(model).__name__} given with it")
            found.append(by_id[id(p)])
    return found


__all__ = ["FlatPiece", "RowsOfColumnsPiece", "model_pieces", "optimizer_pieces",
           "sharded_tensors_quiet", "unwrapped"]
