"""A device mesh: which rank does what when pipeline, data, context, tensor and expert
parallelism combine.

The layout (how many ways each axis splits) and the rank order (tp fastest, then cp, dp, pp
slowest, and why; ep borrowing dp x cp, or dp x cp x tp as torchtitan does) are
:class:`parlib.cost.Layout`'s: plain arithmetic, no processes.
:class:`Mesh` creates the process group of every axis once, inside a launched run, and
hands them out; strategies take them as arguments and never read a global.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from parlib.comm import rank_and_size
from parlib.cost.layout import AXIS_NAMES, Layout, axis


class Mesh:
    """This rank's place in a layout over the current world, with one process group per
    axis (created once, here; every rank must build the same Mesh).

    ``Mesh(Layout(dp=2, tp=2))`` or ``Mesh(dp=2, tp=2)`` (missing axes are 1).
    ``mesh.coord("tp")``: this rank's index along an axis; ``mesh.group("dp")``: the
    process group of that axis containing this rank; ``mesh.ranks("pp")``: its global
    ranks in order; ``mesh.size("pp")`` (or ``mesh.pp``): the axis's size;
    ``mesh.pp_prev`` / ``mesh.pp_next``: global ranks of the neighbouring stages (None at
    the ends). With ep > 1, ``mesh.group("ep")`` splits the experts (placed by the layout's
    ``ep_borrows``) and ``mesh.expert_replica_group()`` holds the same experts, the group
    their gradients sync over. Raises ValueError if the layout's size is not the world size.
    """

    def __init__(self, layout: Layout | None = None, **sizes: int) -> None:
        if layout is not None and sizes:
            raise ValueError(f"give a Layout or axis sizes, not both: got {layout!r} and "
                             f"{sizes}")
        self.layout = Layout.of(layout) if layout is not None else Layout(**sizes)
        # no process group: the error says where to run it (parlib.cost.Layout does the
        # arithmetic without one)
        self.rank, world = rank_and_size(None, "Mesh")
        if self.layout.world != world:
            raise ValueError(f"the layout {self.layout!r} is {self.layout.world} ranks, but "
                             f"the world has {world}: the product must equal the world size")
        self._coords = self.layout.coords(self.rank)
        self._ranks: dict[str, list[int]] = {}
        self._groups: dict[str, Any] = {}
        # ep borrows placed ranks: its groups (and its experts' replicas) exist when ep > 1
        self.axes = (*AXIS_NAMES, "ep") if self.layout.ep > 1 else AXIS_NAMES
        for name in self.axes:
            self._keep_mine(name, self.layout.groups(name))
        if self.layout.ep > 1:
            self._keep_mine(_REPLICAS, self.layout.expert_replica_groups())
        self.pp_prev, self.pp_next = self.layout.pipeline_neighbours(self.rank)

    def _keep_mine(self, key: str, groups: list[list[int]]) -> None:
        # new_group is collective: every rank creates every group, in the same order, and
        # keeps the one it belongs to.
        for members in groups:
            group = dist.new_group(members)
            if self.rank in members:
                self._ranks[key], self._groups[key] = members, group

    def __getattr__(self, name: str) -> int:
        # mesh.pp is mesh.size("pp"): the axes are the layout's, so no state is kept twice
        if name in AXIS_NAMES:
            return self.layout[name]
        if name == "ep":
            return self.layout.ep
        raise AttributeError(f"Mesh has no attribute {name!r}")

    def coord(self, name: str) -> int:
        """This rank's index along axis ``name``."""
        name = axis(name).name
        if name not in self._coords:  # a borrowed axis (ep): the place in its group
            return self.ranks(name).index(self.rank)
        return self._coords[name]

    def group(self, name: str) -> Any:
        """The process group of axis ``name`` that contains this rank."""
        return self._groups[self._known(name)]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group along ``name``, in order of their index on it."""
        return list(self._ranks[self._known(name)])

    def expert_replica_group(self) -> Any:
        """The ranks holding this rank's experts (one per ep group; this rank's alone when
        ep covers the borrowed ranks): ``sync_gradients``'s ``replica_group``."""
        return self._groups[self._known(_REPLICAS)]

    def expert_replica_ranks(self) -> list[int]:
        """Global ranks of :meth:`expert_replica_group`, lowest first."""
        return list(self._ranks[self._known(_REPLICAS)])

    def _known(self, name: str) -> str:
        if name != _REPLICAS:
            name = axis(name).name
        if name not in self._groups:  # only ep is ever absent: it has no groups at ep = 1
            raise ValueError(f"{self!r} has no expert-parallel groups: give the layout "
                             f"ep > 1, e.g. Mesh(dp=4, ep=2)")
        return name

    def size(self, name: str) -> int:
        """How many ways axis ``name`` splits the work."""
        name = axis(name).name
        return self.layout.sizes()[name]

    def describe(self) -> str:
        coords = " ".join(f"{a}={i}" for a, i in self._coords.items())
        groups = ", ".join(f"{a} group {self.ranks(a)}" for a in reversed(self.axes))
        return (f"rank {self.rank}: {coords} | {groups} "
                f"(pp prev {self.pp_prev}, next {self.pp_next})")

    def __repr__(self) -> str:
        return f"Mesh({self.layout!r}, rank={self.rank})"


_REPLICAS = "expert replicas"  # the key of the experts' gradient-sync group


def torch_device_mesh_ranks(layout: Layout, *,
                            device_type: str | None = None) -> dict[str, list[int]]:
    """This rank's group along each axis as PyTorch's ``init_device_mesh`` builds it for the
    same shape and dimension names (in rank order): to check :class:`Mesh` against. With
    ep > 1 also ``"ep"``, built as torchtitan builds it (:func:`torchtitan_ep_mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = Layout.of(layout)
    device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    mesh = init_device_mesh(device_type, tuple(layout.values()), mesh_dim_names=AXIS_NAMES)
    out = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in AXIS_NAMES}
    if layout.ep > 1:
        ep_mesh = torchtitan_ep_mesh(layout, device_type=device_type)
        out["ep"] = dist.get_process_group_ranks(ep_mesh.get_group())
    return out


def torchtitan_ep_mesh(layout: Layout, *, device_type: str = "cpu") -> Any:
    """This rank's ep group as a one-dimensional DeviceMesh, made the way torchtitan makes
    it (torchtitan/distributed/parallel_dims.py, ``ParallelDims``; parlib's dp is its
    dp_shard, with no dp_replicate): the dp axis cut in two, (d / k, k), the inner k and
    every other borrowed axis (cp; cp and tp for its etp = 1) flattened into one dimension
    of e = k x c (x t) ranks with ``DeviceMesh._flatten``. torchtitan takes only e that
    are such multiples: a ValueError names any other."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = Layout.of(layout)
    inner = [a for a in layout.ep_borrows if a != "dp"]  # borrowed whole: cp (, tp)
    whole = math.prod(layout[a] for a in inner)
    if layout.ep % whole:
        raise ValueError(f"{layout!r}: torchtitan's ep borrows all of {' x '.join(inner)} "
                         f"({whole} ranks) and part of dp, so e must be a multiple of "
                         f"{whole}; parlib's Layout takes e = {layout.ep} all the same")
    k = layout.ep // whole  # the part of dp inside an ep group
    names = ("pp", "dp_outside_ep", "dp_inside_ep", "cp", "tp")
    sizes = (layout.pp, layout.dp // k, k, layout.cp, layout.tp)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    return mesh[("dp_inside_ep", *inner)]._flatten(mesh_dim_name="ep")


__all__ = ["Mesh", "torch_device_mesh_ranks", "torchtitan_ep_mesh"]
