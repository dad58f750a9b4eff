"""Context parallelism: the sequence split over cp ranks, attention by ring or all-gather.

Every layer but attention acts on each token alone, so a rank holding s/cp positions runs
them unchanged. Attention needs every key and value; two ways to get them:

- :func:`all_gather_attention`: all-gather K and V (their gradients reduce-scatter back),
  then ordinary attention of the local queries against the whole sequence. Simple; every
  rank holds all of K and V.
- :func:`ring_attention`: each rank keeps its queries and passes K/V blocks around the
  ring (a send to the next rank and a receive from the previous, posted together as one
  ``dist.batch_isend_irecv``, the next block's transfer running while the current block is
  computed), merging blockwise results with an online softmax (:func:`merge_partials`).
  The backward sends the K/V blocks round again, with their partial gradients travelling
  one hop behind, so each gradient reaches its owner. Every exchange goes through
  :func:`parlib.comm.exchange`: no tags (K/V blocks and gradients share the links and
  match by order, as NCCL matches them), send and receive batched (at cp = 2 both go to
  the same peer, a pair NCCL can deadlock on when posted apart).

Which positions a rank holds is the *layout*: ``"contiguous"`` (rank r holds chunk r of
cp) or ``"zigzag"`` (2cp chunks, rank r holds chunks r and 2cp - 1 - r, which balances
the causal mask's work). The process group is always an argument. On a model, the two
attentions replace its attention computation: :func:`context_parallel_copy` does it for
the course's TinyGPT, :mod:`parlib.strategies.context_transformers` for a Hugging Face model.

Shapes in names (``q_BHSD``): B batch, H heads, S the positions this rank holds (L/C),
D head size (head_dim), L the whole sequence, C cp ranks, 2 K and V stacked, W model width.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function

from parlib import comm
from parlib.model import Attention, TinyGPT
from parlib.strategies.context_ops import (
    block_attention,
    block_backward,
    chunk_attention,
    merge_partials,
    visible_mask,
)

LAYOUTS = ("contiguous", "zigzag")


# --------------------------------------------------------------------------------------
# Which positions each rank holds
# --------------------------------------------------------------------------------------

def sequence_positions(rank: int, cp: int, seq_len: int,
                       layout: str = "contiguous") -> torch.Tensor:
    """The global positions (long, ascending) rank ``rank`` of ``cp`` holds of a sequence of
    ``seq_len``: contiguous, chunk r of cp; zig-zag, chunks r and 2cp - 1 - r of 2cp."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"need cp >= 1 and 0 <= rank < cp, got rank={rank}, cp={cp}")
    chunks = cp if layout == "contiguous" else 2 * cp
    if seq_len % chunks:
        raise ValueError(f"sequence length {seq_len} does not split into {chunks} equal "
                         f"chunks ({layout} layout over cp={cp} ranks)")
    size = seq_len // chunks
    mine = [rank] if layout == "contiguous" else [rank, 2 * cp - 1 - rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in mine])


def split_sequence(x: torch.Tensor, group: Any, layout: str = "contiguous",
                   dim: int = 1) -> torch.Tensor:
    """This rank's positions of ``x`` along ``dim`` (tokens (B, L) -> (B, S))."""
    rank, cp = comm.rank_and_size(group, "split_sequence", allow_none=False)
    pos = sequence_positions(rank, cp, x.shape[dim], layout)
    return x.index_select(dim, pos.to(x.device))


# --------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------

def _chunks(positions: torch.Tensor, size: int) -> list[tuple[slice, int, int]]:
    """A rank's positions cut into the layout's chunks: (local slice, first, last)."""
    pos = positions.tolist()  # plain ints: indexing a tensor element by element is slow
    return [(slice(i, i + size), pos[i], pos[i + size - 1]) for i in range(0, len(pos), size)]


class _Ring:
    """This rank's place in the group: ring neighbours and every rank's chunks."""

    def __init__(self, group: Any, s_local: int, layout: str, causal: bool) -> None:
        self.rank, self.cp = comm.rank_and_size(group, "RingAttention", allow_none=False)
        self.group = group
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)
        self.causal = causal
        size = s_local if layout == "contiguous" else s_local // 2
        self.chunks = [_chunks(sequence_positions(r, self.cp, s_local * self.cp, layout), size)
                       for r in range(self.cp)]

    def source(self, step: int) -> int:
        """Whose K/V block this rank holds at ``step``: it moved ``step`` hops forward."""
        return (self.rank - step) % self.cp

    def pairs(self, step: int) -> list[tuple[slice, slice, bool]]:
        """(query slice, key slice, diagonal) of every chunk pair to compute at ``step``.
        The layouts cut the sequence into equal chunks, so under the causal mask a pair is
        fully visible (keys before queries), diagonal (the same chunk) or skipped (keys in
        the queries' future: never computed, which is where the layout's balance shows)."""
        if not self.causal:
            return [(slice(None), slice(None), False)]
        return [(qs, ks, k_first == q_first)
                for qs, q_first, q_last in self.chunks[self.rank]
                for ks, k_first, k_last in self.chunks[self.source(step)]
                if k_first <= q_last]

    def exchange(self, send: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
        """Start sending ``send`` to the next rank and receiving the previous rank's, as one
        batch (wait for all its works). Every rank posts its exchanges in the same order,
        so each message meets its receive by order alone."""
        recv = torch.empty_like(send)
        works = comm.exchange([(send, self.next)], [(recv, self.prev)], self.group)
        return works, recv


def ring_schedule(group: Any, seq_len: int, layout: str = "contiguous",
                  causal: bool = True) -> list[list[tuple[slice, slice, bool]]]:
    """Per ring step, the (query slice, key slice, diagonal) chunk pairs this rank of
    ``group`` computes in ring attention over ``seq_len`` positions (what the mask leaves)."""
    _, cp = comm.rank_and_size(group, "ring_schedule", allow_none=False)
    ring = _Ring(group, seq_len // cp, layout, causal)
    return [ring.pairs(step) for step in range(ring.cp)]


def _rows(t_BHSD: torch.Tensor, rows: slice) -> torch.Tensor:
    return t_BHSD[..., rows, :]  # the positions ``rows`` of a (..., S, D) tensor


class RingAttention(Function):
    """Attention of this rank's queries over the whole sequence, K/V passed round a ring.

    q, k, v (B, H, S, D) on each rank -> out (B, H, S, D). Forward: C steps; at step j the
    rank holds the K/V of rank (r - j) mod C, stacked as kv_2BHSD, sends it on while
    computing with it, and merges each chunk pair's (out, lse) into the running one.
    Backward: the K/V go round again; each block's partial dK/dV (2, B, H, S, D) is summed
    on every rank it visits and sent one hop behind it, home after C - 1 hops."""

    @staticmethod
    def forward(ctx: Any, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                group: Any, causal: bool, layout: str) -> torch.Tensor:
        ring = _Ring(group, q_BHSD.shape[-2], layout, causal)
        kv_2BHSD = torch.stack([k_BHSD, v_BHSD]).contiguous()
        out_BHSD = torch.zeros_like(q_BHSD)
        lse_BHS = torch.full(q_BHSD.shape[:-1], float("-inf"), dtype=q_BHSD.dtype,
                             device=q_BHSD.device)
        for step in range(ring.cp):
            works, incoming_2BHSD = ring.exchange(kv_2BHSD) if step < ring.cp - 1 else ([], None)
            for qs, ks, diagonal in ring.pairs(step):  # while the next block travels
                part = chunk_attention(_rows(q_BHSD, qs), _rows(kv_2BHSD[0], ks),
                                       _rows(kv_2BHSD[1], ks), diagonal)
                out_BHSD[..., qs, :], lse_BHS[..., qs] = merge_partials(
                    _rows(out_BHSD, qs), lse_BHS[..., qs], *part)
            for w in works:
                w.wait()
            kv_2BHSD = incoming_2BHSD
        ctx.save_for_backward(q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS)
        ctx.ring = ring
        return out_BHSD

    @staticmethod
    def backward(ctx: Any, d_out_BHSD: torch.Tensor) -> tuple[Any, ...]:
        q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS = ctx.saved_tensors
        ring = ctx.ring
        d_out_BHSD = d_out_BHSD.contiguous()
        dq_BHSD = torch.zeros_like(q_BHSD)
        kv_2BHSD = torch.stack([k_BHSD, v_BHSD]).contiguous()
        mine_2BHSD = torch.zeros_like(kv_2BHSD)  # this rank's share of its own block's gradient
        pending: tuple[list[Any], torch.Tensor] | None = None  # (works, gradient) in transit
        for step in range(ring.cp):
            works, incoming_2BHSD = ring.exchange(kv_2BHSD) if step < ring.cp - 1 else ([], None)
            partial_2BHSD = torch.zeros_like(kv_2BHSD)  # dK, dV of the held block
            for qs, ks, diagonal in ring.pairs(step):
                dq, dk, dv = block_backward(
                    _rows(q_BHSD, qs), _rows(kv_2BHSD[0], ks), _rows(kv_2BHSD[1], ks),
                    _rows(d_out_BHSD, qs), _rows(out_BHSD, qs), lse_BHS[..., qs], diagonal)
                dq_BHSD[..., qs, :] += dq
                partial_2BHSD[0, ..., ks, :] += dk
                partial_2BHSD[1, ..., ks, :] += dv
            if step == 0:
                mine_2BHSD = partial_2BHSD
            else:
                if pending is not None:
                    partial_2BHSD = partial_2BHSD + _arrived(*pending)
                # one hop behind the K/V: the next rank gets this block at the next step
                pending = ring.exchange(partial_2BHSD.contiguous())
            for w in works:
                w.wait()
            kv_2BHSD = incoming_2BHSD
        if pending is not None:  # after C - 1 hops the own block's gradient comes home
            mine_2BHSD = mine_2BHSD + _arrived(*pending)
        return dq_BHSD, mine_2BHSD[0], mine_2BHSD[1], None, None, None


def _arrived(works: list[Any], tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` once its exchange (the send beside its receive included) is done."""
    for w in works:
        w.wait()
    return tensor


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *,
                   causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """Attention over the whole sequence of this rank's queries, q, k, v (B, H, S, D),
    the sequence split over ``group`` in ``layout``; returns (B, H, S, D). The first
    call with ``group`` checks that its ranks agree on the shapes, dtype, ``causal`` and
    ``layout`` (:func:`parlib.comm.agree`), raising on every rank if not."""
    comm.rank_and_size(group, "ring_attention", allow_none=False)
    _check_shapes(q, k, v)
    _agree_across_ranks("ring_attention", q, group, causal, layout)
    return RingAttention.apply(q, k, v, group, causal, layout)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError("q, k and v must all be (b, heads, s_local, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _agree_across_ranks(what: str, q: torch.Tensor, group: Any, causal: bool,
                        layout: str) -> None:
    """On the first call with ``group``: the ranks' shapes, dtype, mask and layout agree
    (otherwise gloo aborts on a size mismatch, or a differing mask runs silently)."""
    batch, heads, s_local, head_dim = q.shape
    comm.agree(what, group, {
        "the local sequence length (q.shape[-2])": (
            s_local, "every rank must hold as many positions: cut one sequence whose "
            "length divides into cp chunks (2 x cp for zigzag) with split_sequence"),
        "(batch, heads, head_dim) of q, k, v": (
            (batch, heads, head_dim), "every rank must pass the same batch, heads and head_dim"),
        "the dtype of q, k, v": (q.dtype, "cast q, k and v to one dtype on every rank"),
        "causal": (causal, "pass the same causal= on every rank (one mask over the whole "
                   "sequence)"),
        "layout": (layout, "pass every rank the layout= split_sequence cut with"),
    }, once=True)


# --------------------------------------------------------------------------------------
# All-gather attention
# --------------------------------------------------------------------------------------

class AllGatherKV(Function):
    """kv (2, B, H, S, D) on each rank -> every rank's, (C, 2, B, H, S, D) in rank
    order; backward: the gradients summed over the ranks, each rank keeping its own block
    (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, kv_2BHSD: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        _, cp = comm.rank_and_size(group, "AllGatherKV", allow_none=False)
        # collectives concatenate along dim 0: gather (C x 2, B, H, S, D), then view
        gathered = kv_2BHSD.new_empty((cp * kv_2BHSD.shape[0], *kv_2BHSD.shape[1:]))
        comm.all_gather(gathered, kv_2BHSD.contiguous(), group=group)
        return gathered.view(cp, *kv_2BHSD.shape)

    @staticmethod
    def backward(ctx: Any, grad_C2BHSD: torch.Tensor) -> tuple[torch.Tensor, None]:
        mine_2BHSD = grad_C2BHSD.new_empty(grad_C2BHSD.shape[1:])
        comm.reduce_scatter(mine_2BHSD, grad_C2BHSD.contiguous().flatten(0, 1),
                            group=ctx.group)
        return mine_2BHSD, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *,
                         causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """The simple way: gather all of K and V, then attend the local queries
    (B, H, S, D) over the whole sequence; returns (B, H, S, D). The first call with
    ``group`` checks its ranks' settings, as :func:`ring_attention` does."""
    rank, cp = comm.rank_and_size(group, "all_gather_attention", allow_none=False)
    _check_shapes(q, k, v)
    _agree_across_ranks("all_gather_attention", q, group, causal, layout)
    seq_len = q.shape[-2] * cp
    every_C2BHSD = AllGatherKV.apply(torch.stack([k, v]), group)
    k_BHLD = torch.cat(list(every_C2BHSD[:, 0]), dim=-2)  # blocks in rank order
    v_BHLD = torch.cat(list(every_C2BHSD[:, 1]), dim=-2)
    mask_SL = None
    if causal:
        k_pos = torch.cat([sequence_positions(r, cp, seq_len, layout) for r in range(cp)])
        mask_SL = visible_mask(sequence_positions(rank, cp, seq_len, layout), k_pos)
        mask_SL = mask_SL.to(q.device)
    return F.scaled_dot_product_attention(q, k_BHLD, v_BHLD, attn_mask=mask_SL)


ATTENTIONS = {"ring": ring_attention, "all_gather": all_gather_attention}


def _attention_named(attention: str) -> Callable[..., torch.Tensor]:
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {sorted(ATTENTIONS)}, got {attention!r}")
    return ATTENTIONS[attention]


# --------------------------------------------------------------------------------------
# The tiny model with its sequence split
# --------------------------------------------------------------------------------------

class ContextParallelAttention(Attention):
    """The model's attention on a split sequence: the same q/k/v/out projections (the same
    parameter objects and names), attention by ring or all-gather over ``group``."""

    def __init__(self, attn: Attention, group: Any, layout: str = "contiguous",
                 attention: str = "ring") -> None:
        nn.Module.__init__(self)
        self.head_dim = attn.head_dim
        self.q, self.k, self.v, self.out = attn.q, attn.k, attn.v, attn.out
        self.group, self.layout, self.attend = group, layout, _attention_named(attention)

    def forward(self, x_BSW: torch.Tensor) -> torch.Tensor:
        batch, s_local, _ = x_BSW.shape
        width = self.q.out_features
        heads = width // self.head_dim

        def split(t_BSW: torch.Tensor) -> torch.Tensor:  # -> (B, H, S, D)
            return t_BSW.view(batch, s_local, heads, self.head_dim).transpose(1, 2)

        y_BHSD = self.attend(split(self.q(x_BSW)), split(self.k(x_BSW)), split(self.v(x_BSW)),
                             self.group, causal=True, layout=self.layout)
        return self.out(y_BHSD.transpose(1, 2).reshape(batch, s_local, width))


class ContextParallelEmbed(nn.Module):
    """The model's embedding on this rank's positions: tokens (B, S) -> (B, S, W)."""

    def __init__(self, embed: nn.Module, positions: torch.Tensor) -> None:
        super().__init__()
        self.tok, self.pos = embed.tok, embed.pos
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != self.positions.numel():
            raise ValueError(f"this rank holds {self.positions.numel()} positions, got "
                             f"tokens of length {tokens.shape[1]} (split them first)")
        return self.tok(tokens) + self.pos(self.positions)


def context_parallel_copy(model: TinyGPT, group: Any, layout: str = "contiguous",
                          attention: str = "ring") -> TinyGPT:
    """A copy of ``model`` that runs on this rank's share of the sequence (tokens from
    :func:`split_sequence`), parameters named as in ``model``."""
    rank, cp = comm.rank_and_size(group, "context_parallel_copy", allow_none=False)
    cp_model = copy.deepcopy(model)
    positions = sequence_positions(rank, cp, model.cfg.seq_len, layout)
    cp_model.embed = ContextParallelEmbed(cp_model.embed, positions)
    for block in cp_model.blocks:
        block.attn = ContextParallelAttention(block.attn, group, layout, attention)
    return cp_model


def average_gradients(model: nn.Module, group: Any) -> None:
    """Each parameter's gradient -> its mean over the cp group. Every rank's loss is the
    mean over its own tokens; the mean over all tokens is the mean of those (equal
    shares), so the gradient of the whole loss is the average of the ranks' gradients."""
    _, cp = comm.rank_and_size(group, "average_gradients", allow_none=False)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= cp


def mean_over_group(value: torch.Tensor, group: Any) -> torch.Tensor:
    """A per-rank mean (the local loss) -> the mean over all tokens of all ranks."""
    _, n = comm.rank_and_size(group, "mean_over_group")
    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return total / n


__all__ = ["ATTENTIONS", "AllGatherKV", "LAYOUTS", "ContextParallelAttention",
           "ContextParallelEmbed", "RingAttention", "all_gather_attention",
           "average_gradients", "block_attention", "context_parallel_copy",
           "mean_over_group", "merge_partials", "ring_attention", "ring_schedule",
           "sequence_positions", "split_sequence"]
