"""Questions of the sharded-data-parallel chapter: each grader accepts the reference answer
and rejects each mutant with the diagnosis (and hint) that names its mistake."""

from __future__ import annotations

import re

import pytest

from parlib.cost.memory import model_state_bytes
from parlib.cost.sharded import zero_sent_bytes_per_step
from parlib.course.check import check
from parlib.course.questions.ch02 import ZERO3_SOLUTION
from parlib.course.registry import questions
from tests.helpers.learner_code import learner as define_learner

pytestmark = pytest.mark.usefixtures("clean_checks")

GiB = 2**30


def test_ch02_questions_registered():
    ids = set(questions("02"))
    assert {"02.zero3_linear", "02.zero3_memory", "02.zero2_mixed_memory", "02.zero3_bytes",
            "02.recompute_pays", "02.fast_links"} <= ids
    for q in questions("02").values():
        assert q.working and q.prompt


# --------------------------------------------------------------------------- numeric / choice

_Z3 = 7e9 / GiB  # 16 bytes / 16 ranks = 1 byte per parameter
_Z2_MIXED = (2 * 7e9 + 14 * 7e9 / 16) / GiB


@pytest.mark.parametrize("qid, right, wrong, hint", [
    ("02.zero3_memory", _Z3, (4 * 7e9 + 12 * 7e9 / 16) / GiB, "ZeRO-2"),
    ("02.zero3_memory", _Z3, (8 * 7e9 + 8 * 7e9 / 16) / GiB, "ZeRO-1"),
    ("02.zero3_memory", _Z3, 16 * 7e9 / GiB, "plain data parallelism"),
    ("02.zero3_memory", _Z3, _Z3 / 2, "16 bytes, not 8"),
    ("02.zero3_memory", _Z3, 7.0, "GiB"),
    ("02.zero2_mixed_memory", _Z2_MIXED, (4 * 7e9 + 12 * 7e9 / 16) / GiB, "bf16"),
    ("02.zero2_mixed_memory", _Z2_MIXED, 16 * 7e9 / 16 / GiB, "ZeRO-3"),
    ("02.zero2_mixed_memory", _Z2_MIXED, (2 * 7e9 + 10 * 7e9 / 16) / GiB, "master copy"),
    ("02.zero2_mixed_memory", _Z2_MIXED, _Z2_MIXED * GiB / 1e9, "GiB"),
    ("02.zero3_bytes", 1.05e10, 7e9, "three passes"),
    ("02.zero3_bytes", 1.05e10, 3.5e9, "one pass"),
    ("02.zero3_bytes", 1.05e10, 2.1e10, "bf16"),
    ("02.zero3_bytes", 1.05e10, 1.2e10, "(N-1)/N"),
    ("02.zero3_bytes", 1.05e10, 5.25e9, "not 1"),
])
def test_numeric_answers_and_hints(qid, right, wrong, hint):
    assert check(qid, right).passed
    r = check(qid, wrong)
    assert r.status == "failed" and hint in r.message, r.message


def test_numbers_are_the_cost_models():
    assert check("02.zero3_memory", model_state_bytes(7e9, 16, zero_stage=3) / GiB).passed
    assert check("02.zero2_mixed_memory",
                 model_state_bytes(7e9, 16, zero_stage=2, mixed_precision=True) / GiB).passed
    assert check("02.zero3_bytes", zero_sent_bytes_per_step(2e9, 8, 3, dtype_bytes=2)).passed


@pytest.mark.parametrize("qid, right, wrong, hint", [
    ("02.recompute_pays", "c", "A", "what divides the activations"),
    ("02.recompute_pays", "C", "B", "bytes per parameter"),
    ("02.recompute_pays", "C", "D", "twice a forward"),
    ("02.fast_links", "d", "A", "2 x P x (N-1)/N"),
    ("02.fast_links", "D", "C", "more memory"),
    ("02.fast_links", "D", "B", "number of units"),
])
def test_choices(qid, right, wrong, hint):
    assert check(qid, right).passed
    r = check(qid, wrong)
    assert r.status == "failed" and hint in r.message, r.message


def test_right_option_is_not_the_longest():
    for q in questions("02").values():
        if hasattr(q, "options"):
            longest = max(q.options.values(), key=len)
            assert q.options[q.answer] != longest, q.id


# --------------------------------------------------------------------------- ZeRO-3 unit

PRELUDE = "from parlib import comm\nimport torch.distributed._functional_collectives as funcol\n"

_GATHER = ("            comm.all_gather(weight, shard, group=group)     # every rank's rows, in "
           "order\n")
_REGATHER = ("            comm.all_gather(weight, shard, group=group)     # gathered again for "
             "backward\n")
_SCATTER = ("            comm.reduce_scatter(grad_shard, grad_w, group=group)  # sum of my rows "
            "only\n")
_RETURN = "            return grad_x, grad_shard / n                   # the sum -> the average\n"
_SAVE = "            ctx.save_for_backward(x, shard)                 # the shard, not the full W\n"

# name: (replacements in the reference, the diagnosis it must reach, words of its hint)
ZERO3_MUTANTS = {
    "gradients all-reduced, then this rank's rows taken": (
        [(_SCATTER, "            dist.all_reduce(grad_w, group=group)\n"
                    "            r, rows = dist.get_rank(group), shard.shape[0]\n"
                    "            grad_shard = grad_w[r * rows:(r + 1) * rows]\n")],
        "all_reduced_gradients", "times the memory"),
    "gathered weight kept for backward": (
        [(_SAVE, _SAVE + "            ctx.weight = weight\n"),
         (_REGATHER, "            weight = ctx.weight\n")],
        "kept_gathered_weights", "bytes of gathered weights"),
    "no division by N": (
        [(_RETURN, "            return grad_x, grad_shard\n")],
        "gradient_times_N", "times too big"),
    "gradient cut by columns": (
        [(_SCATTER, "            columns = torch.cat(grad_w.chunk(n, dim=1))  # flattened: "
                    "shapes agree\n            comm.reduce_scatter(grad_shard.view(-1), "
                    "columns.view(-1), group=group)\n")],
        "wrong_dimension", "columns of dL/dW"),
    "a rank updates the full parameter": (
        [(_SCATTER, "            dist.all_reduce(grad_w, group=group)\n"),
         (_RETURN, "            return grad_x, grad_w / n\n")],
        "full_parameter_gradient", "only its shard"),
    "group ignored": (
        [("group=group", "group=None"), ("dist.get_world_size(group)", "dist.get_world_size()")],
        "ignores_group", "sub-group"),
    "weights written over by the reduce-scatter": (
        [(_SCATTER, "            comm.reduce_scatter(shard.data, grad_w, group=group)\n"
                    "            grad_shard = shard.detach().clone()\n")],
        "breaks_training", "in place"),
    "forward uses this rank's rows N times": (
        [(_GATHER, "            weight = shard.detach().repeat(n, 1)\n")],
        "wrong_output", "first forward"),
    "dL/dW transposed": (
        [("            grad_w = grad_y.T @ x ", "            grad_w = (x.T @ grad_y).reshape("
          "grad_y.shape[1], -1) ")],
        "wrong_gradient", "dL/dW = dL/dy.T @ x"),
    "rank 0 gathers once more than the others": (
        [(_GATHER, _GATHER + "            if dist.get_rank(group) == 0:\n    " + _GATHER)],
        "hang", "did not match"),
}

_LIST_GATHER = ("            pieces = [torch.empty_like(shard) for _ in range(n)]\n"
                "            dist.all_gather(pieces, shard, group=group)\n"
                "            weight = torch.cat(pieces)\n")
# every rank's rows gathered by summing a zero-padded buffer: an all-reduce, not a gather
_PADDED_SUM = ("            weight = torch.zeros(n * shard.shape[0], shard.shape[1])\n"
               "            r, rows = dist.get_rank(group), shard.shape[0]\n"
               "            weight[r * rows:(r + 1) * rows] = shard.detach()\n"
               "            dist.all_reduce(weight, group=group)\n")
_KEEP = (_SAVE, "            ctx.save_for_backward(x, shard, weight)\n")
_KEPT = ("            x, shard = ctx.saved_tensors\n",
         "            x, shard, kept = ctx.saved_tensors\n")
_REUSE = (_REGATHER, "            weight = kept\n")

# Wrong answers the check accepted before it judged by storage what a rank holds between
# forward and backward, and named the way a weight was gathered; name: (replacements,
# diagnosis, words of its hint)
ZERO3_HELD = {
    "list all-gather joined by torch.cat, the joined W kept for backward": (
        [(_GATHER, _LIST_GATHER), _KEEP, _KEPT, _REUSE],
        "kept_gathered_weights", "bytes of gathered weights"),
    "a .detach() of the gathered weight kept on ctx": (
        [(_SAVE, _SAVE + "            ctx.weight = weight.detach()\n"),
         (_REGATHER, "            weight = ctx.weight\n")],
        "kept_gathered_weights", "bytes of gathered weights"),
    "a padded buffer all-reduced into W, kept for backward": (
        [(_GATHER, _PADDED_SUM), _KEEP, _KEPT, _REUSE],
        "kept_gathered_weights", "bytes of gathered weights"),
    "a padded buffer all-reduced into W, in forward and backward": (
        [(_GATHER, _PADDED_SUM), (_REGATHER, _PADDED_SUM)],
        "gathered_by_all_reduce", "all-reduce is not a gather"),
    "async all-gather, computed with before wait()": (
        [(_GATHER, "            work = comm.all_gather(weight, shard, group=group, "
                   "async_op=True)\n"),
         ("            return x @ weight.T ",
          "            y = x @ weight.T\n            work.wait()\n            return y ")],
        "used_before_wait", "before work.wait()"),
    "async all-gather in backward, computed with before wait()": (
        [(_REGATHER, "            work = comm.all_gather(weight, shard, group=group, "
                     "async_op=True)\n"),
         ("            grad_x = grad_y @ weight\n",
          "            grad_x = grad_y @ weight\n            work.wait()\n")],
        "used_before_wait", "before work.wait()"),
}


@pytest.mark.parametrize("name", list(ZERO3_HELD))
def test_zero3_judges_what_a_rank_holds_and_how_it_gathers(name):
    changes, diagnosis, hint = ZERO3_HELD[name]
    r = _check(_mutant(changes))
    assert r.status == "failed", r
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)
    assert hint in r.message, r.message


def test_zero3_accepts_an_async_all_gather_waited_for():
    src = _mutant([(_GATHER, "            work = comm.all_gather(weight, shard, group=group, "
                             "async_op=True)\n            work.wait()\n"),
                   (_REGATHER, "            comm.all_gather(weight, shard, group=group, "
                               "async_op=True).wait()\n")])
    r = _check(src)
    assert r.passed, r


def test_kept_weights_are_measured_by_storage():
    # the gathered W kept through a torch.cat of a list all-gather: every unit's full W
    changes, _, _ = ZERO3_HELD[
        "list all-gather joined by torch.cat, the joined W kept for backward"]
    r = _check(_mutant(changes))
    kept = int(re.search(r"still holds (\d+) bytes", r.message).group(1))
    assert kept == _block_linear_weight_bytes()


# Learners who skip the autograd.Function: whole functions, not edits of the reference.
NO_FUNCTION = {
    "functional all-gather, differentiated by autograd": ('''
def zero3_linear(x, shard, group=None):
    weight = funcol.all_gather_tensor(shard, 0, group or dist.group.WORLD)
    return x @ weight.T
''', "differentiable_collective", "without dividing by N"),
    "all-gather of the shard outside an autograd.Function": ('''
def zero3_linear(x, shard, group=None):
    n = dist.get_world_size(group)
    weight = torch.empty(n * shard.shape[0], shard.shape[1])
    comm.all_gather(weight, shard, group=group)
    return x @ weight.T
''', "collective_without_autograd", "no autograd kernel"),
    "all-gather outside autograd": ('''
def zero3_linear(x, shard, group=None):
    n = dist.get_world_size(group)
    weight = torch.empty(n * shard.shape[0], shard.shape[1])
    comm.all_gather(weight, shard.detach(), group=group)
    return x @ weight.T
''', "no_shard_gradient", "invisible to autograd"),
}


def _mutant(changes: list[tuple[str, str]]) -> str:
    src = ZERO3_SOLUTION
    for old, new in changes:
        assert old in src, f"the reference no longer has {old!r}"
        src = src.replace(old, new)
    return src


def _check(src: str):
    return check("02.zero3_linear", define_learner(src, "zero3_linear", prelude=PRELUDE))


def test_zero3_accepts_the_reference():
    r = _check(ZERO3_SOLUTION)
    assert r.passed, r


def test_zero3_accepts_a_list_all_gather():
    # another right answer: torch's list form, the pieces joined with torch.cat
    gather = ("            pieces = [torch.empty_like(shard) for _ in range(n)]\n"
              "            dist.all_gather(pieces, shard, group=group)\n"
              "            weight = torch.cat(pieces)\n")
    r = _check(_mutant([(_GATHER, gather), (_REGATHER, gather)]))
    assert r.passed, r


@pytest.mark.parametrize("name", list(ZERO3_MUTANTS))
def test_zero3_rejects_mutant(name):
    changes, diagnosis, hint = ZERO3_MUTANTS[name]
    r = _check(_mutant(changes))
    assert r.status == "failed", r
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)
    assert hint in r.message, r.message


@pytest.mark.parametrize("name", list(NO_FUNCTION))
def test_zero3_rejects_unit_without_function(name):
    src, diagnosis, hint = NO_FUNCTION[name]
    r = _check(src)
    assert r.status == "failed", r
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)
    assert hint in r.message, r.message


def test_zero3_stub_not_attempted():
    stub = '''
def zero3_linear(x, shard, group=None):
    raise NotImplementedError("your code here")
'''
    assert _check(stub).status == "not attempted"


def test_every_zero3_diagnosis_is_reached():
    # the tests above show each mutant reaches its diagnosis; together they reach them all
    reached = {d for _, d, _ in ZERO3_MUTANTS.values()} | {d for _, d, _ in NO_FUNCTION.values()}
    reached |= {d for _, d, _ in ZERO3_HELD.values()}
    assert reached == set(questions("02")["02.zero3_linear"].diagnosis_names())


def _block_linear_weight_bytes() -> int:
    from parlib.course.questions.ch02.zero3 import SEED, cfg
    from parlib.model import build_model

    model = build_model(cfg(), SEED)
    return sum(p.numel() * p.element_size() for n, p in model.blocks.named_parameters()
               if n.endswith("weight") and p.dim() == 2)


def test_kept_weights_are_measured():
    # the gathered weights still alive after forward: every unit's full W, and only those
    changes, _, _ = ZERO3_MUTANTS["gathered weight kept for backward"]
    r = _check(_mutant(changes))
    kept = int(re.search(r"still holds (\d+) bytes", r.message).group(1))
    assert kept == _block_linear_weight_bytes()


def test_all_reduced_gradients_are_measured_at_n_times_the_shards():
    changes = [(_SCATTER, "            dist.all_reduce(grad_w, group=group)\n"
                          "            grad_w /= n\n"
                          "            r, rows = dist.get_rank(group), shard.shape[0]\n"
                          "            return grad_x, grad_w[r * rows:(r + 1) * rows]\n")]
    r = _check(_mutant(changes))  # returns a view: shard.grad keeps the whole gradient
    assert r.diagnosis == "all_reduced_gradients", r.message
    reduced, shards, storage = map(int, re.search(
        r"(\d+) bytes of reduced gradient.* shards' (\d+) bytes .*keep (\d+) bytes",
        r.message).groups())
    assert reduced == storage == 2 * shards == _block_linear_weight_bytes()
