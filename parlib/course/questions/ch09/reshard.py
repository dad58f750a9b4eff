"""09.reshard_reads: which element ranges of which saved rank a new rank reads, to rebuild its
piece of a flat vector saved by another number of ranks (torch.chunk's split, the one
every sharded state of the course and a DTensor's Shard(0) use), judged in a child process
against :func:`parlib.cost.reshard_reads` on every rank, on sizes and world sizes that do
not divide each other (short and empty last pieces included)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from parlib.cost.checkpoint import reshard_reads
from parlib.course.on_ranks import Case, CaseExercise, Diagnosis, always
from parlib.course.registry import register

# name -> (numel, saved world size, new world size); judged in this order
CASES: dict[str, tuple[int, int, int]] = {
    "even": (12, 4, 2),
    "uneven": (10, 4, 3),
    "tiny_model": (178, 4, 3),
    "more_ranks": (13, 3, 5),
    "empty_pieces": (5, 4, 6),
}

RESHARD_SOLUTION = '''\
def reshard_plan(numel, saved_world_size, world_size, rank):
    def piece(n_ranks, r):  # torch.chunk's split: pieces of ceil(numel / n_ranks)
        size = -(-numel // n_ranks)
        return min(numel, r * size), min(numel, (r + 1) * size)

    lo, hi = piece(world_size, rank)
    reads = []
    for saved in range(saved_world_size):
        start, stop = piece(saved_world_size, saved)
        if max(lo, start) < min(hi, stop):  # they overlap: read the overlap
            reads.append((saved, max(lo, start), min(hi, stop)))
    return reads
'''


def _reads_by(rule: Callable[[int, int, int], tuple[int, int]], numel: int, saved: int,
              world: int, rank: int, *, keep_empty: bool = False) -> list[tuple[int, int, int]]:
    lo, hi = rule(numel, world, rank)
    out = []
    for s in range(saved):
        start, stop = rule(numel, saved, s)
        if max(lo, start) < min(hi, stop) or (keep_empty and max(lo, start) <= min(hi, stop)):
            out.append((s, max(lo, start), min(hi, stop)))
    return out


def _floor_rule(numel: int, n: int, r: int) -> tuple[int, int]:
    """Pieces of numel // n, the last rank taking the rest."""
    size = numel // n
    return r * size, numel if r == n - 1 else (r + 1) * size


def _array_split_rule(numel: int, n: int, r: int) -> tuple[int, int]:
    """numpy.array_split's rule: the first numel % n ranks one element more."""
    size, extra = divmod(numel, n)
    start = r * size + min(r, extra)
    return start, start + size + (r < extra)


def _chunk_rule(numel: int, n: int, r: int) -> tuple[int, int]:
    size = -(-numel // n)
    return min(numel, r * size), min(numel, (r + 1) * size)


def _as_reads(got: Any) -> list[tuple[int, int, int]] | None:
    try:
        out = [tuple(int(v) for v in item) for item in got]
    except (TypeError, ValueError):
        return None
    return out if all(len(t) == 3 for t in out) else None


def _report(fn: Callable, name: str) -> dict[str, Any]:
    numel, saved, world = CASES[name]
    report: dict[str, Any] = {"case": (numel, saved, world)}
    for rank in range(world):
        raw = fn(numel, saved, world, rank)
        got = _as_reads(raw)
        if got is None:
            report["problem"] = ("form", rank, repr(raw)[:80])
            return report
        if got != reshard_reads(numel, saved, world, rank):
            report["problem"] = ("wrong", rank, got)
            return report
    return report


# --------------------------------------------------------------------------- the verdicts


def _got(c: Case) -> list[tuple[int, int, int]]:
    return c.report["problem"][2]


def _rank(c: Case) -> int:
    return c.report["problem"][1]


def _wrong_as(make: Callable[..., list]) -> Callable[[Case], bool]:
    def when(c: Case) -> bool:
        if c.report["problem"][0] != "wrong":
            return False
        numel, saved, world = c.report["case"]
        return _got(c) == make(numel, saved, world, _rank(c))
    return when


def _local_offsets(numel: int, saved: int, world: int, rank: int) -> list:
    size = -(-numel // saved)
    return [(s, a - s * size, b - s * size) for s, a, b in reshard_reads(numel, saved, world,
                                                                          rank)]


def _want(c: Case) -> list:
    numel, saved, world = c.report["case"]
    return reshard_reads(numel, saved, world, _rank(c))


def _words(c: Case) -> str:
    numel, saved, world = c.report["case"]
    return (f"numel = {numel} saved by {saved} ranks, loaded on {world}: rank {_rank(c)} "
            f"returned {_got(c)}, expected {_want(c)}")


DIAGNOSES = (
    Diagnosis("not_a_list_of_triples", lambda c: c.report["problem"][0] == "form",
              lambda c: f"rank {_rank(c)} returned {c.report['problem'][2]}: return a list "
              "of (saved rank, start, stop) tuples of whole numbers, one per saved piece "
              "the new piece overlaps"),
    Diagnosis("local_offsets", _wrong_as(_local_offsets),
              lambda c: f"{_words(c)}. Your start and stop are offsets inside the saved "
              "piece; give them as global element indices of the flat vector (the "
              "saved piece of rank s starts at s x ceil(numel / N_saved))"),
    Diagnosis("empty_reads", _wrong_as(lambda *a: _reads_by(_chunk_rule, *a, keep_empty=True)),
              lambda c: f"{_words(c)}. A saved piece that only touches the new one (an "
              "overlap of zero elements), or an empty last piece, is not read: keep only "
              "ranges with start < stop"),
    Diagnosis("floor_split", _wrong_as(lambda *a: _reads_by(_floor_rule, *a)),
              lambda c: f"{_words(c)}. Pieces of numel // N with the rest on the last "
              "rank are not the split the course's strategies (and DTensor's Shard(0)) "
              "use: torch.chunk's pieces of ceil(numel / N), the last ranks short or empty"),
    Diagnosis("array_split", _wrong_as(lambda *a: _reads_by(_array_split_rule, *a)),
              lambda c: f"{_words(c)}. That is numpy.array_split's split (the first ranks "
              "one element longer); the saved pieces are torch.chunk's: ceil(numel / N) "
              "each, the last ranks short or empty"),
    Diagnosis("same_rank_only",
              _wrong_as(lambda numel, saved, world, rank:
                        [(rank, *_chunk_rule(numel, world, rank))] if rank < saved else []),
              lambda c: f"{_words(c)}. On another world size new rank r's piece is not old "
              "rank r's: read the overlap of your new piece with every saved piece"),
    Diagnosis("wrong_reads", always,
              lambda c: f"{_words(c)}. Work out your new piece [lo, hi) by torch.chunk's "
              "rule at the new world size, each saved rank's piece at the saved one, and "
              "return each non-empty overlap, in order of saved rank"),
)


def _names(fn: Callable) -> set[str]:
    """The global and attribute names a function's code (nested functions included) uses."""
    found: set[str] = set()
    stack = [getattr(fn, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is not None:
            found |= set(code.co_names)
            stack += [c for c in code.co_consts if hasattr(c, "co_names")]
    return found


def _refuse_parlibs_map(fn: Callable) -> tuple[str, str] | None:
    """The answer is parlib's own map, or calls it: the check would compare it with itself."""
    if fn is reshard_reads:
        return ("parlib_reshard_reads", "that is parlib.cost.reshard_reads itself, the map the "
                "check compares with: write your own")
    code = getattr(fn, "code", None)
    if code is None:
        try:
            code = inspect.getsource(fn)
        except (OSError, TypeError):
            code = ""
    if re.search(r"\breshard_reads\s*\(", code) or "reshard_reads" in _names(fn):
        return ("parlib_reshard_reads", "your function calls parlib.cost.reshard_reads, the "
                "map the check compares with: work out the overlaps yourself")
    return None


QUESTION = register(CaseExercise(
    "09.reshard_reads",
    cases=CASES,
    report=_report,
    where=lambda case: "",
    refuse=_refuse_parlibs_map,
    refusals=["parlib_reshard_reads"],
    diagnoses=DIAGNOSES,
    solution=RESHARD_SOLUTION,
    prompt="""
        Write reshard_plan(numel, saved_world_size, world_size, rank) -> list of
        (saved_rank, start, stop). A flat vector of numel elements was saved by
        saved_world_size ranks, each holding its piece by torch.chunk's rule (pieces of
        ceil(numel / N), the last ranks short or empty). It is loaded on world_size ranks,
        split the same way. Return what rank must read to rebuild its new piece: for each
        saved rank whose piece overlaps it, in order, the overlap as global element indices
        [start, stop). Checked on every rank against parlib.cost.reshard_reads, on sizes
        and world sizes that do not divide each other (4 -> 3, 3 -> 5, 4 -> 6 with empty
        pieces).
    """,
    explanation="""
        Both splits are torch.chunk's: rank r of N holds [r x S, (r + 1) x S) with
        S = ceil(numel / N), clipped to numel, so the last ranks may be short or empty.
        The new rank's piece [lo, hi) overlaps saved piece [start, stop) where
        max(lo, start) < min(hi, stop); that overlap is what DCP reads from that rank's
        file. The ranges of one new rank tile its piece, and over all new ranks every
        element is read exactly once.
    """,
    after="""
        DCP works this out itself from the DTensor Shard(0) descriptions that
        parlib.strategies.checkpoint gives it: load_checkpoint(..., stats=...) reports the
        bytes a rank read, and the lesson compares them with the sum of these ranges.
    """,
))

__all__ = ["CASES", "RESHARD_SOLUTION"]
