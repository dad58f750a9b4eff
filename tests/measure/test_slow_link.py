"""parlib.measure.SlowLink: each collective takes at least the alpha-beta time of its bytes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib.cost.collectives import collective_time
from parlib.measure import CommLog, SlowLink

ALPHA, BETA = 1e-3, 20e-9  # 1 ms per message step, 50 MB/s
# A lower bound (a call takes at least its emulated time) holds under any load; an upper
# bound (a call returns at once, a collective that is not slowed stays fast) fails when a
# loaded machine stalls that one call, so it is measured again, up to this many times.
TRIES = 3


def _until_fast(run, fast):
    """``run()`` until ``fast(result)`` holds, at most TRIES times; the last result."""
    for _ in range(TRIES):
        result = run()
        if fast(result):
            break
    return result


def _slowed_calls():
    from parlib import comm

    n = dist.get_world_size()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single")}
    t = torch.ones(2**18)  # 1 MiB
    out = torch.empty(n * t.numel())
    seconds = {}
    with SlowLink(ALPHA, BETA) as link:
        with CommLog() as log:  # inside: its seconds include the emulated time
            t0 = time.perf_counter()
            dist.all_reduce(t)
            seconds["all_reduce"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            comm.all_gather(out, t)
            seconds["all_gather"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            work = dist.all_reduce(t, async_op=True)
            issued = time.perf_counter() - t0
            work.wait()
            seconds["async"] = time.perf_counter() - t0
        extra = {"all_reduce": link.extra_seconds("all_reduce", t.numel() * 4, n),
                 "all_gather": link.extra_seconds("all_gather", out.numel() * 4, n)}
    restored = all(getattr(dist, k) is v for k, v in originals.items())
    return seconds, extra, issued, log.seconds("all_reduce"), restored


@pytest.mark.parametrize("n", [2, 4])
def test_each_collective_takes_at_least_its_emulated_time(n):
    seconds, extra, issued, logged, restored = _until_fast(
        lambda: parlib.launch(_slowed_calls, world_size=n)[0],
        lambda r: r[2] < r[1]["all_reduce"])
    assert extra["all_reduce"] == collective_time("all_reduce", 2**20, n, ALPHA, BETA)
    assert extra["all_gather"] == collective_time("all_gather", n * 2**20, n, ALPHA, BETA)
    assert seconds["all_reduce"] >= extra["all_reduce"]
    assert seconds["all_gather"] >= extra["all_gather"]
    assert issued < extra["all_reduce"] <= seconds["async"]  # async: the wait pays it
    assert logged >= seconds["all_reduce"] - 1e-3 >= extra["all_reduce"] - 1e-3
    assert restored


def test_describe_says_emulated():
    assert "emulated" in SlowLink(5e-5, 1e-9).describe()


def test_blocks_close_in_reverse_order():
    outer, inner = SlowLink(), SlowLink(1.0)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)


def _slowed_p2p():
    rank = dist.get_rank()
    t = torch.ones(2**16)  # 256 KiB
    with SlowLink(ALPHA, BETA) as link:
        extra = link.extra_seconds("p2p", t.numel() * 4, 2)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            work = dist.isend(t, 1)
            issued = time.perf_counter() - t0
            work.wait()
        else:
            dist.recv(t, 0)
            issued = 0.0
        took = time.perf_counter() - t0
    return extra, issued, took


def test_point_to_point_messages_pay_one_message_time():
    (extra, issued, sent), (_, _, received) = _until_fast(
        lambda: parlib.launch(_slowed_p2p, world_size=2), lambda r: r[0][1] < r[0][0])
    assert extra == pytest.approx(ALPHA + BETA * 2**18)  # alpha + beta x bytes
    assert issued < extra <= sent      # isend returns at once; its wait pays the link
    assert received >= extra           # the receiver pays it after the data arrives


def _slowed_batch():
    rank = dist.get_rank()
    out, inp = torch.zeros(2**16), torch.ones(2**16)  # 256 KiB each way
    with SlowLink(ALPHA, BETA) as link:
        extra = link.extra_seconds("p2p", inp.numel() * 4, 2)
        ops = [dist.P2POp(dist.isend, inp, 1 - rank), dist.P2POp(dist.irecv, out, 1 - rank)]
        dist.barrier()
        t0 = time.perf_counter()
        works = dist.batch_isend_irecv(ops if rank == 0 else ops[::-1])
        issued = time.perf_counter() - t0
        for work in works:
            work.wait()
        took = time.perf_counter() - t0
        t0 = time.perf_counter()
        dist.broadcast(inp, src=0)  # no ring time in the cost layer: not slowed
        broadcast = time.perf_counter() - t0
    return extra, issued, took, broadcast, out.sum().item()


def test_a_batch_of_messages_pays_each_message_time_on_its_wait():
    results = _until_fast(lambda: parlib.launch(_slowed_batch, world_size=2),
                          lambda rs: all(r[1] < 2 * r[0] and r[3] < r[0] for r in rs))
    for extra, issued, took, broadcast, received in results:
        assert received == 2**16
        assert issued < 2 * extra <= took  # one send and one receive, paid by the waits
        assert broadcast < extra
