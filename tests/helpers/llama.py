"""A tiny Llama and a tiny Qwen3-MoE from Hugging Face ``transformers`` (random weights,
nothing downloaded) and their single-device run: the models the strategies were not written
for (tests/strategies/test_on_transformers*.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 8, 2, 0.1
SEED = 0
EXPERTS = 8  # in every layer of the Qwen3-MoE


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    args = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                max_position_embeddings=SEQ, use_cache=False, attn_implementation="eager")
    return LlamaConfig(**{**args, **overrides})


def tiny_llama(seed: int = SEED, **overrides: Any) -> torch.nn.Module:
    """``LlamaForCausalLM`` of :func:`llama_config`, weights drawn from ``seed``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides))


def tiny_qwen_moe(seed: int = SEED) -> torch.nn.Module:
    """``Qwen3MoeForCausalLM``, tiny: every layer a mixture of EXPERTS experts, top 2, its
    routing parlib's (softmax, top k, weights not renormalised: ``norm_topk_prob=False``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_experts=EXPERTS,
        num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="eager"))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: tokens and next-token targets, (BATCH, SEQ) each."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(VOCAB, (BATCH, SEQ), generator=g)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: (b, s, vocab), (b, s) -> ()."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def reference(steps: int = STEPS, build: Callable[..., torch.nn.Module] = tiny_llama,
              **overrides: Any) -> dict[str, torch.Tensor]:
    """One device, the whole batch, SGD: each step's loss and every gradient, by name, of
    the model ``build(**overrides)`` (the Llama unless told)."""
    model = build(**overrides)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, torch.Tensor] = {}
    for step in range(steps):
        tokens, targets = batch(step)
        loss = loss_of(model(tokens).logits, targets)
        loss.backward()
        out[f"step {step} loss"] = loss.detach()
        for name, p in model.named_parameters():
            out[f"step {step} grad {name}"] = p.grad.detach().clone()
        opt.step()
        opt.zero_grad()
    return out


def llama_tensor_plan(model: torch.nn.Module) -> dict[str, str]:
    """Megatron's split of every decoder layer, by module name: q, k, v and the MLP's gate
    and up by columns, o and down by rows (for ``tensor_parallel_modules``)."""
    plan = {}
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.self_attn.{name}"] = "column"
        plan[f"{layer}.self_attn.o_proj"] = "row"
        plan[f"{layer}.mlp.gate_proj"] = plan[f"{layer}.mlp.up_proj"] = "column"
        plan[f"{layer}.mlp.down_proj"] = "row"
    return plan


class DecoderLayer(torch.nn.Module):
    """One Llama decoder layer as a pipeline stage runs it: hidden states in, hidden states
    out. The positions' rotation (cos, sin) and the causal mask, which ``LlamaModel``
    computes once for all its layers, are computed here from the hidden states' length."""

    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        positions = torch.arange(seq, device=x.device)[None]  # (1, s)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        mask = torch.zeros(seq, seq, dtype=x.dtype, device=x.device).masked_fill(
            future, torch.finfo(x.dtype).min)[None, None]  # (1, 1, s, s): 0 or -inf
        out = self.layer(x, attention_mask=mask,
                         position_embeddings=self.rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out  # transformers 4 returned a tuple
