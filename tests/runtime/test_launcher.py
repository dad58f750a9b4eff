"""parlib.launch with real rank processes: results, output, faults, leaks, arguments."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import RankError
from parlib.runtime.policy import plan, threads_per_rank
from tests.helpers import rank_fns
from tests.helpers.procutil import alive, children_of, open_fds, rss_kib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _no_rank_left():
    """Only the forkserver, its resource tracker and the temp-folder reaper may outlive a
    launch."""
    deadline = time.time() + 3
    while time.time() < deadline:
        kids = children_of(os.getpid())
        if len(kids) <= 3:
            return kids
        time.sleep(0.05)
    raise AssertionError(f"rank processes left behind: {sorted(kids)}")


def test_results_ordered_by_rank_and_threads():
    def f(x):
        return dist.get_rank() * x, dist.get_world_size(), torch.get_num_threads()

    out = parlib.launch(f, 10, world_size=3)
    threads = threads_per_rank(3)
    assert out == [(0, 3, threads), (10, 3, threads), (20, 3, threads)]


def test_imported_function_and_kwargs():
    assert parlib.launch(rank_fns.rank_sum, world_size=4, scale=2.0) == [12.0] * 4


def test_closure_and_local_class_are_shipped_by_value():
    offset = 5

    class Acc:
        def __init__(self):
            self.total = offset

        def add(self, v):
            self.total += v
            return self

    def f():
        return Acc().add(dist.get_rank()).total

    assert parlib.launch(f, world_size=2) == [5, 6]


def test_world_size_one_and_device():
    def f():
        return str(parlib.device()), os.environ["RANK"], dist.get_backend()

    assert parlib.launch(f, world_size=1) == [("cpu", "0", "gloo")]


def test_output_is_prefixed_by_rank(capfd):
    def f():
        print("hello", dist.get_rank())
        print("to stderr", file=sys.stderr)

    parlib.launch(f, world_size=2)
    out, err = capfd.readouterr()
    assert "[rank 0] hello 0\n" in out and "[rank 1] hello 1\n" in out
    assert "[rank 0] to stderr\n" in err and "[rank 1] to stderr\n" in err


def test_output_arrives_before_the_launch_ends(capfd):
    """A line printed before a long sleep is shown while the rank is still sleeping."""
    code = textwrap.dedent(
        """
        import sys, time, parlib
        def f():
            print("early", flush=True)
            time.sleep(3)
            print("late", flush=True)
        parlib.launch(f, world_size=1)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    seen = {}
    for line in proc.stdout:
        for word in ("early", "late"):
            if f"[rank 0] {word}" in line:
                seen[word] = time.time()
    proc.wait(60)
    assert seen["late"] - seen["early"] > 1.5  # not held back until the rank finished


def _assert_fault(fn, *args, rank, exc_type, within, world_size=4, timeout=60.0, **kwargs):
    start = time.time()
    with pytest.raises(RankError) as info:
        parlib.launch(fn, *args, world_size=world_size, timeout=timeout, **kwargs)
    elapsed = time.time() - start
    assert info.value.rank == rank, str(info.value)
    assert info.value.exc_type == exc_type, str(info.value)
    assert elapsed < within, f"took {elapsed:.1f} s"
    _no_rank_left()
    assert parlib.launch(rank_fns.rank_sum, world_size=2) == [1.0, 1.0]  # next launch works
    return info.value


def test_exception_on_one_rank_names_it_with_cell_source():
    err = _assert_fault(rank_fns.fail_on, 2, rank=2, exc_type="ValueError", within=5)
    assert "bad value on rank 2" in str(err)
    assert "rank_fns.py" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert "Connection" not in str(err).splitlines()[0]


def test_exception_on_all_ranks_reports_the_first_not_echoes():
    err = _assert_fault(rank_fns.fail_everywhere, rank=err_rank_any(), exc_type="KeyError",
                        within=5)
    assert "broke" in str(err) and "reset by peer" not in str(err).splitlines()[0]


def err_rank_any():
    class AnyRank:
        def __eq__(self, other):
            return other in range(4)

    return AnyRank()


def test_os_exit_is_root_cause():
    err = _assert_fault(rank_fns.exit_on, 1, rank=1, exc_type="Exited", within=5)
    assert "exited with code 3" in str(err)


def test_signal_kill_is_root_cause():
    err = _assert_fault(rank_fns.kill_on, 3, rank=3, exc_type="Exited", within=5)
    assert "SIGKILL" in str(err)


def test_skipped_collective_is_bounded_by_timeout():
    err = _assert_fault(rank_fns.skip_collective, 0, rank=1, exc_type="Timeout", within=8,
                        timeout=3)
    assert "did every rank call the same collectives" in str(err)
    assert "all_reduce" in err.remote_traceback  # where the stuck ranks were


def test_infinite_loop_is_bounded_by_timeout():
    err = _assert_fault(rank_fns.spin_forever, rank=0, exc_type="Timeout", within=7,
                        world_size=2, timeout=2)
    assert "spin_forever" in err.remote_traceback


def test_unpicklable_return_value():
    err = _assert_fault(rank_fns.unpicklable, rank=0, exc_type="PicklingError", within=5,
                        world_size=1)
    assert "generator" in str(err)


def test_one_megabyte_of_output(capfd):
    assert parlib.launch(rank_fns.shout, 1 << 20, world_size=2) == [0, 1]
    out, _ = capfd.readouterr()
    assert out.count("[rank 0] " + "x" * 99 + "\n") == (1 << 20) // 100


def test_nothing_listens_beyond_loopback():
    per_rank = parlib.launch(rank_fns.listening_sockets, world_size=2)
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    for sockets in per_rank:
        for addr, _port in sockets:
            assert addr in loopback, f"a rank listens on {addr}"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), "world_size must be a positive int"),
        (dict(world_size=-2), "world_size must be a positive int"),
        (dict(world_size=2.0), "world_size must be a positive int"),
        (dict(world_size=2, backend="mpi2"), "unknown backend"),
        (dict(world_size=2, timeout=0), "timeout must be a positive"),
    ],
)
def test_bad_arguments_raise_value_error_before_start(kwargs, match):
    before = children_of(os.getpid())
    with pytest.raises(ValueError, match=match):
        parlib.launch(rank_fns.rank_sum, **kwargs)
    assert children_of(os.getpid()) <= before | _no_rank_left()


def test_non_callable_and_nccl_without_gpus():
    with pytest.raises(ValueError, match="fn must be callable"):
        parlib.launch(42, world_size=2)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs one CUDA GPU per rank"):
            parlib.launch(rank_fns.rank_sum, world_size=2, backend="nccl")


def test_unshippable_function_is_a_clear_error():
    import threading

    lock = threading.Lock()

    def f():
        return lock.locked()

    with pytest.raises(ValueError, match="cannot send"):
        parlib.launch(f, world_size=2)
    _no_rank_left()


def test_device_policy():
    p = plan(4)
    if torch.cuda.device_count() >= 4:
        assert (p.backend, p.device_type) == ("nccl", "cuda")
    else:
        assert (p.backend, p.device_type) == ("gloo", "cpu") and "CPU" in p.reason
    assert plan(2, "gloo").backend == "gloo"


def test_env_is_passed_to_ranks():
    def f():
        return os.environ.get("PARLIB_TEST_VALUE")

    assert parlib.launch(f, world_size=2, env={"PARLIB_TEST_VALUE": "yes"}) == ["yes", "yes"]
    assert parlib.launch(f, world_size=1) == [None]


def test_a_device_asked_for_in_env_is_the_ranks_device():
    # gloo over GPU tensors (two ranks on one GPU) is asked for this way: the launcher's own
    # choice (the CPU under gloo) must not replace it
    def f():
        return str(parlib.device())

    assert parlib.launch(f, world_size=2, backend="gloo", env={"PARLIB_DEVICE": "meta"}) == [
        "meta", "meta"]
    assert parlib.launch(f, world_size=2, backend="gloo") == ["cpu", "cpu"]


@pytest.mark.slow
def test_200_launches_leak_nothing():
    for _ in range(5):  # warm up caches and allocator pools
        parlib.launch(rank_fns.rank_sum, world_size=2)
    fds, rss, kids = open_fds(), rss_kib(), children_of(os.getpid())
    for _ in range(200):
        parlib.launch(rank_fns.rank_sum, world_size=2)
    assert children_of(os.getpid()) == kids
    assert open_fds() <= fds
    assert rss_kib() - rss < 20_000, "resident memory grew by more than 20 MB"


def _script(body):
    head = (
        f"import os, sys, time\nsys.path.insert(0, {ROOT!r})\n"
        "import parlib\nfrom tests.helpers import rank_fns\n"
        "parlib.launch(rank_fns.rank_sum, world_size=1)  # forkserver warm\n"
    )
    return head + textwrap.dedent(body)


def _pids_from(path, n, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            pids = [int(x) for x in open(path).read().split()]
            if len(pids) >= n:
                return pids
        time.sleep(0.05)
    raise AssertionError("ranks did not start")


@pytest.mark.parametrize("to_group", [False, True], ids=["kernel-alone", "process-group"])
def test_interrupt_ends_ranks_within_a_second(tmp_path, to_group):
    pidfile = tmp_path / "pids"
    body = f"""
    try:
        parlib.launch(rank_fns.report_pid_and_sleep, {str(pidfile)!r}, 60, world_size=2)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    """
    proc = subprocess.Popen([sys.executable, "-c", _script(body)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    pids = _pids_from(pidfile, 2)
    start = time.time()
    if to_group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    while any(alive(p) for p in pids) and time.time() - start < 10:
        time.sleep(0.02)
    took = time.time() - start
    out, _ = proc.communicate(timeout=120)
    assert "INTERRUPTED" in out
    assert not any(alive(p) for p in pids)
    assert took < 1.0 + 2.0, f"ranks outlived the interrupt by {took:.1f} s"


def test_killed_parent_leaves_no_rank(tmp_path):
    pidfile = tmp_path / "pids"
    body = f"parlib.launch(rank_fns.report_pid_and_sleep, {str(pidfile)!r}, 60, world_size=2)"
    proc = subprocess.Popen([sys.executable, "-c", _script(body)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    pids = _pids_from(pidfile, 2)
    proc.kill()
    proc.wait(5)
    deadline = time.time() + 3
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_two_launchers_at_once():
    body = "print(parlib.launch(rank_fns.sleep_then, 1.0, world_size=2) and 'OK')"
    procs = [subprocess.Popen([sys.executable, "-c", _script(body)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all("OK" in out for out in outs)


def test_torchrun_runs_the_same_function():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed beside this python")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2",
         "-m", "parlib.run", "tests.helpers.rank_fns:torchrun_entry", "3"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'sum': 3.0" in out.stdout and "'rank': 1" in out.stdout


def test_a_cell_function_that_names_dist_and_reads_a_config_attribute_launches():
    """A notebook cell's function is shipped by value; naming ``dist`` and reading any
    ``.config`` made cloudpickle ship the submodule torch.distributed.config, which pickle
    cannot copy ("cannot pickle 'ConfigModuleInstance'")."""
    cell = {"__name__": "__a_notebook_cell__"}  # not importable: pickled by value
    exec(textwrap.dedent("""
        import torch.distributed as dist
        from types import SimpleNamespace

        def rank_fn():
            model = SimpleNamespace(config=SimpleNamespace(width=3))
            return dist.get_rank() * model.config.width
    """), cell)
    assert parlib.launch(cell["rank_fn"], world_size=2, timeout=60) == [0, 3]
