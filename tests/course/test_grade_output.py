"""What ``python -m parlib grade`` prints: the rows in the notebook's order, each hint whole
(wrapped) or cut with a pointer to --json, and nothing before the table (no launch banner,
no kernel warning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parlib.course import grading
from parlib.course.questions.ch00 import RING_SOLUTION
from parlib.course.registry import questions
from tests.helpers.notebooks import notebook

ROOT = Path(__file__).resolve().parents[2]
LONG_HINT = ("your function returned a tensor of shape (9,) on rank 1 where the sum of every "
             "rank's input has shape (10,): the last chunk is shorter when the length does "
             "not divide by the world size, so size each chunk from torch.tensor_split")


def report(message: str) -> dict:
    row = {"id": "00.ring_all_reduce", "status": "failed", "score": 0, "max_score": 1,
           "message": message}
    return {"notebook": "00_x.ipynb", "chapter": "00", "error": None, "questions": [row],
            "score": 0, "max_score": 1}


def test_a_long_hint_is_shown_whole_wrapped_under_its_column():
    text = grading.format_report(report(LONG_HINT), width=100)
    lines = text.splitlines()[1:-1]
    assert " ".join(" ".join(line.split()) for line in lines).endswith(LONG_HINT)
    assert all(len(line) <= 100 for line in lines)
    column = lines[0].index("your function")
    assert all(line[:column].strip() == "" for line in lines[1:])
    assert "--json" not in text


@pytest.mark.parametrize(("json_path", "pointer"), [(None, "--json"), ("s.json", "s.json")])
def test_a_hint_too_long_for_the_table_is_cut_with_a_pointer_to_json(json_path, pointer):
    text = grading.format_report(report(LONG_HINT * 4), json_path, width=100)
    lines = text.splitlines()[1:-1]
    assert len(lines) == grading.HINT_LINES
    assert "cut" in lines[-1] and pointer in lines[-1]


def test_rows_come_in_the_order_the_notebook_asks(tmp_path):
    path = notebook(tmp_path, "00_mine.ipynb",
                    'parlib.check("00.p2p_time", 1.0)',
                    "x = 1\nparlib.check('00.ring_bytes', x)\nparlib.explain('00.p2p_time')",
                    'parlib.check("00.dp_collective", "B")')
    rows = [{"id": qid, "status": "not run", "score": 0, "message": ""}
            for qid in questions("00")]
    ids = [r["id"] for r in grading.report_for(path, rows, None, 0.0)["questions"]]
    named = ["00.p2p_time", "00.ring_bytes", "00.dp_collective"]
    assert ids[:3] == named
    assert ids[3:] == [q for q in questions("00") if q not in named]  # the rest, by id


def test_the_order_of_an_unreadable_notebook_is_the_chapters(tmp_path):
    path = tmp_path / "00_broken.ipynb"
    path.write_text("{not json")
    rows = [{"id": qid, "status": "not run", "score": 0, "message": ""}
            for qid in reversed(list(questions("00")))]
    ids = [r["id"] for r in grading.report_for(path, rows, None, 0.0)["questions"]]
    assert sorted(ids) == ids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_output_is_the_table_only(tmp_path):
    """A right function answer is re-checked on ranks (which print parlib's launch banner)
    by a kernel started as grading starts every kernel (which ipykernel warns about over
    TCP): neither reaches the output."""
    ring = RING_SOLUTION.replace("def ring_all_reduce", "def my_ring")
    path = notebook(tmp_path, "00_mine.ipynb",
                    "import parlib, torch\nimport torch.distributed as dist",
                    ring, 'parlib.check("00.ring_all_reduce", my_ring)',
                    'parlib.check("00.dp_collective", "B")')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "parlib", "grade", str(path), "--json",
                          str(tmp_path / "s.json")], env=env, capture_output=True,
                         text=True, timeout=500, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"{path}  (the launching chapter)"), out.stdout
    assert "rank(s) on" not in out.stdout + out.stderr  # the launch banner
    assert "without encryption" not in out.stderr, out.stderr
    assert out.stderr == "", out.stderr
    rows = json.loads((tmp_path / "s.json").read_text())["notebooks"][0]["questions"]
    assert [r["id"] for r in rows][:2] == ["00.ring_all_reduce", "00.dp_collective"]
    assert rows[0]["status"] == "passed", rows[0]
