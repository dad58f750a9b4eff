"""Questions of the pipeline chapter: the GPipe grader accepts the reference and rejects each
mutant."""

from __future__ import annotations

import time

import pytest

from parlib.cost import bubble_fraction
from parlib.course.check import check, explain
from parlib.course.questions.ch04 import GPIPE_SOLUTION
from parlib.course.registry import questions
from tests.helpers.learner_code import learner as define_learner

pytestmark = pytest.mark.usefixtures("clean_checks")


def learner(src, name):
    return define_learner(src, name, prelude="from parlib.model import loss_fn\n")






# Mutants are the reference solution (the code the worked answer shows) with one change each.
PLACES = {
    "FWD_SRC": "dist.recv(x, rank - 1)",
    "LOSS_DIV": "loss_fn(y, ys[i].to(dev)) / m",
    "BWD_ORDER": "for i in reversed(range(m)):",
    "ZERO": "    for i in reversed(range(m)):\n",
    "RESULT": "return total if stage.is_last else None",
}
FILLED = {
    "FWD_SRC": "dist.recv(x, {})",
    "LOSS_DIV": "loss_fn(y, ys[i].to(dev)) / ({})",
    "BWD_ORDER": "for i in {}:",
    "ZERO": "    for i in reversed(range(m)):\n        {}\n",
    "RESULT": "return {}",
}


def gpipe(**changes):
    src = GPIPE_SOLUTION
    for key, value in changes.items():
        assert src.count(PLACES[key]) == 1, f"the reference no longer has {PLACES[key]!r}"
        src = src.replace(PLACES[key], FILLED[key].format(value))
    return learner(src, "gpipe_step")


def test_ch03_questions_registered():
    ids = set(questions("04"))
    assert {"04.gpipe", "04.bubble", "04.bubble_naive", "04.min_microbatches",
            "04.gpipe_inflight", "04.1f1b_inflight", "04.boundary_bytes",
            "04.more_stages", "04.dp_pp_sync"} <= ids


def test_numeric_answers_and_hints():
    assert check("04.bubble", 3 / 11).passed
    assert check("04.bubble", bubble_fraction(4, 8)).passed
    r = check("04.bubble", 3 / 8)
    assert r.status == "failed" and "relative to the ideal" in r.message
    assert check("04.bubble_naive", 0.75).passed
    assert check("04.min_microbatches", 64).passed
    r = check("04.min_microbatches", 63)
    assert r.status == "failed" and "exactly" in r.message
    assert check("04.gpipe_inflight", 8).passed and check("04.1f1b_inflight", 4).passed
    assert "warm-up" in check("04.1f1b_inflight", 3).message
    assert check("04.boundary_bytes", 268_435_456).passed
    assert "one direction" in check("04.boundary_bytes", 134_217_728).message
    assert check("04.more_stages", "B").passed
    assert check("04.more_stages", "A").status == "failed"


def test_min_microbatches_names_the_other_bubble_definition():
    # 71 solves (p-1)/m < 0.1: the learner used the bubble relative to the ideal time
    r = check("04.min_microbatches", 71)
    assert r.status == "failed" and "(p-1)/m" in r.message and "(p-1)/(m+p-1)" in r.message
    assert "70 is m + p - 1" in check("04.min_microbatches", 70).message


def test_gpipe_inflight_working_is_consistent(capsys):
    check("04.gpipe_inflight", 8)
    explain("04.gpipe_inflight")
    out = capsys.readouterr().out
    assert "whatever m is" not in out and "grow with m" in out


def test_dp_pp_sync_question():
    assert check("04.dp_pp_sync", "C").passed and check("04.dp_pp_sync", "c").passed
    assert "complete only after the last backward" in check("04.dp_pp_sync", "A").message
    assert "stage 2's layers" in check("04.dp_pp_sync", "B").message
    assert check("04.dp_pp_sync", "D").status == "failed"


def test_min_microbatches_matches_formula():
    from parlib.cost import min_microbatches

    # "under 10%" is strict: 63 gives exactly 0.1
    assert bubble_fraction(8, 63) == pytest.approx(0.1)
    assert min_microbatches(8, 0.1 - 1e-9) == 64


def test_gpipe_reference_passes():
    t0 = time.monotonic()
    r = check("04.gpipe", gpipe())
    assert r.passed, r
    assert time.monotonic() - t0 < 30


def test_gpipe_rejects_wrong_recv_order():
    # the last stage sends gradients m-1..0 but the others take them as 0..m-1
    r = check("04.gpipe", gpipe(BWD_ORDER="(reversed(range(m)) if stage.is_last else range(m))"))
    assert r.status == "failed", r
    assert "2 ranks" in r.message and "microbatch it belongs to" in r.message


def test_gpipe_rejects_missing_accumulation():
    r = check("04.gpipe", gpipe(ZERO="stage.zero_grad()"))
    assert r.status == "failed", r
    assert "only microbatch 0's share" in r.message and "add into .grad" in r.message


def test_gpipe_rejects_backward_in_forward_order():
    # consistent on every rank, so the all-learner cases pass: the mixed case catches it
    r = check("04.gpipe", gpipe(BWD_ORDER="range(m)"))
    assert r.status == "failed", r
    assert "reference GPipe on ranks" in r.message and "m-1, ..., 0" in r.message


def test_gpipe_rejects_loss_divided_by_wrong_count():
    r = check("04.gpipe", gpipe(LOSS_DIV="tokens.shape[0]"))  # the batch size, not m
    assert r.status == "failed", r
    assert "0.5 x the single-device" in r.message and "divide each microbatch's loss by m" \
        in r.message


def test_gpipe_rejects_wrong_return():
    r = check("04.gpipe", gpipe(RESULT="None"))
    assert r.status == "failed", r
    assert "returned None" in r.message


def test_gpipe_deadlock_bounded_by_timeout():
    # receives activations from rank + 1, which never sends them: every rank waits
    t0 = time.monotonic()
    r = check("04.gpipe", gpipe(FWD_SRC="(rank + 1) % stage.p"), timeout=5)
    assert r.status == "failed", r
    assert "did not finish after 5 s" in r.message
    assert time.monotonic() - t0 < 25


def test_gpipe_stub_not_attempted(capsys):
    def gpipe_step(stage, tokens, targets, m):
        raise NotImplementedError

    assert check("04.gpipe", gpipe_step).status == "not attempted"
    explain("04.gpipe")
    assert "reversed(range(m))" not in capsys.readouterr().out  # no working before an attempt


def _notebook_sources(kind):
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[2] / "notebooks/04_pipeline_parallel.ipynb")
                    .read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def test_chapter_prose_facts_match_the_formulas():
    import re

    from parlib import cost

    text = "\n".join(_notebook_sources("markdown"))
    code = "\n".join(_notebook_sources("code"))
    half = cost.min_microbatches(4, bubble_fraction(4, 8) / 2)
    assert f"halving that needs m = {half}" in text and half == 19
    # the explorer's m slider reaches the answer the text asks for (p = 8 under 10%)
    slider = re.search(r"IntSlider\(value=8, min=1, max=(\d+), description=\"microbatches m\"",
                       code)
    assert slider and int(slider.group(1)) >= cost.min_microbatches(8, 0.1 - 1e-9)
    assert "description_width" in code and code.count("display(explorer)") == 1
    assert "widgets.interact(" not in code and "\nexplore()" not in code  # drawn once
    # no test plumbing or course-symbol aliases in what the learner reads
    assert "NBVAL" not in code and not re.search(r"\bP\.\w", text + code)
    assert "tenths of a millisecond" not in text


# --------------------------------------------------------------------------- every hint reachable

# One wrong answer per diagnosis of 04.gpipe, and a part of the hint it must give.
GPIPE_DIAGNOSES = {
    "missing_grad": ({"BWD_ORDER": "[]"}, "did its backward run?"),
    "not_finite": ({"LOSS_DIV": "0"}, "NaN or inf"),
    "scaled_loss": ({"LOSS_DIV": "tokens.shape[0]"}, "divide each microbatch's loss by m"),
    "one_microbatch": ({"ZERO": "stage.zero_grad()"}, "only microbatch 0's share"),
    "wrong_grad": ({"BWD_ORDER": "(reversed(range(m)) if stage.is_last else range(m))"},
                   "microbatch it belongs to"),
    "loss_not_a_number": ({"RESULT": "None"}, "returned None"),
    "wrong_loss": ({"RESULT": "2 * total if stage.is_last else None"}, "2 x the expected"),
    "loss_on_another_stage": ({"RESULT": "total"}, "only the last stage returns the loss"),
}


def test_every_gpipe_diagnosis_has_a_wrong_answer():
    assert sorted(GPIPE_DIAGNOSES) == sorted(questions("04")["04.gpipe"].diagnosis_names())


@pytest.mark.parametrize("name", sorted(GPIPE_DIAGNOSES))
def test_gpipe_wrong_answer_reaches_its_diagnosis(name):
    changes, hint = GPIPE_DIAGNOSES[name]
    r = check("04.gpipe", gpipe(**changes))
    assert r.status == "failed", r
    assert r.diagnosis == name and hint in r.message, (r.diagnosis, r.message)
