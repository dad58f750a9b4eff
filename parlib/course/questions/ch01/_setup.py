"""What the data-parallel chapter's rank exercises share: a small model (a fraction of a
second per launch), its learning rate and seed."""

from __future__ import annotations

import torch

LR = 0.1
SEED = 1


def cfg():
    from parlib.model import ModelConfig

    return ModelConfig(seq_len=16, d_model=32, n_heads=2, n_layers=1)


def flat(tensors) -> torch.Tensor:
    """The tensors (parameters, or a reference's values) as one flat vector."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])
