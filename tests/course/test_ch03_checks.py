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
    assert check("03.slow_link", "b").passed
    assert "4 times per layer" in check("03.slow_link", "A").message
    assert check("03.t_within_node", "A").passed
    assert not check("03.t_within_node", "C").passed
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


def test_row_parallel_reference_passes():
    r = check("03.row_parallel", row())
    assert r.passed, r


def test_row_parallel_plain_dist_all_reduce_passes():
    # dist.all_reduce in forward is invisible to autograd: its backward is the identity,
    # which is exactly g's. A learner who writes it this way is right.
    src = ROW_PARALLEL_SOLUTION.replace(
        SUM,
        "    dist.all_reduce(partial, group=group)\n    total = partial ")
    r = check("03.row_parallel", row(src))
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


def test_row_parallel_stub_not_attempted():
    stub = """
def row_parallel_linear(x, linear, group=None):
    raise NotImplementedError("your code here")
"""
    assert check("03.row_parallel", row(stub)).status == "not attempted"
