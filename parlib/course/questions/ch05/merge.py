"""05.merge_partials: merge two partial attention results with the online softmax, judged
against the full softmax on random blocks (with causal masks that leave rows fully masked on
one side, either one, or on both, and scores large enough to overflow exp, also on the rows
that see one side only)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from parlib.course.answers import plain_tensor
from parlib.course.on_ranks import Case, CaseExercise, Diagnosis, always
from parlib.course.registry import register
from parlib.strategies.context_ops import block_attention, merge_partials
from parlib.verify import close

SEED = 5
B, HEADS, S_Q, D, S_K = 1, 2, 6, 4, 5  # two key blocks of S_K keys each

# name -> (query positions, first key position of block a, of block b, query scale); None:
# no mask. "large" scores reach lse ~ 10^2, past fp32's exp limit (88).
CASES: dict[str, tuple[Any, int, int, float]] = {
    "plain": (None, 0, 0, 1.0),
    "causal": (range(2, 8), 0, 5, 1.0),  # queries 2..4 see nothing of block b (5..9)
    "large": (None, 0, 0, 300.0),
    "masked": (range(0, 6), 3, 8, 1.0),  # queries 0..2 see nothing on either side
    # large scores on rows that see one block only: queries 2..4 see nothing of block b,
    # then (the blocks swapped) nothing of block a, so either side may be the one seen
    "causal_large": (range(2, 8), 0, 5, 300.0),
    "swapped_large": (range(2, 8), 5, 0, 300.0),
}

MERGE_SOLUTION = '''\
def merge(out_a, lse_a, out_b, lse_b):
    top = torch.maximum(lse_a, lse_b)  # the running max, (b, a, s_q)
    # a row masked on both sides: any finite top will do (else -inf - -inf = NaN)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)  # each side's sum / exp(top)
    total = wa + wb  # 0 only where both sides saw nothing
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / safe[..., None]
    return out, top + torch.log(total)  # log 0 = -inf: still nothing seen
'''


def _blocks(name: str) -> dict[str, torch.Tensor]:
    """One case: the two partials (block_attention on each key block) and the full softmax
    over both blocks at once, out 0 and lse -inf on a row that sees no key at all."""
    q_pos, first_a, first_b, scale = CASES[name]
    gen = torch.Generator().manual_seed(SEED + list(CASES).index(name))
    q = torch.randn(B, HEADS, S_Q, D, generator=gen) * scale
    k = torch.randn(B, HEADS, 2 * S_K, D, generator=gen)
    v = torch.randn(B, HEADS, 2 * S_K, D, generator=gen)
    qp = None if q_pos is None else torch.tensor(list(q_pos))
    kp = [None if q_pos is None else torch.arange(f, f + S_K) for f in (first_a, first_b)]
    out_a, lse_a = block_attention(q, k[..., :S_K, :], v[..., :S_K, :], qp, kp[0])
    out_b, lse_b = block_attention(q, k[..., S_K:, :], v[..., S_K:, :], qp, kp[1])
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (b, a, s_q, 2 S_K): the full softmax
    if qp is not None:
        scores = scores.masked_fill(torch.cat(kp)[None, :] > qp[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.where(seen[..., None], torch.softmax(scores, dim=-1), torch.zeros_like(scores))
    return {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b,
            "out": probs @ v, "lse": lse}


def lse_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same -inf rows, and :func:`parlib.verify.close` on the others."""
    if got.shape != want.shape:
        return False
    finite = torch.isfinite(want)
    if not torch.equal(torch.isneginf(got), ~finite):
        return False
    return close(got[finite], want[finite])


def _report(fn: Callable, name: str) -> dict[str, Any]:
    blocks = _blocks(name)
    args = [blocks[k].clone() for k in ("out_a", "lse_a", "out_b", "lse_b")]
    got = fn(*args)
    report: dict[str, Any] = {"case": name, "blocks": blocks}
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        report["problem"] = ("not_pair", type(got).__name__)
        return report
    out, lse = (plain_tensor(t) for t in got)
    if out is None or lse is None:
        report["problem"] = ("not_pair", " and ".join(type(t).__name__ for t in got))
        return report
    report.update(out=out.detach(), lse=lse.detach())
    if out.shape != blocks["out"].shape or lse.shape != blocks["lse"].shape:
        report["problem"] = ("shape", f"{tuple(out.shape)} and {tuple(lse.shape)}")
    elif not close(torch.nan_to_num(out, nan=1e9), blocks["out"]):
        report["problem"] = ("out", "")
    elif not lse_close(lse, blocks["lse"]):
        report["problem"] = ("lse", "")
    return report


# --------------------------------------------------------------------------- the verdicts


def _what(c: Case) -> str:
    return c.report["problem"][0]


def _blk(c: Case) -> dict[str, torch.Tensor]:
    return c.report["blocks"]


def _out_is(c: Case, want: torch.Tensor) -> bool:
    return _what(c) == "out" and close(torch.nan_to_num(c.report["out"], nan=1e9), want)


def _one_side_unweighted(c: Case) -> bool:
    """One side's weight exp(lse_x - top) taken as 1: its log-sum-exp ignored."""
    k = _blk(c)
    top = torch.maximum(k["lse_a"], k["lse_b"])
    wa, wb = torch.exp(k["lse_a"] - top)[..., None], torch.exp(k["lse_b"] - top)[..., None]
    return (_out_is(c, (wa * k["out_a"] + k["out_b"]) / (wa + 1))
            or _out_is(c, (k["out_a"] + wb * k["out_b"]) / (1 + wb)))


def _lse_of_one_side(c: Case) -> bool:
    k = _blk(c)
    return _what(c) == "lse" and any(
        lse_close(c.report["lse"], k[x]) for x in ("lse_a", "lse_b"))


def _nan_on_masked_rows_only(c: Case) -> bool:
    """NaN exactly on the rows that see no key on either side, every other row right."""
    if c.report["case"] != "masked" or _what(c) not in ("out", "lse"):
        return False
    k, out, lse = _blk(c), c.report["out"], c.report["lse"]
    dead = ~torch.isfinite(k["lse"])  # (b, a, s_q)
    nan_rows = torch.isnan(out).any(-1) | torch.isnan(lse)
    return bool(torch.equal(nan_rows, dead)) and close(out[~dead], k["out"][~dead])


def _bad_rows(c: Case) -> torch.Tensor:
    """(b, a, s_q): the rows whose out or lse is inf or NaN where the softmax's is not."""
    k = _blk(c)
    return ((~torch.isfinite(c.report["out"])).any(-1)
            | (~torch.isfinite(c.report["lse"]) & torch.isfinite(k["lse"])))


def _overflow(c: Case) -> bool:
    return CASES[c.report["case"]][3] > 1 and _what(c) in ("out", "lse") and bool(
        _bad_rows(c).any())


def _overflow_on_one_side_rows(c: Case) -> bool:
    """inf or NaN only on rows that see keys in one block alone (the other's lse -inf): the
    guard against -inf - (-inf) keyed on one side's lse, not on the max."""
    if not _overflow(c):
        return False
    k = _blk(c)
    one_side = torch.isfinite(k["lse_a"]) ^ torch.isfinite(k["lse_b"])
    return not bool((_bad_rows(c) & ~one_side).any())


def _finite_where_nothing(c: Case) -> bool:
    """lse finite on rows that see no key at all (the softmax's -inf)."""
    if _what(c) != "lse":
        return False
    dead = torch.isneginf(_blk(c)["lse"])
    return bool(torch.isfinite(c.report["lse"][dead]).any())


def _finite_where_nothing_hint(c: Case) -> str:
    dead = torch.isneginf(_blk(c)["lse"])
    value = c.report["lse"][dead & torch.isfinite(c.report["lse"])].min().item()
    head = (f"on the rows that see no key on either side your lse is {value:.3g}, where the "
            f"full softmax's is -inf (log 0)")
    if value < -1e4:
        return (f"{head}: that is a sentinel standing in for -inf (like -1e9), and a "
                "sentinel is a number: the next merge weighs such a row as a block that was "
                "seen. Keep -inf for \"nothing seen\" and guard the max instead: replace a "
                "non-finite max by 0 and divide only where the total is positive")
    return (f"{head}: with both weights 0 the total is 0, and the merged lse is the max plus "
            "log(total) = log 0 = -inf; take the log of the total itself, not of a value put "
            "in its place to avoid dividing by 0")


def _worst(c: Case) -> str:
    got, want = c.report[_what(c)], _blk(c)[_what(c)]
    diff = (torch.nan_to_num(got, nan=float("inf")) - want).abs()
    diff = diff[torch.isfinite(want)] if _what(c) == "lse" else diff
    return f"{diff.max().item():.3g}"


_WHERE = {"plain": "random blocks without a mask",
          "causal": "a causal mask under which some rows see nothing in block b (lse_b -inf)",
          "large": "large scores (log-sum-exps about 10^2, past where exp overflows in fp32)",
          "masked": "a causal mask under which some rows see nothing on either side",
          "causal_large": "large scores, with rows that see nothing in block b (lse_b -inf)",
          "swapped_large": "large scores, with rows that see nothing in block a (lse_a -inf)"}

DIAGNOSES = (
    Diagnosis("not_a_pair", lambda c: _what(c) == "not_pair",
              lambda c: f"your function returned {c.report['problem'][1]}: return a pair "
              "(out, lse) of tensors, e.g. `return out, lse`"),
    Diagnosis("wrong_shape", lambda c: _what(c) == "shape",
              lambda c: f"out and lse have shapes {c.report['problem'][1]}, expected "
              f"{tuple(_blk(c)['out'].shape)} and {tuple(_blk(c)['lse'].shape)}: the merged "
              "result has the shapes of each partial"),
    Diagnosis("guard_on_one_side", _overflow_on_one_side_rows,
              "inf or NaN only on rows that see keys in one block alone: there one lse is "
              "-inf and the other large, and the running max must be the seen side's lse. "
              "Take m = max(lse_a, lse_b) and replace it by 0 only where m itself is not "
              "finite (both sides -inf): a guard on lse_a or lse_b alone sets m = 0 on rows "
              "that saw keys, and exp(lse - 0) overflows"),
    Diagnosis("no_running_max", _overflow,
              "your result is inf or NaN: exp(lse) overflows fp32 past 88. "
              "Subtract the running max m = max(lse_a, lse_b) before exp: weigh each side by "
              "exp(lse_x - m) and add m back to the merged log-sum-exp"),
    Diagnosis("nan_masked_row", _nan_on_masked_rows_only,
              "NaN on exactly the rows that see no key on either side (both lse -inf): there "
              "the running max is -inf too and -inf - (-inf) is NaN. Such a row must come out "
              "as out 0, lse -inf: replace a non-finite max by 0 before subtracting, and do "
              "not divide by a zero total"),
    Diagnosis("summed_outputs", lambda c: _out_is(c, _blk(c)["out_a"] + _blk(c)["out_b"]),
              "out is out_a + out_b: each partial is normalised by its own block's sum, so "
              "they cannot simply be added. Weigh each by its share of the total, "
              "exp(lse_x - lse)"),
    Diagnosis("averaged_outputs",
              lambda c: _out_is(c, (_blk(c)["out_a"] + _blk(c)["out_b"]) / 2),
              "out is the plain average of out_a and out_b: the two blocks carry different "
              "shares of the softmax's total. Weigh each by exp(lse_x - lse)"),
    Diagnosis("one_lse_ignored", _one_side_unweighted,
              "one side is weighed as if its log-sum-exp were the running max (weight 1): "
              "weigh both sides, exp(lse_a - m) and exp(lse_b - m)"),
    Diagnosis("lse_not_minus_inf", _finite_where_nothing, _finite_where_nothing_hint),
    Diagnosis("lse_not_merged", _lse_of_one_side,
              "out is right, but the lse you return is one side's: the merged log-sum-exp is "
              "log(exp(lse_a) + exp(lse_b)) (= m + log(exp(lse_a - m) + exp(lse_b - m))), "
              "which the next merge needs"),
    Diagnosis("wrong_lse", lambda c: _what(c) == "lse",
              lambda c: f"out is right but lse differs from the full softmax's log-sum-exp "
              f"(max |difference| {_worst(c)})"),
    Diagnosis("wrong_output", always,
              lambda c: f"out differs from the full softmax's (max |difference| "
              f"{_worst(c)})"),
)


def _refuse_parlibs_merge(fn: Callable) -> tuple[str, str] | None:
    if fn is merge_partials:  # the notebook imports it for the ring exercise
        return ("parlib_merge", "that is parlib's own merge_partials, imported for the ring "
                "exercise: write your own merge and check that")
    return None


QUESTION = register(CaseExercise(
    "05.merge_partials",
    cases=CASES,
    report=_report,
    where=lambda case: f"on {_WHERE[case.step]}",
    refuse=_refuse_parlibs_merge,
    refusals=["parlib_merge"],
    diagnoses=DIAGNOSES,
    solution=MERGE_SOLUTION,
    prompt="""
        Write merge(out_a, lse_a, out_b, lse_b) -> (out, lse). Each side is the attention
        of the same queries over one block of keys: out (b, heads, s_q, head_dim), the
        softmax-weighted values normalised within that block, and lse (b, heads, s_q), the
        log-sum-exp of that block's scores (-inf for a row that sees no key of the block).
        Return the result over both blocks: the attention output and log-sum-exp of the
        full softmax. A row that sees no key on either side comes out as out 0, lse -inf.
        Checked against the full softmax on random blocks: without a mask, with causal
        masks that leave rows fully masked on one side (either one) and on both, and with
        scores large enough that exp overflows in fp32, also on rows that see one side
        only (tolerance rtol 1e-4).
    """,
    explanation="""
        A block's out is sum_j exp(s_j) v_j / exp(lse_x): the weighted values over that
        block's own total exp(lse_x). Over both blocks the total is exp(lse_a) +
        exp(lse_b), so each side carries the share exp(lse_x) / (exp(lse_a) + exp(lse_b))
        and out = share_a out_a + share_b out_b.

        Never compute exp(lse) itself: past 88 it overflows fp32. Subtract the running
        max m = max(lse_a, lse_b) first; the weights exp(lse_x - m) are at most 1, and the
        merged log-sum-exp is m + log(exp(lse_a - m) + exp(lse_b - m)).

        A row that sees nothing on either side has m = -inf, and -inf - (-inf) is NaN:
        replace such an m by 0 (both weights come out 0), and divide by the total only
        where it is positive. Ring attention merges each arriving block into the running
        result with exactly this function.
    """,
))

__all__ = ["CASES", "MERGE_SOLUTION", "lse_close"]
