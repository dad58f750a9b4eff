"""Context and expert parallelism on models they were not written for, from Hugging Face
``transformers`` (tiny configs, random weights, nothing downloaded; skipped if transformers
is not installed): a Llama under ring and all-gather attention, both splits, and a
Qwen3-MoE under expert parallelism.

Each run trains the same seeded model for a few SGD steps and is held against one device on
the whole batch (tests/helpers/llama.py): every step's loss and every gradient, by
:func:`parlib.verify.compare` (the course's one tolerance), on 2 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import verify
from parlib.strategies.context import average_gradients, mean_over_group, split_sequence
from parlib.strategies.context_transformers import register_transformers_attention
from tests.helpers.llama import LR, SEQ, STEPS, batch, loss_of, reference, tiny_llama

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
