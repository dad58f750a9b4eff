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
rows of the global batch) and :func:`setup` (a model, optimizer and gradient sync for each
strategy). The training step is :func:`parlib.model.train_step`; the single-device run to
check against is in :mod:`parlib.verify`. ``reduce_scatter`` and ``all_gather`` come from
:mod:`parlib.comm`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.comm import all_gather, reduce_scatter
from parlib.model import ModelConfig, build_model, make_batch, make_optimizer
from parlib.runtime.policy import device as this_device
from parlib.strategies.zero import Zero1


def _world(group: Any = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


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
    r, n = _world()
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
    _, n = _world(group)
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
        self.world_size = _world(group)[1]
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
# Training helpers and checks
# --------------------------------------------------------------------------------------


STRATEGIES = ("single", "naive", "bucketed", "overlapped", "ddp", "zero1")


def setup(
    kind: str,
    cfg: ModelConfig | None = None,
    *,
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.1,
    bucket_mb: float = 25.0,
    device: torch.device | str | None = None,
) -> tuple[nn.Module, Any, Callable[[], Any] | None]:
    """A fresh model, its optimizer and its gradient sync for one strategy in ``STRATEGIES``.

    Returns ``(model, optimizer, sync)`` ready for :func:`train_step`. ``"single"`` has no
    sync (one device, or every rank on its own); ``"ddp"`` wraps the model in
    ``DistributedDataParallel`` (which syncs inside backward); ``"zero1"`` returns a
    :class:`Zero1` as the optimizer.
    """
    if device is None:
        device = this_device()
    model = build_model(cfg, seed).to(device)
    sync: Callable[[], Any] | None = None
    if kind == "single":
        opt = make_optimizer(model.parameters(), optimizer, lr)
    elif kind == "naive":
        opt = make_optimizer(model.parameters(), optimizer, lr)
        sync = lambda: allreduce_gradients(model)  # noqa: E731
    elif kind == "bucketed":
        opt = make_optimizer(model.parameters(), optimizer, lr)
        sync = Bucketed(model, bucket_mb, first_bucket_mb=min(1.0, bucket_mb))
    elif kind == "overlapped":
        opt = make_optimizer(model.parameters(), optimizer, lr)
        sync = Overlapped(model, bucket_mb, first_bucket_mb=min(1.0, bucket_mb))
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        dev = torch.device(device)
        ids = [dev.index if dev.index is not None else 0] if dev.type == "cuda" else None
        model = DistributedDataParallel(
            model, device_ids=ids
        )  # production defaults (25 MiB buckets)
        opt = make_optimizer(model.parameters(), optimizer, lr)
    elif kind == "zero1":
        cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
        opt = Zero1(model.parameters(), cls, lr=lr)
    else:
        raise ValueError(f"kind must be one of {STRATEGIES}, got {kind!r}")
    return model, opt, sync


__all__ = [
    "reduce_scatter",
    "all_gather",
    "shard_rows",
    "local_batch",
    "allreduce_gradients",
    "make_buckets",
    "Bucketed",
    "Overlapped",
    "Zero1",
    "STRATEGIES",
    "setup",
]
