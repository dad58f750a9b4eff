"""The launching chapter's ring exercise: every named diagnosis is reached by a wrong answer
(each wrong answer the worked answer's code with one change, or a short function), and the
worked answer passes."""

from __future__ import annotations

import pytest

from parlib.course.check import check
from parlib.course.questions.ch00 import RING_SOLUTION
from parlib.course.registry import questions
from tests.helpers.learner_code import learner

pytestmark = pytest.mark.usefixtures("clean_checks")


def _mutant(old: str, new: str) -> str:
    assert RING_SOLUTION.count(old) == 1, f"the reference no longer has {old!r}"
    return RING_SOLUTION.replace(old, new)


def _returns(value: str) -> str:
    return _mutant("    return out\n", f"    return {value}\n")


REDUCE_TO_ZERO = """
def ring_all_reduce(tensor):
    rank, N = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    if rank == 0:
        buf = torch.empty_like(out)
        for src in range(1, N):
            dist.recv(buf, src)
            out += buf
    else:
        dist.send(out, 0)
    return out
"""

NO_MESSAGES = """
def ring_all_reduce(t):
    from parlib.course.questions.ch00 import _case_input, _lengths
    world = dist.get_world_size()
    case = _lengths(world).index(t.numel())
    return sum(_case_input(world, case, r, t.numel()) for r in range(world))
"""

# wrong answer -> (its source, a words of its hint, the diagnosis it must reach)
RING_MUTANTS = {
    "reduce_to_rank_0": (REDUCE_TO_ZERO, "rank 0 has the right sum", "rank0_only"),
    "sums_in_place": (_returns("(tensor.copy_(out), None)[1]"), "in place",
                      "returned_none_in_place"),
    "returns_none": (_returns("out if N == 1 else None"), "returned None; return",
                     "returned_none"),
    "returns_a_list": (_returns("out.tolist()"), "torch.Tensor", "not_a_tensor"),
    "drops_an_element": (_returns("out[:-1]"), "shape", "wrong_shape"),
    "returns_float64": (_returns("out.double()"), "dtype", "wrong_dtype"),
    "returns_nan": (_returns("out * float('nan')"), "NaN", "not_finite"),
    "subtracts_own": (_returns("out - tensor if N > 1 else out"), "its own contribution",
                      "missing_own"),
    "returns_own": (_returns("tensor.clone()"), "its own input unchanged", "own_input"),
    "copies_in_reduce_scatter": (_mutant("if add:", "if False:"), "missing rank(s)",
                                 "partial_sum"),
    "wrong_gather_index": (_mutant("exchange((rank + 1 - s) % N,", "exchange((rank - s) % N,"),
                           "chunk index", "some_chunks_right"),
    "doubles": (_returns("2 * out"), "elements wrong", "wrong_values"),
    "writes_into_input": (_returns("tensor.copy_(out)"), "input tensor was changed",
                          "input_changed"),
    "calls_all_reduce": ("def ring_all_reduce(t):\n    out = t.clone()\n"
                         "    dist.all_reduce(out)\n    return out\n",
                         "called the collective all_reduce", "collective_used"),
    "no_messages": (NO_MESSAGES, "sent or received nothing", "no_messages"),
    # parlib's own agreement checks are left out of communication logs; a learner's
    # collective wrapped the same way must still be seen
    "hides_all_reduce_as_bookkeeping": (
        "def ring_all_reduce(t):\n    import parlib.comm\n    out = t.clone()\n"
        "    with parlib.comm.bookkeeping():\n        dist.all_reduce(out)\n    return out\n",
        "called the collective all_reduce", "collective_used"),
}


def test_ring_accepts_reference():
    r = check("00.ring_all_reduce", learner(RING_SOLUTION, "ring_all_reduce"))
    assert r.passed, r


@pytest.mark.parametrize("mutant", sorted(RING_MUTANTS))
def test_ring_rejects_mutant_with_its_diagnosis(mutant):
    src, hint, diagnosis = RING_MUTANTS[mutant]
    r = check("00.ring_all_reduce", learner(src, "ring_all_reduce"))
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)


def test_every_ring_diagnosis_has_a_wrong_answer_that_reaches_it():
    # each mutant above reaches its diagnosis; together they reach every one declared
    reached = {diagnosis for _, _, diagnosis in RING_MUTANTS.values()}
    assert sorted(reached) == sorted(questions("00")["00.ring_all_reduce"].diagnosis_names())
