"""parlib.experiments.context: the context-parallel chapter's harnesses report what they
measure (checks that can fail, work per rank equal to the formula, memory falling as 1/c),
and the chapter's two drawings take their output."""

from __future__ import annotations

import functools

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parlib  # noqa: E402
from parlib.cost.context import causal_block_work, ring_attention_sent_bytes_per_layer  # noqa: E402
from parlib.experiments import context as X  # noqa: E402
from parlib.model import ModelConfig  # noqa: E402
from parlib.plots import draw_causal_imbalance, draw_memory_vs_length  # noqa: E402
from parlib.verify import compare, reference_run  # noqa: E402

CFG = ModelConfig(seq_len=16, d_model=16, n_heads=2, n_layers=1)


def _on_ranks():
    out = {"ring": X.attention_check("ring", seq_len=16),
           "all_gather": X.attention_check("all_gather", causal=False, seq_len=16,
                                           layout="contiguous"),
           "train": X.train_split_model(CFG, steps=2, batch=2),
           "memory": X.saved_activations(CFG, [16, 32])}
    for layout in ("contiguous", "zigzag"):
        out[layout] = X.emulated_imbalance(layout, seq_len=16, pair_seconds=0.002)
    try:
        X.attention_check("striped")
    except ValueError as err:
        out["bad"] = str(err)
    out["world"] = dist.get_world_size()
    return out


@functools.lru_cache(maxsize=None)
def _results(cp):
    return parlib.launch(_on_ranks, world_size=cp, timeout=240)


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_check_compares_and_records_the_ring(cp):
    for r in _results(cp):
        assert r["ring"]["check"] and r["all_gather"]["check"]
        sent = sum(sent for op, _, sent in r["ring"]["forward"] + r["ring"]["backward"]
                   if op == "batch_isend_irecv")  # one batch per exchange
        assert sent == ring_attention_sent_bytes_per_layer(2, 16, 2 * 8, cp)
        assert [op for op, *_ in r["all_gather"]["forward"]] == ["all_gather"]
        assert r["bad"].startswith("kind must be one of")


@pytest.mark.parametrize("cp", [2, 4])
def test_emulated_work_per_rank_is_the_causal_formula(cp):
    ranks = _results(cp)
    assert [r["contiguous"]["units"] for r in ranks] == [4 * w for w in causal_block_work(cp)]
    assert [r["zigzag"]["units"] for r in ranks] == causal_block_work(cp, zigzag=True)
    for r in ranks:
        for layout in ("contiguous", "zigzag"):
            # the sleeps really ran: busy at least the emulated seconds, total at least busy
            assert r[layout]["busy"] >= 0.002 * r[layout]["units"] * 0.99
            assert r[layout]["total"] >= r[layout]["busy"]


def test_training_harness_matches_one_device_and_the_check_can_fail():
    ref = reference_run(CFG, steps=2, batch=2)
    for r in _results(2):
        assert compare(r["train"]["params"], ref.params)
        assert compare([torch.tensor(x) for x in r["train"]["losses"]],
                       [torch.tensor(x) for x in ref.losses])
    other = reference_run(CFG, steps=2, batch=2, lr=0.2)  # a different run is told apart
    assert not compare(_results(2)[0]["train"]["params"], other.params)


def test_saved_activations_fall_as_one_over_c_and_grow_with_s():
    one = parlib.launch(X.saved_activations, CFG, [16, 32], world_size=1, timeout=120)[0]
    for cp in (2, 4):
        for s in (16, 32):
            assert _results(cp)[0]["memory"][s] * cp == pytest.approx(one[s], rel=0.02)
    assert one[32] == pytest.approx(2 * one[16], rel=0.02)


def test_the_chapter_drawings_take_the_harness_output():
    ranks = _results(2)
    runs = {layout: [r[layout] for r in ranks] for layout in ("contiguous", "zigzag")}
    ax = draw_causal_imbalance(runs, caption="2 ranks")
    assert len(ax.get_yticklabels()) == 4 and ax.get_title() == "2 ranks"
    memory = {cp: _results(cp)[0]["memory"] for cp in (2, 4)}
    ax = draw_memory_vs_length(memory, memory, caption="x")
    assert len(ax.get_lines()) == 4
