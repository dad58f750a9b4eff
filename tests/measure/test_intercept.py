"""parlib.measure.intercept: one patch of torch.distributed, one table of ops, many views."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import parlib
from parlib.measure import CommLog, axis_traffic, intercept
from parlib.measure.emulation import PacedCost
from parlib.measure.timeline import Recorder

ROW = 3  # floats per row of the all-to-all input


class _Names:
    """An observer that writes down what it saw, and where in the chain it ran."""

    def __init__(self, tag: str, order: list[str]) -> None:
        self.tag, self.order, self.calls = tag, order, []

    def around(self, call, proceed):
        self.order.append(f"{self.tag} in")
        self.calls.append((call.name, call.op, call.nbytes, call.sent_bytes))
        out = proceed()
        self.order.append(f"{self.tag} out")
        return out


def _splits(rank: int, n: int) -> list[int]:
    """Rows rank ``rank`` sends to each rank: uneven (1, 2, 3, ... shifted by rank)."""
    return [1 + (rank + j) % n for j in range(n)]


def _all_to_all_ranks():
    rank, n = dist.get_rank(), dist.get_world_size()
    send = _splits(rank, n)
    recv = [_splits(j, n)[rank] for j in range(n)]
    x = torch.cat([torch.full((k, ROW), float(10 * rank + j)) for j, k in enumerate(send)])
    y = torch.empty(sum(recv), ROW)
    pieces = [torch.full((2, ROW), float(10 * rank + j)) for j in range(n)]
    got = [torch.empty(2, ROW) for _ in range(n)]
    dist.barrier()
    with CommLog() as log:
        dist.all_to_all_single(y, x, recv, send)
        dist.all_to_all(got, pieces)  # gloo needs equal-sized pieces for the list form
        work = dist.all_to_all_single(y, x, recv, send, async_op=True)
        work.wait()
    expect_y = torch.cat([torch.full((k, ROW), float(10 * j + rank)) for j, k in enumerate(recv)])
    return {
        "records": [(r.op, r.nbytes, r.group_size, r.async_op, r.predicted_sent)
                    for r in log.records],
        "wire": log.records[0].wire_bytes,
        "data_ok": torch.equal(y, expect_y)
        and all(torch.equal(g, torch.full((2, ROW), float(10 * j + rank)))
                for j, g in enumerate(got)),
        "seconds_ok": all(r.seconds > 0 for r in log.records),
    }


@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all_runs_on_gloo_and_is_counted_exactly(n):
    for rank, r in enumerate(parlib.launch(_all_to_all_ranks, world_size=n)):
        send = _splits(rank, n)
        row = ROW * 4
        uneven = (sum(send) * row, (sum(send) - send[rank]) * row)  # message, sent
        even = (n * 2 * row, (n - 1) * 2 * row)
        assert r["data_ok"] and r["seconds_ok"]
        assert r["records"] == [
            ("all_to_all", uneven[0], n, False, uneven[1]),
            ("all_to_all", even[0], n, False, even[1]),
            ("all_to_all", uneven[0], n, True, uneven[1]),
        ]
        if sys.platform.startswith("linux"):  # what went to the sockets: the pieces + headers
            assert uneven[1] <= r["wire"] <= uneven[1] + 512 * n


def _batch_and_observers():
    rank = dist.get_rank()
    peer = 1 - rank
    out, inp = torch.zeros(5), torch.full((5,), float(rank))
    made_before = [dist.P2POp(dist.isend, inp, peer), dist.P2POp(dist.irecv, out, peer)]
    order: list[str] = []
    outer, inner = _Names("outer", order), _Names("inner", order)
    originals = {name: getattr(c10d, name) for name in intercept.OPS if hasattr(c10d, name)}
    with intercept.observing(inner):
        with intercept.observing(outer):
            patched = all(getattr(c10d, name) is not f for name, f in originals.items())
            same_wrapper = dist.all_reduce is c10d.all_reduce
            with CommLog() as log:
                for work in dist.batch_isend_irecv(made_before):
                    work.wait()
                made_inside = [dist.P2POp(dist.irecv, out, peer),
                               dist.P2POp(dist.isend, inp, peer)]
                if rank == 1:
                    made_inside.reverse()
                for work in dist.batch_isend_irecv(made_inside):
                    work.wait()
        try:
            with intercept.observing(outer):
                raise KeyError("boom")
        except KeyError:
            pass
        still_inner = dist.all_reduce is not originals["all_reduce"]
    restored = all(getattr(c10d, name) is f for name, f in originals.items()) and all(
        getattr(dist, name) is f for name, f in originals.items() if hasattr(dist, name))
    return {"patched": patched, "same_wrapper": same_wrapper, "still_inner": still_inner,
            "restored": restored, "order": order, "inner": inner.calls,
            "records": [(r.op, r.nbytes, r.predicted_sent) for r in log.records],
            "received": out.tolist()}


def test_batch_isend_irecv_and_nested_observers():
    for rank, r in enumerate(parlib.launch(_batch_and_observers, world_size=2)):
        assert r["patched"] and r["same_wrapper"] and r["still_inner"] and r["restored"]
        assert r["received"] == [float(1 - rank)] * 5
        # the batch is one call (its isend/irecv inside are not seen again), 20 B sent
        assert r["records"] == [("batch_isend_irecv", 40, 20.0)] * 2
        assert r["inner"] == [("batch_isend_irecv", "batch_isend_irecv", 40, 20.0)] * 2
        # the observer subscribed last is the outermost
        assert r["order"] == ["outer in", "inner in", "inner out", "outer out"] * 2


def _axes_ranks():
    rank = dist.get_rank()
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    rec = Recorder(rank)
    pacer = PacedCost([1e6] * 3, [0.0], 1e9)  # pieces of 1 ms around 2 points
    t = torch.ones(256)  # 1 KiB
    with axis_traffic({"tp": tp, "dp": dp}, rec, pacer) as counts:
        pacer.start("forward", 1)
        dist.all_reduce(t, group=tp)
        gathered = torch.empty(2 * 256)
        dist.all_gather_into_tensor(gathered, t, group=tp)
        dist.all_reduce(t, group=dp)
        dist.all_to_all_single(torch.empty(256), t, group=dp)
        dist.all_reduce(t)  # the world: no axis
        peer = rank ^ 1  # my tp partner, as a global rank
        if rank % 2 == 0:
            dist.send(t, peer, group=tp)
        else:
            dist.recv(t, peer, group=tp)
    return {"counts": counts, "kinds": [s.kind for s in rec.spans],
            "points": pacer.points}


def test_axis_traffic_counts_every_call_on_each_axis_group():
    kib = 1024
    for rank, r in enumerate(parlib.launch(_axes_ranks, world_size=4)):
        send_bytes = kib if rank % 2 == 0 else 0
        assert r["counts"] == {
            # all-reduce 2(N-1)/N, all-gather (N-1)/N of the 2 KiB output, then the message
            "tp": {"calls": 3, "message_bytes": 4 * kib,
                   "sent_bytes": kib + kib + send_bytes},
            # all-reduce, all-to-all: the half for the other rank
            "dp": {"calls": 2, "message_bytes": 2 * kib, "sent_bytes": kib + kib / 2},
        }
        assert r["kinds"] == ["tp", "tp", "dp", "dp", "tp"]
        assert r["points"] == 2  # paced before the first two tp calls, not before dp ones


def test_axis_traffic_names_bad_arguments():
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        with axis_traffic({"xp": None}):
            pass
    with pytest.raises(ValueError, match="needs the recorder"):
        with axis_traffic({"tp": None}, pacer=PacedCost([1.0], [1.0], 1.0)):
            pass


def _functional():
    import torch.distributed._functional_collectives as funcol

    t = torch.ones(8)
    with CommLog() as log:
        out = funcol.all_reduce(t, "sum", dist.group.WORLD)
        out = funcol.wait_tensor(out)
    return [(r.op, r.nbytes, r.group_size) for r in log.records], out.tolist()


def test_functional_collectives_are_seen():
    for records, out in parlib.launch(_functional, world_size=2):
        assert records == [("all_reduce", 32, 2)] and out == [2.0] * 8


def test_every_table_entry_reads_its_message():
    # each op's message argument is a parameter of this torch's function of that name
    import inspect

    for name, rule in intercept.OPS.items():
        fn = getattr(c10d, name, None)
        if fn is None or rule.message is None:
            continue
        assert rule.message in inspect.signature(fn).parameters, name
