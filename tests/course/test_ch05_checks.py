"""Questions of the context-parallel chapter: each grader accepts the worked answer and rejects
each wrong answer (the worked answer's code with one change) with the diagnosis that names its
mistake; together the wrong answers reach every diagnosis."""

from __future__ import annotations

import time

import pytest

from parlib.cost.context import cp_activation_bytes_per_layer, ring_attention_sent_bytes_per_layer
from parlib.course.check import check
from parlib.course.questions.ch05 import MERGE_SOLUTION, RING_SOLUTION
from parlib.course.questions.ch05.merge import CASES, _blocks
from parlib.course.registry import questions
from tests.helpers.learner_code import learner

pytestmark = pytest.mark.usefixtures("clean_checks")

RING_PRELUDE = "from parlib.strategies.context_ops import block_attention, merge_partials\n"


def _mutant(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"the worked answer no longer has {old!r}"
    return source.replace(old, new)


def test_ch05_questions_registered():
    ids = set(questions("05"))
    assert {"05.merge_partials", "05.ring_forward", "05.ring_bytes", "05.activation_memory",
            "05.zigzag_pair", "05.cp_or_tp"} <= ids
    for q in questions("05").values():
        assert q.working and q.prompt


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("qid, right, wrong, hint", [
    ("05.ring_bytes", 352_321_536, 352_321_536 / 3, "forward only"),
    ("05.ring_bytes", 352_321_536, 352_321_536 * 2 / 3, "3 (cp - 1)"),
    ("05.ring_bytes", 352_321_536, 352_321_536 * 4, "kv_dim"),
    ("05.ring_bytes", 352_321_536, 352_321_536 / 2, "both K and V"),
    ("05.ring_bytes", 352_321_536, 352_321_536 * 8, "s/cp positions"),
    ("05.ring_bytes", 352_321_536, 352_321_536 * 8 / 7, "cp - 1 blocks per pass"),
    ("05.activation_memory", 1089.0, 1089.0 * 16, "divide by cp"),
    ("05.activation_memory", 1089.0, 1088.0, "log-sum-exp"),
    ("05.activation_memory", 1089.0, 3009.0, "all-gather"),
    ("05.activation_memory", 1089.0, 1089.0 * 2**20 / 1e6, "MiB"),
])
def test_numeric_answers_and_hints(qid, right, wrong, hint):
    assert check(qid, right).passed
    r = check(qid, wrong)
    assert r.status == "failed" and hint in r.message, r.message


@pytest.mark.parametrize("qid", ["05.ring_bytes", "05.activation_memory"])
def test_every_numeric_mistake_gets_its_own_hint(qid):
    q = questions("05")[qid]
    assert len(q.mistakes) >= 4
    for wrong, hint in q.mistakes.items():
        r = check(qid, wrong)
        assert r.status == "failed" and hint in r.message, (wrong, r.message)


def test_expected_values_are_parlib_cost():
    assert check("05.ring_bytes",
                 ring_attention_sent_bytes_per_layer(1, 32768, 1024, 8, 2)).passed
    assert check("05.activation_memory",
                 cp_activation_bytes_per_layer(131072, 1, 4096, 32, 16) / 2**20).passed


@pytest.mark.parametrize("answer, hint", [
    ((6, 1), "increasing order"),
    ((2, 3), "neighbouring chunks"),
    ((1, 7), "2cp - 1 - r"),
    ((2, 7), "counted from 0"),
    ((1, 9), "0 to 2cp - 1"),
    ((0, 5), "mirror image"),
    ((1.0, 6.0), "pair of two ints"),
    ([1, 6], "a list"),
    ("1, 6", "a str"),
    (6, "pair of two ints"),
    ((-1, 6), "numbered from 0"),
])
def test_zigzag_pair(answer, hint):
    assert check("05.zigzag_pair", (1, 6)).passed
    r = check("05.zigzag_pair", answer)
    assert r.status == "failed" and hint in r.message, r.message


def test_zigzag_pair_not_attempted():
    assert check("05.zigzag_pair", ...).status == "not attempted"


def test_cp_or_tp():
    assert check("05.cp_or_tp", "b").passed
    for wrong, hint in (("A", "which parameters"), ("C", "sequence parallelism"),
                        ("D", "every key and value")):
        r = check("05.cp_or_tp", wrong)
        assert r.status == "failed" and hint in r.message, r.message


def test_cp_or_tp_right_option_is_not_the_longest():
    q = questions("05")["05.cp_or_tp"]
    longest = max(len(text) for text in q.options.values())
    assert len(q.options[q.answer]) < longest


# --------------------------------------------------------------------------- merge


def test_merge_cases_cover_masked_rows_and_overflow():
    # the cases the grader judges must hold what its diagnoses look for
    assert set(CASES) == {"plain", "causal", "large", "masked", "causal_large", "swapped_large"}
    causal, large, masked = _blocks("causal"), _blocks("large"), _blocks("masked")
    assert causal["lse_b"].isneginf().any() and causal["lse"].isfinite().all()
    assert large["lse"].max() > 88  # exp overflows fp32 past 88.7
    # the max lies far in either block: a merge relative to one side's lse overflows
    assert (large["lse_b"] - large["lse_a"]).max() > 88
    assert (large["lse_a"] - large["lse_b"]).max() > 88
    assert masked["lse"].isneginf().any() and masked["lse"].isfinite().any()
    # rows that see one block only, either one, with a log-sum-exp past exp's limit
    for name, empty, seen in (("causal_large", "lse_b", "lse_a"),
                              ("swapped_large", "lse_a", "lse_b")):
        blocks = _blocks(name)
        one_side = blocks[empty].isneginf() & blocks[seen].isfinite()
        assert (blocks[seen][one_side] > 88).any(), name


def _merge(old: str, new: str) -> str:
    return _mutant(MERGE_SOLUTION, old, new)


NO_GUARD = "    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))\n"

# wrong answer -> (its source, words of its hint, the diagnosis it must reach)
MERGE_MUTANTS = {
    "returns_out_only": (_merge("    return out, top", "    return out  #"), "a pair",
                         "not_a_pair"),
    "keeps_head_dim_in_lse": (_merge("    return out, top + torch.log(total)",
                                     "    return out, (top + torch.log(total))[..., None]"),
                              "shapes", "wrong_shape"),
    "no_running_max": (_merge("    top = torch.maximum(lse_a, lse_b)",
                              "    top = torch.zeros_like(lse_a)"), "overflows",
                       "no_running_max"),
    "nan_on_masked_row": (_merge(NO_GUARD, ""), "-inf - (-inf)", "nan_masked_row"),
    "sums_outputs": (_merge("    out = (wa[..., None] * out_a + wb[..., None] * out_b) / "
                            "safe[..., None]", "    out = out_a + out_b"),
                     "out_a + out_b", "summed_outputs"),
    "averages_outputs": (_merge("    out = (wa[..., None] * out_a + wb[..., None] * out_b) / "
                                "safe[..., None]", "    out = (out_a + out_b) / 2"),
                         "plain average", "averaged_outputs"),
    "ignores_lse_b": (_merge("torch.exp(lse_b - top)", "torch.ones_like(lse_b)"),
                      "weight 1", "one_lse_ignored"),
    "returns_lse_a": (_merge("    return out, top + torch.log(total)", "    return out, lse_a"),
                      "one side's", "lse_not_merged"),
    "lse_off_by_log2": (_merge("top + torch.log(total)", "top + torch.log(total + 1)"),
                        "out is right but lse differs", "wrong_lse"),
    # the -inf guard keyed on one side, not on the max: m = 0 on rows that saw only the
    # other side, whose exp(lse) overflows (passed before the large one-side cases)
    "guards_on_lse_a": (_merge("torch.where(torch.isfinite(top), top,",
                               "torch.where(torch.isfinite(lse_a), top,"),
                        "a guard on lse_a or lse_b alone", "guard_on_one_side"),
    "guards_on_lse_b": (_merge("torch.where(torch.isfinite(top), top,",
                               "torch.where(torch.isfinite(lse_b), top,"),
                        "one lse is -inf and the other large", "guard_on_one_side"),
    # the running max taken from block a: the large case's max lies far in block b too
    "max_from_block_a": (_merge("torch.maximum(lse_a, lse_b)", "lse_a.clone()"),
                         "overflows", "no_running_max"),
    # -inf replaced by a -1e9 sentinel: a row that sees nothing comes out finite (before:
    # "lse differs", with a max |difference| of 0 over the finite rows)
    "sentinel_for_inf": (_merge("    top = torch.maximum(lse_a, lse_b)",
                                "    lse_a = torch.nan_to_num(lse_a, neginf=-1e9)\n"
                                "    lse_b = torch.nan_to_num(lse_b, neginf=-1e9)\n"
                                "    top = torch.maximum(lse_a, lse_b)"),
                         "a sentinel standing in for -inf (like -1e9)", "lse_not_minus_inf"),
    # the log of the total made safe for division: lse 0 where nothing was seen
    "log_of_safe_total": (_merge("top + torch.log(total)", "top + torch.log(safe)"),
                          "take the log of the total itself", "lse_not_minus_inf"),
    "swaps_weights": (_merge("    out = (wa[..., None] * out_a + wb[..., None] * out_b)",
                             "    out = (wb[..., None] * out_a + wa[..., None] * out_b)"),
                      "out differs from the full softmax", "wrong_output"),
}


def test_merge_accepts_worked_answer():
    r = check("05.merge_partials", learner(MERGE_SOLUTION, "merge"))
    assert r.passed, r


def test_merge_refuses_parlibs_own_merge():
    from parlib.strategies.context_ops import merge_partials

    r = check("05.merge_partials", merge_partials)
    assert not r.passed and r.diagnosis == "parlib_merge", r
    assert "write your own" in r.message


@pytest.mark.parametrize("mutant", sorted(MERGE_MUTANTS))
def test_merge_rejects_mutant_with_its_diagnosis(mutant):
    src, hint, diagnosis = MERGE_MUTANTS[mutant]
    r = check("05.merge_partials", learner(src, "merge"))
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)


def test_every_merge_diagnosis_has_a_wrong_answer_that_reaches_it():
    reached = {diagnosis for _, _, diagnosis in MERGE_MUTANTS.values()} | {"parlib_merge"}
    assert sorted(reached) == sorted(questions("05")["05.merge_partials"].diagnosis_names())


# --------------------------------------------------------------------------- ring


def _ring(old: str, new: str) -> str:
    return _mutant(RING_SOLUTION, old, new)


ALL_GATHER = '''\
def ring_attention_forward(q, k, v, group, causal):
    cp = dist.get_world_size(group)
    ks, vs = [torch.empty_like(k) for _ in range(cp)], [torch.empty_like(v) for _ in range(cp)]
    dist.all_gather(ks, k.contiguous(), group=group)
    dist.all_gather(vs, v.contiguous(), group=group)
    rank, size = dist.get_rank(group), q.shape[-2]
    q_pos = torch.arange(rank * size, (rank + 1) * size)
    k_pos = torch.arange(cp * size)
    out, _ = block_attention(q, torch.cat(ks, -2), torch.cat(vs, -2),
                             q_pos if causal else None, k_pos if causal else None)
    return out
'''

# a ring that carries every block round but keeps them all and attends once at the end: the
# all-gather variant's memory, with sends and receives only (passed before)
RING_THEN_ATTEND_ONCE = '''\
def ring_attention_forward(q, k, v, group, causal):
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    size = q.shape[-2]
    send_to = dist.get_global_rank(group, (rank + 1) % cp)
    recv_from = dist.get_global_rank(group, (rank - 1) % cp)
    kv = torch.stack([k, v])
    blocks = {rank: kv}
    for step in range(cp - 1):
        incoming = torch.empty_like(kv)
        works = [dist.isend(kv, send_to, group=group),
                 dist.irecv(incoming, recv_from, group=group)]
        for w in works:
            w.wait()
        kv = incoming
        blocks[(rank - step - 1) % cp] = kv
    ks = torch.cat([blocks[i][0] for i in range(cp)], dim=-2)
    vs = torch.cat([blocks[i][1] for i in range(cp)], dim=-2)
    q_pos, k_pos = torch.arange(rank * size, (rank + 1) * size), torch.arange(cp * size)
    out, _ = block_attention(q, ks, vs, q_pos if causal else None, k_pos if causal else None)
    return out
'''

# the transfer started at every step, the last one included: cp sends, the last wasted
SENDS_EVERY_STEP = RING_SOLUTION.replace("        if step < cp - 1:", "        if True:")
assert SENDS_EVERY_STEP.count("if True:") == 2

NEIGHBOURS = ("    send_to = dist.get_global_rank(group, (rank + 1) % cp)\n"
              "    recv_from = dist.get_global_rank(group, (rank - 1) % cp)")
ISEND_IRECV = ("            works = [dist.isend(kv, send_to, group=group),\n"
               "                     dist.irecv(incoming, recv_from, group=group)]")

RING_MUTANTS = {
    "wrong_neighbour": (_ring("    send_to = dist.get_global_rank(group, (rank + 1) % cp)\n"
                              "    recv_from = dist.get_global_rank(group, (rank - 1) % cp)",
                              "    send_to = dist.get_global_rank(group, (rank - 1) % cp)\n"
                              "    recv_from = dist.get_global_rank(group, (rank + 1) % cp)"),
                        "other way round the ring", "wrong_neighbour"),
    "wrong_source": (_ring("source = (rank - step) % cp", "source = (rank - step - 1) % cp"),
                     "still on its way", "wrong_source"),
    "local_positions": (_ring("        k_pos = torch.arange(source * size, (source + 1) * size)",
                              "        k_pos = q_pos = torch.arange(size)"),
                        "within the chunk", "mask_local_positions"),
    "ignores_causal": (_ring("q_pos if causal else None,\n                               "
                             "k_pos if causal else None", "None, None"),
                       "without a mask", "no_mask"),
    "always_causal": (_ring("q_pos if causal else None,\n                               "
                            "k_pos if causal else None", "q_pos, k_pos"),
                      "apply the mask only when causal", "always_masked"),
    "forgets_last_block": (_ring("    for step in range(cp):", "    for step in range(cp - 1):"),
                           "leaves out the last block", "last_block_missing"),
    "ignores_group": (_ring("    rank, cp = dist.get_rank(group), dist.get_world_size(group)",
                            "    rank, cp = dist.get_rank(), dist.get_world_size()").replace(
                                "dist.get_global_rank(group, ", "(").replace(
                                ", group=group)", ")"),
                      "right when the group is the whole world", "ignores_group"),
    "returns_lse_too": (_ring("    return out\n", "    return out, lse\n"), "returned tuple",
                        "not_a_tensor"),
    "returns_whole_kv": (_ring("    return out\n", "    return out.repeat(1, 1, cp, 1)\n"),
                         "returned shape", "wrong_shape"),
    "doubles": (_ring("    return out\n", "    return 2 * out\n"), "differs from single-device",
                "wrong_output"),
    "all_gathers": (ALL_GATHER, "called all_gather", "collective_used"),
    # a blocking send before the receive on every rank (before: a 60 s wait, then "did not
    # match")
    "sends_before_receiving": (_ring(ISEND_IRECV,
                                     "            dist.send(kv, send_to, group=group)\n"
                                     "            dist.recv(incoming, recv_from, group=group)\n"
                                     "            works = []"),
                               "calls dist.send, which blocks until the peer receives",
                               "blocking_send"),
    "sends_twice": (_ring("            works = [dist.isend(kv, send_to, group=group),",
                          "            dist.send(kv, send_to, group=group)\n"
                          "            works = [dist.isend(kv, send_to, group=group),"),
                    "each waits in send", "blocking_send"),
    # receives from the rank it sends to: the same peer for cp = 2, a send never received
    # for cp = 4
    "receives_from_next": (_ring("recv_from = dist.get_global_rank(group, (rank - 1) % cp)",
                                 "recv_from = send_to"),
                           "did not match", "hang"),
    # K and V concatenated along the batch, not stacked: kv[0], kv[1] are K and V only for
    # batch 1 (passed before, when the check's batch was 1)
    "cats_kv_along_batch": (_ring("kv = torch.stack([k, v])", "kv = torch.cat([k, v])"),
                            "differs from single-device", "wrong_output"),
    # neighbours found by adding to the global rank: right on groups of consecutive ranks
    # (passed before, when the only sub-groups were {0, 1} and {2, 3})
    "neighbours_by_global_offset": (
        _ring(NEIGHBOURS, "    first = dist.get_rank() - rank  # the group's first global rank\n"
                          "    send_to = first + (rank + 1) % cp\n"
                          "    recv_from = first + (rank - 1) % cp"),
        "a group's ranks need not be consecutive", "neighbour_outside_group"),
    # the place in the group taken as the global rank mod cp: right for {0, 1} and {2, 3}
    # (passed before), not for {0, 2} and {1, 3}
    "place_from_global_rank": (
        _ring("    rank, cp = dist.get_rank(group), dist.get_world_size(group)",
              "    cp = dist.get_world_size(group)\n"
              "    rank = dist.get_rank() % cp  # my place in my group"),
        "though they did on groups of consecutive ranks", "not_consecutive"),
    "ring_then_attend_once": (RING_THEN_ATTEND_ONCE, "That is the all-gather variant",
                              "all_gather_variant"),
    "sends_every_step": (SENDS_EVERY_STEP,
                         "sent 2 blocks of K and V in one forward, not cp - 1 = 1",
                         "extra_transfers"),
}


def test_ring_accepts_worked_answer():
    r = check("05.ring_forward", learner(RING_SOLUTION, "ring_attention_forward", RING_PRELUDE))
    assert r.passed, r


@pytest.mark.parametrize("mutant", sorted(RING_MUTANTS))
def test_ring_rejects_mutant_with_its_diagnosis(mutant):
    src, hint, diagnosis = RING_MUTANTS[mutant]
    t0 = time.monotonic()
    r = check("05.ring_forward", learner(src, "ring_attention_forward", RING_PRELUDE))
    assert r.status == "failed", r
    assert time.monotonic() - t0 < 90  # a hang is named after the question's 20 s
    assert hint in r.message, r.message
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)


def test_every_ring_diagnosis_has_a_wrong_answer_that_reaches_it():
    reached = {diagnosis for _, _, diagnosis in RING_MUTANTS.values()}
    assert sorted(reached) == sorted(questions("05")["05.ring_forward"].diagnosis_names())
