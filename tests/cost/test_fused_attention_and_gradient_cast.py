"""Two memory-bound terms worked by hand: a fused attention kernel streams no scores, and an
fp32 reduction of bf16 gradients pays a cast of every gradient element it reduces."""

import pytest

from parlib import cost
from parlib.cost.efficiency import H100_TRAINING
from parlib.cost.memory import gradient_cast_bytes_per_param

MODEL = cost.Model(4, 512, 8, 1024, 1000, name="small")
HARDWARE = cost.Hardware.dgx_h100(8)


def _estimate(**settings):
    return cost.estimate(MODEL, HARDWARE, cost.Layout(dp=8), **settings)


def test_cast_bytes_per_gradient_element():
    # read the bf16 gradient (2 bytes), write its fp32 copy (4): 6 bytes an element
    assert gradient_cast_bytes_per_param(2, 4) == 6
    assert gradient_cast_bytes_per_param(2, 2) == 0  # reduced in its own dtype: no cast
    assert gradient_cast_bytes_per_param(4, 4) == 0
    with pytest.raises(ValueError, match="grad_bytes"):
        gradient_cast_bytes_per_param(0, 4)


@pytest.mark.parametrize("zero, reductions", [(3, 4), (2, 4), (1, 1)])
def test_an_fp32_reduction_casts_every_gradient_before_each_reduction(zero, reductions):
    settings = dict(m=4, global_batch=64, zero=zero)
    plain = _estimate(**settings)
    fp32 = _estimate(**settings, grad_reduce_bytes=4)
    # every rank casts the whole model's gradient (ZeRO shards it only after the
    # reduce-scatter): 6 bytes an element, before every microbatch's reduce-scatter with
    # ZeRO-2 and ZeRO-3, once a step with ZeRO-1; one large streaming kernel: at 90% of 3.35
    # TB/s (not the layers' fitted share)
    by_hand = reductions * MODEL.n_params * 6 / (0.9 * 3350e9)
    added = fp32.time["memory_bound"] - plain.time["memory_bound"]
    assert added == pytest.approx(by_hand, rel=1e-9)
    assert plain.time["compute"] == fp32.time["compute"]


def test_a_fused_kernel_streams_no_attention_scores_even_with_full_recomputation():
    settings = dict(m=1, global_batch=8, zero=3, recompute=True)
    stored = _estimate(**settings)
    fused = _estimate(**settings, fused_attention=True)
    # the softmax over stored scores reads and writes a x s bf16 values per token per layer
    # (2 x 2 x a x s bytes); forward, recomputed forward and a backward of twice the bytes:
    # four passes; one sequence of s tokens per device, 4 layers
    a, s, layers = 8, 1024, 4
    by_hand = 4 * (2 * 2 * a * s) * s * layers / (H100_TRAINING[1] * 3350e9)
    saved = stored.time["memory_bound"] - fused.time["memory_bound"]
    assert saved == pytest.approx(by_hand, rel=1e-9)
    # the layer being recomputed no longer holds its scores during the backward either
    assert fused.memory["activations"] < stored.memory["activations"]
    # "selective" already keeps the scores on chip: the flag changes nothing there
    selective = dict(settings, recompute="selective")
    assert (_estimate(**selective).time == _estimate(**selective, fused_attention=True).time)


def test_fused_attention_without_recomputation_stores_no_scores():
    settings = dict(m=1, global_batch=8, zero=3, recompute=False)
    stored = _estimate(**settings)
    fused = _estimate(**settings, fused_attention=True)
    selective = _estimate(**dict(settings, recompute="selective"))
    assert fused.memory["activations"] == selective.memory["activations"]
    assert fused.memory["activations"] < stored.memory["activations"]
    with pytest.raises(ValueError, match="fused_attention"):
        _estimate(**settings, fused_attention="yes")
