"""03.f and 03.g: Megatron's f and g as autograd functions, probed alone and inside a
tensor-parallel TinyGPT."""

from __future__ import annotations

from typing import Any, Callable

import torch

from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World
from parlib.course.questions.ch03._setup import (
    SEED,
    STEPS,
    WORLDS,
    cfg,
    first_mismatch,
    rank_values,
    reference_record,
    train_record,
)
from parlib.course.registry import register

F_SOLUTION = '''\
def copy_to_parallel_region(x, group=None):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    class CopyToParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)          # every rank already holds the same x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()          # each rank holds its slice's share of dL/dx
            dist.all_reduce(grad, group=ctx.group)
            return grad, None            # no gradient for the group argument

    return CopyToParallelRegion.apply(x, group)
'''

G_SOLUTION = '''\
def reduce_from_parallel_region(x, group=None):
    """g: all-reduce (sum) forward, identity backward."""

    class ReduceFromParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            out = x.clone()              # each rank holds a partial sum
            dist.all_reduce(out, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad, None            # the gradient is already whole on every rank

    return ReduceFromParallelRegion.apply(x, group)
'''

TP_GROUP = 2  # the sub-group probe: 4 ranks as two tensor-parallel groups of 2


def _probe_op(fn: Callable, group_size: int | None = None) -> dict[str, Any]:
    """On each rank: the learner's operator on rank + 1 (a non-leaf tensor, as inside a
    model), and the gradient it passes back for an incoming gradient of 10 x (rank + 1).
    With ``group_size`` the world is cut into consecutive groups of that size (as the
    tensor-parallel groups of a 3-D mesh) and the operator gets this rank's group."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    group, members = None, list(range(world))
    if group_size is not None:
        for start in range(0, world, group_size):  # every rank creates every group
            ranks = list(range(start, start + group_size))
            made = dist.new_group(ranks)
            if rank in ranks:
                group, members = made, ranks
    x = rank_values((3,), 1.0).requires_grad_()
    y = fn(x * 1.0, group)
    if not isinstance(y, torch.Tensor):
        return {"error": f"it returned {type(y).__name__}, not a tensor", "group": members}
    if not y.requires_grad:
        return {"error": "its output does not require grad: build it with "
                         "torch.autograd.Function (forward and backward), call .apply",
                "group": members}
    out = {"forward": y.detach().clone(), "group": members}
    y.backward(rank_values(tuple(y.shape), 10.0))
    out["backward"] = None if x.grad is None else x.grad.detach().clone()
    return out


def _sum(ranks: list[int]) -> float:
    """The sum of rank + 1 over ``ranks``: what an all-reduce of the probe's values gives."""
    return float(sum(r + 1 for r in ranks))


def _ignores_group(which: str) -> Callable[[Case], str]:
    def hint(c: Case) -> str:
        where = "backward" if which == "f" else "forward"
        return (f"{which}'s {where} summed over all {c.world} ranks, not over its group: "
                f"rank {c.rank}'s tensor-parallel group is ranks {c.report['group']}. Pass "
                f"the group to dist.all_reduce (group=group; keep it on ctx in forward), "
                f"or 3-D training mixes the groups' activations")
    return hint


# The expected value of each probe and the known wrong values, per operator. Values are
# functions of (rank, g: the ranks of its group, w: the world size); the hints name the
# mistake.
_OPS = {
    "f": {
        "forward": (lambda r, g, w: r + 1.0, {
            "all_reduce": (lambda r, g, w: _sum(g),
                           "f all-reduces in forward: its input is the same on every rank "
                           "already (it enters a column-parallel region), so f's forward is "
                           "the identity and its all-reduce belongs in backward"),
            "average": (lambda r, g, w: _sum(g) / len(g),
                        "f averages in forward: its forward is the identity")}),
        "backward": (lambda r, g, w: 10.0 * _sum(g), {
            "unchanged": (lambda r, g, w: 10.0 * (r + 1),
                          "f's backward returns the gradient unchanged: each rank's slice of "
                          "the next layer gives only part of dL/dx, so f's backward must "
                          "all-reduce (sum) it"),
            "average": (lambda r, g, w: 10.0 * _sum(g) / len(g),
                        "f's backward divides by t: the ranks' partial gradients add up, sum "
                        "them without dividing"),
            "ignores_group": (lambda r, g, w: 10.0 * _sum(range(w)), _ignores_group("f"))}),
    },
    "g": {
        "forward": (lambda r, g, w: _sum(g), {
            "unchanged": (lambda r, g, w: r + 1.0,
                          "g returns its input: each rank holds a partial sum after a "
                          "row-parallel layer, so g must all-reduce it in forward"),
            "average": (lambda r, g, w: _sum(g) / len(g),
                        "g averages: the partial sums add up to the output, sum them "
                        "without dividing"),
            "ignores_group": (lambda r, g, w: _sum(range(w)), _ignores_group("g"))}),
        "backward": (lambda r, g, w: 10.0 * (r + 1), {
            "all_reduce": (lambda r, g, w: 10.0 * _sum(g),
                           "g's backward all-reduces: the gradient of g's output is already "
                           "the same whole gradient on every rank, so summing it makes it t "
                           "times too big; g's backward is the identity"),
            "average": (lambda r, g, w: 10.0 * _sum(g) / len(g),
                        "g's backward averages: it must return the gradient unchanged")}),
    },
}
_PARTS = ("forward", "backward")


def _tp_with_op(which: str, fn: Callable, steps: int) -> dict[str, Any]:
    """On each rank: the TP copy of a small TinyGPT with the learner's f (or g) inside."""
    from parlib.model import build_model
    from parlib.strategies import tensor_ops
    from parlib.strategies.tensor import local_shards, tensor_parallel_copy

    name = {"f": "copy_to_tensor_parallel_region", "g": "reduce_from_tensor_parallel_region"}
    setattr(tensor_ops, name[which], lambda x, group=None: fn(x, group))
    ref = reference_record(steps)
    tp = tensor_parallel_copy(build_model(cfg(), SEED))
    got = train_record(tp, steps)
    ref["grads"] = [local_shards(tp, gr) for gr in ref["grads"]]
    ref["params"] = local_shards(tp, ref["params"])
    return {"problem": first_mismatch(got, ref)}


def _op_rank(fn: Callable, phase: str, which: str) -> dict[str, Any]:
    """The probe: the operator alone on the whole world ("op") or on sub-groups ("group"),
    or inside a tensor-parallel TinyGPT ("train")."""
    if phase == "train":
        return _tp_with_op(which, fn, STEPS)
    return _probe_op(fn, TP_GROUP if phase == "group" else None)


def _want(which: str, part: str, case: Case, rank: int) -> float:
    """The right value of ``part`` on ``rank``, from the group the probe reported."""
    return _OPS[which][part][0](rank, case.results[rank]["group"], case.world)


def _is(got: torch.Tensor, value: float) -> bool:
    return torch.allclose(got, torch.full_like(got, value))


def _first_wrong(case: Case) -> tuple[int, str] | None:
    phase, which = case.setting.args
    for rank, res in enumerate(case.results):
        if phase == "train":
            if res["problem"]:
                return rank, "train"
            continue
        if "error" in res:
            return rank, "error"
        for part in _PARTS:
            if res[part] is None or not _is(res[part], _want(which, part, case, rank)):
                return rank, part
    return None


def _wrong_value(which: str) -> Callable[[Case], str]:
    def hint(c: Case) -> str:
        got, want = c.report[c.step], _want(which, c.step, c, c.rank)
        came = "" if c.step == "forward" else ", the incoming gradient 10 x (rank + 1)"
        return (f"rank {c.rank}'s {which} gave {got.tolist()} in {c.step}, expected "
                f"{[want] * got.numel()} (its input was rank + 1 = {c.rank + 1}{came})")
    return hint


def _diagnoses(which: str) -> list[Diagnosis]:
    out = [
        Diagnosis("not_autograd", lambda c: c.step == "error",
                  lambda c: f"rank {c.rank}: {c.report['error']}"),
        Diagnosis("no_gradient", lambda c: c.step in _PARTS and c.report[c.step] is None,
                  "rank {rank} got no gradient for x: backward must return the gradient of x "
                  "(and None for the group)"),
    ]
    for part in _PARTS:
        for label, (value, hint) in _OPS[which][part][1].items():
            out.append(Diagnosis(
                f"{part}_{label}",
                lambda c, part=part, value=value: c.step == part and _is(
                    c.report[part], value(c.rank, c.report["group"], c.world)),
                hint))
    out += [
        Diagnosis("wrong_value", lambda c: c.step in _PARTS, _wrong_value(which)),
        Diagnosis("breaks_training", lambda c: c.step == "train",
                  lambda c: f"{c.report['problem']}. Your {which} passed the small test on its "
                  f"own: does it keep state between calls, or change its input in place?"),
    ]
    return out


_CLASS_NOTE = """
        Define the torch.autograd.Function class inside the function and return
        Class.apply(x, group): the grader rebuilds your function from its source, and a
        class defined in another cell would not come with it.
"""


def _exercise(which: str, solution: str, prompt: str, explanation: str) -> RankExercise:
    train = (f"training a tensor-parallel TinyGPT with your {which} on {{world}} ranks, "
             f"rank {{rank}}")
    groups = (f"on {{world}} ranks cut into tensor-parallel groups of {TP_GROUP} "
              f"(ranks 0-1 and 2-3), rank {{rank}}")
    return RankExercise(
        f"03.{which}", probe=_op_rank,
        worlds=[World(t, ("op", which)) for t in WORLDS]
        + [World(max(WORLDS), ("group", which), groups)]
        + [World(t, ("train", which), train) for t in WORLDS],
        reference=lambda world: None,  # the probe's values are formulas of (rank, t); the
        # training run compares with verify.reference_run on the ranks
        first_wrong=_first_wrong, diagnoses=_diagnoses(which), solution=solution,
        explanation=explanation, prompt=prompt, timeout=90.0,
        backend=None)  # launch's default for the ranks' device, as the chapter runs


register(_exercise("f", F_SOLUTION, """
        Write copy_to_parallel_region(x, group=None) -> Tensor, Megatron's f: identity in
        forward, all-reduce (sum over the group) of the gradient in backward, as a
        torch.autograd.Function with forward(ctx, x, group) and backward(ctx, grad).
    """ + _CLASS_NOTE + """
        Checked on 2 and 4 ranks: forward and backward on rank-dependent values (also on
        4 ranks cut into two groups of 2, each rank passing its own group), then as
        the f of a tensor-parallel TinyGPT trained for 3 SGD steps, whose logits,
        gradients and parameters must equal single-device training (rtol 1e-4).
    """, """
        f sits where a replicated activation x enters column-parallel layers. Forward:
        every rank already has x, so pass it through. Backward: rank r's slice of the
        next layer contributes only its part of dL/dx (the gradient flows back through
        rank r's columns only), so the ranks sum their parts: an all-reduce.

        backward returns one gradient per forward input: (gradient of x, None for the
        group). Clone before the in-place all-reduce, so the tensor autograd handed you is
        left alone.
    """))

register(_exercise("g", G_SOLUTION, """
        Write reduce_from_parallel_region(x, group=None) -> Tensor, Megatron's g:
        all-reduce (sum over the group) in forward, identity in backward, as a
        torch.autograd.Function with forward(ctx, x, group) and backward(ctx, grad).
    """ + _CLASS_NOTE + """
        Checked on 2 and 4 ranks: forward and backward on rank-dependent values (also on
        4 ranks cut into two groups of 2, each rank passing its own group), then as
        the g of a tensor-parallel TinyGPT trained for 3 SGD steps, whose logits,
        gradients and parameters must equal single-device training (rtol 1e-4).
    """, """
        g sits after a row-parallel layer. Forward: each rank holds a partial sum of the
        output, so all-reduce (on a clone: the partial sum is autograd's tensor).
        Backward: the loss is computed the same way on every rank from the summed output,
        so the gradient arriving at g is whole and identical on every rank: pass it
        through. Summing it again would make it t times too big.
    """))


__all__ = ["F_SOLUTION", "G_SOLUTION"]
