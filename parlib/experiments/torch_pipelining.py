"""The pipeline chapter's stages under ``torch.distributed.pipelining``'s own schedules
(ScheduleGPipe, Schedule1F1B), padded to the same emulated cost as our runs, to race them.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.measure.emulation import StageCost
from parlib.model import ModelConfig, loss_fn, make_batch
from parlib.runtime.policy import device as this_device
from parlib.strategies.pipeline import Stage, build_stage
from parlib.strategies.schedules import BACKWARD, FORWARD


class _BackwardEnd(torch.autograd.Function):
    """Identity; its backward runs last in a stage's backward and pads it to the cost of
    the microbatch's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
        ctx.state, ctx.rows = state, x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        state = ctx.state
        state["cost"].pad(BACKWARD, state["t0"], ctx.rows, state["stage"])
        return grad, None


class _BackwardStart(torch.autograd.Function):
    """Identity; its backward runs first in a stage's backward and starts the clock."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, state: dict) -> torch.Tensor:
        ctx.state, ctx.rows = state, y.shape[0]
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        state = ctx.state
        state["t0"] = state["cost"].start(BACKWARD, ctx.rows, state["stage"])
        return grad, None


class CostPadded(nn.Module):
    """A :class:`Stage` whose forward and backward are padded to a :class:`StageCost`,
    for running it inside a schedule we do not control (torch.distributed.pipelining).
    The embedding's backward on the first stage is left out of the padding (it is tiny).
    Each microbatch is padded to the cost of its own rows (the schedule cuts the batch)."""

    def __init__(self, stage: Stage, cost: StageCost) -> None:
        super().__init__()
        self.stage = stage
        self._state = {"cost": cost, "t0": 0.0, "stage": stage.rank}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        st = self.stage
        t0 = self._state["cost"].start(FORWARD, rows, st.rank)
        if st.embed is not None:
            x = st.embed(x)
        x = _BackwardEnd.apply(x, self._state)
        for block in st.blocks:
            x = block(x)
        if st.head is not None:
            x = st.head(x)
        self._state["cost"].pad(FORWARD, t0, rows, st.rank)
        return _BackwardStart.apply(x, self._state)


def rank_torch_pipelining(
    cfg: ModelConfig | None = None,
    *,
    schedule_name: str = "gpipe",
    m: int = 4,
    batch_size: int = 8,
    seed: int = 0,
    cost: StageCost | None = None,
    repeats: int = 3,
    warmup: int = 1,
) -> dict[str, Any]:
    """Run on every rank: the same stages under ``torch.distributed.pipelining``'s
    ScheduleGPipe or Schedule1F1B. Returns ``loss`` (last stage, mean of the microbatch
    losses), ``grads`` (last step), ``times`` (s, each repeat, this rank, barrier to end)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    cfg = cfg or ModelConfig()
    rank, p = dist.get_rank(), dist.get_world_size()
    dev = this_device()
    stage = build_stage(cfg, seed, rank, p, dev)
    module = CostPadded(stage, cost) if cost is not None else stage
    pipe_stage = PipelineStage(module, rank, p, dev)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    sched = kind(pipe_stage, n_microbatches=m, loss_fn=loss_fn)
    tokens, targets = make_batch(batch_size, cfg, 0, seed)
    tokens, targets = tokens.to(dev), targets.to(dev)
    times, loss = [], None
    for it in range(warmup + repeats):
        stage.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        dist.barrier()
        t0 = time.perf_counter()
        if stage.is_first:
            sched.step(tokens)
        elif stage.is_last:
            sched.step(target=targets, losses=losses)
        else:
            sched.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if it >= warmup:
            times.append(time.perf_counter() - t0)
        if losses:
            loss = torch.stack([x.detach() for x in losses]).mean().item()
    dist.barrier()
    return {"rank": rank, "loss": loss, "grads": stage.grads(), "times": times}


__all__ = ["CostPadded", "rank_torch_pipelining"]
