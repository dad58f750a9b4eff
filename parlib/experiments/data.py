"""The data-parallel chapter's experiment setups: a fresh model, its optimizer and its
gradient sync for each way of training in :data:`STRATEGIES`, so the notebook and the
benchmarks can race them on the same footing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from parlib.model import ModelConfig, build_model, make_optimizer
from parlib.runtime.policy import device as this_device
from parlib.strategies.data import SYNC_KINDS, gradient_sync
from parlib.strategies.zero import Zero1

STRATEGIES = ("single", "naive", "bucketed", "overlapped", "ddp", "zero1")
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


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

    Returns ``(model, optimizer, sync)`` ready for :func:`parlib.model.train_step`.
    ``"single"`` has no sync (one device, or every rank on its own); ``"ddp"`` wraps the
    model in ``DistributedDataParallel`` (which syncs inside backward); ``"zero1"`` returns
    a :class:`~parlib.strategies.zero.Zero1` as the optimizer. ``optimizer``: "sgd" or
    "adam". ``device``: this rank's device (``parlib.device()``) when None.
    """
    if kind not in STRATEGIES:
        raise ValueError(f"kind must be one of {STRATEGIES}, got {kind!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
    if device is None:
        device = this_device()
    model = build_model(cfg, seed).to(device)
    sync: Callable[[], Any] | None = None
    if kind in SYNC_KINDS:
        sync = gradient_sync(kind, model, bucket_mb=bucket_mb,
                             first_bucket_mb=min(1.0, bucket_mb))
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        dev = torch.device(device)
        ids = [dev.index if dev.index is not None else 0] if dev.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)  # production defaults
    if kind == "zero1":
        return model, Zero1(model.parameters(), OPTIMIZERS[optimizer], lr=lr), None
    return model, make_optimizer(model.parameters(), optimizer, lr), sync


__all__ = ["OPTIMIZERS", "STRATEGIES", "setup"]
