"""Resharding across strategies with DCP (parlib.strategies.checkpoint), then training on.

A small GPT trained with SGD and momentum (its state, one buffer per parameter, reshards as
Adam's moments do; Adam would amplify the rounding noise of the key biases, whose gradient
is zero but for rounding). Saved by FSDP on 4 ranks after SAVE_AT steps, it loads into
tensor parallelism t = 2 times data parallelism d = 2 (the tensor-parallel groups {0, 1}
and {2, 3}: sub-groups, so a row-parallel piece must name its owners by global rank);
saved by a pipeline of p = 4 stages, it loads into p = 2. Each resumed run's next steps
equal the uninterrupted run's within ``parlib.verify``'s rule, and each rank reads the
bytes of what it holds (the weight and its momentum, 4 + 4 bytes an element), nothing else.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import verify
from parlib.model import ModelConfig, build_model, loss_fn, make_batch
from parlib.strategies.checkpoint import load_checkpoint, save_checkpoint
from parlib.strategies.data import allreduce_gradients, shard_rows
from parlib.strategies.fsdp import FSDP
from parlib.strategies.pipeline import run_schedule
from parlib.strategies.pipeline_stages import build_stage
from parlib.strategies.schedules import one_f_one_b
from parlib.strategies.tensor import TensorParallelGPT, shard_of, split_dims

STEPS, SAVE_AT, OTHER_SEED, ROWS, M = 5, 3, 77, 8, 4
CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=4)
BYTES_PER_ELEMENT = 4 + 4  # the fp32 weight and its fp32 momentum buffer


def sgd(params: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _fsdp_saving(folder: str) -> dict[str, Any]:
    """FSDP on every rank, saving after SAVE_AT steps and going on: the uninterrupted run."""
    rank, n = dist.get_rank(), dist.get_world_size()
    net = FSDP(build_model(CFG, 0))
    opt = sgd(net.parameters())
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            save_checkpoint(f"{folder}/fsdp", net, opt, extra={"step": step})
        x, y = (shard_rows(t, rank, n) for t in make_batch(ROWS, CFG, step))
        loss = loss_fn(net(x), y)
        loss.backward()
        net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / n)
    return {"losses": losses, "weights": net.gather_full_params()}


def _tensor_times_data_parallel(folder: str) -> dict[str, Any]:
    """t = 2 ({0, 1}, {2, 3}) x d = 2 ({0, 2}, {1, 3}), loaded from FSDP's checkpoint."""
    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes them all
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    net = TensorParallelGPT(build_model(CFG, OTHER_SEED), group=tp_groups[rank // 2])
    opt = sgd(net.parameters())
    stats: dict[str, int] = {}
    start = load_checkpoint(f"{folder}/fsdp", net, opt, stats=stats)["step"]
    losses = []
    for step in range(start, STEPS):
        x, y = (shard_rows(t, rank // 2, 2) for t in make_batch(ROWS, CFG, step))
        loss = loss_fn(net(x), y)
        loss.backward()
        allreduce_gradients(net, group=dp_groups[rank % 2])
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_groups[rank % 2])
        losses.append(total.item() / 2)
    return {"losses": losses, "weights": {n: p.detach() for n, p in net.named_parameters()},
            "dims": split_dims(net), "read": stats["read_bytes"],
            "held": sum(p.numel() for p in net.parameters())}


def _pipeline(folder: str, resume: bool) -> dict[str, Any]:
    """A pipeline of p = world size stages (1F1B, M microbatches): from scratch, saving after
    SAVE_AT steps, or from other weights resuming from p = 4's checkpoint."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = build_stage(CFG, seed=OTHER_SEED if resume else 0)
    opt = sgd(stage.parameters())
    start, stats, losses = 0, {"read_bytes": None}, []
    if resume:
        start = load_checkpoint(f"{folder}/pipeline", stage, opt, stats=stats)["step"]
    for step in range(start, STEPS):
        if not resume and step == SAVE_AT:
            save_checkpoint(f"{folder}/pipeline", stage, opt, extra={"step": step})
        x, y = make_batch(ROWS, CFG, step)
        losses.append(run_schedule(stage, one_f_one_b(p, M, rank), x, y, M))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "read": stats["read_bytes"],
            "weights": {stage.global_names[n]: q.detach() for n, q in stage.named_parameters()},
            "held": sum(q.numel() for q in stage.parameters())}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("across"))


def test_fsdp_on_four_resumes_as_tensor_times_data_parallel(folder):
    whole = parlib.launch(_fsdp_saving, folder, world_size=4, timeout=300)[0]
    ranks = parlib.launch(_tensor_times_data_parallel, folder, world_size=4, timeout=300)
    assert sum(d == 1 for d in ranks[0]["dims"].values()) == 2 * CFG.n_layers  # row-parallel
    for rank, res in enumerate(ranks):
        for got, want in zip(res["losses"], whole["losses"][SAVE_AT:], strict=True):
            assert verify.close(torch.tensor(got), torch.tensor(want)), (rank, got, want)
        pieces = {n: shard_of(w, res["dims"][n], rank % 2, 2)
                  for n, w in whole["weights"].items()}
        comparison = verify.compare(res["weights"], pieces)
        assert comparison, f"rank {rank}: {comparison}"
        assert res["read"] == BYTES_PER_ELEMENT * res["held"], rank


def test_a_pipeline_of_four_resumes_as_a_pipeline_of_two(folder):
    four = parlib.launch(_pipeline, folder, False, world_size=4, timeout=300)
    two = parlib.launch(_pipeline, folder, True, world_size=2, timeout=300)
    for got, want in zip(two[-1]["losses"], four[-1]["losses"][SAVE_AT:], strict=True):
        assert verify.close(torch.tensor(got), torch.tensor(want))
    full = {n: w for res in four for n, w in res["weights"].items()}
    resumed = {n: w for res in two for n, w in res["weights"].items()}
    assert resumed.keys() == full.keys()
    assert verify.compare(resumed, full)
    assert [res["read"] for res in two] == [BYTES_PER_ELEMENT * res["held"] for res in two]
