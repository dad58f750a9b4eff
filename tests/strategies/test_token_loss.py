"""The global-token loss against per-microbatch means, under padding that differs by row.

Eight rows of up to five tokens, each row padded (targets = -100) after its own length, so
microbatches and ranks hold different numbers of real tokens. Split over dp ranks and m
microbatches, with the gradients averaged over the ranks as the course's syncs do: averaging
per-microbatch means gives a loss and gradients that move with m and dp (only dp = m = 1 is
one device's); the global-token form gives one device's loss and gradients at every layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import parlib
from parlib import verify
from parlib.strategies.data import allreduce_gradients, shard_rows
from parlib.strategies.token_loss import (
    IGNORE_INDEX,
    global_token_count,
    global_token_loss,
    real_tokens,
)

V, D, ROWS, LENGTH = 11, 6, 8, 5
LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2)]  # (dp, m)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, D), nn.Tanh(), nn.Linear(D, V))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(V, (ROWS, LENGTH), generator=g)
    targets = torch.randint(V, (ROWS, LENGTH), generator=g)
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])  # real tokens per row: all different sums
    targets[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return tokens, targets


def step(m: int, form: str) -> dict:
    """This rank's rows in m microbatches; the loss reported and the synced gradients."""
    dp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    net = model()
    tokens, targets = (shard_rows(t, rank, dp) for t in batch())
    micro = list(zip(tokens.chunk(m), targets.chunk(m)))
    total = global_token_count([y for _, y in micro])
    reported = torch.zeros(())
    for x, y in micro:
        logits = net(x)
        if form == "global":
            loss = global_token_loss(logits, y, total, averaged_over=dp)
        else:  # the mean over this microbatch's real tokens, averaged over the m microbatches
            loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)) / m
        loss.backward()
        reported += loss.detach()
    if dist.is_initialized():
        allreduce_gradients(net)  # sum over the ranks, / dp
        dist.all_reduce(reported)
    return {"loss": reported / dp, "grads": {n: p.grad for n, p in net.named_parameters()}}


def _both_forms(m_values: list[int]) -> dict:
    return {(m, form): step(m, form) for m in m_values for form in ("mean", "global")}


def one_device() -> dict:
    net = model()
    tokens, targets = batch()
    loss = F.cross_entropy(net(tokens).reshape(-1, V), targets.reshape(-1))  # / real tokens
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in net.named_parameters()}}


@pytest.fixture(scope="module")
def results() -> dict:
    out = {}
    for dp in sorted({dp for dp, _ in LAYOUTS}):
        ms = [m for d, m in LAYOUTS if d == dp]
        got = _both_forms(ms) if dp == 1 else parlib.launch(_both_forms, ms, world_size=dp,
                                                             timeout=120)[0]
        out.update({(dp, m, form): r for (m, form), r in got.items()})
    return out


def test_the_padding_is_uneven_across_microbatches_and_ranks():
    _, targets = batch()
    per_row = [int(real_tokens(row)) for row in targets]
    assert len(set(per_row)) > 1 and sum(per_row) == 23
    assert int(global_token_count(targets)) == 23  # one device: no all-reduce


@pytest.mark.parametrize("dp, m", LAYOUTS)
def test_global_token_loss_is_one_devices_at_every_layout(results, dp, m):
    ref, got = one_device(), results[(dp, m, "global")]
    assert verify.close(got["loss"], ref["loss"])
    assert verify.compare(got["grads"], ref["grads"])


@pytest.mark.parametrize("dp, m", [layout for layout in LAYOUTS if layout != (1, 1)])
def test_per_microbatch_means_move_with_m_and_dp(results, dp, m):
    ref, got = one_device(), results[(dp, m, "mean")]
    assert verify.compare(results[(1, 1, "mean")]["grads"], ref["grads"])  # one microbatch
    assert not verify.close(got["loss"], ref["loss"])
    assert not verify.compare(got["grads"], ref["grads"])


def test_bad_counts_are_refused():
    logits, targets = torch.zeros(2, V), torch.full((2,), IGNORE_INDEX)
    with pytest.raises(ValueError, match="no real token"):
        global_token_loss(logits, targets, global_token_count(targets))
    with pytest.raises(ValueError, match="averaged_over"):
        global_token_loss(logits, torch.zeros(2, dtype=torch.long), 2, averaged_over=0)
    with pytest.raises(ValueError, match="no microbatch"):
        global_token_count([])
