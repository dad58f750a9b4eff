"""The pipeline chapter's experiment on one rank: :func:`rank_step` runs
:func:`parlib.strategies.pipeline.run_schedule` with :class:`MeasuringHooks`, which record
a timeline of every op and message (:class:`parlib.measure.timeline.Recorder`), the bytes
sent, the peak saved-activation bytes (:class:`parlib.measure.memory.SavedActivations`)
and, optionally, pad compute to an *emulated* stage cost
(:class:`parlib.measure.emulation.StageCost`, a time per row of the microbatch plus a fixed
time per call) so that pipelining shows on a machine with fewer cores than ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from parlib.measure.emulation import PacedCost, StageCost
from parlib.measure.memory import SavedActivations
from parlib.measure.timeline import Recorder, align, makespan
from parlib.model import ModelConfig, make_batch
from parlib.runtime.policy import device as this_device
from parlib.strategies.pipeline import PipelineHooks, build_stage, run_schedule
from parlib.strategies.schedules import FORWARD, schedule


class MeasuringHooks(PipelineHooks):
    """Hooks for :func:`run_schedule` that record into ``recorder`` (a span per op and per
    message, bytes by peer), track saved activations of every forward in ``memory`` and
    pad every forward and backward to ``cost`` (communication recorded inside the op, the
    tensor-parallel all-reduces of the combining chapter, is not counted as compute)."""

    def __init__(self, stage: int, recorder: Recorder | None = None,
                 cost: StageCost | PacedCost | None = None,
                 memory: SavedActivations | None = None) -> None:
        self.stage, self.recorder, self.cost, self.memory = stage, recorder, cost, memory

    def _span(self, kind: str, mb: int) -> Any:
        return self.recorder.span(kind, mb) if self.recorder is not None else nullcontext()

    @contextmanager
    def compute(self, kind: str, mb: int, rows: int) -> Iterator[None]:
        with self._span(kind, mb):
            cost = self.cost
            t0 = cost.start(kind, rows, self.stage) if cost is not None else time.perf_counter()
            track = self.memory if kind == FORWARD and self.memory is not None else None
            with track if track is not None else nullcontext():
                yield
            if cost is not None:
                nested = self.recorder.seconds_since(t0) if self.recorder is not None else 0.0
                cost.pad(kind, t0, rows, self.stage, nested)

    @contextmanager
    def message(self, kind: str, peer: int, tensor: torch.Tensor, mb: int) -> Iterator[None]:
        with self._span(kind, mb):
            yield
        if self.recorder is not None:
            nbytes = tensor.numel() * tensor.element_size()
            self.recorder.count(peer, nbytes, sent=kind == "send")


def rank_step(
    cfg: ModelConfig | None = None,
    *,
    schedule_name: str = "gpipe",
    m: int = 1,
    batch_size: int = 8,
    seed: int = 0,
    cost: StageCost | None = None,
    repeats: int = 1,
    warmup: int = 1,
    memory: bool = False,
) -> dict[str, Any]:
    """Run on every rank of ``parlib.launch``: build this rank's stage and run ``warmup``
    + ``repeats`` steps of ``schedule_name`` on batch 0 (gradients zeroed before each).

    Returns ``rank``, ``loss`` (last stage), ``grads`` (last step, by full-model name),
    ``spans`` (one list per repeat), ``sent`` / ``received`` (bytes per step by peer),
    ``peak_saved`` (bytes, last step; 0 unless ``memory``).
    """
    cfg = cfg or ModelConfig()
    rank, p = dist.get_rank(), dist.get_world_size()
    dev = this_device()
    stage = build_stage(cfg, seed, rank, p, dev)
    tokens, targets = make_batch(batch_size, cfg, 0, seed)
    ops = schedule(schedule_name, p, m, rank)
    out: dict[str, Any] = {"rank": rank, "spans": [], "device": str(dev),
                           "backend": dist.get_backend()}
    for it in range(warmup + repeats):
        stage.zero_grad(set_to_none=True)
        rec = Recorder(rank, dev)
        tracker = SavedActivations(stage) if memory else None
        dist.barrier()
        hooks = MeasuringHooks(stage.rank, rec, cost, tracker)
        loss = run_schedule(stage, ops, tokens, targets, m, hooks=hooks)
        if it >= warmup:
            out["spans"].append(rec.spans)
    out["loss"] = loss
    out["grads"] = stage.grads()
    out["sent"] = dict(rec.sent)
    out["received"] = dict(rec.received)
    out["peak_saved"] = tracker.peak if tracker is not None else 0
    dist.barrier()
    return out


def gather_grads(results: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Merge the per-rank ``grads`` dicts of :func:`rank_step` results into one."""
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["grads"])
    return merged


def median_run(results: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """The repeat with the median step time, as spans per rank (aligned to start at 0)."""
    repeats = len(results[0]["spans"])
    runs = [align([r["spans"][k] for r in results]) for k in range(repeats)]
    runs.sort(key=makespan)
    return runs[len(runs) // 2]


__all__ = ["MeasuringHooks", "gather_grads", "median_run", "rank_step"]
