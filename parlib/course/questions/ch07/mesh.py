"""07.mesh_position: where a global rank sits in a d x t x p mesh. Pure Python, but the
answer runs in a child process (one rank), never in the grader's own."""

from __future__ import annotations

from typing import Any, Callable

from parlib.cost import Layout
from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always
from parlib.course.registry import register

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
    layout = Layout(dp=d, tp=t, pp=p)
    c = layout.coords(rank)
    prev, nxt = layout.pipeline_neighbours(rank)
    return {**{a: c[a] for a in ("pp", "dp", "tp")}, **{f"{a}_group": layout.axis_ranks(a, rank)
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


def _mesh_rank(fn) -> list[dict[str, Any]]:
    """In a child process (one rank), never in the grader: the learner's answer for every
    rank of every layout, as plain data. Stops at the first answer that is not a dict."""
    from parlib.course.answers import no_process_exit, plain_data

    out: list[dict[str, Any]] = []
    for d, t, p in _LAYOUTS:
        for rank in range(d * t * p):
            with no_process_exit():
                got = fn(rank, d, t, p)
            if not isinstance(got, dict):
                return out + [{"layout": (d, t, p), "rank": rank, "type": type(got).__name__}]
            got = {k: (list(v) if isinstance(v, (list, tuple, range)) else v)
                   for k, v in got.items()}
            out.append({"layout": (d, t, p), "rank": rank, "got": plain_data(got)})
    return out


def _want(c: Case) -> dict[str, Any]:
    return expected_position(c.report[c.step]["rank"], *c.report[c.step]["layout"])


def _got(c: Case) -> dict[str, Any]:
    return c.report[c.step]["got"]


def _first_wrong(case: Case) -> tuple[int, int] | None:
    for i, answer in enumerate(case.results[0]):
        got = answer.get("got")
        if got is None or any(k not in got for k in _KEYS):
            return 0, i
        if any(got[k] != v for k, v in expected_position(answer["rank"],
                                                         *answer["layout"]).items()):
            return 0, i
    return None


def _as_if(order: tuple[str, ...]) -> Callable[[Case], bool]:
    """Is every coordinate and group that of a mesh whose axes run ``order``?"""
    def when(c: Case) -> bool:
        d, t, p = c.report[c.step]["layout"]
        other = _position(c.report[c.step]["rank"], {"dp": d, "tp": t, "pp": p}, order)
        return all(_got(c)[k] == other[k] for k in _PLACE_KEYS)
    return when


def _neighbours_off_by_one(c: Case) -> bool:
    (d, t, _), rank, got = c.report[c.step]["layout"], c.report[c.step]["rank"], _got(c)
    if any(got[k] != _want(c)[k] for k in _PLACE_KEYS) or d * t == 1:
        return False
    return ((got["pp_prev"] is not None and got["pp_prev"] == rank - 1)
            or (got["pp_next"] is not None and got["pp_next"] == rank + 1))


def _where(c: Case) -> str:
    d, t, p = c.report[c.step]["layout"]
    return f"rank {c.report[c.step]['rank']} of d x t x p = {d} x {t} x {p}"


def _wrong_key(c: Case) -> str:
    got, want = _got(c), _want(c)
    key = next(k for k in _KEYS if got.get(k) != want[k])
    return f"{_where(c)}: {key} is {got.get(key)!r}, expected {want[key]!r}"


DIAGNOSES = (
    Diagnosis("not_a_dict", lambda c: "type" in c.report[c.step],
              lambda c: f"mesh_position returned a {c.report[c.step]['type']}; return a dict "
              f"with the keys {', '.join(_KEYS)}"),
    Diagnosis("missing_key", lambda c: any(k not in _got(c) for k in _KEYS),
              lambda c: f"the returned dict has no key "
              f"{next(k for k in _KEYS if k not in _got(c))!r}"),
    Diagnosis("axes_swapped", _as_if(("pp", "tp", "dp")),
              lambda c: f"{_where(c)}: your dp and tp axes are swapped: tp varies fastest "
              f"(adjacent ranks share a tensor-parallel group), then dp, then pp"),
    Diagnosis("column_major", _as_if(("tp", "dp", "pp")),
              lambda c: f"{_where(c)}: you made pp vary fastest (column-major); the mesh is "
              f"row-major over (pp, dp, tp): rank = (pp x d + dp) x t + tp, so tp varies "
              f"fastest"),
    Diagnosis("neighbours_off_by_one", _neighbours_off_by_one,
              lambda c: f"{_where(c)}: the previous/next pipeline stage is not rank - 1 / "
              f"rank + 1: it is the rank with the same dp and tp index one stage away, "
              f"d x t ranks apart"),
    Diagnosis("wrong_key", always, _wrong_key),
)


QUESTION = register(RankExercise(
    "07.mesh_position",
    probe=_mesh_rank,
    worlds=[World(1)],  # one child process: the answer never runs in the grader's
    reference=lambda world: None,  # expected_position, computed here from parlib's mesh
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    solution=MESH_SOLUTION,
    where="",
    timeout=60.0,
    prompt="""
        Write mesh_position(rank, d, t, p) -> dict: for global rank `rank` of a d x t x p
        mesh with axes (pp, dp, tp), tp varying fastest, return its coordinates "pp", "dp",
        "tp", its groups "tp_group", "dp_group", "pp_group" (global ranks in order of
        their index on that axis) and its pipeline neighbours "pp_prev", "pp_next" (global
        ranks, None at the ends). Checked on every rank of seven layouts.
    """,
    explanation="""
        Row-major over (pp, dp, tp) means rank = (pp x d + dp) x t + tp: peel the fastest
        axis off first, tp = rank mod t, then dp = (rank div t) mod d, then
        pp = rank div (t x d). A group along one axis is every rank whose two other
        coordinates are the same: vary that axis's index and rebuild the rank. The pipeline
        neighbours are the pp group's previous and next members, d x t ranks away, not
        rank - 1 and rank + 1 (those are tensor-parallel partners).
    """,
))


__all__ = ["MESH_SOLUTION", "expected_position"]
