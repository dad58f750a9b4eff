"""03.row_parallel: a row-parallel linear layer, probed on a square layer and inside a
tensor-parallel TinyGPT."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch

from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always, off_by
from parlib.course.questions.ch03._setup import (
    SEED,
    STEPS,
    WORLDS,
    cfg,
    first_mismatch,
    reference_record,
    train_record,
)
from parlib.course.registry import register
from parlib.verify import close

ROW_PARALLEL_SOLUTION = '''\
def row_parallel_linear(x, linear, group=None):
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    cols = linear.in_features // t
    # torch stores the weight as (out_features, in_features): this rank's input
    # features are a slice of its columns
    weight = linear.weight[:, rank * cols:(rank + 1) * cols]       # (out, in/t)
    partial = x @ weight.T     # (b, s, in/t) @ (in/t, out) -> (b, s, out), a partial sum
    total = tensor_ops.reduce_from_tensor_parallel_region(partial, group)  # g
    return total + linear.bias  # the bias once, after the sum
'''


class _LearnerRowParallel(torch.nn.Module):
    """A full nn.Linear driven by the learner's row_parallel_linear (same on every rank)."""

    def __init__(self, linear: torch.nn.Linear, fn: Callable) -> None:
        super().__init__()
        self.linear = linear
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.linear, None)


@contextlib.contextmanager
def _plain_all_reduce_watch() -> Iterator[list[bool]]:
    """Yields a list that holds True once ``dist.all_reduce`` ran on a tensor autograd
    tracks. That all-reduce is invisible to autograd: it works only through torch's
    deprecated autograd fallback (which warns "may lead to silently incorrect behavior"),
    and its backward is whatever the fallback does, not a choice the code made. Inside an
    autograd Function's forward (g's) grad mode is off, so g's own all-reduce is not
    counted."""
    import torch.distributed as dist

    seen: list[bool] = []
    real = dist.all_reduce

    def watched(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and getattr(tensor, "requires_grad", False):
            seen.append(True)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = watched
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
        if any("silently incorrect" in str(w.message) for w in caught):
            seen.append(True)
    finally:
        dist.all_reduce = real


def _probe_row(fn: Callable) -> dict[str, Any]:
    """On each rank: the learner's layer on a square 8 x 8 linear, this rank's slice of a
    random input, against the full layer; and the candidates for common mistakes."""
    import torch.distributed as dist

    rank, t = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(SEED)
    full = torch.nn.Linear(8, 8)
    with torch.no_grad():
        full.weight.copy_(torch.randn(8, 8, generator=gen))
        full.bias.copy_(torch.randn(8, generator=gen))
    x = torch.randn(2, 3, 8, generator=gen)
    dy = torch.randn(2, 3, 8, generator=gen)
    cols = 8 // t
    mine = slice(rank * cols, (rank + 1) * cols)
    xf = x.clone().requires_grad_()
    yf = full(xf)
    yf.backward(dy)
    w, bias = full.weight.detach(), full.bias.detach()
    partials = [x[..., r * cols:(r + 1) * cols] @ w[:, r * cols:(r + 1) * cols].T
                for r in range(t)]
    wrong_dim = sum(x[..., r * cols:(r + 1) * cols] @ w[r * cols:(r + 1) * cols, :]
                    for r in range(t))
    candidates = {
        "bias_every_rank": yf.detach() + (t - 1) * bias,
        "no_all_reduce": partials[rank] + bias,
        "average": sum(partials) / t + bias,
        "wrong_dim": wrong_dim + bias,
        "wrong_dim_no_bias_fix": wrong_dim + t * bias,
    }
    mine_layer = torch.nn.Linear(8, 8)
    mine_layer.load_state_dict(full.state_dict())
    xs = x[..., mine].clone().requires_grad_()
    try:
        with _plain_all_reduce_watch() as plain:
            y = fn(xs, mine_layer, None)
    except NotImplementedError:  # the exercise's stub: "not attempted"
        raise
    except RuntimeError as exc:  # a shape mismatch, most often
        return {"error": str(exc).splitlines()[0]}
    if plain:
        return {"plain_all_reduce": True}
    if not isinstance(y, torch.Tensor):
        return {"error": f"row_parallel_linear returned {type(y).__name__}, not a tensor"}
    out = {"y": y.detach().clone(), "want": yf.detach(), "candidates": candidates}
    if y.shape == yf.shape and y.requires_grad:
        y.backward(dy)
        wg = mine_layer.weight.grad
        out["x_grad"] = (None if xs.grad is None else xs.grad.clone(), xf.grad[..., mine])
        out["w_grad"] = (None if wg is None else wg[:, mine].clone(),
                         full.weight.grad[:, mine])
        out["b_grad"] = (None if mine_layer.bias.grad is None else
                         mine_layer.bias.grad.clone(), full.bias.grad)
    return out


_CANDIDATE_HINTS = {
    "bias_every_rank": "the output is t - 1 biases too big: every rank adds the bias before "
                       "the all-reduce, so the sum holds it t times. Add it once, after the "
                       "all-reduce",
    "no_all_reduce": "each rank returns only its own partial sum: all-reduce the partial "
                     "products in forward (g), then add the bias",
    "average": "the output is the average of the partial sums: they add up to XW, so sum "
               "them (no division by t)",
    "wrong_dim": "you took rows of linear.weight, but torch stores it as (out_features, "
                 "in_features): this rank's input features are the columns "
                 "[r * in/t, (r + 1) * in/t)",
    "wrong_dim_no_bias_fix": "you took rows of linear.weight (torch stores it as "
                             "(out_features, in_features): the input features are "
                             "columns), and the bias is added on every rank",
}
_GRADS = (("x_grad", "x"), ("w_grad", "this rank's columns of the weight"),
          ("b_grad", "the bias"))


def _tp_with_row(fn: Callable, steps: int) -> dict[str, Any]:
    """On each rank: a TP TinyGPT whose attention out and MLP down run the learner's
    row_parallel_linear on full copies of the single-device layers."""
    import copy

    import torch.distributed as dist

    from parlib.model import build_model
    from parlib.strategies.tensor import local_shards, shard_of, tensor_parallel_copy

    rank, t = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg(), SEED)
    ref = reference_record(steps)
    tp = tensor_parallel_copy(model)
    for block, full_block in zip(tp.blocks, model.blocks):
        block.attn.out = _LearnerRowParallel(copy.deepcopy(full_block.attn.out), fn)
        block.mlp.down = _LearnerRowParallel(copy.deepcopy(full_block.mlp.down), fn)
    got = train_record(tp, steps)
    names = [n for n, _ in tp.named_parameters()]

    def columns(d: dict[str, Any]) -> dict[str, Any]:
        """The learner's layers hold the full weight; only this rank's columns count (a
        row-parallel weight is cut along its input dimension, 1)."""
        out = dict(d)
        for n in names:
            if ".linear.weight" in n and out[n] is not None:
                out[n] = shard_of(out[n], 1, rank, t)
        return out

    def local(full: dict[str, torch.Tensor]) -> dict[str, Any]:
        return columns(local_shards(tp, {n: full[n.replace(".linear.", ".")] for n in names}))

    got["grads"] = [columns(gr) for gr in got["grads"]]
    got["params"] = columns(got["params"])
    ref["grads"] = [local(gr) for gr in ref["grads"]]
    ref["params"] = local(ref["params"])
    return {"problem": first_mismatch(got, ref)}


def _row_rank(fn: Callable, phase: str) -> dict[str, Any]:
    """The probe: the layer alone on a square linear ("op") or inside a TinyGPT ("train")."""
    return _probe_row(fn) if phase == "op" else _tp_with_row(fn, STEPS)


def _first_wrong(case: Case) -> tuple[int, str] | None:
    for rank, res in enumerate(case.results):
        if case.setting.args[0] == "train":
            if res["problem"]:
                return rank, "train"
            continue
        if "error" in res:
            return rank, "error"
        if "plain_all_reduce" in res:
            return rank, "plain_all_reduce"
        if res["y"].shape != res["want"].shape:
            return rank, "shape"
        if not close(res["y"], res["want"]):
            return rank, "y"
        if "x_grad" not in res:
            return rank, "no_autograd"
        for key, _ in _GRADS:
            got, want = res[key]
            if got is None or not close(got, want):
                return rank, key
    return None


def _what(case: Case) -> str:
    return dict(_GRADS)[case.step]


def _grad(case: Case) -> tuple[Any, torch.Tensor]:
    return case.report[case.step]


def _candidate(key: str) -> Diagnosis:
    return Diagnosis(key, lambda c: c.step == "y" and close(c.report["y"],
                                                            c.report["candidates"][key]),
                     _CANDIDATE_HINTS[key])


DIAGNOSES = [
    Diagnosis("shape_error", lambda c: c.step == "error",
              lambda c: f"rank {c.rank}: {c.report['error']}. x holds this rank's "
              f"in_features/t input features; the matching weight slice is the columns "
              f"linear.weight[:, r * in/t:(r + 1) * in/t] (shape (out, in/t))"),
    Diagnosis("plain_all_reduce", lambda c: c.step == "plain_all_reduce",
              "you called dist.all_reduce directly on a tensor autograd tracks: autograd "
              "cannot see through it (torch only falls back, warning that this \"may lead "
              "to silently incorrect behavior\"). Use g, "
              "tensor_ops.reduce_from_tensor_parallel_region (or your own from 03.g): an "
              "autograd Function whose forward all-reduces and whose backward is the "
              "identity, on purpose"),
    Diagnosis("wrong_shape", lambda c: c.step == "shape",
              lambda c: f"rank {c.rank} returned shape {tuple(c.report['y'].shape)}, expected "
              f"{tuple(c.report['want'].shape)}: every rank returns the whole output"),
    *[_candidate(key) for key in _CANDIDATE_HINTS],
    Diagnosis("wrong_output", lambda c: c.step == "y",
              lambda c: f"rank {c.rank}'s output differs from the full layer's (max "
              f"|difference| {(c.report['y'] - c.report['want']).abs().max().item():.3g})"),
    Diagnosis("no_autograd", lambda c: c.step == "no_autograd",
              "the output does not require grad: build it from x and linear.weight with "
              "differentiable operations"),
    Diagnosis("no_gradient", lambda c: c.step in dict(_GRADS) and _grad(c)[0] is None,
              lambda c: f"rank {c.rank} got no gradient for {_what(c)}"),
    Diagnosis("gradient_times_t",
              lambda c: c.step in dict(_GRADS) and off_by(_grad(c)[0], _grad(c)[1], c.world),
              lambda c: f"the gradient of {_what(c)} is t times too big: your all-reduce "
              f"also sums in backward. The output's gradient is already whole on every rank, "
              f"so the reduction's backward must be the identity (Megatron's g)"),
    Diagnosis("wrong_gradient", lambda c: c.step in dict(_GRADS),
              lambda c: f"rank {c.rank}'s gradient of {_what(c)} differs from the full "
              f"layer's (max |difference| "
              f"{(_grad(c)[0] - _grad(c)[1]).abs().max().item():.3g})"),
    Diagnosis("breaks_training", always, lambda c: c.report["problem"]),
]

_TRAIN = ("training a tensor-parallel TinyGPT with your layer as attention's out and the "
          "MLP's down on {world} ranks, rank {rank}")

QUESTION = register(RankExercise(
    "03.row_parallel",
    probe=_row_rank,
    worlds=[World(t, ("op",)) for t in WORLDS] + [World(t, ("train",), _TRAIN) for t in WORLDS],
    reference=lambda world: None,  # nn.Linear on the ranks; verify.reference_run in training
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    solution=ROW_PARALLEL_SOLUTION,
    backend=None,
    timeout=90.0,
    prompt="""
        Write row_parallel_linear(x, linear, group=None) -> Tensor. linear is a full
        nn.Linear, the same on every rank; x (shape (b, s, in_features/t)) is this rank's
        slice of the layer's input features, slice r of t. Return the layer's whole output
        (b, s, out_features) on every rank, computed from this rank's slice of the weight
        only, with the right communication in forward and backward: use g (all-reduce
        forward, identity backward), tensor_ops.reduce_from_tensor_parallel_region from
        parlib.strategies, or your own from 03.g
        (a bare dist.all_reduce is rejected: autograd cannot see it). Checked on 2 and 4
        ranks: a square layer against nn.Linear (output, and the gradients of x, of this
        rank's weight columns and of the bias), then as attention's out and the MLP's
        down in a tensor-parallel TinyGPT trained for 3 SGD steps against single-device
        training (rtol 1e-4).
    """,
    explanation="""
        Cut W by rows of the maths, which are **columns** of torch's weight: nn.Linear
        stores W as (out_features, in_features) and computes x @ W.T + b. Rank r's input
        features are [r * in/t, (r + 1) * in/t), so it needs linear.weight[:, that range]
        (shape (out, in/t)). x @ weight.T is then a partial sum of the whole output: the
        other ranks' features contribute the rest.

        All-reduce the partial sums with g. Its backward is the identity: the loss is
        computed from the summed output identically on every rank, so the gradient of
        the output is already whole everywhere, and each rank's gradients of its own x
        and weight columns follow from it without communication.

        Add the bias **after** the all-reduce: added before, every rank's copy would be
        summed, t biases in all.
    """,
))

__all__ = ["ROW_PARALLEL_SOLUTION"]
