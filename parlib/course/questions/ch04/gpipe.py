"""04.gpipe: one GPipe step of this rank's stage, with send / recv between neighbours."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always, off_by
from parlib.course.registry import register
from parlib.verify import close, reference_run

CFG_KW = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
SEED = 3
BATCH = 8


# The exercise's solution, written once: the checker runs it as the reference, and the
# worked answer shows the same text.
GPIPE_SOLUTION = """\
def gpipe_step(stage, tokens, targets, m):
    rank = stage.rank
    dev = next(stage.parameters()).device
    xs, ys = tokens.chunk(m), targets.chunk(m)
    inputs, outputs, total = [], [], 0.0
    for i in range(m):
        if stage.is_first:
            x = xs[i].to(dev)
        else:
            x = torch.empty(stage.activation_shape(xs[i].shape[0]), device=dev)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if stage.is_last:
            y = loss_fn(y, ys[i].to(dev)) / m
            total += y.item()
        else:
            dist.send(y.detach(), rank + 1)
        inputs.append(x)
        outputs.append(y)
    for i in reversed(range(m)):
        if stage.is_last:
            outputs[i].backward()
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, rank + 1)
            outputs[i].backward(grad)
        if not stage.is_first:
            dist.send(inputs[i].grad, rank - 1)
    return total if stage.is_last else None
"""


def _define_reference() -> Callable:
    import torch.distributed as dist

    from parlib.model import loss_fn

    namespace = {"torch": torch, "dist": dist, "loss_fn": loss_fn, "__name__": __name__}
    exec(compile(GPIPE_SOLUTION, f"<{__name__} reference>", "exec"), namespace)  # noqa: S102
    return namespace["gpipe_step"]


reference_gpipe = _define_reference()


def _gpipe_rank(fn: Callable, m: int, learner_ranks: tuple[int, ...]) -> dict[str, Any]:
    """Runs on every rank: this rank's stage, the learner's or the reference step."""
    import torch.distributed as dist

    from parlib.model import ModelConfig, make_batch
    from parlib.runtime import device
    from parlib.strategies.pipeline import build_stage

    cfg = ModelConfig(**CFG_KW)
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = build_stage(cfg, SEED, rank, p, device())
    tokens, targets = make_batch(BATCH, cfg, 0, SEED)
    step = fn if rank in learner_ranks else reference_gpipe
    out = step(stage, tokens.clone(), targets.clone(), m)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    elif out is not None and not isinstance(out, (int, float)):
        out = f"<{type(out).__name__}>"
    return {"loss": out, "grads": stage.grads(),
            "missing": [n for n, prm in stage.named_parameters() if prm.grad is None]}


@functools.lru_cache(maxsize=None)
def _reference(world: World) -> dict[str, Any]:
    """Single-device loss, gradients, and each microbatch's gradient contribution."""
    from parlib.model import ModelConfig

    m = world.args[0]
    h = reference_run(ModelConfig(**CFG_KW), steps=1, batch=BATCH, seed=SEED, microbatches=m,
                      record=("microbatch_grads",))
    return {"loss": h.losses[0], "grads": h.grads[0], "per_mb": h.microbatch_grads[0]}


def _learners(case: Case) -> tuple[int, ...]:
    return case.setting.args[1]


def _bad(case: Case, rank: int) -> list[str]:
    got, want = case.results[rank]["grads"], case.reference["grads"]
    return [n for n in got if not close(got[n], want[n])]


def _first_wrong(case: Case) -> tuple[int, None] | None:
    for rank, res in enumerate(case.results):
        if (rank in _learners(case) and res["missing"]) or _bad(case, rank):
            return rank, None
    return None


def _flat(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    got = case.report["grads"]
    return (torch.cat([got[n].flatten() for n in got]),
            torch.cat([case.reference["grads"][n].flatten() for n in got]))


def _scale(case: Case) -> float:
    g, w = _flat(case)
    return (g @ w / (w @ w)).item()


def _protocol(case: Case, problem: str) -> str:
    """A gradient's hint, and in a launch mixing the learner's stages with the reference's
    the message order they must share."""
    if len(_learners(case)) == case.world:
        return f"{problem}."
    return (f"{problem}. Your stage must follow the same message order as the reference: "
            f"forwards of microbatches 0, ..., m-1 (each output sent to rank + 1), then "
            f"backwards of m-1, ..., 0 (each input gradient sent to rank - 1).")


def _only_microbatch(case: Case) -> int | None:
    got = case.report["grads"]
    for i, part in enumerate(case.reference["per_mb"]):
        if all(close(got[n], part[n]) for n in got):
            return i
    return None


def _wrong_grad(case: Case) -> str:
    got, want, bad = case.report["grads"], case.reference["grads"], _bad(case, case.rank)
    err = (got[bad[0]] - want[bad[0]]).abs().max().item()
    return _protocol(case, (
        f"stage {case.rank}'s gradient of {bad[0]} differs from the single-device step "
        f"(max |difference| {err:.3g}, {len(bad)} of {len(got)} parameters wrong). Check "
        f"that each gradient you receive is applied to the microbatch it belongs to: the "
        f"backward goes m-1, ..., 0 on every stage, and the gradient you send is the .grad "
        f"of that microbatch's stage input"))


def _last_loss(case: Case) -> Any:
    return case.results[-1]["loss"]


def _loss_is_off(case: Case) -> bool:
    ref = case.reference["loss"]
    return abs(_last_loss(case) - ref) > 1e-4 * abs(ref)


def _loss_hint(case: Case) -> str:
    last, ref = _last_loss(case), case.reference["loss"]
    ratio = last / ref
    hint = (f" ({ratio:.3g} x the expected value: sum the microbatch losses after dividing "
            f"each by m)") if abs(ratio - round(ratio)) < 1e-3 else ""
    return f"the last stage returned loss {last:.6g}, the single-device loss is {ref:.6g}{hint}"


def _stray_loss(case: Case) -> int | None:
    """The first of the learner's stages but the last that returned something."""
    for rank in _learners(case):
        if rank != case.world - 1 and case.results[rank]["loss"] is not None:
            return rank
    return None


DIAGNOSES = (
    Diagnosis(
        "missing_grad",
        lambda c: c.rank in _learners(c) and bool(c.report["missing"]),
        lambda c: f"stage {c.rank} has no gradient for {c.report['missing'][0]}: did its "
        f"backward run?"),
    Diagnosis(
        "not_finite",
        lambda c: not torch.isfinite(_flat(c)[0]).all(),
        lambda c: _protocol(c, f"stage {c.rank} has NaN or inf gradients")),
    Diagnosis(
        "scaled_loss",
        lambda c: abs(_scale(c) - 1) > 1e-3 and off_by(_flat(c)[0], _flat(c)[1], _scale(c)),
        lambda c: _protocol(c, (
            f"the gradients on stage {c.rank} are {_scale(c):.4g} x the single-device ones "
            f"(on every parameter): divide each microbatch's loss by m = {c.setting.args[0]}, "
            f"the number of microbatches, so that the m backwards add up to the full-batch "
            f"mean"))),
    Diagnosis(
        "one_microbatch",
        lambda c: _only_microbatch(c) is not None,
        lambda c: _protocol(c, (
            f"stage {c.rank} holds only microbatch {_only_microbatch(c)}'s share of the "
            f"gradient: the backward of each microbatch must add into .grad (do not zero "
            f"the gradients or replace .grad between microbatches)"))),
    Diagnosis("wrong_grad", always, _wrong_grad),
    Diagnosis(
        "loss_not_a_number",
        lambda c: c.world - 1 in _learners(c) and not isinstance(_last_loss(c), (int, float)),
        lambda c: f"the last stage returned {_last_loss(c)!r}; return the full-batch loss as a "
        f"float (the sum of the m microbatch losses, each divided by m)",
        right=True),
    Diagnosis(
        "wrong_loss",
        lambda c: c.world - 1 in _learners(c) and _loss_is_off(c),
        _loss_hint, right=True),
    Diagnosis(
        "loss_on_another_stage",
        lambda c: _stray_loss(c) is not None,
        lambda c: f"stage {_stray_loss(c)} returned {c.results[_stray_loss(c)]['loss']!r}; only "
        f"the last stage returns the loss, the others None",
        right=True),
)

WORLDS = (  # p ranks; (m, the ranks running the learner's function); what the case tests
    World(2, (4, (0, 1)), "on 2 ranks, m = 4, batch 8"),
    World(4, (4, (0, 1, 2, 3)), "on 4 ranks, m = 4, batch 8"),
    World(4, (2, (1, 3)), "on 4 ranks with your function on ranks 1 and 3 and the reference "
                          "GPipe on ranks 0 and 2, m = 2, batch 8"),
    World(4, (2, (0, 2)), "on 4 ranks with your function on ranks 0 and 2 and the reference "
                          "GPipe on ranks 1 and 3, m = 2, batch 8"),
)

QUESTION = register(RankExercise(
    "04.gpipe",
    probe=_gpipe_rank,
    worlds=WORLDS,
    reference=_reference,
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    solution=GPIPE_SOLUTION,
    where="{world} ranks",
    backend=None,  # the ranks' own device type: the stage runs where the course runs
    timeout=30.0,
    prompt="""
        Write gpipe_step(stage, tokens, targets, m) -> float | None: one GPipe training
        step of this rank's stage, with dist.send / dist.recv between neighbouring ranks.
        Forwards of microbatches 0, ..., m-1 (each stage output sent to rank + 1), then
        backwards of m-1, ..., 0 (the gradient of each stage input sent to rank - 1); each
        microbatch's loss divided by m, gradients accumulated in .grad. The last stage
        returns the full-batch loss, the others None. Checked on 2 and 4 ranks against the
        single-device gradients (rtol 1e-4), and mixed with the reference on 4 ranks.
    """,
    explanation="""
        Cut the batch with `tokens.chunk(m)` and `targets.chunk(m)`. Keep, for each
        microbatch, the stage's input `x` and output `y`: the backward needs both.

        **Forwards**, i = 0, ..., m-1. The first stage feeds its tokens; the others
        `dist.recv` a buffer of `stage.activation_shape(b)` from rank - 1 and call
        `requires_grad_()` on it, so that autograd computes its gradient. Run `y = stage(x)`.
        The last stage turns y into `loss_fn(y, targets_i) / m`; the others
        `dist.send(y.detach(), rank + 1)`.

        **Backwards**, i = m-1, ..., 0 (the newest activations first; the order must match
        on both sides of every boundary, or a gradient lands on the wrong microbatch). The
        last stage calls `loss_i.backward()`; the others receive the gradient of y from
        rank + 1 and call `y.backward(grad)`. Then every stage but the first sends
        `x.grad` to rank - 1.

        Dividing by m makes the sum of the m microbatch gradients equal the gradient of
        the full-batch mean loss, and `.backward()` adds into `.grad`, so nothing else is
        needed. All sends of the forward phase go to rank + 1 and all of the backward
        phase to rank - 1, so blocking sends cannot deadlock here.
    """,
))
