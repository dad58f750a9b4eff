"""ZeRO-2: every rank keeps the whole model, but only its shard of gradients and optimizer state.

    model = build_model(cfg)
    zero2 = Zero2(model, torch.optim.AdamW, lr=1e-3)    # every rank now holds rank 0's weights
    loss_fn(model(x), y).backward()    # each unit's gradients are reduce-scattered when ready
    zero2.step(); zero2.zero_grad()    # update my shard, all-gather the weights

ZeRO-1 (:class:`parlib.strategies.zero.Zero1`) shards the optimizer state but every rank still
holds every full gradient until the step. ZeRO-2 also shards the gradients: the trainable
parameters are grouped in *units* (the blocks, and the rest), each unit seen as one flat
vector padded to N equal pieces (:class:`parlib.strategies.zero.FlatShard`). As soon as
backward has produced every gradient of a unit, a hook reduce-scatters them (rank r receives
the sum of piece r, divided by N) and frees the full gradients; only the shard gradient
survives. The step updates the shard and all-gathers the weights: 2 x P x (N-1)/N bytes per
step, as plain data parallelism (:func:`parlib.cost.sharded.zero_sent_bytes_per_step`).

ZeRO-3, where the weights are sharded too, is :class:`parlib.strategies.fsdp.FSDP`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from parlib.comm import all_gather, rank_and_size, reduce_scatter
from parlib.strategies.fsdp import FSDP, GatherUnit, Unit
from parlib.strategies.zero import FlatShard, broadcast_tensors


def unit_params(model: nn.Module, units: list[str] | None = None) -> list[list[torch.Tensor]]:
    """Trainable parameters grouped by unit: each named submodule (default: every child of
    every ``nn.ModuleList``, the blocks), then the rest; each parameter once (a tied one
    goes to the first unit that holds it)."""
    if units is None:
        units = [f"{name}.{i}" for name, child in model.named_modules()
                 if isinstance(child, nn.ModuleList) for i in range(len(child))]
    seen: set[int] = set()
    groups = []
    for sub in [*(model.get_submodule(u) for u in units), model]:
        group = [p for p in sub.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in group)
        if group:
            groups.append(group)
    return groups


class Zero2:
    """ZeRO-2 on ``model`` over ``group`` with the elementwise optimizer ``optimizer_cls``
    (``**defaults``: its hyperparameters); see the module docstring. ``units``: submodule
    names whose gradients are reduce-scattered together (default: the blocks)."""

    def __init__(self, model: nn.Module,
                 optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam, *,
                 units: list[str] | None = None, group: Any = None, broadcast_from: int = 0,
                 **defaults: Any) -> None:
        self.rank, self.world_size = rank_and_size(group, "Zero2")
        self.group = group
        broadcast_tensors([*model.parameters(), *model.buffers()], broadcast_from, group)
        groups = unit_params(model, units)
        if not groups:
            raise ValueError(f"Zero2: {type(model).__name__} has no trainable parameters")
        if any(p.dtype != torch.float32 for g in groups for p in g):
            raise ValueError("Zero2: trainable parameters must be fp32")
        self.shards = [FlatShard(g, self.rank, self.world_size) for g in groups]
        self.optimizer = optimizer_cls([s.tensor for s in self.shards], **defaults)
        self._ready = [0] * len(self.shards)  # gradients produced this backward, per unit
        self._done = [False] * len(self.shards)  # reduce-scattered this step
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, s in enumerate(self.shards) for p in s.params]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def grad_ready(_p: torch.Tensor) -> None:
            self._ready[i] += 1
            if self._ready[i] == len(self.shards[i].params):
                self._reduce(i)
        return grad_ready

    @torch.no_grad()
    def _reduce(self, i: int) -> None:
        """Unit i: full gradients (N x S, flat) -> my piece of their average (S); the full
        gradients are freed."""
        shard = self.shards[i]
        mine = torch.empty_like(shard.tensor)
        reduce_scatter(mine, shard.flatten([p.grad for p in shard.params]), group=self.group)
        mine.div_(self.world_size)
        if shard.tensor.grad is None:
            shard.tensor.grad = mine
        else:  # a second backward before the step (accumulation): add up
            shard.tensor.grad.add_(mine)
        for p in shard.params:
            p.grad = None
        self._ready[i] = 0
        self._done[i] = True

    def finish_gradient_synchronization(self) -> None:
        """Reduce-scatter the units whose gradients did not all arrive (a parameter unused
        this step counts as a zero gradient): every rank must issue the same collectives."""
        for i, shard in enumerate(self.shards):
            if not self._done[i] and (self._ready[i] or shard.tensor.grad is None):
                self._reduce(i)

    @torch.no_grad()
    def step(self) -> None:
        """Update my shard, then all-gather every unit's weights into the model."""
        self.finish_gradient_synchronization()
        self.optimizer.step()
        for shard in self.shards:
            flat = torch.empty(shard.padded, dtype=shard.tensor.dtype, device=shard.tensor.device)
            all_gather(flat, shard.tensor.detach(), group=self.group)
            shard.unflatten_into_params(flat)
        self._done = [False] * len(self.shards)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``set_to_none=False`` keeps the shard gradients' memory (zeroed), as torch's
        optimizers do; the full gradients are freed either way (they live only in backward)."""
        for shard in self.shards:
            if set_to_none or shard.tensor.grad is None:
                shard.tensor.grad = None
            else:
                shard.tensor.grad.zero_()
            for p in shard.params:
                p.grad = None
        self._ready = [0] * len(self.shards)
        self._done = [False] * len(self.shards)

    def shard_grad_bytes(self) -> int:
        return sum(s.tensor.grad.numel() * 4 for s in self.shards if s.tensor.grad is not None)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


__all__ = ["FSDP", "GatherUnit", "Unit", "Zero2", "unit_params"]
