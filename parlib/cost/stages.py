"""Pipeline stages of uneven size: how many layers each of p stages holds when p does not
divide the layer count.

The rule (Llama 3's, Dubey et al. 2024, Sec. 3.3.2: "we reduce one Transformer layer each
from the first and the last stages"): every stage gets ceil(L / p) layers, and the layers
that are then too many are taken from the ends, one from the first stage, one from the
last, one from the second, one from the second-to-last, and so on. The ends are where the
embedding and the output layer (and, on the first stage, the most microbatches in flight)
already sit, so they are the ones to lighten. 126 layers in 16 stages: 16 x 8 = 128, two too
many, so the first and last stages get 7 and the fourteen others 8.

The step follows the slowest stage (the most layers); memory is that of the worst stage.

Interleaved (v model chunks per rank): the same rule over the p x v chunks, chunk j on rank
j mod p (:func:`rank_layers`). 126 layers in 16 x 2 chunks: 32 x 4 = 128, the first and
last chunks get 3, so rank 1 (chunks 1 and 17) holds 3 + 4 = 7 layers, rank 16 (chunks 16
and 32) 4 + 3 = 7, the others 8: the same stages as without interleaving.
"""

from __future__ import annotations


def stage_layers(n_layers: int, p: int) -> list[int]:
    """Layers of each of ``p`` pipeline stages, first to last (they sum to ``n_layers``)."""
    for name, value in (("n_layers", n_layers), ("p", p)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if p > n_layers:
        raise ValueError(f"p = {p} stages need at least one layer each, but the model has "
                         f"{n_layers} layers")
    most = -(-n_layers // p)  # ceil
    layers = [most] * p
    too_many = most * p - n_layers  # < p, so each stage loses at most one
    ends = [i // 2 if i % 2 == 0 else p - 1 - i // 2 for i in range(p)]  # 0, p-1, 1, p-2, ...
    for stage in ends[:too_many]:
        layers[stage] -= 1
    return layers


def rank_layers(n_layers: int, p: int, v: int = 1) -> list[int]:
    """Layers each of ``p`` pipeline ranks holds with ``v`` model chunks per rank: the
    p x v chunks split by :func:`stage_layers`, chunk j on rank j mod p (v = 1: the stages)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"v must be a positive integer, got {v!r}")
    if p * v > n_layers:
        raise ValueError(f"p x v = {p} x {v} = {p * v} model chunks need at least one layer "
                         f"each, but the model has {n_layers} layers")
    chunks = stage_layers(n_layers, p * v)
    return [sum(chunks[rank::p]) for rank in range(p)]


def stage_imbalance(n_layers: int, p: int) -> float:
    """The slowest stage's layers over the mean's, max(layers) x p / L: 1 when p divides L.
    The layers' share of a step stretches by this much (every stage waits for the slowest)."""
    return max(stage_layers(n_layers, p)) * p / n_layers


__all__ = ["rank_layers", "stage_imbalance", "stage_layers"]
