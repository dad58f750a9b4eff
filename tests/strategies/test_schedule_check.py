"""The schedule validator: each kind of bad schedule gets its own error, named at its op;
every accepted schedule runs to its end on real ranks and trains like one device."""

from __future__ import annotations

import random

import pytest

import parlib
from parlib import verify
from parlib.model import ModelConfig
from parlib.strategies.schedule_check import ScheduleError, messages, validate
from parlib.strategies.schedules import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    B,
    F,
    Op,
    W,
    all_ranks,
    chunks_of,
    peaks,
)


def rejects(sched, p, m, v=1, **kw) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(sched, p, m, v, **kw)
    return info.value


@pytest.mark.parametrize("name", SCHEDULES[1:])
@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (4, 4), (4, 8), (3, 6)])
def test_built_in_schedules_pass(name, p, m):
    v = chunks_of(name, 2)
    validate(all_ranks(name, p, m, v), p, m, v)
    validate(all_ranks("naive", p, 1), p, 1)


def test_deadlock_names_the_waiting_op_and_whom_it_waits_for():
    # rank 0 waits for B0's gradient, which rank 1 sends only after F1, which it receives
    # from rank 0's F1, which comes after B0
    sched = {0: [F(0), B(0), F(1), B(1)], 1: [F(0), F(1), B(0), B(1)]}
    err = rejects(sched, 2, 2)
    assert (err.problem, err.rank, err.index, err.op) == ("deadlock", 0, 1, B(0))
    assert str(err).startswith("deadlock: rank 0 waits at op 1 (B0) for the gradient rank 1 "
                               "sends at its op 2 (B0), but rank 1 waits at op 1 (F1) for the "
                               "activation rank 0 sends at its op 2 (F1)")


def test_deadlock_across_three_ranks_names_the_loop():
    ok = all_ranks("1f1b", 3, 3)
    validate(ok, 3, 3)
    # rank 2 runs all forwards first, but rank 1 sends F1 only after B0's gradient, which
    # rank 2 sends after F2; rank 0 waits behind them
    sched = {**ok, 1: [F(0), B(0), F(1), B(1), F(2), B(2)], 2: all_ranks("gpipe", 3, 3)[2]}
    err = rejects(sched, 3, 3)
    assert (err.problem, err.rank, err.index, err.op) == ("deadlock", 1, 1, B(0))
    assert str(err) == (
        "deadlock: rank 1 waits at op 1 (B0) for the gradient rank 2 sends at its op 5 (B0), "
        "but rank 2 waits at op 1 (F1) for the activation rank 1 sends at its op 2 (F1): no "
        "rank can go on (rank 0 waits behind them)")


def test_gradient_before_its_forward():
    sched = {0: [F(0), F(1), B(0), B(1)], 1: [F(0), B(1), F(1), B(0)]}
    err = rejects(sched, 2, 2)
    assert (err.problem, err.rank, err.index, err.op) == ("order", 1, 1, B(1))
    assert str(err).startswith("rank 1, op 1 (B1): its forward F1 has not run on this rank")


def test_weight_gradient_before_its_backward():
    sched = {0: [F(0), B(0), W(0)], 1: [F(0), W(0), B(0)]}
    err = rejects(sched, 2, 1)
    assert (err.problem, err.rank, err.index, err.op) == ("order", 1, 1, W(0))
    assert str(err).startswith("rank 1, op 1 (W0): its backward B0 has not run")


def test_skipped_backward():
    sched = all_ranks("1f1b", 2, 3)
    sched[1] = [op for op in sched[1] if op != B(2)]
    err = rejects(sched, 2, 3)
    assert (err.problem, err.rank, err.index, err.op) == ("missing", 1, None, B(2))
    assert str(err).startswith("rank 1: B2 never runs")


def test_skipped_weight_gradient():
    sched = all_ranks("zb-h1", 2, 2)
    sched[0] = [op for op in sched[0] if op != W(1)]
    err = rejects(sched, 2, 2)
    assert (err.problem, err.rank, err.op) == ("missing", 0, W(1))


def test_repeated_forward():
    sched = all_ranks("gpipe", 2, 2)
    sched[0] = [F(0), F(1), F(1), B(1), B(0)]
    err = rejects(sched, 2, 2)
    assert (err.problem, err.rank, err.index, err.op) == ("repeated", 0, 2, F(1))


def test_max_in_flight_rejects_gpipe_at_its_first_forward_over_the_limit():
    p, m = 4, 8
    limit = {r: p - r for r in range(p)}  # 1F1B's peak on each rank
    validate(all_ranks("1f1b", p, m), p, m, max_in_flight=limit)
    err = rejects(all_ranks("gpipe", p, m), p, m, max_in_flight=limit)
    assert (err.problem, err.rank, err.index, err.op) == ("memory", 0, 4, F(4))
    assert "holds 5 microbatches" in str(err) and "max_in_flight=4" in str(err)
    validate(all_ranks("gpipe", p, m), p, m, max_in_flight=m)  # GPipe's own peak
    assert rejects(all_ranks("gpipe", p, m), p, m, max_in_flight=m - 1).problem == "memory"


def test_split_schedule_holds_activations_until_w():
    sched = {0: [F(0), B(0), F(1), B(1), W(0), W(1)]}
    assert peaks(sched) == {0: 2}  # F0 is held until W0, after F1
    err = rejects(sched, 1, 2, max_in_flight=1)
    assert (err.problem, err.index, err.op) == ("memory", 2, F(1))
    validate({0: [F(0), B(0), W(0), F(1), B(1), W(1)]}, 1, 2, max_in_flight=1)


def test_mix_of_split_and_unsplit_ranks():
    sched = {0: [F(0), B(0), W(0)], 1: [F(0), B(0)]}
    err = rejects(sched, 2, 1)
    assert (err.problem, err.rank, err.index, err.op) == ("shape", 1, 0, F(0))
    assert "rank 1 has no W ops but rank 0 has" in str(err)


@pytest.mark.parametrize("bad,what", [
    (F(4), "microbatch 4 is not one of 0..3"),
    (F(-1), "microbatch -1"),
    (F(0, 1), "chunk 1 is not one of 0..0 (v=1"),
    (Op("sideways", 0), "unknown kind 'sideways'"),
])
def test_bad_kind_microbatch_or_chunk(bad, what):
    sched = all_ranks("gpipe", 2, 4)
    sched[1] = [bad, *sched[1]]
    err = rejects(sched, 2, 4)
    assert (err.problem, err.rank, err.index, err.op) == ("unknown", 1, 0, bad)
    assert what in str(err)


def test_not_an_op():
    err = rejects({0: [F(0), "B0"]}, 1, 1)
    assert (err.problem, err.index) == ("unknown", 1)


def test_missing_or_extra_rank():
    sched = all_ranks("gpipe", 2, 2)
    assert rejects({0: sched[0]}, 2, 2).problem == "shape"
    err = rejects({**sched, 2: sched[1]}, 2, 2)
    assert err.problem == "shape" and "rank 2 is not one of the 2 ranks" in str(err)


def test_neighbours_in_different_microbatch_orders():
    # each rank's list is fine alone; together rank 1's F1 would receive microbatch 0
    sched = {0: [F(0), F(1), B(0), B(1)], 1: [F(1), F(0), B(1), B(0)]}
    err = rejects(sched, 2, 2)
    assert (err.problem, err.rank, err.index, err.op) == ("order", 1, 0, F(1))
    assert "the next message rank 0 sends it is the activation for F0 (sent at its op 0, F0)" \
        in str(err)


def test_interleaved_chunks_travel_around_the_ring():
    # p = 2, v = 2: rank 0's chunk 1 receives from rank 1's chunk 0
    good = {0: [F(0), F(0, 1), B(0, 1), B(0)], 1: [F(0), F(0, 1), B(0, 1), B(0)]}
    validate(good, 2, 1, 2)
    bad = {0: [F(0, 1), F(0), B(0, 1), B(0)], 1: [F(0), F(0, 1), B(0, 1), B(0)]}
    err = rejects(bad, 2, 1, 2)
    assert (err.problem, err.rank, err.op) == ("deadlock", 0, F(0, 1))


def test_interleaving_sends_v_times_the_messages():
    p, m = 4, 8
    one = messages(all_ranks("1f1b", p, m), p)
    two = messages(all_ranks("interleaved", p, m, 2), p, 2)
    assert one == {0: m, 1: 2 * m, 2: 2 * m, 3: m}  # the ends send one way only
    # one activation and one gradient per microbatch across each of the p*v - 1 boundaries
    # between virtual stages, against p - 1 boundaries with one chunk per rank
    assert sum(one.values()) == 2 * m * (p - 1)
    assert sum(two.values()) == 2 * m * (p * 2 - 1)
    assert two == {r: 4 * m - (m if r in (0, p - 1) else 0) for r in range(p)}


# ----------------------------------------------------------------- accepted => runs

CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)


def _random_schedule(rng: random.Random, p: int, m: int, split: bool) -> dict[int, list[Op]]:
    """Each rank: forwards and backwards in microbatch order (so neighbours agree on the
    order), interleaved at random; Ws at random after their B."""
    sched = {}
    for r in range(p):
        fs, bs, ws, ops = 0, 0, [], []
        while len(ops) < m * (3 if split else 2):
            choices = []
            if fs < m:
                choices.append("F")
            if bs < fs:
                choices.append("B")
            if ws:
                choices.append("W")
            pick = rng.choice(choices)
            if pick == "F":
                ops.append(F(fs))
                fs += 1
            elif pick == "B":
                ops.append(B(bs))
                if split:
                    ws.append(bs)
                bs += 1
            else:
                ops.append(W(ws.pop(rng.randrange(len(ws)))))
        sched[r] = ops
    return sched


def _accepted(rng: random.Random, p: int, m: int, split: bool, want: int) -> list[dict]:
    found, rejected = [], 0
    while len(found) < want:
        sched = _random_schedule(rng, p, m, split)
        try:
            validate(sched, p, m)
        except ScheduleError as err:
            assert err.problem == "deadlock"  # orders agree, so nothing else can be wrong
            rejected += 1
            continue
        found.append(sched)
    assert rejected  # the random orders include deadlocks: the check does reject some
    return found


def test_every_accepted_schedule_runs_to_the_end_on_ranks():
    from tests.helpers.pipeline_ranks import schedules_on_ranks

    rng = random.Random(4)
    p, m = 3, 3
    scheds = _accepted(rng, p, m, False, 2) + _accepted(rng, p, m, True, 2)
    scheds.append({0: [F(0), F(1), F(0, 1), F(1, 1), B(0, 1), B(1, 1), B(0), B(1)],
                   1: [F(0), F(1), F(0, 1), F(1, 1), B(0, 1), B(1, 1), B(0), B(1)],
                   2: [F(0), F(1), F(0, 1), B(0, 1), F(1, 1), B(1, 1), B(0), B(1)]})
    # interleaved with a split backward: each B followed by its W
    split_chunks = {r: [x for op in ops for x in ([op, W(op.mb, op.chunk)]
                                                  if op.kind == BACKWARD else [op])]
                    for r, ops in all_ranks("interleaved", p, m, 2).items()}
    runs = ([(s, m, 1) for s in scheds[:-1]] + [(scheds[-1], 2, 2)]
            + [(split_chunks, m, 2)])
    validate(scheds[-1], p, 2, 2)
    validate(split_chunks, p, m, 2)
    cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=6)
    res = parlib.launch(schedules_on_ranks, cfg, runs, 6, world_size=p, timeout=90)
    ref = verify.reference_step(cfg, seed=0, batch_size=6)
    for k, (sched, _, _) in enumerate(runs):
        got = {}
        for r in res:
            got.update(r[k]["grads"])
        assert res[-1][k]["loss"] == pytest.approx(ref["loss"], rel=1e-5), sched
        same = verify.compare(got, ref["grads"])
        assert same, (sched, same)
        assert sorted(got) == sorted(ref["grads"])


def test_forward_before_backward_holds_for_every_rank_in_random_schedules():
    # the generator itself: every op once, forwards before their backwards
    rng = random.Random(0)
    for split in (False, True):
        sched = _random_schedule(rng, 2, 3, split)
        for ops in sched.values():
            assert len(set(ops)) == len(ops) == 3 * (3 if split else 2)
            assert all(ops.index(F(op.mb)) < i for i, op in enumerate(ops)
                       if op.kind != FORWARD)


def test_validator_is_pure_python():
    import subprocess
    import sys

    code = ("import sys, parlib.strategies.schedule_check; "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]
