"""Context parallelism on a model from Hugging Face ``transformers``: its attention function.

A transformers model calls its attention through a function looked up by name
(``config._attn_implementation`` in ``transformers.AttentionInterface``), with q (B, H, S, D)
and k, v (B, K, S, D) already projected and rotated. :func:`attention_function` is such a
function running :func:`parlib.strategies.context.ring_attention` (or the all-gather one)
over the cp group; :func:`register_transformers_attention` registers it. Everything else of
the model acts on each token alone and runs unchanged on the rank's positions, given as
``position_ids`` so that the rotation is that of each token's place in the whole sequence.

Shapes in names: B batch, H query heads, K key/value heads, S the positions this rank holds,
D head size (head_dim).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from parlib.strategies.context import ATTENTIONS


def attention_function(group: Any, layout: str = "contiguous",
                       attention: str = "ring") -> Callable[..., tuple[torch.Tensor, None]]:
    """Causal attention over ``group``'s split sequence in the signature transformers
    models call their attention with: ``fn(module, q_BHSD, k_BKSD, v_BKSD, attention_mask,
    scaling=..., dropout=...)`` -> (out (B, S, H, D), None); K key/value heads, repeated to
    H when fewer (grouped-query attention). Register it with
    :func:`register_transformers_attention`; pass each rank's ``position_ids`` (its
    positions under ``layout``, from :func:`split_sequence`) so the rotation is right."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {sorted(ATTENTIONS)}, got {attention!r}")
    attend = ATTENTIONS[attention]

    def cp_attention(module: nn.Module, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor,
                     v_BKSD: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
        head_dim = q_BHSD.shape[-1]
        if scaling is not None and abs(scaling * head_dim ** 0.5 - 1) > 1e-6:
            raise ValueError(f"context-parallel attention scales scores by 1/sqrt(head_dim) "
                             f"= {head_dim ** -0.5:.6g}; this model asks for {scaling:.6g}")
        if dropout:
            raise ValueError(f"context-parallel attention has no attention dropout; got "
                             f"dropout={dropout} (set the config's attention_dropout=0)")
        if attention_mask is not None:
            raise ValueError("context-parallel attention takes the causal mask from the "
                             "layout; got an attention_mask (register the attention with "
                             "register_transformers_attention, and pad no sequence)")
        repeat = q_BHSD.shape[1] // k_BKSD.shape[1]  # query heads per key/value head
        k_BHSD = k_BKSD.repeat_interleave(repeat, dim=1)
        v_BHSD = v_BKSD.repeat_interleave(repeat, dim=1)
        out_BHSD = attend(q_BHSD, k_BHSD, v_BHSD, group, causal=True, layout=layout)
        return out_BHSD.transpose(1, 2).contiguous(), None

    return cp_attention


def _no_mask(*args: Any, attention_mask: torch.Tensor | None = None,
             **kwargs: Any) -> None:
    """transformers' mask for context-parallel attention: none (the layout gives the causal
    mask); a padding mask would be lost, so it is refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("context-parallel attention cannot apply a padding attention_mask: "
                         "pass none (every sequence whole)")


def register_transformers_attention(name: str, group: Any, layout: str = "contiguous",
                                    attention: str = "ring") -> str:
    """Register :func:`attention_function` (and no mask) with transformers under ``name``;
    build or switch the model to it with ``model.set_attn_implementation(name)``. Returns
    ``name``. transformers is imported here only: the rest of parlib runs without it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_function(group, layout, attention))
    AttentionMaskInterface.register(name, _no_mask)
    return name


__all__ = ["attention_function", "register_transformers_attention"]
