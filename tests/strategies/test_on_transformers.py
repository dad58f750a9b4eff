"""The strategies on a model they were not written for: a Llama from Hugging Face
``transformers`` (tiny config, random weights, nothing downloaded; skipped if transformers is
not installed).

Each run trains the same seeded ``LlamaForCausalLM`` for a few SGD steps and is held against
one device on the whole batch (tests/helpers/llama.py): every step's loss and every gradient,
by :func:`parlib.verify.compare` (the course's one tolerance), on 2 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import verify
from parlib.comm import all_gather
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP
from parlib.strategies.pipeline import Stage, partition, run_schedule
from parlib.strategies.schedules import schedule
from parlib.strategies.sharded import Zero2
from parlib.strategies.tensor import local_shards, tensor_parallel_modules
from tests.helpers.llama import (
    LR,
    SEQ,
    STEPS,
    DecoderLayer,
    batch,
    llama_tensor_plan,
    loss_of,
    reference,
    tiny_llama,
)
from tests.helpers.readme import run_readme_blocks

pytest.importorskip("transformers")


def _gathered(shard: torch.Tensor, numel: int) -> torch.Tensor:
    """Every rank's piece of a flat tensor, side by side, the padding cut off."""
    out = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    all_gather(out, shard.detach().contiguous())
    return out[:numel]


def _fsdp_grads(fsdp: FSDP) -> dict[str, torch.Tensor]:
    """The full gradient of every parameter, by the unwrapped model's names."""
    out = {}
    for unit in fsdp.units:
        prefix = next(n for n, m in fsdp.module.named_modules() if m is unit.module)
        for name, shard, shape, numel in zip(unit.names, unit.shards, unit.shapes, unit.numels):
            out[f"{prefix}.{name}" if prefix else name] = _gathered(shard.grad, numel).view(shape)
    return out


def _zero2_grads(zero2: Zero2, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for shard in zero2.shards:
        flat = _gathered(shard.tensor.grad, shard.padded)
        for p, piece in zip(shard.params, flat.split([p.numel() for p in shard.params])):
            out[names[id(p)]] = piece[: p.numel()].view_as(p)
    return out


def _train(strategy: str) -> dict[str, torch.Tensor]:
    """This rank's rows of each batch; the loss averaged over ranks, every full gradient."""
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(seed=rank)  # different on every rank: the strategy broadcasts rank 0's
    if strategy.startswith("fsdp"):
        wrapped = FSDP(model, units=[f"model.layers.{i}" for i in range(len(model.model.layers))],
                       prefetch="prefetch" in strategy, recompute="recompute" in strategy)
        opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    else:
        wrapped = model
        opt = Zero2(model, torch.optim.SGD, units=["model.layers.0", "model.layers.1"], lr=LR)
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        tokens, targets = (shard_rows(t, rank, n) for t in batch(step))
        loss = loss_of(wrapped(tokens).logits, targets)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out[f"step {step} loss"] = mean / n
        if strategy.startswith("fsdp"):
            wrapped.finish_gradient_synchronization()
            grads = _fsdp_grads(wrapped)
        else:
            opt.finish_gradient_synchronization()
            grads = _zero2_grads(opt, model)
        out.update({f"step {step} grad {name}": g for name, g in grads.items()})
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_sharded_llama_equals_one_device(strategy, world_size):
    _held_to_one_device(strategy, world_size)


@pytest.mark.parametrize("strategy", ["fsdp prefetch", "fsdp recompute"])
def test_fsdp_options_on_llama_equal_one_device(strategy):
    _held_to_one_device(strategy, 2)


def _held_to_one_device(strategy: str, world_size: int) -> None:
    want = reference()
    for rank, got in enumerate(parlib.launch(_train, strategy, world_size=world_size,
                                             timeout=300)):
        assert set(got) == set(want)  # the loss and every gradient of every step
        verdict = verify.compare(got, want)
        assert verdict.ok, f"{strategy}, rank {rank} of {world_size}: {verdict}"


def _tensor_parallel(overrides: dict) -> tuple[dict, dict]:
    """The whole batch on every rank; this rank's piece of every reference gradient."""
    torch.set_num_threads(1)
    model = tiny_llama(**overrides)  # the same seed on every rank: the copy cuts its slice
    tp = tensor_parallel_modules(model, llama_tensor_plan(model))
    opt = torch.optim.SGD(tp.parameters(), lr=LR)
    want_all = reference(**overrides)
    got, want = {}, {}
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = loss_of(tp(tokens).logits, targets)
        loss.backward()
        got[f"step {step} loss"] = loss.detach()
        want[f"step {step} loss"] = want_all[f"step {step} loss"]
        full = {n: want_all[f"step {step} grad {n}"] for n, _ in model.named_parameters()}
        for name, piece in local_shards(tp, full).items():
            got[f"step {step} grad {name}"] = dict(tp.named_parameters())[name].grad.clone()
            want[f"step {step} grad {name}"] = piece
        opt.step()
        opt.zero_grad()
    return got, want


# t must divide the key/value heads: 2 of them (grouped-query attention) for t = 2, 4 for t = 4
TP_CASES = [(2, {}), (4, {"num_key_value_heads": 4})]


@pytest.mark.parametrize("t,overrides", TP_CASES, ids=["t=2 gqa", "t=4"])
def test_tensor_parallel_llama_equals_one_device(t, overrides):
    n_params = len(dict(tiny_llama().named_parameters()))
    for rank, (got, want) in enumerate(parlib.launch(_tensor_parallel, overrides,
                                                     world_size=t, timeout=300)):
        assert sum(k.startswith("step 0 grad ") for k in got) == n_params
        verdict = verify.compare(got, want)
        assert verdict.ok, f"tensor parallelism, rank {rank} of {t}: {verdict}"


def test_tensor_plan_refuses_what_it_cannot_split():
    model = tiny_llama()
    with pytest.raises(ValueError, match="'model.norm' \\(LlamaRMSNorm\\)"):
        tensor_parallel_modules(model, {"model.norm": "column"})
    with pytest.raises(ValueError, match="no such module"):
        tensor_parallel_modules(model, {"model.layers.0.attn.q": "column"})
    with pytest.raises(ValueError, match="\"column\" or \"row\""):
        tensor_parallel_modules(model, {"model.layers.0.self_attn.q_proj": "colwise"})


def _pipeline(name: str, overrides: dict) -> dict[str, torch.Tensor]:
    """This rank's stage of the Llama: the embedding first, its decoder layers, the final
    norm and the head last; each step's loss (last rank) and gradients, by full names."""
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(**overrides)  # every rank builds it whole and keeps its layers
    mine = partition(len(model.model.layers), p)[rank]
    stage = Stage.from_modules(
        model.model.embed_tokens if rank == 0 else None,
        [DecoderLayer(model.model.layers[i], model.model.rotary_emb) for i in mine],
        torch.nn.Sequential(model.model.norm, model.lm_head) if rank == p - 1 else None,
        row_shape=(SEQ, model.config.hidden_size), names_from=model)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = run_schedule(stage, schedule(name, p, MICROBATCHES, rank), tokens, targets,
                            MICROBATCHES)
        if loss is not None:
            out[f"step {step} loss"] = torch.tensor(loss)
        out.update({f"step {step} grad {n}": g for n, g in stage.grads().items()})
        opt.step()
        opt.zero_grad()
    return out


MICROBATCHES = 4
# p = 4 stages need 4 decoder layers
PIPELINE_CASES = [(name, p) for name in ("1f1b", "zb-h1") for p in (2, 4)]


@pytest.mark.parametrize("name,p", PIPELINE_CASES)
def test_pipelined_llama_equals_one_device(name, p):
    overrides = {"num_hidden_layers": p}
    want = reference(**overrides)
    got: dict[str, torch.Tensor] = {}
    for part in parlib.launch(_pipeline, name, overrides, world_size=p, timeout=300):
        assert not set(part) & set(got)  # each parameter on one stage, the loss on the last
        got.update(part)
    assert set(got) == set(want)  # the loss and every gradient of every step
    verdict = verify.compare(got, want)
    assert verdict.ok, f"{name} on {p} ranks: {verdict}"


def _one_rank_passes_first() -> str:
    model = tiny_llama()
    try:  # rank 1 of 2 is not the first stage
        Stage.from_modules(model.model.embed_tokens, [], None, row_shape=(SEQ, 32))
    except ValueError as err:
        return str(err)
    return "accepted"


def test_stage_refuses_an_embedding_on_a_middle_rank():
    said = parlib.launch(_one_rank_passes_first, world_size=2)
    assert said[0] == "accepted"
    assert "first= goes to the pipeline's first rank (rank 0) only; pass None here" in said[1]


def test_readme_example_runs_as_written(monkeypatch):
    example, (launches,) = run_readme_blocks(monkeypatch, "Use it on your own model", 1)
    sharded, tensor_parallel = launches
    model = example["llama"]()  # the one-device loss of the same weights on the whole batch
    want = loss_of(model(example["tokens"]).logits, example["targets"]).item()
    assert verify.close(torch.tensor(sum(sharded) / 2), torch.tensor(want)), (sharded, want)
    assert all(verify.close(torch.tensor(got), torch.tensor(want)) for got in tensor_parallel)
