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
survives. Units go in one fixed order on every rank (backward's: the last block first), so
that a unit left without gradients on some ranks (a skipped branch) waits, with those after
it, for ``finish_gradient_synchronization`` rather than pairing with another unit. The step
updates the shard and all-gathers the weights: 2 x P x (N-1)/N bytes per step, as plain data
parallelism (:func:`parlib.cost.sharded.zero_sent_bytes_per_step`).

ZeRO-3, where the weights are sharded too, is :class:`parlib.strategies.fsdp.FSDP`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from parlib.comm import all_gather, rank_and_size, reduce_scatter
from parlib.strategies.fsdp import FSDP, GatherUnit, Unit
from parlib.strategies.zero import FlatShard, agree_on_model, broadcast_tensors


def unit_params(model: nn.Module, units: list[str] | None = None) -> list[list[torch.Tensor]]:
    """Trainable parameters grouped by unit: each named submodule (default: every child of
    every ``nn.ModuleList``, the blocks), then the rest; each parameter once (a tied one
    goes to the first unit that holds it)."""
    seen: set[int] = set()
    groups = []
    for sub in [*(model.get_submodule(u) for u in _unit_names(model, units)), model]:
        group = [p for p in sub.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in group)
        if group:
            groups.append(group)
    return groups


def _unit_names(model: nn.Module, units: list[str] | None) -> list[str]:
    if units is None:
        return [f"{name}.{i}" for name, child in model.named_modules()
                if isinstance(child, nn.ModuleList) for i in range(len(child))]
    if isinstance(units, (str, nn.Module)) or not all(isinstance(u, str) for u in units):
        raise TypeError(f"units takes a list of submodule names, e.g. ['blocks.0', "
                        f"'blocks.1'] (the default: every block), got {type(units).__name__}")
    return list(units)


def _reduce_order(model: nn.Module, units: list[str] | None = None) -> list[int]:
    """The order in which Zero2 reduce-scatters the groups of :func:`unit_params`: the
    named units last first, then the rest (its embeddings get their gradients last). That is
    the order backward completes them when ``units`` are listed in forward order."""
    groups = unit_params(model, units)
    named = {id(p) for u in _unit_names(model, units)
             for p in model.get_submodule(u).parameters()}
    has_rest = bool(groups) and id(groups[-1][0]) not in named
    n_named = len(groups) - has_rest
    return [*reversed(range(n_named)), *([n_named] if has_rest else [])]


class Zero2:
    """ZeRO-2 on ``model`` over ``group`` with the elementwise optimizer ``optimizer_cls``
    (``**defaults``: its hyperparameters); see the module docstring. ``units``: submodule
    names whose gradients are reduce-scattered together (default: the blocks), best listed in
    forward order: they are reduced in the reverse order, and one waits for those before it.
    Every rank must wrap the same model (names and shapes, checked before the broadcast)."""

    def __init__(self, model: nn.Module,
                 optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam, *,
                 units: list[str] | None = None, group: Any = None, broadcast_from: int = 0,
                 **defaults: Any) -> None:
        self.rank, self.world_size = rank_and_size(group, "Zero2")
        self.group = group
        agree_on_model("Zero2", model, group)
        broadcast_tensors([*model.parameters(), *model.buffers()], broadcast_from, group)
        groups = unit_params(model, units)
        if not groups:
            raise ValueError(f"Zero2: {type(model).__name__} has no trainable parameters")
        if any(p.dtype != torch.float32 for g in groups for p in g):
            raise ValueError("Zero2: trainable parameters must be fp32")
        self.shards = [FlatShard(g, self.rank, self.world_size) for g in groups]
        self.optimizer = optimizer_cls([s.tensor for s in self.shards], **defaults)
        self._order = _reduce_order(model, units)
        self._next = 0  # position in _order of the next unit to reduce-scatter
        self._ready = [0] * len(self.shards)  # gradients produced, not yet reduced, per unit
        self._done = [False] * len(self.shards)  # reduce-scattered this step
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, s in enumerate(self.shards) for p in s.params]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def grad_ready(_p: torch.Tensor) -> None:
            self._ready[i] += 1
            self._reduce_ready()
        return grad_ready

    def _reduce_ready(self) -> None:
        """Reduce-scatter the units whose gradients have all arrived, in ``_order`` only,
        stopping at the first that is not complete. Collectives pair by order: if a branch
        skipped on one rank let the next unit go first there, equal-sized units would swap
        gradients. That unit and those after it wait for
        :meth:`finish_gradient_synchronization`, on the ranks where it is incomplete."""
        while self._ready[i := self._order[self._next]] >= len(self.shards[i].params):
            self._reduce(i)
            self._next = (self._next + 1) % len(self._order)  # a full round: the next backward
            if self._next == 0:
                return

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
        """Finish the round of reduce-scatters that backward left open, in the same order
        (a gradient that did not arrive counts as zeros): every rank must issue the same
        collectives. Another round if gradients arrived for units already reduced (a second
        backward), and a round of zeros on a rank whose backward gave no gradient at all."""
        while self._next or any(self._ready) or not any(self._done):
            for i in self._order[self._next:]:
                self._reduce(i)
            self._next = 0

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
        self._next = 0
        self._ready = [0] * len(self.shards)
        self._done = [False] * len(self.shards)

    def shard_grad_bytes(self) -> int:
        return sum(s.tensor.grad.numel() * 4 for s in self.shards if s.tensor.grad is not None)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


__all__ = ["FSDP", "GatherUnit", "Unit", "Zero2", "unit_params"]
