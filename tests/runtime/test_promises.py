"""What the runtime says after a fault is what happens next (issue 26, items 4 and 5): a
timeout that finds a rank inside a collective, a send nobody receives, an un-waited isend,
how long an interrupt takes, and temp folders after a kernel killed with its process group.
Each test failed before its fix."""

import glob
import linecache
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from parlib import Cluster, RankError
from parlib.runtime.magic import _run_cell_on
from tests.helpers import rank_fns
from tests.helpers.procutil import alive, children_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def _cell(cluster, source):
    linecache.cache["<test cell>"] = (len(source), None, source.splitlines(True), "<test cell>")
    return cluster.run(_run_cell_on, None, source, "<test cell>", ())


def _send_nobody_receives():
    if dist.get_rank() == 0:
        dist.isend(torch.ones(4), 1).wait()
    return dist.get_rank()


def _isend_left_unwaited():
    if dist.get_rank() == 0:
        dist.isend(torch.ones(4), 1)  # never waited, never received
    return dist.get_rank()


def _assert_promise_kept(cluster, err, pids):
    """"Kept" means the same ranks, their variables, and a process group that works;
    anything else must say the variables are lost, and the next call must work."""
    text = str(err)
    if err.kept:
        assert "lost" not in text, text
        assert cluster.pids() == pids
        assert [v for v, _ in _cell(cluster, "x")] == [41, 42], "variables said kept are gone"
        assert cluster.run(rank_fns.rank_sum) == [1.0, 1.0], "the kept group is broken"
    else:
        assert "kept" not in text and "lost" in text, text
        assert cluster.run(rank_fns.rank_sum) == [1.0, 1.0]
        assert set(cluster.pids()).isdisjoint(pids)


@pytest.mark.parametrize("in_cell", [False, True])
def test_timeout_in_a_collective_says_what_happens_next(in_cell):
    # The call's timeout is the cluster's: gloo's own timeout used to fire inside the grace
    # window, so the rank looked "stopped in Python" over a process group already broken.
    with Cluster(2, timeout=3) as cluster:
        _cell(cluster, "x = 41 + dist.get_rank()")
        pids = cluster.pids()
        with pytest.raises(RankError) as info:
            if in_cell:
                _cell(cluster, "if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))")
            else:
                cluster.run(rank_fns.skip_collective, 1)
        assert info.value.exc_type == "Timeout"
        _assert_promise_kept(cluster, info.value, pids)


def test_send_nobody_receives_says_what_happens_next():
    with Cluster(2, timeout=3) as cluster:
        _cell(cluster, "x = 41 + dist.get_rank()")
        pids = cluster.pids()
        with pytest.raises(RankError) as info:
            cluster.run(_send_nobody_receives)
        assert info.value.exc_type == "Timeout" and info.value.rank == 0
        _assert_promise_kept(cluster, info.value, pids)


def test_unwaited_isend_leaves_ranks_variables_and_group_working():
    with Cluster(2, timeout=3) as cluster:
        _cell(cluster, "x = 41 + dist.get_rank()")
        pids = cluster.pids()
        assert cluster.run(_isend_left_unwaited) == [0, 1]
        time.sleep(3.5)  # past the call's timeout: nothing in the group may give up now
        assert cluster.pids() == pids
        assert [v for v, _ in _cell(cluster, "x")] == [41, 42]
        assert cluster.run(rank_fns.rank_sum) == [1.0, 1.0]


def test_interrupt_of_ranks_stuck_in_a_collective_takes_under_a_second():
    # The README: "the kernel's interrupt button stops every rank within a second".
    with Cluster(2, timeout=30) as cluster:
        fired = []

        def interrupt():
            fired.append(time.monotonic())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        timer = threading.Timer(1.0, interrupt)
        timer.start()
        with pytest.raises(KeyboardInterrupt) as info:
            cluster.run(rank_fns.skip_collective, 0)
        took = time.monotonic() - fired[0]
        timer.join()
        assert "did not stop" in str(info.value) and "lost" in str(info.value)
        assert "all_reduce" in info.value.stacks, "no stack of the stuck rank"
        assert took < 1.0, f"the interrupt took {took:.2f} s"
        assert cluster.run(rank_fns.rank_sum) == [1.0, 1.0]


@pytest.mark.slow
def test_kernel_killed_with_its_process_group_leaves_no_temp_folder(tmp_path):
    # Jupyter ends a kernel by killing its whole process group: the forkserver dies with
    # it, so nothing inside that group can remove the kernel's temp folders.
    flag = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import pathlib, sys, time
        sys.path.insert(0, {ROOT!r})
        import parlib
        cluster = parlib.Cluster(2)
        pathlib.Path({str(flag)!r}).write_text("ok")
        time.sleep(600)
    """)
    kernel = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not flag.exists():
            time.sleep(0.1)
        assert flag.exists(), "the cluster did not start"
        pattern = os.path.join(tempfile.gettempdir(), f"parlib-{kernel.pid}-*")
        assert glob.glob(pattern), "the kernel made no temp folder to look for"
        helpers = children_of(kernel.pid)
        os.killpg(kernel.pid, signal.SIGKILL)
        kernel.wait()
        deadline = time.time() + 10
        while time.time() < deadline and glob.glob(pattern):
            time.sleep(0.1)
        assert not glob.glob(pattern), glob.glob(pattern)
        while time.time() < deadline and any(alive(p) for p in helpers):
            time.sleep(0.1)
        left = {p: _cmdline(p) for p in helpers if alive(p)}
        assert not left, f"processes outlived their kernel: {left}"
    finally:
        if kernel.poll() is None:
            os.killpg(kernel.pid, signal.SIGKILL)
            kernel.wait()
