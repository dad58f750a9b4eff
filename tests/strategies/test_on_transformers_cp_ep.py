"""Context and expert parallelism on models they were not written for, from Hugging Face
``transformers`` (tiny configs, random weights, nothing downloaded; skipped if transformers
is not installed): a Llama under ring and all-gather attention, both splits, and a
Qwen3-MoE under expert parallelism.

Each run trains the same seeded model for a few SGD steps and is held against one device on
the whole batch (tests/helpers/llama.py): every step's loss and every gradient, by
:func:`parlib.verify.compare` (the course's one tolerance), on 2 and 4 ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import verify
from parlib.strategies.context import average_gradients, mean_over_group, split_sequence
from parlib.strategies.context_transformers import (
    attention_function,
    register_transformers_attention,
)
from parlib.strategies.experts import (
    ExpertParallelMoE,
    experts_of_rank,
    split_rows,
    sync_gradients,
)
from tests.helpers.llama import (
    EXPERTS,
    LR,
    SEQ,
    STEPS,
    batch,
    loss_of,
    reference,
    tiny_llama,
    tiny_qwen_moe,
)
from tests.helpers.readme import run_readme_blocks

pytest.importorskip("transformers")


def _train(model: torch.nn.Module, share: Callable[[torch.Tensor], torch.Tensor],
           sync: Callable[[torch.nn.Module], None], names: dict[int, str] | None = None,
           **forward: torch.Tensor) -> dict[str, torch.Tensor]:
    """STEPS SGD steps on this rank's ``share`` of each batch: each step's loss averaged
    over the ranks and every gradient after ``sync``, named as on one device (``names``:
    by the parameter's id, for those the strategy moved)."""
    torch.set_num_threads(1)
    names = names or {}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        tokens, targets = (share(t) for t in batch(step))
        loss = loss_of(model(tokens, **forward).logits, targets)
        loss.backward()
        sync(model)
        out[f"step {step} loss"] = mean_over_group(loss, dist.group.WORLD)
        out.update({f"step {step} grad {names.get(id(p), n)}": p.grad.clone()
                    for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


# ---- context parallelism on a Llama

def _context_parallel(layout: str, attention: str) -> dict[str, torch.Tensor]:
    """This rank's positions of every sequence (the whole batch on every rank), with their
    position_ids; the gradients averaged over the cp ranks."""
    group = dist.group.WORLD
    model = tiny_llama()  # the same seed on every rank
    model.set_attn_implementation(
        register_transformers_attention(f"cp_{attention}", group, layout, attention))
    positions = split_sequence(torch.arange(SEQ)[None], group, layout)  # (1, S)
    return _train(model, lambda t: split_sequence(t, group, layout),
                  lambda m: average_gradients(m, group), position_ids=positions)


CP_CASES = [(layout, cp, "ring") for layout in ("contiguous", "zigzag") for cp in (2, 4)]
CP_CASES += [("zigzag", 2, "all_gather")]


@pytest.mark.parametrize("layout,cp,attention", CP_CASES)
def test_context_parallel_llama_equals_one_device(layout, cp, attention):
    want = reference()
    for rank, got in enumerate(parlib.launch(_context_parallel, layout, attention,
                                             world_size=cp, timeout=300)):
        assert set(got) == set(want)  # the loss and every gradient of every step
        verdict = verify.compare(got, want)
        assert verdict.ok, f"{attention} attention, {layout}, rank {rank} of {cp}: {verdict}"


# ---- expert parallelism on Qwen3-MoE

def _expert_parallel() -> tuple[dict[str, torch.Tensor], range]:
    """This rank's rows and E/P experts of every layer; every gradient (the experts': this
    rank's slice) named as on one device, and which experts this rank holds."""
    group = dist.group.WORLD
    model = tiny_qwen_moe()  # the same seed on every rank: each keeps its experts
    one_device = list(model.named_parameters())  # held, so no new tensor reuses their ids
    for layer in model.model.layers:
        layer.mlp = ExpertParallelMoE(layer.mlp.gate, layer.mlp.experts, group,
                                      top_k=model.config.num_experts_per_tok)
    out = _train(model, lambda t: split_rows(t, group), lambda m: sync_gradients(m, group),
                 names={id(p): n for n, p in one_device})  # the gate's weight: still its own
    return out, experts_of_rank(dist.get_rank(), dist.get_world_size(), EXPERTS)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_qwen3_moe_equals_one_device(ep):
    want = reference(build=tiny_qwen_moe)
    for rank, (got, mine) in enumerate(parlib.launch(_expert_parallel, world_size=ep,
                                                     timeout=300)):
        assert set(got) == set(want)  # the loss and every gradient of every step
        mine_of = {k: w[mine.start:mine.stop] if ".experts." in k else w
                   for k, w in want.items()}
        assert got["step 0 grad model.layers.0.mlp.experts.down_proj"].shape[0] == EXPERTS // ep
        verdict = verify.compare(got, mine_of)
        assert verdict.ok, f"expert parallelism, rank {rank} of {ep}: {verdict}"


# ---- the README's example, as written

def test_readme_context_and_expert_example_runs_as_written(monkeypatch):
    example, (_, launches) = run_readme_blocks(monkeypatch, "Use it on your own model", 2)
    context_parallel, expert_parallel = launches
    tokens, targets = example["tokens"], example["targets"]
    for build, losses in (("llama", context_parallel), ("qwen_moe", expert_parallel)):
        model = example[build]()  # the one-device loss of the same weights on the whole batch
        want = loss_of(model(tokens).logits, targets).item()
        assert len(losses) == 2  # each rank's loss over its equal share of the tokens
        assert verify.close(torch.tensor(sum(losses) / 2), torch.tensor(want)), (build, losses)


# ---- what they refuse, and why

def test_context_attention_refuses_what_it_cannot_compute():
    attend = attention_function(group=None)  # the checks come before any communication
    q_BHSD = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="scales scores by 1/sqrt\\(head_dim\\)"):
        attend(None, q_BHSD, q_BHSD, q_BHSD, None, scaling=1.0)
    with pytest.raises(ValueError, match="no attention dropout; got dropout=0.1"):
        attend(None, q_BHSD, q_BHSD, q_BHSD, None, dropout=0.1)
    with pytest.raises(ValueError, match="takes the causal mask from the layout"):
        attend(None, q_BHSD, q_BHSD, q_BHSD, torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="attention must be one of"):
        attention_function(None, attention="flash")
    model = tiny_llama()  # a padding mask would be dropped silently: refused instead
    model.set_attn_implementation(register_transformers_attention("cp_refuses", None))
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    padded = torch.ones(1, SEQ, dtype=torch.long).index_fill(1, torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="cannot apply a padding attention_mask"):
        model(tokens, attention_mask=padded)


def _refusals() -> list[str]:
    group, said = dist.group.WORLD, []
    moe = tiny_qwen_moe().model.layers[0].mlp
    for router, experts in ((torch.nn.ReLU(), moe.experts),  # no weight to score with
                            (torch.nn.Linear(32, 4, bias=False), moe.experts)):  # 4 != 8
        try:
            ExpertParallelMoE(router, experts, group, top_k=2)
            said.append("accepted")
        except ValueError as err:
            said.append(str(err))
    return said


def test_expert_parallel_refuses_a_router_that_does_not_fit():
    no_weight, too_few = parlib.launch(_refusals, world_size=2, timeout=300)[0]
    assert "router must be an nn.Linear or have a weight (E, W) parameter, got ReLU" in no_weight
    assert "the router scores 4 experts; experts holds 8" in too_few
