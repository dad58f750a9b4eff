"""Tensor-parallel communication (Megatron-LM, Shoeybi et al. 2019).

A transformer layer split t ways (attention by heads, MLP column-then-row) all-reduces
its (b, s, h) activations twice in forward (after attention, after the MLP) and twice
in backward (the gradients entering the two column-parallel regions). Sequence
parallelism (Korthikanti et al. 2022) replaces each all-reduce by a reduce-scatter plus
an all-gather: the same bytes on the wire.

Also here: sequence parallelism's small extra messages, the parameters one rank holds
under t-way tensor parallelism, and the LayerNorm activations sequence parallelism splits.
"""

from __future__ import annotations

from parlib.cost.collectives import predicted_sent_bytes
from parlib.cost.model import Model

ALL_REDUCES_PER_LAYER = {"forward": 2, "backward": 2}


def tp_message_bytes(b: int, s: int, h: int, dtype_bytes: int = 4) -> int:
    """The message of one tensor-parallel all-reduce: the (b, s, h) activations."""
    return b * s * h * dtype_bytes


def tp_sent_bytes_per_layer(b: int, s: int, h: int, t: int, dtype_bytes: int = 4,
                            passes: tuple[str, ...] = ("forward", "backward"), *,
                            split_mlp: bool = True) -> float:
    """Bytes one rank sends per transformer layer per step under t-way tensor
    parallelism: 2 all-reduces in forward and 2 in backward, each 2(t-1)/t x b*s*h*bytes.
    ``split_mlp=False``: the MLP is not split (a mixture of experts that every rank runs
    whole, :func:`parlib.strategies.tensor.tensor_parallel_block`), only attention's one
    all-reduce each way remains."""
    count = sum(ALL_REDUCES_PER_LAYER[p] for p in passes)
    if not split_mlp:
        count //= 2  # one of the two per pass is the MLP's
    return count * predicted_sent_bytes("all_reduce", tp_message_bytes(b, s, h, dtype_bytes), t)


__all__ = ["ALL_REDUCES_PER_LAYER", "tp_message_bytes", "tp_sent_bytes_per_layer"]


# --------------------------------------------------------------------------------------
# Sequence parallelism's extra messages, and parameters per rank under t-way TP
# --------------------------------------------------------------------------------------

# Under sequence parallelism, these replicated vectors of h elements act on s/t positions
# per rank, so their gradients are partial and are all-reduced in backward: ln1 and ln2
# (weight and bias each), and the biases of the two row-parallel layers (attention out,
# MLP down), added after the reduce-scatter.
SP_PARTIAL_GRAD_VECTORS_PER_LAYER = 6


def sp_sent_bytes_per_layer(b: int, s: int, h: int, t: int, dtype_bytes: int = 4) -> float:
    """Bytes one rank sends per layer per step under tensor + sequence parallelism: the
    activations (2 all-gathers + 2 reduce-scatters each way, the same bytes as the 4
    all-reduces of plain TP) plus the all-reduce of the 6h partial parameter gradients."""
    activations = tp_sent_bytes_per_layer(b, s, h, t, dtype_bytes)
    vectors = SP_PARTIAL_GRAD_VECTORS_PER_LAYER * predicted_sent_bytes(
        "all_reduce", h * dtype_bytes, t)
    return activations + vectors


def sp_boundary_sent_bytes(b: int, s: int, h: int, t: int, dtype_bytes: int = 4) -> float:
    """Bytes one rank sends per step at the two ends of the split-sequence stretch: the
    all-gather of the embedding's gradient (backward) and of the last block's output before
    the replicated head (forward), each (t-1)/t x b*s*h*bytes."""
    return 2 * predicted_sent_bytes("all_gather", tp_message_bytes(b, s, h, dtype_bytes), t)


def tp_layer_params(model: Model, t: int) -> dict[str, float]:
    """Parameters one rank holds of one transformer layer under t-way tensor parallelism
    (Megatron's split; ``model`` is a :class:`parlib.cost.model.Model`):

    - "split", 1/t each: the matrices of q, k, v, out and the MLP, and the biases of the
      column-parallel layers (q, k, v, up);
    - "replicated", whole on every rank: the two norms, and the biases of the row-parallel
      layers (out, down), added once after the reduction.
    """
    if t < 1 or model.n_kv_heads % t or model.ffn_dim % t:
        raise ValueError(f"t={t} must be >= 1 and divide the heads (n_kv_heads="
                         f"{model.n_kv_heads}) and ffn_dim={model.ffn_dim}")
    h, kv, f = model.d_model, model.kv_dim, model.ffn_dim
    column_biases = h + 2 * kv + (2 if model.gated_mlp else 1) * f if model.bias else 0
    split = model.layer_matmul_params + column_biases
    replicated = model.layer_params - split  # the norms and the row-parallel biases
    return {"split": split / t, "replicated": float(replicated)}


def tp_params_per_rank(model: Model, t: int) -> float:
    """Parameters one rank holds of the whole model under t-way tensor parallelism: each
    layer's split part / t and replicated part, plus the embeddings and the head, which
    stay whole (a vocabulary-parallel embedding and head would split them too)."""
    layer = tp_layer_params(model, t)
    return (model.n_layers * (layer["split"] + layer["replicated"]) + model.embedding_params
            + model.head_params)


__all__ += ["SP_PARTIAL_GRAD_VECTORS_PER_LAYER", "sp_boundary_sent_bytes",
            "sp_sent_bytes_per_layer", "tp_layer_params", "tp_params_per_rank"]


# --------------------------------------------------------------------------------------
# Activation memory
# --------------------------------------------------------------------------------------


def layernorm_saved_bytes_per_layer(b: int, s: int, h: int, t: int = 1,
                                    sequence_parallel: bool = False,
                                    dtype_bytes: int = 4) -> float:
    """Bytes the two LayerNorms of one course TinyGPT block keep for backward on each rank:
    their input (b*s*h) and each position's mean and 1/std (2*b*s). Tensor parallelism
    leaves them whole; sequence parallelism runs them on s/t positions. (The norms' share
    of :func:`parlib.cost.memory.activation_bytes_per_layer`, plus the statistics, for the
    measured model.)"""
    positions = s / t if sequence_parallel else s
    return 2 * (b * positions * h + 2 * b * positions) * dtype_bytes


__all__ += ["layernorm_saved_bytes_per_layer"]
