"""01.grad_accum: one data-parallel step with gradient accumulation and a single sync."""

from __future__ import annotations

import functools

import torch

from parlib.course.answers import no_process_exit
from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always, off_by
from parlib.course.questions.ch01._setup import LR, SEED, cfg
from parlib.course.registry import register
from parlib.verify import reference_run

MICRO = 3  # microbatches per step, k
ROWS = 2   # rows per microbatch, b
STEPS = 2
WORLDS = (2, 4)


def _batch(world: int) -> int:
    """Global batch B = b x k x N."""
    return ROWS * MICRO * world


def _acc_rank(fn) -> dict:
    """On each rank: STEPS calls of the learner's accumulation step (plain SGD), with this
    rank's B/N rows cut into k microbatches. Records the parameters before and after each
    step and the bytes all-reduced."""
    import torch.distributed as dist

    from parlib.measure import CommLog
    from parlib.model import build_model, loss_fn
    from parlib.strategies import data as dp

    world = dist.get_world_size()
    model = build_model(cfg(), SEED)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    report: dict = {"before": [], "after": [], "reduced_bytes": [],
                    "grad_bytes": sum(p.numel() * p.element_size() for p in params)}
    for step in range(STEPS):
        x, y = dp.local_batch(_batch(world), cfg(), step, SEED)
        micro = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
        before = [p.detach().clone() for p in params]
        with CommLog() as log, no_process_exit():
            fn(model, opt, micro, loss_fn)
        report["reduced_bytes"].append(sum(r.nbytes for r in log.records if r.op == "all_reduce"))
        report["before"].append(before)
        report["after"].append([p.detach().clone() for p in params])
    return report


@functools.lru_cache(maxsize=None)
def _reference(world: World) -> dict:
    """The single-device run on B = b x k x N rows, in N slices (slice r is rank r's rows):
    the gradient each step applies, and each rank's own rows' gradient at step 0 (what a
    rank that never syncs applies)."""
    n = world.size
    h = reference_run(cfg(), steps=STEPS, batch=_batch(n), lr=LR, seed=SEED,
                      microbatches=n, record=("microbatch_grads",))
    return {"grads": [list(g.values()) for g in h.grads],
            "local": [[n * g for g in piece.values()] for piece in h.microbatch_grads[0]]}


def _applied(case: Case, grads: list[torch.Tensor], factor: float = 1.0) -> bool:
    """Did the wrong rank's SGD step move by ``factor`` x ``grads`` (compared in parameter
    space, where fp32 rounding is small)?"""
    before = case.report["before"][case.step]
    return off_by(case.report["after"][case.step], [b - LR * g for b, g in zip(before, grads)],
                  factor, origin=before)


def _want(case: Case) -> list[torch.Tensor]:
    return case.reference["grads"][case.step]


def _first_wrong(case: Case) -> tuple[int, int] | None:
    for step in range(STEPS):
        for rank in range(case.world):
            if not _applied(Case(case.world, case.results, case.reference, rank, step),
                            case.reference["grads"][step]):
                return rank, step
    return None


def _times_synced(case: Case, rank: int, step: int) -> float:
    res = case.results[rank]
    return res["reduced_bytes"][step] / res["grad_bytes"]


def _over_synced(case: Case) -> tuple[int, float] | None:
    """The first rank that all-reduced more than its gradient's bytes in a step, and how
    many times them."""
    for rank in range(case.world):
        for step in range(STEPS):
            if _times_synced(case, rank, step) > 1.5:
                return rank, _times_synced(case, rank, step)
    return None


DIAGNOSES = (
    Diagnosis(
        "kept_last_step_grad",
        lambda c: c.step == 1 and _applied(
            c, [w + e0 for w, e0 in zip(_want(c), c.reference["grads"][0])]),
        "step 1 was right, but step 2 applied step 1's gradient as well. Zero the gradients "
        "(optimizer.zero_grad()) at the start of each step: backward adds into p.grad"),
    Diagnosis(
        "sync_inside_loop",
        lambda c: _times_synced(c, c.rank, c.step) > 1.5,
        lambda c: f"rank {c.rank} all-reduced {_times_synced(c, c.rank, c.step):.1f} times its "
        f"gradient bytes in one step, and its update is wrong. Sync once, after the last "
        f"microbatch: an all-reduce inside the loop sums gradients that were already summed, "
        f"and pays the communication k times"),
    Diagnosis(
        "times_k",
        lambda c: _applied(c, _want(c), MICRO),
        f"rank {{rank}} applied {MICRO} x the full-batch gradient. backward() adds each "
        f"microbatch's gradient into p.grad, so after k microbatches p.grad holds a sum of k "
        f"means: divide by k (or scale each microbatch's loss by 1/k)"),
    Diagnosis(
        "times_N",
        lambda c: _applied(c, _want(c), c.world),
        "rank {rank} applied {world} x the full-batch gradient. all_reduce sums over the "
        "ranks: divide by N = dist.get_world_size()"),
    Diagnosis(
        "times_N_k",
        lambda c: _applied(c, _want(c), c.world * MICRO),
        lambda c: f"rank {c.rank} applied {c.world * MICRO} = N x k times the full-batch "
        f"gradient: divide by k for the microbatches and by N for the ranks"),
    Diagnosis(
        "never_synced",
        lambda c: c.step == 0 and any(_applied(c, c.reference["local"][c.rank], s)
                                      for s in (1.0, MICRO)),
        "rank {rank} stepped with its own rows' gradient only, as if it never synced. After "
        "the last microbatch all-reduce every p.grad and divide by N, on every rank"),
    Diagnosis(
        "no_all_reduce",
        lambda c: c.report["reduced_bytes"][c.step] == 0,
        "rank {rank} made no all_reduce call. Sync the accumulated gradients once per step "
        "with dist.all_reduce"),
    Diagnosis(
        "wrong_update", always,
        "after step {step} rank {rank}'s parameters are not those of full-batch SGD. "
        "Accumulate k backward passes, all-reduce once, divide by k x N, then "
        "optimizer.step()"),
    Diagnosis(
        "right_numbers_k_syncs",
        lambda c: _over_synced(c) is not None,
        lambda c: f"the numbers are right, but rank {_over_synced(c)[0]} all-reduced "
        f"{_over_synced(c)[1]:.1f} x its gradient bytes in one step. Accumulate locally and "
        f"sync once per step: that is the point of accumulation (DDP's no_sync)",
        right=True),
)

HANG_HINT = (
    "your function did not finish on every rank{t} ({where}). Every rank must issue the same "
    "collectives, on tensors of the same size, in the same order: a rank that skips a sync "
    "(or syncs a different parameter, or one time more) leaves its peers waiting in "
    "all_reduce for ever"
)

# The worked answer's code, written once: the working shows it and the tests derive their
# wrong answers from it.
ACCUM_SOLUTION = """\
def accumulation_step(model, optimizer, microbatches, loss_fn):
    k, N = len(microbatches), dist.get_world_size()
    optimizer.zero_grad()
    for x, y in microbatches:
        loss = loss_fn(model(x), y) / k        # mean over b rows, / k: mean over b x k
        loss.backward()                        # adds into p.grad; no communication
    for p in model.parameters():
        dist.all_reduce(p.grad)                # one sync per step, after the last microbatch
        p.grad /= N
    optimizer.step()
"""

QUESTION = register(
    RankExercise(
        "01.grad_accum",
        probe=_acc_rank,
        worlds=WORLDS,
        reference=_reference,
        first_wrong=_first_wrong,
        diagnoses=DIAGNOSES,
        where=f"on {{world}} ranks with k = {MICRO} microbatches",
        hang_hint=HANG_HINT,
        solution=ACCUM_SOLUTION,
        timeout=120.0,
        prompt="""
        Write accumulation_step(model, optimizer, microbatches, loss_fn) -> None: one
        data-parallel training step with gradient accumulation. `microbatches` is this rank's
        list of k (x, y) pairs of b rows each; loss_fn(model(x), y) is the mean loss over
        those b rows. Accumulate the k backward passes, sync the gradients ONCE with
        dist.all_reduce, and call optimizer.step(), so that the step equals single-device SGD
        on the global batch of B = b x k x N rows. Checked on 2 and 4 ranks with k = 3, b = 2,
        over 2 steps (rtol 1e-4); the check also counts the bytes you all-reduce.
    """,
        explanation="""
        The full-batch loss is the mean over B = b x k x N rows: the mean over ranks of the
        mean over microbatches of each microbatch's mean. backward() *adds* into p.grad, so
        after k microbatches p.grad holds a sum of k means: divide by k (scaling each loss by
        1/k does it on the way). The all-reduce sums over the N ranks: divide by N. Sync once,
        after the last microbatch: the bytes per step are those of one all-reduce whatever k
        is, so accumulation buys k times the compute per sync (DDP does this with `no_sync()`
        on the first k-1 microbatches).
    """,
        after="""
        Ways to get it wrong, each caught by the check: all-reducing inside the loop (it
        re-sums gradients that were already summed, and pays k syncs), forgetting 1/k or
        1/N (steps k or N times too long under SGD), forgetting zero_grad (step 2 adds
        step 1's gradient), and a rank that skips the sync: its peers wait in all_reduce,
        because every rank must issue the same collectives in the same order.
    """,
    )
)
