"""NCCL's point-to-point rules on the CPU (parlib.comm.nccl_rules): tags dropped, so gloo
matches messages by order as NCCL does, and an unbatched send and receive to one peer
refused. The rules catch the patterns NCCL does not honour, and the pipeline (all four
schedules), ring attention (both layouts, forward and backward) and the experts'
all-to-all run under them equal to one device.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import comm, verify
from parlib.experiments import pipeline as runs
from parlib.strategies.context import LAYOUTS
from tests.strategies.test_context import _attention_vs_single
from tests.strategies.test_experts import FACTORS, _layer_vs_single
from tests.strategies.test_pipeline import CFG8, EVERY_SCHEDULE

# ---- the rules catch what NCCL does not honour


def _old_patterns() -> dict[str, object]:
    """On two ranks: the patterns the rules refuse or change, and what still runs."""
    rank = dist.get_rank()
    peer = 1 - rank
    out: dict[str, object] = {}
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    with comm.nccl_rules():
        send = dist.isend(mine, peer)  # unbatched, and not yet waited for
        try:
            dist.irecv(theirs, peer)
        except RuntimeError as err:
            out["pair"] = str(err)
    dist.recv(theirs, peer)  # outside the rules: receive the message sent above
    send.wait()
    out["pair_received"] = theirs.tolist()
    with comm.nccl_rules():
        out["tags"] = _swapped_tags(rank)
        try:
            dist.recv(theirs)
        except RuntimeError as err:
            out["any_source"] = str(err)
        out["blocking"] = _blocking_ring(rank, peer)  # send, then recv: one at a time
        works = comm.exchange([(mine, peer)], [(theirs, peer)])
        for work in works:
            work.wait()
        out["batched"] = theirs.tolist()
    out["tags_without_rules"] = _swapped_tags(rank)
    out["docstring"] = _docstring_example(peer)
    return out


def _docstring_example(peer: int) -> list[float]:
    """The example of parlib.comm's docstring, run as written."""
    code = textwrap.dedent(comm.__doc__.split("::\n", 1)[1])
    mine, theirs = torch.full((2,), float(dist.get_rank())), torch.empty(2)
    scope = {"dist": dist, "parlib": parlib, "mine": mine, "theirs": theirs, "peer": peer}
    exec(code, scope)
    for work in scope["works"]:
        work.wait()
    return theirs.tolist()


def _swapped_tags(rank: int) -> list[float] | None:
    """Rank 0 sends 1 (tag 7) then 2 (tag 8); rank 1 posts the tag-8 receive first. Gloo
    pairs them by tag; NCCL (and the rules) by order, swapping them."""
    if rank == 0:
        works = [dist.isend(torch.ones(2), 1, tag=7), dist.isend(torch.full((2,), 2.0), 1,
                                                                 tag=8)]
    else:
        first, second = torch.empty(2), torch.empty(2)
        works = [dist.irecv(second, 0, tag=8), dist.irecv(first, 0, tag=7)]
    for work in works:
        work.wait()
    return None if rank == 0 else [first[0].item(), second[0].item()]


def _blocking_ring(rank: int, peer: int) -> float:
    t = torch.full((2,), float(rank))
    got = torch.empty(2)
    if rank == 0:
        dist.send(t, peer)
        dist.recv(got, peer)
    else:
        dist.recv(got, peer)
        dist.send(t, peer)
    return got[0].item()


@functools.lru_cache(maxsize=None)
def _patterns():
    return parlib.launch(_old_patterns, world_size=2, timeout=60)


def test_an_unbatched_send_and_receive_to_one_peer_are_refused_naming_it():
    for rank, out in enumerate(_patterns()):
        assert out["pair"].startswith(f"rank {rank}: unbatched irecv from rank {1 - rank} "
                                      f"while an unbatched isend to rank {1 - rank} is still "
                                      "outstanding"), out["pair"]
        assert "batch_isend_irecv" in out["pair"]
        assert out["pair_received"] == [float(1 - rank)] * 4


def test_tags_are_dropped_so_messages_match_by_order():
    results = _patterns()
    assert results[1]["tags_without_rules"] == [1.0, 2.0]  # gloo: by tag
    assert results[1]["tags"] == [2.0, 1.0]  # NCCL's way: by order, the tags ignored


def test_what_nccl_honours_still_runs_under_the_rules():
    for rank, out in enumerate(_patterns()):
        assert "from any source" in out["any_source"]
        assert out["blocking"] == float(1 - rank)
        assert out["batched"] == [float(1 - rank)] * 4
        assert out["docstring"] == [float(1 - rank)] * 2


def test_the_rules_put_torch_back_and_nest():
    before = (dist.isend, dist.irecv, dist.batch_isend_irecv)
    with comm.nccl_rules():
        assert comm.nccl_rules_on() and dist.isend is not before[0]
        with comm.nccl_rules():
            pass
        assert comm.nccl_rules_on()
    assert not comm.nccl_rules_on()
    assert (dist.isend, dist.irecv, dist.batch_isend_irecv) == before
    assert dist.distributed_c10d.isend is before[0]


def test_the_environment_variable_turns_the_rules_on_for_a_process():
    code = "import parlib.comm as c; print(c.nccl_rules_on(), c._deadlock_after)"
    for value, limit, want in (("1", "7", "True 7.0"), ("0", "", "False 60.0")):
        env = {**os.environ, "PARLIB_NCCL_RULES": value, "PARLIB_NCCL_DEADLOCK_S": limit}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert run.stdout.strip() == want


# ---- NCCL's order: one work per batch, a group's batches one at a time, in order


def _order_patterns(limit: float) -> dict[str, object]:
    """On two ranks: a batch's works, and a receive posted ahead of a send in batches of
    their own (each rank's receive holds back its send, which the other's receive needs:
    gloo runs it, NCCL hangs)."""
    peer = 1 - dist.get_rank()
    mine, theirs = torch.full((4,), float(dist.get_rank())), torch.empty(4)
    out: dict[str, object] = {}
    with comm.nccl_rules(deadlock_after_s=limit):
        works = comm.exchange([(mine, peer)], [(theirs, peer)])
        out["works"] = len(works)
        for work in works:
            work.wait()
        out["exchanged"] = theirs.tolist()
        ahead = comm.exchange([], [(theirs, peer)])
        behind = comm.exchange([(mine, peer)], [])
        start = time.monotonic()
        try:
            for work in ahead + behind:
                work.wait()
            out["ahead"] = "ran"
        except RuntimeError as err:
            out["ahead"] = str(err)
        out["seconds"] = time.monotonic() - start
    return out


def test_a_batch_has_one_work_and_a_receive_posted_ahead_of_its_send_raises_not_hangs():
    for rank, out in enumerate(parlib.launch(_order_patterns, 3.0, world_size=2, timeout=60)):
        peer = 1 - rank
        assert out["works"] == 1  # as ProcessGroupNCCL's coalesced batch: one work
        assert out["exchanged"] == [float(peer)] * 4
        assert out["ahead"].startswith(
            f"rank {rank}: deadlock under NCCL's rules: batch 2 (receive from rank {peer} "
            f"(4 x float32)) on the group [0, 1] stream has not completed in 3 s"), out["ahead"]
        assert "in the order posted" in out["ahead"]
        assert out["seconds"] < 30


# ---- the pipeline's posting order, replayed under NCCL's order (pure Python)


def _nccl_hangs(programs: dict[int, list[tuple]]) -> dict[int, int]:
    """Replay each rank's program under NCCL's order: ("post", {message ids}) posts a
    batch, ("op", message id or None) computes an op after its receive completed. A rank's
    batches run one at a time in posting order; a message completes once the batches that
    hold it on both of its ranks are running (a send waits for its receiver). Returns
    rank -> the program step it is stuck at, for every rank that cannot finish."""
    step, head, batches = dict.fromkeys(programs, 0), dict.fromkeys(programs, 0), {}
    done: set = set()
    for r in programs:
        batches[r] = []
    moved = True
    while moved:
        moved = False
        for r, program in programs.items():
            while step[r] < len(program):
                kind, what = program[step[r]]
                if kind == "op" and what is not None and what not in done:
                    break
                if kind == "post":
                    batches[r].append(set(what))
                step[r] += 1
                moved = True
        running = {r: batches[r][head[r]] for r in programs if head[r] < len(batches[r])}
        for batch in running.values():
            done |= {msg for msg in batch
                     if sum(msg in other for other in running.values()) == 2}
        for r, batch in running.items():
            if batch <= done:
                head[r] += 1
                moved = True
    return {r: step[r] for r in programs
            if step[r] < len(programs[r]) or head[r] < len(batches[r])}


def _mailbox_programs(sched, p: int, v: int, monkeypatch) -> dict[int, list[tuple]]:
    """Each rank's program as the runner's _Mailbox posts it, driven as run_schedule drives
    it (a receive taken before its op computes, a send after), comm.exchange left out."""
    from parlib.strategies import pipeline_mail
    from parlib.strategies.schedule_check import message_order, peer_of, target_of

    sender = {(d, di): (s, si) for s, si, d, di in message_order(sched, p, v)}
    original = pipeline_mail._Mailbox._post_one
    programs: dict[int, list[tuple]] = {}

    def recorded(mail) -> None:  # each message the mailbox posts is a batch of its own
        kind, index, rank = mail.plan[mail.next]  # (the test's peer: this rank)
        msg = (rank, index) if kind == "send" else sender[rank, index]
        programs[rank].append(("post", {msg}))
        original(mail)

    with monkeypatch.context() as patch:
        patch.setattr(pipeline_mail._Mailbox, "_post_one", recorded)
        patch.setattr(pipeline_mail.comm, "exchange", lambda sends, recvs, group=None: [])
        for rank, ops in sched.items():
            programs[rank] = []
            plan = pipeline_mail.message_plan(sched, p, v, rank, lambda kind, i: rank)
            mail = pipeline_mail._Mailbox(torch.device("cpu"), (1,), plan)
            for i, op in enumerate(ops):
                if peer_of(op, rank, p, v) is not None:
                    mail.take(i, op)
                programs[rank].append(("op", sender.get((rank, i))))
                if target_of(op, rank, p, v) is not None:
                    mail.send(i, torch.zeros(3), torch.zeros(1), rank)
            mail.finish()
    return programs


def _paired_programs(sched, p: int, v: int) -> dict[int, list[tuple]]:
    """The runner's earlier posting: an op's send batched with the next op's receive (the
    receive alone, posted before the op computes, when the op sends nothing)."""
    from parlib.strategies.schedule_check import message_order, peer_of, target_of

    sender = {(d, di): (s, si) for s, si, d, di in message_order(sched, p, v)}
    programs = {}
    for rank, ops in sched.items():
        program, outbox, posted = [], set(), set()

        def post(j: int) -> None:
            recv = (j < len(ops) and j not in posted and peer_of(ops[j], rank, p, v)
                    is not None)
            if outbox or recv:
                program.append(("post", outbox | ({sender[rank, j]} if recv else set())))
                outbox.clear()
                posted.update({j} if recv else set())

        post(0)
        for i, op in enumerate(ops):
            sends = target_of(op, rank, p, v) is not None
            if not sends:
                post(i + 1)
            program.append(("op", sender.get((rank, i))))
            if sends:
                outbox.add((rank, i))
                post(i + 1)
        programs[rank] = program
    return programs


def _every_schedule() -> list[tuple[str, int, int, int]]:
    from parlib.strategies.schedules import chunks_of

    return [(name, p, m, chunks_of(name, 2)) for name in ("gpipe", "1f1b", "interleaved",
                                                          "zb-h1")
            for p in (2, 3, 4) for m in (1, p // 2 + 1, p, 2 * p, 3 * p)
            if name != "interleaved" or m % p == 0]


def test_the_runners_posting_order_never_hangs_under_nccls_order(monkeypatch):
    from parlib.strategies.schedules import all_ranks

    for name, p, m, v in _every_schedule():
        sched = all_ranks(name, p, m, v)
        assert _nccl_hangs(_mailbox_programs(sched, p, v, monkeypatch)) == {}, (name, p, m)


def test_the_replay_catches_the_earlier_posting_order_hanging_interleaved_on_two_ranks():
    from parlib.strategies.schedules import all_ranks

    hung = {(name, p, m) for name, p, m, v in _every_schedule()
            if _nccl_hangs(_paired_programs(all_ranks(name, p, m, v), p, v))}
    assert ("interleaved", 2, 4) in hung  # as it hung on gloo ranks under nccl_rules
    assert not any(name != "interleaved" for name, _, _ in hung), hung


# ---- the strategies under the rules equal one device


def _every_m(p: int) -> list[tuple[str, int, int]]:
    """Each schedule with fewer, as many and more microbatches than the p ranks (the
    interleaved order needs m a multiple of p)."""
    return [(name, m, v) for m in (max(p // 2, 1), p, 2 * p) for name, _, v in EVERY_SCHEDULE
            if v == 1 or m % p == 0]


def _schedules_under_rules():
    from tests.helpers.pipeline_ranks import schedules_on_ranks

    # a deadlock in NCCL's order raises after 20 s (the old runner's did, interleaved on 2
    # ranks, whose two neighbours are one rank) instead of waiting for the launch timeout
    with comm.nccl_rules(deadlock_after_s=20):
        return schedules_on_ranks(CFG8, _every_m(dist.get_world_size()))


@pytest.mark.parametrize("p", [2, 4])
def test_every_pipeline_schedule_under_the_rules_equals_one_device(p):
    res = parlib.launch(_schedules_under_rules, world_size=p, timeout=240)
    ref = verify.reference_step(CFG8, seed=0, batch_size=8)
    for k, (name, m, v) in enumerate(_every_m(p)):
        assert res[-1][k]["loss"] == pytest.approx(ref["loss"], rel=1e-5), (name, m)
        same = verify.compare(runs.gather_grads([r[k] for r in res]), ref["grads"])
        assert same, (name, m, v, same)


def _ring_and_experts_under_rules():
    torch.set_num_threads(1)
    with comm.nccl_rules():
        ring = {(causal, layout): _attention_vs_single(causal, layout, "ring")[0]
                for causal in (True, False) for layout in LAYOUTS}
        experts = {cf: _layer_vs_single(cf) for cf in FACTORS}
    return ring, experts


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_and_experts_under_the_rules_equal_one_device(world):
    for rank, (ring, experts) in enumerate(
            parlib.launch(_ring_and_experts_under_rules, world_size=world, timeout=240)):
        for (causal, layout), result in ring.items():  # out, dq, dk, dv: both directions
            assert result, f"rank {rank} of {world}, causal={causal}, {layout}: {result}"
        for cf, got in experts.items():
            assert got["out"] and got["grads"] and got["routing"], (rank, cf)
