"""Mixture of experts and expert parallelism: parameters, routing traffic, capacity, compute.

A mixture-of-experts layer replaces the MLP with E expert MLPs (h -> f -> h) and a router
(h x E); each token runs k of them. Expert parallelism puts E/ep experts on each of ep
ranks: parameters per rank fall by ep, compute per token stays that of k experts, and
every layer moves each kept choice's hidden vector to its expert's rank and back (an
all-to-all each way), forward and backward alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PASSES = ("forward", "backward")


def _split(n_experts: int, ep: int) -> int:
    if ep < 1 or n_experts < 1 or n_experts % ep:
        raise ValueError(f"n_experts={n_experts} experts do not split over ep={ep} ranks "
                         "(E must be divisible by ep)")
    return n_experts // ep


def expert_params(h: int, expert_hidden: int, bias: bool = True) -> int:
    """One expert MLP h -> f -> h: 2 h f weights, plus f + h biases."""
    return 2 * h * expert_hidden + ((expert_hidden + h) if bias else 0)


def moe_params_per_rank(n_experts: int, ep: int, h: int, expert_hidden: int,
                        bias: bool = True) -> int:
    """One MoE layer's parameters on one of ep ranks: E/ep experts, and the router (h x E,
    no bias) replicated on every rank."""
    return _split(n_experts, ep) * expert_params(h, expert_hidden, bias) + h * n_experts


def expert_flops_per_token(h: int, expert_hidden: int, top_k: int, n_experts: int = 0) -> int:
    """Forward FLOPs one token costs in an MoE layer: k experts of 2 x 2 h f each (two
    matmuls, multiply-add = 2), plus 2 h E for the router. The same whatever E is (but the
    router), which is the point: parameters grow with E, compute with k."""
    return top_k * 2 * 2 * h * expert_hidden + 2 * h * n_experts


def expert_capacity(assignments: int, n_experts: int, capacity_factor: float | None) -> int | None:
    """Choices one expert accepts: ceil(capacity_factor x T x k / E), T x k = ``assignments``
    (the fair share times the factor); None: no limit."""
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None), got {capacity_factor}")
    return math.ceil(round(capacity_factor * assignments / n_experts, 9))


def tokens_dropped(load: Sequence[int], capacity_factor: float | None) -> int:
    """Choices dropped when expert e is picked ``load[e]`` times: sum of max(0, load - C),
    C = :func:`expert_capacity` of sum(load) choices over len(load) experts."""
    if not load:
        raise ValueError("load needs one count per expert, got none")
    capacity = expert_capacity(sum(load), len(load), capacity_factor)
    if capacity is None:
        return 0
    return sum(max(0, n - capacity) for n in load)


def ep_all_to_all_bytes_per_layer(tokens: int, h: int, top_k: int, dtype_bytes: int = 4,
                                  passes: tuple[str, ...] = PASSES, dropped: int = 0) -> int:
    """Bytes one rank puts into the token all-to-alls of one MoE layer: each of its
    tokens x k choices (less the ``dropped``) sends an h-vector out (dispatch) and gets
    one back (combine), in forward; backward sends their gradients the same two ways.
    Includes the share a rank addresses to itself (it never leaves: see
    :func:`ep_expected_sent_fraction`). A rank's own messages are the dispatch and the
    combine's gradient (half of this); the other half are the rows it computed for others,
    which equals its own share when routing is balanced, and summed over the ep ranks the
    total is exact whatever the routing."""
    unknown = set(passes) - set(PASSES)
    if unknown:
        raise ValueError(f"passes must be among {PASSES}, got {sorted(unknown)}")
    return 2 * len(passes) * (tokens * top_k - dropped) * h * dtype_bytes


def ep_count_bytes_per_layer(n_experts: int, count_bytes: int = 8) -> int:
    """Bytes of the counts all-to-all (forward only): E/ep counts to each of ep ranks."""
    return n_experts * count_bytes


def ep_expected_sent_fraction(ep: int) -> float:
    """The share of the all-to-all bytes that leaves a rank when routing is uniform:
    (ep - 1)/ep (1/ep of the choices land on its own experts)."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    return (ep - 1) / ep


def load_imbalance(tokens_per_rank: Sequence[float]) -> float:
    """The busiest rank's tokens over the mean: the step waits for the busiest."""
    if not tokens_per_rank or sum(tokens_per_rank) <= 0:
        raise ValueError("need at least one rank with tokens")
    return max(tokens_per_rank) / (sum(tokens_per_rank) / len(tokens_per_rank))


__all__ = ["ep_all_to_all_bytes_per_layer", "ep_count_bytes_per_layer",
           "ep_expected_sent_fraction", "expert_capacity", "expert_flops_per_token",
           "expert_params", "load_imbalance", "moe_params_per_rank", "tokens_dropped"]
