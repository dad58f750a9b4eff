"""The choosing chapter's practice set: every question passes its worked answer and rejects the
slips
learners make, naming each."""

from __future__ import annotations

import pytest

from parlib.course.check import check
from parlib.course.registry import questions

GiB = 2**30
RIGHT = {
    "08.what_tp_splits": "D",
    "08.dp_bytes": 2 * 7 / 8 * 2 * 1.3e9,
    "08.dp_seconds": 2 * 7 / 8 * 2 * 1.3e9 / 25e9,
    "08.memory_bound": "b",
    "08.bandwidth_bound": "(C)",
    "08.zero1_mixed": (4 * 7e9 + 12 * 7e9 / 8) / GiB,
    "08.tp_bytes_per_layer": 469_762_048,
    "08.seed_bubble": 3 / 11,
    "08.microbatch_speedup": 32 / 11,
    "08.shrink_bubble": "A",
}

# (question, wrong answer, words the hint must contain)
WRONG = [
    ("08.what_tp_splits", "A", "data parallelism"),
    ("08.what_tp_splits", "C", "pipeline"),
    ("08.dp_bytes", 7 / 8 * 2 * 1.3e9, "reduce-scatter AND an all-gather"),
    ("08.dp_bytes", 2 * 7 / 8 * 4 * 1.3e9, "bf16"),
    ("08.dp_bytes", 4.55, "in GB"),
    ("08.dp_seconds", 2 * 7 / 8 * 2 * 1.3e9 / 200e9, "gigaBITS"),
    ("08.dp_seconds", 7 / 8 * 2 * 1.3e9 / 25e9, "2(N-1)/N"),
    ("08.memory_bound", "A", "whole model"),
    ("08.memory_bound", "D", "activation"),
    ("08.bandwidth_bound", "A", "every layer"),
    ("08.bandwidth_bound", "D", "x data parallelism's"),
    ("08.zero1_mixed", 38.5, "GB (10^9 bytes)"),
    ("08.zero1_mixed", 16 * 7e9 / 8 / GiB, "ZeRO-3"),
    ("08.zero1_mixed", (8 * 7e9 + 8 * 7e9 / 8) / GiB, "fp32"),
    ("08.tp_bytes_per_layer", 469_762_048 / 2, "backward 2 more"),
    ("08.tp_bytes_per_layer", 469_762_048 * 2, "bf16"),
    ("08.seed_bubble", 3 / 8, "(p-1)/(m+p-1)"),
    ("08.seed_bubble", 0.38, "(p-1)/(m+p-1)"),  # 3/8 to two digits: named all the same
    ("08.seed_bubble", 27, "looks like a percent"),
    ("08.seed_bubble", 0.3, "at least 2 significant digits"),
    ("08.seed_bubble", 0.26, "too low"),
    ("08.bandwidth_bound", "B", "whatever the batch: of its 27 GB per GPU, 1/8 leaves"),
    ("08.seed_bubble", 3 / 12, "m + p - 1"),
    ("08.microbatch_speedup", 8, "fill and drain"),
    ("08.microbatch_speedup", 4, "limit"),
    ("08.shrink_bubble", "B", "adds a slot"),
    ("08.shrink_bubble", "D", "idle compute"),
]


def test_every_question_has_a_right_answer_here():
    assert set(RIGHT) == set(questions("08"))


@pytest.mark.parametrize("qid", sorted(RIGHT))
def test_worked_answer_passes(qid, clean_checks):
    assert check(qid, RIGHT[qid]).passed


@pytest.mark.parametrize("qid,answer,words", WRONG)
def test_common_slips_are_named(qid, answer, words, clean_checks):
    result = check(qid, answer)
    assert result.status == "failed", result
    assert words in result.message, result.message


def test_each_question_rejects_at_least_two_slips():
    counts = {qid: sum(1 for q, _a, _w in WRONG if q == qid) for qid in RIGHT}
    assert min(counts.values()) >= 2, counts


@pytest.mark.parametrize("answer", [0.27, 0.273, 0.2727, 3 / 11])
def test_seed_bubble_accepts_the_rounding_its_digits_state(answer, clean_checks):
    assert check("08.seed_bubble", answer).passed, check("08.seed_bubble", answer).message


def test_bandwidth_bound_right_answer_puts_the_fewest_bytes_on_the_slow_links():
    # C (pipeline across the nodes) against B (the data-parallel sync across them) and A
    # (tensor parallelism across them: t = 8, one GPU per node in each group), per GPU and
    # step, for the question's run: 512 sequences, d = 8 inside the nodes
    from parlib.cost import Model, boundary_bytes, predicted_sent_bytes
    from parlib.cost.tensor import tp_sent_bytes_per_layer

    model = Model(32, 4096, 32, 2048, 51200, name="6.7B")
    pipeline = 2 * boundary_bytes(512 // 8, 2048, 4096, dtype_bytes=2)
    sync = predicted_sent_bytes("all_reduce", 2 * model.n_params, 64)
    tensor = model.n_layers * tp_sent_bytes_per_layer(512 // 8, 2048, 4096, 8, dtype_bytes=2)
    assert pipeline < sync / 5 and pipeline < tensor / 5, (pipeline, sync, tensor)


def test_bandwidth_bound_agrees_with_the_chapters_link_sweep():
    """The question's key, hints and worked answer quote the chapter's own estimates at its
    setting (notebooks/08_choosing.ipynb, the link sweep's cells at 5 GB/s), so they cannot
    drift apart: recompute them as the chapter does and find them in the question's text."""
    from parlib.cost import Hardware, Layout, Link, Model, best_layouts, estimate
    from parlib.cost.hardware import GB
    from parlib.course.questions.ch08 import memory_or_bandwidth as q
    from parlib.course.registry import get_question

    model_b = Model(32, 4096, 32, 2048, 51200, name="6.7B")  # the chapter's cell
    slow = Hardware.dgx_h100(64).with_(inter_node=Link(alpha=10e-6, bandwidth=5 * GB))
    best = best_layouts(model_b, slow, global_batch=512, top=1)[0]
    plain = estimate(model_b, slow, Layout(dp=64), m=512 // 64, zero=1,
                     recompute="selective", global_batch=512)
    question = get_question("08.bandwidth_bound")
    text = " ".join((question.working + " " + " ".join(question.hints.values())).split())
    # the chapter prints these at 5 GB/s: the pick and its step, d=64's bytes and seconds
    assert (best.name, best.zero) == (q.BW_PICK.name, q.BW_PICK.zero)
    assert f"{best.name} with {best.sharding or 'no ZeRO'}" in text
    assert f"step {best.step_time:.2f} s" in text
    assert f"{plain.inter_node_bytes / GB:.2f} GB" in text
    assert f"{plain.time['dp_sync_total']:.2f} s at 5 GB/s" in text
    # the key is the choice with the fewest slow-link bytes, by the same model
    sent = q.BW_SLOW_BYTES
    assert question.answer == min(sent, key=sent.get) == "C"
    assert sent["B"] == plain.inter_node_bytes
    assert f"{sent['B'] / sent['C']:.1f}x fewer" in text
