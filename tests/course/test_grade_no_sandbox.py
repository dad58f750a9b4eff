"""``python -m parlib grade --no-sandbox``: what a notebook leaves running or plants on disk
does not reach the next notebook's row (issue 39's sixth finding).

Each batch runs on a copy of ``parlib`` (the notebooks plant files in it) and holds two
notebooks: the attacker, then a victim whose row must be its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parlib.course import boot, sandbox
from tests.helpers.notebooks import notebook

ROOT = Path(__file__).resolve().parents[2]


def _course_copy(tmp_path: Path) -> Path:
    course = tmp_path / "course"
    shutil.copytree(ROOT / "parlib", course / "parlib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return course


def _grade(tmp_path: Path, course: Path, *notebooks: Path) -> list[dict]:
    out = tmp_path / "scores.json"
    env = {**os.environ, "PYTHONPATH": str(course)}
    proc = subprocess.run([sys.executable, "-m", "parlib", "grade", "--no-sandbox",
                           *map(str, notebooks), "--json", str(out), "--timeout", "120"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())["notebooks"]


def _status(row: dict) -> dict[str, str]:
    return {q["id"]: q["status"] for q in row["questions"]}


# --------------------------------------------------------------------------- planted files

# Stamped with check.py's own time and size, Python takes this bytecode for check.py: every
# re-check then passes. The sources, all the digest read, are untouched.
_PLANT_PYC = '''
import importlib.util, os
from importlib import _bootstrap_external
text = open(CHECK).read() + """
_real_recheck = recheck
def recheck(question, payload, *, timeout=None):
    result = _real_recheck(question, payload, timeout=timeout)
    result.status, result.score = PASSED, question.points
    return result
"""
stat = os.stat(CHECK)
pyc = importlib.util.cache_from_source(CHECK)
os.makedirs(os.path.dirname(pyc), exist_ok=True)
with open(pyc, "wb") as f:
    f.write(_bootstrap_external._code_to_timestamp_pyc(compile(text, CHECK, "exec"),
                                                        stat.st_mtime, stat.st_size))
'''

# Python imports sitecustomize from its path at start-up: in the next grader process, it
# makes every re-check pass before the grader has read a line of its own.
_PLANT_SITECUSTOMIZE = '''
with open(os.path.join(COURSE, "sitecustomize.py"), "w") as f:
    f.write("""
import sys
if "--one" in sys.argv:
    from parlib.course import check
    real = check.recheck
    def recheck(question, payload, *, timeout=None):
        result = real(question, payload, timeout=timeout)
        result.status, result.score = check.PASSED, question.points
        return result
    check.recheck = recheck
""")
'''


@pytest.mark.slow
@pytest.mark.parametrize("plant", [_PLANT_PYC, _PLANT_SITECUSTOMIZE], ids=["pyc", "sitecustomize"])
def test_a_planted_pyc_or_sitecustomize_changes_no_verdict(tmp_path, plant):
    course = _course_copy(tmp_path)
    check_file = course / "parlib" / "course" / "check.py"
    consts = f"import os\nCHECK = {str(check_file)!r}\nCOURSE = {str(course)!r}"
    planter = notebook(tmp_path, "00_planter.ipynb", consts, plant)
    wrong = notebook(tmp_path, "00_wrong.ipynb", "import parlib",
                     'parlib.check("00.dp_collective", "A")')
    rows = _grade(tmp_path, course, planter, wrong)
    assert rows[0]["error"] is None, rows[0]  # the plant itself worked
    assert _status(rows[1])["00.dp_collective"] == "failed", rows[1]
    assert rows[1]["score"] == 0 and rows[1]["error"] is None, rows[1]


# --------------------------------------------------------------------------- leftovers

# A process that forks and exits in a loop, each generation appending a wrong answer to
# every check log it finds: alive after its notebook's row, it rewrites the next one's.
_FORK_LOOP = '''
import glob, json, os, subprocess, sys, tempfile, time
loop = """
import glob, json, os, sys, tempfile, time
beat, end, strike = sys.argv[1], time.monotonic() + 120, 0.0  # it ends by itself, at worst
while time.monotonic() < end:
    if os.fork():  # each generation lives for one turn of the loop
        os._exit(0)
    if time.monotonic() < strike:
        continue
    strike = time.monotonic() + 0.05
    with open(beat, "w") as f:
        f.write(str(os.getpid()))
    for log in glob.glob(os.path.join(tempfile.gettempdir(), "parlib-grade-*", "*.jsonl")):
        with open(log, "a") as f:
            f.write(json.dumps({"id": "00.dp_collective", "answer": "A"}) + "\\\\n")
"""
subprocess.Popen([sys.executable, "-c", loop, BEAT], start_new_session=True)
while not os.path.exists(BEAT):
    time.sleep(0.05)
'''


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux subreaper")
def test_a_process_forking_in_a_loop_dies_with_its_row_and_the_next_row_is_right(tmp_path):
    course = _course_copy(tmp_path)
    beat = tmp_path / "beat"
    looper = notebook(tmp_path, "00_looper.ipynb", f"BEAT = {str(beat)!r}", _FORK_LOOP)
    right = notebook(tmp_path, "00_right.ipynb", "import parlib",
                     'parlib.check("00.dp_collective", "B")')
    rows = _grade(tmp_path, course, looper, right)
    last = beat.read_text()
    time.sleep(1.5)
    assert beat.read_text() == last, "a generation of the loop still runs after the batch"
    assert rows[0]["error"] is None, rows[0]
    assert _status(rows[1])["00.dp_collective"] == "passed", rows[1]


# --------------------------------------------------------------------------- the bootstrap


def test_the_grader_process_refuses_a_changed_course_before_importing_it(tmp_path):
    course = _course_copy(tmp_path)
    digest = sandbox.course_digest(course / "parlib")
    marker = tmp_path / "imported"
    init = course / "parlib" / "__init__.py"
    init.write_text(f"open({str(marker)!r}, 'w')\n" + init.read_text())
    cmd = sandbox.grader_command(digest, ["--one", "nothing.ipynb", "--out", "x.json"])
    cmd[cmd.index(str(sandbox.COURSE))] = str(course / "parlib")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == boot.CHANGED, proc.stderr
    assert "changed on disk" in proc.stderr and not marker.exists()


def test_the_grader_process_never_reads_the_courses_bytecode(tmp_path):
    """A module whose .pyc (stamped with its source's time and size) says otherwise is
    imported from its source."""
    import importlib.util
    from importlib import _bootstrap_external

    course = _course_copy(tmp_path)
    source = course / "parlib" / "chapters.py"
    stat = source.stat()
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(_bootstrap_external._code_to_timestamp_pyc(
        compile("PLANTED = True\n", str(source), "exec"), stat.st_mtime, stat.st_size))
    probe = (f"import pathlib, sys\nboot = {{'__name__': 'boot'}}\n"
             f"exec(open({boot.__file__!r}).read(), boot)\n"
             f"root = pathlib.Path({str(course / 'parlib')!r})\n"
             "sys.meta_path.insert(0, boot['SnapshotFinder'](root, boot['snapshot'](root)[1]))\n"
             "import parlib.chapters as c; print(hasattr(c, 'PLANTED'), c.__file__)\n")
    plain = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, "
                            f"{str(course)!r})\nimport parlib.chapters as c; "
                            f"print(hasattr(c, 'PLANTED'))"], capture_output=True, text=True,
                           timeout=120)
    assert plain.stdout.split() == ["True"], plain.stderr  # Python itself takes it
    snap = subprocess.run([sys.executable, "-I", "-B", "-c", probe], capture_output=True,
                          text=True, timeout=120)
    assert snap.stdout.split() == ["False", str(source)], snap.stderr


def test_the_bootstrap_runs_the_grading_module_from_its_snapshot_untraceable(tmp_path):
    """A stand-in package whose grading module changes a module on disk, then imports it:
    the import still gets the source of the snapshot."""
    pkg = tmp_path / "standin"
    (pkg / "course").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "course" / "__init__.py").write_text("")
    late = pkg / "course" / "late.py"
    late.write_text("VALUE = 'as snapshotted'\n")
    (pkg / "course" / "grading.py").write_text(
        "import ctypes, json, sys\n"
        f"open({str(late)!r}, 'w').write('VALUE = 1')\n"
        "import standin.course.late\n"
        "dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE\n"
        "print(json.dumps({'argv': sys.argv[1:], 'dumpable': dumpable, "
        "'late': standin.course.late.VALUE, 'flags': [sys.flags.isolated, "
        "sys.flags.no_site, sys.flags.dont_write_bytecode]}))\n")
    cmd = sandbox.grader_command(sandbox.course_digest(pkg), ["--one", "x"])
    cmd[cmd.index(str(sandbox.COURSE))] = str(pkg)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    seen = json.loads(proc.stdout.splitlines()[0])
    assert seen == {"argv": ["--one", "x"], "dumpable": 0, "late": "as snapshotted",
                    "flags": [1, 1, 1]}, proc.stderr
