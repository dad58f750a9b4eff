"""Collectives under the names every torch version knows, this rank's place in a group, and
the ranks' agreement on their settings.

torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` and
``all_gather_into_tensor`` to ``all_gather_single`` and deprecates the old names. This is
the only module that knows: the rest of parlib, and the learner's code, call
:func:`reduce_scatter` and :func:`all_gather`, which pick whichever this torch has, so the
same code runs on an older cluster. :func:`quiet_renames` hides the deprecation warnings
that torch's own code (FSDP, DTensor) still triggers through the old names.

:func:`agree` is the one set-up check the strategies share: the ranks exchange their
settings (shapes, dtypes, counts) once, and a mismatch raises the same message on every
rank, instead of the backend's size-mismatch abort, a hang or a silent wrong answer.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


def rank_and_size(group: Any = None, what: str = "this", *, required: bool = True,
                  allow_none: bool = True) -> tuple[int, int]:
    """(this rank's index in ``group``, the group's size); ``None`` is the default group,
    or refused with ``allow_none=False`` (functions whose group is always an argument).

    With no process group running: a clear error naming ``what`` needs one, or ``(0, 1)``
    (one rank on its own) when ``required=False``. A rank that is not a member of ``group``
    is refused: torch would give it rank -1 and size -1, which indexing and ring
    arithmetic turn into wrong answers instead of errors."""
    if group is None and not allow_none:
        raise ValueError(f"{what} needs its process group as an argument "
                         "(e.g. dist.group.WORLD or dist.new_group(ranks)), got None")
    if not (dist.is_available() and dist.is_initialized()):
        if not required:
            return 0, 1
        raise RuntimeError(
            f"{what} needs torch.distributed: the process group is not initialised. Run it on "
            "ranks (parlib.launch, a Cluster, %%ranks or torchrun), not in the notebook itself."
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(f"{what}: global rank {dist.get_rank()} is not a member of the "
                           f"group {_ranks_of(group)}; call it only on the group's ranks")
    return rank, dist.get_world_size(group)


def _ranks_of(group: Any) -> str:
    """The group's global ranks, for a message. On a non-member, dist.new_group returns
    the shared sentinel NON_GROUP_MEMBER, whose recorded ranks are those of the last group
    this rank was left out of, not necessarily this one: say so rather than mislead."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return ("(dist.new_group gave this rank GroupMember.NON_GROUP_MEMBER; torch does not "
                "keep the group's ranks on a non-member)")
    return str(dist.get_process_group_ranks(group))


_bookkeeping = threading.local()


@contextmanager
def bookkeeping() -> Iterator[None]:
    """Mark the collectives of the block as parlib's own checks, not a strategy's traffic:
    parlib's communication logs (``parlib.measure``) leave them out, so a log shows the
    messages the cost model predicts."""
    _bookkeeping.depth = getattr(_bookkeeping, "depth", 0) + 1
    try:
        yield
    finally:
        _bookkeeping.depth -= 1


def in_bookkeeping() -> bool:
    """Whether this thread is inside :func:`bookkeeping`."""
    return getattr(_bookkeeping, "depth", 0) > 0


_AGREED: dict[tuple[str, int], Any] = {}  # (what, id(group)) -> group, for once=True


def agree(what: str, group: Any, settings: Mapping[str, tuple[Any, str]],
          payload: Any = None, *, once: bool = False) -> list[Any]:
    """Check that every rank of ``group`` passes the same settings, once, before a
    strategy's first message: a mismatch would otherwise end in the backend's size-mismatch
    abort, a hang, or a silent wrong answer.

    ``settings``: name (the argument, as the learner wrote it) -> (this rank's value, the
    fix). Every rank calls it (one ``all_gather_object``, left out of communication logs);
    on a mismatch every rank raises the same ``ValueError``, naming ``what``, the first
    setting that differs, each rank's value (global ranks) and the fix. Returns every
    rank's ``payload`` in group order (for a check of its own, such as a whole schedule).

    ``once=True``: only on this process's first call of ``what`` with ``group`` (for a
    function called every step, where the first call is the set-up); every rank makes the
    same number of calls, so every rank skips or checks alike."""
    _, size = rank_and_size(group, what)
    key = (what, id(group))
    if size == 1 or (once and key in _AGREED):
        return [payload]
    mine = {name: value for name, (value, _) in settings.items()}
    every: list[Any] = [None] * size
    with bookkeeping():
        dist.all_gather_object(every, (mine, payload), group=group)
    for name, (_, fix) in settings.items():
        values = [theirs[name] for theirs, _ in every]
        if any(v != values[0] for v in values):
            raise ValueError(f"{what}: {name} differs across the ranks of its group "
                             f"({_by_rank(values, group)}); {fix}")
    if once:
        _AGREED[key] = group  # held, so that its id is not reused by another group
    return [theirs for _, theirs in every]


def _by_rank(values: list[Any], group: Any) -> str:
    """'rank 0: 4, rank 1: 3' (global ranks), ranks with equal values together."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    seen: list[tuple[Any, list[int]]] = []
    for rank, value in zip(ranks, values):
        for known, members in seen:
            if known == value:
                members.append(rank)
                break
        else:
            seen.append((value, [rank]))
    return ", ".join(f"rank{'s' if len(m) > 1 else ''} {', '.join(map(str, m))}: {v!r}"
                     for v, m in seen)


def quiet_renames() -> None:
    """Hide torch 2.13's deprecation warnings for the two renamed collectives."""
    warnings.filterwarnings(
        "ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated",
        category=FutureWarning,
    )


__all__ = ["agree", "all_gather", "bookkeeping", "in_bookkeeping", "quiet_renames",
           "rank_and_size", "reduce_scatter"]
