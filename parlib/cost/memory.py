"""Memory formulas: model-state bytes per parameter and what ZeRO shards of them.

With Adam, every parameter carries its weight, its gradient and two moments. In fp32
that is 4 + 4 + 8 = 16 bytes. In mixed precision it is 2 (bf16 weight) + 2 (bf16
gradient) + 12 (fp32 master weight and two fp32 moments) = 16 bytes too; the 12 are
the optimizer state ZeRO-1 shards. ZeRO stage 1 shards the optimizer state over the N
data-parallel ranks, stage 2 also the gradients, stage 3 also the weights.
"""

from __future__ import annotations


def model_state_bytes_per_param(mixed_precision: bool = False) -> dict[str, int]:
    """Bytes per parameter by kind: {"params", "grads", "optimizer"} (Adam)."""
    if mixed_precision:
        return {"params": 2, "grads": 2, "optimizer": 12}
    return {"params": 4, "grads": 4, "optimizer": 8}


def adam_bytes_per_param(mixed_precision: bool = False) -> int:
    """Model-state bytes per parameter with Adam: 16 in fp32 and in mixed precision."""
    return sum(model_state_bytes_per_param(mixed_precision).values())


def model_state_bytes(n_params: float, world_size: int = 1, zero_stage: int = 0,
                      mixed_precision: bool = False) -> float:
    """Model-state bytes per rank with Adam under ZeRO stage 0-3 over ``world_size`` ranks.

    fp32: 16P unsharded; stage 1 gives 8P + 8P/N, stage 2 4P + 12P/N, stage 3 16P/N.
    Mixed precision: stage 1 gives 4P + 12P/N.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    per = model_state_bytes_per_param(mixed_precision)
    sharded_from = {"optimizer": 1, "grads": 2, "params": 3}
    return sum(per[kind] * n_params / (world_size if zero_stage >= stage else 1)
               for kind, stage in sharded_from.items())


__all__ = ["adam_bytes_per_param", "model_state_bytes", "model_state_bytes_per_param"]
