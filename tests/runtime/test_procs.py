"""Processes named by (pid, start time), read from /proc on Linux and through psutil
elsewhere."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from parlib.runtime import procs


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
    if not os.path.isdir("/proc/self"):
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

