"""Sharded data parallelism: bytes each rank sends per step under ZeRO stage 0-3.

Plain data parallelism (and ZeRO-1, ZeRO-2) moves every gradient once through a
reduce-scatter and every weight once through an all-gather: an all-reduce's worth,
2 x P x (N-1)/N message bytes per rank. ZeRO-3 gathers the weights twice, before a unit's
forward and again before its backward (they were freed in between), so 3 x P x (N-1)/N.
HSDP (ZeRO-3 inside a shard group, its copies replicated) is
:func:`hsdp_sent_bytes_per_step`. The per-rank memory of each stage is
:func:`parlib.cost.memory.model_state_bytes_by_kind`.
"""

from __future__ import annotations

from parlib.cost.collectives import predicted_sent_bytes

# per step: (weight all-gathers, gradient reduce-scatters); plain DP's all-reduce is one of each
_PASSES = {0: (1, 1), 1: (1, 1), 2: (1, 1), 3: (2, 1)}


def zero_sent_bytes_per_step(n_params: float, world_size: int, zero_stage: int,
                             dtype_bytes: int = 4) -> float:
    """Bytes one rank sends per step (ring collectives) under ZeRO ``zero_stage`` over
    ``world_size`` ranks, messages of ``dtype_bytes`` per element (2 in bf16/fp16).

    Stages 0-2: 2 x P x (N-1)/N x bytes; stage 3: 3 x P x (N-1)/N x bytes. ``n_params`` is
    what goes on the wire: with shards padded to N equal pieces, the padded count."""
    if zero_stage not in _PASSES:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    gathers, scatters = _PASSES[zero_stage]
    nbytes = n_params * dtype_bytes
    return (gathers * predicted_sent_bytes("all_gather", nbytes, world_size)
            + scatters * predicted_sent_bytes("reduce_scatter", nbytes, world_size))


def hsdp_sent_bytes_per_step(n_params: float, shard_size: int, replicas: int,
                             dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step under HSDP, by axis: r copies of the model, each
    sharded ZeRO-3 style over ``shard_size`` = s ranks (``replicas`` = r).

    ``"dp_shard"``: ZeRO-3's inside the shard group, 3 x P x (s-1)/s x bytes;
    ``"dp_replicate"``: one all-reduce of this rank's 1/s gradient piece across the copies,
    2 x (P/s) x (r-1)/r x bytes. ``n_params``: the padded count (a multiple of s)."""
    if shard_size < 1 or replicas < 1:
        raise ValueError(f"shard_size and replicas must be >= 1, got {shard_size!r}, "
                         f"{replicas!r}")
    piece = n_params / shard_size * dtype_bytes
    return {"dp_shard": zero_sent_bytes_per_step(n_params, shard_size, 3, dtype_bytes),
            "dp_replicate": predicted_sent_bytes("all_reduce", piece, replicas)}


def padded_numel(numel: int, world_size: int) -> int:
    """Elements of a tensor flattened and zero-padded to ``world_size`` equal shards."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    return -(-numel // world_size) * world_size


__all__ = ["hsdp_sent_bytes_per_step", "padded_numel", "zero_sent_bytes_per_step"]
