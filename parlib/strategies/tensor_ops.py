"""The communication of tensor parallelism, one small autograd.Function per operator.

Megatron-LM (Shoeybi et al. 2019) names two conjugate operators around a split layer:

- *f*: identity forward, all-reduce of the gradient backward. It sits where a replicated
  activation enters a column-parallel region: every rank's slice of the next matmul
  contributes a partial gradient for that activation.
- *g*: all-reduce forward, identity backward. It sits where a row-parallel region ends:
  every rank holds a partial sum of the output.

Sequence parallelism (Korthikanti et al. 2022) keeps the activations between those regions
split along the sequence dimension, and replaces each all-reduce by a reduce-scatter plus an
all-gather (the same bytes on the wire): all-gather forward / reduce-scatter backward on the
way in, reduce-scatter forward / all-gather backward on the way out. Two more operators
enter and leave the split-sequence stretch of the model from replicated code (after the
embedding, before the head): a plain split, and an all-gather whose backward is a split.
The same all-gather along the last dimension collects a column-parallel output.

Every operator takes the process group as an argument; activations are (b, s, h) with the
sequence on dim 1. ``parlib.comm`` collectives work on dim 0 of contiguous tensors, so the
sequence dimension is moved to the front around them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from parlib import comm

SEQ_DIM = 1  # activations are (b, s, h)


def _group_size(group: Any) -> int:
    return comm.rank_and_size(group, "tensor parallelism")[1]


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of ``x`` over the group, in a fresh tensor (the caller's tensor is left alone)."""
    _group_size(group)  # refuses a rank outside the group
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _check_splits(x: torch.Tensor, dim: int, t: int) -> None:
    if x.shape[dim] % t:
        what = "sequence length" if dim == SEQ_DIM else f"dimension {dim}"
        raise ValueError(f"{what} {x.shape[dim]} does not split evenly over {t} ranks")


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Pieces of ``dim`` on each rank -> the whole of ``dim``, the pieces in rank order
    (for SEQ_DIM: (b, s/t, h) -> (b, s, h))."""
    t = _group_size(group)
    front = x.movedim(dim, 0).contiguous()  # (s/t, b, h)
    out = front.new_empty((t * front.shape[0], *front.shape[1:]))  # (s, b, h)
    comm.all_gather(out, front, group=group)
    # One contiguous copy here; a strided view would be copied again by every matmul that
    # reads it (q, k and v) and each copy kept for backward.
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Partial sums on each rank -> this rank's piece of ``dim`` of the total
    (for SEQ_DIM: (b, s, h) -> (b, s/t, h))."""
    t = _group_size(group)
    _check_splits(x, dim, t)
    front = x.movedim(dim, 0).contiguous()  # (s, b, h)
    out = front.new_empty((front.shape[0] // t, *front.shape[1:]))  # (s/t, b, h)
    comm.reduce_scatter(out, front, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's piece of ``dim`` of a replicated tensor: no communication."""
    rank, t = comm.rank_and_size(group, "tensor parallelism")
    _check_splits(x, dim, t)
    return x.chunk(t, dim=dim)[rank].contiguous()


class CopyToTensorParallelRegion(Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward (enters a
    column-parallel region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        _group_size(group)  # a rank outside the group: refused now, not in backward
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallelRegion(Function):
    """Megatron's g: all-reduce forward, identity backward (leaves a row-parallel region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherFromTensorParallelRegion(Function):
    """Megatron's gather of a column-parallel output: all-gather along the last dimension
    forward, keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, grad.dim() - 1, ctx.group), None


class GatherFromSequenceParallelRegion(Function):
    """Sequence parallelism's way in: all-gather along the sequence forward, reduce-scatter
    of the gradient backward (f with its all-reduce split in two)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class ReduceScatterToSequenceParallelRegion(Function):
    """Sequence parallelism's way out: reduce-scatter along the sequence forward, all-gather
    of the gradient backward (g with its all-reduce split in two)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class ScatterToSequenceParallelRegion(Function):
    """From replicated code into the split sequence: keep this rank's piece forward,
    all-gather of the gradient backward (every rank needs the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class GatherToReplicatedRegion(Function):
    """From the split sequence back into replicated code: all-gather forward, keep this
    rank's piece of the (identical on every rank) gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, SEQ_DIM, ctx.group), None


# Lower-case call sites, as in the paper: ``f(x, group)``, ``g(x, group)``.
def copy_to_tensor_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """f(x): identity now, all-reduce of the gradient in backward."""
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """g(x): all-reduce now, identity in backward."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather the last dimension now, this rank's slice of the gradient in backward."""
    return GatherFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather along s now, reduce-scatter of the gradient in backward."""
    return GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor,
                                               group: Any = None) -> torch.Tensor:
    """Reduce-scatter along s now, all-gather of the gradient in backward."""
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """This rank's piece of s now, all-gather of the gradient in backward."""
    return ScatterToSequenceParallelRegion.apply(x, group)


def gather_to_replicated_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather along s now, this rank's piece of the gradient in backward."""
    return GatherToReplicatedRegion.apply(x, group)


f = copy_to_tensor_parallel_region
g = reduce_from_tensor_parallel_region

__all__ = [
    "CopyToTensorParallelRegion",
    "GatherFromSequenceParallelRegion",
    "GatherFromTensorParallelRegion",
    "GatherToReplicatedRegion",
    "ReduceFromTensorParallelRegion",
    "ReduceScatterToSequenceParallelRegion",
    "ScatterToSequenceParallelRegion",
    "copy_to_tensor_parallel_region",
    "f",
    "g",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "gather_to_replicated_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
]
