"""Questions of the combining chapter: each check passes the worked answer and rejects realistic
mistakes."""

from __future__ import annotations

import os

import pytest

from parlib.course.check import check, explain
from parlib.course.questions.ch07 import MESH_SOLUTION, pick_layout_problems
from parlib.course.registry import questions
from tests.helpers.learner_code import learner as define_learner

pytestmark = pytest.mark.usefixtures("clean_checks")


def mesh(**changes):
    """The worked answer with one change each (a realistic mistake)."""
    src = MESH_SOLUTION
    for old, new in changes.items():
        old = PLACES[old]
        assert src.count(old) == 1, f"the worked answer no longer has {old!r}"
        src = src.replace(old, new)
    return define_learner(src, "mesh_position")


PLACES = {
    "COORDS": "    tp = rank % t\n    dp = (rank // t) % d\n    pp = rank // (t * d)\n",
    "AT": "return (pp_ * d + dp_) * t + tp_",
    "PREV": "at(pp - 1, dp, tp) if pp > 0",
    "NEXT": "at(pp + 1, dp, tp) if pp < p - 1",
}


def test_ch04_questions_registered():
    assert {"07.mesh_position", "07.seed_chips", "07.seed_copies", "07.seed_memory",
            "07.crosses_nodes", "07.pick_layout", "07.ep_group_dp_cp", "07.ep_group_dp_cp_tp",
            "07.cp_bytes_4d"} <= set(questions("07"))


def test_mesh_position_accepts_the_worked_answer(capsys):
    assert check("07.mesh_position", mesh()).passed
    explain("07.mesh_position")
    assert "rank = (pp x d + dp) x t + tp" in capsys.readouterr().out


@pytest.mark.parametrize("name,changes,hint", [
    ("axes swapped", {"COORDS": "    dp = rank % d\n    tp = (rank // d) % t\n"
                                "    pp = rank // (t * d)\n",
                      "AT": "return (pp_ * t + tp_) * d + dp_"}, "swapped"),
    ("column-major", {"COORDS": "    pp = rank % p\n    dp = (rank // p) % d\n"
                                "    tp = rank // (p * d)\n",
                      "AT": "return (tp_ * d + dp_) * p + pp_"}, "column-major"),
    ("peers off by one", {"PREV": "rank - 1 if pp > 0", "NEXT": "rank + 1 if pp < p - 1"},
     "rank - 1 / rank + 1"),
    ("peers off the end", {"NEXT": "at(pp + 1, dp, tp) if pp < p"}, "pp_next"),
])
def test_mesh_position_rejects_mutants(name, changes, hint):
    result = check("07.mesh_position", mesh(**changes))
    assert not result.passed, name
    assert hint in result.message, result.message


def test_seed_numbers_and_their_hints():
    assert check("07.seed_chips", 1024).passed
    bad = check("07.seed_chips", 256)
    assert not bad.passed and "claims" in bad.message
    assert check("07.seed_copies", 16).passed
    assert not check("07.seed_copies", 64).passed
    gib = 16 * 48e9 / 16 / 2**30
    assert check("07.seed_memory", gib).passed
    for wrong, hint in [(gib * 4, "both t and p"), (gib / 16, "copies"), (48.0, "GB"),
                        # 2 bytes per parameter is 8x too low, but not a bits/bytes slip
                        (gib / 8, "2 bytes per parameter, the fp16 weights only"),
                        (gib / 4, "4 bytes per parameter")]:
        result = check("07.seed_memory", wrong)
        assert not result.passed and hint in result.message, result.message
        assert "bits" not in result.message, result.message


def test_crosses_nodes():
    assert check("07.crosses_nodes", "D").passed
    for wrong in "ABC":
        assert not check("07.crosses_nodes", wrong).passed


def test_pick_layout_rules():
    for good in [(2, 8, 4), (4, 8, 2), (4, 4, 4)]:
        assert check("07.pick_layout", good).passed, pick_layout_problems(*good)
    for bad, rule in [((1, 8, 8), "does not divide the 60 layers"),
                      ((4, 16, 1), "more than the 8 GPUs of a node"),
                      ((8, 8, 1), "does not fit"),
                      ((2, 8, 2), "there are 64 GPUs")]:
        result = check("07.pick_layout", bad)
        assert not result.passed and rule in result.message, result.message
    assert not check("07.pick_layout", "2, 8, 4 please").passed


# --------------------------------------------------------------------------- every hint reachable

# One wrong answer per diagnosis of 07.mesh_position, and a part of the hint it must give.
MESH_DIAGNOSES = {
    "not_a_dict": ({"AT": "return (pp_ * d + dp_) * t + tp_\n\n    return [pp, dp, tp]"},
                   "return a dict with the keys"),
    "missing_key": ({"AT": "return (pp_ * d + dp_) * t + tp_\n\n"
                           "    return {\"pp\": pp, \"dp\": dp, \"tp\": tp}"},
                    "no key 'tp_group'"),
    "axes_swapped": ({"COORDS": "    dp = rank % d\n    tp = (rank // d) % t\n"
                                "    pp = rank // (t * d)\n",
                      "AT": "return (pp_ * t + tp_) * d + dp_"}, "swapped"),
    "column_major": ({"COORDS": "    pp = rank % p\n    dp = (rank // p) % d\n"
                                "    tp = rank // (p * d)\n",
                      "AT": "return (tp_ * d + dp_) * p + pp_"}, "column-major"),
    "neighbours_off_by_one": ({"PREV": "rank - 1 if pp > 0", "NEXT": "rank + 1 if pp < p - 1"},
                              "rank - 1 / rank + 1"),
    "wrong_key": ({"NEXT": "at(pp + 1, dp, tp) if pp < p"}, "pp_next is"),
}


def test_every_mesh_diagnosis_has_a_wrong_answer():
    assert sorted(MESH_DIAGNOSES) == sorted(questions("07")["07.mesh_position"].diagnosis_names())


@pytest.mark.parametrize("name", sorted(MESH_DIAGNOSES))
def test_mesh_wrong_answer_reaches_its_diagnosis(name):
    changes, hint = MESH_DIAGNOSES[name]
    r = check("07.mesh_position", mesh(**changes))
    assert r.status == "failed", r
    assert r.diagnosis == name and hint in r.message, (r.diagnosis, r.message)


def test_mesh_position_never_runs_in_the_graders_process(tmp_path):
    # issue #26: a function answer runs in a child process the grader only reads results from
    seen = tmp_path / "pids"
    src = MESH_SOLUTION.replace(
        "    tp = rank % t\n",
        f"    import os\n    open({str(seen)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"    tp = rank % t\n")
    assert check("07.mesh_position", define_learner(src, "mesh_position")).passed
    pids = {int(line) for line in seen.read_text().split()}
    assert pids and os.getpid() not in pids


def test_pick_layout_working_says_true_things_about_zero3():
    """The working says ZeRO-3 would let d = 64 alone fit, and that the plain rule (no ZeRO)
    is what the check applies: both stay true of cost.estimate."""
    from parlib.cost import Layout, estimate
    from parlib.course.questions.ch07 import layout as pick

    def fits(**options):
        return estimate(pick.PICK_MODEL, pick.PICK_HARDWARE, Layout(dp=64), m=pick.PICK_BATCH // 64,
                        global_batch=pick.PICK_BATCH, **options).fits

    assert fits(zero=3) and not fits()
    assert pick.pick_layout_problems(64, 1, 1) is not None


# ------------------------------------------------------- the five axes: ep's two placements

@pytest.mark.parametrize("qid,right,wrongs", [
    ("07.ep_group_dp_cp", (17, 19, 21, 23), [
        ((20, 21, 22, 23), "the other placement's group"),  # consecutive ranks
        ((17, 21, 25, 29), "the data-parallel group"),  # stride t x c: dp alone
        ((1, 3, 5, 7), "first pipeline stage"),  # the pp offset forgotten
        ((21, 22, 23, 24), "does not start at rank 21"),  # off by one: from the rank on
        ((21, 23, 25, 27), "does not start at rank 21"),  # the right stride, wrong start
        ((16, 18, 20, 22), "contains rank 21"),  # the tp index forgotten
        ((17, 19, 21, 25), "not its group")]),
    ("07.ep_group_dp_cp_tp", (20, 21, 22, 23), [
        ((17, 19, 21, 23), "the other placement's group"),  # t apart: parlib's default
        ((4, 5, 6, 7), "first pipeline stage"),
        ((21, 22, 23, 24), "does not start at rank 21"),
        ((16, 17, 18, 19), "contains rank 21")]),
])
def test_ep_group_questions_take_the_group_and_name_each_slip(qid, right, wrongs):
    assert check(qid, right).passed
    assert check(qid, tuple(reversed(right))).passed  # any order: a group is a set
    for wrong, hint in wrongs:
        result = check(qid, wrong)
        assert not result.passed and hint in result.message, (wrong, result.message)
    assert not check(qid, [17, 19, 21]).passed  # three ranks: a group of e = 4 has four


def test_ep_group_answers_are_the_layouts():
    from parlib.cost import Layout
    from parlib.course.questions.ch07 import placement as P

    both = {b: Layout(**P.EP_SIZES, ep_borrows=b).axis_ranks("ep", P.EP_RANK)
            for b in (("dp", "cp"), ("dp", "cp", "tp"))}
    assert both[("dp", "cp")] == [17, 19, 21, 23] and both[("dp", "cp", "tp")] == [20, 21, 22, 23]


def test_cp_bytes_of_the_4d_run():
    gib = 2**30
    # 9 blocks per layer (3(c - 1)), 16 layers per stage, 8 microbatches, each block
    # 2 x 1 x 4096 x 512 x 2 bytes = 8 MiB
    right = 9 * 16 * 8 * (2 * 1 * 4096 * 512 * 2) / gib
    assert right == 9.0 and check("07.cp_bytes_4d", right).passed
    for wrong, hint in [(right * 8, "h/t"),  # keys and values whole, as if no tp
                        (right * 4, "s/c long"),
                        (right * 2, "L/p"),
                        (right / 8, "times m"),
                        (right / 3, "3(c - 1)"),
                        (right * 2 / 3, "gradients"),
                        (right / 2, "keys and values")]:
        result = check("07.cp_bytes_4d", wrong)
        assert not result.passed and hint in result.message, (wrong, result.message)
