"""The pipeline chapter's experiment on one rank: :func:`rank_step` runs
:func:`parlib.strategies.pipeline.run_schedule` with :class:`MeasuringHooks`, which record
a timeline of every op and message (:class:`parlib.measure.timeline.Recorder`), the bytes
sent, the peak saved-activation bytes (:class:`parlib.measure.memory.SavedActivations`)
and, optionally, pad compute to an *emulated* stage cost
(:class:`parlib.measure.emulation.StageCost`, a time per row of the microbatch plus a fixed
time per call) so that pipelining shows on a machine with fewer cores than ranks.

:func:`run_pipeline` validates a whole schedule (a name or a hand-written ``{rank: ops}``)
before it launches anything, then runs :func:`rank_step` on every rank. Under an emulated
cost an op of one of v chunks takes 1/v of the stage's time, and a split backward's B and
W take ``1 - weight_share`` and ``weight_share`` of the backward's (the cost of a per-layer
dgrad / wgrad split, not of the runner's autograd split, which redoes some work).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parlib.measure.crossings import trimmed_mean
from parlib.measure.emulation import PacedCost, StageCost
from parlib.measure.memory import SavedActivations
from parlib.measure.timeline import Recorder, align, makespan
from parlib.model import ModelConfig, make_batch
from parlib.runtime import launch
from parlib.runtime.policy import device as this_device
from parlib.strategies.pipeline import PipelineHooks, build_chunks, build_stage, run_schedule
from parlib.strategies.schedule_check import validate
from parlib.strategies.schedules import BACKWARD, FORWARD, WEIGHT, Op, all_ranks, chunks_of


@dataclass(frozen=True)
class _ScaledCost:
    """A :class:`StageCost` whose durations are ``factor`` times the stage's (a chunk's
    1/v, a split backward's B or W share)."""

    base: StageCost
    factor: float

    def start(self, kind: str, rows: int, stage: int = 0) -> float:
        return self.base.start(kind, rows, stage)

    def pad(self, kind: str, started: float, rows: int, stage: int = 0,
            excluded: float = 0.0) -> float:
        due = self.base.duration(kind, rows, stage) * self.factor
        left = due - (time.perf_counter() - started - excluded)
        if left > 0:
            time.sleep(left)
        return left


class MeasuringHooks(PipelineHooks):
    """Hooks for :func:`run_schedule` that record into ``recorder`` (a span per op and per
    message, bytes by peer), track saved activations of every forward in ``memory`` and
    pad every forward, backward and W to ``cost`` (communication recorded inside the op,
    the tensor-parallel all-reduces of the combining chapter, is not counted as compute).
    With ``v`` chunks per rank each op costs 1/v of the stage's; with ``split`` (the
    schedule has W ops) B costs ``1 - weight_share`` of the backward and W the rest."""

    def __init__(self, stage: int, recorder: Recorder | None = None,
                 cost: StageCost | PacedCost | None = None,
                 memory: SavedActivations | None = None, *, v: int = 1,
                 split: bool = False, weight_share: float = 0.5) -> None:
        self.stage, self.recorder, self.cost, self.memory = stage, recorder, cost, memory
        if not 0 <= weight_share <= 1:
            raise ValueError(f"weight_share is W's part of a backward: 0..1, got {weight_share}")
        if (v != 1 or split) and cost is not None and not isinstance(cost, StageCost):
            raise ValueError("chunks and split backwards are emulated with a StageCost only")
        self.v, self.split, self.weight_share = v, split, weight_share

    def _span(self, kind: str, mb: int, chunk: int = 0) -> Any:
        return (self.recorder.span(kind, mb, chunk) if self.recorder is not None
                else nullcontext())

    def _cost_of(self, kind: str) -> tuple[str, StageCost | PacedCost | _ScaledCost | None]:
        """The kind the emulated cost times and the cost that times it for an op."""
        cost = self.cost
        factor = 1.0 / self.v
        if kind == WEIGHT:
            kind, factor = BACKWARD, factor * self.weight_share
        elif kind == BACKWARD and self.split:
            factor *= 1 - self.weight_share
        if cost is None or factor == 1.0:
            return kind, cost
        assert isinstance(cost, StageCost)  # __init__ refused the others
        return kind, _ScaledCost(cost, factor)

    def compute_op(self, op: Op, rows: int) -> Any:
        return self._compute(op.kind, op.mb, rows, op.chunk)

    def compute(self, kind: str, mb: int, rows: int) -> Any:
        return self._compute(kind, mb, rows, 0)

    @contextmanager
    def _compute(self, kind: str, mb: int, rows: int, chunk: int) -> Iterator[None]:
        with self._span(kind, mb, chunk):
            cost_kind, cost = self._cost_of(kind)
            t0 = (cost.start(cost_kind, rows, self.stage) if cost is not None
                  else time.perf_counter())
            track = self.memory if kind == FORWARD and self.memory is not None else None
            with track if track is not None else nullcontext():
                yield
            if cost is not None:
                nested = self.recorder.seconds_since(t0) if self.recorder is not None else 0.0
                cost.pad(cost_kind, t0, rows, self.stage, nested)

    @contextmanager
    def message(self, kind: str, peer: int, tensor: torch.Tensor, mb: int) -> Iterator[None]:
        with self._span(kind, mb):
            yield
        if self.recorder is not None:
            nbytes = tensor.numel() * tensor.element_size()
            self.recorder.count(peer, nbytes, sent=kind == "send")


def emulated_overrun(cost: StageCost, rows: int, repeats: int = 20) -> float:
    """Seconds an emulated op takes beyond its due time, as the runner times it: the
    trimmed mean (:func:`parlib.measure.crossings.trimmed_mean`) over ``repeats`` forwards
    of ``rows`` rows padded by :class:`MeasuringHooks` around no compute at all. The sleep
    wakes a little late and the hooks record a span; every op of a run pays it (measured
    here: 0.2-0.3 ms on a 12 ms op)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    hooks = MeasuringHooks(0, Recorder(0), cost)
    due = cost.duration(FORWARD, rows)
    over = []
    for _ in range(repeats + 1):  # one warm-up
        t0 = time.perf_counter()
        with hooks.compute(FORWARD, 0, rows):
            pass
        over.append(time.perf_counter() - t0 - due)
    return max(trimmed_mean(over[1:]), 0.0)


Schedule = Mapping[int, Sequence[Op]]


def _resolve(schedule_name: str, schedule: Schedule | None, p: int, m: int,
             v: int | None) -> tuple[dict[int, list[Op]], int]:
    """The whole schedule (every rank's ops) and its chunks per rank, validated. ``v``
    (None: 2 for the interleaved schedule, 1 for a hand-written one) is chunks per rank."""
    if schedule is None:
        vv = chunks_of(schedule_name, 2 if v is None else v)
        sched = all_ranks(schedule_name, p, m, vv)
    else:
        sched = {r: list(ops) for r, ops in schedule.items()}
        vv = 1 if v is None else v
    validate(sched, p, m, vv)
    return sched, vv


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
    v: int | None = None,
    schedule: Schedule | None = None,
    weight_share: float = 0.5,
) -> dict[str, Any]:
    """Run on every rank of ``parlib.launch``: build this rank's stage (its v chunks for
    an interleaved schedule) and run ``warmup`` + ``repeats`` steps of ``schedule_name``
    on batch 0 (gradients zeroed before each).

    ``schedule``: a whole hand-written schedule ``{rank: ops}`` instead of a name, with
    ``v`` chunks per rank (default 1; for a name, ``v`` is the interleaved schedule's chunks
    per rank, default 2, and unused by the others). Every
    rank validates the whole schedule before its first message (:func:`run_pipeline` does
    it once before launching). ``weight_share``: W's part of an emulated backward.

    Returns ``rank``, ``loss`` (last stage), ``grads`` (last step, by full-model name),
    ``spans`` (one list per repeat; forward, backward and weight spans carry their chunk),
    ``sent`` / ``received`` (bytes per step by peer), ``peak_saved`` (bytes, last step; 0
    unless ``memory``), ``ops`` (this rank's op list).
    """
    cfg = cfg or ModelConfig()
    rank, p = dist.get_rank(), dist.get_world_size()
    sched, vv = _resolve(schedule_name, schedule, p, m, v)
    ops = sched[rank]
    split = any(op.kind == WEIGHT for op in ops)
    dev = this_device()
    stage = (build_chunks(cfg, seed, rank, p, vv, dev) if vv > 1
             else build_stage(cfg, seed, rank, p, dev))
    tokens, targets = make_batch(batch_size, cfg, 0, seed)
    out: dict[str, Any] = {"rank": rank, "spans": [], "device": str(dev),
                           "backend": dist.get_backend(), "ops": ops}
    for it in range(warmup + repeats):
        stage.zero_grad(set_to_none=True)
        rec = Recorder(rank, dev)
        tracker = SavedActivations(stage) if memory else None
        dist.barrier()
        hooks = MeasuringHooks(rank, rec, cost, tracker, v=vv, split=split,
                               weight_share=weight_share)
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


def run_pipeline(
    cfg: ModelConfig | None,
    schedule: str | Schedule,
    p: int,
    m: int,
    *,
    v: int | None = None,
    timeout: float = 60.0,
    **step: Any,
) -> list[dict[str, Any]]:
    """Validate ``schedule`` (a name of :data:`~parlib.strategies.schedules.SCHEDULES` or a
    whole ``{rank: ops}``) for p ranks and m microbatches, raising
    :class:`~parlib.strategies.schedule_check.ScheduleError` before any rank starts, then
    run :func:`rank_step` on p ranks (``step``: its other arguments) and return the
    results by rank. ``v``: chunks per rank of the interleaved schedule (default 2) or of
    a hand-written one (default 1)."""
    if isinstance(schedule, str):
        _, vv = _resolve(schedule, None, p, m, v)
        return launch(rank_step, cfg, schedule_name=schedule, m=m, v=vv, world_size=p,
                      timeout=timeout, **step)
    sched, vv = _resolve("", schedule, p, m, v)
    return launch(rank_step, cfg, schedule=sched, m=m, v=vv, world_size=p, timeout=timeout,
                  **step)


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


__all__ = ["MeasuringHooks", "emulated_overrun", "gather_grads", "median_run", "rank_step",
           "run_pipeline"]
