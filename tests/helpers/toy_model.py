"""The drop-ins' toy model: tied, frozen and buffer weights, and a branch only rank 0's rows
take (tests/strategies/test_data_parallel.py and test_fsdp.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, D, B, K = 16, 8, 8, 3  # vocabulary, width, global batch rows, steps
N = 2
RANK0_SEED = 100


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(D, D)
        self.extra = nn.Linear(D, D)  # only rows with flag=1 use it
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", 1 + 0.1 * torch.randn(D))

    def forward(self, tokens: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(tokens) * self.scale))
        h = torch.tanh(self.hidden(h))
        if flag.any():  # rank 1's rows never do: its `extra` gets no gradient at all
            h = h + flag[:, None].to(h.dtype) * self.extra(h)
        return self.head(h)


def seeded_toy(seed: int) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (B,), generator=g)
    targets = torch.randint(VOCAB, (B,), generator=g)
    flag = (torch.arange(B) < B // N).float()  # rank 0's rows
    return tokens, targets, flag
