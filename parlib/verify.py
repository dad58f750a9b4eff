"""Checking a parallel run against the single-device computation: one reference, one rule.

Every chapter proves its strategy computes what one device computes before timing it.
The ground truth is :func:`reference_step` (loss, logits and gradients of one step on the
full batch) or :func:`reference_params` (weights after k optimizer steps); the comparison
is :func:`compare` / :func:`close`, with one tolerance for the whole course:

    |got - want| <= ATOL + RTOL x |want|, elementwise, RTOL = 1e-4, ATOL = 1e-6 (fp32)

Why not exact equality: a parallel run adds the same numbers in another order (a ring
all-reduce sums partial gradients rank by rank, a split matmul sums partial products), and
fp32 addition is not associative. Those differences are around 1e-7 relative; a real bug
(a missing division by N, a gradient from the wrong microbatch) is orders larger.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from parlib.model import ModelConfig, build_model, loss_fn, make_batch, make_optimizer, train_step

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
        verdict = "equal to the single-device run" if self.ok else "DIFFERENT from it"
        return (f"{verdict} (largest |difference| {self.worst:.2e} in {self.where or '-'}; "
                f"tolerance {RTOL:g} relative + {ATOL:g})")


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


def reference_step(cfg: ModelConfig | None = None, *, seed: int = 0, batch_size: int = 8,
                   step: int = 0, device: Any = "cpu") -> dict[str, Any]:
    """The single-device step on the full batch: ``loss`` (float), ``logits`` and
    ``grads`` by parameter name (fp32, returned on the CPU). ``device``: where to compute
    it (the ranks' device type, so that both sides run the same kernels)."""
    cfg = cfg or ModelConfig()
    model = build_model(cfg, seed).to(device)
    tokens, targets = make_batch(batch_size, cfg, step, seed)
    logits = model(tokens.to(device))
    loss = loss_fn(logits, targets.to(device))
    loss.backward()
    return {"loss": loss.item(), "logits": logits.detach().cpu(),
            "grads": {n: prm.grad.detach().cpu().clone() for n, prm in model.named_parameters()}}


def reference_params(cfg: ModelConfig | None = None, *, steps: int = 3, global_batch: int = 8,
                     seed: int = 0, lr: float = 0.1, optimizer: str = "sgd",
                     device: Any = "cpu") -> list[torch.Tensor]:
    """Parameters after ``steps`` single-device steps on the full batches 0..steps-1 (the
    ground truth for a training run). Returned on the CPU, in ``model.parameters()`` order."""
    model = build_model(cfg, seed).to(device)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    for step in range(steps):
        x, y = make_batch(global_batch, cfg, step, seed)
        train_step(model, opt, x.to(device), y.to(device))
    return [p.detach().cpu().clone() for p in model.parameters()]


__all__ = ["ATOL", "RTOL", "Comparison", "close", "compare", "max_abs_diff", "reference_params",
           "reference_step"]
