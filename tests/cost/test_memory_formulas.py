"""Memory formulas: model-state bytes per parameter and per ZeRO stage."""

import pytest

from parlib import cost


def test_model_state_bytes_zero_stages():
    p = 1000
    assert cost.model_state_bytes(p) == 16 * p
    assert cost.model_state_bytes(p, 4, 1) == 4 * p + 4 * p + 2 * p
    assert cost.model_state_bytes(p, 4, 2) == 4 * p + p + 2 * p
    assert cost.model_state_bytes(p, 4, 3) == 4 * p
    assert cost.adam_bytes_per_param() == 16 == cost.adam_bytes_per_param(True)


def test_mixed_precision_zero1_approaches_4x():
    # 2 + 2 + 12 bytes: ZeRO-1 leaves 4 + 12/N, a 4x saving as N grows (ZeRO paper)
    p = 1000
    assert cost.model_state_bytes(p, 64, 1, mixed_precision=True) == pytest.approx(
        4 * p + 12 * p / 64)
    assert cost.model_state_bytes(p, 1, 0, True) / cost.model_state_bytes(p, 10**6, 1, True) \
        == pytest.approx(4, rel=1e-4)


def test_model_state_bytes_rejects_bad_stage():
    with pytest.raises(ValueError, match="zero_stage"):
        cost.model_state_bytes(10, 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        cost.model_state_bytes(10, 0, 1)


def test_shard_copy_and_the_formulas_chapter_02_prints():
    """The sharded-data-parallel chapter's takeaway gave ZeRO-1/2 without the fp32 shard copy
    its ledger measures; the formulas now come from here, with the copy (4P/N) for the fp32
    Zero1 and Zero2."""
    p, n = 1000, 4
    kinds = cost.model_state_bytes_by_kind(p, n, 1, shard_copy=True)
    assert kinds["shard copy"] == 4 * p / n
    assert "shard copy" not in cost.model_state_bytes_by_kind(p, n, 1)
    for z in (0, 3):  # nothing to copy: all whole (DP) or all sharded (ZeRO-3)
        assert "shard copy" not in cost.model_state_bytes_by_kind(p, n, z, shard_copy=True)
    # in mixed precision the copy is the master weights, already in the optimizer's 12 bytes
    assert cost.model_state_bytes(p, n, 1, True, shard_copy=True) == \
        cost.model_state_bytes(p, n, 1, True)
    assert [cost.model_state_formula(z, shard_copy=True) for z in range(4)] == [
        "16P", "8P + 12P/N", "4P + 16P/N", "16P/N"]
    assert [cost.model_state_formula(z) for z in range(4)] == [
        "16P", "8P + 8P/N", "4P + 12P/N", "16P/N"]
    assert cost.model_state_formula(1, mixed_precision=True) == "4P + 12P/N"
    for z in range(4):  # each formula, evaluated, is the bytes it names
        whole, _, split = cost.model_state_formula(z, shard_copy=True).partition(" + ")
        if "/N" in whole:
            whole, split = "", whole
        total = (float(whole[:-1]) if whole else 0) * p + (
            float(split[:-3]) if split else 0) * p / n
        assert total == cost.model_state_bytes(p, n, z, shard_copy=True)
