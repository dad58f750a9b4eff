"""A device mesh: which rank does what when data, tensor and pipeline parallelism combine.

N = d x t x p ranks are laid out as a 3-D grid with axes ``("pp", "dp", "tp")``, last axis
fastest-varying (row-major, like a C array of shape (p, d, t))::

    rank = (pp_index * d + dp_index) * t + tp_index

Why this order:

- **tp fastest**: the t ranks of a tensor-parallel group are adjacent (ranks 0..t-1,
  t..2t-1, ...). Launchers number the devices of one node consecutively, so a TP group
  lands inside one node, on its fast links: tensor parallelism talks at every layer.
- **pp outermost**: consecutive pipeline stages are d x t ranks apart, so when a node is
  full the axis that crosses nodes is the one that sends least (one activation per
  microbatch per boundary). torchtitan (``["pp", "dp", "tp"]``) and Megatron-LM (tp, dp,
  pp from fastest to slowest) use the same order.

:func:`coords` and :func:`axis_ranks` are the layout as plain arithmetic (no processes).
:class:`Mesh` creates the process group of every axis once, inside a launched run, and
hands them out; strategies take them as arguments and never read a global.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

AXES = ("pp", "dp", "tp")  # slowest to fastest varying


def _sizes(dp: int, pp: int, tp: int) -> dict[str, int]:
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    for axis, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"mesh size {axis}={n!r} must be a whole number >= 1")
    return sizes


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")


def coords(rank: int, *, dp: int, pp: int, tp: int) -> dict[str, int]:
    """The (pp, dp, tp) indices of global ``rank`` in a d x t x p mesh (tp fastest)."""
    sizes = _sizes(dp, pp, tp)
    n = dp * pp * tp
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside a mesh of {n} ranks (dp={dp}, pp={pp}, "
                         f"tp={tp})")
    out = {}
    for axis in reversed(AXES):  # peel off the fastest axis first
        rank, out[axis] = divmod(rank, sizes[axis])
    return {axis: out[axis] for axis in AXES}


def rank_at(*, dp: int, pp: int, tp: int, coord: dict[str, int]) -> int:
    """The global rank at coordinates ``coord`` (keys "pp", "dp", "tp")."""
    sizes = _sizes(dp, pp, tp)
    rank = 0
    for axis in AXES:
        i = coord[axis]
        if not 0 <= i < sizes[axis]:
            raise ValueError(f"{axis} index {i} is outside [0, {sizes[axis]})")
        rank = rank * sizes[axis] + i
    return rank


def axis_ranks(axis: str, rank: int, *, dp: int, pp: int, tp: int) -> list[int]:
    """Global ranks of ``rank``'s group along ``axis``, in order of their index on it:
    every rank whose other two coordinates equal ``rank``'s."""
    _check_axis(axis)
    sizes = _sizes(dp, pp, tp)
    mine = coords(rank, dp=dp, pp=pp, tp=tp)
    return [rank_at(dp=dp, pp=pp, tp=tp, coord={**mine, axis: i}) for i in range(sizes[axis])]


def all_groups(axis: str, *, dp: int, pp: int, tp: int) -> list[list[int]]:
    """Every group along ``axis`` (each a list of global ranks), ordered by lowest rank."""
    seen: dict[int, list[int]] = {}
    for r in range(dp * pp * tp):
        members = axis_ranks(axis, r, dp=dp, pp=pp, tp=tp)
        seen.setdefault(members[0], members)
    return [seen[k] for k in sorted(seen)]


def pipeline_neighbours(rank: int, *, dp: int, pp: int, tp: int) -> tuple[int | None,
                                                                           int | None]:
    """Global ranks of the previous and next pipeline stage of ``rank`` (None at the ends):
    the same dp and tp index, pp index one less / one more (d x t ranks away)."""
    group = axis_ranks("pp", rank, dp=dp, pp=pp, tp=tp)
    i = coords(rank, dp=dp, pp=pp, tp=tp)["pp"]
    return (group[i - 1] if i > 0 else None, group[i + 1] if i < pp - 1 else None)


class Mesh:
    """This rank's place in a d x t x p mesh over the current world, with one process
    group per axis (created once, here; every rank must build the same Mesh).

    ``mesh.coord("tp")``: this rank's index along an axis; ``mesh.group("dp")``: the
    process group of that axis containing this rank; ``mesh.ranks("pp")``: its global
    ranks in order; ``mesh.pp_prev`` / ``mesh.pp_next``: global ranks of the neighbouring
    stages (None at the ends). Raises ValueError if d x t x p is not the world size.
    """

    def __init__(self, *, dp: int = 1, pp: int = 1, tp: int = 1) -> None:
        self.sizes = _sizes(dp, pp, tp)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Mesh needs a process group: build it inside parlib.launch "
                               "(or use parlib.strategies.mesh.coords for the arithmetic)")
        world = dist.get_world_size()
        if dp * pp * tp != world:
            raise ValueError(f"mesh dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, but "
                             f"the world has {world}: the product must equal the world size")
        self.dp, self.pp, self.tp = dp, pp, tp
        self.rank = dist.get_rank()
        self._coords = coords(self.rank, dp=dp, pp=pp, tp=tp)
        self._ranks: dict[str, list[int]] = {}
        self._groups: dict[str, Any] = {}
        for axis in AXES:
            # new_group is collective: every rank creates every group, in the same order,
            # and keeps the one it belongs to.
            for members in all_groups(axis, dp=dp, pp=pp, tp=tp):
                group = dist.new_group(members)
                if self.rank in members:
                    self._ranks[axis], self._groups[axis] = members, group
        self.pp_prev, self.pp_next = pipeline_neighbours(self.rank, dp=dp, pp=pp, tp=tp)

    def coord(self, axis: str) -> int:
        """This rank's index along ``axis`` ("dp", "pp" or "tp")."""
        _check_axis(axis)
        return self._coords[axis]

    def group(self, axis: str) -> Any:
        """The process group of ``axis`` that contains this rank."""
        _check_axis(axis)
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in order of their index on it."""
        _check_axis(axis)
        return list(self._ranks[axis])

    def size(self, axis: str) -> int:
        _check_axis(axis)
        return self.sizes[axis]

    def describe(self) -> str:
        c = self._coords
        return (f"rank {self.rank}: pp={c['pp']} dp={c['dp']} tp={c['tp']} | "
                f"tp group {self.ranks('tp')}, dp group {self.ranks('dp')}, "
                f"pp group {self.ranks('pp')} (prev {self.pp_prev}, next {self.pp_next})")

    def __repr__(self) -> str:
        return f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}, rank={self.rank})"


def torch_device_mesh_ranks(*, dp: int, pp: int, tp: int,
                            device_type: str | None = None) -> dict[str, list[int]]:
    """This rank's group along each axis as PyTorch's ``init_device_mesh`` builds it for the
    same shape and dimension names ``("pp", "dp", "tp")``: to check :class:`Mesh` against."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=AXES)
    return {axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in AXES}


__all__ = ["AXES", "Mesh", "all_groups", "axis_ranks", "coords", "pipeline_neighbours",
           "rank_at", "torch_device_mesh_ranks"]
