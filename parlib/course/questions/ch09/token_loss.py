"""09.global_token_loss: this rank's share of a loss normalised by the real tokens of every
microbatch of every rank of its data-parallel group, run on 2 and 4 ranks and on two groups
of 2 non-consecutive ranks ({0, 2} and {1, 3}), with padding that differs across ranks and
microbatches. Judged on every rank: the loss's value and its gradient with respect to the
logits against the single-device loss over the group's whole batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from parlib.course.answers import no_process_exit
from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always
from parlib.course.registry import register
from parlib.verify import close

IGNORE = -100
M, ROWS, SEQ, VOCAB = 3, 2, 5, 7  # microbatches per rank, rows, positions, classes
WORLDS = (World(2), World(4), World(4, ("strided",),
                                     "on 4 ranks as two groups of 2, {{0, 2}} and {{1, 3}}"))

TOKEN_LOSS_SOLUTION = '''\
def token_loss(microbatches, group):
    real = sum(int((y != -100).sum()) for _, y in microbatches)
    count = torch.tensor([real])
    dist.all_reduce(count, group=group)  # the real tokens of the whole group's batch
    total = sum(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                ignore_index=-100, reduction="sum")
                for logits, y in microbatches)
    return total / count[0]
'''


def _microbatches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s M microbatches: logits and targets, each row padded (IGNORE) after a
    length that differs by rank, microbatch and row (at least one real token)."""
    g = torch.Generator().manual_seed(900 + rank)
    out = []
    for i in range(M):
        logits = torch.randn(ROWS, SEQ, VOCAB, generator=g)
        y = torch.randint(VOCAB, (ROWS, SEQ), generator=g)
        for j in range(ROWS):
            y[j, 1 + (3 * rank + 2 * i + 4 * j) % SEQ:] = IGNORE
        out.append((logits, y))
    return out


def _sums(mbs: list) -> list[tuple[torch.Tensor, int]]:
    return [(F.cross_entropy(lg.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE,
                             reduction="sum"), int((y != IGNORE).sum())) for lg, y in mbs]


def _candidates(rank: int, members: list[int], world: int) -> dict[str, float]:
    """The right loss on ``rank`` and the wrong ones a learner could compute."""
    mine = _sums(_microbatches(rank))
    group_tokens = sum(t for r in members for _, t in _sums(_microbatches(r)))
    world_tokens = sum(t for r in range(world) for _, t in _sums(_microbatches(r)))
    total, local = sum(float(s) for s, _ in mine), sum(t for _, t in mine)
    n = len(members)
    return {"right": total / group_tokens,
            "per_microbatch_means": sum(float(s) / t for s, t in mine) / (M * n),
            "per_microbatch_means_no_n": sum(float(s) / t for s, t in mine) / M,
            "local_count": total / (local * n),
            "local_count_no_n": total / local,
            "counted_padding": total / (n * M * ROWS * SEQ),
            "world_count": total / world_tokens,
            "group_times_n": n * total / group_tokens}


def _probe(fn, layout: str = "world") -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "strided":
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
        group, members = groups[rank % 2], [rank % 2, rank % 2 + 2]
    else:
        group, members = dist.group.WORLD, list(range(world))
    mbs = [(lg.clone().requires_grad_(), y) for lg, y in _microbatches(rank)]
    with no_process_exit():
        loss = fn([(lg, y.clone()) for lg, y in mbs], group)
    report: dict[str, Any] = {"candidates": _candidates(rank, members, world)}
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        report["form"] = type(loss).__name__ if not isinstance(loss, torch.Tensor) \
            else f"a tensor of shape {tuple(loss.shape)}"
        return report
    report["loss"] = float(loss.detach().reshape(()))
    if loss.grad_fn is None:
        report["detached"] = True
        return report
    loss.reshape(()).backward()
    want = [lg.detach().clone().requires_grad_() for lg, _ in mbs]
    right = sum(F.cross_entropy(w.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE,
                                reduction="sum") for w, (_, y) in zip(want, mbs))
    (right / sum(t for r in members for _, t in _sums(_microbatches(r)))).backward()
    report["grads_right"] = all(lg.grad is not None and close(lg.grad, w.grad)
                                for (lg, _), w in zip(mbs, want))
    return report


def _ok(report: dict[str, Any]) -> bool:
    return ("loss" in report and not report.get("detached") and report["grads_right"]
            and close(torch.tensor(report["loss"]), torch.tensor(report["candidates"]["right"])))


def _first_wrong(case: Case) -> tuple[int, str] | None:
    for rank, report in enumerate(case.results):
        if not _ok(report):
            return rank, "loss"
    return None


def _is(name: str):
    def when(c: Case) -> bool:
        r = c.report
        if "loss" not in r:
            return False
        got, cands = torch.tensor(r["loss"]), r["candidates"]
        return close(got, torch.tensor(cands[name])) and not close(got,
                                                                  torch.tensor(cands["right"]))
    return when


def _values(c: Case) -> str:
    r = c.report
    return (f"rank {c.rank}'s loss is {r['loss']:.6f}, expected "
            f"{r['candidates']['right']:.6f}")


DIAGNOSES = (
    Diagnosis("not_a_scalar", lambda c: "form" in c.report,
              lambda c: f"rank {c.rank} returned {c.report['form']}: return this rank's loss "
              "as a one-element tensor that carries the gradient (backward is called on it)"),
    Diagnosis("detached", lambda c: c.report.get("detached", False),
              lambda c: f"rank {c.rank}'s loss has no gradient (no grad_fn): compute it from "
              "the logits with torch operations, without .item(), .detach() or torch.no_grad; "
              "only the token count may be a plain number"),
    Diagnosis("per_microbatch_means",
              lambda c: _is("per_microbatch_means")(c) or _is("per_microbatch_means_no_n")(c),
              lambda c: f"{_values(c)}: that averages each microbatch's mean. A microbatch "
              "with few real tokens then weighs as much as a full one, so the loss changes "
              "with m and with how the padding falls. Sum the token losses and divide by "
              "the real tokens of every microbatch of every rank of the group"),
    Diagnosis("local_count",
              lambda c: _is("local_count")(c) or _is("local_count_no_n")(c),
              lambda c: f"{_values(c)}: you divided by this rank's own real tokens. Ranks "
              "hold different numbers of them; divide by the group's count, summed with "
              "dist.all_reduce(count, group=group)"),
    Diagnosis("counted_padding", _is("counted_padding"),
              lambda c: f"{_values(c)}: your count includes the padded positions (targets "
              "equal to -100). Count only real tokens, (y != -100).sum()"),
    Diagnosis("world_group", _is("world_count"),
              lambda c: f"{_values(c)}: you counted the tokens of every rank of the world. "
              f"Rank {c.rank}'s data-parallel group is the group given: pass group=group to "
              "the all-reduce, so each group divides by its own batch's tokens"),
    Diagnosis("times_group_size", _is("group_times_n"),
              lambda c: f"{_values(c)}: N times too large. The ranks' losses (and "
              "gradients) are summed over the group, so no rank multiplies by N"),
    Diagnosis("wrong_gradient",
              lambda c: "loss" in c.report and not c.report["grads_right"] and close(
                  torch.tensor(c.report["loss"]), torch.tensor(c.report["candidates"]["right"])),
              lambda c: f"rank {c.rank}'s loss has the right value but not the right "
              "gradient with respect to the logits: build it from the cross-entropy of the "
              "logits themselves (a constant divisor is fine; a value patched in is not)"),
    Diagnosis("wrong_loss", always,
              lambda c: f"{_values(c)}. Sum the cross-entropy of the real tokens of all this "
              "rank's microbatches and divide by the real tokens summed over every "
              "microbatch of every rank of the group"),
)

HANG_HINT = ("your function did not finish on every rank{t} ({where}): every rank of a group "
             "must make the same all-reduce of the token count, once")


QUESTION = register(RankExercise(
    "09.global_token_loss",
    probe=_probe,
    worlds=WORLDS,
    reference=lambda world: None,
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    where="on {world} ranks",
    hang_hint=HANG_HINT,
    solution=TOKEN_LOSS_SOLUTION,
    timeout=120.0,
    prompt="""
        Write token_loss(microbatches, group) -> Tensor, run on every rank of the
        data-parallel group `group` (it may be a sub-group of the world). `microbatches` is
        this rank's list of (logits, targets): logits (b, s, V), targets (b, s) with -100 at
        padded positions. Return this rank's loss, a one-element tensor, such that the
        losses of the group's ranks add up to the single-device loss of the group's whole
        batch, the mean cross-entropy over its real tokens, and so that backward on each
        gives that loss's gradient with respect to this rank's logits (the gradients are
        summed over the ranks). Checked on every rank on 2 and 4 ranks and on two groups of
        2, {0, 2} and {1, 3}, with padding that differs across ranks and microbatches.
    """,
    explanation="""
        One device computes sum(token losses) / T, T the real tokens of the whole batch.
        Split over ranks and microbatches, the same sum is the sum of every microbatch's
        token losses; the divisor must stay T, the real tokens of every microbatch of every
        rank of the group, which no rank sees alone: one all-reduce of a count, before the
        first backward. Averaging each microbatch's mean instead weighs a token of a short
        microbatch more than one of a long one; dividing by the local count weighs a rank's
        tokens by how much padding it got. Both move when m, the data-parallel size or the
        padding changes; this form cannot.
    """,
    after="""
        parlib.strategies.token_loss does the same with global_token_count and
        global_token_loss. The course's gradient syncs average the gradients (they divide
        the sum by N), so there each share is multiplied by N (averaged_over=N) to undo
        that division.
    """,
))

__all__ = ["M", "TOKEN_LOSS_SOLUTION", "WORLDS"]
