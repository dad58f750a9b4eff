"""Zero2 when a unit's parameters get gradients on some ranks only (a branch one rank skips):
equal to one device. Before, the rank with the gradients reduce-scattered that unit during
backward and the other only in finish_gradient_synchronization; collectives pair by order,
so two equal-sized units swapped gradients with no error.

The model's units are all the same size, so a mispairing is a silent wrong answer (not a
hang or a size error): exactly what these tests must catch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlib
from parlib.measure import CommLog
from parlib.model import ModelConfig, build_model, loss_fn, make_batch
from parlib.strategies.data import shard_rows
from parlib.strategies.sharded import Zero2

WIDTH, ROWS, STEPS, LR = 4, 4, 2, 0.1


class Branches(nn.Module):
    """Three equal residual blocks; ``skip`` leaves out block 1 (its parameters get no
    gradient from these rows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                x = x + torch.tanh(block(x))
        return x


def _rows(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, WIDTH, generator=gen)


def _loss(model: nn.Module, step: int, rank: int, skip: bool) -> torch.Tensor:
    x, y = _rows(step, rank)
    return ((model(x, skip) - y) ** 2).mean()


def _one_device(skips: list[bool]) -> dict[str, torch.Tensor]:
    """Every rank's rows on one device: the mean of the ranks' losses (equal shares)."""
    model = Branches()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(_loss(model, step, r, s) for r, s in enumerate(skips)) / len(skips)
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _zero2(skips: list[bool]) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model = Branches()
    zero2 = Zero2(model, torch.optim.SGD, lr=LR)
    for step in range(STEPS):
        _loss(model, step, rank, skips[rank]).backward()
        zero2.step()
        zero2.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("skips", [[False, True], [True, False], [True, True], [False, False]],
                         ids=["rank 1 skips", "rank 0 skips", "both skip", "none skips"])
def test_a_branch_skipped_on_some_ranks_equals_one_device(skips):
    want = _one_device(skips)
    for rank, got in enumerate(parlib.launch(_zero2, skips, world_size=2)):
        for name, value in want.items():
            err = (got[name] - value).abs().max().item()
            assert err < 1e-6, f"{skips}: rank {rank}, {name} off by {err:.3g}"


CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=3)


def _reduced_during_backward() -> tuple[list[bool], list[str]]:
    """On the course's model, every unit is still reduce-scattered during backward (the
    fixed order is backward's own), not held back until finish."""
    rank = dist.get_rank()
    model = build_model(CFG)
    zero2 = Zero2(model, torch.optim.SGD, lr=LR)
    x, y = (shard_rows(t, rank, 2) for t in make_batch(8, CFG, 0, 0))
    with CommLog() as log:
        loss_fn(model(x), y).backward()
        in_backward = [s.tensor.grad is not None for s in zero2.shards]
        zero2.finish_gradient_synchronization()
    return in_backward, [r.op for r in log.records]


def test_the_usual_path_still_overlaps_backward_and_adds_no_collective():
    for in_backward, ops in parlib.launch(_reduced_during_backward, world_size=2):
        assert all(in_backward)
        assert ops == ["reduce_scatter"] * (CFG.n_layers + 1)  # the blocks, then the rest
