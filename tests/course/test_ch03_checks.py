"""Questions of the tensor-parallel chapter: each grader accepts the reference and rejects each
mutant with a
hint that names the mistake."""

from __future__ import annotations

import pytest

from parlib.cost.tensor import tp_sent_bytes_per_layer
from parlib.course.check import check, explain
from parlib.course.questions.ch03 import F_SOLUTION, G_SOLUTION, ROW_PARALLEL_SOLUTION
from parlib.course.registry import questions
from tests.helpers.learner_code import learner as define_learner

pytestmark = pytest.mark.usefixtures("clean_checks")

GiB = 2**30


def test_ch02_questions_registered():
    ids = set(questions("03"))
    assert {"03.f", "03.g", "03.row_parallel", "03.bytes_per_layer", "03.layer_memory",
            "03.slow_link", "03.t_within_node", "03.mlp_split"} <= ids
    for q in questions("03").values():
        assert q.working and q.prompt


# --------------------------------------------------------------------------- numeric / choice


@pytest.mark.parametrize("qid, right, wrong, hint", [
    ("03.bytes_per_layer", 939_524_096, 469_762_048, "forward only"),
    # 4 all-reduces x (t-1)/t: the ring factor of one pass is named, not only "forward"
    ("03.bytes_per_layer", 939_524_096, 4 * 7 / 8 * 4 * 2048 * 8192 * 2,
     "With the ring factor (t-1)/t you counted only one of the ring's two passes"),
    ("03.bytes_per_layer", 939_524_096, 536_870_912, "2(t-1)/t"),
    ("03.bytes_per_layer", 939_524_096, 2 * 939_524_096, "bf16"),
    ("03.layer_memory", 1.5, 12.0, "whole layer"),
    ("03.layer_memory", 1.5, 1.0, "MLP alone"),
    ("03.layer_memory", 1.5, 1.5 * GiB / 1e9, "GiB"),
])
def test_numeric_answers_and_hints(qid, right, wrong, hint):
    assert check(qid, right).passed
    r = check(qid, wrong)
    assert r.status == "failed" and hint in r.message, r.message


def test_bytes_per_layer_is_the_formula():
    assert check("03.bytes_per_layer", tp_sent_bytes_per_layer(4, 2048, 8192, 8, 2)).passed


def test_choices():
    assert check("03.slow_link", "d").passed
    assert "4 times per layer" in check("03.slow_link", "A").message
    assert check("03.t_within_node", "A").passed
    assert "keeps shrinking" in check("03.t_within_node", "C").message
    assert "when it is sent" in check("03.t_within_node", "B").message
    assert check("03.mlp_split", "C").passed
    assert "partial sum" in check("03.mlp_split", "B").message


# --------------------------------------------------------------------------- f and g

F_MUTANTS = {
    "all-reduce in forward instead of backward (wrong direction)": (
        [("            return x.view_as(x)          # every rank already holds the same x",
          "            out = x.clone()\n            dist.all_reduce(out, group=group)\n"
          "            return out"),
         ("            dist.all_reduce(grad, group=ctx.group)\n", "")],
        "f all-reduces in forward"),
    "missing gradient all-reduce": (
        [("            dist.all_reduce(grad, group=ctx.group)\n", "")],
        "f's backward returns the gradient unchanged"),
    "gradient averaged (divided by t)": (
        [("            dist.all_reduce(grad, group=ctx.group)\n",
          "            dist.all_reduce(grad, group=ctx.group)\n"
          "            grad /= dist.get_world_size(ctx.group)\n")],
        "divides by t"),
}

_STATEFUL = (  # right on its first call, wrong from the second: passes the probe alone
    "    _calls.append(1)\n    if len(_calls) > 1:\n        x = x * 1.5\n")

F_MUTANTS.update({
    "forward averages": (
        [("            return x.view_as(x)          # every rank already holds the same x",
          "            out = x.clone()\n            dist.all_reduce(out, group=group)\n"
          "            return out / dist.get_world_size(group)")],
        "f averages in forward"),
    "no gradient returned": (
        [("            return grad, None            # no gradient for the group argument",
          "            return None, None")],
        "got no gradient for x"),
    "forward doubles": (
        [("            return x.view_as(x)          # every rank already holds the same x",
          "            return x * 2")],
        "in forward, expected"),
    "no autograd function": (
        [(F_SOLUTION, "def copy_to_parallel_region(x, group=None):\n    return x.detach()\n")],
        "does not require grad"),
    "state kept between calls": (
        [("def copy_to_parallel_region(x, group=None):\n",
          "def copy_to_parallel_region(x, group=None, _calls=[]):\n" + _STATEFUL)],
        "does it keep state between calls"),
})

G_MUTANTS = {
    "forgotten all-reduce": (
        [("            dist.all_reduce(out, group=group)\n", "")],
        "g returns its input"),
    "all-reduce in backward too (duplicated gradient)": (
        [("            return grad, None            # the gradient is already whole on every "
          "rank",
          "            grad = grad.clone()\n            dist.all_reduce(grad)\n"
          "            return grad, None")],
        "t times too big"),
    "partial sums averaged": (
        [("            dist.all_reduce(out, group=group)\n",
          "            dist.all_reduce(out, group=group)\n"
          "            out = out / dist.get_world_size(group)\n")],
        "g averages"),
}

G_MUTANTS.update({
    "backward averages": (
        [("            return grad, None            # the gradient is already whole on every "
          "rank",
          "            grad = grad.clone()\n            dist.all_reduce(grad)\n"
          "            return grad / dist.get_world_size(), None")],
        "g's backward averages"),
    "no gradient returned": (
        [("            return grad, None            # the gradient is already whole on every "
          "rank", "            return None, None")],
        "got no gradient for x"),
    "forward doubles": (
        [("            return out\n", "            return out * 2\n")],
        "in forward, expected"),
    "no autograd function": (
        [(G_SOLUTION, "def reduce_from_parallel_region(x, group=None):\n"
                      "    out = x.detach().clone()\n    dist.all_reduce(out)\n"
                      "    return out\n")],
        "does not require grad"),
    "state kept between calls": (
        [("def reduce_from_parallel_region(x, group=None):\n",
          "def reduce_from_parallel_region(x, group=None, _calls=[]):\n" + _STATEFUL)],
        "does it keep state between calls"),
})

# An f or g that ignores its group and all-reduces over the whole world passes on the world
# alone; on 4 ranks in two tensor-parallel groups of 2 it sums across groups (10 where 3
# and 7 are right), which breaks 3-D training. The sub-group probe names the group.
F_MUTANTS["group ignored (the default group, in place)"] = (
    [("            grad = grad.clone()          # each rank holds its slice's share of dL/dx\n",
      ""),
     ("            dist.all_reduce(grad, group=ctx.group)\n",
      "            dist.all_reduce(grad)\n")],
    "not over its group: rank 0's tensor-parallel group is ranks [0, 1]")
G_MUTANTS["group ignored (the default group)"] = (
    [("            dist.all_reduce(out, group=group)\n", "            dist.all_reduce(out)\n")],
    "not over its group: rank 0's tensor-parallel group is ranks [0, 1]")

# The diagnosis each wrong answer must reach: together they reach every diagnosis.
F_DIAGNOSES = {
    "all-reduce in forward instead of backward (wrong direction)": "forward_all_reduce",
    "missing gradient all-reduce": "backward_unchanged",
    "gradient averaged (divided by t)": "backward_average",
    "group ignored (the default group, in place)": "backward_ignores_group",
    "forward averages": "forward_average",
    "no gradient returned": "no_gradient",
    "forward doubles": "wrong_value",
    "no autograd function": "not_autograd",
    "state kept between calls": "breaks_training",
}
G_DIAGNOSES = {
    "group ignored (the default group)": "forward_ignores_group",
    "forgotten all-reduce": "forward_unchanged",
    "all-reduce in backward too (duplicated gradient)": "backward_all_reduce",
    "partial sums averaged": "forward_average",
    "backward averages": "backward_average",
    "no gradient returned": "no_gradient",
    "forward doubles": "wrong_value",
    "no autograd function": "not_autograd",
    "state kept between calls": "breaks_training",
}
DIAGNOSES = {"03.f": F_DIAGNOSES, "03.g": G_DIAGNOSES}

OPS = {"03.f": (F_SOLUTION, "copy_to_parallel_region", F_MUTANTS),
       "03.g": (G_SOLUTION, "reduce_from_parallel_region", G_MUTANTS)}


def mutate(src, changes):
    for old, new in changes:
        assert src.count(old) == 1, f"the reference no longer has {old!r}"
        src = src.replace(old, new)
    return src


@pytest.mark.parametrize("qid", list(OPS))
def test_operator_reference_passes(qid):
    src, name, _ = OPS[qid]
    r = check(qid, define_learner(src, name))
    assert r.passed, r


@pytest.mark.parametrize("qid, mutant", [(q, m) for q in OPS for m in OPS[q][2]])
def test_operator_rejects_mutant(qid, mutant):
    src, name, mutants = OPS[qid]
    changes, hint = mutants[mutant]
    r = check(qid, define_learner(mutate(src, changes), name))
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == DIAGNOSES[qid][mutant], r.diagnosis


def test_operator_without_autograd_is_rejected():
    # dist.all_reduce on a plain tensor in forward, no Function: autograd sees no f at all
    src = """
def copy_to_parallel_region(x, group=None):
    return x.detach()
"""
    r = check("03.f", define_learner(src, "copy_to_parallel_region"))
    assert r.status == "failed" and "does not require grad" in r.message, r.message


def test_operator_stub_not_attempted(capsys):
    stub = """
def copy_to_parallel_region(x, group=None):
    class CopyToParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            raise NotImplementedError("your code here")

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("your code here")

    return CopyToParallelRegion.apply(x, group)
"""
    assert check("03.f", define_learner(stub, "copy_to_parallel_region")).status == \
        "not attempted"
    explain("03.f")
    assert "dist.all_reduce(grad" not in capsys.readouterr().out  # no working yet


# --------------------------------------------------------------------------- row parallel

PRELUDE = "from parlib.strategies import tensor_ops\n"
SUM = "    total = tensor_ops.reduce_from_tensor_parallel_region(partial, group) "


def row(src=ROW_PARALLEL_SOLUTION):
    return define_learner(src, "row_parallel_linear", prelude=PRELUDE)


ROW_MUTANTS = {
    "bias added on every rank, before the all-reduce": (
        [("    partial = x @ weight.T", "    partial = x @ weight.T + linear.bias"),
         ("    return total + linear.bias ", "    return total ")],
        "t - 1 biases too big"),
    "split along the wrong dimension (rows of torch's weight)": (
        [("    weight = linear.weight[:, rank * cols:(rank + 1) * cols]",
          "    weight = linear.weight[rank * cols:(rank + 1) * cols, :].T")],
        "you took rows of linear.weight"),
    "forgotten all-reduce": (
        [(SUM, "    total = partial ")],
        "only its own partial sum"),
    "all-reduce in the wrong direction (f instead of g)": (
        [(SUM,
          "    total = copy_to_tensor_parallel_region(partial, group) ")],
        "only its own partial sum"),
    "partial sums averaged": (
        [(SUM,
          SUM.rstrip() + " / t ")],
        "sum them (no division by t)"),
    "autograd all-reduce: the gradient summed again in backward": (
        [(SUM,
          "    total = torch.distributed.nn.functional.all_reduce(partial, group=group"
          " or dist.group.WORLD) ")],
        "t times too big"),
}


ROW_MUTANTS.update({
    "the whole weight": (
        [("    weight = linear.weight[:, rank * cols:(rank + 1) * cols]",
          "    weight = linear.weight")],
        "the matching weight slice is the columns"),
    "a slice of the output": (
        [("    return total + linear.bias ", "    return (total + linear.bias)[..., :cols] ")],
        "every rank returns the whole output"),
    "rows of the weight and the bias on every rank": (
        [("    weight = linear.weight[:, rank * cols:(rank + 1) * cols]",
          "    weight = linear.weight[rank * cols:(rank + 1) * cols, :].T"),
         ("    partial = x @ weight.T", "    partial = x @ weight.T + linear.bias"),
         ("    return total + linear.bias ", "    return total ")],
        "and the bias is added on every rank"),
    "output doubled": (
        [("    return total + linear.bias ", "    return total * 2 + linear.bias ")],
        "output differs from the full layer's"),
    "detached output": (
        [("    return total + linear.bias ", "    return (total + linear.bias).detach() ")],
        "does not require grad"),
    "detached bias": (
        [("    return total + linear.bias ", "    return total + linear.bias.detach() ")],
        "got no gradient for the bias"),
    "gradient tripled": (
        [("    return total + linear.bias ",
          "    y = total + linear.bias\n    return y + 2 * y - (2 * y).detach() ")],
        "gradient of x differs"),
    # dist.all_reduce straight on autograd's tensor: right numbers only through torch's
    # deprecated autograd fallback ("may lead to silently incorrect behavior"), and the
    # learner never wrote g. Rejected, with a hint that names g.
    "plain dist.all_reduce, no g": (
        [(SUM, "    dist.all_reduce(partial, group=group)\n    total = partial ")],
        "Use g, tensor_ops.reduce_from_tensor_parallel_region"),
    "state kept between calls": (
        [("def row_parallel_linear(x, linear, group=None):\n",
          "def row_parallel_linear(x, linear, group=None, _calls=[]):\n" + _STATEFUL)],
        "training a tensor-parallel TinyGPT"),
})
ROW_DIAGNOSES = {
    "bias added on every rank, before the all-reduce": "bias_every_rank",
    "split along the wrong dimension (rows of torch's weight)": "wrong_dim",
    "forgotten all-reduce": "no_all_reduce",
    "all-reduce in the wrong direction (f instead of g)": "no_all_reduce",
    "partial sums averaged": "average",
    "autograd all-reduce: the gradient summed again in backward": "gradient_times_t",
    "the whole weight": "shape_error",
    "a slice of the output": "wrong_shape",
    "rows of the weight and the bias on every rank": "wrong_dim_no_bias_fix",
    "output doubled": "wrong_output",
    "detached output": "no_autograd",
    "detached bias": "no_gradient",
    "gradient tripled": "wrong_gradient",
    "plain dist.all_reduce, no g": "plain_all_reduce",
    "state kept between calls": "breaks_training",
}


def test_row_parallel_reference_passes():
    r = check("03.row_parallel", row())
    assert r.passed, r


@pytest.mark.parametrize("name", list(ROW_MUTANTS))
def test_row_parallel_rejects_mutant(name):
    changes, hint = ROW_MUTANTS[name]
    src = ROW_PARALLEL_SOLUTION
    for old, new in changes:
        assert src.count(old) == 1, f"the reference no longer has {old!r}"
        src = src.replace(old, new)
    prelude = PRELUDE + ("from parlib.strategies.tensor_ops import "
                         "copy_to_tensor_parallel_region\nimport torch.distributed.nn\n")
    r = check("03.row_parallel", define_learner(src, "row_parallel_linear", prelude=prelude))
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == ROW_DIAGNOSES[name], r.diagnosis


def test_row_parallel_stub_not_attempted():
    stub = """
def row_parallel_linear(x, linear, group=None):
    raise NotImplementedError("your code here")
"""
    assert check("03.row_parallel", row(stub)).status == "not attempted"


# --------------------------------------------------------------------------- every hint reachable

@pytest.mark.parametrize("qid", ["03.f", "03.g", "03.row_parallel"])
def test_every_diagnosis_has_a_wrong_answer_that_reaches_it(qid):
    # the mutant tests above assert each mutant reaches its diagnosis; this one that the
    # mutants together reach every diagnosis the question declares
    mutants, diagnoses = {"03.f": (F_MUTANTS, F_DIAGNOSES), "03.g": (G_MUTANTS, G_DIAGNOSES),
                          "03.row_parallel": (ROW_MUTANTS, ROW_DIAGNOSES)}[qid]
    assert set(diagnoses) == set(mutants)
    assert sorted(set(diagnoses.values())) == sorted(questions("03")[qid].diagnosis_names())
