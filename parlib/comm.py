"""Collectives under the names every torch version knows, and this rank's place in a group.

torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` and
``all_gather_into_tensor`` to ``all_gather_single`` and deprecates the old names. This is
the only module that knows: the rest of parlib, and the learner's code, call
:func:`reduce_scatter` and :func:`all_gather`, which pick whichever this torch has, so the
same code runs on an older cluster. :func:`quiet_renames` hides the deprecation warnings
that torch's own code (FSDP, DTensor) still triggers through the old names.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

_REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)
_ALL_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
    """Sum ``input`` (N x S elements) over the ranks; rank r receives elements
    [r*S, (r+1)*S) into ``output`` (S elements)."""
    return getattr(dist, _REDUCE_SCATTER)(output, input, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    """Concatenate every rank's ``input`` (S elements) into ``output`` (N x S), in rank
    order."""
    return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


def rank_and_size(group: Any = None, what: str = "this", *,
                  required: bool = True) -> tuple[int, int]:
    """(this rank's index in ``group``, the group's size); ``None`` is the default group.

    With no process group running: a clear error naming ``what`` needs one, or ``(0, 1)``
    (one rank on its own) when ``required=False``."""
    if not (dist.is_available() and dist.is_initialized()):
        if not required:
            return 0, 1
        raise RuntimeError(
            f"{what} needs torch.distributed: the process group is not initialised. Run it on "
            "ranks (parlib.launch, a Cluster, %%ranks or torchrun), not in the notebook itself."
        )
    return dist.get_rank(group), dist.get_world_size(group)


def quiet_renames() -> None:
    """Hide torch 2.13's deprecation warnings for the two renamed collectives."""
    warnings.filterwarnings(
        "ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated",
        category=FutureWarning,
    )


__all__ = ["all_gather", "quiet_renames", "rank_and_size", "reduce_scatter"]
