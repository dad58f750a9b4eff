"""Questions of the long-runs chapter: each grader accepts the worked answer and rejects each
wrong answer (the worked answer's code with one change) with the diagnosis that names its
mistake; together the wrong answers reach every diagnosis."""

from __future__ import annotations

import pytest

from parlib.cost.checkpoint import checkpoint_bytes, reshard_reads, young_daly_interval
from parlib.course.check import check
from parlib.course.questions.ch09 import (
    RESHARD_SOLUTION,
    TOKEN_LOSS_SOLUTION,
    ZERO1_STATE_SOLUTION,
)
from parlib.course.questions.ch09.reshard import CASES
from parlib.course.questions.ch09.token_loss import _microbatches
from parlib.course.registry import questions
from tests.helpers.learner_code import learner

pytestmark = pytest.mark.usefixtures("clean_checks")

ALL_IDS = {"09.checkpoint_bytes", "09.young_daly", "09.adam_step", "09.reshard_reads",
           "09.global_token_loss", "09.zero1_checkpoint"}


def _mutant(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"the worked answer no longer has {old!r}"
    return source.replace(old, new)


DCP_IMPORTS = ("from torch.distributed.device_mesh import DeviceMesh\n"
               "from torch.distributed.tensor import DTensor, Shard\n")


def _grade(qid: str, src: str, name: str):
    import importlib

    questions_ = importlib.import_module("parlib.course.questions.ch09")  # registers them
    assert questions_
    return check(qid, learner(src, name, "import torch.nn.functional as F\n" + DCP_IMPORTS))


def test_ch09_questions_registered():
    import parlib.course.questions.ch09  # noqa: F401 - registers them

    assert ALL_IDS <= set(questions("09"))
    for q in questions("09").values():
        assert q.working and q.prompt


# --------------------------------------------------------------------------- numbers

BYTES = 14 * 7e9 / 8
SECONDS = (2 * 90 * 5 * 365 * 24 * 3600 / 1024) ** 0.5


@pytest.mark.parametrize("qid, right, wrong, hint", [
    ("09.checkpoint_bytes", BYTES, 16 * 7e9 / 8, "counts the gradients"),
    ("09.checkpoint_bytes", BYTES, 14 * 7e9, "the whole checkpoint"),
    ("09.checkpoint_bytes", BYTES, 2 * 7e9 / 8, "only the bf16 weights"),
    ("09.checkpoint_bytes", BYTES, 12 * 7e9 / 8, "Adam in fp32"),
    ("09.checkpoint_bytes", BYTES, 2 * 7e9 + 12 * 7e9 / 8, "ZeRO-1"),
    ("09.checkpoint_bytes", BYTES, BYTES / 2**30 * 1e9, "GiB"),
    ("09.young_daly", SECONDS, SECONDS * 32, "one GPU's mean time"),
    ("09.young_daly", SECONDS, SECONDS / 2**0.5, "not tau"),
    ("09.young_daly", SECONDS, SECONDS * 2**0.5, "not sqrt(4 delta M)"),
    ("09.young_daly", SECONDS, SECONDS / 60, "1000x"),  # minutes: too low, a unit slip
    ("09.young_daly", SECONDS, 5 * 365 * 24 * 3600 / 1024, "mean time between failures"),
])
def test_numeric_answers_and_hints(qid, right, wrong, hint):
    import parlib.course.questions.ch09  # noqa: F401

    assert check(qid, right).passed
    r = check(qid, wrong)
    assert r.status == "failed", r.message
    if hint != "1000x":
        assert hint in r.message, r.message


def test_expected_values_are_parlib_cost():
    import parlib.course.questions.ch09  # noqa: F401

    per_rank = checkpoint_bytes(7e9, "fsdp", {"dp": 8}, mixed_precision=True).per_rank
    assert check("09.checkpoint_bytes", per_rank).passed
    assert check("09.young_daly", young_daly_interval(90, 5 * 365 * 24 * 3600 / 1024)).passed


@pytest.mark.parametrize("qid", ["09.checkpoint_bytes", "09.young_daly"])
def test_every_numeric_mistake_gets_its_own_hint(qid):
    import parlib.course.questions.ch09  # noqa: F401

    q = questions("09")[qid]
    assert len(q.mistakes) >= 4
    for wrong, hint in q.mistakes.items():
        r = check(qid, wrong)
        assert r.status == "failed" and hint in r.message, (wrong, r.message)


# --------------------------------------------------------------------------- resharding


def _reshard(old: str, new: str) -> str:
    return _mutant(RESHARD_SOLUTION, old, new)


def test_reshard_cases_are_uneven_and_have_empty_pieces():
    sizes = list(CASES.values())
    assert any(numel % saved and numel % world and saved % world and world % saved
               for numel, saved, world in sizes)
    assert any(-(-numel // saved) * (saved - 1) >= numel for numel, saved, _ in sizes)


# wrong answer -> (its source, words of its hint, the diagnosis it must reach)
RESHARD_MUTANTS = {
    "local_offsets": (_reshard("reads.append((saved, max(lo, start), min(hi, stop)))",
                               "reads.append((saved, max(lo, start) - start, "
                               "min(hi, stop) - start))"),
                      "offsets inside the saved piece", "local_offsets"),
    "keeps_empty_overlaps": (_reshard("if max(lo, start) < min(hi, stop):",
                                      "if max(lo, start) <= min(hi, stop):"),
                             "zero elements", "empty_reads"),
    "floor_split": (_reshard("        size = -(-numel // n_ranks)\n"
                             "        return min(numel, r * size), min(numel, (r + 1) * size)",
                             "        size = numel // n_ranks\n"
                             "        return r * size, numel if r == n_ranks - 1 "
                             "else (r + 1) * size"),
                    "numel // N", "floor_split"),
    "array_split": (_reshard("        size = -(-numel // n_ranks)\n"
                             "        return min(numel, r * size), min(numel, (r + 1) * size)",
                             "        size, extra = divmod(numel, n_ranks)\n"
                             "        start = r * size + min(r, extra)\n"
                             "        return start, start + size + (r < extra)"),
                    "numpy.array_split", "array_split"),
    "same_rank": (_reshard("    reads = []\n    for saved in range(saved_world_size):",
                           "    return [(rank, lo, hi)] if rank < saved_world_size else []\n"
                           "    reads = []\n    for saved in range(saved_world_size):"),
                  "new rank r's piece is not old rank r's", "same_rank_only"),
    "returns_ranges_only": (_reshard("reads.append((saved, max(lo, start), min(hi, stop)))",
                                     "reads.append((max(lo, start), min(hi, stop)))"),
                            "list of (saved rank, start, stop)", "not_a_list_of_triples"),
    "stop_inclusive": (_reshard("reads.append((saved, max(lo, start), min(hi, stop)))",
                                "reads.append((saved, max(lo, start), min(hi, stop) - 1))"),
                       "each non-empty overlap", "wrong_reads"),
    "calls_parlib": ("def reshard_plan(numel, saved_world_size, world_size, rank):\n"
                     "    from parlib.cost import reshard_reads\n"
                     "    return reshard_reads(numel, saved_world_size, world_size, rank)\n",
                     "work out the overlaps yourself", "parlib_reshard_reads"),
}


def test_reshard_accepts_the_worked_answer():
    r = _grade("09.reshard_reads", RESHARD_SOLUTION, "reshard_plan")
    assert r.passed, r.message


@pytest.mark.parametrize("mutant", list(RESHARD_MUTANTS))
def test_reshard_rejects_mutant(mutant):
    src, hint, diagnosis = RESHARD_MUTANTS[mutant]
    r = _grade("09.reshard_reads", src, "reshard_plan")
    assert r.status == "failed" and hint in r.message, r.message
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)


# --------------------------------------------------------------------------- token loss


def _loss(old: str, new: str) -> str:
    return _mutant(TOKEN_LOSS_SOLUTION, old, new)


def test_token_loss_padding_differs_across_ranks_and_microbatches():
    counts = [[int((y != -100).sum()) for _, y in _microbatches(r)] for r in range(4)]
    assert len({tuple(c) for c in counts}) == 4  # every rank differs
    assert all(len(set(c)) > 1 for c in counts)  # and within a rank, across microbatches
    assert all(min(c) > 0 for c in counts)


TOKEN_MUTANTS = {
    "per_microbatch_means": (
        _loss("    return total / count[0]\n",
              "    means = [F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1),\n"
              "                             ignore_index=-100) for lg, y in microbatches]\n"
              "    return sum(means) / len(means) / dist.get_world_size(group)\n"),
        "averages each microbatch's mean", "per_microbatch_means"),
    "local_count": (_loss("    dist.all_reduce(count, group=group)  # the real tokens of the "
                          "whole group's batch\n",
                          "    count = count * dist.get_world_size(group)\n"),
                    "this rank's own real tokens", "local_count"),
    "counted_padding": (_loss("real = sum(int((y != -100).sum()) for _, y in microbatches)",
                              "real = sum(y.numel() for _, y in microbatches)"),
                        "includes the padded positions", "counted_padding"),
    "world_group": (_loss("dist.all_reduce(count, group=group)", "dist.all_reduce(count)"),
                    "every rank of the world", "world_group"),
    "times_group_size": (_loss("    return total / count[0]\n",
                               "    return total / count[0] * dist.get_world_size(group)\n"),
                         "N times too large", "times_group_size"),
    "detached": (_loss("    return total / count[0]\n",
                       "    return (total / count[0]).detach()\n"),
                 "no gradient", "detached"),
    "returns_float": (_loss("    return total / count[0]\n",
                            "    return float(total / count[0])\n"),
                      "returned float", "not_a_scalar"),
    "patched_value": (_loss("    return total / count[0]\n",
                            "    loss = total / count[0]\n"
                            "    return loss.detach() + 0 * total\n"),
                      "right value but not the right gradient", "wrong_gradient"),
    "sums_without_dividing": (_loss("    return total / count[0]\n", "    return total\n"),
                              "Sum the cross-entropy of the real tokens", "wrong_loss"),
}


def test_token_loss_accepts_the_worked_answer():
    r = _grade("09.global_token_loss", TOKEN_LOSS_SOLUTION, "token_loss")
    assert r.passed, r.message


@pytest.mark.parametrize("mutant", list(TOKEN_MUTANTS))
def test_token_loss_rejects_mutant(mutant):
    _assert_rejected("09.global_token_loss", "token_loss", *TOKEN_MUTANTS[mutant])


def _assert_rejected(question, function, src, hint, diagnosis):
    r = _grade(question, src, function)
    assert r.status == "failed" and hint in r.message, r.message
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)


def test_the_world_group_mistake_fails_only_on_the_sub_groups():
    """Its loss is right wherever the group is the world: only the strided launch parts it."""
    src = TOKEN_MUTANTS["world_group"][0]
    r = _grade("09.global_token_loss", src, "token_loss")
    assert "two groups of 2" in r.message, r.message


# --------------------------------------------------------------------------- Zero1 with DCP


def _zero1(old: str, new: str) -> str:
    return _mutant(ZERO1_STATE_SOLUTION, old, new)


# wrong answer -> (its source, words of its hint, the diagnosis it must reach)
ZERO1_MUTANTS = {
    # the pieces at the wrong offsets: no global shape, DTensor assumes even pieces
    "no_global_shape": (_zero1("value[:real], mesh, [Shard(0)], shape=(numel,), stride=(1,),",
                               "value[:real], mesh, [Shard(0)],"),
                        "puts the pieces at the wrong offsets", "wrong_offsets"),
    # a shard read from the wrong offset inside the piece: its real elements taken from the end
    "real_elements_from_the_end": (_zero1("value[:real], mesh,",
                                          "value[shard.size - real:], mesh,"),
                                   "the padding comes last", "wrong_state"),
    "step_not_saved": (_zero1("            if value.dim() == 0:  # Adam's step: the same on "
                              "every rank, saved once\n"
                              "                state[f\"flat{i}.{name}\"] = value\n",
                              "            if value.dim() == 0:  # the step: not a piece\n"
                              "                continue\n"),
                       "step count is 1", "step_not_saved"),
    # saved, but loaded into a copy on the one rank whose piece is short
    "copied_on_the_short_rank": (_zero1("value[:real], mesh,",
                                        "value[:real] if real == shard.size "
                                        "else value[:real].clone(), mesh,"),
                                 "saved but not loaded", "moments_not_loaded"),
    "only_rank_0_saves": (_zero1("    return state\n", "    return state if rank == 0 else {}\n"),
                          "only rank 0's shard", "pieces_missing"),
    # plain tensors: DCP takes them as replicated and writes rank 0's piece only
    "plain_tensors": (_zero1("DTensor.from_local(\n                    value[:real], mesh, "
                             "[Shard(0)], shape=(numel,), stride=(1,),\n"
                             "                    run_check=False)", "value[:real]"),
                      "rank 0's piece only", "saved_once"),
    "global_rank": (_zero1("    rank = mesh.get_local_rank()", "    rank = dist.get_rank()"),
                    "not by its global rank", "group_rank"),
    "names_by_world_size": (_zero1("state[f\"flat{i}.{name}\"] = DTensor",
                                   "state[f\"flat{i}.{name}.{mesh.size()}\"] = DTensor"),
                            "Missing key", "dcp_refused"),
    "returns_a_list": (_zero1("    return state\n", "    return list(state.values())\n"),
                       "returned a list", "not_a_dict"),
}


def test_zero1_checkpoint_accepts_the_worked_answer():
    r = _grade("09.zero1_checkpoint", ZERO1_STATE_SOLUTION, "zero1_state")
    assert r.passed, r.message


@pytest.mark.parametrize("mutant", list(ZERO1_MUTANTS))
def test_zero1_checkpoint_rejects_mutant(mutant):
    _assert_rejected("09.zero1_checkpoint", "zero1_state", *ZERO1_MUTANTS[mutant])


def test_zero1_checkpoint_names_the_one_rank_whose_moments_were_not_loaded():
    r = _grade("09.zero1_checkpoint", ZERO1_MUTANTS["copied_on_the_short_rank"][0],
               "zero1_state")
    assert "ranks with unloaded moments: [3]" in r.message, r.message


def test_zero1_checkpoint_settings_are_uneven_with_an_empty_piece_and_sub_groups():
    from parlib.course.questions.ch09.zero1_checkpoint import SCENARIOS, Small, param_groups

    sizes = [sum(p.numel() for p in g["params"]) for g in param_groups(Small())]
    worlds = {len(ranks) for _, saved, loaded in SCENARIOS for ranks in (saved, loaded)}
    assert all(sizes[0] % n for n in worlds)  # no world size divides the weights
    assert -(-sizes[1] // 4) * 3 >= sizes[1]  # rank 3 of 4 holds no bias
    assert any(len(s) % len(t) and len(t) % len(s) for _, s, t in SCENARIOS)  # 3 -> 2
    assert any(list(t) != list(range(len(t))) for _, _, t in SCENARIOS)  # {1, 3}, {0, 3}


def test_zero1_checkpoint_reference_is_what_zero1_on_one_rank_would_resume_to():
    """The check's reference moments are torch's AdamW's, flattened per parameter group in
    Zero1's order: the flat vectors Zero1 keeps."""
    from parlib.course.questions.ch09.zero1_checkpoint import SAVE_AT, reference

    ref = reference()
    assert [v.numel() for v in ref["moments"]["exp_avg"]] == [35, 9]
    assert len(ref["losses"]) == len(ref["weights"]) > 0 and SAVE_AT > 1


@pytest.mark.parametrize("qid, mutants", [("09.reshard_reads", RESHARD_MUTANTS),
                                          ("09.global_token_loss", TOKEN_MUTANTS),
                                          ("09.zero1_checkpoint", ZERO1_MUTANTS)])
def test_every_diagnosis_has_a_wrong_answer_that_reaches_it(qid, mutants):
    import parlib.course.questions.ch09  # noqa: F401

    reached = {diagnosis for _, _, diagnosis in mutants.values()}
    declared = set(questions("09")[qid].diagnosis_names()) - {"hang"}
    assert reached == declared


def test_parlibs_own_map_is_refused():
    import parlib.course.questions.ch09  # noqa: F401

    r = check("09.reshard_reads", reshard_reads)
    assert r.status == "failed" and "reshard_reads itself" in r.message, r.message


def test_stubs_are_not_attempted():
    stub = "def token_loss(microbatches, group):\n    raise NotImplementedError\n"
    assert _grade("09.global_token_loss", stub, "token_loss").status == "not attempted"
    stub = ("def reshard_plan(numel, saved_world_size, world_size, rank):\n"
            "    raise NotImplementedError\n")
    assert _grade("09.reshard_reads", stub, "reshard_plan").status == "not attempted"
    stub = "def zero1_state(optimizer):\n    raise NotImplementedError\n"
    assert _grade("09.zero1_checkpoint", stub, "zero1_state").status == "not attempted"


@pytest.mark.parametrize("mutant", ["floor_split", "array_split"])
def test_the_other_splits_part_from_chunks_only_on_uneven_sizes(mutant):
    """Right whenever the sizes divide (the first case), so only the uneven ones catch them."""
    fn = learner(RESHARD_MUTANTS[mutant][0], "reshard_plan")
    numel, saved, world = CASES["even"]
    assert numel % saved == 0 == numel % world
    assert all(fn(numel, saved, world, r) == reshard_reads(numel, saved, world, r)
               for r in range(world))
    assert any(fn(*CASES[name], r) != reshard_reads(*CASES[name], r)
               for name in CASES for r in range(CASES[name][2]))


# --------------------------------------------------------------------------- Adam's step


def test_adam_step():
    import parlib.course.questions.ch09  # noqa: F401

    assert check("09.adam_step", "a").passed
    for wrong, hint in (("B", "the moments are in the checkpoint"),
                        ("C", "also feeds its bias correction"),
                        ("D", "it is in the denominator")):
        r = check("09.adam_step", wrong)
        assert r.status == "failed" and hint in r.message, r.message


def test_adam_step_key_is_the_optimizers_own_behaviour():
    """torch's Adam with its step count reset on warm moments steps shorter, by the factor
    the working computes (sqrt(1 - beta2^t) / (1 - beta1^t)), than with its count kept."""
    import torch

    from parlib.course.questions.ch09.numbers import resumed_update_scale

    def update(step: int) -> torch.Tensor:
        w = torch.zeros(3, requires_grad=True)
        opt = torch.optim.Adam([w], lr=1.0, eps=0.0)
        w.grad = torch.tensor([1.0, -2.0, 0.5])
        opt.step()  # creates the state; then make the moments warm and set the count
        state = opt.state[w]
        state["exp_avg"].copy_(torch.tensor([0.3, -0.4, 0.1]))
        state["exp_avg_sq"].copy_(torch.tensor([0.2, 0.5, 0.05]))
        state["step"].fill_(step - 1)
        before = w.detach().clone()
        opt.step()
        return w.detach() - before

    ratio = update(1) / update(10_000)
    assert torch.allclose(ratio, torch.full((3,), resumed_update_scale(1)), rtol=1e-3)
    assert resumed_update_scale(1) < 0.5  # several times smaller, not larger


def _round_trip_on_even_sizes(fn, folder: str) -> bool:
    """Zero1 over one vector of 8 elements, which 4 and 2 divide: saved by the 4 ranks,
    loaded by ranks {0, 1}, the first ranks of the world. True where rank r's loaded
    exp_avg is the saved run's piece r."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from parlib.strategies.zero import Zero1

    rank = dist.get_rank()
    groups = dist.new_group([0, 1, 2, 3]), dist.new_group([0, 1])
    weight = torch.nn.Parameter(torch.arange(8.0))
    opt = Zero1([weight], torch.optim.AdamW, lr=0.1, group=groups[0])
    weight.grad = torch.full((8,), rank + 1.0)
    opt.step()
    full = torch.empty(8)
    dist.all_gather_into_tensor(full, opt.optimizer.state[opt.shards[0].tensor]["exp_avg"])
    dcp.save(fn(opt), checkpoint_id=folder, process_group=groups[0])
    if rank >= 2:
        return True
    fresh = torch.nn.Parameter(torch.zeros(8))
    loaded = Zero1([fresh], torch.optim.AdamW, lr=0.0, group=groups[1])
    fresh.grad = torch.zeros(8)
    loaded.step()  # the state to load into, as the check creates it
    dcp.load(fn(loaded), checkpoint_id=folder, process_group=groups[1])
    got = loaded.optimizer.state[loaded.shards[0].tensor]["exp_avg"]
    return torch.equal(got, full[4 * rank:4 * rank + 4])


@pytest.mark.parametrize("mutant", ["no_global_shape", "global_rank",
                                    "copied_on_the_short_rank"])
def test_zero1_mistakes_that_only_uneven_sizes_or_sub_groups_part(tmp_path, mutant):
    """Right where every size divides and the group is the world's first ranks: only the
    check's uneven vectors (no global shape, the short rank's copy) and its sub-group {1, 3}
    (the global rank taken for the group's) catch them."""
    import parlib

    fn = learner(ZERO1_MUTANTS[mutant][0], "zero1_state", DCP_IMPORTS)
    assert all(parlib.launch(_round_trip_on_even_sizes, fn, str(tmp_path), world_size=4,
                             timeout=120))


def test_the_even_round_trip_can_fail(tmp_path):
    """The ground of the test above: moments loaded into copies on every rank come back
    wrong there too."""
    import parlib

    src = _zero1("value[:real], mesh,", "value[:real].clone(), mesh,")
    fn = learner(src, "zero1_state", DCP_IMPORTS)
    assert not any(parlib.launch(_round_trip_on_even_sizes, fn, str(tmp_path), world_size=4,
                                 timeout=120)[:2])
