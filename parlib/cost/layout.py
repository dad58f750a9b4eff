"""A layout: how many ways each axis of parallelism splits the work, and how ranks are numbered.

The axes are data (:data:`AXES`), listed in **rank order**, slowest-varying first; the last
one varies fastest (row-major, like a C array of shape (pp, dp, cp, tp))::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

Why this order:

- **tp fastest**: the ranks of a tensor-parallel group are adjacent (0..t-1, t..2t-1, ...).
  Launchers number the devices of one node consecutively, so a tensor-parallel group lands
  inside one node, on its fast links: tensor parallelism talks at every layer.
- **pp slowest**: consecutive pipeline stages are dp x tp ranks apart, so when a node is full
  the axis that crosses nodes is the one that sends least (one activation per microbatch
  per boundary). torchtitan (``["pp", "dp", "tp"]``) and Megatron-LM (tp, dp, pp from
  fastest to slowest) use the same order.

- **cp between dp and tp**, as torchtitan orders them (pp, dp, cp, tp): context parallelism
  talks at every layer (K/V blocks), less than tensor parallelism but more than data
  parallelism, so its group is the next to stay inside a node.

- **ep borrows dp x cp** (:data:`BORROWED_AXES`): expert parallelism gets no place of its
  own in the order and does not multiply the world size (DeepSeek-style). For the dense
  part of the model (attention, norms, embeddings, the router) the ep ranks are ordinary
  data-parallel (and context-parallel) ranks; in the MoE layers, each group of ep
  consecutive ranks of the d x c block (consecutive in dp-then-cp index: t ranks apart)
  splits the experts e ways, so an expert's weights have d x c / e copies, whose gradients
  sync over those. ep must divide d x c. ``Layout(dp=8, ep=4)`` is 8 devices.

- **or ep borrows dp x cp x tp** (``ep_borrows=EP_OVER_TP``), torchtitan's default
  placement (its ``etp = 1``; torchtitan's ``etp = tp`` is the one above). An ep group is
  then e consecutive ranks: for c = 2, t = 4, e = 2, rank 0's group is [0, 1], where
  the placement above gives [0, 4]. What each trades:

  ====================  ===============================  ================================
  ep borrows            dp x cp (parlib's default)       dp x cp x tp (torchtitan's)
  ====================  ===============================  ================================
  an ep group's ranks   t apart, spanning e x t ranks    consecutive, spanning e
  the all-to-all        crosses nodes once e x t > node  inside a node while e fits
  an expert on a rank   1/t of it (split like the MLP)   whole (the tp ranks must hold
                                                         different tokens: sequence
                                                         parallelism)
  its gradient syncs    d x c / e ranks (same tp index)  d x c x t / e ranks
  ====================  ===============================  ================================

  In the first placement :func:`~parlib.cost.estimate` splits an expert over tp, as
  torchtitan's etp = tp does; the course's own run (``strategies.combined.build_nd``) keeps
  it whole on every tp rank, and :func:`~parlib.cost.mesh_sent_bytes_per_step` counts that.

  torchtitan also asks e to be a multiple of c (dp x cp) or of c x t (dp x cp x tp), so
  that a group holds whole context-(and tensor-)parallel blocks; parlib takes any e that
  divides the borrowed ranks, in groups of e consecutive indices of that block.

Adding an axis is an entry in :data:`AXES` (or :data:`BORROWED_AXES`), its formulas in this
package and its strategy file.

A :class:`Layout` is the arithmetic of that numbering (no processes, no torch):
coordinates of a rank, the rank at coordinates, the groups of an axis, pipeline neighbours,
and how many consecutive ranks a group spans (which decides its link).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
    """One axis of parallelism: ``name`` as in code ("dp"), ``symbol`` as in formulas ("d"),
    ``title`` as in prose ("data"), what it ``splits``, and whether it is the pipeline (its
    neighbours send activations to each other)."""

    name: str
    symbol: str
    title: str
    splits: str
    pipeline: bool = False
    borrows: tuple[str, ...] = ()  # the placed axes whose ranks its groups reuse (default)


# Slowest-varying first: the rank order is this tuple's order, written nowhere else.
AXES: tuple[Axis, ...] = (
    Axis("pp", "p", "pipeline", "the layers, into consecutive stages", pipeline=True),
    Axis("dp", "d", "data", "the batch; every rank keeps a whole copy of its part of the model"),
    Axis("cp", "c", "context", "the sequence; attention passes keys and values between ranks"),
    Axis("tp", "t", "tensor", "each layer's weight matrices, by rows or columns"),
)
# Axes without a place in the rank order: their groups reuse the ranks of the axes they
# borrow, and they do not multiply the world size.
BORROWED_AXES: tuple[Axis, ...] = (
    Axis("ep", "e", "expert", "the experts of each MoE layer; its groups borrow data- and "
         "context-parallel ranks", borrows=("dp", "cp")),
)
AXIS_NAMES: tuple[str, ...] = tuple(a.name for a in AXES)  # the rank order's axes
ALL_AXIS_NAMES: tuple[str, ...] = AXIS_NAMES + tuple(a.name for a in BORROWED_AXES)
_BY_NAME = {a.name: a for a in AXES + BORROWED_AXES}
_INDEX = {a.name: i for i, a in enumerate(AXES)}
# Where ep's groups may live: the placed axes they borrow (adjacent in the rank order).
EP_OVER_DP_CP: tuple[str, ...] = ("dp", "cp")  # parlib's default; torchtitan's etp = tp
EP_OVER_TP: tuple[str, ...] = ("dp", "cp", "tp")  # torchtitan's default (its etp = 1)
EP_PLACEMENTS: tuple[tuple[str, ...], ...] = (EP_OVER_DP_CP, EP_OVER_TP)


def axis(name: str) -> Axis:
    """The :class:`Axis` called ``name``; a ValueError listing the axes for any other name."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown axis {name!r}; the axes are {', '.join(ALL_AXIS_NAMES)}"
                         ) from None


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"layout size {name}={value!r} must be a whole number >= 1")
    return value


class Layout(Mapping[str, int]):
    """How many ways each axis splits the work: ``Layout(dp=2, tp=2)`` (missing axes are 1).

    A read-only mapping from axis name to size, iterated in rank order (slowest first);
    ``layout.tp`` is ``layout["tp"]``. ``str(layout)`` names it by its axes bigger than one,
    fastest first: "t=2 x d=2"; "one device" when all are 1.

    Expert parallelism, ``ep``, borrows ranks (see the module's docstring): ``layout.ep``
    and ``layout["ep"]`` read it, ``str`` appends it ("d=8 e=4"), but it is not iterated
    with the rank-order axes (``dict(layout)`` is the rank order's sizes, as a device mesh
    takes them); :meth:`sizes` gives all of them. ``ep_borrows`` says which placed axes
    its groups borrow: :data:`EP_OVER_DP_CP` (the default) or :data:`EP_OVER_TP`
    (torchtitan's default), e.g. ``Layout(cp=2, tp=4, ep=2, ep_borrows=EP_OVER_TP)``.
    """

    __slots__ = ("_sizes", "_ep", "_ep_borrows")

    def __init__(self, *, ep_borrows: tuple[str, ...] = EP_OVER_DP_CP, **sizes: int) -> None:
        for name in sizes:
            axis(name)
        object.__setattr__(self, "_sizes", tuple(_size(a, sizes.get(a, 1)) for a in AXIS_NAMES))
        borrows = tuple(ep_borrows) if isinstance(ep_borrows, (tuple, list)) else ep_borrows
        if borrows not in EP_PLACEMENTS:
            raise ValueError(f"ep_borrows={ep_borrows!r}: expert parallelism borrows "
                             f"{EP_OVER_DP_CP} (parlib's default) or {EP_OVER_TP} "
                             f"(torchtitan's default): pass one of them "
                             f"(parlib.cost.layout.EP_OVER_DP_CP or EP_OVER_TP)")
        ep = _size("ep", sizes.get("ep", 1))
        shared = math.prod(self[a] for a in borrows)
        if shared % ep:
            symbols = " x ".join(axis(a).symbol for a in borrows)
            fits = [k for k in range(1, shared + 1) if shared % k == 0]
            raise ValueError(f"ep = {ep} does not divide {symbols} = {shared}: expert-"
                             f"parallel groups borrow the {' and '.join(borrows)} ranks (ep "
                             f"does not add devices); pick ep from {fits}, or give "
                             f"{' x '.join(borrows)} more ranks")
        object.__setattr__(self, "_ep", ep)
        object.__setattr__(self, "_ep_borrows", borrows)

    @classmethod
    def of(cls, layout: Layout | Mapping[str, int]) -> Layout:
        """``layout`` itself, or a Layout of a mapping from axis name to size."""
        if isinstance(layout, Layout):
            return layout
        if isinstance(layout, Mapping):
            return cls(**layout)
        raise ValueError(f"a layout must be a Layout (e.g. Layout(dp=2, tp=2)) or a mapping "
                         f"from axis name to size, got {type(layout).__name__}")

    # ---- the mapping
    def __getitem__(self, name: str) -> int:
        if name not in _BY_NAME:  # a KeyError, as a mapping's contract says, that names them
            raise KeyError(f"unknown axis {name!r}; the axes are {', '.join(ALL_AXIS_NAMES)}")
        if name == "ep":
            return self._ep
        return self._sizes[_INDEX[name]]

    def sizes(self) -> dict[str, int]:
        """Every axis's size, the borrowed ones (ep) too: ``Layout(**layout.sizes(),
        ep_borrows=layout.ep_borrows)`` is ``layout``."""
        return {**dict(self), "ep": self._ep}

    @property
    def ep_borrows(self) -> tuple[str, ...]:
        """The placed axes whose ranks ep's groups borrow, in rank order."""
        return self._ep_borrows

    def _placement(self) -> tuple[str, ...]:  # what equality sees: none without ep
        return self._ep_borrows if self._ep > 1 else EP_OVER_DP_CP

    def __contains__(self, name: object) -> bool:
        return name in _BY_NAME

    def __iter__(self) -> Iterator[str]:
        return iter(AXIS_NAMES)

    def __len__(self) -> int:
        return len(AXIS_NAMES)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Layout is read-only: make a new one, e.g. layout.with_(tp=4)")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Layout) and self._sizes == other._sizes
                and self._ep == other._ep and self._placement() == other._placement())

    def __hash__(self) -> int:
        if self._ep == 1:
            return hash(self._sizes)
        return hash((self._sizes, self._ep, self._placement()))

    def __reduce__(self) -> tuple:  # pickles (to ranks) as its sizes: it has no __dict__
        if self._placement() != EP_OVER_DP_CP:
            return (_from_sizes, (self.sizes(), self._ep_borrows))
        return (_from_sizes, (self.sizes() if self._ep > 1 else dict(self),))

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}={n}" for a, n in self.sizes().items() if n > 1)
        if self._placement() != EP_OVER_DP_CP:
            inner += f", ep_borrows={self._ep_borrows!r}"
        return f"Layout({inner})"

    def __str__(self) -> str:
        parts = [f"{axis(a).symbol}={self[a]}" for a in reversed(AXIS_NAMES) if self[a] > 1]
        placed = " x ".join(parts) or "one device"
        if self._ep == 1:
            return placed
        over = " x ".join(axis(a).symbol for a in self._ep_borrows)
        return placed + f" e={self._ep}" + (f" over {over}" if over != "d x c" else "")

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def with_(self, **changes: int) -> Layout:
        """A copy with some sizes changed: ``layout.with_(tp=4)``."""
        return Layout(**{**self.sizes(), **changes}, ep_borrows=self._ep_borrows)

    # ---- the numbering
    @property
    def world(self) -> int:
        """The number of ranks: the product of the sizes."""
        return math.prod(self._sizes)

    def stride(self, name: str) -> int:
        """How many ranks apart two neighbours along axis ``name`` are: the product of the
        sizes of the axes that vary faster (for ep, which runs along the index of the axes it
        borrows: the fastest one's stride)."""
        name = axis(name).name
        if name == "ep":
            return self.stride(self._ep_borrows[-1])
        return math.prod(self._sizes[_INDEX[name] + 1:])

    def span(self, name: str) -> int:
        """How many consecutive ranks a block holding whole groups of axis ``name`` covers
        (size x stride): a group of it lies inside such a block, which starts at a multiple
        of it. Where the block fits in a node, so does the group."""
        return self[name] * self.stride(name)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} is outside a layout of {self.world} ranks "
                             f"({self!r})")

    def coords(self, rank: int) -> dict[str, int]:
        """The index of ``rank`` along every axis, keyed in rank order."""
        self._check_rank(rank)
        out = {}
        for name in reversed(AXIS_NAMES):  # peel off the fastest axis first
            rank, out[name] = divmod(rank, self[name])
        return {name: out[name] for name in AXIS_NAMES}

    def rank_at(self, coord: Mapping[str, int]) -> int:
        """The rank at coordinates ``coord`` (axis name -> index; an axis of size 1 may be
        left out, its only index is 0)."""
        for name in coord:
            axis(name)
        rank = 0
        for name, n in self.items():
            if name not in coord and n > 1:
                raise ValueError(f"coordinates {dict(coord)} lack axis {name!r} (size {n})")
            i = coord.get(name, 0)
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"{name} index {i!r} is outside [0, {n})")
            rank = rank * n + i
        return rank

    def axis_ranks(self, name: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along axis ``name``, in order of their index on it:
        every rank whose other coordinates equal ``rank``'s."""
        axis(name)
        mine = self.coords(rank)
        if name == "ep":  # e consecutive indices of the borrowed block (dp x cp or dp x cp x tp)
            e = self._ep
            first = self._borrowed_index(mine) // e * e
            return [self._at_borrowed_index(mine, j) for j in range(first, first + e)]
        return [self.rank_at({**mine, name: i}) for i in range(self[name])]

    def _borrowed_index(self, coord: Mapping[str, int]) -> int:
        """The index of ``coord`` in the block of ep's borrowed axes, in rank order."""
        j = 0
        for a in self._ep_borrows:
            j = j * self[a] + coord[a]
        return j

    def _at_borrowed_index(self, coord: Mapping[str, int], j: int) -> int:
        """The rank with ``coord``'s other coordinates at index ``j`` of ep's block."""
        at = dict(coord)
        for a in reversed(self._ep_borrows):
            j, at[a] = divmod(j, self[a])
        return self.rank_at(at)

    def expert_replica_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same experts as ``rank`` (the same index in their ep
        groups, the same on every axis ep does not borrow): the group an expert's gradient
        syncs over, d x c / e ranks (d x c x t / e borrowing tp too), lowest first."""
        mine, e = self.coords(rank), self._ep
        j = self._borrowed_index(mine)
        block = math.prod(self[a] for a in self._ep_borrows)
        return [self._at_borrowed_index(mine, k) for k in range(j % e, block, e)]

    def expert_replica_groups(self) -> list[list[int]]:
        """Every group of :meth:`expert_replica_ranks`, ordered by lowest rank."""
        seen = {min(g): g for g in map(self.expert_replica_ranks, range(self.world))}
        return [seen[k] for k in sorted(seen)]

    def groups(self, name: str) -> list[list[int]]:
        """Every group along axis ``name`` (each a list of ranks), ordered by lowest rank."""
        axis(name)
        seen: dict[int, list[int]] = {}
        for r in range(self.world):
            members = self.axis_ranks(name, r)
            seen.setdefault(members[0], members)
        return [seen[k] for k in sorted(seen)]

    def pipeline_neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """The ranks of the previous and next pipeline stage of ``rank`` (None at the ends):
        the same index on every other axis, one less / one more on the pipeline's."""
        name = PIPELINE.name
        group, i = self.axis_ranks(name, rank), self.coords(rank)[name]
        return (group[i - 1] if i > 0 else None,
                group[i + 1] if i < self[name] - 1 else None)


def _size_of(i: int) -> property:
    return property(lambda self: self._sizes[i], doc=f"The size of axis {AXIS_NAMES[i]!r}.")


for _i, _name in enumerate(AXIS_NAMES):  # layout.pp, layout.dp, ...: one per axis of the table
    setattr(Layout, _name, _size_of(_i))
Layout.ep = property(lambda self: self._ep,
                     doc="The size of axis 'ep' (borrows dp x cp, or dp x cp x tp).")


def _from_sizes(sizes: dict[str, int], ep_borrows: tuple[str, ...] = EP_OVER_DP_CP) -> Layout:
    return Layout(**sizes, ep_borrows=ep_borrows)


PIPELINE: Axis = next(a for a in AXES if a.pipeline)

__all__ = ["ALL_AXIS_NAMES", "AXES", "AXIS_NAMES", "BORROWED_AXES", "EP_OVER_DP_CP", "EP_OVER_TP",
           "EP_PLACEMENTS", "PIPELINE", "Axis", "Layout", "axis"]
