"""What :class:`parlib.FSDP` shards, and over which ranks: the units gathered one at a time
(``units=``), the parameters kept whole (``replicate=``), and HSDP's two groups
(``group=`` the shard group, ``replicate_group=`` the copies of it).

HSDP (hybrid sharded data parallelism; FSDP2's ``fully_shard`` on a 2-D mesh
("replicate", "shard"), torchtitan's dp_replicate x dp_shard): the ranks form an
r x s grid. Each row (a *shard group*, s ranks, best inside one node) holds one copy of the
model sharded s ways, ZeRO-3 style; the rank at position i of every row holds the same
piece i, and those r ranks form a column (a *replicate group*, usually across nodes). The
gathers and reduce-scatters stay inside a row; one all-reduce of each 1/s gradient piece
crosses the column. :func:`check_hsdp_groups` refuses groups that do not form such a grid.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.comm import agree, rank_and_size
from parlib.strategies.zero import broadcast_tensors


def norms_and_biases(name: str, param: nn.Parameter) -> bool:
    """``replicate=`` rule: keep the 1-D parameters (norm weights, biases) whole (small)."""
    return param.ndim == 1


REPLICATE_RULES: dict[str, Callable[[str, nn.Parameter], bool]] = {
    "norms_and_biases": norms_and_biases}


def replicate_rule(replicate: Any, module: nn.Module
                   ) -> Callable[[str, nn.Parameter], bool] | None:
    """``replicate=`` as a ``(name, param) -> bool`` rule: a rule's name
    (:data:`REPLICATE_RULES`), a callable, or a collection of parameter names (each one
    must exist). Anything else is refused: a string taken as a collection of names would be
    a set of characters, and replicate nothing."""
    if replicate is None or callable(replicate):
        return replicate
    if isinstance(replicate, str):
        if replicate not in REPLICATE_RULES:
            raise ValueError(f"FSDP: replicate={replicate!r} names no rule; the rules are "
                             f"{', '.join(map(repr, REPLICATE_RULES))} (or pass a "
                             f"(name, param) -> bool function, or a list of parameter names)")
        return REPLICATE_RULES[replicate]
    if not isinstance(replicate, Collection) or not all(isinstance(n, str) for n in replicate):
        raise TypeError(f"FSDP: replicate must be a rule's name, a (name, param) -> bool "
                        f"function or a collection of parameter names, got {replicate!r}")
    names = set(replicate)
    unknown = sorted(names - {n for n, _ in module.named_parameters()})
    if unknown:
        raise ValueError(f"FSDP: replicate names parameters the module does not have: "
                         f"{', '.join(unknown)}")
    return lambda name, _p: name in names


def _default_units(module: nn.Module) -> list[str]:
    return [f"{name}.{i}" for name, child in module.named_modules()
            if isinstance(child, nn.ModuleList) for i in range(len(child))]


def unit_names_of(module: nn.Module, units: list[str] | None) -> list[str]:
    """``units=`` checked: names of submodules that run a forward of their own. A container
    (``nn.ModuleList``, ``nn.ModuleDict``) never does, so its weights would never be
    gathered: it is refused, naming its children to pass instead."""
    if units is None:
        return _default_units(module)
    if isinstance(units, str) or not all(isinstance(u, str) for u in units):
        raise TypeError(f"FSDP: units takes a list of submodule names, e.g. ['blocks.0', "
                        f"'blocks.1'] (the default: every block), got {units!r}")
    for name in units:
        sub = module.get_submodule(name)
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            children = [f"{name}.{child}" for child, _ in sub.named_children()]
            shown = ", ".join(map(repr, children[:3])) + (", ..." if len(children) > 3 else "")
            raise ValueError(
                f"FSDP: units names {name!r}, an nn.{type(sub).__name__}: a container never "
                f"runs forward itself, so its weights would never be gathered. Pass its "
                f"blocks, units=[{shown}], or leave units=None (every child of every "
                f"ModuleList)")
    return list(units)



def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def check_hsdp_groups(group: Any, replicate_group: Any) -> list[list[int]]:
    """HSDP's groups checked on every rank (one ``all_gather_object`` over the replicate
    group): this rank is a member of both; they meet only at this rank; every rank of the
    replicate group has a shard group of the same size, and holds the same position in it
    (the same piece of every weight). Returns the shard group of each replicate-group member
    (global ranks, in replicate-group order)."""
    rank_and_size(group, "FSDP (group=, the shard group)")
    rank_and_size(replicate_group, "FSDP (replicate_group=)")
    me, shard_ranks, copy_ranks = dist.get_rank(), _ranks(group), _ranks(replicate_group)
    both = sorted(set(shard_ranks) & set(copy_ranks) - {me})
    fix = ("pass group= one row of the mesh (the ranks sharing one sharded copy of the model, "
           "e.g. mesh['shard'].get_group()) and replicate_group= one column (the ranks "
           "holding the same shard in every copy, mesh['replicate'].get_group())")
    if both:
        raise ValueError(f"FSDP: rank {me}'s shard group {shard_ranks} and replicate group "
                         f"{copy_ranks} share ranks {both}; they must meet only at rank {me}: "
                         f"{fix}")
    settings = {"the shard group's size": (len(shard_ranks), fix),
                "the position in the shard group": (shard_ranks.index(me), fix)}
    rows = agree("FSDP (replicate_group=)", replicate_group, settings, payload=shard_ranks)
    seen = [r for row in rows for r in row]
    if len(seen) != len(set(seen)):
        raise ValueError(f"FSDP: the shard groups of replicate group {copy_ranks} overlap "
                         f"({rows}); {fix}")
    return rows


def broadcast_over_mesh(tensors: Iterable[torch.Tensor], src: int, group: Any,
                        replicate_group: Any, rows: list[list[int]]) -> None:
    """Every rank of the grid gets global rank ``src``'s values: first down each column,
    from the row that holds ``src``, then along each row, from the position ``src`` holds."""
    tensors = list(tensors)
    holder = next((j for j, row in enumerate(rows) if src in row), None)
    if holder is None:
        raise ValueError(f"FSDP: broadcast_from={src} is in none of the shard groups {rows}: "
                         f"pass a global rank of the grid, whose weights every rank starts "
                         f"from")
    broadcast_tensors(tensors, _ranks(replicate_group)[holder], replicate_group)
    broadcast_tensors(tensors, _ranks(group)[rows[holder].index(src)], group)


__all__ = ["REPLICATE_RULES", "broadcast_over_mesh", "check_hsdp_groups", "norms_and_biases",
           "replicate_rule", "unit_names_of"]
