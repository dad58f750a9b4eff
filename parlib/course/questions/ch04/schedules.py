"""04.one_f_one_b and 04.zb_h1: pipeline schedules written as data (lists of ``Op``).

The learner's function returns one rank's op list; the checks call it for every rank,
hand the whole schedule to the validator (``parlib.strategies.schedule_check.validate``),
then look at what a valid schedule costs: its peak of microbatches in flight per rank and
its simulated bubble. 04.one_f_one_b also runs the schedule on 2 and 4 ranks and compares
the gradients with the single-device step. The learner's code runs only in child processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from parlib.course.on_ranks import Case, CaseExercise, Diagnosis, RankExercise, World
from parlib.course.registry import register
from parlib.verify import close

CFG_KW = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
SEED = 5
BATCH = 8

# (p, m) the 1F1B plan is judged on, in this order: the first wrong one is diagnosed.
# m > p, m = p (the pipe just full), then m < p last: there the warm-up is capped at m.
ONE_F_ONE_B_SETTINGS = ((2, 4), (4, 8), (4, 4), (4, 2))

ONE_F_ONE_B_SOLUTION = """\
def one_f_one_b(p, m, rank):
    warmup = min(p - 1 - rank, m)
    ops = [F(i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [F(warmup + i), B(i)]
    ops += [B(i) for i in range(m - warmup, m)]
    return ops
"""

# name -> (p, m) of the ZB-H1 cases, judged in this order: m > p, m = p, m < p
ZB_CASES: dict[str, tuple[int, int]] = {"p4_m8": (4, 8), "p2_m4": (2, 4), "p4_m4": (4, 4),
                                        "p4_m2": (4, 2)}
# op times of the simulated timeline: forward, full backward (B + W), weight part
ZB_TIMES = dict(t_f=1.0, t_b=2.0, t_w=1.0)

ZB_H1_SOLUTION = """\
def zb_h1(p, m, rank):
    warmup = min(p - 1 - rank, m)
    ops = [F(i) for i in range(warmup)]
    late = []                          # microbatches whose B ran and W has not
    for i in range(m):
        if warmup + i < m:
            ops.append(F(warmup + i))
        ops.append(B(i))
        late.append(i)
        if len(late) > rank:           # rank r runs each W r backwards late
            ops.append(W(late.pop(0)))
    return ops + [W(i) for i in late]
"""


def _ops_problem(sched: dict[int, Any]) -> dict[str, Any] | None:
    """A problem report when some rank's answer is not a list of ``Op``."""
    from parlib.strategies.schedules import Op

    for rank, ops in sched.items():
        if not isinstance(ops, (list, tuple)):
            return {"problem": "not_ops", "rank": rank,
                    "message": f"rank {rank}'s answer is a {type(ops).__name__}"}
        for i, op in enumerate(ops):
            if not isinstance(op, Op):
                return {"problem": "not_ops", "rank": rank,
                        "message": f"rank {rank}, item {i} is {op!r} (a {type(op).__name__})"}
    return None


# The calls that read the process group, each with two values it is made to return: a
# schedule that changes between them depends on the process, not on the arguments.
GROUP_CALLS = {"get_rank": lambda p: (0, p - 1), "get_world_size": lambda p: (1, p + 1)}


def _ops_under(fn: Callable, p: int, m: int, call: str, value: int) -> str:
    """Every rank's ops (as text: anything but an Op by its type alone, so that the text
    does not change from call to call) while ``dist.<call>()`` returns ``value``."""
    from unittest import mock

    import torch.distributed as dist

    from parlib.strategies.schedules import Op

    def text(ops: Any) -> str:
        if not isinstance(ops, (list, tuple)):
            return type(ops).__name__
        return " ".join(repr(op) if isinstance(op, Op) else type(op).__name__ for op in ops)

    with mock.patch.object(dist, call, lambda *args, **kwargs: value):
        try:
            return " | ".join(text(fn(p, m, r)) for r in range(p))
        except Exception as err:  # noqa: BLE001 -- raising under one value is depending on it
            return f"raised {type(err).__name__}"


def _group_calls(fn: Callable, p: int, m: int) -> list[str]:
    """The process-group calls (dist.get_rank(), dist.get_world_size()) whose value changes
    the ops ``fn`` returns: a schedule must be a function of (p, m, rank) alone, since the
    check asks one process for every rank's ops."""
    return [f"dist.{call}()" for call, values in GROUP_CALLS.items()
            if len({_ops_under(fn, p, m, call, v) for v in values(p)}) > 1]


def _validated(fn: Callable, p: int, m: int) -> tuple[dict[int, list], dict[str, Any] | None]:
    """Every rank's ops from ``fn`` and the validator's verdict on them (None: valid)."""
    from parlib.strategies.schedule_check import ScheduleError, validate

    calls = _group_calls(fn, p, m)  # first: read from the group, the ops mislead
    sched = {r: fn(p, m, r) for r in range(p)}
    bad = _ops_problem(sched)
    if bad is not None:
        return sched, bad
    if calls:
        return sched, {"problem": "reads_group", "calls": calls}
    sched = {r: list(ops) for r, ops in sched.items()}
    try:
        validate(sched, p, m)
    except ScheduleError as err:
        # plain data only: the report goes back from a rank (the microbatch, not the Op)
        return sched, {"problem": err.problem, "message": str(err), "rank": err.rank,
                       "op_mb": None if err.op is None else err.op.mb,
                       "between_ranks": _between_ranks(sched, err)}
    return sched, None


def _between_ranks(sched: dict[int, list], err: Any) -> bool:
    """An order error between two ranks (a neighbour sends another microbatch first), not
    on one rank (a gradient before its own forward, a W before its B)."""
    from parlib.strategies.schedules import BACKWARD, FORWARD, WEIGHT, Op

    if err.problem != "order" or err.op is None or err.index is None:
        return False
    before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(err.op.kind)
    if before is None:
        return True
    return Op(before, err.op.mb, err.op.chunk) in sched[err.rank][:err.index]


def _simulated(sched: dict[int, list], p: int, m: int) -> tuple[float, float]:
    """(step time in units of t_f, idle fraction of the step) of a valid schedule's ideal
    timeline with the op times of :data:`ZB_TIMES`."""
    from parlib.experiments.simulate import simulate
    from parlib.measure.timeline import makespan

    spans = simulate(sched, p, m, **ZB_TIMES)
    step = makespan(spans)
    work = sum(x.duration for rank in spans for x in rank)  # the simulator draws only work
    return step, 1.0 - work / (p * step)


# --------------------------------------------------------------------------- 04.one_f_one_b


def _plan(fn: Callable) -> dict[str, Any]:
    """In one child process: validity and peaks of the learner's 1F1B on every setting."""
    from parlib.strategies.schedules import one_f_one_b, peak_in_flight

    for p, m in ONE_F_ONE_B_SETTINGS:
        sched, bad = _validated(fn, p, m)
        where = {"p": p, "m": m}
        if bad is not None:
            return {**where, **bad}
        peaks = [peak_in_flight(sched[r]) for r in range(p)]
        want = [peak_in_flight(one_f_one_b(p, m, r)) for r in range(p)]
        if peaks != want:
            reference = {r: one_f_one_b(p, m, r) for r in range(p)}
            return {**where, "problem": "peak", "peaks": peaks, "want": want,
                    "step": _simulated(sched, p, m)[0],
                    "step_1f1b": _simulated(reference, p, m)[0]}
    return {"problem": None}


def _run(fn: Callable, m: int) -> dict[str, Any]:
    """On every rank: this rank's stage runs the learner's ops for one training step."""
    import torch.distributed as dist

    from parlib.model import ModelConfig, make_batch
    from parlib.runtime import device
    from parlib.strategies.pipeline import build_stage, run_schedule

    cfg = ModelConfig(**CFG_KW)
    rank, p = dist.get_rank(), dist.get_world_size()
    sched, bad = _validated(fn, p, m)
    if bad is not None:  # every rank computes the same verdict: none of them runs
        return {"p": p, "m": m, **bad}
    stage = build_stage(cfg, SEED, rank, p, device())
    tokens, targets = make_batch(BATCH, cfg, 0, SEED)
    loss = run_schedule(stage, sched[rank], tokens, targets, m)
    return {"problem": None, "loss": loss, "grads": stage.grads()}


def _probe(fn: Callable, mode: str, m: int = 0) -> dict[str, Any]:
    return _plan(fn) if mode == "plan" else _run(fn, m)


@functools.lru_cache(maxsize=None)
def _reference(world: World) -> dict[str, Any] | None:
    if world.args[0] == "plan":
        return None
    from parlib.model import ModelConfig
    from parlib.verify import reference_run

    h = reference_run(ModelConfig(**CFG_KW), steps=1, batch=BATCH, seed=SEED,
                      microbatches=world.args[1])
    return {"loss": h.losses[0], "grads": h.grads[0]}


def _first_wrong(case: Case) -> tuple[int, Any] | None:
    for rank, res in enumerate(case.results):
        if res["problem"] is not None:
            return rank, f"p={res['p']}, m={res['m']}"
        if case.reference is not None:
            want = case.reference["grads"]
            if any(not close(g, want[n]) for n, g in res["grads"].items()):
                return rank, "gradients"
    return None


def _is(problem: str) -> Callable[[Case], bool]:
    return lambda c: c.report["problem"] == problem


def _setting(c: Case) -> str:
    return f"with p = {c.report['p']}, m = {c.report['m']}"


def _says(c: Case) -> str:
    return f"{_setting(c)} the validator says: {c.report['message']}"


def _beyond_m(c: Case) -> bool:
    mb = c.report.get("op_mb")
    return c.report["problem"] == "unknown" and mb is not None and mb >= c.report["m"]


def _group_hint(name: str) -> Callable[[Case], str]:
    """The hint for a schedule that reads the process group instead of its arguments."""
    def hint(c: Case) -> str:
        calls = c.report["calls"]
        args = " and ".join({"dist.get_rank()": "`rank`", "dist.get_world_size()": "`p`"}[x]
                            for x in calls)
        return (f"your function's ops change with what {' and '.join(calls)} returns: it "
                f"takes the rank from the process group, not from its argument {args}. A "
                f"schedule is a plan made for every rank: the check calls {name}(p, m, r) "
                f"for r = 0, ..., p - 1 in one process, where the group says nothing of r. "
                f"Build rank r's ops from the arguments (p, m, rank) alone")
    return hint


def _peaks(c: Case) -> str:
    return f"peak in flight per rank {c.report['peaks']}, 1F1B's {c.report['want']}"


def _holds_all(c: Case) -> bool:
    return (c.report["problem"] == "peak"
            and c.report["peaks"] == [c.report["m"]] * c.report["p"])


def _one_too_many(c: Case) -> bool:
    m, want = c.report["m"], c.report["want"]
    return c.report["problem"] == "peak" and c.report["peaks"] == [min(w + 1, m) for w in want]


def _too_few(c: Case) -> bool:
    return (c.report["problem"] == "peak"
            and all(g <= w for g, w in zip(c.report["peaks"], c.report["want"])))


def _too_few_hint(c: Case) -> str:
    step, ref = c.report["step"], c.report["step_1f1b"]
    wait = (f"but its ranks wait: the simulated step takes {step:g} t_f against 1F1B's "
            f"{ref:g} t_f (t_b = 2 t_f)" if step > ref + 1e-9 else
            "which is not the schedule asked for")
    return (f"{_setting(c)} your schedule is valid and holds fewer microbatches than 1F1B "
            f"({_peaks(c)}), {wait}. Run p - 1 - rank warm-up forwards so that the pipe is "
            f"full when the first gradient comes back")


ONE_F_ONE_B_DIAGNOSES = (
    Diagnosis("not_ops", _is("not_ops"),
              lambda c: f"{_setting(c)}: {c.report['message']}: return a list of Op, built "
              f"with F(i) and B(i) (from parlib.strategies.schedules)"),
    Diagnosis("rank_from_group", _is("reads_group"), _group_hint("one_f_one_b")),
    Diagnosis("microbatch_beyond_m", _beyond_m,
              lambda c: f"{_says(c)}. There are only m = {c.report['m']} microbatches: when m "
              f"is smaller than p - 1 - rank, the warm-up runs all m forwards and no more "
              f"(cap it at m)"),
    Diagnosis("deadlock", _is("deadlock"),
              lambda c: f"{_says(c)}. A rank's first backward needs the gradient the last "
              f"stage sends back, so each rank must run enough forwards first to fill the "
              f"pipe below it: p - 1 - rank warm-up forwards on rank `rank` (the first "
              f"stage the most, the last none)"),
    Diagnosis("microbatch_order", lambda c: c.report.get("between_ranks", False),
              lambda c: f"{_says(c)}. Every rank must run its backwards in the same "
              f"microbatch order, 0, 1, ..., m-1, in the cool-down too (1F1B's oldest "
              f"microbatch first), or a gradient arrives for another microbatch than the "
              f"one the rank's next op expects"),
    Diagnosis("gradient_before_forward", _is("order"),
              lambda c: f"{_says(c)}. In the steady phase a rank runs the forward of its next "
              f"microbatch first, then the backward of its oldest one: F(warmup + i), B(i)"),
    Diagnosis("skipped_backward", _is("missing"),
              lambda c: f"{_says(c)}. Every microbatch needs its backward on every rank: the "
              f"cool-down after the steady phase runs the backwards the steady phase did "
              f"not (the last `warmup` ones)"),
    Diagnosis("repeated_op", _is("repeated"),
              lambda c: f"{_says(c)}. Each forward and each backward runs once: count the "
              f"backwards of the steady phase and of the cool-down, m in all"),
    Diagnosis("invalid", lambda c: c.report["problem"] not in (None, "peak"), _says),
    Diagnosis("holds_every_microbatch", _holds_all,
              lambda c: f"{_setting(c)} your schedule is valid, but every rank holds all "
              f"m = {c.report['m']} microbatches at its peak ({_peaks(c)}): that is GPipe's "
              f"memory. Start the backwards before all forwards have run: p - 1 - rank "
              f"warm-up forwards, then one forward and one backward in turn"),
    Diagnosis("warmup_one_too_many", _one_too_many,
              lambda c: f"{_setting(c)} your schedule is valid but holds one microbatch too "
              f"many on each rank ({_peaks(c)}): the warm-up is p - 1 - rank forwards, not "
              f"p - rank; the steady phase's first forward is the one that makes p - rank"),
    Diagnosis("warmup_too_short", _too_few, _too_few_hint),
    Diagnosis("wrong_peak", _is("peak"),
              lambda c: f"{_setting(c)} your schedule is valid but its memory is not 1F1B's "
              f"({_peaks(c)}): rank r holds at most p - r microbatches (m if fewer)"),
)

ONE_F_ONE_B_WORLDS = (
    World(1, ("plan",), ""),
    World(2, ("run", 4), "run on 2 ranks (m = 4, batch 8), rank {rank}"),
    World(4, ("run", 8), "run on 4 ranks (m = 8, batch 8), rank {rank}"),
)

ONE_F_ONE_B = register(RankExercise(
    "04.one_f_one_b",
    probe=_probe,
    worlds=ONE_F_ONE_B_WORLDS,
    reference=_reference,
    first_wrong=_first_wrong,
    diagnoses=ONE_F_ONE_B_DIAGNOSES,
    solution=ONE_F_ONE_B_SOLUTION,
    where="",  # the plan's hints name their (p, m); the runs' worlds say where they ran
    backend=None,
    timeout=60.0,
    prompt="""
        Write one_f_one_b(p, m, rank) -> list[Op]: the 1F1B schedule of one rank as data,
        built with F(i) (forward of microbatch i) and B(i) (its backward). Checked: the
        schedule of every rank goes through the validator for (p, m) = (2, 4), (4, 8),
        (4, 4) and (4, 2), asked for every rank in one process; rank r must hold at most
        p - r microbatches at once (m if fewer); then it runs on 2 ranks (m = 4) and 4
        ranks (m = 8) and its gradients are compared with the single-device step (rtol
        1e-4).
    """,
    explanation="""
        Start from GPipe, all forwards then all backwards, and move the backwards as early
        as the pipeline allows. Rank r's first backward needs the gradient of microbatch 0
        from the last stage, which can only start once microbatch 0 got there. So rank r
        runs **p - 1 - r warm-up forwards** (capped at m), then alternates: the forward of
        the next microbatch, the backward of the oldest (F(warmup + i), B(i)). When the
        forwards run out, the **cool-down** runs the last `warmup` backwards.

        Every rank runs its backwards in microbatch order 0, ..., m-1, so each gradient
        that crosses a boundary is the one the neighbour's next op expects. The count of
        microbatches in flight rises to warmup + 1 = p - r and stays there: the last
        stage holds 1, the first p, whatever m is.
    """,
    after="""
        `parlib.strategies.schedules.one_f_one_b` is the same function; the runner
        (`run_schedule`) executes any schedule the validator accepts.
    """,
))


# --------------------------------------------------------------------------- 04.zb_h1


def _zb_report(fn: Callable, name: str) -> dict[str, Any]:
    from parlib.strategies.schedules import WEIGHT, one_f_one_b, peak_in_flight, zb_h1

    p, m = ZB_CASES[name]
    report: dict[str, Any] = {"p": p, "m": m}
    sched, bad = _validated(fn, p, m)
    if bad is not None:
        return {**report, **bad}
    if not any(op.kind == WEIGHT for ops in sched.values() for op in ops):
        return {**report, "problem": "unsplit"}
    peaks = [peak_in_flight(sched[r]) for r in range(p)]
    # the pipeline's memory is its fullest rank's: 1F1B's first rank, min(p, m)
    want = [max(peak_in_flight(one_f_one_b(p, m, r)) for r in range(p))] * p
    if any(g > w for g, w in zip(peaks, want)):
        rank = next(r for r in range(p) if peaks[r] > want[r])
        ops = sched[rank]
        last_b = max(i for i, op in enumerate(ops) if op.kind != WEIGHT)
        weights_last = all(op.kind == WEIGHT for op in ops[last_b + 1:]) and \
            sum(op.kind == WEIGHT for op in ops[last_b + 1:]) == m
        return {**report, "problem": "w_at_end" if weights_last else "peak", "peaks": peaks,
                "want": want, "rank": rank}
    step, bubble = _simulated(sched, p, m)
    best_step, best = _simulated({r: zb_h1(p, m, r) for r in range(p)}, p, m)
    f1b_step, f1b = _simulated({r: one_f_one_b(p, m, r) for r in range(p)}, p, m)
    report.update(step=step, bubble=bubble, best_step=best_step, best=best, f1b_step=f1b_step,
                  f1b=f1b)
    if step > best_step + 1e-9:
        report["problem"] = "w_behind_b" if _each_w_behind_its_b(sched) else "bubble"
    return report


def _each_w_behind_its_b(sched: dict[int, list]) -> bool:
    """Every W right after its own B, on every rank."""
    from parlib.strategies.schedules import WEIGHT

    return all(op.kind != WEIGHT or (i > 0 and ops[i - 1].mb == op.mb
                                     and ops[i - 1].kind != WEIGHT)
               for ops in sched.values() for i, op in enumerate(ops))


def _zb_where(c: Case) -> str:
    return f"with p = {c.report['p']}, m = {c.report['m']}"


def _bubbles(c: Case) -> str:
    r = c.report
    return (f"simulated step {r['step']:g} t_f (bubble {r['bubble']:.3f} of the step); 1F1B "
            f"takes {r['f1b_step']:g} t_f ({r['f1b']:.3f}), ZB-H1 {r['best_step']:g} t_f "
            f"({r['best']:.3f}), with t_f = 1, B = 1, W = 1")


ZB_DIAGNOSES = (
    Diagnosis("not_ops", _is("not_ops"),
              lambda c: f"{c.report['message']}: return a list of Op built with F, B and W"),
    Diagnosis("rank_from_group", _is("reads_group"), _group_hint("zb_h1")),
    Diagnosis("microbatch_beyond_m", _beyond_m,
              lambda c: f"the validator says: {c.report['message']}. There are only m = "
              f"{c.report['m']} microbatches: when m is smaller than p - 1 - rank, the "
              f"warm-up runs all m forwards and no more (cap it at m), and the steady phase "
              f"runs no forward"),
    Diagnosis("weight_before_backward",
              lambda c: c.report["problem"] == "order" and not c.report["between_ranks"],
              lambda c: f"the validator says: {c.report['message']}. W(i) computes the weight "
              f"gradients from the output gradient that B(i) received: it can run only after "
              f"B(i) on the same rank"),
    Diagnosis("weight_missing", _is("missing"),
              lambda c: f"the validator says: {c.report['message']}. Once a schedule splits "
              f"the backward, every microbatch needs its W on every rank, or that rank's "
              f"weight gradients stay incomplete"),
    Diagnosis("deadlock", _is("deadlock"),
              lambda c: f"the validator says: {c.report['message']}. Keep 1F1B's order of F "
              f"and B (its warm-up and steady phase); only the W are yours to place"),
    Diagnosis("invalid", lambda c: c.report["problem"] not in (
        None, "unsplit", "w_at_end", "peak", "w_behind_b", "bubble"),
        lambda c: f"the validator says: {c.report['message']}"),
    Diagnosis("unsplit", _is("unsplit"),
              "your schedule has no W op: its B are full backwards, so this is 1F1B again. "
              "Split each backward: B(i) computes the input gradient the previous stage "
              "waits for, W(i) the weight gradients, which nobody waits for"),
    Diagnosis("weights_at_the_end", _is("w_at_end"),
              lambda c: f"your schedule is valid, but it runs every W at the end: a "
              f"microbatch's activations stay until its W, so rank {c.report['rank']} holds "
              f"{c.report['peaks'][c.report['rank']]} microbatches at its peak, 1F1B "
              f"{c.report['want'][c.report['rank']]} (peaks {c.report['peaks']} against "
              f"{c.report['want']}). Run a W before the next F whenever that F would take the "
              f"rank above 1F1B's peak"),
    Diagnosis("too_much_memory", _is("peak"),
              lambda c: f"your schedule is valid, but rank {c.report['rank']} holds more "
              f"microbatches than 1F1B's first rank (peaks {c.report['peaks']}, at most "
              f"{c.report['want'][0]}): a microbatch is held from its F until its W, so a W "
              f"put off too long keeps its activations"),
    Diagnosis("w_right_behind_its_b", _is("w_behind_b"),
              lambda c: f"your schedule is valid with 1F1B's memory, but every W runs right "
              f"behind its B: {_bubbles(c)}. In the cool-down a W there delays the next B, "
              f"which the previous stage waits for: let each W wait until after the next B, "
              f"where the rank would otherwise wait for a gradient"),
    Diagnosis("bubble_too_large", _is("bubble"),
              lambda c: f"your schedule is valid with 1F1B's memory, but slower than ZB-H1: "
              f"{_bubbles(c)}. Draw its timeline (simulate): where does a rank still wait "
              f"while it holds a W it could run, or run a W while a neighbour waits for "
              f"its next B?"),
)


ZB_H1 = register(CaseExercise(
    "04.zb_h1",
    cases=ZB_CASES,
    report=_zb_report,
    where=_zb_where,
    diagnoses=ZB_DIAGNOSES,
    solution=ZB_H1_SOLUTION,
    timeout=60.0,
    prompt="""
        Write zb_h1(p, m, rank) -> list[Op]: the ZB-H1 zero-bubble schedule of one rank,
        built with F(i), B(i) (now the input-gradient half of the backward) and W(i) (the
        weight-gradient half). Checked for (p, m) = (4, 8), (2, 4), (4, 4), (4, 2), every
        rank asked for in one process: the validator accepts it; no rank holds more
        microbatches than 1F1B's first rank does (a microbatch is held from its F to its
        W); and its simulated step (t_f = 1, B = 1, W = 1, instant messages) is as short as
        ZB-H1's.
    """,
    explanation="""
        Keep 1F1B's F and B exactly where they were: the same warm-up of p - 1 - rank
        forwards, the same steady phase, the same cool-down of backwards. B(i) now only
        computes the gradient of the stage input, which the previous stage is waiting
        for, so the gradients travel back faster. W(i), the weight gradients, is needed
        by nobody else: run it where the rank would otherwise wait.

        Where does a rank wait? At the end of the step the last gradients travel back to
        rank 0 one B at a time: rank r runs its last B about r B-times before rank 0 does,
        and would then sit idle. So rank r runs each W r backwards late (rank 0 right
        behind its B), and its last r W after its last B, in that wait; with the W out of
        the way, each B, and the gradient it sends back, also starts sooner. A microbatch
        is held from its F to its W, so the late W raise rank r's peak from 1F1B's p - r
        to p, the peak of 1F1B's first rank: the pipeline needs no more memory than 1F1B.
    """,
    after="""
        `parlib.strategies.schedules.zb_h1` is the library's ZB-H1 (Qi et al., 2023, "Zero
        Bubble Pipeline Parallelism"); the paper counts its bubble as (p - 1)(t_F + t_B -
        t_W), against 1F1B's (p - 1)(t_F + t_B + t_W), with t_B and t_W the two halves of
        the backward.
    """,
))

__all__ = ["ONE_F_ONE_B", "ONE_F_ONE_B_SETTINGS", "ONE_F_ONE_B_SOLUTION", "ZB_CASES",
           "ZB_H1", "ZB_H1_SOLUTION"]
