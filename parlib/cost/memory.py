"""Memory formulas: model-state bytes per parameter and what ZeRO shards of them.

With Adam, every parameter carries its weight, its gradient and two moments. In fp32
that is 4 + 4 + 8 = 16 bytes. In mixed precision it is 2 (bf16 weight) + 2 (bf16
gradient) + 12 (fp32 master weight and two fp32 moments) = 16 bytes too; the 12 are
the optimizer state ZeRO-1 shards. ZeRO stage 1 shards the optimizer state over the N
data-parallel ranks, stage 2 also the gradients, stage 3 also the weights.

Then activations: the bytes a transformer layer keeps for its backward pass (Korthikanti et
al. 2022), with tensor and sequence parallelism and recomputation, and the output logits.
"""

from __future__ import annotations


def _require_at_least_one(**values: float) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")


def model_state_bytes_per_param(mixed_precision: bool = False) -> dict[str, int]:
    """Bytes per parameter by kind: {"params", "grads", "optimizer"} (Adam)."""
    if mixed_precision:
        return {"params": 2, "grads": 2, "optimizer": 12}
    return {"params": 4, "grads": 4, "optimizer": 8}


def adam_bytes_per_param(mixed_precision: bool = False) -> int:
    """Model-state bytes per parameter with Adam: 16 in fp32 and in mixed precision."""
    return sum(model_state_bytes_per_param(mixed_precision).values())


# From which ZeRO stage each kind of model state is sharded over the N ranks.
_SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3, "shard copy": 1}


def model_state_bytes_by_kind(n_params: float, world_size: int = 1, zero_stage: int = 0,
                              mixed_precision: bool = False,
                              shard_copy: bool = False) -> dict[str, float]:
    """Model-state bytes per rank by kind, {"params", "grads", "optimizer"}, with Adam under
    ZeRO stage 0-3 over ``world_size`` data-parallel ranks: stage 1 shards the optimizer
    state, stage 2 also the gradients, stage 3 also the weights.

    ``shard_copy``: also count, as kind "shard copy", the fp32 copy of its shard of the
    weights that a ZeRO-1 or ZeRO-2 rank's optimizer steps while the model keeps its own
    whole weights (this course's fp32 ``Zero1`` and ``Zero2``): 4P/N. In mixed precision
    that copy is the master weights, already in "optimizer", so it adds nothing."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    per = dict(model_state_bytes_per_param(mixed_precision))
    if shard_copy and zero_stage in (1, 2) and not mixed_precision:
        per["shard copy"] = per["params"]
    return {kind: per[kind] * n_params / (world_size if zero_stage >= _SHARDED_FROM[kind] else 1)
            for kind in per}


def model_state_bytes(n_params: float, world_size: int = 1, zero_stage: int = 0,
                      mixed_precision: bool = False, shard_copy: bool = False) -> float:
    """Model-state bytes per rank with Adam under ZeRO stage 0-3 over ``world_size`` ranks
    (``shard_copy``: as in :func:`model_state_bytes_by_kind`).

    fp32: 16P unsharded; stage 1 gives 8P + 8P/N, stage 2 4P + 12P/N, stage 3 16P/N.
    Mixed precision: stage 1 gives 4P + 12P/N. :func:`model_state_formula` writes them.
    """
    return sum(model_state_bytes_by_kind(n_params, world_size, zero_stage, mixed_precision,
                                         shard_copy).values())


def model_state_formula(zero_stage: int, mixed_precision: bool = False,
                        shard_copy: bool = False) -> str:
    """:func:`model_state_bytes` as a formula in P (parameters) and N (ranks), e.g.
    "8P + 12P/N" for fp32 ZeRO-1 with its shard copy: the bytes held whole, then the
    bytes sharded N ways."""
    kinds = model_state_bytes_by_kind(1, 1, zero_stage, mixed_precision, shard_copy)
    whole = sum(b for k, b in kinds.items() if zero_stage < _SHARDED_FROM[k])
    split = sum(b for k, b in kinds.items() if zero_stage >= _SHARDED_FROM[k])
    terms = ([f"{whole:g}P"] if whole else []) + ([f"{split:g}P/N"] if split else [])
    return " + ".join(terms)


# Activations: what a transformer layer keeps for its backward pass. Korthikanti et al. 2022,
# "Reducing Activation Recomputation in Large Transformer Models", Sec. 4 (Table 2).

RECOMPUTE_MODES = ("none", "selective", "full", "op")
# A fused attention kernel keeps, for its backward, one fp32 log-sum-exp per head and position.
LSE_BYTES_PER_HEAD = 4


def activation_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, n_heads: int, *,
                               t: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", dtype_bytes: int = 2,
                               dropout: bool = True, ffn_dim: int | None = None,
                               kv_dim: int | None = None, gated_mlp: bool = False) -> float:
    """Bytes one transformer layer stores for backward, per microbatch, on one of t ranks.

    Assumes activations of ``dtype_bytes`` each (2: the paper's 16-bit; 4 for fp32) and
    1-byte dropout masks. For a GPT layer (MLP 4h, no grouped KV, dropout) this is the
    paper's formula: s*b*h*(34 + 5*a*s/h) for 16-bit on one device, of which
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) on each of t tensor-parallel ranks, all of it / t with
    sequence parallelism. Term by term (s*b*h elements each unless said):

    - not split by tensor parallelism (split by sequence parallelism): the inputs of the two
      norms, the inputs of attention and MLP, two dropout masks (bytes): 4 elements + 2 bytes;
    - split t ways: Q, K, V (K and V of width ``kv_dim``), attention output, and the MLP's
      two (gated: three) hidden tensors of width ``ffn_dim``;
    - the a*s*s*b attention scores: softmax output, with dropout also its mask and output.

    ``recompute``: "selective" recomputes the scores in backward (they are not stored; this
    is also what FlashAttention does), "full" stores only the layer input, 2*s*b*h bytes at
    16 bit (/ t with sequence parallelism), and reruns the layer's forward in backward.
    "op" is torchtitan's per-operation policy on a layer of separate Q, K, V and output
    matrices with a fused attention kernel: it keeps the layer's input, attention's output
    and its log-sum-exp (4 bytes per head), and the output of every other matmul in forward
    order (Q, V, the MLP's first matrix and, gated, its last), and reruns the rest (the other
    matmuls and every memory-bound op) in backward: per token h + (with a gated MLP) h, not
    split by tensor parallelism, and 2h + kv + f split t ways; no scores (the fused kernel
    never stores them). On one CPU this is, to the byte, what PyTorch's selective
    checkpointing keeps for ``transformers``' Llama layer under that policy (measured with
    :class:`parlib.measure.KeptAllocations`).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    _require_at_least_one(seq_len=seq_len, micro_batch=micro_batch, d_model=d_model,
                          n_heads=n_heads, t=t, dtype_bytes=dtype_bytes)
    s, b, h, a = seq_len, micro_batch, d_model, n_heads
    f = 4 * h if ffn_dim is None else ffn_dim
    kv = h if kv_dim is None else kv_dim
    mask = 1 if dropout else 0
    seq_split = t if sequence_parallel else 1
    if recompute == "full":
        return s * b * h * dtype_bytes / seq_split
    if recompute == "op":
        kept_whole = s * b * h * (2 if gated_mlp else 1) * dtype_bytes
        kept_split = s * b * ((2 * h + kv + f) * dtype_bytes + a * LSE_BYTES_PER_HEAD)
        return kept_whole / seq_split + kept_split / t
    replicated = s * b * h * (4 * dtype_bytes + 2 * mask)
    split = s * b * (2 * h + 2 * kv + (3 if gated_mlp else 2) * f) * dtype_bytes
    scores = 0 if recompute == "selective" else a * s * s * b * (
        dtype_bytes + mask * (dtype_bytes + 1))
    return replicated / seq_split + (split + scores) / t


def logits_bytes(seq_len: int, micro_batch: int, vocab_size: int, *, t: int = 1,
                 dtype_bytes: int = 2) -> float:
    """Bytes of the output layer's logits for one microbatch on one of t ranks (vocabulary
    split t ways): the (b, s, V) logits in the activation dtype plus the fp32 copy the
    cross-entropy keeps. Large for big vocabularies: 8192 x 128000 x 6 bytes is 6.3 GB.

    This is what an unfused cross-entropy's forward leaves (measured with
    :class:`parlib.measure.KeptAllocations`); its backward holds more for a moment, and the
    estimate counts that peak (:func:`loss_peak_bytes`)."""
    return seq_len * micro_batch * vocab_size * (dtype_bytes + 4) / t


# What a loss holds at its peak (its backward), by implementation:
# - "unfused": PyTorch's cross-entropy of the logits cast to fp32 (what a plain training loop
#   and the course's own code run): log-softmax's backward reads the fp32 output it saved and
#   the fp32 gradient NLL made, and writes the fp32 gradient of its input, all alive at once:
#   12 bytes a logit, whatever the logits' dtype (measured with KeptAllocations);
# - "in_place": Megatron-LM's vocab-parallel cross-entropy (megatron/core/tensor_parallel/
#   cross_entropy.py): one fp32 copy of the logits, turned into the softmax and then into the
#   gradient in place, and the gradient cast back to the logits' dtype: 4 + 2 bytes in bf16
#   (4 in fp32, where the copy is the logits themselves);
# - "fused": one kernel (flash-attn's cross_entropy, which llm-foundry's MPT uses): it keeps
#   the logits and writes their gradient, 2 x their dtype.
LOSSES = ("unfused", "in_place", "fused")


def check_loss(loss: str) -> None:
    """Raise ValueError naming :data:`LOSSES` unless ``loss`` is one of them."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def loss_peak_bytes(seq_len: int, micro_batch: int, vocab_size: int, *, t: int = 1,
                    dtype_bytes: int = 2, loss: str = "unfused") -> float:
    """Bytes a cross-entropy holds at once in its backward, for one microbatch on one of t
    ranks (vocabulary split t ways), logits of ``dtype_bytes``, by ``loss``
    (:data:`LOSSES`): 12 bytes a logit "unfused", 6 "in_place" in bf16, 4 "fused" in bf16.
    Held when the backward starts, beside every layer's saved activations: for a large
    vocabulary a large share of a step's peak (8192 x 128000 x 12 bytes is 12.6 GB)."""
    check_loss(loss)
    per_logit = {"unfused": 12, "in_place": 4 + (dtype_bytes if dtype_bytes < 4 else 0),
                 "fused": 2 * dtype_bytes}[loss]
    return seq_len * micro_batch * vocab_size * per_logit / t


# A backward pass of a memory-bound operation reads what its forward read (the saved input)
# and the output's gradient, and writes the input's gradient: about twice the forward's bytes.
MEMORY_BOUND_BACKWARD_PER_FORWARD = 2


def loss_bytes_per_token(vocab_size: int, *, t: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes an unfused cross-entropy reads and writes per token, forward and backward, on
    one of t ranks (vocabulary split t ways): memory-bound work no matmul hides, as large
    per token as a small model's layers together (V = 50,368 in bf16: 1.4 MB a token).

    Per logit: 16-bit logits are upcast to fp32 (read ``dtype_bytes``, write 4), the
    log-softmax reads and writes fp32 (8), its backward reads the saved fp32 output and
    writes the fp32 gradient (8), cast back to the logits' dtype (read 4, write
    ``dtype_bytes``); fp32 logits skip both casts. In bf16 28 bytes a logit, in fp32 16.
    The matmul that makes the logits is counted as compute, not here."""
    _require_at_least_one(vocab_size=vocab_size, t=t, dtype_bytes=dtype_bytes)
    casts = 2 * (dtype_bytes + 4) if dtype_bytes < 4 else 0
    return vocab_size * (casts + 8 + 8) / t


def optimizer_step_bytes_per_param(mixed_precision: bool = False) -> int:
    """Bytes Adam's update reads and writes per parameter its rank updates (a memory-bound
    pass over the model state, :func:`model_state_bytes_per_param`): it reads the gradient
    and the optimizer state and writes the state and the weight; in fp32 the weight is
    also the master copy it reads. 28 bytes in fp32 (read 4 + 4 + 8, write 4 + 8) and in
    mixed precision (read 2 + 12, write 12 + the 2-byte weight)."""
    per = model_state_bytes_per_param(mixed_precision)
    reads = per["grads"] + per["optimizer"] + (0 if mixed_precision else per["params"])
    return reads + per["optimizer"] + per["params"]


def gradient_cast_bytes_per_param(grad_bytes: int, reduce_bytes: int) -> int:
    """Bytes a rank reads and writes per gradient element to reduce its gradients in a wider
    dtype than the backward made them in: PyTorch's FSDP casts the unsharded bf16 gradient
    to ``reduce_dtype`` before the reduce-scatter (FSDP1's post-backward hook,
    ``flat_param.grad.to(reduce_dtype)``; FSDP2's ``foreach_reduce``): read ``grad_bytes``,
    write ``reduce_bytes``, 6 bytes for bf16 to fp32. 0 when the reduction keeps the
    gradients' dtype (nothing is cast)."""
    _require_at_least_one(grad_bytes=grad_bytes, reduce_bytes=reduce_bytes)
    return grad_bytes + reduce_bytes if reduce_bytes > grad_bytes else 0


def memory_bound_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                                 *, t: int = 1, sequence_parallel: bool = False,
                                 dtype_bytes: int = 2, ffn_dim: int | None = None,
                                 gated_mlp: bool = False, dropout: bool = False,
                                 scores_stored: bool = True) -> float:
    """Bytes one transformer layer's memory-bound operations read and write in one forward,
    per microbatch, on one of t ranks: the work that is limited by memory bandwidth, not by
    FLOPs (each element is touched once or twice, so no matmul hides it).

    Per token, in elements of ``dtype_bytes`` (reads plus writes):

    - two norms, each reads h and writes h: 4h; two residual adds, each reads 2h and writes
      h: 6h; with dropout, two dropouts of h (read, write, a 1-byte mask): 4h + 2h bytes.
      Split t ways only by sequence parallelism (otherwise every TP rank runs them whole).
    - the MLP's activation: GELU reads f and writes f (2f); gated (SwiGLU) reads 2f, writes
      f (3f). Split t ways.
    - when the attention scores are stored (no fused kernel: ``scores_stored``), the softmax
      reads and writes a x s scores (2as), with dropout also its mask (a x s bytes) and
      output (2as). Split t ways. A fused (Flash) kernel keeps them on chip: none.

    Backward moves about :data:`MEMORY_BOUND_BACKWARD_PER_FORWARD` times these bytes.
    """
    _require_at_least_one(seq_len=seq_len, micro_batch=micro_batch, d_model=d_model,
                          n_heads=n_heads, t=t, dtype_bytes=dtype_bytes)
    s, b, h, a = seq_len, micro_batch, d_model, n_heads
    f = 4 * h if ffn_dim is None else ffn_dim
    tokens = s * b
    replicated = (10 * h + (4 * h if dropout else 0)) * dtype_bytes + (2 * h if dropout else 0)
    activation = (3 if gated_mlp else 2) * f * dtype_bytes
    scores = 0 if not scores_stored else a * s * (
        2 * dtype_bytes + ((2 * dtype_bytes + 1) if dropout else 0))
    seq_split = t if sequence_parallel else 1
    return tokens * (replicated / seq_split + (activation + scores) / t)


def model_activation_bytes(seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                           n_layers: int, vocab_size: int, *, recompute: str = "none",
                           dtype_bytes: int = 4) -> float:
    """Activation bytes a whole GPT (no dropout, attention that keeps no s x s scores, as
    ``scaled_dot_product_attention`` on the CPU) keeps for backward on one rank: ``n_layers``
    x :func:`activation_bytes_per_layer` (its "selective" count unless ``recompute`` is
    "full": each layer's input only, or "attention": attention alone recomputed from its
    input, so Q, K, V and the attention output are not kept), the final norm's input and
    output (2 x s x b x h),
    and the logits the loss keeps: 16-bit logits also keep the fp32 copy of
    :func:`logits_bytes`; fp32 logits are that copy. The norms' statistics (two values per
    row and position) are not counted: they are the gap a measurement shows."""
    modes = tuple(m for m in RECOMPUTE_MODES if m != "op") + ("attention",)
    if recompute not in modes:
        raise ValueError(f"recompute must be one of {modes}, got {recompute!r}")
    layer = activation_bytes_per_layer(seq_len, micro_batch, d_model, n_heads,
                                       recompute="full" if recompute == "full" else "selective",
                                       dtype_bytes=dtype_bytes, dropout=False)
    if recompute == "attention":  # Q, K, V and the attention output: 4 x s x b x h
        layer -= 4 * seq_len * micro_batch * d_model * dtype_bytes
    logits = (logits_bytes(seq_len, micro_batch, vocab_size, dtype_bytes=dtype_bytes)
              if dtype_bytes < 4 else seq_len * micro_batch * vocab_size * dtype_bytes)
    final_norm = 2 * seq_len * micro_batch * d_model * dtype_bytes
    return n_layers * layer + final_norm + logits


__all__ = ["LOSSES", "LSE_BYTES_PER_HEAD", "check_loss",
           "MEMORY_BOUND_BACKWARD_PER_FORWARD", "RECOMPUTE_MODES", "loss_peak_bytes",
           "activation_bytes_per_layer",
           "memory_bound_bytes_per_layer", "gradient_cast_bytes_per_param",
           "adam_bytes_per_param", "logits_bytes",
           "loss_bytes_per_token", "optimizer_step_bytes_per_param",
           "model_activation_bytes",
           "model_state_bytes", "model_state_bytes_by_kind", "model_state_bytes_per_param",
           "model_state_formula"]
