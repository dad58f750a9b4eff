"""06.dispatch: one rank's side of an expert-parallel MoE layer (capacity, the permutation that
groups the kept choices by destination rank, the send counts, and the combine through the
inverse permutation), judged in this process against the single-device :class:`MoE` for
ep = 2 and 4, with the two all-to-alls and the remote experts emulated by ``exchange``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from parlib.cost.experts import expert_capacity
from parlib.course.answers import plain_tensor
from parlib.course.on_ranks import Case, CaseExercise, Diagnosis, always
from parlib.course.registry import register
from parlib.model import ModelConfig, MoE, route
from parlib.verify import close

SEED, TOKENS, H, E, K = 6, 16, 8, 8, 2

# name -> (ep, capacity factor); judged in this order, the first wrong one diagnosed
CASES: dict[str, tuple[int, float | None]] = {
    "ep2": (2, None),
    "ep4": (4, None),
    "ep2_capacity": (2, 1.25),
    "ep4_capacity": (4, 1.0),
    "ep4_idle_experts": (4, 1.0),
}
# name -> experts the router never picks there: every token leans one way along the
# first hidden dimension and their router rows point the other way. Experts 6 and 7 are
# rank 3's: a whole rank receives nothing; crowded, some tokens lose every choice.
IDLE: dict[str, tuple[int, ...]] = {"ep4_idle_experts": (2, 6, 7)}

DISPATCH_SOLUTION = '''\
def expert_parallel_moe(x, experts, weights, n_experts, ep, capacity, exchange):
    T, k = experts.shape
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity is not None:
        taken = [0] * n_experts  # choices each expert has accepted so far
        for j in range(k):  # choice-major: every first choice before any second one
            for t in range(T):
                e = int(experts[t, j])
                keep[t, j] = taken[e] < capacity
                taken[e] += 1
    token, choice = torch.nonzero(keep, as_tuple=True)  # the kept choices, token order
    expert = experts[token, choice]
    order = torch.argsort(expert, stable=True)  # groups them by expert, hence by rank
    per_expert = torch.bincount(expert, minlength=n_experts)
    per_rank = per_expert.view(ep, -1).sum(1)  # rank r holds experts r E/ep .. (r+1) E/ep - 1
    returned = exchange(x[token[order]], per_rank, per_expert)  # row i: kept choice order[i]
    back = torch.empty_like(returned)
    back[order] = returned  # the inverse permutation: row i is kept choice i again
    out = torch.zeros_like(x)
    return out.index_add(0, token, back * weights[token, choice][:, None])
'''


class Refused(Exception):
    """What ``exchange`` raises when its arguments cannot be sent: (problem, detail)."""


def _case(name: str) -> dict[str, Any]:
    """One case: tokens, a single-device MoE layer, its routing and its output (built from
    its seed alike on the rank and in the grader: the rank sends back only plain data)."""
    ep, factor = CASES[name]
    torch.manual_seed(SEED + list(CASES).index(name))
    cfg = ModelConfig(d_model=H, n_heads=1, n_experts=E, top_k=K, capacity_factor=factor,
                      expert_hidden=2 * H)
    moe = MoE(cfg)
    x = torch.randn(TOKENS, H)
    if name in IDLE:
        x[:, 0] = 1 + x[:, 0].abs()
        with torch.no_grad():
            moe.router.weight[list(IDLE[name]), 0] = -6.0
    with torch.no_grad():
        want = moe(x)
        r = route(x, moe.router, K, factor)
    return {"name": name, "ep": ep, "moe": moe, "x": x, "routing": r, "out": want,
            "capacity": expert_capacity(TOKENS * K, E, factor)}


def _pairs(experts: torch.Tensor, keep: torch.Tensor) -> Counter:
    token, choice = torch.nonzero(keep, as_tuple=True)
    return Counter(zip(token.tolist(), experts[token, choice].tolist()))


def _exchange(case: dict[str, Any], sent: list[Any]) -> Callable:
    """The dispatch all-to-all, the experts of every rank and the combine all-to-all, as one
    call: rows grouped by destination rank (``per_rank`` rows to each) and, within a rank,
    by expert (``per_expert`` rows to each); returns each row's expert output, same order."""
    ep, moe = case["ep"], case["moe"]

    def exchange(rows: Any, per_rank: Any, per_expert: Any) -> torch.Tensor:
        if sent:
            raise Refused("twice", "")
        rows = plain_tensor(rows)
        if rows is None or rows.dim() != 2 or rows.shape[1] != H:
            raise Refused("rows", f"{type(rows).__name__}")
        counts = [torch.as_tensor(c).reshape(-1).long() for c in (per_rank, per_expert)]
        per_rank, per_expert = counts
        if len(per_rank) == E and len(per_rank) != ep:
            raise Refused("counts_by_expert", "")
        if len(per_expert) < E and case["name"] in IDLE:
            raise Refused("idle_counts", f"per_expert has {len(per_expert)} entries")
        if len(per_rank) != ep or len(per_expert) != E:
            raise Refused("count_lengths", f"{len(per_rank)} and {len(per_expert)}")
        n = rows.shape[0]
        if int(per_expert.sum()) != n or int(per_rank.sum()) != n:
            raise Refused("counts_sum", f"{int(per_rank.sum())} and {int(per_expert.sum())}"
                                        f" for {n} rows")
        if not torch.equal(per_expert.view(ep, -1).sum(1), per_rank):
            raise Refused("rank_sum", "")
        expert_of_row = torch.arange(E).repeat_interleave(per_expert)
        sent.append((rows.detach().clone(), expert_of_row))
        out = torch.empty_like(rows)
        with torch.no_grad():
            for e in range(E):
                mine = expert_of_row == e
                out[mine] = moe.experts[e](rows[mine])
        return out

    return exchange


def _sent_problem(case: dict[str, Any], rows: torch.Tensor, expert_of_row: torch.Tensor
                  ) -> tuple[str, str] | None:
    """Whether the rows sent are the kept choices' tokens, each to the expert it chose."""
    r, x = case["routing"], case["x"]
    match = (rows[:, None, :] == x[None, :, :]).all(-1)  # (n, T)
    if not bool((match.sum(1) == 1).all()):
        return ("rows_not_tokens", "")
    got = Counter(zip(match.float().argmax(1).tolist(), expert_of_row.tolist()))
    if got == _pairs(r.experts, r.keep):
        return None
    every = _pairs(r.experts, torch.ones_like(r.keep))
    if case["capacity"] is not None and got == every:
        return ("capacity_ignored", "")
    if (case["capacity"] is not None and not got - every
            and got.total() == int(r.keep.sum())):
        return ("wrong_drops", "")
    return ("not_grouped", "")


def _report(fn: Callable, name: str) -> dict[str, Any]:
    case = _case(name)
    r, sent = case["routing"], []
    report: dict[str, Any] = {}
    try:
        got = fn(case["x"].clone(), r.experts.clone(), r.weights.clone(), E, case["ep"],
                 case["capacity"], _exchange(case, sent))
    except Refused as refused:
        report["problem"] = refused.args
        return report
    except Exception as exc:  # noqa: BLE001 - right on every other case, raised here
        if name not in IDLE:
            raise
        report["problem"] = ("idle_counts", f"your function raised {type(exc).__name__}: "
                                            f"{str(exc).splitlines()[0]}")
        return report
    if not sent:
        report["problem"] = ("no_exchange", "")
        return report
    problem = _sent_problem(case, *sent[0])
    if problem is not None:
        report["problem"] = problem
        return report
    out = plain_tensor(got)
    if out is None:
        report["problem"] = ("not_tensor", type(got).__name__)
    elif out.shape != case["out"].shape:
        report["problem"] = ("shape", str(tuple(out.shape)))
    elif not close(out.detach(), case["out"]):
        report.update(problem=("out", ""), out=out.detach(), returned=sent[0])
    return report


# --------------------------------------------------------------------------- the verdicts


def _what(c: Case) -> str:
    return c.report["problem"][0]


def _detail(c: Case) -> str:
    return c.report["problem"][1]


def _combined(case: dict[str, Any], weights: torch.Tensor) -> torch.Tensor:
    """The layer's output with these weights (T, k) in place of the router's."""
    r = case["routing"]
    with torch.no_grad():
        want = torch.zeros_like(case["x"])
        for e in range(E):
            token, choice = torch.nonzero((r.experts == e) & r.keep, as_tuple=True)
            y = case["moe"].experts[e](case["x"][token]) * weights[token, choice, None]
            want = want.index_add(0, token, y)
    return want


def _output_is(make: Callable[[dict[str, Any]], torch.Tensor]) -> Callable[[Case], bool]:
    """A predicate: the learner's (wrong) output is ``make(case)``."""
    return lambda c: _what(c) == "out" and close(c.report["out"], make(_case(c.report["name"])))


def renormalised(weights: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's weights divided by their sum over its top-k (or its kept) choices."""
    w = weights if keep is None else weights * keep
    return w / w.sum(1, keepdim=True).clamp_min(1e-30)


_unweighted = _output_is(lambda case: _combined(case, torch.ones(TOKENS, K)))
# over the kept choices it is the same until a capacity drops one, and the cases without a
# capacity limit come first: the top-k renormalisation is the one a wrong answer shows
_renormalised = _output_is(lambda case: _combined(case, renormalised(case["routing"].weights)))
_dropped_passed_through = _output_is(lambda case: case["out"] + case["x"] * (
    ~case["routing"].keep.any(1, keepdim=True)))


def _idle(c: Case) -> list[int]:
    """The experts no token of this case picks."""
    picked = _case(c.report["name"])["routing"].experts.reshape(-1).tolist()
    return sorted(set(range(E)) - set(picked))


def _all_dropped(c: Case) -> str:
    lost = torch.nonzero(~_case(c.report["name"])["routing"].keep.any(1)).reshape(-1).tolist()
    return (f"tokens {lost} lost every choice at capacity, and your output gives them x: "
            f"such a token gets 0 from the layer (no expert computed it). The block's "
            f"residual, x + moe(x), passes it through; adding x here counts it twice")


def _is(kind: str) -> Callable[[Case], bool]:
    return lambda c: _what(c) == kind


def _case_words(c: Case) -> str:
    case = _case(c.report["name"])
    limit = ("no capacity limit" if case["capacity"] is None
             else f"capacity {case['capacity']} choices per expert")
    return f"ep = {case['ep']}, E = {E} experts, {TOKENS} tokens, top-{K}, {limit}"


DIAGNOSES = (
    Diagnosis("called_exchange_twice", _is("twice"),
              "you called exchange more than once: it is the all-to-all there and back, "
              "called once per layer with every kept choice's row"),
    Diagnosis("no_exchange", _is("no_exchange"),
              "your function never called exchange: the tokens must travel to their "
              "experts' ranks (exchange(rows, per_rank, per_expert)) and come back"),
    Diagnosis("counts_by_expert", _is("counts_by_expert"),
              lambda c: f"per_rank has one count per expert ({E}), not one per rank "
              f"({_case(c.report['name'])['ep']}): the all-to-all sends to ranks, and rank r holds "
              "E/ep experts, so add the counts of each rank's experts: "
              "per_expert.view(ep, -1).sum(1)"),
    Diagnosis("count_lengths", _is("count_lengths"),
              lambda c: f"per_rank and per_expert have {_detail(c)} entries: give one "
              f"count per rank (ep = {_case(c.report['name'])['ep']}) and one per expert ({E})"),
    Diagnosis("counts_not_kept", _is("counts_sum"),
              lambda c: f"your counts add up to {_detail(c)}: count only the choices you "
              "send, the kept ones (after the capacity cut), each exactly once"),
    Diagnosis("idle_expert_counts", _is("idle_counts"),
              lambda c: f"experts {_idle(c)} receive no token here, 6 and 7 being all of "
              f"rank 3's ({_detail(c)}): per_expert needs "
              f"a count for every expert, 0 for an idle one (torch.bincount(expert, "
              f"minlength=n_experts); torch.unique counts only the experts present), and "
              f"per_rank one for every rank, 0 for an idle one"),
    Diagnosis("rank_counts_disagree", _is("rank_sum"),
              "per_rank is not the sum of per_expert over each rank's experts: rank r holds "
              "the contiguous experts r x E/ep to (r + 1) x E/ep - 1"),
    Diagnosis("rows_not_tokens", lambda c: _what(c) in ("rows", "rows_not_tokens"),
              "the rows you sent are not rows of x: send each kept choice's token as it is "
              "(x[token]), one row per choice; the router weight is applied after the "
              "expert, when combining (an expert is not linear)"),
    Diagnosis("capacity_ignored", _is("capacity_ignored"),
              "you sent every choice: an expert accepts at most `capacity` choices, and "
              "the ones over it are dropped before they travel"),
    Diagnosis("wrong_tokens_dropped", _is("wrong_drops"),
              "you dropped as many choices as you should but not the right ones: an expert "
              "takes choices first come first served in choice-major order, every token's "
              "first choice (in token order) before any token's second choice, so a token "
              "loses its second expert before another token loses its first"),
    Diagnosis("not_grouped", _is("not_grouped"),
              "the rows you sent do not reach the experts they chose: exchange hands the "
              "first per_expert[0] rows to expert 0, the next per_expert[1] to expert 1, "
              "and so on, so sort the kept choices by expert (which also groups them by "
              "destination rank)"),
    Diagnosis("not_a_tensor", _is("not_tensor"),
              lambda c: f"your function returned a {_detail(c)}: return the layer's output, "
              "a tensor shaped like x"),
    Diagnosis("wrong_shape", _is("shape"),
              lambda c: f"your output has shape {_detail(c)}, expected {(TOKENS, H)}: one "
              "row per token, the sum over its kept choices"),
    Diagnosis("forgot_router_weight", _unweighted,
              "your output adds each token's expert outputs without the router's weight: "
              "scale each returned row by its choice's weight (weights[token, choice]) "
              "before adding it to its token"),
    Diagnosis("renormalised_router_weights", _renormalised,
              "you renormalised the router weights (each token's weights divided by their sum "
              "over its top-k or its kept choices): this layer scales each expert's output by "
              "the router's probability as it is, weights[token, choice] (softmax over all E "
              "experts), without renormalising"),
    Diagnosis("dropped_token_passed_through", _dropped_passed_through, _all_dropped),
    Diagnosis("wrong_combine_order", always,
              "the rows you sent were right but the output is not: the returned rows come "
              "back in the order you sent them (sorted by expert), so undo that permutation "
              "(its inverse) before adding each to the token it came from"),
)


QUESTION = register(CaseExercise(
    "06.dispatch",
    cases=CASES,
    report=_report,
    where=lambda case: f"with {_case_words(case)}",
    diagnoses=DIAGNOSES,
    solution=DISPATCH_SOLUTION,
    prompt="""
        Write expert_parallel_moe(x, experts, weights, n_experts, ep, capacity, exchange)
        -> Tensor, one rank's side of an expert-parallel MoE layer. x (T, h) are this
        rank's tokens; experts (T, k) the router's top-k choices for each token (expert
        indices) and weights (T, k) their router probabilities (the softmax over all E
        experts, as they are: not renormalised over the k). Rank r of the ep ranks
        holds experts r x E/ep to (r + 1) x E/ep - 1. capacity (an int, or None: no
        limit) is the most choices one expert accepts: first come first served in
        choice-major order (every token's first choice, in token order, before any second
        choice); the others are dropped. Call exchange(rows, per_rank, per_expert) once:
        it is the all-to-all out, the experts and the all-to-all back. rows are the kept
        choices' tokens grouped by destination rank, and within a rank by expert;
        per_rank (ep,) and per_expert (E,) their counts. It returns each row's expert
        output, in the order sent. Return the layer's output (T, h): for each token, the
        sum of its kept experts' outputs times their router weights. Checked against the
        single-device MoE layer for ep = 2 and 4, with and without a capacity limit, and
        with experts (a whole rank's) that receive no token and tokens that lose every
        choice.
    """,
    explanation="""
        Three steps on each rank. First the capacity cut: walk the choices in
        choice-major order, counting what each expert has taken, and drop a choice once
        its expert is full. Then the dispatch: sort the kept (token, choice) pairs by
        expert (a stable argsort, `order`). Rank r's experts are contiguous, so this also
        groups the rows by destination; per_expert counts the rows per expert and
        per_rank adds them up over each rank's E/ep experts, the split sizes of the
        all-to-all.

        The outputs come back in the order sent, sorted by expert. The combine undoes
        that: back[order] = returned is the inverse permutation, so row i is kept choice
        i again. Each row is scaled by its router weight and added to its token
        (index_add: a token with two kept choices gets both). A token whose choices were
        all dropped gets 0, and the residual passes it through.
    """,
    after="""
        On ranks, exchange is two dist.all_to_all_single calls around the local experts
        (split sizes per_rank out, the same exchange reversed back), after a small
        all-to-all of per_expert so every rank knows how many rows it will receive:
        parlib.strategies.experts.ExpertParallelMoE. Each kept choice's h-vector goes out
        and comes back, and backward sends the gradients the same two ways:
        parlib.cost's ep_all_to_all_bytes_per_layer.
    """,
))

__all__ = ["CASES", "DISPATCH_SOLUTION", "Refused"]
