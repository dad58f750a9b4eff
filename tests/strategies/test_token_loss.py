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
from parlib.model import (
    ModelConfig,
    build_model,
    loss_share,
    make_batch,
    make_optimizer,
    train_step,
)
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
    # the course's loss_share: a count of 0 would give nan (0 / 0), not an error
    with pytest.raises(ValueError, match="batch_tokens=0.*pass global_token_count"):
        loss_share(logits, targets, 0)


TINY = ModelConfig(vocab_size=32, seq_len=6, d_model=16, n_heads=2, n_layers=1)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of the model's stream, padded after 6, 1, 4 and 2 real targets: on 2 ranks,
    rank 0 holds 7 real targets, rank 1 holds 6."""
    tokens, targets = make_batch(4, TINY)
    lengths = torch.tensor([6, 1, 4, 2])
    targets[torch.arange(TINY.seq_len)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return tokens, targets


def _train_step_on_rows(with_group: bool) -> dict:
    """parlib.model.train_step on this rank's rows, gradients averaged over the ranks."""
    net = build_model(TINY)
    opt = make_optimizer(net.parameters(), "sgd", lr=0.5)
    x, y = (shard_rows(t, dist.get_rank(), dist.get_world_size()) for t in padded_batch())
    sync = lambda: allreduce_gradients(net)  # noqa: E731
    loss = (train_step(net, opt, x, y, sync, group=dist.group.WORLD) if with_group
            else train_step(net, opt, x, y, sync))
    return {"loss": loss, "weights": {n: p.detach().clone() for n, p in net.named_parameters()}}


def test_the_course_train_step_over_ranks_is_one_devices_step_under_uneven_padding():
    """With ``group``, parlib.model.train_step on 2 ranks holding 7 and 6 real targets steps
    the weights as one device does on the whole batch; without it (the mean of each rank's
    mean, the old step) it does not."""
    net = build_model(TINY)
    opt = make_optimizer(net.parameters(), "sgd", lr=0.5)
    want_loss = train_step(net, opt, *padded_batch())
    want = {n: p.detach() for n, p in net.named_parameters()}
    grouped = parlib.launch(_train_step_on_rows, True, world_size=2, timeout=120)
    per_rank_means = parlib.launch(_train_step_on_rows, False, world_size=2, timeout=120)[0]
    assert all(verify.close(r["loss"], want_loss) for r in grouped)
    assert all(verify.compare(r["weights"], want) for r in grouped)
    assert not verify.compare(per_rank_means["weights"], want)


def test_a_batch_with_no_real_target_is_refused_by_name():
    with pytest.raises(parlib.RankError, match="no rank of the group has a real target"):
        parlib.launch(_all_ignored_step, world_size=2, timeout=60)


def _all_ignored_step() -> None:
    net = build_model(TINY)
    x, y = make_batch(2, TINY)
    train_step(net, make_optimizer(net.parameters()), x, torch.full_like(y, IGNORE_INDEX),
               group=dist.group.WORLD)
