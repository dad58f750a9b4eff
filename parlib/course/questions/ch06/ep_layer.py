"""06.expert_parallel_layer: the rank side of an expert-parallel MoE layer, run on ranks
(ep = 2, ep = 4 with experts no token picks, and two ep groups of 2 on 4 ranks, consecutive
and not), with and without a capacity limit, its
output and gradients (of the tokens, of this rank's experts, of the router through the
router weights) compared with the single-device :class:`MoE`."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from parlib.cost.experts import expert_capacity
from parlib.course.answers import plain_tensor
from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World
from parlib.course.questions.ch06.dispatch import renormalised
from parlib.course.registry import register
from parlib.model import ModelConfig, MoE, route
from parlib.verify import close

SEED, TOKENS, H, E, K = 16, 8, 8, 8, 2  # TOKENS: per rank
FACTOR = 1.0  # the capacity case: ceil(1.0 x 8 x 2 / 8) = 2 choices per expert and rank
# the launches: (ranks, phases); a phase is (layout, capacity factor), judged in order
PHASES = {2: (("world", None), ("world", FACTOR)),
          4: (("world", None), ("world", FACTOR), ("pairs", None), ("pairs", FACTOR),
              ("strided", None))}
# the 4-rank world's capacity setting: experts the router never picks (every token leans
# one way along the first hidden dimension, their router rows the other way); 6 and 7 are
# rank 3's, so a whole rank receives nothing, and crowded, some tokens lose every choice
IDLE = (2, 6, 7)

EP_LAYER_SOLUTION = '''\
def expert_parallel_layer(x, experts, weights, local_experts, n_experts, capacity, group):
    ep = dist.get_world_size(group)
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
    send = per_expert.view(ep, -1).sum(1).tolist()  # rows to each rank of the group
    # what each rank sends to each of my experts: (ep, E/ep) counts, by sender
    incoming = torch.empty_like(per_expert)
    dist.all_to_all_single(incoming, per_expert, group=group)
    incoming = incoming.view(ep, -1)
    recv = incoming.sum(1).tolist()
    arrived = all_to_all(x[token[order]], send, recv, group)  # by sender, then by expert
    # the local expert of each arrived row, then each expert on its rows
    local = torch.arange(len(local_experts)).repeat(ep).repeat_interleave(incoming.view(-1))
    computed = torch.zeros_like(arrived)
    for i, module in enumerate(local_experts):
        rows = torch.nonzero(local == i).squeeze(1)
        computed = computed.index_copy(0, rows, module(arrived[rows]))
    returned = all_to_all(computed, recv, send, group)  # back to the senders, as sent
    back = torch.empty_like(returned)
    back[order] = returned  # the inverse permutation: row i is kept choice i again
    out = torch.zeros_like(x)
    return out.index_add(0, token, back * weights[token, choice][:, None])
'''


class Refused(Exception):
    """Raised before an all-to-all whose split sizes cannot be sent: ``(problem,
    detail)``. Sends that do not match what their receivers expect are refused on every
    rank of the group (each sees every rank's sizes), so none is left waiting."""


# --------------------------------------------------------------------------- on the ranks


@contextlib.contextmanager
def _watched_all_to_all() -> Iterator[dict[str, Any]]:
    """``dist.all_to_all_single`` checked before it runs: the split sizes (one per rank of
    the group; every rank's sends matching what the others expect, swapped with
    ``all_gather_object`` first, so a mismatch is refused on every rank instead of
    crashing gloo), and whether it ran on a tensor autograd tracks (outside an autograd
    Function's forward, where grad mode is off, it is invisible to autograd: torch only
    falls back, warning that this "may lead to silently incorrect behavior")."""
    import torch.distributed as dist

    state: dict[str, Any] = {"plain": False}
    real = dist.all_to_all_single

    def watched(output: Any, input: Any, output_split_sizes: Any = None,
                input_split_sizes: Any = None, group: Any = None, async_op: bool = False
                ) -> Any:
        if torch.is_grad_enabled() and getattr(input, "requires_grad", False):
            state["plain"] = True
        if output_split_sizes is not None or input_split_sizes is not None:
            n = dist.get_world_size(group)
            sizes = []
            for split, t in ((input_split_sizes, input), (output_split_sizes, output)):
                split = ([t.shape[0] // n] * n if split is None
                         else [int(v) for v in torch.as_tensor(split).reshape(-1)])
                sizes.append(split)
            if any(len(s) != n for s in sizes):
                lengths = f"{len(sizes[0])} send and {len(sizes[1])} receive counts"
                kind = "counts_by_expert" if len(sizes[0]) == E else "split_lengths"
                raise Refused(kind, f"{lengths} for a group of {n} ranks")
            every: list[Any] = [None] * n
            dist.all_gather_object(every, sizes, group=group)
            for src in range(n):
                for dst in range(n):
                    sends, expects = every[src][0][dst], every[dst][1][src]
                    if sends != expects:
                        raise Refused("receive_counts",
                                      f"rank {dst} of the group expects {expects} rows from "
                                      f"rank {src}, which sends it {sends}")
        return real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)

    dist.all_to_all_single = watched
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield state
        if any("silently incorrect" in str(w.message) for w in caught):
            state["plain"] = True
    finally:
        dist.all_to_all_single = real


def _has_idle_experts(index: int, ep: int, factor: float | None) -> bool:
    return index == 0 and ep == 4 and factor is not None


def _setting(index: int, ep: int, factor: float | None) -> dict[str, Any]:
    """Group ``index``'s MoE layer and tokens (ep x TOKENS rows, rank s of the group holds
    rows s x TOKENS ..), the same on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + 10 * index + (factor is not None))
        moe = MoE(ModelConfig(d_model=H, n_heads=1, n_experts=E, top_k=K,
                              capacity_factor=factor, expert_hidden=2 * H))
        x = torch.randn(ep * TOKENS, H)
        dy = torch.randn(ep * TOKENS, H)
    if _has_idle_experts(index, ep, factor):
        x[:, 0] = 1 + x[:, 0].abs()
        with torch.no_grad():
            moe.router.weight[list(IDLE), 0] = -6.0
    return {"moe": moe, "x": x, "dy": dy, "ep": ep, "factor": factor,
            "capacity": expert_capacity(TOKENS * K, E, factor)}


def _reference(s: dict[str, Any], rank: int) -> dict[str, Any]:
    """The single-device layer on every rank's tokens (capacity over each rank's own T, as
    each rank routes its own), loss sum(out * dy): this rank's output, the gradients of its
    tokens and of its router copy (its own tokens' part), the experts' (every rank's)."""
    moe, ep = copy.deepcopy(s["moe"]), s["ep"]
    x = s["x"].clone().requires_grad_()
    outs = [moe(part) for part in x.split(TOKENS)]
    losses = [(o * d).sum() for o, d in zip(outs, s["dy"].split(TOKENS))]
    (router,) = torch.autograd.grad(losses[rank], moe.router.weight, retain_graph=True)
    torch.stack(losses).sum().backward()
    every = Counter()  # (global token, expert) of every choice / of the kept ones
    kept = Counter()
    with torch.no_grad():
        for src, part in enumerate(s["x"].split(TOKENS)):
            r = route(part, moe.router, K, s["factor"])
            for t in range(TOKENS):
                for j in range(K):
                    pair = (src * TOKENS + t, int(r.experts[t, j]))
                    every[pair] += 1
                    kept[pair] += bool(r.keep[t, j])
    mine = range(rank * E // ep, (rank + 1) * E // ep)
    return {"out": outs[rank].detach(), "x_grad": x.grad.split(TOKENS)[rank],
            "router_grad": router, "mine": mine, "every": every, "kept": +kept,
            "expert_grads": {e: {n: p.grad.clone() for n, p in moe.experts[e].named_parameters()}
                             for e in mine}}


def _candidates(s: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
    """This rank's output as the common wrong combines would make it."""
    moe = s["moe"]
    x = s["x"].split(TOKENS)[rank]
    with torch.no_grad():
        r = route(x, moe.router, K, s["factor"])
        token, choice = torch.nonzero(r.keep, as_tuple=True)
        expert = r.experts[token, choice]
        order = torch.argsort(expert, stable=True)
        sent = x[token[order]]
        returned = torch.stack([moe.experts[int(e)](row) for e, row in zip(expert[order], sent)]
                               ) if len(sent) else sent
        back = torch.empty_like(returned)
        back[order] = returned
        w = r.weights[token, choice][:, None]
        zero = torch.zeros_like(x)
        lost = ~r.keep.any(1, keepdim=True)  # tokens that lost every choice
        right = zero.index_add(0, token, back * w)
        return {"unweighted": zero.index_add(0, token, back),
                "sent_order": zero.index_add(0, token, returned * w),
                "permuted_again": zero.index_add(0, token, returned[order] * w),
                "renormalised": zero.index_add(0, token, back * renormalised(
                    r.weights)[token, choice][:, None]),
                "dropped_passed_through": right + x * lost if bool(lost.any()) else None}


def _arrivals(seen: dict[int, list[torch.Tensor]], s: dict[str, Any], ref: dict[str, Any]
              ) -> tuple[str, str] | None:
    """Whether each of this rank's experts computed the rows it should: the tokens of every
    rank's kept choices of it, each once."""
    tokens = s["x"]
    got: Counter = Counter()
    for e, calls in seen.items():
        rows = torch.cat(calls) if calls else tokens[:0]
        if rows.dim() != 2 or rows.shape[1] != H:
            return ("rows_not_tokens", f"expert {e} received rows of shape {tuple(rows.shape)}")
        match = (rows[:, None, :] == tokens[None, :, :]).all(-1)
        if not bool((match.sum(1) == 1).all()):
            return ("rows_not_tokens", f"expert {e}")
        got.update((int(t), e) for t in match.float().argmax(1).tolist())
    want = Counter({pair: n for pair, n in ref["kept"].items() if pair[1] in ref["mine"]})
    every = Counter({pair: n for pair, n in ref["every"].items() if pair[1] in ref["mine"]})
    if got == want:
        return None
    if s["capacity"] is not None and got == every:
        return ("capacity_ignored", f"{got.total()} rows, where {want.total()} should come")
    if s["capacity"] is not None and not got - every and got.total() == want.total():
        return ("wrong_drops", "")
    return ("not_grouped", f"they computed {got.total()} rows, {(got - want).total()} of "
                           f"them not theirs or twice, and {(want - got).total()} of the "
                           f"{want.total()} that chose them never came")


def _grad_problem(got: Any, want: torch.Tensor, kind: str, what: str
                  ) -> tuple[str, str] | None:
    """(kind, a sentence about ``what``'s gradient), or None when it is right."""
    if got is None:
        return (kind, f"{what} got no gradient")
    if not close(got, want):
        diff = (got - want).abs().max().item()
        return (kind, f"the gradient of {what} differs from the single-device layer's (max "
                      f"|difference| {diff:.3g})")
    return None


def _phase(fn: Callable, layout: str, factor: float | None) -> dict[str, Any]:
    """One run of the learner's layer on this rank: the problem it shows, or None."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if layout == "pairs":
        groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank, each
        index, group = 1 + rank // 2, groups[rank // 2]  # data of its own, not the world's
    elif layout == "strided":  # {0, 2} and {1, 3}: rank 2 is rank 1 of its group
        half = world // 2
        groups = [dist.new_group([r, r + half]) for r in range(half)]
        index, group = 3 + rank % half, groups[rank % half]
    else:
        index, group = 0, dist.group.WORLD
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    s = _setting(index, ep, factor)
    ref = _reference(s, me)
    moe = copy.deepcopy(s["moe"])
    x = s["x"].split(TOKENS)[me].clone().requires_grad_()
    r = route(x, moe.router, K, factor)  # the weights lead back to the router and to x
    local = torch.nn.ModuleList(moe.experts[e] for e in ref["mine"])
    seen: dict[int, list[torch.Tensor]] = {e: [] for e in ref["mine"]}
    for e in ref["mine"]:
        moe.experts[e].register_forward_pre_hook(
            lambda module, args, e=e: seen[e].append(args[0].detach().clone()))
    report: dict[str, Any] = {"layout": layout, "ep": ep, "capacity": s["capacity"],
                              "problem": None, "idle": _has_idle_experts(index, ep, factor)}
    try:
        with _watched_all_to_all() as watch:
            got = fn(x, r.experts.clone(), r.weights, local, E, s["capacity"], group)
            out = plain_tensor(got)
            trainable = (out is not None and out.shape == ref["out"].shape
                         and getattr(got, "requires_grad", False))
            if trainable:  # every rank (the same code) runs backward's all-to-alls
                (got * s["dy"].split(TOKENS)[me]).sum().backward()
    except Refused as refused:
        report["problem"] = refused.args
        return report
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - in a sub-group an ignored group is any error
        if layout == "world" and not report["idle"]:
            raise
        report["problem"] = ("error", f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        return report
    report["problem"] = _problem(got, out, watch, s, ref, moe, x, me)
    if out is not None and not watch["plain"]:  # what this rank's experts computed
        report["rows"] = _arrivals(seen, s, ref)
    return report


def _problem(got: Any, out: Any, watch: dict[str, Any], s: dict[str, Any],
             ref: dict[str, Any], moe: MoE, x: torch.Tensor, me: int
             ) -> tuple[str, str] | None:
    """What is wrong with this rank's output and gradients (None: nothing)."""
    if watch["plain"]:
        return ("plain_all_to_all", "")
    if out is None:
        return ("not_output", f"a {type(got).__name__}, not a tensor")
    if out.shape != ref["out"].shape:
        return ("not_output", f"shape {tuple(out.shape)}")
    if not close(out, ref["out"]):
        for name, candidate in _candidates(s, me).items():
            if candidate is not None and close(out, candidate):
                return (name, "")
        return ("wrong_output", f"{(out - ref['out']).abs().max().item():.3g}")
    if not got.requires_grad:
        return ("no_autograd", "")
    for e in ref["mine"]:
        for name, p in moe.experts[e].named_parameters():
            found = _grad_problem(p.grad, ref["expert_grads"][e][name], "expert_gradient",
                                  f"expert {e}'s {name}")
            if found:
                return found
    found = _grad_problem(moe.router.weight.grad, ref["router_grad"], "router_gradient",
                          "the router's weight")
    return found or _grad_problem(x.grad, ref["x_grad"], "x_gradient", "x")


def _layer_rank(fn: Callable, phases: tuple[tuple[str, float | None], ...]) -> list[dict]:
    """The probe: every phase in turn, on every rank (a phase's collectives must not depend
    on an earlier phase's verdict, which ranks could reach differently)."""
    return [_phase(fn, layout, factor) for layout, factor in phases]


# --------------------------------------------------------------------------- the verdicts


# the problems a rank can show, cause first: a rank's output is wrong when another rank's
# expert received the wrong rows, so once an output is wrong the rows each rank's experts
# computed are judged first (only then: a right answer may run an expert on more rows)
_ORDER = ("counts_by_expert", "split_lengths", "receive_counts", "error", "plain_all_to_all",
          "not_output", "rows_not_tokens", "capacity_ignored", "wrong_drops", "not_grouped",
          "unweighted", "renormalised", "dropped_passed_through",
          "sent_order", "permuted_again", "wrong_output", "no_autograd",
          "expert_gradient", "router_gradient", "x_gradient")
_OUTPUTS = ("unweighted", "renormalised", "dropped_passed_through",
            "sent_order", "permuted_again", "wrong_output")


def _first_wrong(case: Case) -> tuple[int, tuple[int, str]] | None:
    """(rank, (phase, "problem" or "rows")): the first phase with a problem, and the rank
    and report entry with its first cause."""
    for phase in range(len(case.results[0])):
        reports = [phases[phase] for phases in case.results]
        if not any(rep["problem"] for rep in reports):
            continue
        # an output is wrong: did every expert compute the right rows?
        keys = ("problem", "rows") if any(
            rep["problem"] and rep["problem"][0] in _OUTPUTS for rep in reports) else ("problem",)
        wrong = [(_ORDER.index(rep[key][0]), rank, key) for rank, rep in enumerate(reports)
                 for key in keys if rep.get(key)]
        _, rank, key = min(wrong)
        return rank, (phase, key)
    return None


def _report(c: Case) -> dict[str, Any]:
    return c.report[c.step[0]]


def _what(c: Case) -> str:
    return _report(c)[c.step[1]][0]


def _detail(c: Case) -> str:
    return _report(c)[c.step[1]][1]


def _is(*kinds: str) -> Callable[[Case], bool]:
    return lambda c: _what(c) in kinds


def _where(c: Case) -> str:
    rep = _report(c)
    limit = ("no capacity limit" if rep["capacity"] is None
             else f"capacity {rep['capacity']} choices per expert")
    groups = {"pairs": f"two ep groups of {rep['ep']} ({{0, 1}} and {{2, 3}}) on {c.world} "
                       f"ranks",
              "strided": f"two ep groups of {rep['ep']} ({{0, 2}} and {{1, 3}}) on "
                         f"{c.world} ranks",
              }.get(rep["layout"], f"ep = {rep['ep']} (the whole world)")
    idle = (f", experts {list(IDLE)} picked by no token (rank 3 holds 6 and 7)"
            if rep.get("idle") else "")
    return f"on {groups}, {limit}{idle}, rank {c.rank}"


def _hint(text: str | Callable[[Case], str]) -> Callable[[Case], str]:
    return lambda c: f"{_where(c)}: " + (text(c) if callable(text) else text)


def _ignores_group(c: Case) -> str:
    what = _detail(c) or "its numbers differ from the single-device layer's"
    return (f"right when the group is the whole world, but wrong in a sub-group ({what}). "
            "Take ep and this rank's place from the group (dist.get_world_size(group)) and "
            "pass group=group to every collective: the world is not the group")


DIAGNOSES = (
    Diagnosis("global_rank_in_group", lambda c: _report(c)["layout"] == "strided", _hint(
        lambda c: "right on the whole world and on consecutive groups ({0, 1} and {2, 3}), but "
        "wrong when a group's ranks are not consecutive: rank 2 is rank 1 of {0, 2}, not "
        "rank 2 % ep = 0. Take this rank's place in its group from the group, "
        "dist.get_rank(group), never from the global rank")),
    Diagnosis("ignores_group", lambda c: _report(c)["layout"] == "pairs", _hint(_ignores_group)),
    Diagnosis("idle_expert_counts",
              lambda c: _report(c)["idle"] and _is("error", "split_lengths")(c),
              _hint(lambda c: f"{_detail(c)}. Right while every expert is picked, but here "
                    f"experts {list(IDLE)} receive no token: per_expert needs a count for every "
                    f"expert, 0 for an idle one (torch.bincount(expert, minlength=n_experts); "
                    f"torch.unique counts only the experts present), and send one for every "
                    f"rank, 0 for an idle one")),
    Diagnosis("counts_by_expert", _is("counts_by_expert"), _hint(
        lambda c: f"{_detail(c)}: the all-to-all sends to ranks, one count per rank of the "
        f"group, and rank r holds E/ep contiguous experts: add up each rank's experts' counts "
        f"(per_expert.view(ep, -1).sum(1))")),
    Diagnosis("split_lengths", _is("split_lengths"), _hint(
        lambda c: f"{_detail(c)}: give one send count and one receive count per rank of the "
        f"group (ep = dist.get_world_size(group))")),
    Diagnosis("receive_counts_wrong", _is("receive_counts"), _hint(
        lambda c: f"{_detail(c)}. A rank receives what the others send it, which it cannot "
        f"know from its own tokens: swap the per-expert counts first (a small "
        f"dist.all_to_all_single of per_expert), and receive their sums per sender")),
    Diagnosis("plain_all_to_all", _is("plain_all_to_all"), _hint(
        "you called dist.all_to_all_single directly on a tensor autograd tracks: autograd "
        "cannot see through it (torch only falls back, warning that this \"may lead to "
        "silently incorrect behavior\"), so no gradient would go back to the senders. Send "
        "the rows with an all-to-all that carries gradients: the chapter's all_to_all "
        "(parlib.strategies.experts), whose backward is the reverse exchange, or "
        "torch.distributed.nn.functional.all_to_all_single")),
    Diagnosis("not_output", _is("not_output"), _hint(
        lambda c: f"your function returned {_detail(c)}: return the layer's output for this "
        f"rank's tokens, shaped like x ({TOKENS}, {H}), each token the sum over its kept "
        f"choices")),
    Diagnosis("rows_not_tokens", _is("rows_not_tokens"), _hint(
        lambda c: f"{_detail(c)} computed rows that are not tokens of the group: send each "
        f"kept choice's token as it is (x[token]); the router weight scales the expert's "
        f"output, in the combine (an expert is not linear)")),
    Diagnosis("capacity_ignored", _is("capacity_ignored"), _hint(
        lambda c: f"this rank's experts received every choice ({_detail(c)}): an expert "
        f"accepts at most `capacity` choices of each rank, the ones over it are dropped "
        f"before they travel")),
    Diagnosis("wrong_tokens_dropped", _is("wrong_drops"), _hint(
        "your capacity cut dropped as many choices as it should, but not the right ones: an "
        "expert takes choices first come first served in choice-major order, every token's "
        "first choice (in token order) before any token's second choice, so a token loses "
        "its second expert before another token loses its first")),
    Diagnosis("not_grouped", _is("not_grouped"), _hint(
        lambda c: f"this rank's experts did not compute the rows that chose them "
        f"({_detail(c)}): all_to_all sends the first send[0] rows to rank 0, the next "
        f"send[1] to rank 1, ..., so sort the kept choices by expert (which groups them by "
        f"rank), and on arrival run each local expert on the rows sent to it (each sender's "
        f"rows come sorted by expert, per_expert counts of theirs)")),
    Diagnosis("forgot_router_weight", _is("unweighted"), _hint(
        "your output adds each token's expert outputs without the router's weight: scale "
        "each returned row by its choice's weight (weights[token, choice]) before adding it "
        "to its token")),
    # (over the kept choices it is the same until a capacity drops one: a phase without a
    # capacity limit comes first in every layout)
    Diagnosis("renormalised_router_weights", _is("renormalised"), _hint(
        "you renormalised the router weights (each token's weights divided by their sum over "
        "its top-k or its kept choices): this layer scales each expert's output by the "
        "router's probability as it is, weights[token, choice] (softmax over all E experts), "
        "without renormalising")),
    Diagnosis("dropped_token_passed_through", _is("dropped_passed_through"), _hint(
        "a token that lost every choice at capacity gets x from your layer: it should get 0 "
        "(no expert computed it). The block's residual, x + moe(x), passes it through; "
        "adding x here counts it twice")),
    Diagnosis("wrong_combine_order", _is("sent_order", "permuted_again"), _hint(
        "every expert computed the right rows, but the output is not the layer's: the rows "
        "come back in the order you sent them (sorted by expert), so undo that permutation "
        "(its inverse: back[order] = returned) before adding each to the token it came "
        "from")),
    Diagnosis("wrong_output", _is("wrong_output"), _hint(
        lambda c: f"every expert computed the right rows, but your output differs from the "
        f"single-device layer's (max |difference| {_detail(c)}): return only the MoE "
        f"output, sum over a token's kept choices of expert output x router weight (the "
        f"block adds the residual, not the layer)")),
    Diagnosis("no_autograd", _is("no_autograd"), _hint(
        "the output is right but does not require grad: build it from x, the experts and "
        "the weights with differentiable operations (and all-to-alls that carry "
        "gradients)")),
    Diagnosis("expert_gradient", _is("expert_gradient"), _hint(
        lambda c: f"the output is right, but {_detail(c)}: the experts' outputs must stay in "
        f"the graph (no .detach() or torch.no_grad()), and come back through an all-to-all "
        f"whose backward returns each row's gradient to the expert that computed it")),
    Diagnosis("router_gradient", _is("router_gradient"), _hint(
        lambda c: f"the output is right, but {_detail(c)}: the router "
        f"learns through the weights that scale the returned rows, so keep weights[token, "
        f"choice] in the graph (no .detach(), no .tolist())")),
    Diagnosis("x_gradient", _is("x_gradient"), _hint(
        lambda c: f"the output, the experts' and the router's gradients are right, but "
        f"{_detail(c)}: the tokens' gradient flows back through the experts and the "
        f"all-to-all to the rows you sent, so send x[token] itself (no .detach()) through "
        f"an all-to-all that carries gradients")),
)

QUESTION = register(RankExercise(
    "06.expert_parallel_layer",
    probe=_layer_rank,
    worlds=[World(n, (phases,), "") for n, phases in PHASES.items()],
    reference=lambda world: None,  # the single-device layer runs on the ranks
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    solution=EP_LAYER_SOLUTION,
    where="",
    timeout=90.0,
    hang_hint="the ranks' collectives did not match{t} ({where}): every rank of the group "
              "must call the same all-to-alls in the same order, with group=group, in "
              "forward and in backward",
    prompt="""
        Write expert_parallel_layer(x, experts, weights, local_experts, n_experts,
        capacity, group) -> Tensor, the rank side of an expert-parallel MoE layer. x (T, h)
        are this rank's tokens; experts (T, k) the router's top-k choices (expert indices)
        and weights (T, k) their router probabilities; local_experts this rank's experts
        as modules: rank r of the ep ranks of group holds experts r x E/ep to
        (r + 1) x E/ep - 1 (E = n_experts). capacity (an int, or None: no limit) is the
        most choices one expert accepts from this rank, first come first served in
        choice-major order (every token's first choice, in token order, before any second
        choice); the others are dropped. Count the kept choices per destination rank,
        swap the counts, send each kept choice's token to its expert's rank, run the local
        experts, send the outputs back, undo the permutation and return (T, h): for each
        token, the sum of its kept experts' outputs times their router weights. The tokens
        travel by an all-to-all that carries gradients: the chapter's all_to_all(rows,
        send, recv, group) (parlib.strategies.experts) or
        torch.distributed.nn.functional.all_to_all_single; a bare dist.all_to_all_single
        on them is rejected (autograd cannot see it), and is right only for the counts.
        Checked on ranks, fp32, rtol 1e-4, against the single-device MoE layer with the same
        routing: ep = 2, ep = 4 (with a capacity limit, experts no token picks, a whole
        rank's of them), two ep groups of 2 on 4 ranks ({0, 1} and {2, 3}, then {0, 2} and
        {1, 3}), with and without a capacity limit; the output, and the gradients of x, of
        this rank's experts and of the router (through the weights). The weights are the
        router's probabilities as they are (softmax over all E experts, not renormalised).
    """,
    explanation="""
        Three steps on each rank, then backward. The capacity cut and the sort are
        06.dispatch's (question 5): keep the choices an expert accepts (choice-major),
        sort the kept (token, choice) pairs by expert with a stable argsort (`order`);
        rank r's experts are contiguous, so this also groups the rows by destination,
        and per_expert.view(ep, -1).sum(1) are the send counts.

        A rank cannot know from its own tokens what the others will send it, so the
        per-expert counts are swapped first with a plain all-to-all (integers, nothing to
        differentiate): `incoming` (ep, E/ep) says how many rows each sender has for each
        local expert, and its row sums are the receive counts.

        The tokens go out with a differentiable all-to-all; they arrive by sender, and
        within a sender sorted by expert, so `local` names each arrived row's expert.
        The outputs go back with the same exchange reversed and come back in the order
        sent: back[order] = returned undoes the sort, each row is scaled by its router
        weight and added to its token.

        Backward runs the two all-to-alls in reverse: each output's gradient returns to
        the expert that computed it (the experts' gradients sum every rank's tokens),
        and each row's gradient returns to the rank whose token it was. The router's
        gradient comes through the weights, which never travel.
    """,
    after="""
        parlib.strategies.experts.ExpertParallelMoE is this layer with the router inside
        (route on this rank's tokens, then these steps); its all_to_all is the
        autograd.Function AllToAll, whose backward is the reversed exchange.
    """,
))

__all__ = ["EP_LAYER_SOLUTION", "Refused"]
