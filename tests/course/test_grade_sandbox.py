"""Hostile notebooks against the sandboxed grader (bubblewrap), the time limits kept from
outside, and what counts in a notebook's score.

Without bwrap the sandboxed batch is skipped with the reason; in CI (CI=true) it fails
instead, as the browser test does without Chromium (.ci/run installs bubblewrap)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parlib.course import grading
from parlib.course.check import answer_payload, check, recheck
from parlib.course.registry import get_question, questions
from tests.helpers.notebooks import need_bwrap, notebook

ROOT = Path(__file__).resolve().parents[2]
MARK = "1234.5"  # the lingering process's argument, to find it afterwards


def _lingering() -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"sleep {MARK}" in line]


# --------------------------------------------------------------------------- fast: what counts


def _right_payloads() -> dict[str, object]:
    """A forged log's "right" answers: every numeric and letter question's expected value."""
    out = {}
    for qid, q in questions().items():
        if q.kind in ("number", "letter"):
            out[qid] = answer_payload(q, q.answer)
    return out


def test_only_the_notebooks_own_chapter_counts_each_question_once(tmp_path):
    log = tmp_path / "checks.jsonl"
    with log.open("w") as f:
        for _ in range(10):  # ten copies of every question's right answer
            for qid, payload in _right_payloads().items():
                f.write(json.dumps({"id": qid, "status": "passed", "score": 99,
                                    "answer": payload}) + "\n")
    rows = grading.recheck_log(log, "00")
    assert [r["id"] for r in rows] == list(questions("00"))
    rep = grading.report_for(Path("00_x.ipynb"), rows * 10 + [
        {"id": "07.pick_layout", "status": "passed", "score": 1}], None, 1.0)
    ids = [r["id"] for r in rep["questions"]]
    assert ids == list(questions("00")) and len(ids) == len(set(ids))
    assert rep["max_score"] == sum(q.points for q in questions("00").values())
    assert 0 < rep["score"] < rep["max_score"]  # its own numbers and letters, nothing more


def test_huge_int_never_raises_and_a_forged_one_is_skipped(tmp_path, monkeypatch,
                                                           clean_checks):
    log = tmp_path / "checks.jsonl"
    monkeypatch.setenv("PARLIB_CHECK_LOG", str(log))
    r = check("00.ring_bytes", 10**5000)
    assert not r.passed
    line = '{"id": "00.ring_bytes", "answer": ' + "9" * 5000 + "}\n"
    log.write_text(log.read_text() + line)
    assert grading.read_log(log)["00.ring_bytes"]["answer"] != 10**5000


@pytest.mark.parametrize("answer", ["284", (2.9, 8.9, 4.9), (2.0, 8.0, 4.0), [2, 8]])
def test_pick_layout_refuses_the_wrong_form(answer, clean_checks):
    r = check("07.pick_layout", answer)
    assert not r.passed and "tuple of three whole numbers" in r.message, r
    assert check("07.pick_layout", (2, 8, 4)).passed


def test_huge_power_in_a_formula_is_refused_at_once(clean_checks):
    t0 = time.monotonic()
    r = check("00.ring_formula", "9**9**9")
    assert not r.passed and "too large" in r.message and time.monotonic() - t0 < 5


def test_a_function_the_grader_cannot_read_says_so():
    from parlib.course.answers import from_plain

    fn = from_plain(answer_payload(get_question("07.mesh_position"), lambda r, d, t, p: {}))
    with pytest.raises(TypeError, match="lambda"):
        fn(0, 1, 1, 1)
    orphan = from_plain({"__kind__": "function", "name": "f", "code": "x = 1\n"})
    with pytest.raises(TypeError, match="define it with def"):
        orphan()


# --------------------------------------------------------------------------- hostile batches

_LINGER = f'''
import subprocess, sys
# a detached process that would, later, overwrite the scores and the next notebook
subprocess.Popen(["sh", "-c", "sleep {MARK}"], start_new_session=True)
# it strikes 3 s after its notebook's kernel has gone: after that notebook's row, whatever
# the machine's load (a fixed delay could strike while the notebook still runs)
subprocess.Popen([sys.executable, "-c", """
import time, pathlib, os
while os.path.exists("/proc/" + os.environ["KERNEL_PID"]):
    time.sleep(0.1)
time.sleep(3)
for p in os.environ["VICTIMS"].split(":"):
    pathlib.Path(p).write_text("tampered")
"""], start_new_session=True,
   env={{**os.environ, "VICTIMS": VICTIMS, "KERNEL_PID": str(os.getpid())}})
'''

_TAMPER = '''
import shutil, os
errors = []
for attack in (lambda: open(QUESTION_FILE, "a").write("\\nQUESTION = None\\n"),
               lambda: (os.remove(SCORES), os.mkdir(SCORES))):
    try:
        attack()
    except OSError as exc:
        errors.append(f"{type(exc).__name__}: {exc.strerror}")
raise RuntimeError("; ".join(errors) or "every attack worked")
'''

_KILL_ALL = '''
import os, signal
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
'''

_SLEEPER = '''
import os, time, json
def ring_all_reduce(t):  # right in the kernel; asleep when re-checked by the grader
    if not os.environ.get("PARLIB_CHECK_LOG"):
        time.sleep(3600)
    return t.clone()
parlib.check("00.ring_all_reduce", ring_all_reduce)
with open(os.environ["PARLIB_CHECK_LOG"], "a") as f:  # a forged line for another chapter
    f.write(json.dumps({"id": "07.pick_layout", "answer": {"__kind__": "tuple", "len": 3,
                        "items": [2, 8, 4]}}) + "\\n")
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    need_bwrap()
    d = tmp_path_factory.mktemp("hostile")
    out = d / "scores.json"
    nxt = d / "00_next.ipynb"
    qfile = ROOT / "parlib" / "course" / "questions" / "ch00" / "__init__.py"
    before = qfile.read_bytes()
    consts = f"import parlib, os\nVICTIMS = {f'{out}:{nxt}'!r}\n" \
             f"SCORES = {str(out)!r}\nQUESTION_FILE = {str(qfile)!r}"
    order = [notebook(d, "00_linger.ipynb", consts, _LINGER,
                      'parlib.check("00.dp_collective", "B")'),
             notebook(d, "00_tamper.ipynb", consts, _TAMPER),
             notebook(d, "00_killall.ipynb", consts, _KILL_ALL),
             notebook(d, "00_sleeper.ipynb", consts, _SLEEPER),
             notebook(d, "00_next.ipynb", consts, 'parlib.check("00.dp_collective", "A")')]
    nxt_before = nxt.read_bytes()
    t0 = time.monotonic()
    rc = grading.main([str(p) for p in order] + ["--json", str(out), "--timeout", "120",
                                                 "--question-timeout", "15"])
    seconds = time.monotonic() - t0
    time.sleep(6)  # past the moment the detached process would have struck
    assert qfile.read_bytes() == before, "a sandboxed notebook edited a question module"
    data = json.loads(out.read_text())
    rows = {Path(r["notebook"]).stem.split("_", 1)[1]: r for r in data["notebooks"]}
    return rc, data, rows, seconds, nxt.read_bytes() == nxt_before


def _status(row):
    return {q["id"]: q["status"] for q in row["questions"]}


def test_leftover_processes_die_with_their_notebook(hostile):
    rc, data, rows, _, next_untouched = hostile
    assert _status(rows["linger"])["00.dp_collective"] == "passed"
    assert rows["linger"]["sandboxed"] is True
    assert not _lingering()
    assert next_untouched and data["complete"]
    assert rows["next"]["score"] == 0  # all wrong stays all wrong


def test_course_and_scores_are_read_only_to_a_notebook(hostile):
    _, data, rows, _, _ = hostile
    assert rows["tamper"]["error"].count("Read-only file system") == 2, rows["tamper"]["error"]
    assert len(data["notebooks"]) == 5


def test_killing_everything_it_can_see_costs_only_its_own_row(hostile):
    _, _, rows, _, _ = hostile
    assert rows["killall"]["error"] and rows["killall"]["score"] == 0
    assert rows["next"]["error"] is None
    assert _status(rows["next"])["00.dp_collective"] == "failed"


def test_a_recheck_past_its_limit_is_stopped_and_the_batch_goes_on(hostile):
    _, _, rows, seconds, _ = hostile
    sleeper = rows["sleeper"]
    assert "00.ring_all_reduce ran longer than 15 s" in sleeper["error"]
    assert _status(sleeper)["00.ring_all_reduce"] == "timed out"
    assert all(q["id"].startswith("00.") for q in sleeper["questions"])  # 07.* not counted
    assert seconds < 400


def test_without_sandbox_leftovers_are_killed_and_edits_to_the_course_stop_grading(tmp_path):
    course = tmp_path / "course"
    shutil.copytree(ROOT / "parlib", course / "parlib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    qfile = course / "parlib" / "course" / "questions" / "ch00" / "__init__.py"
    consts = f"import parlib, os\nVICTIMS = {str(tmp_path / 'victim')!r}"
    editor = notebook(tmp_path, "00_editor.ipynb", consts, _LINGER,
                      f"open({str(qfile)!r}, 'a').write('\\n# edited\\n')")
    nxt = notebook(tmp_path, "00_next.ipynb", consts, 'parlib.check("00.dp_collective", "B")')
    out = tmp_path / "scores.json"
    env = {**os.environ, "PYTHONPATH": str(course)}
    proc = subprocess.run([sys.executable, "-m", "parlib", "grade", "--no-sandbox", str(editor),
                           str(nxt), "--json", str(out), "--timeout", "120"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert "WITHOUT a sandbox (--no-sandbox was given)" in proc.stdout, proc.stdout
    time.sleep(6)
    assert not _lingering() and not (tmp_path / "victim").exists()
    rows = json.loads(out.read_text())["notebooks"]
    assert [r["sandboxed"] for r in rows] == [False, False]
    assert "changed on disk" in rows[1]["error"] and rows[1]["score"] == 0


def test_readme_says_what_the_sandbox_protects_against_and_what_counts():
    text = (ROOT / "README.md").read_text()
    section = text.split("## For instructors", 1)[1].split("\n## ", 1)[0]
    for phrase in ("bubblewrap", "--no-sandbox", "does not protect", "a student can copy",
                   "macOS", "docker run", "own chapter", "--question-timeout",
                   "graded without a sandbox"):
        assert phrase in section, phrase


def test_os_exit_in_the_learners_function_is_named_not_blamed_on_collectives(clean_checks):
    def accumulation_step(model, optimizer, microbatches, loss_fn):
        import os

        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(3)
        for p in model.parameters():
            dist.all_reduce(p.grad if p.grad is not None else p.detach())

    def mesh_position(rank, d, t, p):
        import os

        os._exit(0)

    for qid, fn in (("01.grad_accum", accumulation_step), ("07.mesh_position", mesh_position)):
        r = check(qid, fn, timeout=30)
        assert not r.passed and "os._exit" in r.message, (qid, r.message)
        assert "collective" not in r.message.split("os._exit", 1)[0], r.message


def test_every_code_answer_runs_in_a_child_process_never_the_graders(tmp_path):
    from parlib.course.on_ranks import RankExercise

    code = [q.id for q in questions().values() if q.kind == "function"]
    assert code and all(isinstance(questions()[qid], RankExercise) for qid in code)
    marker = tmp_path / "pid"
    payload = {"__kind__": "function", "name": "mesh_position", "missing": {}, "code":
               f"def mesh_position(rank, d, t, p):\n"
               f"    import os\n    open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
               f"    return {{}}\n"}
    r = recheck(get_question("07.mesh_position"), payload, timeout=30)
    assert not r.passed and int(marker.read_text()) != os.getpid()
