"""Tensor-parallel communication (Megatron-LM, Shoeybi et al. 2019).

A transformer layer split t ways (attention by heads, MLP column-then-row) all-reduces
its (b, s, h) activations twice in forward (after attention, after the MLP) and twice
in backward (the gradients entering the two column-parallel regions). Sequence
parallelism (Korthikanti et al. 2022) replaces each all-reduce by a reduce-scatter plus
an all-gather: the same bytes on the wire.
"""

from __future__ import annotations

from parlib.cost.collectives import predicted_sent_bytes

ALL_REDUCES_PER_LAYER = {"forward": 2, "backward": 2}


def tp_message_bytes(b: int, s: int, h: int, dtype_bytes: int = 4) -> int:
    """The message of one tensor-parallel all-reduce: the (b, s, h) activations."""
    return b * s * h * dtype_bytes


def tp_sent_bytes_per_layer(b: int, s: int, h: int, t: int, dtype_bytes: int = 4,
                            passes: tuple[str, ...] = ("forward", "backward")) -> float:
    """Bytes one rank sends per transformer layer per step under t-way tensor
    parallelism: 2 all-reduces in forward and 2 in backward, each 2(t-1)/t x b*s*h*bytes."""
    count = sum(ALL_REDUCES_PER_LAYER[p] for p in passes)
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


def tp_layer_params(h: int, mlp_width: int, t: int, bias: bool = True) -> dict[str, float]:
    """Parameters one rank holds of one transformer layer under t-way TP:
    {"split": 1/t of q, k, v, out (4h^2) and MLP up, down (2h x mlp_width), plus the biases
    of q, k, v, up; "replicated": the biases of out and down, and two LayerNorms (4h)}."""
    if t < 1 or h % t or mlp_width % t:
        raise ValueError(f"t={t} must be >= 1 and divide h={h} and mlp_width={mlp_width}")
    split = 4 * h * h + 2 * h * mlp_width + (3 * h + mlp_width if bias else 0)
    replicated = 4 * h + (2 * h if bias else 0)
    return {"split": split / t, "replicated": float(replicated)}


def tp_params_per_rank(vocab: int, s: int, h: int, n_layers: int, mlp_width: int,
                       t: int) -> float:
    """Parameters one rank holds of the course's TinyGPT under t-way TP: the split layers'
    1/t, plus what stays whole (token and position embeddings, final LayerNorm and the
    vocabulary projection, and each layer's replicated vectors)."""
    layer = tp_layer_params(h, mlp_width, t)
    whole = vocab * h + s * h + 2 * h + h * vocab + vocab
    return n_layers * (layer["split"] + layer["replicated"]) + whole


__all__ += ["SP_PARTIAL_GRAD_VECTORS_PER_LAYER", "sp_boundary_sent_bytes",
            "sp_sent_bytes_per_layer", "tp_layer_params", "tp_params_per_rank"]


# --------------------------------------------------------------------------------------
# Activation memory
# --------------------------------------------------------------------------------------


def megatron_activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                                        sequence_parallel: bool = False) -> float:
    """Activation bytes one rank stores per transformer layer for backward, 16-bit
    activations with dropout, no recomputation (Korthikanti et al. 2022, Table 2):
    sbh(34 + 5as/h) on one device; sbh(10 + 24/t + 5as/(ht)) under t-way TP (the 10
    are the LayerNorm and dropout activations every rank keeps whole); and
    sbh/t (34 + 5as/h) with sequence parallelism as well. ``a`` is the number of heads."""
    sbh = s * b * h
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def layernorm_saved_bytes_per_layer(b: int, s: int, h: int, t: int = 1,
                                    sequence_parallel: bool = False,
                                    dtype_bytes: int = 4) -> float:
    """Bytes the two LayerNorms of one course TinyGPT block keep for backward on each rank:
    their input (b*s*h) and each position's mean and 1/std (2*b*s). Tensor parallelism
    leaves them whole; sequence parallelism runs them on s/t positions."""
    positions = s / t if sequence_parallel else s
    return 2 * (b * positions * h + 2 * b * positions) * dtype_bytes


__all__ += ["layernorm_saved_bytes_per_layer", "megatron_activation_bytes_per_layer"]
