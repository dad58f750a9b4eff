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
