"""Checkpoint bytes per rank and in total, and Young/Daly's interval, against cases worked by
hand (P = 1000 parameters, Adam: 4 + 8 bytes saved a parameter in fp32, 2 + 12 in mixed
precision; gradients are not saved)."""

import doctest

import pytest

import parlib.cost.checkpoint as checkpoint
import parlib.cost.memory as memory
from parlib import cost
from parlib.cost import Layout

P = 1000


@pytest.mark.parametrize("strategy, layout, per_rank, total", [
    ("dp", {}, 12 * P, 12 * P),                        # one rank: everything
    ("dp", {"dp": 4}, 12 * P, 12 * P),                 # one copy written, by one rank
    ("zero1", {"dp": 4}, 4 * P + 8 * P / 4, 12 * P),   # weights whole, moments / 4
    ("zero2", {"dp": 4}, 4 * P + 8 * P / 4, 12 * P),   # ZeRO-2's sharded gradients: unsaved
    ("zero3", {"dp": 4}, 12 * P / 4, 12 * P),
    ("fsdp", {"dp": 4}, 12 * P / 4, 12 * P),
    ("dp", {"tp": 2}, 12 * P / 2, 12 * P),             # each tp rank its half of every weight
    ("dp", {"pp": 4, "dp": 2}, 12 * P / 4, 12 * P),    # a stage: a quarter of the layers
    ("fsdp", {"dp": 2, "tp": 2}, 12 * P / 4, 12 * P),  # fsdp over dp of a tp half
    ("zero1", {"dp": 2, "cp": 2}, 4 * P + 8 * P / 4, 12 * P),  # cp ranks are copies too
])
def test_fp32_bytes_per_rank_and_total(strategy, layout, per_rank, total):
    got = cost.checkpoint_bytes(P, strategy, layout)
    assert (got.per_rank, got.total) == (pytest.approx(per_rank), pytest.approx(total))
    assert got.ranks == Layout.of(layout).world


def test_mixed_precision_saves_bf16_weights_master_and_moments():
    # 2 (bf16 weights) + 12 (fp32 master, two moments) = 14 bytes a parameter
    assert cost.checkpoint_bytes(P, "fsdp", {"dp": 4}, mixed_precision=True).per_rank == 3500
    zero1 = cost.checkpoint_bytes(P, "zero1", {"dp": 4}, mixed_precision=True)
    assert (zero1.per_rank, zero1.total) == (2 * P + 12 * P / 4, 14 * P)
    assert zero1.by_kind == {"params": 2 * P, "optimizer": 12 * P, "step": 0}


def test_every_rank_writing_its_copy_multiplies_the_replicated_bytes_only():
    every = cost.checkpoint_bytes(P, "dp", {"dp": 4}, writers="every")
    assert (every.per_rank, every.total) == (12 * P, 4 * 12 * P)
    zero1 = cost.checkpoint_bytes(P, "zero1", {"dp": 4}, writers="every")
    assert zero1.by_kind == {"params": 4 * 4 * P, "optimizer": 8 * P, "step": 0}
    fsdp = cost.checkpoint_bytes(P, "fsdp", {"dp": 4}, writers="every")  # nothing replicated
    assert fsdp.total == 12 * P


def test_step_counters_are_four_bytes_each_once_per_model_slice():
    got = cost.checkpoint_bytes(P, "fsdp", {"dp": 4, "tp": 2}, step_tensors=10)
    assert got.by_kind["step"] == 10 * 4 * 2  # each tp half has its 10 counters
    assert got.per_rank == 12 * P / 8 + 40
    assert cost.checkpoint_bytes(P, "fsdp", {"dp": 4}, writers="every",
                                 step_tensors=10).by_kind["step"] == 4 * 40


def test_bytes_come_from_the_memory_module(monkeypatch):
    """One formula: change memory's per-parameter bytes and the checkpoint follows."""
    monkeypatch.setattr(memory, "model_state_bytes_per_param",
                        lambda mixed_precision=False: {"params": 1, "grads": 100,
                                                       "optimizer": 2})
    assert cost.checkpoint_bytes(P, "zero1", {"dp": 2}).per_rank == 1 * P + 2 * P / 2


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="strategy must be one of dp, zero1"):
        cost.checkpoint_bytes(P, "zero4")
    with pytest.raises(ValueError, match="writers"):
        cost.checkpoint_bytes(P, "dp", writers="rank0")
    with pytest.raises(ValueError, match="ep=2"):
        cost.checkpoint_bytes(P, "fsdp", {"dp": 2, "ep": 2})
    with pytest.raises(ValueError, match="step_tensors"):
        cost.checkpoint_bytes(P, step_tensors=-1)
    with pytest.raises(ValueError, match="save_time must be > 0"):
        cost.young_daly_interval(0, 3600)
    with pytest.raises(ValueError, match="restart_time"):
        cost.checkpoint_overhead_per_hour(60, 1, 3600, restart_time=-1)


def test_young_daly_interval_by_hand():
    # a 1-minute save and a failure a day: sqrt(2 x 60 x 86400) = sqrt(10 368 000) = 3219.9 s
    assert cost.young_daly_interval(60, 86400) == pytest.approx(3219.94, abs=0.01)
    # a 10-second save, a failure an hour: sqrt(72 000) = 268.3 s
    assert cost.young_daly_interval(10, 3600) == pytest.approx(268.33, abs=0.01)


def test_overhead_per_hour_by_hand_and_smallest_at_the_interval():
    # every 600 s, a 60 s save, a failure every 10 hours, 300 s to restart:
    # spent 3600 x 60 / 600 = 360 s; lost 0.1 failures an hour x (300 + 300) = 60 s
    assert cost.checkpoint_overhead_per_hour(600, 60, 36000, restart_time=300) == {
        "spent": 360.0, "lost": 60.0, "total": 420.0}
    best = cost.young_daly_interval(60, 36000)
    at = cost.checkpoint_overhead_per_hour(best, 60, 36000)
    assert at["spent"] == pytest.approx(at["lost"])
    for factor in (0.5, 0.9, 1.1, 2.0):
        other = cost.checkpoint_overhead_per_hour(best * factor, 60, 36000)
        assert other["total"] > at["total"]


def test_docstring_examples_run():
    result = doctest.testmod(checkpoint)
    assert result.attempted >= 7 and result.failed == 0


def test_flat_shard_range_short_and_empty_last_pieces():
    assert [cost.flat_shard_range(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3),
                                                                 (3, 3)]
    assert [cost.flat_shard_range(35, 3, r) for r in range(3)] == [(0, 12), (12, 24), (24, 35)]
    with pytest.raises(ValueError, match="rank must be in"):
        cost.flat_shard_range(10, 2, 2)


@pytest.mark.parametrize("numel", [1, 3, 10, 35, 178])
@pytest.mark.parametrize("saved, now", [(4, 2), (2, 4), (4, 3), (3, 4), (1, 5), (5, 1)])
def test_reshard_reads_rebuild_every_piece_exactly_once(numel, saved, now):
    for rank in range(now):
        lo, hi = cost.flat_shard_range(numel, now, rank)
        reads = cost.reshard_reads(numel, saved, now, rank)
        assert [(a, b) for _, a, b in reads] == sorted((a, b) for _, a, b in reads)
        assert sum(b - a for _, a, b in reads) == hi - lo  # nothing missing, nothing twice
        assert all(lo <= a < b <= hi for _, a, b in reads)
        for old, a, b in reads:  # each range lies in the saved piece it is read from
            start, stop = cost.flat_shard_range(numel, saved, old)
            assert start <= a and b <= stop


def test_reshard_reads_by_hand():
    # 10 elements, 4 -> 3: old pieces [0,3) [3,6) [6,9) [9,10), new [0,4) [4,8) [8,10)
    assert cost.reshard_reads(10, 4, 3, 0) == [(0, 0, 3), (1, 3, 4)]
    assert cost.reshard_reads(10, 4, 3, 2) == [(2, 8, 9), (3, 9, 10)]
    assert cost.reshard_reads(10, 2, 4, 3) == [(1, 9, 10)]
