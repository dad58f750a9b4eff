"""parlib.strategies.data (through parlib.experiments.data.setup): every data-parallel sync
gives the single-device parameters (fp32, SGD)."""

from __future__ import annotations

import pytest
import torch

import parlib
from parlib import measure, verify
from parlib.experiments import data as runs
from parlib.model import ModelConfig, build_model, count_parameters, train_step
from parlib.strategies import data as dp

CFG = ModelConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2)
B = 8
STEPS = 3


def test_shard_rows():
    x = torch.arange(8).reshape(8, 1)
    assert dp.shard_rows(x, 1, 4).flatten().tolist() == [2, 3]
    with pytest.raises(ValueError):
        dp.shard_rows(x, 0, 3)
    xs, _ = dp.local_batch(8, CFG, step=2, rank=3, world_size=4)
    assert xs.shape == (2, CFG.seq_len)


def test_make_buckets_reverse_order_and_cap():
    params = [torch.zeros(100), torch.zeros(300), torch.zeros(50), torch.zeros(10)]
    buckets = dp.make_buckets(params, bucket_bytes=1000)  # 250 floats
    assert [[p.numel() for p in b] for b in buckets] == [[10, 50], [300], [100]]
    assert sum(len(b) for b in buckets) == len(params)
    # DDP-style: a small first bucket, then big ones
    first = dp.make_buckets(params, bucket_bytes=10_000, first_bucket_bytes=100)
    assert [[p.numel() for p in b] for b in first] == [[10], [50, 300, 100]]


def _strategies(kinds, optimizer="sgd", lr=0.1, bucket_mb=0.01):
    """On each rank: STEPS steps of each strategy; parameters and comm counts back."""
    out = {}
    for kind in kinds:
        model, opt, sync = runs.setup(kind, CFG, optimizer=optimizer, lr=lr, bucket_mb=bucket_mb)
        with measure.CommLog() as log:
            for step in range(STEPS):
                x, y = dp.local_batch(B, CFG, step, device=parlib.device())
                train_step(model, opt, x, y, sync)
        out[kind] = (
            [p.detach().cpu().clone() for p in model.parameters()],
            log.count(),
            sorted({r.op for r in log.records}),
        )
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_every_strategy_matches_single_device(n):
    kinds = ("naive", "bucketed", "overlapped", "ddp", "zero1")
    ref = verify.reference_params(CFG, steps=STEPS, global_batch=B)
    n_tensors = len(ref)
    for rank, res in enumerate(parlib.launch(_strategies, kinds, world_size=n)):
        for kind in kinds:
            params, calls, ops = res[kind]
            verdict = verify.compare(params, ref)
            assert verdict.ok, f"{kind} on rank {rank} of {n}: {verdict}"
        assert res["naive"][1] == STEPS * n_tensors  # one all-reduce per tensor per step
        assert 1 < res["bucketed"][1] / STEPS < n_tensors  # a few buckets (10 KiB cap)
        assert res["overlapped"][1] == res["bucketed"][1]
        assert res["zero1"][2] == ["all_gather", "reduce_scatter"]
        assert res["ddp"][1] == 0  # DDP's reducer is C++: invisible to the Python log


def _naive_without_average():
    model, opt, _ = runs.setup("single", CFG)
    for step in range(STEPS):
        x, y = dp.local_batch(B, CFG, step)
        train_step(model, opt, x, y, lambda: dp.allreduce_gradients(model, average=False))
    return [p.detach().clone() for p in model.parameters()]


def test_forgetting_to_average_is_caught():
    ref = verify.reference_params(CFG, steps=STEPS, global_batch=B)
    res = parlib.launch(_naive_without_average, world_size=2)
    assert not verify.compare(res[0], ref).ok


def _adam_zero1_memory():
    out = {}
    for kind in ("naive", "zero1"):
        model, opt, sync = runs.setup(kind, CFG, optimizer="adam", lr=1e-3)
        x, y = dp.local_batch(B, CFG, 0)
        rep = measure.memory_breakdown(model, opt, lambda: train_step(model, opt, x, y, sync))
        out[kind] = rep.as_dict()
    out["params_equal"] = True
    return out


def test_zero1_shards_adam_state():
    n = 2
    p = count_parameters(build_model(CFG))
    res = parlib.launch(_adam_zero1_memory, world_size=n)[0]
    n_tensors = len(list(build_model(CFG).parameters()))
    assert 8 * p <= res["naive"]["optimizer"] <= 8 * p + 8 * n_tensors
    # ZeRO-1: two moments for this rank's ceil(P/N) elements, plus one step counter
    shard = -(-p // n)
    assert 8 * shard <= res["zero1"]["optimizer"] <= 8 * shard + 8
    assert res["zero1"]["params"] == res["naive"]["params"] == 4 * p


def _overlap_launches_during_backward():
    model = build_model(CFG)
    sync = dp.Overlapped(model, bucket_mb=0.01, first_bucket_mb=None)
    x, y = dp.local_batch(B, CFG, 0)
    from parlib.model import loss_fn

    loss_fn(model(x), y).backward()
    launched = sync._next  # buckets whose all-reduce started inside backward
    sync.wait()
    sync.remove()
    return launched, len(sync.buckets)


def test_overlapped_starts_all_reduce_inside_backward():
    launched, total = parlib.launch(_overlap_launches_during_backward, world_size=2)[0]
    assert total > 1 and launched == total


def _unused_parameter():
    model = build_model(CFG)
    extra = torch.nn.Parameter(torch.ones(3))  # never used in forward
    params = list(model.parameters()) + [extra]
    sync = dp.Overlapped(params, bucket_mb=0.01, first_bucket_mb=None)
    x, y = dp.local_batch(B, CFG, 0)
    from parlib.model import loss_fn

    loss_fn(model(x), y).backward()
    sync.wait()  # must not hang: the bucket with the unused parameter is launched here
    return extra.grad.tolist()


def test_overlapped_handles_unused_parameter():
    assert parlib.launch(_unused_parameter, world_size=2, timeout=20)[0] == [0.0, 0.0, 0.0]


def test_setup_rejects_unknown_names():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        runs.setup("zero1", CFG, optimizer="adamw", device="cpu")
    with pytest.raises(ValueError, match="kind must be one of"):
        runs.setup("fsdp", CFG, device="cpu")
    with pytest.raises(ValueError, match="unknown gradient sync 'ring'"):
        dp.gradient_sync("ring", build_model(CFG))
