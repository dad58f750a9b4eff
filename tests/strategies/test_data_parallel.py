"""parlib.DataParallel and parlib.Zero1 as drop-ins, checked against one device.

Two ranks on gloo, seeded differently; a toy model with a frozen layer, a buffer, tied
weights (embedding = output head) and a branch only rank 0's rows use (so rank 1 has no
gradient for it). For every sync and for Zero1, with SGD and with AdamW (weight decay, two
parameter groups, an LR scheduler): after wrapping every rank holds rank 0's state; after
K steps on different rows per rank the parameters equal the single-device run on the whole
batch; the frozen layer is bitwise unchanged; no_sync accumulation equals the large batch.
One launch runs every case; the tests read its results.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parlib
from parlib import verify
from parlib.measure import CommLog
from parlib.strategies.data import shard_rows
from tests.helpers.toy_model import RANK0_SEED, D, K, N, Toy, global_batch, seeded_toy

CASES = [(sync, opt) for sync in ("naive", "bucketed", "overlapped", "zero1")
         for opt in ("sgd", "adamw")]


def optimizer_for(model: nn.Module, kind: str, zero1: bool):
    """SGD with momentum, or AdamW with weight decay on matrices only and a halving LR."""
    params = [p for p in model.parameters()]
    if kind == "sgd":
        cls, groups, hyper = torch.optim.SGD, params, {"lr": 0.1, "momentum": 0.9}
    else:
        cls = torch.optim.AdamW
        groups = [{"params": [p for p in params if p.ndim == 2]},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        hyper = {"lr": 1e-2, "weight_decay": 0.1}
    opt = parlib.Zero1(groups, cls, **hyper) if zero1 else cls(groups, **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    return opt, sched


def reference(kind: str, steps: int) -> dict[str, torch.Tensor]:
    """One device, the whole batch, rank 0's initial weights."""
    model = seeded_toy(RANK0_SEED)
    opt, sched = optimizer_for(model, kind, zero1=False)
    for step in range(steps):
        tokens, targets, flag = global_batch(step)
        F.cross_entropy(model(tokens, flag), targets).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return copy.deepcopy(model.state_dict())


def wrap(sync: str, kind: str, rank: int):
    model = seeded_toy(RANK0_SEED + rank)  # every rank different before wrapping
    if sync == "zero1":  # Zero1 pools the gradients; DataParallel(sync=None) copies buffers
        dp = parlib.DataParallel(model, sync=None)
        opt, sched = optimizer_for(model, kind, zero1=True)
    else:  # tiny buckets, so that there are several
        dp = parlib.DataParallel(model, sync=sync, bucket_mb=400 / 2**20, first_bucket_mb=1e-4)
        opt, sched = optimizer_for(model, kind, zero1=False)
    return model, dp, opt, sched


def train_steps(dp, opt, sched, steps, rank, micro: int = 1) -> int:
    """``steps`` steps on this rank's rows, each in ``micro`` microbatches (no_sync for all
    but the last). Returns how many collectives the calls that must do nothing issued."""
    idle = CommLog()  # records only the `with idle:` blocks
    for step in steps:
        tokens, targets, flag = (shard_rows(t, rank, N) for t in global_batch(step))
        with idle:
            dp.finish_gradient_synchronization()  # before backward
        for m in range(micro):
            rows = slice(m * len(tokens) // micro, (m + 1) * len(tokens) // micro)
            if m < micro - 1:
                with dp.no_sync():
                    loss = F.cross_entropy(dp(tokens[rows], flag[rows]), targets[rows])
                    (loss / micro).backward()
                    with idle:
                        dp.finish_gradient_synchronization()  # inside no_sync
            else:
                loss = F.cross_entropy(dp(tokens[rows], flag[rows]), targets[rows])
                (loss / micro).backward()
        dp.finish_gradient_synchronization()
        with idle:
            dp.sync()  # a second time
        opt.step()
        sched.step()
        opt.zero_grad()
    return idle.count()


def _all_cases() -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    for sync, kind in CASES:
        model, dp, opt, sched = wrap(sync, kind, rank)
        res = {"initial": copy.deepcopy(dp.state_dict())}
        frozen = model.frozen.weight.detach().clone()
        res["idle calls"] = train_steps(dp, opt, sched, range(K - 1), rank)
        saved = copy.deepcopy((dp.state_dict(), opt.state_dict(), sched.state_dict()))
        train_steps(dp, opt, sched, [K - 1], rank)
        res["final"] = copy.deepcopy(dp.state_dict())
        res["frozen_same"] = torch.equal(model.frozen.weight, frozen)
        res["tied"] = model.head.weight is model.embed.weight
        # resume from the checkpoint of step K-1 in a fresh model and optimizer
        model2, dp2, opt2, sched2 = wrap(sync, kind, rank)
        dp2.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        sched2.load_state_dict(saved[2])
        train_steps(dp2, opt2, sched2, [K - 1], rank)
        res["resumed"] = copy.deepcopy(dp2.state_dict())
        # gradient accumulation: one step in two microbatches per rank
        _, dp3, opt3, sched3 = wrap(sync, kind, rank)
        res["idle calls"] += train_steps(dp3, opt3, sched3, [0], rank, micro=2)
        res["accumulated"] = copy.deepcopy(dp3.state_dict())
        out[(sync, kind)] = res
    try:
        parlib.DataParallel(seeded_toy(0), broadcast_from=5)
    except ValueError as e:
        out["bad source"] = str(e)
    out["fp64"] = _fp64_step(rank)
    return out


def _fp64_step(rank: int) -> list[torch.Tensor]:
    p32 = nn.Parameter(torch.linspace(-1, 1, 5))
    p64 = nn.Parameter(torch.linspace(-1, 1, 7, dtype=torch.float64) / 3)
    opt = parlib.Zero1([p32, p64], torch.optim.SGD, lr=0.1)
    p32.grad = torch.full((5,), rank + 1.0) / 3
    p64.grad = torch.full((7,), rank + 1.0, dtype=torch.float64) / 3
    opt.step()
    return [p32.detach().clone(), p64.detach().clone()]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return parlib.launch(_all_cases, world_size=N, timeout=120)


@pytest.mark.parametrize("sync,kind", CASES)
def test_wrapping_gives_every_rank_the_source_ranks_state(results, sync, kind):
    want = seeded_toy(RANK0_SEED).state_dict()
    for res in results:
        got = res[(sync, kind)]["initial"]
        assert list(got) == list(want)  # the unwrapped module's keys
        assert all(torch.equal(got[k], want[k]) for k in want)  # buffers and frozen too


@pytest.mark.parametrize("sync,kind", CASES)
def test_k_steps_equal_the_single_device_run(results, sync, kind):
    want = reference(kind, K)
    for rank, res in enumerate(results):
        r = res[(sync, kind)]
        cmp = verify.compare(r["final"], want)
        assert cmp, f"{sync}/{kind} rank {rank}: {cmp}"
        assert r["frozen_same"] and torch.equal(r["final"]["frozen.weight"], want["frozen.weight"])
        assert r["tied"] and torch.equal(r["final"]["head.weight"], r["final"]["embed.weight"])
        # finishing the sync before backward, twice or inside no_sync sends nothing
        assert r["idle calls"] == 0
        # the ranks agree exactly, and a resumed checkpoint continues exactly
        assert all(torch.equal(r["final"][k], results[0][(sync, kind)]["final"][k]) for k in want)
        assert all(torch.equal(r["resumed"][k], r["final"][k]) for k in want)


@pytest.mark.parametrize("sync,kind", CASES)
def test_no_sync_accumulation_equals_the_large_batch_step(results, sync, kind):
    want = reference(kind, 1)
    for rank, res in enumerate(results):
        cmp = verify.compare(res[(sync, kind)]["accumulated"], want)
        assert cmp, f"{sync}/{kind} rank {rank}: {cmp}"


def test_zero1_steps_fp64_parameters_in_fp64(results):
    mean_grad = torch.tensor(1.5, dtype=torch.float64) / 3  # ranks send 1/3 and 2/3
    want64 = torch.linspace(-1, 1, 7, dtype=torch.float64) / 3 - 0.1 * mean_grad
    for p32, p64 in (r["fp64"] for r in results):
        assert p64.dtype == torch.float64 and p32.dtype == torch.float32
        assert torch.allclose(p64, want64, rtol=0, atol=1e-15)  # fp32 would be ~1e-8 off
        assert verify.close(p32, torch.linspace(-1, 1, 5) - 0.1 * 0.5)


def test_source_rank_outside_the_group_is_refused(results):
    assert "broadcast_from=5 is not a rank" in results[0]["bad source"]


def test_misuse_gets_a_clear_error():
    with pytest.raises(ValueError, match="unknown sync 'ring'"):
        parlib.DataParallel(Toy(), sync="ring")
    with pytest.raises(ValueError, match="no parameters"):
        parlib.DataParallel(nn.ReLU())
    split = Toy()
    split.scale = torch.empty(D, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        parlib.DataParallel(split)
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        parlib.DataParallel(Toy())
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        parlib.Zero1(Toy().parameters(), torch.optim.SGD, lr=0.1)
