"""ZeRO stage 1 as a torch optimizer: each rank keeps optimizer state for only 1/N of it.

``Zero1(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)`` is used like the
optimizer it wraps: ``zero_grad()``, ``loss.backward()``, ``step()``, an LR scheduler on top.
Inside, the trainable parameters of each parameter group are viewed as one flat vector per
dtype, zero-padded to a multiple of N; rank r owns elements ``[r*S, (r+1)*S)`` of each. A step:

1. flatten the gradients and reduce-scatter them: rank r receives the *sum* of its slice
   over all ranks, and divides by N;
2. step the wrapped optimizer (``.optimizer``) on the slices this rank owns;
3. all-gather the updated slices and copy them into every rank's parameters.

Zero1 pools the gradients itself (step 1), so the model needs no gradient sync: use it with
the plain model, or with ``DataParallel(model, sync=None)`` to also copy rank 0's buffers.

Slicing a flat vector works for optimizers that treat every element on its own (SGD with
momentum, Adam, AdamW, ...). An optimizer that needs a whole tensor at once (a per-tensor norm,
as in LAMB) would need whole parameters per rank, as torch's ``ZeroRedundancyOptimizer`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.comm import agree, all_gather, rank_and_size, reduce_scatter


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int, group: Any = None) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with global rank ``src``'s values."""
    members = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
    if src not in members:
        raise ValueError(f"broadcast_from={src} is not a rank of the group {list(members)}")
    with torch.no_grad():
        for t in tensors:
            buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
            dist.broadcast(buf, src=src, group=group)
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)


def agree_on_model(what: str, module: nn.Module, group: Any = None) -> None:
    """Before the first broadcast: every rank of ``group`` wraps the same model (names,
    shapes and dtypes of its parameters and buffers), else the broadcast aborts on a size
    mismatch, or pairs one rank's tensor with another's of the same size."""
    mine = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in [*module.named_parameters(), *module.named_buffers()]]
    every = agree(what, group, {}, payload=mine)
    other = next((j for j, theirs in enumerate(every) if theirs != every[0]), None)
    if other is None:
        return
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    first, theirs = every[0], every[other]
    i = next((i for i, (a, b) in enumerate(zip(first, theirs)) if a != b),
             min(len(first), len(theirs)))

    def tensor(sig: list[tuple[str, tuple[int, ...], str]]) -> str:
        return f"{sig[i][0]!r} {sig[i][1]} {sig[i][2]}" if i < len(sig) else "nothing"

    raise ValueError(
        f"{what}: the model differs across the ranks of its group: rank {ranks[0]} has "
        f"{len(first)} parameters and buffers, rank {ranks[other]} has {len(theirs)}; the first "
        f"difference (tensor {i}): {tensor(first)} on rank {ranks[0]}, {tensor(theirs)} on "
        f"rank {ranks[other]}. Wrap the same model on every rank (same class and config; "
        f"only its weights may differ: {what} copies them from one rank to the others)")


class FlatShard:
    """Some parameters (one dtype, one device) seen as one flat vector of ``N * size``
    elements; ``tensor`` is this rank's ``size`` of them, the leaf the inner optimizer steps."""

    def __init__(self, params: list[torch.Tensor], rank: int, world_size: int) -> None:
        self.params = params
        self.size = math.ceil(sum(p.numel() for p in params) / world_size)
        self.padded = self.size * world_size
        self.lo = rank * self.size
        self.tensor = torch.zeros(self.size, dtype=params[0].dtype, device=params[0].device,
                                  requires_grad=True)
        self.read_params()

    @torch.no_grad()
    def read_params(self) -> None:
        """Copy this rank's slice of the parameters into ``tensor`` (they may have been
        changed since, e.g. by ``model.load_state_dict``)."""
        flat = self.flatten([p.detach() for p in self.params])
        self.tensor.copy_(flat[self.lo : self.lo + self.size])

    def flatten(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """One padded vector; a missing gradient (``None``) counts as zeros."""
        p0 = self.params[0]
        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p, t in zip(self.params, tensors):
            if t is not None:
                flat[offset : offset + p.numel()].copy_(t.reshape(-1))
            offset += p.numel()
        return flat

    def unflatten_into_params(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class Zero1(torch.optim.Optimizer):
    """ZeRO-1 around any elementwise torch optimizer; see the module docstring.

    ``params``: tensors or parameter-group dicts with per-group hyperparameters, as for any
    torch optimizer. ``optimizer_cls`` and ``**defaults``: the optimizer to shard and its
    hyperparameters. ``group``: the process group (default: all ranks). At construction the
    parameters are broadcast from global rank ``broadcast_from``, so ranks seeded differently
    start equal. Parameters with ``requires_grad=False`` are never touched; one without a
    gradient this step counts as a zero gradient on this rank (as in DataParallel).

    ``state_dict()`` is **sharded**: each rank saves its own slice of the optimizer state
    (and the hyperparameters); ``load_state_dict`` takes it back on the same rank of a run with
    the same world size and parameters, and refuses anything else.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
        *,
        group: Any = None,
        broadcast_from: int = 0,
        **defaults: Any,
    ) -> None:
        self.rank, self.world_size = rank_and_size(group, "Zero1")
        self.optimizer_cls = optimizer_cls
        self.group = group
        self.broadcast_from = broadcast_from
        self.shards: list[FlatShard] = []
        self._group_of_shard: list[int] = []  # index into param_groups, one per shard
        self.optimizer: torch.optim.Optimizer | None = None
        self._given_defaults = defaults
        # the wrapped optimizer's full defaults (betas, eps, ...), so that schedulers that read
        # them (OneCycleLR's momentum) find them here; building it also checks the values
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)], **defaults)
        super().__init__(params, dict(probe.defaults))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # checks the group and fills in the defaults
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        broadcast_tensors(group["params"], self.broadcast_from, self.group)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        for params in by_dtype.values():  # one flat vector per dtype: fp64 is stepped in fp64
            if len({p.device for p in params}) > 1:
                raise ValueError(f"Zero1: parameters on several devices {params[0].device}, ...: "
                                 "one rank's parameters must all be on one device")
            shard = FlatShard(params, self.rank, self.world_size)
            inner_group = {**self._hyperparameters(group), "params": [shard.tensor]}
            if self.optimizer is None:
                self.optimizer = self.optimizer_cls([inner_group], **self._given_defaults)
            else:
                self.optimizer.add_param_group(inner_group)
            self.shards.append(shard)
            self._group_of_shard.append(index)

    @staticmethod
    def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.optimizer is None:  # every parameter is frozen
            return loss
        # a scheduler changed our param_groups: pass the new values on to the inner groups
        for inner, index in zip(self.optimizer.param_groups, self._group_of_shard):
            inner.update(self._hyperparameters(self.param_groups[index]))
        for shard in self.shards:  # 1. my slice of the summed gradient, divided by N
            shard.read_params()
            shard_grad = torch.empty_like(shard.tensor)
            reduce_scatter(shard_grad, shard.flatten([p.grad for p in shard.params]),
                           group=self.group)
            shard.tensor.grad = shard_grad.div_(self.world_size)
        self.optimizer.step()  # 2. update my slice only (its state lives only here)
        for shard in self.shards:  # 3. everyone's updated slices into every rank's parameters
            shard.tensor.grad = None
            flat = torch.empty(shard.padded, dtype=shard.tensor.dtype, device=shard.tensor.device)
            all_gather(flat, shard.tensor.detach(), group=self.group)
            shard.unflatten_into_params(flat)
        return loss

    def extra_bytes(self) -> dict[str, int]:
        """The slices this rank keeps besides the model (reported by memory_breakdown)."""
        return {"shard copy": sum(s.tensor.numel() * s.tensor.element_size() for s in self.shards)}

    def _layout(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size,
                "shard_sizes": [s.size for s in self.shards]}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state: ``param_groups`` (hyperparameters, as torch's),
        ``shards`` (the inner optimizer's state_dict over the slices) and ``layout``."""
        return {"param_groups": super().state_dict()["param_groups"],
                "shards": None if self.optimizer is None else self.optimizer.state_dict(),
                "layout": self._layout()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        layout = state_dict.get("layout")
        if layout != self._layout():
            raise ValueError(f"Zero1.load_state_dict: this state was saved with layout {layout}, "
                             f"this optimizer has {self._layout()} (state is sharded per rank: "
                             "load it on the same rank, world size and parameters)")
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("Zero1.load_state_dict: parameter groups do not match")
        for group, saved_group in zip(self.param_groups, saved):
            group.update(self._hyperparameters(saved_group))
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state_dict["shards"])


__all__ = ["FlatShard", "Zero1", "agree_on_model", "broadcast_tensors"]
