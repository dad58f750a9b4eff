"""Rank processes as the OS sees them: named by (pid, start time), read from /proc on Linux
and through psutil elsewhere, and ended when their launcher's lifeline closes."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from parlib.runtime import procs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_process_is_named_by_pid_and_start_time():
    me = os.getpid()
    started = procs.start_time(me)
    assert started is not None and procs.start_time(me) == started  # fixed for its life
    assert procs.is_alive(me) and procs.is_alive(me, started)
    # the same pid with another start time is another process: a reused pid
    assert not procs.is_alive(me, started - 1)
    assert procs.cpu_seconds(me) > 0


def test_zombies_and_gone_processes_are_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while procs.start_time(child.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # exited but not reaped: a zombie
    assert not procs.is_alive(child.pid)
    assert child.pid not in procs.live_parents()
    child.wait()
    assert procs.start_time(child.pid) is None and procs.cpu_seconds(child.pid) is None


def test_live_parents_sees_a_running_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procs.live_parents()[child.pid] == os.getpid()
        assert procs.is_alive(child.pid, procs.start_time(child.pid))
    finally:
        child.kill()
        child.wait()


def test_a_clock_step_does_not_rename_a_process(monkeypatch):
    """psutil's create_time adds the wall-clock boot time, read afresh each call: a clock step
    between two readings must not make a live rank look like a reused pid."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the start time is read from /proc on Linux only")
    from psutil import _pslinux

    me = os.getpid()
    started = procs.start_time(me)
    steps = iter(range(10**6))
    stepped = lambda: 1.0e9 + next(steps)  # noqa: E731 - the clock moves 1 s per reading
    monkeypatch.setattr(_pslinux, "boot_time", stepped)
    monkeypatch.setattr(psutil, "boot_time", stepped)
    assert [procs.start_time(me) for _ in range(3)] == [started] * 3
    assert procs.is_alive(me, started)


def test_a_command_name_with_parentheses_and_spaces_is_read_past():
    code = ("import time; open('/proc/self/comm', 'w').write('a) b (c'); "
            "print(flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # the name is set
        if psutil.Process(child.pid).name() != "a) b (c":
            pytest.skip("this system does not let a process rename itself")
        expected = round((psutil.Process(child.pid).create_time() - psutil.boot_time())
                         * os.sysconf("SC_CLK_TCK"))
        assert procs.start_time(child.pid) == expected
    finally:
        child.kill()
        child.wait()


# A rank is started by the forkserver, not by the launcher: the launcher's end of a pipe (the
# lifeline) closing is what ends a rank nobody tracks. Here a rank's main thread holds the GIL
# in torch's C++ code: FileStore retries opening a file in a removed folder every 10 ms for
# minutes, so no Python thread can act on the closed pipe.
_STUCK_RANK = """
import os, sys
import torch.distributed as dist
from parlib.runtime import worker
fd = int(sys.argv[1])
if sys.argv[3] == "threadless":  # as if the fallback thread had not run yet
    worker._watch_lifeline = lambda fd: None
worker._bind_to_lifeline(fd)
if sys.argv[3] == "say":  # not otherwise: the print would let a Python thread run first
    print("bound", flush=True)
dist.FileStore(os.path.join(sys.argv[2], "gone", "store"), 2)  # holds the GIL for minutes
"""


def _stuck_rank(read_fd, tmp_path, mode):
    return subprocess.Popen(
        [sys.executable, "-c", _STUCK_RANK, str(read_fd), str(tmp_path), mode],
        pass_fds=(read_fd,),
        stdout=subprocess.PIPE, start_new_session=True, cwd=ROOT)


def _ended_within(child, seconds):
    try:
        return child.wait(seconds)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_ASYNC on pipes: Linux")
def test_a_rank_holding_the_gil_ends_when_its_lifeline_closes(tmp_path):
    read_fd, write_fd = os.pipe()
    child = _stuck_rank(read_fd, tmp_path, "say")
    os.close(read_fd)
    assert child.stdout.readline() == b"bound\n"
    time.sleep(1.0)  # inside FileStore's retry loop by now
    os.close(write_fd)
    assert _ended_within(child, 10) == -signal.SIGIO  # the kernel ended it, not Python


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_ASYNC on pipes: Linux")
def test_a_lifeline_closed_before_the_rank_watches_it_still_ends_the_rank(tmp_path):
    read_fd, write_fd = os.pipe()
    os.close(write_fd)  # the launcher was interrupted before this rank got going
    child = _stuck_rank(read_fd, tmp_path, "threadless")
    os.close(read_fd)
    assert _ended_within(child, 10) == -signal.SIGKILL
