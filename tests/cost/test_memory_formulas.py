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
