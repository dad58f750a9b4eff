"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): split the matrices of every layer.

Each of the t ranks in a group holds a slice of every weight. A column-parallel layer keeps
a slice of the output features (its output is a slice of the last dimension); a
row-parallel layer keeps a slice of the input features (its output is a partial sum that
the ranks add up). Column then row needs no communication in between, because a
nonlinearity acts element-wise on the column slices: one all-reduce forward (g, after the
row-parallel layer) and one backward (f, before the column-parallel layer) per pair.

- :class:`ColumnParallelLinear`, :class:`RowParallelLinear`: cut from a full ``nn.Linear``
  (``from_linear``), so a single-device model and its copy start from the same numbers.
- :func:`tensor_parallel_copy`: the shared TinyGPT split over a group of t ranks (attention
  by heads, MLP up by columns and down by rows; embeddings, LayerNorms and head replicated),
  optionally with sequence parallelism (Korthikanti et al. 2022).
- :func:`torch_tensor_parallel`: the same split with PyTorch's ``parallelize_module``.
- :func:`tensor_parallel_modules`: any model (a Llama from ``transformers``, say) split
  by a plan naming its linear layers "column" or "row".
- :func:`split_dims` / :func:`shard_of` / :func:`local_shards`: how each parameter was cut,
  and this rank's piece of any full tensor, to compare a copy's parameters or gradients
  with the single-device model's.

The operators themselves (f, g and the sequence-parallel pair) are in ``tensor_ops``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlib.comm import rank_and_size
from parlib.model import MLP, Attention, Block, TinyGPT
from parlib.strategies import tensor_ops as ops


def _check_slices(local: int, full: int, group: Any, what: str) -> None:
    """This rank holds exactly ``full / t`` of the ``what`` features: uneven slices make the
    ranks' messages disagree in size, which gloo answers by aborting a rank. (If the slices
    differ, some rank's is not full / t, so no rank needs to talk.)"""
    rank, t = rank_and_size(group, "tensor parallelism")
    if local * t != full:
        raise ValueError(
            f"tensor parallelism over t={t} ranks: rank {rank} holds {local} of the "
            f"{what}_features, but every rank must hold an equal slice of the full "
            f"{what}_features={full} ({full}/{t}); cut the weight into t equal slices "
            f"(from_linear does)")


def _check_divides(t: int, size: int, what: str, why: str = "") -> None:
    if size % t:
        why = f" ({why})" if why else ""
        raise ValueError(f"tensor parallelism over t={t} ranks: {what}={size} is not "
                         f"divisible by {t}{why}; pick t among the divisors of {size}")


def _enter(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """Into a column-parallel region: f, or under sequence parallelism the all-gather
    along s, (b, s/t, h) -> (b, s, h), whose backward reduce-scatters."""
    if sequence_parallel:
        return ops.gather_from_sequence_parallel_region(x, group)
    return ops.copy_to_tensor_parallel_region(x, group)


class ColumnParallelLinear(nn.Module):
    """A linear layer holding rows [r*o/t, (r+1)*o/t) of the weight (this rank's output
    features). Input replicated; output this rank's slice of the last dimension, or the
    whole output with ``gather_output=True``."""

    split_dims = {"weight": 0, "bias": 0}  # which dimension of each full tensor is cut

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                 full_out_features: int, gather_output: bool = False,
                 enter_region: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]  # this rank's share: o/t
        self.full_out_features = full_out_features
        self.gather_output = gather_output
        self.enter_region = enter_region
        self.sequence_parallel = sequence_parallel
        _check_slices(self.out_features, full_out_features, group, "out")

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, gather_output: bool = False,
                    *, enter_region: bool = True,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's column slice of ``linear`` (copied, so ``linear`` is left alone).

        ``enter_region=False`` when the caller already applied f (or the sequence
        all-gather) once for several layers that share one input, as q, k and v do.
        ``sequence_parallel``: the input arrives split along s and is all-gathered here.
        """
        rank, t = rank_and_size(group, "tensor parallelism")
        _check_divides(t, linear.out_features, "out_features")
        rows = linear.out_features // t
        cut = slice(rank * rows, (rank + 1) * rows)
        weight = linear.weight.detach()[cut].clone()
        bias = linear.bias.detach()[cut].clone() if linear.bias is not None else None
        return cls(weight, bias, group, linear.out_features, gather_output, enter_region,
                   sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = _enter(x, self.group, self.sequence_parallel)
        # (b, s, in) @ (in, o/t) -> (b, s, o/t): this rank's output features, no talking
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = ops.gather_from_tensor_parallel_region(y, self.group)  # (b, s, o)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(of {self.full_out_features}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """A linear layer holding columns [r*i/t, (r+1)*i/t) of the weight (this rank's input
    features). Input this rank's slice of the last dimension; output whole: the partial sums
    are all-reduced (g), then the bias is added once."""

    split_dims = {"weight": 1, "bias": None}  # the bias is replicated

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                 full_in_features: int, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.in_features = weight.shape[1]  # this rank's share: i/t
        self.out_features = weight.shape[0]
        self.full_in_features = full_in_features
        self.sequence_parallel = sequence_parallel
        _check_slices(self.in_features, full_in_features, group, "in")

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, *,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's row slice of ``linear`` (copied). ``sequence_parallel``: the output
        is reduce-scattered along s instead of all-reduced."""
        rank, t = rank_and_size(group, "tensor parallelism")
        _check_divides(t, linear.in_features, "in_features")
        cols = linear.in_features // t
        weight = linear.weight.detach()[:, rank * cols:(rank + 1) * cols].clone()
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(weight, bias, group, linear.in_features, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, i/t) @ (i/t, o) -> (b, s, o): a partial sum on every rank
        partial = F.linear(x, self.weight)
        bias = self.bias
        if self.sequence_parallel:
            y = ops.reduce_scatter_to_sequence_parallel_region(partial, self.group)  # (b,s/t,o)
            if bias is not None:  # each rank adds it to s/t positions: its gradient is partial
                bias = ops.copy_to_tensor_parallel_region(bias, self.group)
        else:
            y = ops.reduce_from_tensor_parallel_region(partial, self.group)  # g: (b, s, o)
        return y + bias if bias is not None else y  # once, after the reduction

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.full_in_features}), "
                f"out_features={self.out_features}")


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A replicated LayerNorm applied to this rank's s/t positions. Its weight and bias
    see only those positions, so their gradients are partial: they pass through f."""

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, group: Any = None) -> SequenceParallelLayerNorm:
        new = cls(ln.normalized_shape, eps=ln.eps, elementwise_affine=True,
                  device=ln.weight.device, dtype=ln.weight.dtype)
        new.load_state_dict(ln.state_dict())
        new.group = group
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = ops.copy_to_tensor_parallel_region(self.weight, self.group)
        bias = ops.copy_to_tensor_parallel_region(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class TensorParallelAttention(Attention):
    """This rank's heads: q, k, v column-parallel behind one f, out row-parallel (g)."""

    def __init__(self, attn: Attention, group: Any = None,
                 sequence_parallel: bool = False) -> None:
        nn.Module.__init__(self)  # the layers are cut from ``attn``, not built from a config
        _, t = rank_and_size(group, "tensor parallelism")
        heads = attn.q.out_features // attn.head_dim
        _check_divides(t, heads, "n_heads")
        self.head_dim = attn.head_dim
        self.group = group
        self.sequence_parallel = sequence_parallel
        for name in ("q", "k", "v"):  # a whole number of heads each, by columns
            setattr(self, name, ColumnParallelLinear.from_linear(
                getattr(attn, name), group, enter_region=False))
        self.out = RowParallelLinear.from_linear(attn.out, group,
                                                 sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter(x, self.group, self.sequence_parallel)  # once for q, k and v: (b, s, h)
        return super().forward(x)  # heads counted from q's width: this rank's n_heads/t


class TensorParallelMLP(MLP):
    """up column-parallel (f before it), GELU on the slices, down row-parallel (g)."""

    def __init__(self, mlp: MLP, group: Any = None, sequence_parallel: bool = False) -> None:
        nn.Module.__init__(self)
        self.up = ColumnParallelLinear.from_linear(mlp.up, group,
                                                   sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear.from_linear(mlp.down, group,
                                                  sequence_parallel=sequence_parallel)
    # MLP.forward: down(gelu(up(x))); (b, s, h) -> (b, s, 4h/t) -> (b, s, h)


def tensor_parallel_block(block: Block, group: Any = None,
                          sequence_parallel: bool = False) -> Block:
    """A copy of ``block`` with its attention and MLP split over ``group``. A mixture of
    experts in place of the MLP is copied whole: every rank of ``group`` runs it on the same
    (replicated) input, so it needs no tensor-parallel message (its experts are split over
    an expert-parallel group instead, :mod:`parlib.strategies.experts`)."""
    if sequence_parallel and not isinstance(block.mlp, MLP):
        raise ValueError("sequence parallelism splits the MLP's input along s; a block with "
                         "a mixture of experts runs it whole: use sequence_parallel=False")
    new = Block.__new__(Block)  # Block.forward unchanged; its children are replaced
    nn.Module.__init__(new)
    for name in ("ln1", "attn", "ln2", "mlp"):  # model order, so parameters list alike
        child = getattr(block, name)
        if name == "attn":
            child = TensorParallelAttention(child, group, sequence_parallel)
        elif name == "mlp":
            child = (TensorParallelMLP(child, group, sequence_parallel)
                     if isinstance(child, MLP) else copy.deepcopy(child))
        elif sequence_parallel:
            child = SequenceParallelLayerNorm.from_layernorm(child, group)
        else:
            child = copy.deepcopy(child)
        setattr(new, name, child)
    return new


class TensorParallelGPT(nn.Module):
    """TinyGPT split over a group: the same attribute names (embed, blocks, head), so every
    parameter pairs up by name with the single-device model's."""

    def __init__(self, model: TinyGPT, group: Any = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        cfg = model.cfg
        _, t = rank_and_size(group, "tensor parallelism")
        _check_divides(t, cfg.n_heads, "n_heads")
        _check_divides(t, cfg.d_model, "d_model")
        _check_divides(t, cfg.mlp_ratio * cfg.d_model, "MLP width", "mlp_ratio * d_model")
        if sequence_parallel:
            _check_divides(t, cfg.seq_len, "seq_len", "sequence parallelism splits it")
        self.cfg = cfg
        self.group = group
        self.tp_size = t
        self.sequence_parallel = sequence_parallel
        self.embed = copy.deepcopy(model.embed)  # replicated
        self.blocks = nn.ModuleList(
            tensor_parallel_block(b, group, sequence_parallel) for b in model.blocks)
        self.head = copy.deepcopy(model.head)  # replicated

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (b, s, h), the same on every rank
        if self.sequence_parallel:
            x = ops.scatter_to_sequence_parallel_region(x, self.group)  # (b, s/t, h)
        for block in self.blocks:
            x = block(x)
        if self.sequence_parallel:
            x = ops.gather_to_replicated_region(x, self.group)  # (b, s, h)
        return self.head(x)  # (b, s, vocab), the same on every rank


def tensor_parallel_copy(model: TinyGPT, group: Any = None,
                         sequence_parallel: bool = False) -> TensorParallelGPT:
    """``model`` split over the t ranks of ``group`` (``None``: the default group): attention
    by heads, the MLP by columns then rows, the rest replicated; ``model`` is left untouched.
    Raises ValueError naming the size that t does not divide."""
    return TensorParallelGPT(model, group, sequence_parallel)


SPLITS = ("column", "row")


def tensor_parallel_modules(model: nn.Module, plan: Mapping[str, str],
                            group: Any = None) -> nn.Module:
    """A copy of any ``model`` with the ``nn.Linear`` layers named in ``plan`` split over the
    t ranks of ``group``; ``model`` is left untouched, every other module is replicated.

    ``plan`` maps a submodule's name to ``"column"`` (:class:`ColumnParallelLinear`: this
    rank's output features, f before it) or ``"row"`` (:class:`RowParallelLinear`: this
    rank's input features, g after it), as ``parallelize_module``'s ColwiseParallel and
    RowwiseParallel do. A Llama's attention: q, k, v "column" (whole heads per rank: t must
    divide the query and the key/value heads), o "row"; its MLP: gate and up "column", down
    "row". Every column layer applies its own f, so q, k and v all-reduce three input
    gradients in backward where :func:`tensor_parallel_copy` sums them first and sends once.
    Parameters keep their names, so :func:`local_shards` pairs them with the full model's."""
    bad = {name: how for name, how in plan.items() if how not in SPLITS}
    if bad:
        raise ValueError(f"tensor parallelism: plan splits {bad}; each layer is split "
                         f"\"column\" or \"row\"")
    layers = dict(model.named_modules())
    for name in plan:
        if not isinstance(layers.get(name), nn.Linear):
            what = type(layers[name]).__name__ if name in layers else "no such module"
            raise ValueError(f"tensor parallelism: plan names {name!r} ({what}); it splits "
                             f"nn.Linear layers, named as in model.named_modules()")
    new = copy.deepcopy(model)
    for name, how in plan.items():
        parent, _, leaf = name.rpartition(".")
        linear = new.get_submodule(name)
        cut = (ColumnParallelLinear.from_linear(linear, group) if how == "column"
               else RowParallelLinear.from_linear(linear, group))
        setattr(new.get_submodule(parent), leaf, cut)
    return new


def torch_tensor_parallel(model: TinyGPT, mesh: Any) -> TinyGPT:
    """PyTorch's own version of :func:`tensor_parallel_copy`: ``model`` (changed in place)
    split by ``parallelize_module`` with ColwiseParallel / RowwiseParallel over a 1-D
    DeviceMesh. Its weights become DTensors; the forward is TinyGPT's."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    t = mesh.size()
    _check_divides(t, model.cfg.n_heads, "n_heads")
    plan = {
        # One DTensor input for q, k and v: their partial input gradients add up as a
        # DTensor and are all-reduced once (our single f), not once per projection.
        "attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                   desired_input_layouts=(Replicate(),),
                                   use_local_output=False),
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(), "attn.out": RowwiseParallel(),
        "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
        # Attention counts its heads from q's width, and q's local output is 1/t of it
        # (torchtitan makes the same adjustment to its n_heads).
        block.attn.q.out_features //= t
    return model


def split_dims(model: nn.Module) -> dict[str, int | None]:
    """How tensor parallelism cut each parameter of ``model`` (by name): the dimension of
    the full tensor it was split along (the layers' ``split_dims``), or None if whole."""
    out: dict[str, int | None] = {}
    for mod_name, module in model.named_modules():
        dims = getattr(module, "split_dims", {})
        for p_name, _ in module.named_parameters(recurse=False):
            out[f"{mod_name}.{p_name}" if mod_name else p_name] = dims.get(p_name)
    return out


def shard_of(full: torch.Tensor, dim: int | None, index: int, t: int) -> torch.Tensor:
    """The piece of ``full`` that tensor-parallel rank ``index`` of ``t`` holds when the
    tensor is cut along ``dim`` (None: the whole tensor)."""
    return full if dim is None else full.chunk(t, dim=dim)[index]


def local_shards(tp_model: nn.Module, full: dict[str, torch.Tensor],
                 group: Any = None) -> dict[str, torch.Tensor]:
    """This rank's piece of each full tensor in ``full`` (keyed by parameter name, as
    ``model.named_parameters()`` of the single-device model), cut the way ``tp_model`` cut
    that parameter. Replicated parameters come back whole."""
    rank, t = rank_and_size(group, "tensor parallelism")
    out = {}
    for name, dim in split_dims(tp_model).items():
        if name not in full:
            raise KeyError(f"no full tensor for parameter {name!r}")
        out[name] = shard_of(full[name], dim, rank, t)
    return out


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SequenceParallelLayerNorm",
           "SPLITS", "TensorParallelAttention", "TensorParallelGPT", "TensorParallelMLP",
           "local_shards", "shard_of", "split_dims", "tensor_parallel_block",
           "tensor_parallel_copy", "tensor_parallel_modules", "torch_tensor_parallel"]
