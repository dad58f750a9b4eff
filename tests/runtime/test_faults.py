"""Faults found by the fault sweep (issue 16, items 7-12) and the learner's view of errors
and interrupts (issue 15, items 1-3 and 8): each test failed before its fix."""

import contextlib
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

import parlib
from parlib import Cluster, RankError
from parlib.runtime import procs
from parlib.runtime.group import RankGroup
from parlib.runtime.magic import _run_cell_on
from tests.helpers import rank_fns
from tests.helpers.procutil import alive, children_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cell_function(source, name, filename):
    """A function as a notebook cell defines it: a file name only linecache knows."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102
    return namespace[name]


def _cell(cluster, source):
    linecache.cache["<test cell>"] = (len(source), None, source.splitlines(True), "<test cell>")
    return cluster.run(_run_cell_on, None, source, "<test cell>", ())


def _interrupt_main_after(seconds):
    timer = threading.Timer(seconds, signal.pthread_kill,
                            (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, timeout=30) as c:
        yield c


# -- 15.3: a plain exception keeps the ranks and their variables -----------------------
def test_exception_on_every_rank_keeps_ranks_and_variables(cluster):
    _cell(cluster, "x = 41 + dist.get_rank()")
    pids = cluster.pids()
    with pytest.raises(RankError) as info:
        _cell(cluster, "1 / 0")
    assert info.value.kept and info.value.exc_type == "ZeroDivisionError"
    assert "variables are as they were" in str(info.value)
    assert cluster.state == "running" and cluster.pids() == pids
    assert [v for v, _ in _cell(cluster, "x")] == [41, 42]


def test_exception_on_one_rank_while_others_finish_keeps_ranks(cluster):
    pids = cluster.pids()
    with pytest.raises(RankError) as info:
        cluster.run(rank_fns.fail_alone, 1)
    assert info.value.rank == 1 and info.value.kept
    assert cluster.pids() == pids


def test_exception_while_others_wait_in_a_collective_rebuilds_and_says_so(cluster):
    with pytest.raises(RankError) as info:
        cluster.run(rank_fns.fail_on, 1)
    assert not info.value.kept and info.value.rank == 1
    assert "still waiting" in str(info.value) and "lost" in str(info.value)
    assert cluster.state == "will rebuild on next call"


# -- 15.2 / 15.3: an interrupt stops the code, keeps what is consistent, says so briefly --
def test_interrupt_keeps_ranks_and_says_where_they_were(cluster):
    _cell(cluster, "y = 7")
    pids = cluster.pids()
    timer = _interrupt_main_after(1.0)
    start = time.time()
    with pytest.raises(KeyboardInterrupt) as info:
        _cell(cluster, "import time\nfor _ in range(600):\n    time.sleep(0.1)")
    took = time.time() - start
    timer.join()
    text = str(info.value)
    assert text.splitlines()[0] == "interrupted: ranks 0-1 stopped; the ranks and their " \
        "variables are kept", text
    assert "rank 0 was at <test cell>, line 3" in text and "time.sleep(0.1)" in text
    assert len(text.splitlines()) == 3
    assert cluster.pids() == pids and [v for v, _ in _cell(cluster, "y")] == [7, 7]
    assert took < 1.0 + 5.0, f"interrupt took {took:.1f} s"


def test_interrupt_of_ranks_stuck_in_a_collective_rebuilds(cluster):
    pids = cluster.pids()
    timer = _interrupt_main_after(1.0)
    with pytest.raises(KeyboardInterrupt) as info:
        cluster.run(rank_fns.skip_collective, 0)
    timer.join()
    assert "did not stop" in str(info.value) and "lost" in str(info.value)
    time.sleep(0.3)
    assert not any(alive(p) for p in pids)
    assert cluster.run(rank_fns.rank_sum) == [1.0, 1.0]


# -- issue 44: a rank left in a collective after its peers returned costs seconds --------
def test_a_rank_left_in_a_collective_after_its_peer_returned_is_named_in_seconds():
    from parlib.runtime.stopping import DEADLOCK_S

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        parlib.launch(rank_fns.skip_collective, 0, world_size=2, timeout=120)
    took = time.monotonic() - start
    err = info.value
    assert err.exc_type == "Deadlock" and err.rank == 1, str(err)
    assert f"waited inside a collective for {DEADLOCK_S:g} s" in str(err)
    assert "Rank(s) 0 had returned" in str(err)
    assert "dist.all_reduce(t)" in err.remote_traceback  # where it waited, on its own line
    assert took < 60, f"took {took:.0f} s: the call's 120 s timeout, not the watch"


def test_a_rank_sleeping_after_its_peer_returned_is_not_a_deadlock():
    from parlib.runtime.stopping import DEADLOCK_S

    # no CPU for longer than the watch's window, but in a sleep, not a collective
    assert parlib.launch(rank_fns.sleep_on, 1, DEADLOCK_S + 2, world_size=2,
                         timeout=120) == [0, 1]


# -- 16.7: a rank that dies while idle -------------------------------------------------
def test_dead_idle_rank_is_named_and_the_cluster_rebuilds(cluster):
    victim = cluster.pids()[1]
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.3)
    assert cluster.state != "running"
    with pytest.raises(RankError) as info:
        cluster.run(rank_fns.rank_sum)
    assert info.value.rank == 1 and info.value.exc_type == "Exited"
    assert "SIGKILL" in str(info.value) and "idle" in str(info.value)
    assert cluster.run(rank_fns.rank_sum) == [1.0, 1.0]
    assert victim not in cluster.pids()


# -- 16.12: launcher edge cases --------------------------------------------------------
def test_huge_world_size_is_refused_before_any_process_starts(monkeypatch):
    before = children_of(os.getpid())
    start = time.time()
    with pytest.raises(ValueError, match="PARLIB_MAX_RANKS"):
        parlib.launch(rank_fns.rank_sum, world_size=1000)
    assert time.time() - start < 2 and children_of(os.getpid()) <= before
    monkeypatch.setenv("PARLIB_MAX_RANKS", "2000")
    RankGroup(1000)  # allowed when asked for (not started)


def test_infinite_timeout_means_no_limit():
    assert parlib.launch(rank_fns.rank_sum, world_size=2, timeout=float("inf")) == [1.0, 1.0]
    with pytest.raises(ValueError, match="timeout"):
        parlib.launch(rank_fns.rank_sum, world_size=2, timeout=float("nan"))


def test_result_that_fails_to_unpickle_names_the_rank():
    with pytest.raises(RankError) as info:
        parlib.launch(rank_fns.unloadable_result, world_size=2)
    assert info.value.rank == 0 and info.value.exc_type == "UnpicklingError"
    assert "refuses to be unpickled" in str(info.value)


def test_exception_whose_str_raises_keeps_type_and_a_message():
    with pytest.raises(RankError) as info:
        parlib.launch(rank_fns.raise_bad_str, world_size=1)
    assert info.value.exc_type == "BadStr" and "original message" in str(info.value)


def test_timeout_stack_dump_and_tracebacks_show_the_cell_line():
    # The loop sits on one line: a dump can catch a two-line loop on either of its lines.
    spin = _cell_function("def spin():\n    n = 0\n    while n >= 0: n += 1  # here\n",
                          "spin", "/tmp/ipykernel_0/cell_spin.py")
    with pytest.raises(RankError) as info:
        parlib.launch(spin, world_size=1, timeout=2)
    assert "<dynamic-code>" not in info.value.remote_traceback
    assert "while n >= 0: n += 1  # here" in info.value.remote_traceback
    # 15.8: a learner's function passed to a self-test keeps its cell's name and lines.
    step = _cell_function("def step(x):\n    y = x + 1\n    raise ValueError('bad step')\n",
                          "step", "/tmp/ipykernel_0/cell_step.py")
    with pytest.raises(RankError) as info:
        parlib.launch(rank_fns.call_with_rank, step, world_size=1)
    tb = info.value.remote_traceback
    assert "<dynamic-code>" not in tb and "raise ValueError('bad step')" in tb
    assert "cell_step.py" in tb and "rank_fns.py" in tb
    assert "group.py" not in tb and "worker.py" in info.value.full_traceback


# -- 16.11: a script without `if __name__ == "__main__":` ------------------------------
def test_script_without_main_guard_is_not_rerun_in_ranks(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {ROOT!r})\nimport parlib\n"
        "from tests.helpers import rank_fns\n"
        "print('SCRIPT BODY RAN', flush=True)\n"
        "print('RESULT', parlib.launch(rank_fns.rank_sum, world_size=2), flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("SCRIPT BODY RAN") == 1 and "RESULT [1.0, 1.0]" in out.stdout


# -- 16.8: partial lines and \r progress bars show while the rank still runs -----------
def test_partial_lines_and_progress_bars_show_live(tmp_path):
    marks = tmp_path / "marks"
    code = (f"import sys\nsys.path.insert(0, {ROOT!r})\nimport parlib\n"
            "from tests.helpers import rank_fns\n"
            f"parlib.launch(rank_fns.partial_then_progress, {str(marks)!r}, world_size=1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    seen, buffer = {}, b""
    wanted = {"partial": b"[rank 0] loading...", "progress10": b"\r[rank 0] 10%|",
              "progress50": b"\r[rank 0] 50%|", "done": b" done\n"}
    while True:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        buffer += chunk
        for key, pattern in wanted.items():
            if key not in seen and pattern in buffer:
                seen[key] = time.time()
    proc.wait(30)
    printed = {line.split()[0]: float(line.split()[1]) for line in marks.read_text().split("\n")
               if line}
    assert set(seen) == set(wanted), buffer[-500:]
    # each piece was shown before the rank printed the next one (1.5 s later)
    for key, following in (("partial", "progress10"), ("progress10", "progress50"),
                           ("progress50", "done")):
        assert seen[key] < printed[following], (key, seen[key] - printed[key])


# -- 16.9: an interrupt at any step of start-up leaves nothing -------------------------
def _own_temp_dirs():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"parlib-{os.getpid()}-*group*")))


def _outlived(baseline, seconds):
    """The descendants not in ``baseline`` that are still alive after ``seconds``, each
    described from /proc (pid, parent, state, command line), then killed so that one leak
    fails this test alone, not every later test that counts processes."""
    deadline = time.time() + seconds
    while time.time() < deadline and children_of(os.getpid()) - baseline:
        time.sleep(0.05)
    described = []
    for pid in sorted(children_of(os.getpid()) - baseline):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state, ppid = fh.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue  # ended meanwhile
        described.append(f"pid {pid} (parent {ppid}, state {state}): {command}")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return ", ".join(described)


def _start_steps(world_size):
    """Every line start-up executes in the launcher (an interrupt can land between any two;
    inside multiprocessing's start() it is held back until the rank is tracked)."""
    steps = []

    def tracer(frame, event, arg):
        if frame.f_code.co_filename.endswith("parlib/runtime/group.py"):
            if event == "line":
                steps.append((frame.f_code.co_filename, frame.f_lineno))
            return tracer
        return None

    group = RankGroup(world_size, timeout=30)
    sys.settrace(tracer)
    try:
        group.start()
    finally:
        sys.settrace(None)
        group.close()
    return steps


@pytest.mark.slow
def test_interrupt_at_every_step_of_start_up_leaves_nothing():
    parlib.launch(rank_fns.rank_sum, world_size=1)  # the forkserver is up
    baseline = children_of(os.getpid())
    folders_before = _own_temp_dirs()  # groups other tests of this process still hold
    steps = _start_steps(2)
    # every line at its first execution, and every line of the last rank's start
    firsts = {s: i for i, s in reversed(list(enumerate(steps)))}
    lasts = {s: i for i, s in enumerate(steps)}
    targets = sorted(set(firsts.values()) | set(lasts.values()))
    assert len(targets) > 40
    survived, leaks = [], []
    for index in targets:
        count = [0]

        def tracer(frame, event, arg, index=index, count=count):
            if frame.f_code.co_filename.endswith("parlib/runtime/group.py"):
                if event == "line":
                    count[0] += 1
                    if count[0] == index + 1:
                        raise KeyboardInterrupt
                return tracer
            return None

        group = RankGroup(2, timeout=30)
        sys.settrace(tracer)
        try:
            group.start()
        except KeyboardInterrupt:
            pass
        else:
            survived.append(index)
        finally:
            sys.settrace(None)
        group.close()
        left = _outlived(baseline, seconds=15)
        if left:  # say where the interrupt landed and what outlived it
            leaks.append(f"interrupt at group.py line {steps[index][1]}: {left}")
    assert not leaks, "processes outlived an interrupted start-up: " + "; ".join(leaks)
    assert not _own_temp_dirs() - folders_before
    assert len(survived) < len(targets) / 4  # the interrupts did land inside start-up
    assert parlib.launch(rank_fns.rank_sum, world_size=2) == [1.0, 1.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_ASYNC on pipes: Linux")
def test_ranks_holding_the_gil_end_when_their_lifelines_close(monkeypatch, tmp_path):
    """What the interrupt test above met about once in ten loaded runs: a rank started but not
    yet tracked, stuck building its FileStore in the folder the interrupted launcher had just
    removed (torch retries the open with the GIL held), so its lifeline thread never ran.
    Every rank must end by the kernel's SIGIO, not only the last to start."""
    spec = RankGroup._spec

    def stuck_spec(self, rank, env, threads):
        return dict(spec(self, rank, env, threads), store_path=str(tmp_path / "gone" / "s"))

    monkeypatch.setattr(RankGroup, "_spec", stuck_spec)
    monkeypatch.setattr(RankGroup, "kill", lambda self: None)  # watch the lifelines alone
    group = RankGroup(3, timeout=60)
    starter = threading.Thread(target=_quietly, args=(group.start,), daemon=True)
    starter.start()
    deadline = time.time() + 60
    while len(group.procs) < 3 and time.time() < deadline:
        time.sleep(0.05)
    ranks = list(group.procs)
    try:
        deadline = time.time() + 60  # every rank inside FileStore's retry loop, GIL held
        while time.time() < deadline and not all(_asleep(p.pid) for p in ranks):
            time.sleep(0.05)
        assert len(ranks) == 3 and all(_asleep(p.pid) for p in ranks)
        for lifeline in group._lifelines:  # noqa: SLF001 - what kill() does first
            lifeline.close()
        deadline = time.time() + 10
        while time.time() < deadline and any(p.exitcode is None for p in ranks):
            time.sleep(0.05)
        assert [p.exitcode for p in ranks] == [-signal.SIGIO] * 3
    finally:
        monkeypatch.undo()
        for p in ranks:
            with contextlib.suppress(OSError, ValueError):
                p.kill()
        starter.join(30)
        group.kill()


def _asleep(pid):
    """The process's main thread sleeps in nanosleep (as FileStore's 10 ms retries do)."""
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            return fh.read() == "hrtimer_nanosleep"
    except OSError:
        return False


def _quietly(fn):
    with contextlib.suppress(BaseException):
        fn()


# -- 16.10: a killed kernel, a rank holding the GIL in C code, a rank's own child ------
@pytest.mark.slow
def test_killed_kernel_leaves_no_process_and_no_temp_folder(tmp_path):
    pidfile = tmp_path / "pids"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        import parlib
        from tests.helpers import rank_fns
        parlib.launch(rank_fns.hog_gil_with_child, {str(pidfile)!r}, world_size=2)
    """)
    kernel = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        rows = pidfile.read_text().split("\n") if pidfile.exists() else []
        if len([r for r in rows if r]) >= 2:
            break
        time.sleep(0.1)
    pids = [int(p) for row in pidfile.read_text().split("\n") if row for p in row.split()]
    helpers = children_of(kernel.pid)  # forkserver, resource tracker, ranks, sleep children
    assert set(pids) <= helpers
    time.sleep(1.0)  # the ranks are inside the regex now
    os.kill(kernel.pid, signal.SIGKILL)  # not reaped yet: the kernel stays a zombie
    deadline = time.time() + 15
    while time.time() < deadline and any(alive(p) for p in helpers):
        time.sleep(0.1)
    left = [p for p in helpers if alive(p)]
    kernel.wait()
    assert not left, f"processes outlived their kernel: {left}"
    folders = glob.glob(os.path.join(tempfile.gettempdir(), f"parlib-{kernel.pid}-*"))
    assert not folders, folders


def test_stale_temp_folders_are_removed_on_the_next_start(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(tempfile.gettempdir(), f"parlib-{dead.pid}-12345-group-x")
    os.makedirs(stale, exist_ok=True)
    mine = procs.make_temp_dir("test")
    removed = procs.remove_stale_temp_dirs()
    assert stale in removed and os.path.isdir(mine)
    os.rmdir(mine)
