"""Hostile notebooks against the sandbox itself, graded as CI grades them (as root, where
bwrap keeps every capability unless told to drop them): remounting a read-only view
writable, forging or jamming the channel to the batch grader, reaching a host socket,
reading the batch's environment, printing into the batch's terminal, a huge error text.

One batch of four notebooks, in its own ``python -m parlib grade`` process (so a batch
grader that crashes or hangs fails the tests, and its terminal can be read), with a secret
in its environment and ``TMPDIR`` and ``XDG_RUNTIME_DIR`` outside /tmp, each holding a
listening socket as a forkserver or a session bus would."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from parlib.course import grading, sandbox
from tests.helpers.notebooks import need_bwrap, notebook

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SECRET = "PARLIB_TEST_SECRET_TOKEN"
FAKE_ROW = "00_z_victim.ipynb  (the launching chapter)\n  total   0/6\n"
TITLE = "\x1b]0;graded by a notebook\x07"

_REMOUNT = r'''
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND, NEWUSER_NEWNS = 32, 4096, 0x10000000 | 0x00020000
def remount(target):
    ok = libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND, None) == 0
    return "remounted" if ok else errno.errorcode[ctypes.get_errno()]
def overwrite_victim():
    try:
        with open(VICTIM, "w") as f:
            f.write(WRONG)
        open(PLANTED, "w").write("left on the host")
        return "written"
    except OSError as exc:
        return errno.errorcode[exc.errno]
found = {"folder": remount(os.path.dirname(VICTIM)), "root": remount("/")}
found["write"] = overwrite_victim()
try:  # opened only: whoever may write it sets what the host's root runs on a crash
    os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))
    found["sysctl"] = "opened"
except OSError as exc:
    found["sysctl"] = errno.errorcode[exc.errno]
pid = os.fork()
if pid == 0:  # a new user and mount namespace: its root may remount what it inherited?
    code = 0
    if libc.unshare(NEWUSER_NEWNS) == 0 and remount(os.path.dirname(VICTIM)) == "remounted":
        code = 3 if overwrite_victim() == "written" else 2
    os._exit(code)
found["unshare"] = os.waitpid(pid, 0)[1] >> 8
raise RuntimeError("@@FOUND@@" + json.dumps(found) + "@@END@@")
'''

_CHANNEL = r'''
import json, os, signal, time
home = os.environ["HOME"]
progress, report = os.path.join(home, "progress.jsonl"), os.path.join(home, "report.json")
forged = {"id": "00.dp_collective", "status": "passed", "score": float("nan"),
          "max_score": 1, "message": ""}
def put(data, path=progress):
    with open(path, "wb") as f:
        f.write(data)
    time.sleep(1)  # a poll of the batch grader sees each
put(b'{"start": "00.ring_bytes"}\n\xff\xfe not utf-8 \xc3\n')
put(b'{"row": ' + json.dumps(forged).encode() + b"}\n" + b"[" * (8 << 20) + b"\n")
put(json.dumps({"notebook": "forged", "chapter": "00", "error": None, "seconds": 1,
                "questions": [dict(forged, id=q) for q in QUESTIONS]}).encode(), report)
os.remove(progress)
os.mkfifo(progress)  # blocks whoever opens it to read
time.sleep(1)
right = json.dumps({"report": {"error": None, "questions": [
    dict(forged, id=q, score=1) for q in QUESTIONS]}}) + "\n"
for pid in (os.getppid(), 1):  # the pipe the grader process reports on, through /proc
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                with open(f"/proc/{pid}/fd/{fd}", "w") as f:
                    f.write(right)
            except OSError:
                pass
    except OSError:
        pass
os.kill(os.getppid(), signal.SIGKILL)  # the kernel's parent: its grader process
'''

_LEAK = r'''
import json, os, socket, subprocess
parlib.check("00.dp_collective", "B")
def connect(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return "connected"
    except OSError as exc:
        return type(exc).__name__
    finally:
        s.close()
found = {"env": sorted(os.environ), "run": sorted(os.listdir("/run")),
         "sockets": [connect(p) for p in SOCKETS]}
os.write(1, FAKE.encode())  # the kernel's own stdout and stderr, and a child's
os.write(2, FAKE.encode())
subprocess.run(["sh", "-c", f"printf '{TITLE}'"])
raise RuntimeError("@@FOUND@@" + json.dumps(found) + "@@END@@" + TITLE + "x" * 1_000_000)
'''


def _listen(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen(8)
    return s


@pytest.fixture(scope="module")
def escape(tmp_path_factory):
    need_bwrap()
    d = tmp_path_factory.mktemp("escape")
    outside = Path(tempfile.mkdtemp(prefix="parlib-escape-", dir="/var/tmp"))  # not /tmp
    tmpdir, runtime = outside / "tmp", outside / "run-user"
    tmpdir.mkdir()
    runtime.mkdir(mode=0o700)
    listeners = [_listen(tmpdir / "listener-forkserver"), _listen(runtime / "bus")]
    victim, planted = d / "00_victim.ipynb", d / "planted"
    wrong = notebook(tmp_path_factory.mktemp("wrong"), "00_victim.ipynb", "import parlib",
                     'parlib.check("00.dp_collective", "A")').read_text()
    consts = (f"import json, parlib\nVICTIM, PLANTED = {str(victim)!r}, {str(planted)!r}\n"
              f"WRONG = {wrong!r}\nFAKE, TITLE = {FAKE_ROW!r}, {TITLE!r}\n"
              f"QUESTIONS = {sorted(grading.questions('00'))!r}\n"
              f"SOCKETS = {[str(tmpdir / 'listener-forkserver'), str(runtime / 'bus')]!r}")
    order = [notebook(d, "00_remount.ipynb", consts, _REMOUNT),
             notebook(d, "00_channel.ipynb", consts, _CHANNEL),
             notebook(d, "00_leak.ipynb", consts, _LEAK),
             notebook(d, "00_victim.ipynb", "import parlib",
                      'parlib.check("00.dp_collective", "B")')]
    out = d / "scores.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), SECRET: "hunter2", "TMPDIR": str(tmpdir),
           "XDG_RUNTIME_DIR": str(runtime), "SSH_AUTH_SOCK": str(runtime / "bus")}
    try:
        proc = subprocess.run([sys.executable, "-m", "parlib", "grade", *map(str, order),
                               "--json", str(out), "--timeout", "120",
                               "--question-timeout", "30"],
                              env=env, capture_output=True, timeout=420, cwd=d)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the batch grader did not finish within 420 s: {exc.stdout!r}")
    finally:
        for s in listeners:
            s.close()
        shutil.rmtree(outside, ignore_errors=True)
    terminal = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert out.exists(), terminal
    data = json.loads(out.read_text())
    rows = {Path(r["notebook"]).stem.split("_", 1)[1]: r for r in data["notebooks"]}
    return proc, terminal, data, rows, planted, out.read_text()


def _found(row: dict) -> dict:
    error = row["error"] or ""
    assert "@@FOUND@@" in error and "@@END@@" in error, error[:3000]
    return json.loads(error.split("@@FOUND@@", 1)[1].split("@@END@@", 1)[0])


def _status(row: dict) -> dict[str, str]:
    return {q["id"]: q["status"] for q in row["questions"]}


def test_root_in_the_sandbox_cannot_remount_a_read_only_view(escape):
    _, _, _, rows, planted, _ = escape
    found = _found(rows["remount"])
    assert found["folder"] == "EPERM" and found["root"] == "EPERM", found
    assert found["write"] == "EROFS" and found["unshare"] != 3, found
    assert found["sysctl"] == "EROFS", found
    assert not planted.exists()
    assert _status(rows["victim"])["00.dp_collective"] == "passed", rows["victim"]
    assert rows["victim"]["error"] is None and rows["victim"]["score"] == 1


def test_what_a_notebook_writes_in_its_home_never_reaches_the_batch(escape):
    proc, terminal, data, rows, _, scores = escape
    assert proc.returncode == 1 and data["complete"] is True, terminal[-3000:]
    assert list(rows) == ["remount", "channel", "leak", "victim"]
    channel = rows["channel"]
    assert "died" in channel["error"] and channel["score"] == 0, channel
    assert "NaN" not in scores and "Infinity" not in scores
    assert _status(rows["victim"])["00.dp_collective"] == "passed"


def test_no_host_socket_and_no_environment_but_the_allowed(escape):
    found = _found(escape[3]["leak"])
    assert found["sockets"] == ["FileNotFoundError"] * 2, found
    assert found["run"] == [], found
    assert SECRET not in found["env"] and "SSH_AUTH_SOCK" not in found["env"]
    assert "XDG_RUNTIME_DIR" not in found["env"], found["env"]
    # what is left: the allow-list, what the sandbox sets (PWD: bwrap's --chdir), and what
    # the kernel adds itself
    kernel = {"PWD", "JPY_PARENT_PID", "JPY_SESSION_NAME", "PYDEVD_USE_FRAME_EVAL", "CLICOLOR",
              "PAGER", "GIT_PAGER", "MPLBACKEND", "TERM", "FORCE_COLOR", "CLICOLOR_FORCE",
              "PARLIB_CHECK_LOG", "PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING"}
    allowed = set(sandbox.ENV_ALLOWED) | set(sandbox.ENV_SET) | kernel
    assert set(found["env"]) <= allowed, set(found["env"]) - allowed


def test_the_notebooks_output_never_reaches_the_batchs_terminal(escape):
    proc, terminal, _, rows, _, _ = escape
    assert "00_z_victim" not in terminal and "\x1b" not in terminal, terminal
    assert "\\x1b]0;graded by a notebook\\x07" in terminal  # its error, shown escaped
    assert "00_z_victim" in rows["leak"]["output"]  # kept in its own row, capped


def test_a_huge_error_text_is_cut(escape):
    rows = escape[3]
    error = rows["leak"]["error"]
    assert len(error) <= grading.TEXT_LIMIT + 100 and "characters in all" in error, error[-200:]
    assert _status(rows["leak"])["00.dp_collective"] == "passed"
    assert all(len(r.get("output", "")) <= grading.TEXT_LIMIT + 100 for r in rows.values())


# --------------------------------------------------------------------------- fast: the data


def test_a_score_that_is_not_a_number_counts_zero_and_is_marked():
    rows = [{"id": "00.ring_bytes", "status": "passed", "score": float("nan")},
            {"id": "00.p2p_time", "status": "passed", "score": float("inf")},
            {"id": "00.dp_collective", "status": "passed", "score": 10**400}]
    rep = grading.report_for(Path("00_x.ipynb"), rows, None, 1.0)
    got = {q["id"]: q for q in rep["questions"]}
    for qid in ("00.ring_bytes", "00.p2p_time", "00.dp_collective"):
        assert got[qid]["score"] == 0 and got[qid]["status"] == grading.INVALID, got[qid]
    assert rep["score"] == 0
    json.dumps(rep, allow_nan=False)  # strict JSON


def test_every_text_in_a_row_is_capped():
    rows = [{"id": "00.ring_bytes", "status": "x" * 10_000, "score": 0,
             "message": "m" * 1_000_000}]
    rep = grading.report_for(Path("00_x.ipynb"), rows, "e" * 1_000_000, 1.0,
                             output="o" * 1_000_000 + "the end")
    row = next(q for q in rep["questions"] if q["id"] == "00.ring_bytes")
    for text in (row["message"], rep["error"], rep["output"]):
        assert len(text) <= grading.TEXT_LIMIT + 100 and "characters in all" in text, text[:99]
    assert rep["output"].endswith("the end") and len(row["status"]) <= 100


def test_the_channel_reads_lines_as_data_and_never_blocks():
    from parlib.course.channel import LINE_LIMIT, Channel

    with Channel.pipe() as channel:
        w = channel.write_fd
        os.write(w, b'{"start": "00.ring_bytes"}\n{"row": {"id": "\xff\xc3"}}\nnot json\n')
        channel.poll()
        assert channel.current() is None and channel.dropped == 1
        assert channel.rows() == [{"id": "\ufffd\ufffd"}]  # invalid bytes replaced
        os.set_blocking(w, False)
        huge = b'{"row": {"id": "' + b"a" * (LINE_LIMIT + 10) + b'"}}\n'
        for i in range(0, len(huge), 1 << 15):  # the reader keeps up, as the batch does
            os.write(w, huge[i:i + (1 << 15)])
            channel.poll()
        os.write(w, b'[1, 2]\n{"row": {"id": "00.p2p_time"}}\n{"report": {"questions": []}}')
        channel.close_write()
        channel.drain()
        assert channel.dropped == 3 and len(channel.rows()) == 2  # the huge line dropped
        assert channel.report() is None  # a last line with no newline is not taken


def test_a_channel_that_is_not_a_pipe_or_file_is_refused(tmp_path):
    from parlib.course.channel import Channel

    fd = os.open(tmp_path, os.O_RDONLY)  # a folder
    with pytest.raises(ValueError, match="pipe or a regular file"):
        Channel(fd)
    os.mkfifo(tmp_path / "fifo")
    fifo = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)  # never blocks
    with Channel(fifo) as channel:
        channel.poll()
        assert channel.items == []


def test_readme_says_what_holds_as_root_and_as_a_user():
    text = (ROOT / "README.md").read_text()
    section = " ".join(text.split("## For instructors", 1)[1].split("\n## ", 1)[0].split())
    for phrase in ("--cap-drop ALL", "no_new_privs", "/proc/sys", "As root and as a user",
                   "$XDG_RUNTIME_DIR", "SSH_AUTH_SOCK", "never to your terminal",
                   "2,000 characters", "`invalid`", "every file on the machine",
                   "not dumpable"):
        assert phrase in section, phrase
    for name in sandbox.ENV_ALLOWED:  # the allow-list as the README names it
        if not name.startswith(("LC_", "LANG", "TZ", "PYTHON", "OMP_", "MKL_", "OPENBLAS_",
                                "NUMEXPR_", "CUDA_", "PARLIB_")):
            assert f"`{name}`" in section, name
