"""One rank's result in the ring exercise, judged: the cases' inputs and the named diagnoses
of a wrong sum, tried in order (first match wins). The same code judges on the rank (to stop
after the first wrong case) and in the grader (for the hint)."""

from __future__ import annotations

import itertools

import torch

from parlib.course.on_ranks import Case, Diagnosis, World, always
from parlib.verify import ATOL, RTOL, close

_P2P_OPS = {"send", "recv", "barrier"}


def _case_input(world: int, case: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * world + 100 * case + rank)
    return torch.randn(n, generator=g, dtype=torch.float32)


def _lengths(world: int) -> list[int]:
    # divisible, not divisible, and a longer uneven one
    return [4 * world, 5 * world + 3, 64 * world + 1]


def _reference(world: World) -> list[list[torch.Tensor]]:
    """Every case's inputs, one tensor per rank (the sum is their sum)."""
    return [[_case_input(world.size, case, r, n) for r in range(world.size)]
            for case, n in enumerate(_lengths(world.size))]


# --------------------------------------------------------------------------- one rank's result
# A Case's ``step`` is the case (the tensor length's index), ``rank`` the rank judged.

def _rep(c: Case) -> dict:
    return c.results[c.rank][c.step]


def _inputs(c: Case) -> list[torch.Tensor]:
    return c.reference[c.step]


def _expected(c: Case) -> torch.Tensor:
    return torch.stack(_inputs(c)).sum(0)


def _own(c: Case) -> torch.Tensor:
    return _inputs(c)[c.rank]


def _out(c: Case):
    return _rep(c)["out"]


def _sum_right(c: Case) -> bool:
    out, expected = _out(c), _expected(c)
    return (isinstance(out, torch.Tensor) and out.shape == expected.shape
            and out.dtype == expected.dtype and bool(torch.isfinite(out).all())
            and close(out, expected))


_INDEX_HINT = ("check the chunk index at each step (reduce-scatter step s: rank r sends "
               "chunk (r - s) % N and adds the one it receives into chunk (r - s - 1) % N; "
               "all-gather step s: it sends chunk (r + 1 - s) % N and copies the one it "
               "receives into chunk (r - s) % N)")


def _chunks(c: Case) -> tuple[list[int], list[int]]:
    """The chunks (as torch.tensor_split makes them) with the right sum, and the others."""
    got = torch.tensor_split(_out(c), c.world)
    want = torch.tensor_split(_expected(c), c.world)
    good = [i for i in range(c.world) if close(got[i], want[i])]
    return good, [i for i in range(c.world) if i not in good]


def _partial(c: Case) -> tuple[int, tuple[int, ...]] | None:
    """(chunk, ranks) when a wrong chunk holds the sum over a subset of the ranks only."""
    if c.world == 1:
        return None
    got = torch.tensor_split(_out(c), c.world)
    for i in _chunks(c)[1]:
        for size in range(1, c.world):
            for subset in itertools.combinations(range(c.world), size):
                part = torch.stack([torch.tensor_split(_inputs(c)[q], c.world)[i]
                                    for q in subset]).sum(0)
                if close(got[i], part):
                    return i, subset
    return None


def _partial_hint(c: Case) -> str:
    i, subset = _partial(c)
    missing = [q for q in range(c.world) if q not in subset]
    own = " (its own input)" if missing == [c.rank] else ""
    return (f"has in chunk {i} the sum over rank(s) {list(subset)} only, "
            f"missing rank(s) {missing}{own}. In the reduce-scatter, add "
            f"each received chunk to yours (don't copy over it); in the "
            f"all-gather, pass on only fully summed chunks: {_INDEX_HINT}")


def _some_chunks_hint(c: Case) -> str:
    good, bad = _chunks(c)
    return (f"has the right sum in chunk(s) {good} but not in chunk(s) {bad} "
            f"(chunks as torch.tensor_split(t, N) makes them): {_INDEX_HINT}")


def _mismatch(c: Case) -> str:
    out, expected = _out(c), _expected(c)
    bad = (~torch.isclose(out, expected, rtol=RTOL, atol=ATOL)).nonzero()
    i = int(bad[0]) if len(bad) else 0
    return (f"element {i} is {out[i].item():.5g}, expected {expected[i].item():.5g} "
            f"({len(bad)} of {out.numel()} elements wrong)")


def _summed_in_place(c: Case) -> bool:
    after = _rep(c)["after"]
    return _out(c) is None and isinstance(after, torch.Tensor) and close(after, _expected(c))


# What is wrong with one rank's result (tried in order, first match wins; only when the sum
# is wrong). Each hint follows "rank r".
RANK_DIAGNOSES = (
    Diagnosis("returned_none_in_place", _summed_in_place,
              "returned None after summing into its input in place; this exercise asks you "
              "to return the sum as a new tensor and leave the input unchanged"),
    Diagnosis("returned_none", lambda c: _out(c) is None, "returned None; return the summed "
              "tensor"),
    Diagnosis("not_a_tensor", lambda c: isinstance(_out(c), str),
              lambda c: f"returned a {_out(c).strip('<>')}; return a torch.Tensor"),
    Diagnosis("wrong_shape", lambda c: _out(c).shape != _expected(c).shape,
              lambda c: f"returned shape {tuple(_out(c).shape)}, expected "
              f"{tuple(_expected(c).shape)}"),
    Diagnosis("wrong_dtype", lambda c: _out(c).dtype != _expected(c).dtype,
              lambda c: f"returned dtype {_out(c).dtype}, expected {_expected(c).dtype}"),
    Diagnosis("not_finite", lambda c: not torch.isfinite(_out(c)).all(),
              "returned NaN or inf values"),
    Diagnosis("missing_own", lambda c: c.world > 1 and close(_out(c), _expected(c) - _own(c)),
              "is missing its own contribution: add the received chunk to your own, "
              "don't replace it"),
    Diagnosis("own_input", lambda c: c.world > 1 and close(_out(c), _own(c)),
              "returned its own input unchanged"),
    Diagnosis("partial_sum", lambda c: _partial(c) is not None, _partial_hint),
    Diagnosis("some_chunks_right", lambda c: c.world > 1 and bool(_chunks(c)[0]),
              _some_chunks_hint),
    Diagnosis("wrong_values", always, _mismatch),
)


def _rank_problem(c: Case) -> Diagnosis | None:
    """The diagnosis of rank ``c.rank``'s result in case ``c.step``; None when it is right."""
    if _sum_right(c):
        return None
    return next(d for d in RANK_DIAGNOSES if d.when(c))


def _input_changed(c: Case) -> bool:
    return not torch.equal(_rep(c)["after"], _own(c))


def _collectives(c: Case) -> list[str]:
    return sorted(set(_rep(c)["ops"]) - _P2P_OPS)


def _p2p_wrong(c: Case) -> bool:
    """The ring must move its data with send/recv only."""
    return bool(_collectives(c)) or (c.world > 1 and not {"send", "recv"} <= set(_rep(c)["ops"]))
