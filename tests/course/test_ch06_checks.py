"""Questions of the expert-parallel chapter: each grader accepts the worked answer and rejects
each wrong answer (the worked answer's code with one change) with the diagnosis that names its
mistake; together the wrong answers reach every diagnosis."""

from __future__ import annotations

import pytest

from parlib.cost.experts import ep_all_to_all_bytes_per_layer, moe_params_per_rank, tokens_dropped
from parlib.course.check import check
from parlib.course.questions.ch06 import DISPATCH_SOLUTION, EP_LAYER_SOLUTION
from parlib.course.questions.ch06.dispatch import CASES, IDLE, _case
from parlib.course.questions.ch06.ep_layer import FACTOR, PHASES, TOKENS, _setting
from parlib.course.questions.ch06.ep_layer import IDLE as LAYER_IDLE
from parlib.course.registry import questions
from parlib.model import route
from tests.helpers.learner_code import learner

pytestmark = pytest.mark.usefixtures("clean_checks")


def _mutant(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"the worked answer no longer has {old!r}"
    return source.replace(old, new)


def _dispatch(old: str, new: str) -> str:
    return _mutant(DISPATCH_SOLUTION, old, new)


def test_ch06_questions_registered():
    ids = set(questions("06"))
    assert {"06.dispatch", "06.expert_parallel_layer", "06.params_per_rank",
            "06.all_to_all_bytes", "06.tokens_dropped", "06.why_no_tp"} <= ids
    for q in questions("06").values():
        assert q.working and q.prompt


# --------------------------------------------------------------------------- numbers

PARAMS, BYTES = 939_786_240, 1_879_048_192


@pytest.mark.parametrize("qid, right, wrong, hint", [
    ("06.params_per_rank", PARAMS, 7_516_454_912, "the whole layer"),
    ("06.params_per_rank", PARAMS, PARAMS / 2, "two matrices"),
    ("06.params_per_rank", PARAMS, PARAMS / 8, "E/ep experts, not one"),
    ("06.params_per_rank", PARAMS, PARAMS * 1.5, "not three"),
    # the router (h x E = 262,144, 0.03%) left out or split: accepted at 0.1% before
    ("06.params_per_rank", PARAMS, PARAMS - 4096 * 64, "leaves out the router"),
    ("06.params_per_rank", PARAMS, PARAMS - 4096 * 64 * 7 / 8, "replicated, not split"),
    ("06.params_per_rank", PARAMS, 9.398e8, "give the exact count"),
    ("06.all_to_all_bytes", BYTES, BYTES / 2, "that is half"),
    ("06.all_to_all_bytes", BYTES, BYTES / 4, "four per layer"),
    ("06.all_to_all_bytes", BYTES, BYTES / 8, "once per chosen expert"),
    ("06.all_to_all_bytes", BYTES, BYTES * 2, "2 bytes"),
    ("06.all_to_all_bytes", BYTES, BYTES * 63 / 64, "own experts"),
    ("06.tokens_dropped", 3, 5, "rounded up"),
    ("06.tokens_dropped", 3, 19, "every token makes k choices"),
    ("06.tokens_dropped", 3, 9, "capacity factor"),
    ("06.tokens_dropped", 3, 2, "counts the experts"),
])
def test_numeric_answers_and_hints(qid, right, wrong, hint):
    assert check(qid, right).passed
    r = check(qid, wrong)
    assert r.status == "failed" and hint in r.message, r.message


@pytest.mark.parametrize("qid", ["06.params_per_rank", "06.all_to_all_bytes",
                                 "06.tokens_dropped"])
def test_every_numeric_mistake_gets_its_own_hint(qid):
    q = questions("06")[qid]
    assert len(q.mistakes) >= 4
    for wrong, hint in q.mistakes.items():
        r = check(qid, wrong)
        assert r.status == "failed" and hint in r.message, (wrong, r.message)


def test_expected_values_are_parlib_cost():
    assert check("06.params_per_rank", moe_params_per_rank(64, 8, 4096, 14336, False)).passed
    assert check("06.all_to_all_bytes", ep_all_to_all_bytes_per_layer(4096, 7168, 8, 2)).passed
    assert check("06.tokens_dropped", tokens_dropped([10, 3, 7, 2, 6, 4, 9, 7], 1.25)).passed


def test_tokens_dropped_is_exact():
    assert check("06.tokens_dropped", 4).status == "failed"


def test_why_no_tp():
    assert check("06.why_no_tp", "b").passed
    for wrong, hint in (("A", "like any other MLP"), ("C", "what must travel"),
                        ("D", "every expert lives on some GPU")):
        r = check("06.why_no_tp", wrong)
        assert r.status == "failed" and hint in r.message, r.message


def test_why_no_tp_right_option_is_not_the_longest():
    q = questions("06")["06.why_no_tp"]
    longest = max(len(text) for text in q.options.values())
    assert len(q.options[q.answer]) < longest


# --------------------------------------------------------------------------- dispatch


def _token_major_keep(experts, capacity):
    taken, keep = [0] * 8, []
    for row in experts.tolist():  # a token's second choice before the next token's first
        for e in row:
            keep.append(taken[e] < capacity)
            taken[e] += 1
    return keep


def test_dispatch_cases_drop_choices_and_tell_the_orders_apart():
    # the capacity cases must drop choices, and dropping token-major must drop other ones
    assert [CASES[n][0] for n in CASES] == [2, 4, 2, 4, 4]
    for name in ("ep2_capacity", "ep4_capacity"):
        case = _case(name)
        r = case["routing"]
        assert not r.keep.all()
        assert _token_major_keep(r.experts, case["capacity"]) != r.keep.reshape(-1).tolist()


CHOICE_MAJOR = ("        for j in range(k):  # choice-major: every first choice before any "
                "second one\n            for t in range(T):")

# wrong answer -> (its source, words of its hint, the diagnosis it must reach)
DISPATCH_MUTANTS = {
    "counts_by_expert": (_dispatch("per_rank = per_expert.view(ep, -1).sum(1)",
                                   "per_rank = per_expert"), "one count per expert",
                         "counts_by_expert"),
    "forgets_router_weight": (_dispatch("back * weights[token, choice][:, None]", "back"),
                              "without the router's weight", "forgot_router_weight"),
    "combines_in_sent_order": (_dispatch("    back[order] = returned", "    back = returned"),
                               "undo that permutation", "wrong_combine_order"),
    "permutes_again": (_dispatch("    back[order] = returned", "    back = returned[order]"),
                       "its inverse", "wrong_combine_order"),
    "drops_token_major": (_dispatch(CHOICE_MAJOR, "        for t in range(T):\n"
                                                  "            for j in range(k):"),
                          "choice-major", "wrong_tokens_dropped"),
    "ignores_capacity": (_dispatch("    if capacity is not None:", "    if False:"),
                         "you sent every choice", "capacity_ignored"),
    "counts_every_choice": (_dispatch("torch.bincount(expert, minlength=n_experts)",
                                      "torch.bincount(experts.reshape(-1), minlength=n_experts)"),
                            "the kept ones", "counts_not_kept"),
    "unsorted_rows": (_dispatch("order = torch.argsort(expert, stable=True)",
                                "order = torch.arange(len(expert))"),
                      "sort the kept choices by expert", "not_grouped"),
    "sends_scaled_rows": (_dispatch("exchange(x[token[order]],",
                                        "exchange(x[token[order]] * 2,"),
                              "not rows of x", "rows_not_tokens"),
    "hard_codes_two_ranks": (_dispatch("per_expert.view(ep, -1).sum(1)",
                                       "per_expert.view(2, -1).sum(1)"),
                             "ep = 4, E = 8 experts", "count_lengths"),
    "per_rank_strided": (_dispatch("per_expert.view(ep, -1).sum(1)",
                                   "per_expert.view(-1, ep).sum(0)"),
                         "contiguous experts", "rank_counts_disagree"),
    "per_rank_of_one_rank": (_dispatch("per_expert.view(ep, -1).sum(1)",
                                       "per_expert.view(ep, -1).sum(1)[:1]"),
                             "one count per rank", "count_lengths"),
    "never_exchanges": (_dispatch("returned = exchange(x[token[order]], per_rank, per_expert)",
                                  "returned = x[token[order]]"), "never called exchange",
                        "no_exchange"),
    "exchanges_twice": (_dispatch("    back = torch.empty_like(returned)\n",
                                  "    exchange(x[token[order]], per_rank, per_expert)\n"
                                  "    back = torch.empty_like(returned)\n"),
                        "more than once", "called_exchange_twice"),
    "returns_counts_too": (_dispatch("    return out.index_add(",
                                     "    return per_rank, out.index_add("),
                           "returned a tuple", "not_a_tensor"),
    "returns_transposed": (_dispatch("[:, None])\n", "[:, None]).T\n"),
                     "expected (16, 8)", "wrong_shape"),
}


def test_dispatch_idle_case_has_idle_experts_an_idle_rank_and_tokens_that_lose_everything():
    case = _case("ep4_idle_experts")
    r = case["routing"]
    picked = set(r.experts.reshape(-1).tolist())
    assert not picked & set(IDLE["ep4_idle_experts"]) and {6, 7} <= set(IDLE["ep4_idle_experts"])
    assert (~r.keep.any(1)).any()  # some token loses every choice at capacity
    for name in CASES:  # and only there: the other cases do not tell these answers apart
        if name not in IDLE:
            other = _case(name)["routing"]
            assert other.keep.any(1).all() and len(set(other.experts.reshape(-1).tolist())) == 8


# Wrong answers right on every case but the idle one (or on none, but named for another
# reason before): (source, words of the hint, diagnosis)
DISPATCH_EDGE_MUTANTS = {
    "bincount_without_minlength": (
        _dispatch("torch.bincount(expert, minlength=n_experts)", "torch.bincount(expert)"),
        "minlength=n_experts", "idle_expert_counts"),
    "counts_of_present_experts": (
        _dispatch("torch.bincount(expert, minlength=n_experts)",
                  "torch.unique(expert, return_counts=True)[1]"),
        "receive no token", "idle_expert_counts"),
    "dropped_token_passed_through": (
        _dispatch("    out = torch.zeros_like(x)\n",
                  "    out = x * ~keep.any(1, keepdim=True)  # a dropped token passes through\n"),
        "lost every choice at capacity", "dropped_token_passed_through"),
    "renormalises_over_top_k": (
        _dispatch("back * weights[token, choice][:, None]",
                  "back * (weights / weights.sum(1, keepdim=True))[token, choice][:, None]"),
        "renormalised the router weights", "renormalised_router_weights"),
    "renormalises_over_kept_choices": (
        _dispatch("    out = torch.zeros_like(x)\n",
                  "    kept = weights * keep\n"
                  "    weights = kept / kept.sum(1, keepdim=True)\n"
                  "    out = torch.zeros_like(x)\n"),
        "renormalised the router weights", "renormalised_router_weights"),
}
DISPATCH_MUTANTS.update(DISPATCH_EDGE_MUTANTS)


def test_dispatch_accepts_worked_answer():
    r = check("06.dispatch", learner(DISPATCH_SOLUTION, "expert_parallel_moe"))
    assert r.passed, r


@pytest.mark.parametrize("mutant", sorted(DISPATCH_MUTANTS))
def test_dispatch_rejects_mutant_with_its_diagnosis(mutant):
    src, hint, diagnosis = DISPATCH_MUTANTS[mutant]
    r = check("06.dispatch", learner(src, "expert_parallel_moe"))
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)


def test_every_dispatch_diagnosis_has_a_wrong_answer_that_reaches_it():
    reached = {diagnosis for _, _, diagnosis in DISPATCH_MUTANTS.values()}
    assert sorted(reached) == sorted(questions("06")["06.dispatch"].diagnosis_names())


# --------------------------------------------------------------------------- on ranks

EP_PRELUDE = "from parlib.strategies.experts import all_to_all\n"


def _layer(old: str, new: str) -> str:
    return _mutant(EP_LAYER_SOLUTION, old, new)


def _check_layer(src: str, prelude: str = EP_PRELUDE):
    return check("06.expert_parallel_layer", learner(src, "expert_parallel_layer", prelude))


def test_expert_parallel_layer_settings_drop_choices_and_tell_the_orders_apart():
    # in every group of every launch, the capacity setting must drop choices, and dropping
    # token-major must drop other ones on some rank
    for ep, index in ((2, 0), (4, 0), (2, 1), (2, 2)):
        s = _setting(index, ep, FACTOR)
        keeps, token_major = [], []
        for part in s["x"].split(TOKENS):
            r = route(part, s["moe"].router, 2, FACTOR)
            keeps.append(r.keep.reshape(-1).tolist())
            token_major.append(_token_major_keep(r.experts, s["capacity"]))
        assert not all(all(k) for k in keeps), (ep, index)
        assert keeps != token_major, (ep, index)
    assert [p for p, _ in PHASES[4]] == ["world", "world", "pairs", "pairs", "strided"]


def test_expert_parallel_layer_accepts_worked_answer():
    r = _check_layer(EP_LAYER_SOLUTION)
    assert r.passed, r


def test_expert_parallel_layer_accepts_torch_functional_all_to_all():
    # torch's differentiable all_to_all_single (deprecated, but it carries gradients)
    prelude = (
        "import warnings\n"
        "import torch.distributed.nn.functional as dnf\n"
        "def all_to_all(rows, send, recv, group):\n"
        "    out = rows.new_empty((sum(recv), rows.shape[1]))\n"
        "    with warnings.catch_warnings():\n"
        "        warnings.simplefilter('ignore', FutureWarning)\n"
        "        return dnf.all_to_all_single(out, rows, recv, send, group=group)\n")
    r = _check_layer(EP_LAYER_SOLUTION, prelude)
    assert r.passed, r


def test_expert_parallel_layer_accepts_experts_run_on_more_rows_than_theirs():
    # wasteful but right: every local expert on every arrived row, its own rows kept
    src = _layer("        rows = torch.nonzero(local == i).squeeze(1)\n"
                 "        computed = computed.index_copy(0, rows, module(arrived[rows]))\n",
                 "        computed = torch.where((local == i)[:, None], module(arrived), "
                 "computed)\n")
    r = _check_layer(src)
    assert r.passed, r


PLAIN_SEND = ("    arrived = x.new_empty((sum(recv), x.shape[1]))\n"
              "    dist.all_to_all_single(arrived, x[token[order]], recv, send, group=group)\n")

# wrong answer -> (its source, words of its hint, the diagnosis it must reach)
LAYER_MUTANTS = {
    "world_size_not_group_size": (
        _layer("    ep = dist.get_world_size(group)", "    ep = dist.get_world_size()"),
        "wrong in a sub-group", "ignores_group"),
    "collectives_on_the_world": (
        _layer("    ep = dist.get_world_size(group)\n",
               "    group = dist.group.WORLD  # the world, whatever the caller's group\n"
               "    ep = dist.get_world_size(group)\n"),
        "two ep groups of 2", "ignores_group"),
    "plain_all_to_all": (
        _layer("    arrived = all_to_all(x[token[order]], send, recv, group)"
               "  # by sender, then by expert\n", PLAIN_SEND),
        "autograd cannot see through it", "plain_all_to_all"),
    "counts_by_expert": (
        _layer("send = per_expert.view(ep, -1).sum(1).tolist()", "send = per_expert.tolist()"),
        "one count per rank", "counts_by_expert"),
    "hard_codes_two_ranks": (
        _layer("per_expert.view(ep, -1).sum(1)", "per_expert.view(2, -1).sum(1)"),
        "ep = 4 (the whole world)", "split_lengths"),
    "receives_what_it_sends": (
        _layer("    recv = incoming.sum(1).tolist()", "    recv = send"),
        "swap the per-expert counts first", "receive_counts_wrong"),
    "returns_per_choice_rows": (
        _layer("    out = torch.zeros_like(x)\n    return out.index_add(0, token, back * "
               "weights[token, choice][:, None])",
               "    return back * weights[token, choice][:, None]"),
        "shaped like x", "not_output"),
    "scales_before_the_expert": (
        _layer("all_to_all(x[token[order]],",
               "all_to_all(x[token[order]] * weights[token[order], choice[order], None],"),
        "not tokens of the group", "rows_not_tokens"),
    "ignores_capacity": (_layer("    if capacity is not None:", "    if False:"),
                         "received every choice", "capacity_ignored"),
    "drops_token_major": (
        _layer(CHOICE_MAJOR, "        for t in range(T):\n            for j in range(k):"),
        "choice-major", "wrong_tokens_dropped"),
    "unsorted_rows": (
        _layer("order = torch.argsort(expert, stable=True)", "order = torch.arange(len(expert))"),
        "sort the kept choices by expert", "not_grouped"),
    "arrivals_taken_as_sorted_by_expert": (
        _layer("torch.arange(len(local_experts)).repeat(ep).repeat_interleave(incoming.view(-1))",
               "torch.arange(len(local_experts)).repeat_interleave(incoming.sum(0))"),
        "each sender's rows come sorted by expert", "not_grouped"),
    "forgets_router_weight": (_layer("back * weights[token, choice][:, None]", "back"),
                              "without the router's weight", "forgot_router_weight"),
    "combines_in_sent_order": (_layer("    back[order] = returned", "    back = returned"),
                               "undo that permutation", "wrong_combine_order"),
    "permutes_again": (_layer("    back[order] = returned", "    back = returned[order]"),
                       "its inverse", "wrong_combine_order"),
    "adds_the_residual": (_layer("    return out.index_add(", "    return x + out.index_add("),
                          "the block adds the residual", "wrong_output"),
    "no_autograd": (_layer("    return out.index_add(0, token, back * weights[token, choice]"
                           "[:, None])",
                           "    return out.index_add(0, token, back * weights[token, choice]"
                           "[:, None]).detach()"),
                    "does not require grad", "no_autograd"),
    "detaches_expert_outputs": (_layer("module(arrived[rows])", "module(arrived[rows]).detach()"),
                                "got no gradient", "expert_gradient"),
    "detaches_router_weights": (_layer("weights[token, choice][:, None]",
                                       "weights[token, choice].detach()[:, None]"),
                                "the router learns through the weights", "router_gradient"),
    "detaches_sent_rows": (_layer("all_to_all(x[token[order]],",
                                  "all_to_all(x[token[order]].detach(),"),
                           "the tokens' gradient", "x_gradient"),
}


_COUNT_SWAP = ("    incoming = torch.empty_like(per_expert)\n"
               "    dist.all_to_all_single(incoming, per_expert, group=group)\n"
               "    incoming = incoming.view(ep, -1)\n")

# Wrong answers right in the settings the check built before (or named for another reason):
# (source, words of the hint, diagnosis)
LAYER_EDGE_MUTANTS = {
    "place_in_group_from_the_global_rank": (
        _layer(_COUNT_SWAP,
               "    every = [torch.empty_like(per_expert) for _ in range(ep)]\n"
               "    dist.all_gather(every, per_expert, group=group)  # every rank's counts\n"
               "    me = dist.get_rank() % ep  # my place in the group\n"
               "    incoming = torch.stack(every).view(ep, ep, -1)[:, me].contiguous()\n"),
        "({0, 2} and {1, 3})", "global_rank_in_group"),
    "bincount_without_minlength": (
        _layer("torch.bincount(expert, minlength=n_experts)", "torch.bincount(expert)"),
        "minlength=n_experts", "idle_expert_counts"),
    "dropped_token_passed_through": (
        _layer("    out = torch.zeros_like(x)\n",
               "    out = x * ~keep.any(1, keepdim=True)  # a dropped token passes through\n"),
        "lost every choice at capacity", "dropped_token_passed_through"),
    "renormalises_over_top_k": (
        _layer("back * weights[token, choice][:, None]",
               "back * (weights / weights.sum(1, keepdim=True))[token, choice][:, None]"),
        "renormalised the router weights", "renormalised_router_weights"),
}
LAYER_MUTANTS.update(LAYER_EDGE_MUTANTS)


def test_expert_parallel_layer_idle_setting_has_idle_experts_and_lost_tokens():
    s = _setting(0, 4, FACTOR)
    lost = 0
    for rank, part in enumerate(s["x"].split(TOKENS)):
        r = route(part, s["moe"].router, 2, FACTOR)
        assert not set(r.experts.reshape(-1).tolist()) & set(LAYER_IDLE), rank
        lost += int((~r.keep.any(1)).sum())
    assert lost and {6, 7} <= set(LAYER_IDLE)  # rank 3 holds experts 6 and 7: it receives nothing
    assert ("strided", None) in PHASES[4]


@pytest.mark.parametrize("mutant", sorted(LAYER_MUTANTS))
def test_expert_parallel_layer_rejects_mutant_with_its_diagnosis(mutant):
    src, hint, diagnosis = LAYER_MUTANTS[mutant]
    r = _check_layer(src)
    assert r.status == "failed", r
    assert hint in r.message, r.message
    assert r.diagnosis == diagnosis, (r.diagnosis, r.message)


def test_every_layer_diagnosis_has_a_wrong_answer_that_reaches_it():
    reached = {diagnosis for _, _, diagnosis in LAYER_MUTANTS.values()}
    reached.add("hang")  # test_expert_parallel_layer_names_collectives_that_do_not_match
    assert sorted(reached) == sorted(questions("06")["06.expert_parallel_layer"].diagnosis_names())


def test_expert_parallel_layer_names_collectives_that_do_not_match():
    # rank 0 swaps the counts once more, alone: the others wait in the next all-to-all
    src = _layer("    out = torch.zeros_like(x)\n",
                 "    if dist.get_rank(group) == 0:\n"
                 "        dist.all_to_all_single(incoming.view(-1).clone(), per_expert, "
                 "group=group)\n"
                 "    out = torch.zeros_like(x)\n")
    r = check("06.expert_parallel_layer",
              learner(src, "expert_parallel_layer", EP_PRELUDE), timeout=10)
    assert r.status == "failed" and r.diagnosis == "hang", r
    assert "same all-to-alls in the same order" in r.message, r.message
