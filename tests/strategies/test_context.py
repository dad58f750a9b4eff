"""parlib.strategies.context: ring and all-gather attention equal single-device attention,
forward and backward, for cp = 2 and 4, causal and not, contiguous and zig-zag; the tiny
model trained with its sequence split equals single-device training; bytes equal the formula.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlib
import parlib.strategies.context as context
import parlib.strategies.context_ops as context_ops
from parlib.cost.context import (
    all_gather_kv_sent_bytes_per_layer,
    causal_block_work,
    kv_block_bytes,
    ring_attention_sent_bytes_per_layer,
    ring_sends_per_layer,
)
from parlib.measure import CommLog
from parlib.model import ModelConfig, build_model, loss_fn, make_batch, make_optimizer
from parlib.strategies.context import (
    LAYOUTS,
    all_gather_attention,
    average_gradients,
    block_attention,
    context_parallel_copy,
    mean_over_group,
    merge_partials,
    ring_attention,
    sequence_positions,
    split_sequence,
)
from parlib.verify import compare, reference_run

B, HEADS, S, D = 2, 2, 16, 8  # attention inputs (b, a, s, d): s splits into 2 x 4 chunks
CFG = ModelConfig(seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, BATCH, LR = 3, 4, 0.1
KINDS = {"ring": ring_attention, "all_gather": all_gather_attention}
BATCH_OP = "batch_isend_irecv"  # how CommLog names a batch of sends and receives


# ---- single process: the online softmax and the layouts

def _random_blocks(seed=0, s_q=6, s_k=5):
    gen = torch.Generator().manual_seed(seed)
    q, k1, v1, k2, v2 = (torch.randn(B, HEADS, n, D, generator=gen)
                         for n in (s_q, s_k, s_k, s_k, s_k))
    return q, (k1, v1), (k2, v2)


def _full(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_merge_of_two_blocks_equals_the_full_softmax():
    q, (k1, v1), (k2, v2) = _random_blocks()
    merged, lse = merge_partials(*block_attention(q, k1, v1), *block_attention(q, k2, v2))
    k, v = torch.cat([k1, k2], -2), torch.cat([v1, v2], -2)
    assert compare([merged], [_full(q, k, v)])
    scores = q @ k.transpose(-2, -1) / D ** 0.5
    assert compare([lse], [torch.logsumexp(scores, -1)])


def test_merge_with_fully_masked_rows_of_a_causal_mask():
    # queries at positions 0..5, keys 0..4 then 5..9: in the second block rows 0-4 see
    # nothing (out 0, lse -inf) and must not turn into NaN or pull the result
    q, (k1, v1), (k2, v2) = _random_blocks(1)
    q_pos, k1_pos, k2_pos = torch.arange(6), torch.arange(5), torch.arange(5, 10)
    out2, lse2 = block_attention(q, k2, v2, q_pos, k2_pos)
    assert torch.isneginf(lse2[..., :5]).all() and (out2[..., :5, :] == 0).all()
    merged, lse = merge_partials(*block_attention(q, k1, v1, q_pos, k1_pos), out2, lse2)
    k, v = torch.cat([k1, k2], -2), torch.cat([v1, v2], -2)
    mask = torch.arange(10)[None, :] <= q_pos[:, None]
    assert compare([merged], [_full(q, k, v, mask)])
    assert torch.isfinite(lse).all()
    # both sides empty: stays (0, -inf)
    empty, none = merge_partials(out2[..., :5, :], lse2[..., :5], out2[..., :5, :],
                                 lse2[..., :5])
    assert (empty == 0).all() and torch.isneginf(none).all()


def test_the_merge_check_rejects_wrong_merges():
    q, (k1, v1), (k2, v2) = _random_blocks(2)
    (oa, la), (ob, lb) = block_attention(q, k1, v1), block_attention(q, k2, v2)
    want = _full(q, torch.cat([k1, k2], -2), torch.cat([v1, v2], -2))
    summed = oa + ob  # summing the normalised outputs
    ignore_b = (oa * la.exp()[..., None] + ob) / (la.exp() + 1)[..., None]  # lse_b taken as 0
    mean = (oa + ob) / 2  # ignoring both log-sum-exps
    for wrong in (summed, ignore_b, mean):
        assert not compare([wrong], [want])
    assert compare([merge_partials(oa, la, ob, lb)[0]], [want])


def test_merge_survives_scores_that_overflow_exp():
    # scores near 1000: exp overflows fp32, so weights need the running max subtracted
    q, (k1, v1), (k2, v2) = _random_blocks(3)
    q = q * 300
    (oa, la), (ob, lb) = block_attention(q, k1, v1), block_attention(q, k2, v2)
    assert la.max() > 100  # exp(la) is inf in fp32
    want = _full(q, torch.cat([k1, k2], -2), torch.cat([v1, v2], -2))
    assert compare([merge_partials(oa, la, ob, lb)[0]], [want])
    wa, wb = la.exp()[..., None], lb.exp()[..., None]  # without the running max
    assert not compare([(wa * oa + wb * ob) / (wa + wb)], [want])


def test_layouts_cover_the_sequence_once():
    for cp in (1, 2, 4):
        for layout in LAYOUTS:
            every = torch.cat([sequence_positions(r, cp, S, layout) for r in range(cp)])
            assert sorted(every.tolist()) == list(range(S))
    assert sequence_positions(1, 4, 16, "zigzag").tolist() == [2, 3, 12, 13]
    assert sequence_positions(1, 4, 16).tolist() == [4, 5, 6, 7]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sequence length 16 does not split into 3"):
        sequence_positions(0, 3, 16)
    with pytest.raises(ValueError, match="sequence length 12 does not split into 8 .*zigzag"):
        sequence_positions(0, 4, 12, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        sequence_positions(0, 2, 16, "striped")
    q = torch.zeros(B, HEADS, 4, D)
    for fn in (ring_attention, all_gather_attention):
        with pytest.raises(ValueError, match="process group"):
            fn(q, q, q, None)
    with pytest.raises(ValueError, match="process group"):
        context_parallel_copy(build_model(CFG), None)


# ---- on ranks: attention against one device, bytes, the model

def _attention_vs_single(causal, layout, kind, group=None):
    """This rank's out, dq, dk, dv of ``kind`` attention against the slices of single-device
    attention (same random q, k, v, upstream gradient on every rank), and the messages."""
    group = group or dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    q, k, v, d_out = (torch.randn(B, HEADS, S, D, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=causal)
    want.backward(d_out)
    mine = [split_sequence(t, group, layout, dim=2).requires_grad_() for t in (q, k, v)]
    with CommLog() as log:
        got = KINDS[kind](*mine, group, causal=causal, layout=layout)
        forward_records = len(log.records)
        got.backward(split_sequence(d_out, group, layout, dim=2))
    cut = functools.partial(split_sequence, group=group, layout=layout, dim=2)
    names = ("out", "dq", "dk", "dv")
    result = compare(dict(zip(names, [got] + [t.grad for t in mine])),
                     dict(zip(names, [cut(want)] + [cut(t.grad) for t in full])))
    records = [(r.op, r.nbytes, r.predicted_sent) for r in log.records]
    return result, records, forward_records


def _model_vs_single(layout, attention, average=True):
    """Losses, every gradient of every step and the final weights of the tiny model trained
    with its sequence split over the world, against :func:`reference_run`."""
    group = dist.group.WORLD
    torch.set_num_threads(1)
    model = context_parallel_copy(build_model(CFG), group, layout, attention)
    opt = make_optimizer(model.parameters(), "sgd", LR)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(BATCH, CFG, step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(split_sequence(tokens, group, layout)),
                       split_sequence(targets, group, layout))
        loss.backward()
        if average:
            average_gradients(model, group)
        losses.append(mean_over_group(loss, group))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _on_ranks():
    torch.set_num_threads(1)
    attention = {(causal, layout, kind): _attention_vs_single(causal, layout, kind)
                 for causal in (True, False) for layout in LAYOUTS for kind in KINDS}
    model = {(layout, kind): _model_vs_single(layout, kind)
             for layout, kind in (("zigzag", "ring"), ("contiguous", "ring"),
                                  ("zigzag", "all_gather"))}
    for layout in LAYOUTS:  # chunk pairs this rank computes over the whole ring, causal
        ring = context._Ring(dist.group.WORLD, S // dist.get_world_size(), layout, True)
        attention[("work", layout)] = sum(len(ring.pairs(step)) for step in range(ring.cp))
    odd = torch.zeros(B, HEADS, 3, D)  # 3 positions per rank: no zig-zag pair of chunks
    try:
        ring_attention(odd, odd, odd, dist.group.WORLD, layout="zigzag")
    except ValueError as err:
        attention["odd"] = str(err)
    fused, context_ops._FUSED = context_ops._FUSED, None  # the explicit formulas, as on a GPU
    try:
        for causal in (True, False):
            attention[("formulas", causal)] = _attention_vs_single(causal, "zigzag", "ring")
    finally:
        context_ops._FUSED = fused
    if dist.get_world_size() == 4:  # two cp groups of 2 side by side: ranks {0, 1}, {2, 3}
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        attention["pairs"] = _attention_vs_single(True, "zigzag", "ring",
                                                  pairs[dist.get_rank() // 2])
    return attention, model


@functools.lru_cache(maxsize=None)
def _results(cp):
    return parlib.launch(_on_ranks, world_size=cp, timeout=240)


CASES = [(c, lay, k) for c in (True, False) for lay in LAYOUTS for k in KINDS]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal,layout,kind", CASES,
                         ids=[f"{'causal' if c else 'full'}-{lay}-{k}" for c, lay, k in CASES])
def test_attention_equals_single_device_forward_and_backward(cp, causal, layout, kind):
    for rank, (attention, _) in enumerate(_results(cp)):
        result, _, _ = attention[(causal, layout, kind)]
        assert result, f"rank {rank} of {cp}: {result} (mismatched {result.mismatched})"


@pytest.mark.parametrize("cp", [2, 4])
def test_a_sequence_that_does_not_split_is_named_on_the_ranks(cp):
    for attention, _ in _results(cp):
        assert attention["odd"].startswith(f"sequence length {3 * cp} does not split into "
                                           f"{2 * cp} equal chunks (zigzag")


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_per_rank_is_the_formula(cp):
    # contiguous: rank r computes r + 1 blocks (unbalanced); zig-zag: 2cp + 1 half-size
    # chunk pairs on every rank
    for layout in LAYOUTS:
        work = [attention[("work", layout)] for attention, _ in _results(cp)]
        assert work == causal_block_work(cp, zigzag=layout == "zigzag")
    assert len({attention[("work", "zigzag")] for attention, _ in _results(cp)}) == 1


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_without_the_fused_kernel(cp):
    for rank, (attention, _) in enumerate(_results(cp)):
        for causal in (True, False):
            result, _, _ = attention[("formulas", causal)]
            assert result, f"rank {rank} of {cp}, causal={causal}: {result}"


def test_ring_attention_on_a_subgroup():
    for rank, (attention, _) in enumerate(_results(4)):
        result, records, _ = attention["pairs"]
        assert result, f"rank {rank}, cp group of 2: {result}"
        assert sum(op == BATCH_OP for op, *_ in records) == ring_sends_per_layer(2)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_equal_the_formula(cp):
    kv_dim = HEADS * D
    block = kv_block_bytes(B, S, kv_dim, cp)
    for attention, _ in _results(cp):
        for causal in (True, False):
            _, records, n_forward = attention[(causal, "zigzag", "ring")]
            # every exchange is one batch: a block sent on, a block received
            assert [op for op, _, _ in records] == [BATCH_OP] * ring_sends_per_layer(cp)
            assert all(nbytes == 2 * block and sent == block for _, nbytes, sent in records)
            assert n_forward == ring_sends_per_layer(cp, ("forward",)) == cp - 1
            assert sum(sent for _, _, sent in records) == ring_attention_sent_bytes_per_layer(
                B, S, kv_dim, cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_all_gather_bytes_equal_the_formula(cp):
    kv_dim = HEADS * D
    for attention, _ in _results(cp):
        _, records, _ = attention[(True, "contiguous", "all_gather")]
        assert [op for op, _, _ in records] == ["all_gather", "reduce_scatter"]
        assert sum(sent for *_, sent in records) == all_gather_kv_sent_bytes_per_layer(
            B, S, kv_dim, cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_model_training_equals_single_device(cp):
    ref = reference_run(CFG, steps=STEPS, batch=BATCH, lr=LR)
    for rank, (_, model) in enumerate(_results(cp)):
        for (layout, kind), (losses, grads, params) in model.items():
            where = f"rank {rank} of {cp}, {layout} {kind}"
            assert compare(losses, [torch.tensor(x) for x in ref.losses]), where
            for step in range(STEPS):
                assert len(grads[step]) == len(ref.grads[step])  # every gradient compared
                result = compare(grads[step], ref.grads[step])
                assert result, f"{where}, step {step}: {result}"
            assert compare(params, ref.params), where


def test_the_training_check_fails_without_the_gradient_average():
    ref = reference_run(CFG, steps=STEPS, batch=BATCH, lr=LR)
    for _, grads, params in parlib.launch(_model_vs_single, "zigzag", "ring", False,
                                                world_size=2):
        assert not compare(grads[0], ref.grads[0])
        assert not compare(params, ref.params)
