"""The loss no layout can move: cross-entropy normalised by the global count of real tokens.

With padding and ignored positions (targets equal to ``ignore_index``), microbatches and
ranks hold different numbers of real tokens. Averaging each microbatch's mean (then over m
microbatches and N data-parallel ranks) weighs a token of a short microbatch more than one
of a long microbatch, so the loss and its gradient change with m, with N and after
resharding. One device computes sum(token losses) / T, T the real tokens of the whole batch;
every layout computes the same when each microbatch contributes

    sum of its token losses / T_global,    T_global = real tokens over every microbatch of
                                           every data-parallel rank (one all-reduce)

and the gradients are *summed* over the ranks. The course's gradient syncs (DataParallel,
Zero1, Zero2, FSDP) divide the summed gradient by N, so :func:`global_token_loss` takes
``averaged_over=N`` and multiplies by it, undoing that division.

    total = global_token_count([y for _, y in microbatches], group=dp_group)
    for x, y in microbatches:
        global_token_loss(model(x), y, total, averaged_over=dp_size).backward()
    sync(); opt.step()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlib.model import IGNORE_INDEX  # torch's cross_entropy default: counts for nothing


def real_tokens(targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many of ``targets`` are real (not ``ignore_index``), as an int64 tensor."""
    return (targets != ignore_index).sum()


def global_token_count(targets: Sequence[torch.Tensor] | torch.Tensor, *, group: Any = None,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The real tokens of this rank's microbatches (``targets``: one tensor or one per
    microbatch), summed over the ranks of ``group`` (default: all ranks) in one all-reduce;
    without a process group (one device), this rank's count. Every rank gets the same int64
    count; call it before the first microbatch's backward."""
    pieces = [targets] if isinstance(targets, torch.Tensor) else list(targets)
    if not pieces:
        raise ValueError("global_token_count: no microbatch targets given")
    count = sum(real_tokens(t, ignore_index) for t in pieces).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, group=group)
    return count[0]


def global_token_loss(logits: torch.Tensor, targets: torch.Tensor,
                      global_tokens: torch.Tensor | int, *, averaged_over: int = 1,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """This microbatch's share of the global loss: the sum of its real tokens' cross-entropy
    (``logits`` (..., V), ``targets`` (...)) divided by ``global_tokens``
    (:func:`global_token_count`), times ``averaged_over``, the number of ranks whose
    gradient sync divides by their count (the data-parallel size; 1 if the gradients are
    summed). Its backward, accumulated over the microbatches and synced, gives the gradient
    one device computes for the whole batch. The loss to report is the sum of the shares
    over the microbatches and ranks, divided by ``averaged_over``."""
    tokens = int(global_tokens)
    if tokens < 1:
        raise ValueError(f"global_token_loss: global_tokens is {tokens}: the batch has no real "
                         f"token (every target is ignore_index={ignore_index})")
    if averaged_over < 1:
        raise ValueError(f"global_token_loss: averaged_over must be >= 1 (the data-parallel "
                         f"size), got {averaged_over!r}")
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    return total * (averaged_over / tokens)


__all__ = ["IGNORE_INDEX", "global_token_count", "global_token_loss", "real_tokens"]
