"""python -m parlib grade on a hostile batch: every notebook becomes a row, forged logs and
patched checkers score nothing, results are written as each notebook finishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parlib.course import grading
from parlib.course.registry import questions
from tests.helpers.notebooks import notebook

# eight notebooks, each in its own grader process and kernel; the timed-out one waits for
# the per-cell limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

IMPORTS = "import os\nimport torch\nimport torch.distributed as dist\nimport parlib"


# The ring split over three cells: a constant, a helper and the function that uses both.
_HELPER = '''
EVEN = 0

def exchange(chunks, rank, send_i, recv_i, add, right, left):
    buf = torch.empty_like(chunks[recv_i])
    if rank % 2 == EVEN:
        dist.send(chunks[send_i].contiguous(), right)
        dist.recv(buf, left)
    else:
        dist.recv(buf, left)
        dist.send(chunks[send_i].contiguous(), right)
    if add:
        chunks[recv_i].add_(buf)
    else:
        chunks[recv_i].copy_(buf)
'''
_RING = '''
def ring(tensor):
    rank, N = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    chunks = torch.tensor_split(out, N)
    right, left = (rank + 1) % N, (rank - 1) % N
    for s in range(N - 1):
        exchange(chunks, rank, (rank - s) % N, (rank - s - 1) % N, True, right, left)
    for s in range(N - 1):
        exchange(chunks, rank, (rank + 1 - s) % N, (rank - s) % N, False, right, left)
    return out
'''

_CHEATS = '''
import json
from parlib.course import registry
from parlib.course.question_types import Choice, Implementation, Numeric
registry.questions()  # load the notebook's copy of the registry, to edit it
log = os.environ["PARLIB_CHECK_LOG"]
with open(log, "a") as f:  # forged verdicts
    for qid in ("00.ring_bytes", "00.ring_all_reduce", "00.dp_collective"):
        f.write(json.dumps({"id": qid, "status": "passed", "score": 100,
                            "max_score": 1}) + "\\n")
Numeric.grade = lambda self, answer: "correct"  # a patched checker
Choice.grade = lambda self, answer: "correct"
registry._REGISTRY["00.p2p_time"].answer = 5.0  # an edited registry
registry._REGISTRY["00.ring_all_reduce"].grader = lambda fn: None
print(parlib.check("00.ring_bytes", 1.0), parlib.check("00.p2p_time", 5.0),
      parlib.check("00.dp_collective", "A"))
def ring_all_reduce(t):
    out = t.clone()
    dist.all_reduce(out)
    return out
parlib.check("00.ring_all_reduce", ring_all_reduce)
'''


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    import parlib

    if not hasattr(parlib, "check"):
        pytest.skip("parlib/__init__.py does not export check/explain yet")
    d = tmp_path_factory.mktemp("batch")
    good = notebook(d, "00_good.ipynb", IMPORTS, _HELPER, _RING,
                    'parlib.check("00.ring_all_reduce", ring)',
                    'parlib.check("00.ring_bytes", 6 * 2**20)')
    cheat = notebook(d, "00_cheat.ipynb", IMPORTS, _CHEATS)
    bad = d / "00_bad.ipynb"
    bad.write_text("this is not JSON {")
    missing = d / "00_missing.ipynb"
    killer = notebook(d, "00_killer.ipynb", IMPORTS,
                      'parlib.check("00.ring_bytes", 6 * 2**20)',
                      "import signal\nos.kill(os.getppid(), signal.SIGKILL)")
    deleter = notebook(d, "00_deleter.ipynb", IMPORTS,
                       'parlib.check("00.ring_bytes", 6 * 2**20)',
                       'os.remove(os.environ["PARLIB_CHECK_LOG"])')
    slow = notebook(d, "00_slow.ipynb", IMPORTS,
                    'parlib.check("00.dp_collective", "B")',
                    "import time\ntime.sleep(600)")
    after = notebook(d, "00_after.ipynb", IMPORTS, 'parlib.check("00.dp_collective", "B")')
    order = [good, cheat, bad, missing, killer, deleter, slow, after]
    out = d / "scores.json"
    rc = grading.main([str(p) for p in order] + ["--json", str(out), "--timeout", "90"])
    data = json.loads(out.read_text())
    rows = {Path(r["notebook"]).stem.split("_", 1)[1]: r for r in data["notebooks"]}
    return rc, data, rows, d


def _status(row):
    return {q["id"]: q["status"] for q in row["questions"]}


def test_every_notebook_is_a_row(batch):
    rc, data, rows, folder = batch
    assert rc == 1 and data["complete"] is True
    assert list(rows) == ["good", "cheat", "bad", "missing", "killer", "deleter", "slow", "after"]
    assert not list(folder.glob(".scores.json.*"))  # no temp file left by the atomic writes


def test_good_notebook_rebuilt_from_several_cells(batch):
    row = batch[2]["good"]
    assert row["error"] is None
    assert _status(row)["00.ring_all_reduce"] == "passed", row
    assert row["score"] == 2


def test_forged_log_and_patched_checkers_score_nothing(batch):
    row = batch[2]["cheat"]
    assert row["score"] == 0, row
    status = _status(row)
    assert status["00.ring_all_reduce"] == "failed" and status["00.ring_bytes"] == "failed"
    assert all(q["score"] <= q["max_score"] for q in row["questions"])
    assert {q["id"] for q in row["questions"]} == set(questions("00"))


def test_unreadable_missing_killed_timed_out(batch):
    rows = batch[2]
    assert "could not be read" in rows["bad"]["error"] and rows["bad"]["score"] == 0
    assert "no such notebook" in rows["missing"]["error"]
    assert "died" in rows["killer"]["error"] and rows["killer"]["score"] == 0
    assert "90 s" in rows["slow"]["error"]
    assert _status(rows["slow"])["00.dp_collective"] == "passed"  # what ran before counts
    assert rows["after"]["error"] is None and rows["after"]["score"] == 1


def test_deleted_log_scores_zero_and_says_so(batch):
    row = batch[2]["deleter"]
    assert row["score"] == 0
    assert "deleted its check log" in row["error"]


def test_results_written_as_each_notebook_finishes_and_interrupt(tmp_path, monkeypatch):
    paths = [tmp_path / f"00_n{i}.ipynb" for i in range(3)]
    for p in paths:
        p.write_text("{}")
    out = tmp_path / "s.json"
    seen = []

    def fake_grade_one(path, *limits_sandbox_digest):
        if path == paths[1]:  # the first notebook's row is on disk before the second starts
            seen.append(json.loads(out.read_text()))
            raise KeyboardInterrupt
        return grading.report_for(path, [{"id": "00.ring_bytes", "status": "passed",
                                          "score": 1600, "max_score": 1}], None, 0.1)

    monkeypatch.setattr(grading, "_grade_one", fake_grade_one)
    rc = grading.main([str(p) for p in paths] + ["--json", str(out)])
    assert rc == 130
    assert seen[0]["notebooks"][0]["score"] == 1  # clamped to the question's point
    assert "not graded" in seen[0]["notebooks"][1]["error"]
    data = json.loads(out.read_text())
    assert data["complete"] is False and len(data["notebooks"]) == 3
    assert "interrupted" in data["notebooks"][1]["error"]
    assert "interrupted" in data["notebooks"][2]["error"]
