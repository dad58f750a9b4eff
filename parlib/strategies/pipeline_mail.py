"""The pipeline runner's messages (:func:`parlib.strategies.pipeline.run_schedule`), posted
so that they run under NCCL's rules: see :class:`_Mailbox`."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from parlib import comm
from parlib.strategies.schedule_check import message_order
from parlib.strategies.schedules import Op

SEND, RECV = "send", "recv"


class _Mailbox:
    """One rank's messages in :func:`run_schedule`, as NCCL takes them.

    Each message (a header, then its payload, to or from one neighbour) is its own
    ``dist.batch_isend_irecv`` (:func:`parlib.comm.exchange`), matched by order, never by
    tag, and every rank posts its messages in one order that all the ranks share: the
    order the schedule's replay sends them in
    (:func:`parlib.strategies.schedule_check.message_order`, computed on every rank from
    the op lists the ranks exchange before the step). A send is posted when its op has
    computed it, a receive as early as the order allows (right after the sends before it),
    so the next input travels while this op computes; a receive is waited for when its op
    runs, the sends at the end of the step. One rank holding every chunk (p = 1) sends to
    itself: a queue, in order.

    Why one shared order: NCCL gives a batch one work (waiting for a receive also waits
    for the sends beside it), runs a rank's batches one at a time in the order posted,
    and a send beyond its buffers waits for the receiver's batch to start. Messages
    posted in each rank's own convenient order (an op's sends with the next op's receive,
    as this runner once did) can then wait on each other in a cycle: the interleaved
    order (v = 2) deadlocked so on 2 ranks, whose two neighbours are one rank, and on 4
    ranks with m = 8 (GPipe, 1F1B and ZB-H1 ran). In one
    shared order the first unfinished message is first in line on both its ranks, and
    its sender has computed it from earlier messages: every message completes.
    :func:`parlib.comm.nccl_rules` emulates those rules on gloo; under it GPipe, 1F1B,
    interleaved (v = 2) and ZB-H1 run equal to one device on 2 and 4 ranks, with fewer,
    as many and more microbatches than ranks (the interleaved order takes m a multiple
    of p)."""

    def __init__(self, device: torch.device, shape: tuple[int, ...],
                 plan: list[tuple[str, int, int]] | None) -> None:
        """``plan``: this rank's messages in the shared order, (SEND or RECV, op index,
        global rank of the peer); None when the rank holds every stage."""
        self.device, self.shape, self.plan = device, shape, plan
        self.alone = plan is None
        self.next = 0  # the plan's first message not yet posted
        self.outbox: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # op -> computed
        self.inbox: dict[int, tuple[torch.Tensor, torch.Tensor, list[Any]]] = {}
        self.sent: list[tuple[list[Any], tuple[torch.Tensor, ...]]] = []  # kept alive
        self.to_self: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self._post_receives()  # the first inputs travel while the first ops compute

    def send(self, index: int, header: torch.Tensor, payload: torch.Tensor, dst: int) -> None:
        """Post op ``index``'s message (and every receive the order puts before it)."""
        if self.alone:
            self.to_self.append((header, payload.clone()))
            return
        self.outbox[index] = (header, payload)
        self._post_through(SEND, index)

    def take(self, index: int, op: Op) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        """(header, payload, the works to wait for) of op ``index``'s message."""
        if self.alone:
            if not self.to_self:
                raise RuntimeError(f"op {op!r} waits for a message this rank never sent "
                                   f"itself (a deadlock: validate the schedule)")
            return (*self.to_self.popleft(), [])
        if index not in self.inbox:
            self._post_through(RECV, index)
        return self.inbox.pop(index)

    def finish(self) -> None:
        """Wait for every send (each receive was waited for by its op)."""
        for works, _ in self.sent:
            for work in works:
                work.wait()

    def _post_through(self, kind: str, index: int) -> None:
        """Post the plan up to op ``index``'s message of ``kind``, then the receives after
        it up to the next send."""
        assert self.plan is not None
        while self.next < len(self.plan):
            here = self.plan[self.next][:2]
            self._post_one()
            if here == (kind, index):
                break
        else:
            raise RuntimeError(f"run_schedule: op {index}'s {kind} is not in this rank's "
                               "message order (the op lists changed after the check)")
        self._post_receives()

    def _post_receives(self) -> None:
        while self.plan and self.next < len(self.plan) and self.plan[self.next][0] == RECV:
            self._post_one()

    def _post_one(self) -> None:
        assert self.plan is not None
        kind, index, peer = self.plan[self.next]
        if kind == SEND:
            if index not in self.outbox:
                raise RuntimeError(f"run_schedule: op {index}'s output is due before it is "
                                   "computed (the op lists changed after the check)")
            header, payload = self.outbox.pop(index)
            self.sent.append((comm.exchange([(header, peer), (payload, peer)], []),
                              (header, payload)))
        else:
            header = torch.empty(3, dtype=torch.int64, device=self.device)
            buf = torch.empty(self.shape, device=self.device)
            self.inbox[index] = (header, buf, comm.exchange([], [(header, peer), (buf, peer)]))
        self.next += 1


def message_plan(sched: Mapping[int, Sequence[Op]], p: int, v: int, rank: int,
                 peer: Any) -> list[tuple[str, int, int]]:
    """This pipeline ``rank``'s messages in the order every rank shares, as (SEND or
    RECV, op index, global rank of the peer); ``peer(kind, index)`` gives the peer."""
    plan = []
    for sender, sent_at, receiver, received_at in message_order(sched, p, v):
        if sender == rank:
            plan.append((SEND, sent_at, peer(SEND, sent_at)))
        if receiver == rank:
            plan.append((RECV, received_at, peer(RECV, received_at)))
    return plan


__all__: list[str] = []
