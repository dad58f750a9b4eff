"""The context-parallel chapter's numbers and choices: ring attention's bytes per layer, the
activation memory of one rank, the zig-zag chunk pair, when to pick cp over t."""

from __future__ import annotations

from typing import Any

from parlib.cost.context import (
    LSE_BYTES,
    cp_activation_bytes_per_layer,
    kv_block_bytes,
    ring_attention_sent_bytes_per_layer,
    ring_sends_per_layer,
)
from parlib.course.on_ranks import factor_mistakes
from parlib.course.question_types import Choice, Numeric, WholeNumbers
from parlib.course.registry import register
from parlib.course.results import CheckFailed
from parlib.strategies.context import sequence_positions

MiB = 2**20

# --------------------------------------------------------------------------- ring bytes

_B, _S, _H, _HEADS, _KV_HEADS, _CP = 1, 32768, 4096, 32, 8, 8
_KV_DIM = _KV_HEADS * _H // _HEADS  # 1024: 8 K/V heads of head_dim 128
_RING = ring_attention_sent_bytes_per_layer(_B, _S, _KV_DIM, _CP, dtype_bytes=2)
_BLOCK = kv_block_bytes(_B, _S, _KV_DIM, _CP, dtype_bytes=2)
_SENDS = ring_sends_per_layer(_CP)  # 3 (cp - 1): K/V forward, K/V and gradients backward

register(Numeric(
    "05.ring_bytes",
    _RING,
    unit="bytes",
    prompt=f"""
        A transformer layer with hidden size h = {_H} and {_HEADS} query heads uses grouped
        K/V: {_KV_HEADS} K/V heads of the same head size. One sequence (b = {_B}) of
        s = {_S} tokens is split contiguously over cp = {_CP} ranks, and attention runs as
        ring attention in bf16 (2 bytes). How many bytes does one rank send for this layer
        in one training step (forward and backward)? In backward the K/V blocks travel the
        ring again (they are not kept) and their gradients travel with them. Give a number
        in bytes.
    """,
    working=f"""
        kv_dim = {_KV_HEADS} heads x {_H // _HEADS} = {_KV_DIM}. One rank's block is its K and
        its V for s/cp = {_S // _CP} positions: 2 x b x s/cp x kv_dim x 2 bytes =
        2 x {_B} x {_S // _CP} x {_KV_DIM} x 2 = {_BLOCK:,.0f} bytes.

        Forward: cp - 1 = {_CP - 1} blocks (every rank needs all cp blocks and holds one).
        Backward: the {_CP - 1} K/V blocks again, and {_CP - 1} blocks of their gradients
        (each gradient visits every rank on its way home). 3 x (cp - 1) = {_SENDS}
        messages.

        {_SENDS} x {_BLOCK:,.0f} = **{_RING:,.0f} bytes** ({_RING / MiB:.0f} MiB) per
        layer. It scales with s x kv_dim: grouped K/V make it {_HEADS // _KV_HEADS} times
        smaller than with full K/V heads.
    """,
    mistakes=factor_mistakes(_RING, {
        1 / 3: "that is the forward only; backward sends the K/V blocks again and their "
               "gradients, 2 (cp - 1) blocks more",
        2 / 3: "backward sends the K/V blocks round the ring again (they are not kept) as "
               "well as their gradients: 3 (cp - 1) blocks in all",
        _H / _KV_DIM: f"K and V have kv_dim = {_KV_HEADS} x {_H // _HEADS} = {_KV_DIM} "
                      f"columns, not h = {_H}: the layer has only {_KV_HEADS} K/V heads",
        0.5: "a block holds both K and V: 2 x b x s/cp x kv_dim elements",
        float(_CP): "a block holds one rank's s/cp positions, not the whole sequence",
        _CP / (_CP - 1): "a rank already holds its own block: it receives (and sends) "
                         "cp - 1 blocks per pass, not cp",
        2.0: "bf16 is 2 bytes per element",
    }),
))

# --------------------------------------------------------------------------- memory

_MS, _MB, _MH, _MA, _MCP = 131072, 1, 4096, 32, 16
_MEM = cp_activation_bytes_per_layer(_MS, _MB, _MH, _MA, _MCP)
_LOCAL = _MS // _MCP
_LSE = _MA * _LOCAL * _MB * LSE_BYTES


_GATHERED = cp_activation_bytes_per_layer(_MS, _MB, _MH, _MA, _MCP, attention="all_gather")


register(Numeric(
    "05.activation_memory",
    _MEM / MiB,
    unit="MiB",
    rtol=2e-4,
    prompt=f"""
        A GPT layer (hidden size h = {_MH}, a = {_MA} heads, full K/V heads, MLP width 4h,
        dropout, bf16 activations and 1-byte dropout masks) trains on one sequence of
        s = {_MS} tokens split over cp = {_MCP} ranks with ring attention. Attention runs
        as a fused kernel: the scores are not stored, only the fp32 log-sum-exp of every
        query row of every head. How much activation memory does one rank keep for this
        layer's backward? Without the scores, a layer stores 34 x s x b x h bytes for s
        positions in bf16. Give a number in MiB (2^20 bytes).
    """,
    working=f"""
        One rank holds s/cp = {_MS} / {_MCP} = {_LOCAL} positions, and every tensor a layer
        stores is per position: parlib.cost's per-layer formula with the scores recomputed,
        34 x (s/cp) x b x h bytes in bf16 (4 tensors of width h and 2 dropout masks outside
        the matmuls, Q, K, V, the attention output and the MLP's two 4h-wide tensors).

        34 x {_LOCAL} x {_MB} x {_MH} = {_MEM - _LSE:,.0f} bytes, plus the
        log-sum-exp: a x s/cp x b x 4 = {_LSE:,} bytes.

        **{_MEM / MiB:.1f} MiB**. The ring keeps no other rank's K and V: the all-gather
        variant would add 2 x b x (s - s/cp) x h x 2 bytes, {(_GATHERED - _MEM) / MiB:.0f} MiB more.
    """,
    mistakes={
        **factor_mistakes(_MEM / MiB, {
            float(_MCP): "every stored tensor holds one rank's s/cp positions: divide by cp",
        }),
        (_MEM - _LSE) / MiB: "add the fp32 log-sum-exp of each query row: a x s/cp x b x 4 "
                             "bytes, kept for the backward",
        _GATHERED / MiB:
            "that keeps every rank's K and V (the all-gather variant); the ring passes them "
            "on",
        cp_activation_bytes_per_layer(_MS, _MB, _MH, _MA, _MCP, dtype_bytes=4) / MiB:
            "the activations are bf16, 2 bytes each",
    },
))


# --------------------------------------------------------------------------- zig-zag

_ZCP, _ZR = 4, 1
_PAIR = tuple(sequence_positions(_ZR, _ZCP, 2 * _ZCP, "zigzag").tolist())  # chunk indices


def _pair_problem(first: int, second: int) -> str | None:
    """The first slip in a chunk pair, or None when it is rank r's."""
    got, want = (first, second), _PAIR
    last = 2 * _ZCP - 1
    if got == want:
        return None
    if got == want[::-1]:
        return "give the two chunks in increasing order"
    if max(got) > last:
        return f"the chunks are numbered 0 to 2cp - 1 = {last}"
    if got == (_ZR, _ZR + 1) or got == (2 * _ZR, 2 * _ZR + 1):
        return ("those are two neighbouring chunks: under the causal mask late chunks cost "
                "more, so zig-zag pairs an early chunk with a late one")
    if got == (_ZR, last - _ZR - 1) or got == (_ZR, 2 * _ZCP - _ZR):
        return "count the chunks from 0: rank r's second chunk is 2cp - 1 - r"
    if got == (_ZR + 1, 2 * _ZCP - _ZR):
        return "ranks and chunks are counted from 0"
    return "rank r holds chunk r and its mirror image, chunk 2cp - 1 - r"


class ChunkPair(WholeNumbers):
    """Two whole numbers, given as a pair of ints: a float, string or list is named as such."""

    def grade(self, answer: Any) -> str:
        if answer is not ... and not (
                isinstance(answer, tuple) and len(answer) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in answer)):
            kinds = (", ".join(type(x).__name__ for x in answer)
                     if isinstance(answer, (tuple, list)) else "")
            what = f"a {type(answer).__name__}" + (f" of {kinds}" if kinds else "")
            raise CheckFailed(f"you gave {what}: give a pair of two ints (first chunk, second "
                              f"chunk), e.g. (0, 7)")
        return super().grade(answer)


register(ChunkPair(
    "05.zigzag_pair",
    _pair_problem,
    names=("first chunk", "second chunk"),
    example=(0, 7),
    minimum=0,
    too_small="chunks are numbered from 0",
    prompt=f"""
        Under the zig-zag split, a causal sequence is cut into 2 x cp equal chunks, numbered
        0 to 2cp - 1 in order, and each rank holds two of them so that every rank does the
        same attention work. With cp = {_ZCP}, which two chunks does rank {_ZR} hold
        (ranks counted from 0)? Give a pair of ints in increasing order, e.g. (0, 7).
    """,
    working=f"""
        Rank r holds chunk r and chunk 2cp - 1 - r: with cp = {_ZCP}, rank {_ZR} holds
        **{_PAIR}**. Under the causal mask, chunk c's queries see c + 1 chunks of keys, so
        the pair costs (r + 1) + (2cp - r) = 2cp + 1 chunk pairs whatever r is: every rank
        the same. A contiguous split (rank r holding chunks 2r and 2r + 1) would leave the
        last rank with the most work.
    """,
))

# --------------------------------------------------------------------------- choice

register(Choice(
    "05.cp_or_tp",
    "B",
    options={
        "A": "Context parallelism divides the weights and optimizer states by cp as well as "
             "the activations, so it saves everything tensor parallelism saves and more.",
        "B": "TP's all-reduces of s x h activations wait on the critical path; CP's ring "
             "moves s x kv_dim K/V blocks, which can hide behind attention.",
        "C": "Tensor parallelism cannot divide activation memory at all, so raising t to 16 "
             "would leave each GPU's activation memory for the long sequence unchanged.",
        "D": "Context parallelism sends no bytes: every layer, attention included, works "
             "token by token on the tokens a rank holds.",
    },
    prompt="""
        A model trains with t = 8 tensor parallelism (with sequence parallelism) inside
        each 8-GPU node. Moving to 128k-token sequences, the activations no longer fit.
        Its attention has 8 K/V heads for 64 query heads. Why add context parallelism
        (cp = 2 across two nodes) rather than raise t to 16 across the same two nodes?
        Give one letter.
    """,
    working="""
        **B.** Both divide the activations of the long sequence. Tensor parallelism
        all-reduces (or all-gathers and reduce-scatters) the (b, s, h) activations 4 times
        per layer, and the next matmul waits for each: across the slow link between nodes
        that stalls every layer. Context parallelism's traffic is the K/V blocks, s x
        kv_dim with kv_dim = h / 8 here, and each transfer runs while the previous block's
        attention computes. A is wrong: every cp rank holds the whole model (weights are
        divided by the other axes). C is wrong: with sequence parallelism the activations
        are divided by t. D is wrong: attention needs every key and value.
    """,
    hints={
        "A": "each cp rank runs the whole layer on its positions: which parameters does it "
             "hold?",
        "C": "with sequence parallelism tensor parallelism divides the activations by t: "
             "the difference is in what each sends, and when",
        "D": "attention mixes tokens: each rank's queries need every key and value",
    },
))

__all__ = ["ChunkPair"]
