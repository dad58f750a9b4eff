"""What the tensor-parallel chapter's rank exercises share: a small model (seconds per check),
rank-dependent probe values, a training record of the tensor-parallel copy, the single-device
reference it is compared with, and where the two first part."""

from __future__ import annotations

from typing import Any

import torch

from parlib.verify import close, reference_run

# 4 heads, so t = 2 and 4 both divide them.
CFG_KW = dict(seq_len=16, d_model=32, n_heads=4, n_layers=2)
BATCH = 4
STEPS = 3
LR = 0.1
SEED = 1
WORLDS = (2, 4)


def cfg():
    from parlib.model import ModelConfig

    return ModelConfig(**CFG_KW)


def rank_values(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """A tensor that differs from rank to rank: every element is scale x (rank + 1)."""
    import torch.distributed as dist

    return torch.full(shape, scale * (dist.get_rank() + 1))


def train_record(model: Any, steps: int) -> dict[str, Any]:
    """The tensor-parallel side: SGD on batches 0..steps-1 of the reference run, recording
    logits, losses and gradients by name at every step."""
    from parlib.model import loss_fn, make_batch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"logits": [], "loss": [], "grads": []}
    for step in range(steps):
        x, y = make_batch(BATCH, cfg(), step, SEED)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        out["logits"].append(logits.detach().clone())
        out["loss"].append(loss.item())
        out["grads"].append({n: None if p.grad is None else p.grad.detach().clone()
                             for n, p in model.named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def reference_record(steps: int) -> dict[str, Any]:
    """The single-device side, :func:`parlib.verify.reference_run`, in ``train_record``'s
    form."""
    h = reference_run(cfg(), steps=steps, batch=BATCH, lr=LR, seed=SEED, record=("logits",))
    return {"logits": h.logits, "loss": h.losses, "grads": h.grads, "params": h.params}


def first_mismatch(got: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """Where a TP run first departs from the single-device one, as a sentence (``ref``'s
    gradients and parameters already cut to this rank's pieces); None if it never does."""
    for step in range(len(ref["loss"])):
        if not close(got["logits"][step], ref["logits"][step]):
            return f"at step {step} the logits differ from single-device training"
        wrong = [n for n, gr in got["grads"][step].items()
                 if gr is None or not close(gr, ref["grads"][step][n])]
        if wrong:
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            return (f"at step {step} the logits are right but the gradient of "
                    f"{wrong[0]}{more} differs from single-device training")
    wrong = [n for n, p in got["params"].items() if not close(p, ref["params"][n])]
    if wrong:
        return f"after {STEPS} steps the parameter {wrong[0]} differs from single-device"
    return None
