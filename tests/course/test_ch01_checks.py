"""Questions of the data-parallel chapter: each grader accepts the reference answer and rejects
each mutant
with a hint that names the mistake."""

from __future__ import annotations

import math

import pytest

from parlib.course.check import check
from parlib.course.questions.ch01 import ACCUM_SOLUTION, ZERO1_SOLUTION
from parlib.course.registry import questions
from tests.helpers.learner_code import learner as define_learner

pytestmark = pytest.mark.usefixtures("clean_checks")


def learner(src, name):
    return define_learner(src, name, prelude="from parlib.strategies import data as dp\n")


GiB = 2**30


def test_chapter_has_its_questions():
    ids = set(questions("01"))
    assert {
        "01.grad_accum",
        "01.zero1_step",
        "01.ring_bytes_model",
        "01.dp_memory",
        "01.zero1_memory",
        "01.memory_wall",
    } <= ids
    for q in questions("01").values():
        assert q.working and q.prompt


# --------------------------------------------------------------------------- numeric / choice


@pytest.mark.parametrize(
    "qid, right, wrong, hint",
    [
        ("01.ring_bytes_model", 2.45e9, 2 * 1.4e9, "limit"),
        ("01.ring_bytes_model", 2.45e9, 2 * 7 / 8 * 350e6, "4 bytes"),
        ("01.dp_memory", 16 * 1.5e9 / GiB, 16 * 1.5e9 / GiB / 8, "full copy"),
        ("01.dp_memory", 16 * 1.5e9 / GiB, 24.0, "GiB"),
        ("01.dp_memory", 16 * 1.5e9 / GiB, 8 * 1.5e9 / GiB, "two moments"),
        ("01.zero1_memory", 9 * 1.5e9 / GiB, 2 * 1.5e9 / GiB, "ZeRO-3"),
        ("01.zero1_memory", 9 * 1.5e9 / GiB, 5.5 * 1.5e9 / GiB, "ZeRO-2"),
        ("01.zero1_memory", 9 * 1.5e9 / GiB, 16 * 1.5e9 / GiB, "plain data parallelism"),
    ],
)
def test_numeric_answers_and_hints(qid, right, wrong, hint):
    assert check(qid, right).passed
    r = check(qid, wrong)
    assert r.status == "failed" and hint in r.message, r.message
    assert check(qid, ...).status == "not attempted"


def test_choices():
    assert check("01.memory_wall", "a").passed
    r = check("01.memory_wall", "B")
    assert r.status == "failed" and "memory does not pool" in r.message
    assert check("01.overlap", "C").passed
    assert not check("01.overlap", "A").passed


# --------------------------------------------------------------------------- accumulation


def _acc_mutant(old: str, new: str) -> str:
    assert ACCUM_SOLUTION.count(old) == 1, f"the reference no longer has {old!r}"
    return ACCUM_SOLUTION.replace(old, new)


ACCUM_MUTANTS = {
    # all-reduce after every microbatch, no scaling at all
    "sync_every_microstep": (
        _acc_mutant(
            ACCUM_SOLUTION[ACCUM_SOLUTION.index("        loss = "):
                           ACCUM_SOLUTION.index("    optimizer.step()")],
            "        loss_fn(model(x), y).backward()\n"
            "        for p in model.parameters():\n"
            "            dist.all_reduce(p.grad)\n",
        ),
        "Sync once, after the last microbatch",
    ),
    "no_divide_by_k": (
        _acc_mutant("loss_fn(model(x), y) / k ", "loss_fn(model(x), y)     "),
        "divide by k",
    ),
    "no_divide_by_N": (_acc_mutant("        p.grad /= N\n", ""), "divide by N"),
    "no_divide_at_all": (
        _acc_mutant("        p.grad /= N\n", "").replace("/ k ", "    "),
        "by k for the microbatches and by N",
    ),
    "no_zero_grad": (_acc_mutant("    optimizer.zero_grad()\n", ""), "zero_grad"),
    "no_sync": (
        _acc_mutant("        dist.all_reduce(p.grad)", "        pass").replace("/= N", "/= 1"),
        "as if it never synced",
    ),
    "rank_skips_sync": (
        _acc_mutant(
            "        dist.all_reduce(p.grad)",
            "        if dist.get_rank() != 0:\n            dist.all_reduce(p.grad)",
        ),
        "same collectives",
    ),
    # no all-reduce at all, but divides by N: neither synced nor the local gradient
    "no_sync_divides": (
        _acc_mutant("        dist.all_reduce(p.grad)", "        pass"),
        "made no all_reduce call",
    ),
    # synced once, but halves the gradient: no known mistake, the catch-all hint
    "half_the_gradient": (
        _acc_mutant("        p.grad /= N\n", "        p.grad /= 2 * N\n"),
        "are not those of full-batch SGD",
    ),
    # right numbers, k syncs: scaled per microstep, each microstep reduced on its own
    "right_numbers_k_syncs": (
        """
def accumulation_step(model, optimizer, microbatches, loss_fn):
    k, N = len(microbatches), dist.get_world_size()
    optimizer.zero_grad()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for x, y in microbatches:
        for p in model.parameters():
            p.grad = None
        loss_fn(model(x), y).backward()
        for t, p in zip(total, model.parameters()):
            dist.all_reduce(p.grad)
            t += p.grad / (k * N)
    for t, p in zip(total, model.parameters()):
        p.grad = t
    optimizer.step()
""",
        "sync once per step",
    ),
}


# The diagnosis each wrong answer must reach: together they reach every diagnosis.
ACCUM_DIAGNOSES = {
    "sync_every_microstep": "sync_inside_loop",
    "no_divide_by_k": "times_k",
    "no_divide_by_N": "times_N",
    "no_divide_at_all": "times_N_k",
    "no_zero_grad": "kept_last_step_grad",
    "no_sync": "never_synced",
    "no_sync_divides": "no_all_reduce",
    "half_the_gradient": "wrong_update",
    "rank_skips_sync": "hang",
    "right_numbers_k_syncs": "right_numbers_k_syncs",
}


def test_accum_accepts_reference():
    r = check("01.grad_accum", learner(ACCUM_SOLUTION, "accumulation_step"))
    assert r.passed, r


@pytest.mark.parametrize("mutant", sorted(ACCUM_MUTANTS))
def test_accum_rejects_mutant(mutant):
    src, hint = ACCUM_MUTANTS[mutant]
    r = check("01.grad_accum", learner(src, "accumulation_step"))
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == ACCUM_DIAGNOSES[mutant], r.diagnosis


def test_accum_stub_not_attempted():
    stub = learner(
        """
def accumulation_step(model, optimizer, microbatches, loss_fn):
    raise NotImplementedError("your code here")
""",
        "accumulation_step",
    )
    assert check("01.grad_accum", stub).status == "not attempted"


# --------------------------------------------------------------------------- ZeRO-1

def _zero1_mutant(old: str, new: str) -> str:
    assert ZERO1_SOLUTION.count(old) == 1, f"the reference no longer has {old!r}"
    return ZERO1_SOLUTION.replace(old, new)


ZERO1_MUTANTS = {
    "no_division": (_zero1_mutant("    shard.grad /= N\n", ""), "divide the shard's gradient"),
    "no_all_gather": (
        _zero1_mutant(
            "    dp.all_gather(flat, shard.detach())",
            "    flat.zero_()\n"
            "    flat[dist.get_rank() * S:(dist.get_rank() + 1) * S] = shard.detach()\n"
            "    mine = torch.cat([p.detach().reshape(-1) for p in params])\n"
            "    lo, hi = dist.get_rank() * S, min((dist.get_rank() + 1) * S, mine.numel())\n"
            "    mine[lo:hi] = flat[lo:hi]\n    flat[: mine.numel()] = mine\n",
        ),
        "All-gather the updated shards",
    ),
    "no_copy_back": (
        _zero1_mutant(
            "            p.copy_(flat[offset: offset + p.numel()].view_as(p))\n",
            "            pass\n",
        ),
        "did not change",
    ),
    "all_reduce": (
        _zero1_mutant(
            "    dp.reduce_scatter(shard.grad, flat_grad)",
            "    dist.all_reduce(flat_grad)\n"
            "    shard.grad.copy_(flat_grad[dist.get_rank() * S:(dist.get_rank() + 1) * S])\n",
        ),
        "you used all_reduce",
    ),
    "fresh_optimizer": (
        _zero1_mutant(
            "    optimizer.step()\n", "    torch.optim.SGD([shard], lr=0.1, momentum=0.9).step()\n"
        ),
        "Keep the optimizer's state",
    ),
    "wrong_slice": (
        _zero1_mutant(
            "    dp.reduce_scatter(shard.grad, flat_grad)",
            "    dp.reduce_scatter(shard.grad, flat_grad.flip(0))",
        ),
        "is wrong",
    ),
}


ZERO1_DIAGNOSES = {
    "no_division": "times_N",
    "no_all_gather": "own_slice_only",
    "no_copy_back": "no_update",
    "all_reduce": "all_reduce_used",
    "fresh_optimizer": "lost_optimizer_state",
    "wrong_slice": "wrong_elements",
}


def test_zero1_accepts_reference():
    r = check("01.zero1_step", learner(ZERO1_SOLUTION, "zero1_step"))
    assert r.passed, r


@pytest.mark.parametrize("mutant", sorted(ZERO1_MUTANTS))
def test_zero1_rejects_mutant(mutant):
    src, hint = ZERO1_MUTANTS[mutant]
    r = check("01.zero1_step", learner(src, "zero1_step"))
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == ZERO1_DIAGNOSES[mutant], r.diagnosis


def test_zero1_working_matches_reference_numbers():
    # the working's numbers: 9 bytes/param under ZeRO-1 on 8 ranks, 16 under DP
    q = questions("01")["01.zero1_memory"]
    assert math.isclose(q.answer, 9 * 1.5e9 / GiB)
    assert "12.57 GiB" in q.working


# --------------------------------------------------------------------------- every hint reachable

@pytest.mark.parametrize("qid", ["01.grad_accum", "01.zero1_step"])
def test_every_diagnosis_has_a_wrong_answer_that_reaches_it(qid):
    # the mutant tests above assert each mutant reaches its diagnosis; this one that the
    # mutants together reach every diagnosis the question declares
    mutants, diagnoses = {"01.grad_accum": (ACCUM_MUTANTS, ACCUM_DIAGNOSES),
                          "01.zero1_step": (ZERO1_MUTANTS, ZERO1_DIAGNOSES)}[qid]
    assert set(diagnoses) == set(mutants)
    assert sorted(set(diagnoses.values())) == sorted(questions("01")[qid].diagnosis_names())
