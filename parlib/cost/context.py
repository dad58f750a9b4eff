"""Context parallelism: the sequence split over cp ranks, attention's K/V traffic and memory.

Every layer but attention works token by token, so with the sequence split over cp ranks
(s/cp positions each) only attention talks: each rank's queries need every key and value.

- Ring attention passes K/V blocks (b, s/cp, kv_dim each of K and V) around the ring: cp - 1
  blocks sent per layer in forward; in backward the K/V blocks travel the ring again (they
  are not kept) and their gradients travel with them, cp - 1 hops each.
- The all-gather variant (Llama 3's choice) gathers all of K and V in forward and
  reduce-scatters their gradients in backward: the same (cp - 1) blocks each way, but every
  rank holds the whole K and V for backward.

Activation memory per rank: the layer's activations for s/cp positions, attention with
a fused kernel (scores not stored: :func:`parlib.cost.memory.activation_bytes_per_layer`'s
``recompute="selective"``) plus its log-sum-exp, and for the all-gather variant the gathered
K and V of the other ranks.
"""

from __future__ import annotations

from parlib.cost.collectives import predicted_sent_bytes
from parlib.cost.memory import activation_bytes_per_layer

CP_ATTENTIONS = ("ring", "all_gather")
LSE_BYTES = 4  # the log-sum-exp of each query row is kept in fp32


def _check(s: int, cp: int, *, zigzag: bool = False) -> None:
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp!r}")
    chunks = 2 * cp if zigzag else cp
    if s % chunks:
        raise ValueError(f"sequence length {s} does not split into {chunks} equal chunks "
                         f"(cp={cp}{', zig-zag' if zigzag else ''})")


def kv_block_bytes(b: int, s: int, kv_dim: int, cp: int, dtype_bytes: int = 4) -> float:
    """One rank's K and V for one layer: 2 x b x (s/cp) x kv_dim elements (the message
    ring attention passes on, and the gradient that travels back)."""
    _check(s, cp)
    return 2 * b * (s // cp) * kv_dim * dtype_bytes


def ring_sends_per_layer(cp: int, passes: tuple[str, ...] = ("forward", "backward")) -> int:
    """Messages one rank sends per layer: cp - 1 K/V blocks in forward; in backward cp - 1
    K/V blocks again and cp - 1 partial K/V gradients."""
    per_pass = {"forward": cp - 1, "backward": 2 * (cp - 1)}
    return sum(per_pass[p] for p in passes)


def ring_attention_sent_bytes_per_layer(b: int, s: int, kv_dim: int, cp: int,
                                        dtype_bytes: int = 4,
                                        passes: tuple[str, ...] = ("forward", "backward"),
                                        ) -> float:
    """Bytes one rank sends per layer under ring attention: forward (cp-1) K/V blocks,
    backward (cp-1) K/V blocks and (cp-1) gradient blocks, each
    :func:`kv_block_bytes`. Scales with s x kv_dim, not with s x h as TP's all-reduces."""
    return ring_sends_per_layer(cp, passes) * kv_block_bytes(b, s, kv_dim, cp, dtype_bytes)


def all_gather_kv_sent_bytes_per_layer(b: int, s: int, kv_dim: int, cp: int,
                                       dtype_bytes: int = 4,
                                       passes: tuple[str, ...] = ("forward", "backward"),
                                       ) -> float:
    """Bytes one rank sends per layer under all-gather attention: an all-gather of K and V
    (the whole 2 x b x s x kv_dim message) forward and a reduce-scatter of their gradients
    backward, (cp-1)/cp of the message each (:func:`parlib.cost.predicted_sent_bytes`)."""
    _check(s, cp)
    message = 2 * b * s * kv_dim * dtype_bytes
    op = {"forward": "all_gather", "backward": "reduce_scatter"}
    return sum(predicted_sent_bytes(op[p], message, cp) for p in passes)


def cp_activation_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                                  cp: int, *, attention: str = "ring", dtype_bytes: int = 2,
                                  dropout: bool = True, ffn_dim: int | None = None,
                                  kv_dim: int | None = None, gated_mlp: bool = False) -> float:
    """Bytes one transformer layer stores for backward on one of cp context-parallel ranks.

    The layer's activations for s/cp positions with the scores not stored
    (:func:`parlib.cost.memory.activation_bytes_per_layer`, ``recompute="selective"``), plus
    the fp32 log-sum-exp of each of the a x s/cp x b query rows; ``attention="all_gather"``
    also keeps the other ranks' K and V, 2 x b x (s - s/cp) x kv_dim elements. Ring
    attention's memory falls as 1/cp; the all-gather variant keeps a term in s."""
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"attention must be one of {CP_ATTENTIONS}, got {attention!r}")
    _check(seq_len, cp)
    local = seq_len // cp
    kv = d_model if kv_dim is None else kv_dim
    layer = activation_bytes_per_layer(local, micro_batch, d_model, n_heads,
                                       recompute="selective", dtype_bytes=dtype_bytes,
                                       dropout=dropout, ffn_dim=ffn_dim, kv_dim=kv,
                                       gated_mlp=gated_mlp)
    lse = n_heads * local * micro_batch * LSE_BYTES
    gathered = (2 * micro_batch * (seq_len - local) * kv * dtype_bytes
                if attention == "all_gather" else 0)
    return layer + lse + gathered


def causal_block_work(cp: int, zigzag: bool = False) -> list[int]:
    """Per rank, how many (query chunk, key chunk) pairs of a causal mask are not fully
    masked, with the sequence cut into cp chunks (contiguous: rank r holds chunk r) or
    2 x cp chunks (zig-zag: rank r holds chunks r and 2cp - 1 - r). A chunk pair on the
    diagonal counts as one (:func:`causal_unmasked_scores` counts its scores). Contiguous:
    rank r does r + 1 blocks (the last rank cp times the first's); zig-zag: every rank does
    2cp + 1 of the (2cp)^2 half-size pairs."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp!r}")
    if not zigzag:
        return [r + 1 for r in range(cp)]
    work = []
    for r in range(cp):
        mine = (r, 2 * cp - 1 - r)
        work.append(sum(1 for q in mine for k in range(2 * cp) if k <= q))
    return work


def causal_unmasked_scores(seq_len: int, cp: int, zigzag: bool = False) -> list[int]:
    """Per rank, the (query, key) scores a causal mask leaves (key position <= query
    position), with the sequence of ``seq_len`` split as :func:`causal_block_work` splits
    it. Counted this way a block on the diagonal is about half full, where
    :func:`causal_block_work` charges it whole. Both splits sum to s(s+1)/2. Contiguous
    chunks of n = s/cp positions: rank r gets n^2 r + n(n+1)/2, so the last rank does
    1 + 2(cp-1) n/(n+1) times the first's, about 2cp - 1 (not cp); zig-zag: the same on
    every rank."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp!r}")
    chunks = 2 * cp if zigzag else cp
    if seq_len < chunks or seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} does not split into {chunks} equal chunks "
                         f"({'2 x ' if zigzag else ''}cp = {cp}); pick a multiple of {chunks}")
    n = seq_len // chunks

    def chunk(c: int) -> int:  # queries c n .. c n + n - 1 see keys 0 .. q
        return n * n * c + n * (n + 1) // 2

    if not zigzag:
        return [chunk(r) for r in range(cp)]
    return [chunk(r) + chunk(chunks - 1 - r) for r in range(cp)]


__all__ = ["CP_ATTENTIONS", "LSE_BYTES", "all_gather_kv_sent_bytes_per_layer",
           "causal_block_work", "causal_unmasked_scores", "cp_activation_bytes_per_layer",
           "kv_block_bytes", "ring_attention_sent_bytes_per_layer", "ring_sends_per_layer"]
