"""00.ring_all_reduce: an all-reduce built from dist.send and dist.recv alone, a
:class:`~parlib.course.on_ranks.RankExercise` (what is wrong with one rank's result is
``ring_result``'s)."""

from __future__ import annotations

import torch

from parlib.course.answers import plain_data, plain_tensor
from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always
from parlib.course.questions.ch00.ring_result import (
    RANK_DIAGNOSES,
    _collectives,
    _input_changed,
    _lengths,
    _p2p_wrong,
    _rank_problem,
    _reference,
)
from parlib.course.registry import register

WORLDS = (1, 2, 3, 4)


# --------------------------------------------------------------------------- the probe


def _ring_rank(fn) -> list[dict]:
    """Runs on every rank: the cases of one world size, stopping after the first case that
    fails on any rank (so a later case cannot hide it by hanging or crashing)."""
    import torch.distributed as dist

    from parlib.measure import CommLog

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _reference(World(world))
    reports: list[dict] = []
    for case, n in enumerate(_lengths(world)):
        given = reference[case][rank].clone()
        with CommLog(deep=True) as log:  # sees collectives however they are called
            out = fn(given)
        if isinstance(out, torch.Tensor):
            plain = plain_tensor(out)  # a subclass's own methods never judge the result
            out = plain if plain is not None else f"<{type(out).__name__}>"
        elif out is not None:
            out = f"<{type(out).__name__}>"
        reports.append({"n": n, "out": out, "after": plain_tensor(given),
                        "ops": sorted(set(log.pg_calls))})
        mine = Case(world, [reports if q == rank else None for q in range(world)], reference,
                    rank=rank, step=case)
        ok = _rank_problem(mine) is None and not _input_changed(mine)
        if world > 1:
            flag = torch.tensor([0.0 if ok else 1.0])
            dist.all_reduce(flag)
            ok = flag.item() == 0
        if not ok:
            break
    return reports


# --------------------------------------------------------------------------- the grader side


def _first_wrong(case: Case) -> tuple[int, int] | None:
    """(rank, case) of the first case, in order, with a wrong sum, a changed input, or data
    moved other than by send/recv; in a case, wrong sums come first."""
    # what came back from the ranks, as plain data: no learner's subclass judges itself
    case.results[:] = [plain_data(r) for r in case.results]
    results = case.results
    for step, _ in enumerate(_lengths(case.world)):
        if any(step >= len(results[r]) for r in range(case.world)):
            return None
        at = [Case(case.world, results, case.reference, rank=r, step=step)
              for r in range(case.world)]
        for test in (lambda c: _rank_problem(c) is not None, _input_changed, _p2p_wrong):
            wrong = [c.rank for c in at if test(c)]
            if wrong:
                return wrong[0], step
    return None


def _where(c: Case) -> str:
    n = _lengths(c.world)[c.step]
    where = f"on {c.world} rank{'s' if c.world > 1 else ''} with a tensor of {n} elements"
    if c.world > 1 and n % c.world:
        where += f" ({n} does not divide by {c.world})"
    return where


def _at(c: Case, rank: int) -> Case:
    return Case(c.world, c.results, c.reference, rank=rank, step=c.step)


def _rank0_only(c: Case) -> bool:
    return c.rank > 0 and _rank_problem(c) is not None and _rank_problem(_at(c, 0)) is None


def _on_rank(d: Diagnosis) -> Diagnosis:
    """A rank's diagnosis as the grader's verdict: where, which rank, what."""
    return Diagnosis(d.name, lambda c: _rank_problem(c) is d,
                     lambda c: f"{_where(c)}: rank {c.rank} {d.message(c)}")


DIAGNOSES = (
    Diagnosis(
        "rank0_only", _rank0_only,
        lambda c: f"{_where(c)}: rank 0 has the right sum but rank {c.rank} "
        f"{_rank_problem(c).message(c)}. An all-reduce leaves the sum on every rank, not "
        f"only on rank 0 (that is a reduce): after the reduce-scatter phase, pass the summed "
        f"chunks round the ring once more (all-gather)"),
    *(_on_rank(d) for d in RANK_DIAGNOSES),
    Diagnosis(
        "input_changed", _input_changed,
        lambda c: f"{_where(c)}: the result is right but rank {c.rank}'s input tensor was "
        f"changed; work on a copy (out = tensor.clone()) and leave the input as it was"),
    Diagnosis(
        "collective_used", lambda c: bool(_collectives(c)),
        lambda c: f"{_where(c)}: the sum is right, but rank {c.rank} called the collective "
        f"{_collectives(c)[0]}: this exercise builds the all-reduce itself, with dist.send "
        f"and dist.recv only"),
    Diagnosis(
        "no_messages", always,
        lambda c: f"{_where(c)}: the sum is right, but rank {c.rank} sent or received "
        f"nothing: a rank can only learn the others' tensors through dist.send / dist.recv"),
)

# The worked answer's code, written once: the working shows it and the tests derive their
# wrong answers from it.
RING_SOLUTION = """\
def ring_all_reduce(tensor):
    rank, N = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    chunks = torch.tensor_split(out, N)
    right, left = (rank + 1) % N, (rank - 1) % N

    def exchange(send_i, recv_i, add):
        buf = torch.empty_like(chunks[recv_i])
        if rank % 2 == 0:
            dist.send(chunks[send_i].contiguous(), right)
            dist.recv(buf, left)
        else:
            dist.recv(buf, left)
            dist.send(chunks[send_i].contiguous(), right)
        if add:
            chunks[recv_i].add_(buf)
        else:
            chunks[recv_i].copy_(buf)

    for s in range(N - 1):
        exchange((rank - s) % N, (rank - s - 1) % N, add=True)
    for s in range(N - 1):
        exchange((rank + 1 - s) % N, (rank - s) % N, add=False)
    return out
"""


QUESTION = register(RankExercise(
    "00.ring_all_reduce",
    probe=_ring_rank,
    worlds=WORLDS,
    reference=_reference,
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    solution=RING_SOLUTION,
    where="",  # the hints name the world and the tensor's length themselves
    timeout=20.0,
    timeout_hint="a send with no matching recv (or a recv with no matching send) blocks "
                 "forever: check that each rank sends to (rank + 1) % N and receives from "
                 "(rank - 1) % N, and that sends and receives are ordered so that "
                 "neighbours do not both wait",
    backend=None,
    prompt="""
        Write ring_all_reduce(tensor) -> torch.Tensor using only dist.send and dist.recv.
        It returns a new tensor holding the element-wise sum of `tensor` over all ranks, on
        every rank, and leaves its input unchanged. Checked against the exact sum on 1, 2,
        3 and 4 ranks, with 1-D float32 tensors whose length may not divide by N
        (tolerance 1e-5).
    """,
    explanation="""
        Split a copy of the tensor into N chunks with `torch.tensor_split(out, N)` (views,
        so writing into a chunk writes into `out`; uneven lengths are fine). Rank r sends to
        `right = (r + 1) % N` and receives from `left = (r - 1) % N`.

        1. **Reduce-scatter**, N - 1 steps. In step s rank r sends chunk `(r - s) % N` and
           receives chunk `(r - s - 1) % N`, which it **adds** to its own copy. After N - 1
           steps rank r holds the full sum of chunk `(r + 1) % N`.
        2. **All-gather**, N - 1 steps. In step s rank r sends chunk `(r + 1 - s) % N` (a
           finished sum) and receives chunk `(r - s) % N`, which it **copies** in.

        `dist.send` and `dist.recv` block, so if every rank sent first nobody would be
        receiving: even ranks send then receive, odd ranks receive then send. With N = 1
        there are no steps and the copy is the answer.
    """,
    after="""
        Each rank sends 2(N-1) chunks of n/N elements: the 2(N-1)/N x bytes of question
        00.ring_bytes.
    """,
))
