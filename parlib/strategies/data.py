"""Data parallelism, built from plain ``torch.distributed`` calls.

Every rank holds the whole model, computes gradients on its own rows of the batch, and the
ranks pool their gradients before the optimizer step. The pieces, from simplest to fastest:

- :func:`allreduce_gradients`: one all-reduce per parameter, then divide by N.
- :class:`Bucketed`: flatten gradients into a few large buffers, one all-reduce each.
- :class:`Overlapped`: the same buckets, each all-reduced asynchronously from a
  ``register_post_accumulate_grad_hook`` as soon as its gradients are ready, so
  communication runs during the rest of backward; ``wait()`` before the step.
- :class:`Zero1` (in :mod:`parlib.strategies.zero`, re-exported here): ZeRO stage 1.
  Reduce-scatter the gradients, step only this rank's shard of the optimizer state,
  all-gather the updated parameters.

:class:`parlib.DataParallel` (:mod:`parlib.strategies.data_parallel`) wraps these syncs in an
``nn.Module`` shaped like torch's ``DistributedDataParallel``.

Helpers shared with later chapters: :func:`shard_rows` / :func:`local_batch` (this rank's
rows of the global batch) and :func:`gradient_sync` (one sync by name; the experiments'
``setup`` builds a model, optimizer and sync for each). The training step is
:func:`parlib.model.train_step`; the single-device run to check against is in
:mod:`parlib.verify`. ``reduce_scatter`` and ``all_gather`` come from :mod:`parlib.comm`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.comm import all_gather, rank_and_size, reduce_scatter
from parlib.model import ModelConfig, make_batch
from parlib.strategies.zero import Zero1


def _params(model_or_params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return [p for p in model_or_params.parameters() if p.requires_grad]
    return [p for p in model_or_params if p.requires_grad]


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def shard_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows ``[rank*b, (rank+1)*b)`` of ``t`` where ``b = B // world_size``."""
    if t.shape[0] % world_size:
        raise ValueError(
            f"batch of {t.shape[0]} rows does not split evenly over {world_size} ranks"
        )
    b = t.shape[0] // world_size
    return t[rank * b : (rank + 1) * b]


def local_batch(
    global_batch: int,
    cfg: ModelConfig | None = None,
    step: int = 0,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share (B/N rows) of global batch ``step``: (tokens, targets) on ``device``."""
    r, n = rank_and_size(required=False)
    rank = r if rank is None else rank
    world_size = n if world_size is None else world_size
    x, y = make_batch(global_batch, cfg, step, seed)
    x, y = shard_rows(x, rank, world_size), shard_rows(y, rank, world_size)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


# --------------------------------------------------------------------------------------
# Naive: one all-reduce per parameter
# --------------------------------------------------------------------------------------


def allreduce_gradients(
    model_or_params: nn.Module | Iterable[torch.Tensor], *, average: bool = True, group: Any = None
) -> None:
    """Sum every parameter's gradient over the ranks, then divide by N (``average=True``).

    One all-reduce per parameter: simple, and slow when there are many small tensors,
    because each call pays the per-message latency.
    """
    _, n = rank_and_size(group, required=False)
    for p in _params(model_or_params):
        if p.grad is None:  # unused this step: every rank must still join the collective
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        if average:
            p.grad.div_(n)


# --------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------


def make_buckets(
    params: Sequence[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> list[list[torch.Tensor]]:
    """Group ``params`` in *reverse* order (the order backward produces their gradients)
    into buckets of at most ``bucket_bytes`` (a bigger tensor gets a bucket of its own).

    ``first_bucket_bytes`` caps the first bucket separately. DDP uses 1 MiB for it and
    25 MiB for the rest, so the first all-reduce can start early in backward, while the
    later ones are few and large.
    """
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        cap = bucket_bytes
        if not buckets and first_bucket_bytes is not None:
            cap = first_bucket_bytes
        if current and (
            size + nbytes > cap or p.dtype != current[0].dtype or p.device != current[0].device
        ):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class Bucketed:
    """Flatten gradients into buckets of at most ``bucket_mb`` MiB (the first one at most
    ``first_bucket_mb``); one all-reduce per bucket. The defaults are DDP's: 1 MiB, then
    25 MiB.

    ``sync()`` after ``backward()``: copies each bucket's gradients into a flat buffer,
    all-reduces it, divides by N and copies the averages back into ``p.grad``.
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        bucket_mb: float = 25.0,
        group: Any = None,
        first_bucket_mb: float | None = 1.0,
    ) -> None:
        self.params = _params(model_or_params)
        self.group = group
        self.world_size = rank_and_size(group, required=False)[1]
        first = None if first_bucket_mb is None else int(first_bucket_mb * 2**20)
        self.buckets = make_buckets(self.params, int(bucket_mb * 2**20), first)
        self.buffers = [
            torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
            for b in self.buckets
        ]

    def _fill(self, i: int) -> torch.Tensor:
        buf, offset = self.buffers[i], 0
        for p in self.buckets[i]:
            n = p.numel()
            if p.grad is None:
                buf[offset : offset + n].zero_()
            else:
                buf[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return buf

    def _unfill(self, i: int) -> None:
        buf, offset = self.buffers[i], 0
        buf.div_(self.world_size)
        for p in self.buckets[i]:
            n = p.numel()
            view = buf[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
            offset += n

    def sync(self) -> None:
        for i in range(len(self.buckets)):
            dist.all_reduce(self._fill(i), group=self.group)
            self._unfill(i)

    __call__ = sync


class Overlapped(Bucketed):
    """Buckets all-reduced *during* backward.

    A ``register_post_accumulate_grad_hook`` on every parameter counts down its bucket; when
    the last gradient of a bucket has arrived, the bucket is copied into its buffer and an
    async all-reduce starts, while autograd carries on with earlier layers. Buckets are
    launched strictly in order 0, 1, 2, ... so every rank issues the same sequence of
    collectives. Call ``wait()`` after ``backward()`` and before ``optimizer.step()``.
    Call ``remove()`` to take the hooks off. While ``paused`` is true the hooks ignore
    gradients (gradient accumulation: ``DataParallel.no_sync``).
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        bucket_mb: float = 25.0,
        group: Any = None,
        first_bucket_mb: float | None = 1.0,
    ) -> None:
        super().__init__(model_or_params, bucket_mb, group, first_bucket_mb)
        self._bucket_of = {}
        for i, b in enumerate(self.buckets):
            for p in b:
                self._bucket_of[id(p)] = i
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        self._pending = [len(b) for b in self.buckets]
        self._works: list[Any] = [None] * len(self.buckets)
        self._next = 0  # next bucket to launch

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            i = self._next
            self._works[i] = dist.all_reduce(self._fill(i), group=self.group, async_op=True)
            self._next += 1

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.paused:
            return
        self._pending[self._bucket_of[id(p)]] -= 1
        self._launch_ready()

    def wait(self) -> None:
        """Launch any bucket whose gradients never arrived (unused parameters), wait for
        every all-reduce, write the averages into ``p.grad``, and re-arm for the next step."""
        for i in range(self._next, len(self.buckets)):
            self._pending[i] = 0
        self._launch_ready()
        for i, work in enumerate(self._works):
            work.wait()
            self._unfill(i)
        self._reset()

    sync = wait
    __call__ = wait

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# --------------------------------------------------------------------------------------
# One sync by name
# --------------------------------------------------------------------------------------


SYNC_KINDS = ("naive", "bucketed", "overlapped")


def gradient_sync(kind: str, model_or_params: nn.Module | Iterable[torch.Tensor], *,
                  group: Any = None, bucket_mb: float = 25.0,
                  first_bucket_mb: float | None = 1.0) -> Callable[[], Any]:
    """The gradient sync called ``kind`` (one of :data:`SYNC_KINDS`) over ``group``: a
    callable that averages the gradients after backward. "naive": one all-reduce per
    parameter; "bucketed": flat buckets of ``bucket_mb`` MiB (the first one
    ``first_bucket_mb``); "overlapped": the same buckets all-reduced during backward (an
    :class:`Overlapped`; calling it waits for them)."""
    if kind == "naive":
        return lambda: allreduce_gradients(model_or_params, group=group)
    if kind == "bucketed":
        return Bucketed(model_or_params, bucket_mb, group, first_bucket_mb)
    if kind == "overlapped":
        return Overlapped(model_or_params, bucket_mb, group, first_bucket_mb)
    raise ValueError(f"unknown gradient sync {kind!r}; choose one of {SYNC_KINDS}")


__all__ = [
    "reduce_scatter",
    "all_gather",
    "shard_rows",
    "local_batch",
    "allreduce_gradients",
    "make_buckets",
    "Bucketed",
    "Overlapped",
    "SYNC_KINDS",
    "Zero1",
    "gradient_sync",
]
