"""01.zero1_step: one ZeRO-1 optimizer step (reduce-scatter, step the shard, all-gather)."""

from __future__ import annotations

import functools
import math

import torch

from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always, off_by
from parlib.course.questions.ch01._setup import LR, SEED, cfg, flat
from parlib.course.registry import register
from parlib.verify import ATOL, RTOL, close, reference_run

STEPS = 3
BATCH = 8  # global batch: divides by 2 and 4
WORLDS = (2, 4)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _zero1_rank(fn) -> dict:
    """On each rank: STEPS steps of SGD with momentum through the learner's ZeRO-1 step."""
    import torch.distributed as dist

    from parlib.measure import CommLog
    from parlib.model import build_model, loss_fn
    from parlib.strategies import data as dp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg(), SEED)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    size = math.ceil(total / world)
    padded = torch.zeros(size * world)
    padded[:total] = flat(params)
    shard = padded[rank * size : (rank + 1) * size].clone().requires_grad_(True)
    opt = _optimizer([shard])
    report: dict = {"flats": []}
    ops: list[str] = []
    for step in range(STEPS):
        for p in params:
            p.grad = None
        x, y = dp.local_batch(BATCH, cfg(), step, SEED)
        loss_fn(model(x), y).backward()
        with CommLog() as log:
            fn(params, shard, opt)
        ops += [rec.op for rec in log.records]
        report["flats"].append(flat(params))
    report["ops"] = sorted(set(ops))
    report["shard_size"] = size
    return report


@functools.lru_cache(maxsize=None)
def _reference(world: World) -> dict:
    """Single-device SGD with momentum on the full batch: the flat parameters at the start
    and after each step, and the parameters' names and sizes (the same for every world)."""
    h = reference_run(cfg(), steps=STEPS, batch=BATCH, seed=SEED, optimizer=_optimizer,
                      record=("params_per_step",))
    start = reference_run(cfg(), steps=0, seed=SEED).params
    return {"start": flat(start.values()), "flats": [flat(p.values()) for p in h.params_per_step],
            "names": list(start), "sizes": [t.numel() for t in start.values()]}


def _got(case: Case) -> torch.Tensor:
    return case.report["flats"][case.step]


def _want(case: Case) -> torch.Tensor:
    return case.reference["flats"][case.step]


def _first_wrong(case: Case) -> tuple[int, int] | None:
    want = case.reference["flats"]
    for rank, res in enumerate(case.results):  # the first step on every rank, then the rest
        if not close(res["flats"][0], want[0]):
            return rank, 0
    for rank, res in enumerate(case.results):
        for step, (got, expected) in enumerate(zip(res["flats"], want)):
            if not close(got, expected):
                return rank, step
    return None


def _own_slice(case: Case) -> tuple[int, int]:
    size = case.report["shard_size"]
    return case.rank * size, min((case.rank + 1) * size, _got(case).numel())


def _only_own_slice(case: Case) -> bool:
    lo, hi = _own_slice(case)
    got, start = _got(case), case.reference["start"]
    return close(got[lo:hi], _want(case)[lo:hi]) and close(
        torch.cat([got[:lo], got[hi:]]), torch.cat([start[:lo], start[hi:]]))


def _which_param(case: Case, index: int) -> str:
    offset = 0
    for name, n in zip(case.reference["names"], case.reference["sizes"]):
        if index < offset + n:
            return name
        offset += n
    return "?"


def _wrong_elements(case: Case) -> str:
    got, want = _got(case), _want(case)
    bad = (~torch.isclose(got, want, rtol=RTOL, atol=ATOL)).nonzero()
    i = int(bad[0])
    return (f"after the first step rank {case.rank}'s parameter {_which_param(case, i)!r} is "
            f"wrong (flat element {i} is {got[i].item():.6g}, expected {want[i].item():.6g}; "
            f"{len(bad)} elements wrong). Rank r owns flat elements [r*S, (r+1)*S) with "
            f"S = shard.numel(): reduce-scatter the flattened, zero-padded gradients into "
            f"shard.grad, divide by N, step, all-gather")


DIAGNOSES = (
    Diagnosis(
        "no_update",
        lambda c: c.step == 0 and close(_got(c), c.reference["start"]),
        "rank {rank}'s parameters did not change in the first step. After optimizer.step() "
        "updates the shard, all-gather the shards and copy the result back into the "
        "parameters (p.copy_(...) under torch.no_grad())"),
    Diagnosis(
        "times_N",
        lambda c: c.step == 0 and off_by(_got(c), _want(c), c.world, origin=c.reference["start"]),
        "rank {rank}'s first update is {world} times too big. The reduce-scatter sums the "
        "gradients over the ranks: divide the shard's gradient by the world size before "
        "optimizer.step()"),
    Diagnosis(
        "own_slice_only",
        lambda c: c.step == 0 and _only_own_slice(c),
        lambda c: f"rank {c.rank} updated only its own slice of the parameters (elements "
        f"{_own_slice(c)[0]}..{_own_slice(c)[1] - 1}); the rest kept their old values. "
        f"All-gather the updated shards from every rank before copying them into the "
        f"parameters"),
    Diagnosis("wrong_elements", lambda c: c.step == 0, _wrong_elements),
    Diagnosis(
        "lost_optimizer_state", always,
        "the first step was right, but after step {step} rank {rank}'s parameters differ "
        "from single-device SGD with momentum. Keep the optimizer's state: step the "
        "optimizer you were given, on the shard you were given, every call"),
    Diagnosis(
        "all_reduce_used",
        lambda c: "all_reduce" in c.results[0]["ops"],
        "your numbers are right, but you used all_reduce. ZeRO-1 reduce-scatters the "
        "gradients, so each rank receives only the slice it steps: half the bytes of an "
        "all-reduce (a ring all-reduce is a reduce-scatter then an all-gather), and no full "
        "averaged gradient in memory. Use dp.reduce_scatter (or dist.reduce_scatter_single; "
        "parlib.comm.reduce_scatter picks the name your torch has)",
        right=True),
)

# The worked answer's code, written once: the working shows it and the tests derive their
# wrong answers from it.
ZERO1_SOLUTION = """\
def zero1_step(params, shard, optimizer):
    N = dist.get_world_size()
    S = shard.numel()
    flat_grad = torch.zeros(N * S)
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    flat_grad[: grads.numel()] = grads
    shard.grad = torch.empty(S)
    dp.reduce_scatter(shard.grad, flat_grad)   # sum of my slice over the ranks
    shard.grad /= N
    optimizer.step()
    flat = torch.empty(N * S)
    dp.all_gather(flat, shard.detach())       # everyone's updated slice
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
"""

QUESTION = register(
    RankExercise(
        "01.zero1_step",
        probe=_zero1_rank,
        worlds=WORLDS,
        reference=_reference,
        first_wrong=_first_wrong,
        diagnoses=DIAGNOSES,
        solution=ZERO1_SOLUTION,
        timeout=120.0,
        prompt="""
        Write zero1_step(params, shard, optimizer) -> None, one ZeRO-1 optimizer step after
        loss.backward(). `params` is the model's parameter list (same order on every rank,
        p.grad holds this rank's local gradient); `shard` is this rank's slice of the
        parameters flattened into one vector and zero-padded to N x S elements (rank r owns
        elements [r*S, (r+1)*S), S = shard.numel()); `optimizer` steps `shard` only. Use a
        reduce-scatter and an all-gather (dp.reduce_scatter / dp.all_gather). Checked on 2
        and 4 ranks against 3 single-device steps of SGD with momentum (rtol 1e-4).
    """,
        explanation="""
        1. Flatten the local gradients into one zero-padded vector of N x S elements.
        2. Reduce-scatter it: rank r receives the **sum** over ranks of its S elements.
           Divide by N to get the average, and make it the shard's gradient.
        3. optimizer.step() updates the shard, and the optimizer keeps state (momentum,
           or Adam's moments) for S elements only: that is the memory ZeRO-1 saves.
        4. All-gather the shards into the full vector and copy it back into the parameters,
           so every rank again holds the whole, identical model.
    """,
        after="""
        Bytes per rank with ring algorithms: (N-1)/N x 4P for the reduce-scatter plus
        (N-1)/N x 4P for the all-gather, the same 2(N-1)/N x 4P as the all-reduce of plain
        data parallelism. (On gloo, measured in the chapter, reduce-scatter is implemented
        as a full all-reduce, so there ZeRO-1 sends 1.5 times as much.)
    """,
    )
)
