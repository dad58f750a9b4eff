"""Blockwise attention and the online softmax: the arithmetic inside ring attention.

Attention of some queries over one block of keys gives a partial result, its output and the
log-sum-exp (lse) of each query's scores; :func:`merge_partials` merges two partial results
over disjoint key blocks into the result over both (the online softmax: a running max and
log-sum-exp, so nothing overflows). :func:`block_backward` gives one block's share of the
gradients from the final output and lse. Tensors are (b, heads, s, head_dim), lse (b, heads,
s). No communication here: :mod:`parlib.strategies.context` passes the blocks around.
"""

from __future__ import annotations

import math

import torch

# The CPU's fused attention kernel returns the log-sum-exp the merge needs (and its backward
# takes the final out and lse): the same numbers as block_attention, without materialising
# the scores. Elsewhere (a GPU, a torch without it) the explicit formulas below run.
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                          None)


def _fused_for(q: torch.Tensor) -> bool:
    return _FUSED is not None and _FUSED_BACKWARD is not None and q.device.type == "cpu"


def visible_mask(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None) -> torch.Tensor | None:
    """(s_q, s_k) bool: key position <= query position (None: no mask)."""
    if q_pos is None or k_pos is None:
        return None
    return k_pos[None, :] <= q_pos[:, None]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    q_pos: torch.Tensor | None = None,
                    k_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q (b, a, s_q, d) on one block of keys/values (b, a, s_k, d):
    (out (b, a, s_q, d), lse (b, a, s_q)), lse the log-sum-exp of each row's scores.

    With positions, key j is visible to query i when k_pos[j] <= q_pos[i] (causal); a row
    that sees nothing in this block gets out 0 and lse -inf."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, a, s_q, s_k)
    allowed = visible_mask(q_pos, k_pos)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, a, s_q); -inf for an all-masked row
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(lse.dtype).min)[..., None])
    return probs @ v, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results of the same queries over disjoint key blocks -> the result over
    both (the online softmax). out (b, a, s_q, d), lse (b, a, s_q).

    Each side is normalised by its own sum exp(lse); the merged row weighs side x by
    exp(lse_x - lse), lse = log(exp(lse_a) + exp(lse_b)), computed from the running max so
    nothing overflows; a row -inf on both sides stays (0, -inf)."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # both -inf: any
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = wa + wb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / safe[..., None]
    return out, top + torch.log(total)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block from the final (out, lse): P = exp(S - lse),
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * out)), dQ = dS K / sqrt(d), dK = dS^T Q /
    sqrt(d). ``causal``: q and k are the same positions (a diagonal chunk pair)."""
    if _fused_for(q):
        return _FUSED_BACKWARD(d_out, q, k, v, out, lse, 0.0, causal)
    scale = 1 / math.sqrt(q.shape[-1])
    probs = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])  # (b, a, s_q, s_k)
    if causal:
        probs = torch.tril(probs)
    dv = probs.transpose(-2, -1) @ d_out  # (b, a, s_k, d)
    delta = (d_out * out).sum(-1, keepdim=True)  # (b, a, s_q, 1)
    ds = probs * (d_out @ v.transpose(-2, -1) - delta)  # (b, a, s_q, s_k)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one chunk pair: all keys visible, or (``causal``) the diagonal pair."""
    if _fused_for(q):
        return _FUSED(q, k, v, 0.0, causal)
    pos = torch.arange(q.shape[-2], device=q.device) if causal else None
    return block_attention(q, k, v, pos, pos)


__all__ = ["block_attention", "block_backward", "chunk_attention", "merge_partials",
           "visible_mask"]
