"""07.mesh_position: where a global rank sits in a d x t x p mesh (pure Python, no ranks)."""

from __future__ import annotations

import textwrap
from typing import Any

from parlib.course.question_types import Implementation
from parlib.course.registry import register
from parlib.course.results import CheckFailed
from parlib.strategies import mesh as meshlib

MESH_SOLUTION = '''\
def mesh_position(rank, d, t, p):
    """Coordinates, groups and pipeline neighbours of global ``rank`` in a d x t x p mesh
    with axes (pp, dp, tp), tp varying fastest: rank = (pp * d + dp) * t + tp."""
    tp = rank % t
    dp = (rank // t) % d
    pp = rank // (t * d)

    def at(pp_, dp_, tp_):
        return (pp_ * d + dp_) * t + tp_

    return {
        "pp": pp, "dp": dp, "tp": tp,
        "tp_group": [at(pp, dp, i) for i in range(t)],
        "dp_group": [at(pp, i, tp) for i in range(d)],
        "pp_group": [at(i, dp, tp) for i in range(p)],
        "pp_prev": at(pp - 1, dp, tp) if pp > 0 else None,
        "pp_next": at(pp + 1, dp, tp) if pp < p - 1 else None,
    }
'''

_KEYS = ("pp", "dp", "tp", "tp_group", "dp_group", "pp_group", "pp_prev", "pp_next")
_LAYOUTS = [(2, 2, 2), (2, 4, 1), (4, 1, 2), (1, 2, 4), (3, 2, 2), (2, 3, 4), (4, 2, 3)]


def expected_position(rank: int, d: int, t: int, p: int) -> dict[str, Any]:
    """The right answer, from :mod:`parlib.strategies.mesh` (the code the course runs)."""
    c = meshlib.coords(rank, dp=d, pp=p, tp=t)
    prev, nxt = meshlib.pipeline_neighbours(rank, dp=d, pp=p, tp=t)
    return {**c, **{f"{a}_group": meshlib.axis_ranks(a, rank, dp=d, pp=p, tp=t)
                    for a in ("tp", "dp", "pp")}, "pp_prev": prev, "pp_next": nxt}


def _position(rank: int, sizes: dict[str, int], order: tuple[str, ...]) -> dict[str, Any]:
    """Coordinates and groups in a mesh whose axes run ``order`` (slowest to fastest)."""
    coord, rest = {}, rank
    for axis in reversed(order):
        rest, coord[axis] = divmod(rest, sizes[axis])

    def at(c: dict[str, int]) -> int:
        r = 0
        for axis in order:
            r = r * sizes[axis] + c[axis]
        return r

    out: dict[str, Any] = dict(coord)
    for axis in ("tp", "dp", "pp"):
        out[f"{axis}_group"] = [at({**coord, axis: i}) for i in range(sizes[axis])]
    return out


_PLACE_KEYS = ("pp", "dp", "tp", "tp_group", "dp_group", "pp_group")


def _diagnose(got: dict, want: dict, rank: int, d: int, t: int, p: int) -> str:
    sizes = {"dp": d, "tp": t, "pp": p}
    swapped = _position(rank, sizes, ("pp", "tp", "dp"))
    column = _position(rank, sizes, ("tp", "dp", "pp"))
    if all(got[k] == swapped[k] for k in _PLACE_KEYS):
        return ("your dp and tp axes are swapped: tp varies fastest (adjacent ranks share a "
                "tensor-parallel group), then dp, then pp")
    if all(got[k] == column[k] for k in _PLACE_KEYS):
        return ("you made pp vary fastest (column-major); the mesh is row-major over (pp, dp, "
                "tp): rank = (pp x d + dp) x t + tp, so tp varies fastest")
    if all(got[k] == want[k] for k in _PLACE_KEYS):
        off_by_one = ((got["pp_prev"] is not None and got["pp_prev"] == rank - 1)
                      or (got["pp_next"] is not None and got["pp_next"] == rank + 1))
        if off_by_one and d * t > 1:
            return ("the previous/next pipeline stage is not rank - 1 / rank + 1: it is the "
                    "rank with the same dp and tp index one stage away, d x t ranks apart")
    for key in _KEYS:
        if got.get(key) != want[key]:
            return f"{key} is {got.get(key)!r}, expected {want[key]!r}"
    return "wrong"


def _grade_mesh(fn) -> None:
    for d, t, p in _LAYOUTS:
        for rank in range(d * t * p):
            want = expected_position(rank, d, t, p)
            got = fn(rank, d, t, p)
            if not isinstance(got, dict):
                raise CheckFailed(f"mesh_position returned a {type(got).__name__}; return a "
                                  f"dict with the keys {', '.join(_KEYS)}")
            missing = [k for k in _KEYS if k not in got]
            if missing:
                raise CheckFailed(f"the returned dict has no key {missing[0]!r}")
            got = {k: (list(v) if isinstance(v, (list, tuple, range)) else v)
                   for k, v in got.items()}
            if any(got[k] != want[k] for k in _KEYS):
                hint = _diagnose(got, want, rank, d, t, p)
                raise CheckFailed(f"rank {rank} of d x t x p = {d} x {t} x {p}: {hint}")


register(Implementation(
    "07.mesh_position",
    _grade_mesh,
    timeout=None,
    prompt="""
        Write mesh_position(rank, d, t, p) -> dict: for global rank `rank` of a d x t x p
        mesh with axes (pp, dp, tp), tp varying fastest, return its coordinates "pp", "dp",
        "tp", its groups "tp_group", "dp_group", "pp_group" (global ranks in order of
        their index on that axis) and its pipeline neighbours "pp_prev", "pp_next" (global
        ranks, None at the ends). Checked on every rank of seven layouts.
    """,
    working=textwrap.dedent("""
        Row-major over (pp, dp, tp) means rank = (pp x d + dp) x t + tp: peel the fastest
        axis off first, tp = rank mod t, then dp = (rank div t) mod d, then
        pp = rank div (t x d). A group along one axis is every rank whose two other
        coordinates are the same: vary that axis's index and rebuild the rank. The pipeline
        neighbours are the pp group's previous and next members, d x t ranks away, not
        rank - 1 and rank + 1 (those are tensor-parallel partners).
    """) + "\n```python\n" + MESH_SOLUTION + "```\n",
))


__all__ = ["MESH_SOLUTION", "expected_position"]
