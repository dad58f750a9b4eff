"""parlib.Cluster: warm ranks, fault recovery, no leaks."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import Cluster, RankError
from tests.helpers import rank_fns
from tests.helpers.procutil import alive, children_of, open_fds, rss_kib


@pytest.fixture(scope="module")
def cluster():
    with Cluster(4, timeout=20) as c:
        yield c


def test_run_returns_per_rank_results(cluster):
    assert cluster.run(rank_fns.rank_sum) == [6.0] * 4
    assert cluster.run(lambda x: dist.get_rank() + x, 1) == [1, 2, 3, 4]
    assert cluster.state == "running"


def test_dispatch_is_fast(cluster):
    cluster.run(lambda: None)
    start = time.perf_counter()
    for _ in range(50):
        cluster.run(lambda: None)
    per_call = (time.perf_counter() - start) / 50
    assert per_call < 0.02, f"{per_call * 1e3:.1f} ms per no-op call"


def test_error_names_rank_and_cluster_rebuilds(cluster, capfd):
    pids = cluster.pids()
    with pytest.raises(RankError) as info:
        cluster.run(rank_fns.fail_on, 1)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert cluster.state == "will rebuild on next call"
    time.sleep(0.2)
    assert not any(alive(p) for p in pids), "old ranks survived the error"
    assert cluster.run(rank_fns.rank_sum) == [6.0] * 4
    assert "rebuilding the cluster" in capfd.readouterr().out
    assert set(cluster.pids()).isdisjoint(pids)


def test_hang_in_collective_is_bounded_by_call_timeout(cluster):
    start = time.time()
    with pytest.raises(RankError) as info:
        cluster.run_with_timeout(rank_fns.skip_collective, (2,), timeout=2)
    assert info.value.exc_type == "Timeout" and time.time() - start < 6
    assert cluster.run(rank_fns.rank_sum) == [6.0] * 4


def test_rank_death_then_next_call_works(cluster):
    with pytest.raises(RankError) as info:
        cluster.run(rank_fns.exit_on, 3)
    assert info.value.rank == 3
    assert cluster.run(rank_fns.rank_sum) == [6.0] * 4


def test_restart_gives_fresh_ranks(cluster):
    before = cluster.pids()
    cluster.restart()
    assert set(cluster.pids()).isdisjoint(before)
    assert cluster.run(rank_fns.rank_sum) == [6.0] * 4


def test_close_ends_ranks_and_refuses_calls():
    c = Cluster(2)
    pids = c.pids()
    c.close()
    time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        c.run(rank_fns.rank_sum)
    c.close()  # twice is fine


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        Cluster(0)
    with pytest.raises(ValueError, match="timeout"):
        Cluster(2, timeout=-1)


@pytest.mark.slow
def test_500_calls_leak_nothing():
    with Cluster(2) as c:
        for _ in range(20):
            c.run(rank_fns.rank_sum)
        fds, rss, kids = open_fds(), rss_kib(), children_of(os.getpid())
        for i in range(500):
            assert c.run(rank_fns.rank_sum, float(i % 3)) == [float(i % 3)] * 2
        assert open_fds() <= fds
        assert children_of(os.getpid()) == kids
        assert rss_kib() - rss < 20_000, "resident memory grew by more than 20 MB"


def test_large_results_come_back(cluster):
    out = cluster.run(lambda: torch.full((1 << 18,), float(dist.get_rank())))
    assert [t.sum().item() for t in out] == [r * (1 << 18) for r in range(4)]


def test_cluster_and_launch_coexist(cluster):
    assert parlib.launch(rank_fns.rank_sum, world_size=2) == [1.0, 1.0]
    assert cluster.run(rank_fns.rank_sum) == [6.0] * 4
