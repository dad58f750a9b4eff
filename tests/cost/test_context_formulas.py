"""parlib.cost.context: context parallelism's K/V bytes, activation memory and causal work."""

import pytest

from parlib.cost.context import (
    LSE_BYTES,
    all_gather_kv_sent_bytes_per_layer,
    causal_block_work,
    causal_unmasked_scores,
    cp_activation_bytes_per_layer,
    kv_block_bytes,
    ring_attention_sent_bytes_per_layer,
    ring_sends_per_layer,
)
from parlib.cost.memory import activation_bytes_per_layer


def test_kv_block_is_k_and_v_of_one_rank():
    # b=2, s=16 over cp=4: 4 positions, kv_dim 16, fp32 -> 2 x 2 x 4 x 16 x 4 bytes
    assert kv_block_bytes(2, 16, 16, 4) == 1024
    assert kv_block_bytes(2, 16, 16, 4, dtype_bytes=2) == 512


def test_ring_sends_cp_minus_one_blocks_forward_and_twice_that_backward():
    assert ring_sends_per_layer(4, ("forward",)) == 3
    assert ring_sends_per_layer(4, ("backward",)) == 6
    assert ring_sends_per_layer(4) == 9
    assert ring_sends_per_layer(1) == 0
    assert ring_attention_sent_bytes_per_layer(2, 16, 16, 4) == 9 * 1024
    assert ring_attention_sent_bytes_per_layer(2, 16, 16, 4, passes=("forward",)) == 3 * 1024
    assert ring_attention_sent_bytes_per_layer(2, 16, 16, 1) == 0


def test_all_gather_sends_the_same_forward_and_half_backward():
    # message 2 x b x s x kv_dim x 4 = 4096 bytes; each pass sends (cp-1)/cp of it
    assert all_gather_kv_sent_bytes_per_layer(2, 16, 16, 4) == 2 * 3072
    assert all_gather_kv_sent_bytes_per_layer(2, 16, 16, 4, passes=("forward",)) == \
        ring_attention_sent_bytes_per_layer(2, 16, 16, 4, passes=("forward",))
    assert all_gather_kv_sent_bytes_per_layer(2, 16, 16, 4, passes=("backward",)) * 2 == \
        ring_attention_sent_bytes_per_layer(2, 16, 16, 4, passes=("backward",))


def test_bytes_scale_with_kv_dim_not_with_cp():
    # per rank: (cp-1)/cp x the whole K and V, which tends to the whole as cp grows
    whole = 2 * 1 * 4096 * 1024 * 4
    assert ring_attention_sent_bytes_per_layer(1, 4096, 1024, 64, passes=("forward",)) == \
        pytest.approx(whole * 63 / 64)
    assert ring_attention_sent_bytes_per_layer(1, 4096, 128, 8) == \
        ring_attention_sent_bytes_per_layer(1, 4096, 1024, 8) / 8


def test_ring_activation_memory_falls_as_one_over_cp():
    s, b, h, a = 32768, 1, 4096, 32
    one = cp_activation_bytes_per_layer(s, b, h, a, 1)
    # Korthikanti et al.'s 34 x s x b x h (16-bit, scores not stored) plus the fp32 lse
    assert one == 34 * s * b * h + a * s * b * LSE_BYTES
    assert one == activation_bytes_per_layer(s, b, h, a, recompute="selective") + \
        a * s * b * LSE_BYTES
    for cp in (2, 4, 16):
        assert cp_activation_bytes_per_layer(s, b, h, a, cp) == pytest.approx(one / cp)


def test_all_gather_keeps_the_other_ranks_k_and_v():
    s, b, h, a, cp, kv = 8192, 2, 1024, 16, 4, 256
    ring = cp_activation_bytes_per_layer(s, b, h, a, cp, kv_dim=kv)
    gather = cp_activation_bytes_per_layer(s, b, h, a, cp, kv_dim=kv, attention="all_gather")
    assert gather - ring == 2 * b * (s - s // cp) * kv * 2
    assert cp_activation_bytes_per_layer(s, b, h, a, 1, attention="all_gather") == \
        cp_activation_bytes_per_layer(s, b, h, a, 1)


def test_causal_work_contiguous_is_unbalanced_zigzag_is_not():
    assert causal_block_work(4) == [1, 2, 3, 4]
    assert causal_block_work(4, zigzag=True) == [9, 9, 9, 9]
    for cp in (1, 2, 3, 8):
        zig = causal_block_work(cp, zigzag=True)
        assert len(set(zig)) == 1
        assert sum(zig) == 2 * cp * (2 * cp + 1) // 2  # the lower triangle of 2cp chunks


def test_causal_scores_counted_one_by_one():
    """The context-parallel chapter said the contiguous split's last rank does c times the
    first's work: in blocks, yes; in the scores the mask leaves, a diagonal block is about
    half full and the ratio is about 2c - 1. Both splits do the same scores in all, s(s+1)/2."""
    s = 32
    for cp in (1, 2, 4):
        for zigzag in (False, True):
            got = causal_unmasked_scores(s, cp, zigzag)
            # brute force: rank r's queries, each seeing keys 0..q
            chunks = 2 * cp if zigzag else cp
            n = s // chunks
            mine = [(r, chunks - 1 - r) if zigzag else (r,) for r in range(cp)]
            want = [sum(q + 1 for c in cs for q in range(c * n, (c + 1) * n)) for cs in mine]
            assert got == want
            assert sum(got) == s * (s + 1) // 2
        assert len(set(causal_unmasked_scores(s, cp, zigzag=True))) == 1
    contiguous = causal_unmasked_scores(32, 4)
    assert contiguous == [36, 100, 164, 228]  # the context-parallel chapter's s = 32, c = 4
    assert contiguous[-1] / contiguous[0] == pytest.approx(1 + 2 * 3 * 8 / 9)
    long = causal_unmasked_scores(4 * 4096, 4)
    assert long[-1] / long[0] == pytest.approx(2 * 4 - 1, rel=1e-3)  # not c = 4
    with pytest.raises(ValueError, match="seq_len 30 does not split into 8 equal chunks"):
        causal_unmasked_scores(30, 4, zigzag=True)
    with pytest.raises(ValueError, match="cp must be >= 1"):
        causal_unmasked_scores(32, 0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sequence length 10 does not split into 4"):
        kv_block_bytes(1, 10, 8, 4)
    with pytest.raises(ValueError, match="cp must be >= 1"):
        ring_attention_sent_bytes_per_layer(1, 16, 8, 0)
    with pytest.raises(ValueError, match="attention must be one of"):
        cp_activation_bytes_per_layer(16, 1, 8, 2, 2, attention="ulysses")
    with pytest.raises(ValueError, match="cp must be >= 1"):
        causal_block_work(0)
