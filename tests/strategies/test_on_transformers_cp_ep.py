"""Context and expert parallelism on models they were not written for, from Hugging Face
``transformers`` (tiny configs, random weights, nothing downloaded; skipped if transformers
is not installed): a Llama under ring and all-gather attention, both splits, and a
Qwen3-MoE under expert parallelism.

Each run trains the same seeded model for a few SGD steps and is held against one device on
the whole batch (tests/helpers/llama.py): every step's loss and every gradient, by
:func:`parlib.verify.compare` (the course's one tolerance), on 2 and 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

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
from tests.helpers.llama import LR, SEQ, STEPS, VOCAB, batch, loss_of, reference, tiny_llama

pytest.importorskip("transformers")


def _context_parallel(layout: str, attention: str) -> dict[str, torch.Tensor]:
    """This rank's positions of every sequence (the whole batch on every rank); the loss
    over all tokens and every gradient, averaged over the cp ranks."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    model = tiny_llama()  # the same seed on every rank
    model.set_attn_implementation(
        register_transformers_attention(f"cp_{attention}", group, layout, attention))
    positions = split_sequence(torch.arange(SEQ)[None], group, layout)  # (1, S)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        tokens, targets = (split_sequence(t, group, layout) for t in batch(step))
        loss = loss_of(model(tokens, position_ids=positions).logits, targets)
        loss.backward()
        average_gradients(model, group)
        out[f"step {step} loss"] = mean_over_group(loss, group)
        out.update({f"step {step} grad {n}": p.grad.clone()
                    for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


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

EXPERTS = 8


def tiny_qwen_moe(seed: int = 0) -> torch.nn.Module:
    """``Qwen3MoeForCausalLM``, tiny: every layer a mixture of EXPERTS experts, top 2, its
    routing parlib's (softmax, top k, weights not renormalised: ``norm_topk_prob=False``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_experts=EXPERTS,
        num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="eager"))


def moe_reference() -> dict[str, torch.Tensor]:
    """One device, the whole batch: each step's loss and every gradient, by name."""
    model = tiny_qwen_moe()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = loss_of(model(tokens).logits, targets)
        loss.backward()
        out[f"step {step} loss"] = loss.detach()
        out.update({f"step {step} grad {n}": p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


def _expert_parallel() -> tuple[dict[str, torch.Tensor], range]:
    """This rank's rows and E/P experts of every layer; the loss averaged over the ranks and
    every gradient (the experts': this rank's slice), named as on one device."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    model = tiny_qwen_moe()  # the same seed on every rank: each keeps its experts
    one_device = list(model.named_parameters())  # held, so no new tensor reuses their ids
    names = {id(p): n for n, p in one_device}  # the router's weight stays this object
    for layer in model.model.layers:
        layer.mlp = ExpertParallelMoE(layer.mlp.gate, layer.mlp.experts, group,
                                      top_k=model.config.num_experts_per_tok)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        tokens, targets = (split_rows(t, group) for t in batch(step))
        loss = loss_of(model(tokens).logits, targets)
        loss.backward()
        sync_gradients(model, group)
        out[f"step {step} loss"] = mean_over_group(loss, group)
        out.update({f"step {step} grad {names.get(id(p), n)}": p.grad.clone()
                    for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out, experts_of_rank(dist.get_rank(), dist.get_world_size(), EXPERTS)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_qwen3_moe_equals_one_device(ep):
    want = moe_reference()
    for rank, (got, mine) in enumerate(parlib.launch(_expert_parallel, world_size=ep,
                                                     timeout=300)):
        assert set(got) == set(want)  # the loss and every gradient of every step
        mine_of = {k: w[mine.start:mine.stop] if ".experts." in k else w
                   for k, w in want.items()}
        assert got["step 0 grad model.layers.0.mlp.experts.down_proj"].shape[0] == EXPERTS // ep
        verdict = verify.compare(got, mine_of)
        assert verdict.ok, f"expert parallelism, rank {rank} of {ep}: {verdict}"


# ---- the README's example, as written

def _readme_blocks() -> list[str]:
    """The python code blocks of the README's "Use it on your own model" section."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Use it on your own model", 1)[1].split("\n### ", 1)[0]
    return [part.split("```", 1)[0] for part in section.split("```python\n")[1:]]


def test_readme_context_and_expert_example_runs_as_written(monkeypatch):
    returned = []
    launch = parlib.launch

    def recording_launch(*args, **kwargs):
        returned.append(launch(*args, timeout=300, **kwargs))
        return returned[-1]

    monkeypatch.setattr(parlib, "launch", recording_launch)
    first, second = _readme_blocks()
    example: dict = {"__name__": "readme_example"}
    exec(first, example)  # the models, tokens and targets the second block continues with
    del returned[:]
    exec(second, example)
    context_parallel, expert_parallel = returned
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
