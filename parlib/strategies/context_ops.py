"""Blockwise attention and the online softmax: the arithmetic inside ring attention.

Attention of some queries over one block of keys gives a partial result, its output and the
log-sum-exp (lse) of each query's scores; :func:`merge_partials` merges two partial results
over disjoint key blocks into the result over both (the online softmax: a running max and
log-sum-exp, so nothing overflows). :func:`block_backward` gives one block's share of the
gradients from the final output and lse. No communication here:
:mod:`parlib.strategies.context` passes the blocks around.

Shapes in names (``q_BHQD``): B batch, H heads, Q query positions, K key positions,
D head size (head_dim).
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
    """(Sq, Sk) bool: key position <= query position (None: no mask)."""
    if q_pos is None or k_pos is None:
        return None
    return k_pos[None, :] <= q_pos[:, None]


def block_attention(q_BHQD: torch.Tensor, k_BHKD: torch.Tensor, v_BHKD: torch.Tensor,
                    q_pos: torch.Tensor | None = None,
                    k_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q (B, H, Q, D) on one block of keys/values (B, H, K, D):
    (out (B, H, Q, D), lse (B, H, Q)), lse the log-sum-exp of each row's scores.

    With positions, key j is visible to query i when k_pos[j] <= q_pos[i] (causal); a row
    that sees nothing in this block gets out 0 and lse -inf."""
    scores_BHQK = q_BHQD @ k_BHKD.transpose(-2, -1) / math.sqrt(q_BHQD.shape[-1])
    allowed_QK = visible_mask(q_pos, k_pos)
    if allowed_QK is not None:
        scores_BHQK = scores_BHQK.masked_fill(~allowed_QK, float("-inf"))
    lse_BHQ = torch.logsumexp(scores_BHQK, dim=-1)  # -inf for an all-masked row
    finite_BHQ = lse_BHQ.clamp_min(torch.finfo(lse_BHQ.dtype).min)  # exp(-inf - -inf): nan
    probs_BHQK = torch.exp(scores_BHQK - finite_BHQ[..., None])
    return probs_BHQK @ v_BHKD, lse_BHQ


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results of the same queries over disjoint key blocks -> the result over
    both (the online softmax). out (B, H, Q, D), lse (B, H, Q).

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


def block_backward(q_BHQD: torch.Tensor, k_BHKD: torch.Tensor, v_BHKD: torch.Tensor,
                   d_out_BHQD: torch.Tensor, out_BHQD: torch.Tensor, lse_BHQ: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block from the final (out, lse): P = exp(S - lse),
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * out)), dQ = dS K / sqrt(head_dim),
    dK = dS^T Q / sqrt(head_dim). ``causal``: q and k are the same positions (a diagonal
    chunk pair)."""
    if _fused_for(q_BHQD):
        return _FUSED_BACKWARD(d_out_BHQD, q_BHQD, k_BHKD, v_BHKD, out_BHQD, lse_BHQ, 0.0,
                               causal)
    scale = 1 / math.sqrt(q_BHQD.shape[-1])
    probs_BHQK = torch.exp(q_BHQD @ k_BHKD.transpose(-2, -1) * scale - lse_BHQ[..., None])
    if causal:
        probs_BHQK = torch.tril(probs_BHQK)
    dv_BHKD = probs_BHQK.transpose(-2, -1) @ d_out_BHQD
    delta_BHQ1 = (d_out_BHQD * out_BHQD).sum(-1, keepdim=True)
    ds_BHQK = probs_BHQK * (d_out_BHQD @ v_BHKD.transpose(-2, -1) - delta_BHQ1)
    return ds_BHQK @ k_BHKD * scale, ds_BHQK.transpose(-2, -1) @ q_BHQD * scale, dv_BHKD


def chunk_attention(q_BHQD: torch.Tensor, k_BHKD: torch.Tensor, v_BHKD: torch.Tensor,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one chunk pair: all keys visible, or (``causal``) the diagonal pair."""
    if _fused_for(q_BHQD):
        return _FUSED(q_BHQD, k_BHKD, v_BHKD, 0.0, causal)
    pos = torch.arange(q_BHQD.shape[-2], device=q_BHQD.device) if causal else None
    return block_attention(q_BHQD, k_BHKD, v_BHKD, pos, pos)


__all__ = ["block_attention", "block_backward", "chunk_attention", "merge_partials",
           "visible_mask"]
