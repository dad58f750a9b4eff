"""Questions of the combining chapter: combining the three strategies (notebook 07_combining)."""

from __future__ import annotations

import textwrap
from typing import Any

from parlib.cost import Cluster, Model, estimate, model_state_bytes
from parlib.course.question_types import Choice, Numeric, Question, is_stub
from parlib.course.registry import register
from parlib.course.results import CheckFailed, NotAttempted
from parlib.strategies import mesh as meshlib

GiB = 2**30

# --------------------------------------------------------------------------- the rank layout

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


class _Function(Question):
    """A function checked by a pure-Python grader (no ranks)."""

    kind = "function"

    def __init__(self, id, grader, *, prompt, working, points=1) -> None:
        super().__init__(id, prompt=prompt, working=working, points=points)
        self.grader = grader

    def grade(self, answer):
        if is_stub(answer):
            raise NotAttempted
        if not callable(answer):
            raise CheckFailed(f"you gave a {type(answer).__name__}: pass the function itself")
        self.grader(answer)
        return "correct"


register(_Function(
    "07.mesh_position",
    _grade_mesh,
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

# --------------------------------------------------------------------------- chips and memory

register(Numeric(
    "07.seed_chips",
    4 * 4 * 64,
    rtol=0.0,
    unit="chips",
    prompt="""
        "A model too big for one GPU is sliced 4 ways (model parallel) and laid out as 4
        stages (pipeline). That whole setup is then copied 64 times (data parallel)." Take
        it literally: t = 4, p = 4, d = 64. How many chips is that?
    """,
    working="""
        One copy is t x p = 4 x 4 = 16 chips (each of the 4 stages is sliced over 4
        chips), and there are d = 64 copies: 64 x 4 x 4 = **1024** chips, not the 256 the
        text says. 256 needs 16 copies of the 16-chip setup, or a 4-chip setup (2 x 2, or
        4 stages with no slicing) copied 64 times.
    """,
    mistakes={256: "that is what the text claims; multiply the three degrees d x t x p",
              68: "the degrees multiply, they do not add",
              72: "the degrees multiply, they do not add"},
))

register(Numeric(
    "07.seed_copies",
    256 // (4 * 4),
    rtol=0.0,
    unit="copies",
    prompt="""
        Keep the slicing (t = 4) and the stages (p = 4) of that layout. How many
        data-parallel copies d fit on 256 chips?
    """,
    working="""
        d = 256 / (t x p) = 256 / 16 = **16**.
    """,
    mistakes={64: "64 copies of a 16-chip setup are 1024 chips",
              4: "256 / 4 divides by only one of t and p; one copy is t x p chips"},
))

_P_SEED = 48e9
_SEED_MEMORY = model_state_bytes(_P_SEED, mixed_precision=True) / (4 * 4) / GiB

register(Numeric(
    "07.seed_memory",
    _SEED_MEMORY,
    rtol=1e-2,
    unit="GiB",
    prompt="""
        The model has P = 48 billion parameters and trains with Adam in mixed precision
        (16 bytes per parameter of weights, gradients and optimizer state, the data-parallel
        chapter).
        On the 16 x 4 x 4 layout, how many GiB of these model states does one chip hold?
        Ignore activations; 1 GiB = 2^30 bytes.
    """,
    working=f"""
        Tensor parallelism keeps 1/t of every layer's weights, the pipeline 1/p of the
        layers, and data parallelism (without ZeRO) copies everything: each chip holds
        16 x P / (t x p) = 16 x 48e9 / 16 = 48e9 bytes = **{_SEED_MEMORY:.1f} GiB**.
        d does not appear: copies do not share the memory.
    """,
    mistakes={16 * _P_SEED / 4 / GiB: "divide by both t and p: each chip holds 1/t of the "
                                      "matrices of 1/p of the layers",
              16 * _P_SEED / 256 / GiB: "data-parallel copies each hold everything (ZeRO "
                                        "would shard it; plain data parallelism does not)",
              16 * _P_SEED / 16 / 1e9: "that is in GB (10^9 bytes); give GiB (2^30)"},
))

register(Choice(
    "07.crosses_nodes",
    "B",
    options={
        "A": "Only the pipeline sends and receives cross nodes.",
        "B": "Pipeline sends and data-parallel all-reduces cross nodes; tensor-parallel "
             "all-reduces stay inside a node.",
        "C": "All three cross nodes.",
        "D": "Only the tensor-parallel all-reduces cross nodes.",
    },
    prompt="""
        64 GPUs in nodes of 8 (GPUs 0-7 in node 0, 8-15 in node 1, ...) run d x t x p =
        4 x 4 x 4 with the mesh order (pp, dp, tp), tp fastest. Which communication
        crosses nodes? Give one letter.
    """,
    working="""
        **B**. A tensor-parallel group is 4 consecutive ranks (0-3, 4-7, ...): inside one
        node. A data-parallel group is t = 4 ranks apart and spans d x t = 16 ranks
        (0, 4, 8, 12): two nodes. A pipeline group is d x t = 16 ranks apart (0, 16, 32,
        48): four nodes. This is the point of the order: the axis that talks at every
        layer (tp) gets the fast in-node links.
    """,
    hints={"A": "write out rank 0's data-parallel group: ranks t apart, d of them",
           "C": "write out rank 0's tensor-parallel group: which ranks, which node?",
           "D": "tp varies fastest: its groups are consecutive ranks"},
))

# --------------------------------------------------------------------------- pick a layout

PICK_MODEL = Model(60, 8192, 64, 2048, 32000, name="a 60-layer model")
PICK_CLUSTER = Cluster.dgx_a100(64)
PICK_BATCH = 128  # sequences per step; m = PICK_BATCH / d microbatches of one sequence


def pick_layout_problems(d: int, t: int, p: int) -> str | None:
    """None if (d, t, p) follows the rules taught, else the first rule it breaks."""
    n, node = PICK_CLUSTER.n_devices, PICK_CLUSTER.devices_per_node
    if d * t * p != n:
        return f"d x t x p = {d} x {t} x {p} = {d * t * p}, but there are {n} GPUs"
    if t > node:
        return (f"t = {t} is more than the {node} GPUs of a node: the tensor-parallel "
                f"all-reduces of every layer would cross the slow network")
    if PICK_MODEL.n_heads % t:
        return f"t = {t} does not divide the {PICK_MODEL.n_heads} attention heads"
    if PICK_MODEL.n_layers % p:
        return f"p = {p} does not divide the {PICK_MODEL.n_layers} layers into equal stages"
    est = estimate(PICK_MODEL, PICK_CLUSTER, d=d, t=t, p=p, m=PICK_BATCH // d,
                   global_batch=PICK_BATCH)
    if not est.fits:
        return (f"it does not fit: {est.memory_total / GiB:.0f} GiB per GPU (cost.estimate) "
                f"against {PICK_CLUSTER.memory_bytes / GiB:.1f} GiB")
    return None


class _Layout(Question):
    kind = "layout"

    def grade(self, answer):
        if is_stub(answer):
            raise NotAttempted
        try:
            d, t, p = (int(x) for x in answer)
        except (TypeError, ValueError):
            raise CheckFailed("give three whole numbers (d, t, p), e.g. (8, 4, 2)") from None
        if min(d, t, p) < 1:
            raise CheckFailed("every degree must be at least 1")
        problem = pick_layout_problems(d, t, p)
        if problem:
            raise CheckFailed(f"({d}, {t}, {p}): {problem}")
        return "correct"


register(_Layout(
    "07.pick_layout",
    prompt=f"""
        Pick (d, t, p) for {PICK_MODEL.name} ({PICK_MODEL.n_params / 1e9:.0f} billion
        parameters, {PICK_MODEL.n_layers} layers, {PICK_MODEL.n_heads} heads) on 64 A100
        GPUs of 80 GB in nodes of 8, global batch {PICK_BATCH} sequences (microbatches of
        one sequence). The rules: d x t x p = 64; t within a node and dividing the heads;
        p dividing the layers; memory per GPU under 80 GB by `cost.estimate` (mixed
        precision, Adam). Give a tuple (d, t, p).
    """,
    working="""
        Tensor parallelism first, inside the node: t = 8 at most. Memory: 16 bytes x P
        / (t x p) must leave room for activations in 74.5 GiB, so t x p >= 16 or so. p must
        divide 60: 1, 2, 3, 4, 5, 6, 10, 12, 15, ... and t x p must divide 64, so p is 1, 2
        or 4. With t = 8, p = 2 or 4 fit (d = 4 or 2); with t = 4, p = 4 (d = 4) fits.
        (2, 8, 4) leaves the most room. (1, 8, 8) is out: 8 does not divide 60, and
        (4, 16, 1) fits but puts tensor parallelism across nodes.
    """,
))


__all__ = ["MESH_SOLUTION", "PICK_CLUSTER", "PICK_MODEL", "expected_position",
           "pick_layout_problems"]
