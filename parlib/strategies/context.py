"""Context parallelism: the sequence split over cp ranks, attention by ring or all-gather.

Every layer but attention acts on each token alone, so a rank holding s/cp positions runs
them unchanged. Attention needs every key and value; two ways to get them:

- :func:`all_gather_attention`: all-gather K and V (their gradients reduce-scatter back),
  then ordinary attention of the local queries against the whole sequence. Simple; every
  rank holds all of K and V.
- :func:`ring_attention`: each rank keeps its queries and passes K/V blocks around the
  ring (isend to the next rank, irecv from the previous, the next block's transfer running
  while the current block is computed), merging blockwise results with an online softmax
  (:func:`merge_partials`). The backward sends the K/V blocks round again, with their
  partial gradients travelling one hop behind, so each gradient reaches its owner.

Which positions a rank holds is the *layout*: ``"contiguous"`` (rank r holds chunk r of
cp) or ``"zigzag"`` (2cp chunks, rank r holds chunks r and 2cp - 1 - r, which balances
the causal mask's work). Tensors are (b, heads, s_local, head_dim) inside attention and
(b, s_local, h) in the model; the process group is always an argument.
"""

from __future__ import annotations

import copy
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
KV_TAG, GRAD_TAG = 0, 1  # K/V blocks and their gradients travel the same links


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
    """This rank's positions of ``x`` along ``dim`` (tokens (b, s) -> (b, s/cp))."""
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

    def exchange(self, send: torch.Tensor,
                 tag: int = KV_TAG) -> tuple[list[Any], torch.Tensor]:
        """Start sending ``send`` to the next rank and receiving the previous rank's."""
        recv = torch.empty_like(send)
        works = [dist.isend(send, self.next, group=self.group, tag=tag),
                 dist.irecv(recv, self.prev, group=self.group, tag=tag)]
        return works, recv


def ring_schedule(group: Any, seq_len: int, layout: str = "contiguous",
                  causal: bool = True) -> list[list[tuple[slice, slice, bool]]]:
    """Per ring step, the (query slice, key slice, diagonal) chunk pairs this rank of
    ``group`` computes in ring attention over ``seq_len`` positions (what the mask leaves)."""
    _, cp = comm.rank_and_size(group, "ring_schedule", allow_none=False)
    ring = _Ring(group, seq_len // cp, layout, causal)
    return [ring.pairs(step) for step in range(ring.cp)]


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[..., rows, :]  # (b, a, s, d) -> the positions ``rows``


class RingAttention(Function):
    """Attention of this rank's queries over the whole sequence, K/V passed round a ring.

    q, k, v: (b, a, s/cp, d) on each rank -> out (b, a, s/cp, d). Forward: cp steps; at step
    j the rank holds the K/V of rank (r - j) mod cp, stacked as kv (2, b, a, s/cp, d), sends
    it on while computing with it, and merges each chunk pair's (out, lse) into the running
    one. Backward: the K/V go round again; each block's partial dK/dV (2, b, a, s/cp, d) is
    summed on every rank it visits and sent one hop behind it, home after cp - 1 hops."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                causal: bool, layout: str) -> torch.Tensor:
        ring = _Ring(group, q.shape[-2], layout, causal)
        kv = torch.stack([k, v]).contiguous()  # (2, b, a, s/cp, d)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for step in range(ring.cp):
            works, incoming = ring.exchange(kv) if step < ring.cp - 1 else ([], None)
            for qs, ks, diagonal in ring.pairs(step):  # while the next block travels
                part = chunk_attention(_rows(q, qs), _rows(kv[0], ks), _rows(kv[1], ks), diagonal)
                out[..., qs, :], lse[..., qs] = merge_partials(
                    _rows(out, qs), lse[..., qs], *part)
            for w in works:
                w.wait()
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        d_out = d_out.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        mine = torch.zeros_like(kv)  # this rank's share of its own block's gradient
        pending = None  # (work, tensor): this step's block's gradient from the ranks before
        grad_sends = []
        for step in range(ring.cp):
            works, incoming = ring.exchange(kv) if step < ring.cp - 1 else ([], None)
            partial = torch.zeros_like(kv)  # (2, b, a, s/cp, d): dK, dV of the held block
            for qs, ks, diagonal in ring.pairs(step):
                dq_b, dk_b, dv_b = block_backward(
                    _rows(q, qs), _rows(kv[0], ks), _rows(kv[1], ks), _rows(d_out, qs),
                    _rows(out, qs), lse[..., qs], diagonal)
                dq[..., qs, :] += dq_b
                partial[0, ..., ks, :] += dk_b
                partial[1, ..., ks, :] += dv_b
            if step == 0:
                mine = partial
            else:
                if pending is not None:
                    pending[0].wait()
                    partial = partial + pending[1]
                # one hop behind the K/V: the next rank gets this block at the next step
                grad_works, arriving = ring.exchange(partial.contiguous(), tag=GRAD_TAG)
                grad_sends.append(grad_works[0])
                pending = (grad_works[1], arriving)
            for w in works:
                w.wait()
            kv = incoming
        for w in grad_sends:
            w.wait()
        if pending is not None:  # after cp - 1 hops the own block's gradient comes home
            pending[0].wait()
            mine = mine + pending[1]
        return dq, mine[0], mine[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *,
                   causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """Attention over the whole sequence of this rank's queries, q, k, v (b, a, s/cp, d),
    the sequence split over ``group`` in ``layout``; returns (b, a, s/cp, d). The first
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
    b, heads, s_local, head_dim = q.shape
    comm.agree(what, group, {
        "the local sequence length (q.shape[-2])": (
            s_local, "every rank must hold as many positions: cut one sequence whose "
            "length divides into cp chunks (2 x cp for zigzag) with split_sequence"),
        "(batch, heads, head_dim) of q, k, v": (
            (b, heads, head_dim), "every rank must pass the same batch, heads and head_dim"),
        "the dtype of q, k, v": (q.dtype, "cast q, k and v to one dtype on every rank"),
        "causal": (causal, "pass the same causal= on every rank (one mask over the whole "
                   "sequence)"),
        "layout": (layout, "pass every rank the layout= split_sequence cut with"),
    }, once=True)


# --------------------------------------------------------------------------------------
# All-gather attention
# --------------------------------------------------------------------------------------

class AllGatherKV(Function):
    """kv (2, b, a, s/cp, d) on each rank -> every rank's, (cp, 2, b, a, s/cp, d) in rank
    order; backward: the gradients summed over the ranks, each rank keeping its own block
    (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        _, cp = comm.rank_and_size(group, "AllGatherKV", allow_none=False)
        gathered = kv.new_empty((cp * kv.shape[0], *kv.shape[1:]))  # collectives use dim 0
        comm.all_gather(gathered, kv.contiguous(), group=group)
        return gathered.view(cp, *kv.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mine = grad.new_empty(grad.shape[1:])
        comm.reduce_scatter(mine, grad.contiguous().flatten(0, 1), group=ctx.group)
        return mine, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *,
                         causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """The simple way: gather all of K and V, then attend the local queries
    (b, a, s/cp, d) over the whole sequence; returns (b, a, s/cp, d). The first call with
    ``group`` checks its ranks' settings, as :func:`ring_attention` does."""
    rank, cp = comm.rank_and_size(group, "all_gather_attention", allow_none=False)
    _check_shapes(q, k, v)
    _agree_across_ranks("all_gather_attention", q, group, causal, layout)
    seq_len = q.shape[-2] * cp
    every = AllGatherKV.apply(torch.stack([k, v]), group)  # (cp, 2, b, a, s/cp, d)
    k_all = torch.cat(list(every[:, 0]), dim=-2)  # (b, a, s, d), blocks in rank order
    v_all = torch.cat(list(every[:, 1]), dim=-2)
    mask = None
    if causal:
        k_pos = torch.cat([sequence_positions(r, cp, seq_len, layout) for r in range(cp)])
        mask = visible_mask(sequence_positions(rank, cp, seq_len, layout), k_pos).to(q.device)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


ATTENTIONS = {"ring": ring_attention, "all_gather": all_gather_attention}


# --------------------------------------------------------------------------------------
# The tiny model with its sequence split
# --------------------------------------------------------------------------------------

class ContextParallelAttention(Attention):
    """The model's attention on a split sequence: the same q/k/v/out projections (the same
    parameter objects and names), attention by ring or all-gather over ``group``."""

    def __init__(self, attn: Attention, group: Any, layout: str = "contiguous",
                 attention: str = "ring") -> None:
        nn.Module.__init__(self)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {sorted(ATTENTIONS)}, "
                             f"got {attention!r}")
        self.head_dim = attn.head_dim
        self.q, self.k, self.v, self.out = attn.q, attn.k, attn.v, attn.out
        self.group, self.layout, self.attend = group, layout, ATTENTIONS[attention]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s_local, _ = x.shape  # (b, s/cp, h)
        width = self.q.out_features
        heads = width // self.head_dim

        def split(t: torch.Tensor) -> torch.Tensor:  # (b, s/cp, h) -> (b, a, s/cp, d)
            return t.view(b, s_local, heads, self.head_dim).transpose(1, 2)

        y = self.attend(split(self.q(x)), split(self.k(x)), split(self.v(x)), self.group,
                        causal=True, layout=self.layout)
        return self.out(y.transpose(1, 2).reshape(b, s_local, width))


class ContextParallelEmbed(nn.Module):
    """The model's embedding on this rank's positions: tokens (b, s/cp) -> (b, s/cp, h)."""

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
