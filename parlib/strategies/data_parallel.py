"""``DataParallel``: the chapter's gradient syncs as a drop-in for ``DistributedDataParallel``.

    model = parlib.DataParallel(TinyGPT(cfg))          # every rank now holds rank 0's weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model(x), y).backward()                     # x, y: this rank's rows of the batch
    model.finish_gradient_synchronization()             # gradients averaged over the ranks
    opt.step(); opt.zero_grad()

The pooling is done by the pieces of :mod:`parlib.strategies.data`: ``"naive"``
(:func:`allreduce_gradients`), ``"bucketed"`` (:class:`Bucketed`) or ``"overlapped"``
(:class:`Overlapped`, all-reduces started inside backward). Two differences from torch's DDP:
the sync is finished by an explicit call (DDP does it inside backward, in C++), and buffers are
broadcast once at construction (DDP re-broadcasts them before every forward).
``loss_fn``'s mean over each rank's rows is the whole batch's only when every rank holds as
many real targets; with padding (``IGNORE_INDEX``) normalise by the global count instead
(:mod:`parlib.strategies.token_loss`, or ``parlib.model.train_step(..., group=group)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from parlib.comm import rank_and_size
from parlib.strategies.data import SYNC_KINDS, Overlapped, gradient_sync
from parlib.strategies.zero import agree_on_model, broadcast_tensors

SYNCS = (*SYNC_KINDS, None)


class DataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``group`` (default: all ranks).

    At construction, every parameter and buffer (frozen ones too) is overwritten with global
    rank ``broadcast_from``'s values. After ``backward()``, call
    :meth:`finish_gradient_synchronization` (or ``sync()``) before the optimizer step: it
    leaves in each ``p.grad`` the average of the ranks' gradients. ``sync`` picks how:
    ``"overlapped"``, ``"bucketed"`` (buckets of ``bucket_mb`` MiB, the first one
    ``first_bucket_mb``) or ``"naive"``; ``None`` only broadcasts (for :class:`Zero1`, which
    pools the gradients itself).

    Frozen parameters (``requires_grad=False``) are never touched; a parameter shared by two
    modules (tied weights) is pooled once; a parameter with no gradient this step joins the
    collective with zeros, since every rank must issue the same calls.
    ``state_dict()`` / ``load_state_dict()`` are the wrapped module's (keys without a
    ``module.`` prefix, as DDP's ``.module.state_dict()``): a checkpoint loads straight into
    the unwrapped model. Keep DataParallel the outermost module for that to hold.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        sync: str | None = "overlapped",
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        group: Any = None,
        broadcast_from: int = 0,
    ) -> None:
        super().__init__()
        if sync not in SYNCS:
            raise ValueError(f"DataParallel: unknown sync {sync!r}; choose one of {SYNCS}")
        params = list(module.parameters())  # each tied tensor once
        if not params:
            raise ValueError(f"DataParallel: {type(module).__name__} has no parameters to train")
        devices = {t.device for t in params} | {t.device for t in module.buffers()}
        if len(devices) > 1:
            raise ValueError(f"DataParallel: the module's parameters and buffers are on "
                             f"different devices ({', '.join(sorted(map(str, devices)))}); "
                             "move the whole module to one device (parlib.device()) first")
        rank_and_size(group, "DataParallel")
        self.module = module
        self.group = group
        agree_on_model("DataParallel", module, group)
        broadcast_tensors([*params, *module.buffers()], broadcast_from, group)

        trainable = [p for p in params if p.requires_grad]
        self._pooler: Callable[[], None] | None = None
        self._overlapped: Overlapped | None = None
        if sync is not None:
            self._pooler = gradient_sync(sync, trainable, group=group, bucket_mb=bucket_mb,
                                         first_bucket_mb=first_bucket_mb)
            if isinstance(self._pooler, Overlapped):  # its hooks pause under no_sync()
                self._overlapped = self._pooler
        self.sync_kind = sync
        self._accumulating = False  # inside no_sync()
        self._grads_waiting = False  # a backward has run since the last sync
        self._hooks = [p.register_post_accumulate_grad_hook(self._note_gradient)
                       for p in trainable]

    def _note_gradient(self, _p: torch.Tensor) -> None:
        if not self._accumulating:
            self._grads_waiting = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Average the gradients over the ranks (or wait for the overlapped all-reduces).

        Does nothing when no backward has run since the last call (so calling it twice, or
        before backward, is harmless) and inside :meth:`no_sync`.
        """
        if self._pooler is None or not self._grads_waiting:
            return
        self._pooler()
        self._grads_waiting = False

    sync = finish_gradient_synchronization

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block only add into ``p.grad``
        on this rank; the first synced step after it pools the accumulated sum."""
        previous = self._accumulating
        self._accumulating = True
        if self._overlapped is not None:
            self._overlapped.paused = True
        try:
            yield
        finally:
            self._accumulating = previous
            if self._overlapped is not None:
                self._overlapped.paused = previous

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def remove_hooks(self) -> None:
        """Take every gradient hook off the wrapped module's parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._overlapped is not None:
            self._overlapped.remove()


__all__ = ["SYNCS", "DataParallel"]
