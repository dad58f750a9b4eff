"""Processes named by (pid, start time), read through psutil."""

import os
import subprocess
import sys
import time

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
