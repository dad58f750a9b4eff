"""What a cross-entropy holds at its peak, by implementation, worked by hand; and the
estimate and the planner counting it."""

import pytest

from parlib.cost import Hardware, Layout, Model, best_layouts, estimate
from parlib.cost.memory import LOSSES, logits_bytes, loss_peak_bytes


def test_each_loss_by_hand():
    s, b, vocab = 8192, 1, 128000
    logits = s * b * vocab
    # PyTorch's: saved fp32 log-probabilities, their gradient, the fp32 logits' gradient
    assert loss_peak_bytes(s, b, vocab, loss="unfused") == 12 * logits == 12_582_912_000
    assert loss_peak_bytes(s, b, vocab, dtype_bytes=4, loss="unfused") == 12 * logits
    # Megatron-LM's: one fp32 copy turned into the gradient in place, cast back to bf16;
    # in fp32 the copy is the logits themselves
    assert loss_peak_bytes(s, b, vocab, loss="in_place") == 6 * logits == logits_bytes(s, b, vocab)
    assert loss_peak_bytes(s, b, vocab, dtype_bytes=4, loss="in_place") == 4 * logits
    # fused (flash-attn's): the logits it keeps and their gradient
    assert loss_peak_bytes(s, b, vocab, loss="fused") == 4 * logits
    assert loss_peak_bytes(s, b, vocab, dtype_bytes=4, loss="fused") == 8 * logits
    # the vocabulary split t ways splits all of it
    assert loss_peak_bytes(s, b, vocab, t=8) == 12 * logits / 8
    assert LOSSES == ("unfused", "in_place", "fused")
    with pytest.raises(ValueError, match="loss must be one of"):
        loss_peak_bytes(s, b, vocab, loss="chunked")


WIDE_VOCAB = Model(4, 512, 8, 2048, 128000, name="wide vocabulary")


def test_the_estimate_counts_the_loss_it_is_told():
    hw = Hardware.dgx_h100(8)
    kw = dict(m=1, global_batch=16, zero=3, fused_attention=True)
    by = {loss: estimate(WIDE_VOCAB, hw, Layout(dp=8), loss=loss, **kw) for loss in LOSSES}
    default = estimate(WIDE_VOCAB, hw, Layout(dp=8), **kw)
    assert default.memory == by["unfused"].memory  # PyTorch's loss unless told
    # two sequences of 2048 a GPU: 4096 x 128000 logits, 12, 6 and 4 bytes each
    logits = 4096 * 128000
    unfused, in_place, fused = (by[k].memory["activations"] for k in LOSSES)
    assert unfused - in_place == pytest.approx(6 * logits)
    assert in_place - fused == pytest.approx(2 * logits)
    assert by["unfused"].step_time == by["fused"].step_time  # memory only
    with pytest.raises(ValueError, match="loss must be one of"):
        estimate(WIDE_VOCAB, hw, Layout(dp=8), loss="fast", **kw)


def test_the_planner_counts_it_too():
    hw = Hardware.dgx_h100(8).with_(memory_bytes=12e9)
    fused = best_layouts(WIDE_VOCAB, hw, global_batch=64, loss="fused", top=50)
    unfused = best_layouts(WIDE_VOCAB, hw, global_batch=64, top=50)
    assert fused and unfused
    # a layout fits under the fused loss's smaller peak that the unfused one's does not
    assert {(e.name, e.m) for e in fused} != {(e.name, e.m) for e in unfused}
    assert min(e.memory_total for e in fused) < min(e.memory_total for e in unfused)
    with pytest.raises(ValueError, match="loss must be one of"):
        best_layouts(WIDE_VOCAB, hw, global_batch=64, loss="fast")
