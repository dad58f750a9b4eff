"""parlib.cost.sharded: bytes per step under ZeRO 0-3, from the ring collectives' formula."""

from __future__ import annotations

import pytest

from parlib.cost import model_state_bytes_by_kind, predicted_sent_bytes
from parlib.cost.sharded import padded_numel, zero_sent_bytes_per_step


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_stages_0_to_2_send_an_all_reduce_and_stage_3_half_as_much_again(n):
    p = 1_000_000
    all_reduce = predicted_sent_bytes("all_reduce", 4 * p, n)
    for stage in (0, 1, 2):
        assert zero_sent_bytes_per_step(p, n, stage) == pytest.approx(all_reduce)
        assert zero_sent_bytes_per_step(p, n, stage) == pytest.approx(2 * 4 * p * (n - 1) / n)
    assert zero_sent_bytes_per_step(p, n, 3) == pytest.approx(3 * 4 * p * (n - 1) / n)
    assert zero_sent_bytes_per_step(p, n, 3, dtype_bytes=2) == pytest.approx(
        zero_sent_bytes_per_step(p, n, 3) / 2)


def test_bad_stage_and_world_size_are_named():
    with pytest.raises(ValueError, match="zero_stage"):
        zero_sent_bytes_per_step(10, 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        zero_sent_bytes_per_step(10, 0, 3)
    with pytest.raises(ValueError, match="world_size"):
        padded_numel(10, 0)


def test_padding_to_equal_shards():
    assert [padded_numel(k, 4) for k in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]


def test_memory_per_rank_of_each_stage_in_fp32_and_mixed_precision():
    # the formulas these shards are measured against (parlib.cost.memory), worked by hand
    p, n = 1_000, 4
    assert model_state_bytes_by_kind(p, n, 2) == {"params": 4000, "grads": 1000, "optimizer": 2000}
    assert model_state_bytes_by_kind(p, n, 3) == {"params": 1000, "grads": 1000, "optimizer": 2000}
    assert model_state_bytes_by_kind(p, n, 3, mixed_precision=True) == {
        "params": 500, "grads": 500, "optimizer": 3000}
