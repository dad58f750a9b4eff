"""Checking a parallel run against the single-device computation: one reference, one rule.

Every chapter proves its strategy computes what one device computes before timing it.
The ground truth is :func:`reference_run` (losses, gradients and weights of k steps on the
full batch; :func:`reference_step` and :func:`reference_params` are its two common
views); the comparison
is :func:`compare` / :func:`close`, with one tolerance for the whole course:

    |got - want| <= ATOL + RTOL x |want|, elementwise, RTOL = 1e-4, ATOL = 1e-6 (fp32)

Why not exact equality: a parallel run adds the same numbers in another order (a ring
all-reduce sums partial gradients rank by rank, a split matmul sums partial products), and
fp32 addition is not associative. Those differences are around 1e-7 relative; a real bug
(a missing division by N, a gradient from the wrong microbatch) is orders larger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from parlib.model import (
    IGNORE_INDEX,
    ModelConfig,
    build_model,
    loss_fn,
    loss_share,
    make_batch,
    make_optimizer,
)

RTOL = 1e-4
ATOL = 1e-6


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape and elementwise within the course tolerance (compared in fp32 on the CPU)."""
    got = torch.as_tensor(got).detach().cpu().float()
    want = torch.as_tensor(want).detach().cpu().float()
    return got.shape == want.shape and torch.allclose(got, want, rtol=RTOL, atol=ATOL)


@dataclass(frozen=True)
class Comparison:
    """``ok`` when every tensor is :func:`close`; ``worst`` is the largest |got - want| and
    ``where`` the name (or index) of the tensor it is in; ``mismatched`` lists the names
    that are not close."""

    ok: bool
    worst: float
    where: str
    mismatched: tuple[str, ...]

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        # Short enough to follow a label on one printed line (a notebook's output area breaks
        # long lines mid-word); the tolerance, the course's one, is named only when it failed.
        where = f"largest |diff| {self.worst:.2e}, in {self.where or '-'}"
        if self.ok:
            return f"equal to the single-device run ({where})"
        return f"DIFFERENT from it ({where}; tolerance {RTOL:.0e} + {ATOL:.0e})"


def _named(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> dict[str, Any]:
    if isinstance(tensors, Mapping):
        return dict(tensors)
    return {str(i): t for i, t in enumerate(tensors)}


def compare(got: Mapping[str, torch.Tensor] | Iterable[torch.Tensor],
            want: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> Comparison:
    """Compare tensors by name (dicts: every name in ``got`` must be in ``want``) or by
    position (lists of equal length)."""
    g, w = _named(got), _named(want)
    if not isinstance(got, Mapping) and len(g) != len(w):
        raise ValueError(f"{len(g)} tensors to compare with {len(w)}")
    missing = sorted(set(g) - set(w))
    if missing:
        raise KeyError(f"no reference tensor named {', '.join(missing)}")
    worst, where, bad, misshapen = 0.0, "", [], []
    for name, t in g.items():
        a = torch.as_tensor(t).detach().cpu().float()
        b = torch.as_tensor(w[name]).detach().cpu().float()
        if a.shape != b.shape:
            misshapen.append(f"{name} (shape {tuple(a.shape)} vs {tuple(b.shape)})")
            bad.append(name)
            continue
        err = (a - b).abs().max().item() if a.numel() else 0.0
        if err >= worst:
            worst, where = err, name
        if not close(a, b):
            bad.append(name)
    if misshapen:
        worst, where = float("inf"), misshapen[0]
    return Comparison(not bad, worst, where, tuple(bad))


def max_abs_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """Largest elementwise |a - b| over two lists of tensors of equal length."""
    return compare(list(a), list(b)).worst


@dataclass
class History:
    """What one single-device training run did, step by step (tensors on the CPU, fp32).

    ``losses[k]`` and ``grads[k]`` (by parameter name) are step k's loss and the gradient it
    applied; ``params`` are the weights after the last step. Recorded only when asked for:
    ``logits[k]``, ``params_per_step[k]`` (weights after step k) and
    ``microbatch_grads[k][i]`` (the gradient of microbatch i's share, loss / m)."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    logits: list[torch.Tensor] = field(default_factory=list)
    params_per_step: list[dict[str, torch.Tensor]] = field(default_factory=list)
    microbatch_grads: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)


RECORDABLE = ("logits", "params_per_step", "microbatch_grads")


def _cpu(named: Iterable[tuple[str, torch.Tensor]], grad: bool = False) -> dict[str, Any]:
    out = {}
    for n, p in named:
        t = p.grad if grad else p
        out[n] = None if t is None else t.detach().cpu().clone()
    return out


def reference_run(cfg: ModelConfig | None = None, *, steps: int = 1, batch: int = 8,
                  optimizer: str | Callable[[Iterable[torch.Tensor]], Any] = "sgd",
                  lr: float = 0.1, seed: int = 0, microbatches: int = 1,
                  model: torch.nn.Module | None = None, device: Any = "cpu",
                  record: Iterable[str] = ()) -> History:
    """The course's one single-device run: ``build_model(cfg, seed)`` (or ``model``) trained
    ``steps`` steps on the full batches 0..steps-1 of ``make_batch(batch, cfg, step, seed)``.

    ``optimizer``: "sgd" or "adam" (:func:`parlib.model.make_optimizer` with ``lr``), or a
    function of the parameters that builds one (``lambda ps: torch.optim.SGD(ps, lr=0.1,
    momentum=0.9)``). ``microbatches=m`` accumulates m equal slices of each batch, each
    slice's loss summed over its tokens / the batch's tokens (:func:`parlib.model.loss_share`:
    the same gradient as the whole batch, summed in another order).
    ``device``: where to compute (the ranks' device type, so both sides run the same
    kernels). ``record``: any of ``"logits"``, ``"params_per_step"``, ``"microbatch_grads"``."""
    extra = set(record)
    unknown = extra - set(RECORDABLE)
    if unknown:
        raise ValueError(f"cannot record {sorted(unknown)}; choose from {', '.join(RECORDABLE)}")
    if microbatches < 1 or batch % microbatches:
        raise ValueError(f"microbatches={microbatches} must divide the batch of {batch}")
    cfg = cfg or ModelConfig()
    net = (model if model is not None else build_model(cfg, seed)).to(device)
    opt = (make_optimizer(net.parameters(), optimizer, lr) if isinstance(optimizer, str)
           else optimizer(net.parameters()))
    hist = History([], [], {})
    for step in range(steps):
        tokens, targets = make_batch(batch, cfg, step, seed)
        tokens, targets = tokens.to(device), targets.to(device)
        opt.zero_grad(set_to_none=True)
        logits, loss, pieces = [], 0.0, []
        for x, y in zip(tokens.chunk(microbatches), targets.chunk(microbatches)):
            before = _cpu(net.named_parameters(), grad=True) if microbatches > 1 else {}
            out = net(x)
            part = (loss_fn(out, y) if microbatches == 1  # else its share of the batch's
                    else loss_share(out, y, (targets != IGNORE_INDEX).sum()))
            part.backward()
            logits.append(out.detach())
            loss += part.item()
            if "microbatch_grads" in extra:
                now = _cpu(net.named_parameters(), grad=True)
                pieces.append({n: g if before.get(n) is None else g - before[n]
                               for n, g in now.items()})
        hist.losses.append(loss if microbatches > 1 else part.item())
        hist.grads.append(_cpu(net.named_parameters(), grad=True))
        if "logits" in extra:
            hist.logits.append(torch.cat(logits).cpu())
        if "microbatch_grads" in extra:
            hist.microbatch_grads.append(pieces)
        opt.step()
        if "params_per_step" in extra:
            hist.params_per_step.append(_cpu(net.named_parameters()))
    hist.params = _cpu(net.named_parameters())
    return hist


def reference_step(cfg: ModelConfig | None = None, *, seed: int = 0, batch_size: int = 8,
                   device: Any = "cpu") -> dict[str, Any]:
    """The first step of :func:`reference_run`: ``loss`` (float), ``logits`` and ``grads``
    by parameter name (fp32, on the CPU)."""
    h = reference_run(cfg, steps=1, batch=batch_size, seed=seed, device=device,
                      record=("logits",))
    return {"loss": h.losses[0], "logits": h.logits[0], "grads": h.grads[0]}


def reference_params(cfg: ModelConfig | None = None, *, steps: int = 3, global_batch: int = 8,
                     seed: int = 0, lr: float = 0.1, optimizer: str = "sgd",
                     device: Any = "cpu") -> list[torch.Tensor]:
    """Parameters after ``steps`` steps of :func:`reference_run`, in ``model.parameters()``
    order (the ground truth for a training run)."""
    h = reference_run(cfg, steps=steps, batch=global_batch, seed=seed, lr=lr,
                      optimizer=optimizer, device=device)
    return list(h.params.values())


__all__ = ["ATOL", "RTOL", "Comparison", "History", "close", "compare", "max_abs_diff",
           "reference_params", "reference_run", "reference_step"]
