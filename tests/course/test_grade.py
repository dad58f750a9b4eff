"""python -m parlib grade: real kernels on the launching chapter's solutions and exercises."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from parlib.course import grading
from parlib.course.registry import questions

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "00_launching_ranks.ipynb"
EXERCISE = ROOT / "exercises" / "00_launching_ranks.ipynb"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two kernels and re-checks


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    import parlib

    if not hasattr(parlib, "check"):  # the notebooks call parlib.check / parlib.explain
        pytest.skip("parlib/__init__.py does not export check/explain yet")
    out = tmp_path_factory.mktemp("grade") / "report.json"
    rc = grading.main([str(SOLUTION), str(EXERCISE), "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_declared_questions():
    ids = list(questions("00"))
    assert len(ids) >= 5 and "00.ring_all_reduce" in ids


def test_solutions_get_full_marks(graded, capsys):
    rc, data = graded
    assert rc == 0
    sol = data["notebooks"][0]
    assert sol["error"] is None
    assert {r["id"] for r in sol["questions"]} == set(questions("00"))
    assert all(r["status"] == "passed" for r in sol["questions"]), sol["questions"]
    assert sol["score"] == sol["max_score"] == sum(q.points for q in questions("00").values())


def test_exercises_get_zero_all_not_attempted(graded):
    _, data = graded
    ex = data["notebooks"][1]
    assert ex["error"] is None
    assert {r["id"] for r in ex["questions"]} == set(questions("00"))
    assert all(r["status"] == "not attempted" for r in ex["questions"]), ex["questions"]
    assert ex["score"] == 0 and ex["max_score"] > 0
    assert data["score"] == data["notebooks"][0]["max_score"]


def test_notebook_that_stops_midway_reports_what_ran(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from parlib.course.check import check\n"
                                  "check('00.ring_bytes', 6 * 2**20)"),
        nbformat.v4.new_code_cell("check('00.dp_collective', 'A')"),
        nbformat.v4.new_code_cell("raise RuntimeError('boom')"),
        nbformat.v4.new_code_cell("check('00.p2p_time', 1.6977)"),
    ]
    path = tmp_path / "00_broken.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "report.json"
    rc = grading.main([str(path), "--json", str(out)])
    assert rc == 1
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())["notebooks"][0]
    status = {r["id"]: r["status"] for r in rep["questions"]}
    assert status["00.ring_bytes"] == "passed"
    assert status["00.dp_collective"] == "failed"
    assert status["00.p2p_time"] == "not run"
    assert "RuntimeError: boom" in rep["error"] and "cell 2" in rep["error"]
    assert rep["score"] == 1
    assert "ERROR" in text and "not run" in text


def test_usage_errors():
    assert grading.main(["/nonexistent/00_x.ipynb"]) == 2
