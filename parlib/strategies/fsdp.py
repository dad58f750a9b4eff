"""ZeRO-3 / FSDP: each rank holds 1/N of every weight; a unit's weights exist in full only
while that unit computes.

    model = parlib.FSDP(TinyGPT(cfg))                 # every rank: its shards of rank 0's weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # steps only the shards
    loss_fn(model(x), y).backward()                   # x, y: this rank's rows of the batch
    model.finish_gradient_synchronization()           # every shard has its fp32 gradient
    opt.step(); opt.zero_grad()

A *unit* is a block (every child of an ``nn.ModuleList``, by default) or the root (every
other parameter: embeddings, the head, tied weights). Every trainable parameter is
flattened, zero-padded to N equal pieces, and rank r keeps piece r (an fp32 ``nn.Parameter``
of shape (S,), registered under the parameter's own name). Per unit and step:

1. before its forward, :class:`GatherUnit` all-gathers the unit's shards (cast to the
   compute dtype first: the messages are in bf16 when compute is) into full weights;
2. the unit computes with them (``torch.func.functional_call``); autograd would keep the
   weights for backward, so a saved-tensor hook keeps a note instead and the full weights are
   freed when the forward ends;
3. in backward, the first note unpacked all-gathers the weights again;
4. when the unit's gradients are ready, :class:`GatherUnit`'s backward reduce-scatters them
   (rank r receives the sum of piece r), divides by N, and hands back fp32 shard gradients.

The root's weights are whole for all of forward (it runs the blocks) and, in backward, from
the head's backward to the embedding's: make the root small.

Bytes per step: 3 x P x (N-1)/N (two all-gathers, one reduce-scatter;
:func:`parlib.cost.sharded.zero_sent_bytes_per_step`). ``prefetch=True`` starts the next
unit's all-gather (async) while this one computes, in forward and in backward.
``recompute=True`` wraps each block unit in ``torch.utils.checkpoint``: its forward then keeps
only the unit's input, and in backward the recomputed forward gathers the weights (that *is*
the second all-gather, so the bytes stay 3 x P x (N-1)/N).

HSDP, ``FSDP(model, group=shard_group, replicate_group=copies)``: r copies of the model,
each sharded s ways; the gathers and reduce-scatters above run in the shard group
(3 x P x (s-1)/s), then one all-reduce of each 1/s gradient piece over the replicate group
(2 x P/s x (r-1)/r; :func:`parlib.cost.sharded.hsdp_sent_bytes_per_step`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from parlib.comm import all_gather, rank_and_size, reduce_scatter
from parlib.strategies.fsdp_layout import (
    REPLICATE_RULES,
    broadcast_over_mesh,
    check_hsdp_groups,
    norms_and_biases,
    replicate_rule,
    unit_names_of,
)
from parlib.strategies.zero import agree_on_model, broadcast_tensors

COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


class _Note:
    """What a saved-tensor hook keeps instead of a gathered weight: where to find it again."""

    __slots__ = ("unit", "index", "size", "stride", "offset")

    def __init__(self, unit: "Unit", index: int, t: torch.Tensor) -> None:
        self.unit, self.index = unit, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class Unit:
    """One unit's trainable parameters as per-parameter shards, and the collectives on them."""

    def __init__(self, owner: "FSDP", module: nn.Module, names: list[str]) -> None:
        self.owner, self.module, self.names = owner, module, names
        n, r = owner.world_size, owner.rank
        full = [module.get_parameter(name) for name in names]
        self.shapes = [p.shape for p in full]
        self.numels = [p.numel() for p in full]
        self.sizes = [math.ceil(k / n) for k in self.numels]  # S_i: each rank's piece
        self.total = sum(self.sizes)
        self.shards: list[nn.Parameter] = []
        for p, size in zip(full, self.sizes):
            flat = torch.zeros(size * n, dtype=torch.float32, device=p.device)
            flat[: p.numel()] = p.detach().reshape(-1)
            self.shards.append(nn.Parameter(flat[r * size : (r + 1) * size].clone()))
        self.regathered: list[torch.Tensor] | None = None  # the full weights during backward
        self.pending: tuple[torch.Tensor, Any] | None = None  # a prefetched all-gather

    # all-gather ---------------------------------------------------------------------
    def start_gather(self, dtype: torch.dtype | None = None) -> None:
        """Begin the all-gather (async); :meth:`gather` finishes it."""
        if self.pending is None:
            self.pending = self._issue(dtype or self.owner.dtype, async_op=True)

    def _issue(self, dtype: torch.dtype, async_op: bool) -> tuple[torch.Tensor, Any]:
        # my pieces side by side (total,) -> every rank's, in rank order: (N * total,)
        mine = torch.cat([s.detach().to(dtype) for s in self.shards])
        out = torch.empty(self.owner.world_size * self.total, dtype=dtype, device=mine.device)
        return out, all_gather(out, mine, group=self.owner.group, async_op=async_op)

    @torch.no_grad()
    def gather(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The unit's full weights (shapes as the module's), in ``dtype`` (compute dtype)."""
        out, work = self.pending if self.pending is not None else self._issue(
            dtype or self.owner.dtype, async_op=False)
        self.pending = None
        if work is not None:
            work.wait()
        by_rank = out.view(self.owner.world_size, self.total)  # row r: rank r's pieces
        fulls, offset = [], 0
        for shape, numel, size in zip(self.shapes, self.numels, self.sizes):
            # a copy, so that every weight has a storage of its own (the saved-tensor hook
            # tells weights apart by storage)
            piece = by_rank[:, offset : offset + size].clone().view(-1)
            fulls.append(piece[:numel].view(shape))
            offset += size
        for hook in list(self.owner.gather_hooks.values()):
            hook(self, fulls)
        return fulls

    # reduce-scatter -------------------------------------------------------------------
    @torch.no_grad()
    def reduce_scatter_grads(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        """Full gradients (compute dtype) -> this rank's piece of their average (fp32)."""
        self.regathered = None  # the unit's backward is over: free its weights
        n = self.owner.world_size
        dtype = next((g.dtype for g in grads if g is not None), self.owner.dtype)
        send = torch.zeros(n, self.total, dtype=dtype, device=self.shards[0].device)
        offset = 0
        for g, numel, size in zip(grads, self.numels, self.sizes):
            if g is not None:  # (N, S_i) columns: row r goes to rank r
                padded = torch.zeros(n * size, dtype=dtype, device=g.device)
                padded[:numel] = g.reshape(-1)
                send[:, offset : offset + size] = padded.view(n, size)
            offset += size
        mine = torch.empty(self.total, dtype=dtype, device=send.device)
        reduce_scatter(mine, send.view(-1), group=self.owner.group)
        if self.owner.replicas > 1:  # HSDP: add the same piece's sums from the other copies
            dist.all_reduce(mine, group=self.owner.replicate_group)
        mine = mine.float().div_(n * self.owner.replicas)  # the sum -> the average, in fp32
        return list(mine.split(self.sizes))

    # backward's re-gather -------------------------------------------------------------
    def regather(self) -> list[torch.Tensor]:
        if self.regathered is None:
            self.regathered = self.gather()
            self.owner.prefetch_before(self)
        return self.regathered


class GatherUnit(torch.autograd.Function):
    """forward: shards (S_i,) fp32 each -> full weights (shape_i) in the compute dtype
    (all-gather). backward: full gradients (shape_i) -> shard gradients (S_i,) fp32,
    averaged over the ranks (reduce-scatter, / N)."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        return tuple(unit.gather())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *ctx.unit.reduce_scatter_grads(grads))


def _check_module(module: nn.Module, tensors: list[torch.Tensor], group: Any) -> None:
    """Refuse, before any collective, a module FSDP cannot shard as it stands."""
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"FSDP: {type(module).__name__} has no trainable parameters")
    devices = {t.device for t in tensors}
    if len(devices) > 1 or any(d.type == "meta" for d in devices):
        raise ValueError(f"FSDP: the module's tensors are on {sorted(map(str, devices))}; "
                         "move the whole module to one device (parlib.device()) first")
    if any(p.dtype != torch.float32 for p in module.parameters() if p.requires_grad):
        raise ValueError("FSDP: trainable parameters must be fp32 (the master weights); "
                         "pass compute_dtype for bf16/fp16 compute")
    if dist.get_backend(group) == "nccl" and next(iter(devices)).type != "cuda":
        raise ValueError("FSDP: the process group is NCCL but the module is on the CPU")


class FSDP(nn.Module):
    """Shard ``module`` over ``group`` (default: all ranks), ZeRO-3 style; see the module
    docstring. ``units``: names of submodules gathered one at a time (default: every child of
    every ``nn.ModuleList``, the blocks); the rest is the root unit. Name the blocks
    themselves (``["blocks.0", "blocks.1"]``): their ``nn.ModuleList`` never runs forward, so
    ``units=["blocks"]`` is refused. ``compute_dtype``:
    ``torch.bfloat16`` or ``torch.float16`` for mixed precision (weights cast before the
    all-gather; shards, optimizer state and shard gradients stay fp32). Frozen parameters
    and buffers stay whole on every rank (cast to the compute dtype for the forward).
    ``replicate``: trainable parameters not worth sharding, kept whole on every rank (fp32,
    cast for the forward) and their gradients averaged by one all-reduce in
    :meth:`finish_gradient_synchronization`: a rule's name (``"norms_and_biases"``,
    :func:`norms_and_biases`), any ``(name, param) -> bool``, or a collection of names.
    ``replicate_group``: HSDP (:mod:`parlib.strategies.fsdp_layout`). ``group`` is then
    this rank's shard group (one copy of the model, sharded over it) and ``replicate_group``
    the ranks holding the same shard in the other copies; each shard's gradient is
    reduce-scattered in ``group``, then averaged over ``replicate_group`` (one all-reduce).
    Every rank must wrap the same model (names and shapes, checked before the broadcast)."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, *,
                 units: list[str] | None = None, prefetch: bool = False,
                 recompute: bool = False, group: Any = None, replicate_group: Any = None,
                 broadcast_from: int = 0,
                 replicate: str | Callable[[str, nn.Parameter], bool] | Collection[str]
                 | None = None
                 ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"FSDP: compute_dtype must be one of {COMPUTE_DTYPES}, "
                             f"got {compute_dtype!r}")
        self.rank, self.world_size = rank_and_size(group, "FSDP")
        rows = None if replicate_group is None else check_hsdp_groups(group, replicate_group)
        self.replicate_group = replicate_group
        self.replicas = 1 if rows is None else len(rows)
        tensors = [*module.parameters(), *module.buffers()]
        _check_module(module, tensors, group)
        keep = replicate_rule(replicate, module)  # refused before any collective
        unit_names = unit_names_of(module, units)
        self.group, self.dtype = group, compute_dtype or torch.float32
        self.prefetch, self.recompute = prefetch, recompute
        agree_on_model("FSDP", module, group)
        if rows is None:
            broadcast_tensors(tensors, broadcast_from, group)  # rank 0's weights everywhere
        else:
            agree_on_model("FSDP", module, replicate_group)
            broadcast_over_mesh(tensors, broadcast_from, group, replicate_group, rows)
        self.full_names = [n for n, _ in module.named_parameters()]  # tied ones once
        owner_of: dict[int, str] = {}  # parameter id -> unit ("" is the root)
        for uname in unit_names:
            for p in module.get_submodule(uname).parameters():
                owner_of[id(p)] = uname if id(p) not in owner_of else ""  # shared: the root
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
            owner_of.setdefault(id(p), "")
        self.module = module
        # observers of every gather, e.g. parlib.measure.GatheredWeights (memory)
        self.gather_hooks: OrderedDict[int, Callable[[Unit, list[torch.Tensor]], None]] = \
            OrderedDict()  # RemovableHandle needs a dict it can refer to weakly
        self.units: list[Unit] = []
        self.replicated = [p for n, p in module.named_parameters()
                           if p.requires_grad and keep is not None and keep(n, p)]
        self._whole = {id(p) for p in self.replicated}
        trainable = [(n, p) for n, p in module.named_parameters()
                     if p.requires_grad and id(p) not in self._whole]
        for uname in ["", *unit_names]:
            sub = module.get_submodule(uname) if uname else module
            prefix = f"{uname}." if uname else ""
            mine = [(n, p) for n, p in trainable if owner_of[id(p)] == uname]
            unit = Unit(self, sub, [n[len(prefix):] for n, _ in mine])
            for (_, p), shard in zip(mine, unit.shards):  # every alias (tied) -> the shard
                for alias in aliases[id(p)]:
                    owner_name, _, leaf = alias.rpartition(".")
                    setattr(module.get_submodule(owner_name), leaf, shard)
            self.units.append(unit)
        for unit in self.units[1:]:
            self._wrap_forward(unit)
        # Why storage pointers: autograd saves the gathered weights for backward (a matmul
        # saves its weight, or a view of it: a transpose, a slice), and _pack must tell
        # them from activations without keeping them alive. Every gathered weight has a
        # storage of its own (Unit.gather copies it), and every view shares it, so the
        # storage's address names the weight whatever view autograd saves; a note (unit,
        # index, view geometry) replaces it and _unpack re-gathers. Why dropped when the
        # unit's forward ends: then the unit's full weights are freed, and the allocator may
        # hand their addresses to the next tensors (the next unit's weights, activations);
        # a stale key would turn an activation into a note for the wrong weight.
        self._ptrs: dict[int, tuple[Unit, int]] = {}  # storage of a gathered weight -> where

    # forward ------------------------------------------------------------------------
    def _wrap_forward(self, unit: Unit) -> None:
        inner_forward = unit.module.forward

        def sharded_forward(*args: Any, **kwargs: Any) -> Any:
            if getattr(unit, "computing", False):  # functional_call calls us back: compute
                return inner_forward(*args, **kwargs)
            if self.recompute and torch.is_grad_enabled():
                return checkpoint(self._run, unit, args, kwargs, use_reentrant=False)
            return self._run(unit, args, kwargs)

        unit.module.forward = sharded_forward

    def _run(self, unit: Unit, args: tuple, kwargs: dict) -> Any:
        fulls = GatherUnit.apply(unit, *unit.shards) if unit.shards else ()
        if self.prefetch and not self.recompute:
            self.prefetch_after(unit)
        tensors = dict(zip(unit.names, fulls))
        for name, t in [*unit.module.named_parameters(), *unit.module.named_buffers()]:
            shard = isinstance(t, nn.Parameter) and t.requires_grad and id(t) not in self._whole
            # shards are never cast (they are gathered in the compute dtype instead)
            if not shard and t.is_floating_point() and t.dtype != self.dtype:
                tensors.setdefault(name, t.to(self.dtype))  # frozen, replicated, buffers
        keys = [s.untyped_storage().data_ptr() for s in fulls]
        self._ptrs.update({k: (unit, i) for i, k in enumerate(keys)})
        unit.computing = True
        try:
            return torch.func.functional_call(unit.module, tensors, args, kwargs, strict=False)
        finally:
            unit.computing = False
            for k in keys:  # the weights die now: their addresses may be reused
                self._ptrs.pop(k, None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self._run(self.units[0], args, kwargs)

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            where = self._ptrs.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return t
        return t if where is None else _Note(where[0], where[1], t)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Note):
            return saved
        full = saved.unit.regather()[saved.index]
        return full.as_strided(saved.size, saved.stride, saved.offset)

    # prefetch -------------------------------------------------------------------------
    def prefetch_after(self, unit: Unit) -> None:
        i = self.units.index(unit)  # the root first, then the blocks in order
        if i + 1 < len(self.units):
            self.units[i + 1].start_gather()

    def prefetch_before(self, unit: Unit) -> None:
        i = self.units.index(unit)
        if self.prefetch and not self.recompute and i > 1:  # blocks run backward in reverse
            self.units[i - 1].start_gather()

    def register_gather_hook(self, hook: Callable[[Unit, list[torch.Tensor]], None]
                             ) -> RemovableHandle:
        """Call ``hook(unit, full_weights)`` after every all-gather of a unit's weights
        (forward, prefetch finished, or backward's re-gather); ``handle.remove()`` stops it.
        For observers (memory, timing), as ``nn.Module``'s hooks are: the strategy keeps no
        record of its own."""
        handle = RemovableHandle(self.gather_hooks)
        self.gather_hooks[handle.id] = hook
        return handle

    # after backward -------------------------------------------------------------------
    def finish_gradient_synchronization(self) -> None:
        """After backward, before ``optimizer.step()``: the reduce-scatters already ran in
        backward; every trainable shard gets a gradient (zeros if it had none), and the
        replicated parameters' gradients are averaged over the ranks (one all-reduce)."""
        for unit in self.units:
            unit.regathered = None
            if unit.pending is not None:  # a prefetch nobody used: its weights are stale now
                unit.pending[1].wait()
                unit.pending = None
            for s in unit.shards:
                if s.grad is None:
                    s.grad = torch.zeros_like(s)
        if self.replicated:  # every rank sends every one (zeros where it had no gradient)
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in self.replicated])
            dist.all_reduce(flat, group=self.group)
            if self.replicas > 1:
                dist.all_reduce(flat, group=self.replicate_group)
            pieces = flat.div_(self.world_size * self.replicas).split(
                [p.numel() for p in self.replicated])
            for p, g in zip(self.replicated, pieces):
                p.grad = g.view_as(p)

    sync = finish_gradient_synchronization

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor} under the unwrapped module's parameter names (every rank
        joins: it all-gathers)."""
        full: dict[str, torch.Tensor] = {}
        for unit in self.units:
            prefix = next(n for n, m in self.module.named_modules() if m is unit.module)
            for name, t in zip(unit.names, unit.gather(torch.float32) if unit.shards else []):
                full[f"{prefix}.{name}" if prefix else name] = t.clone()
        frozen = dict(self.module.named_parameters())
        return {n: full[n] if n in full else frozen[n].detach().clone() for n in self.full_names}


__all__ = ["COMPUTE_DTYPES", "FSDP", "GatherUnit", "REPLICATE_RULES", "Unit", "norms_and_biases",
           "replicate_rule"]
