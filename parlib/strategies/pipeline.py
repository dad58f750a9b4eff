"""Pipeline parallelism with plain torch.distributed point-to-point messages.

The shared model (``embed -> blocks -> head``) is cut into p stages of consecutive
layers; stage i runs on the i-th rank of a pipeline process group. A stage receives
activations from the previous stage, sends its output to the next, and on the way back
receives gradients from the next and sends the gradient of its input to the previous.
The neighbours are global ranks carried by the stage (``stage.prev_rank`` /
``stage.next_rank``, from :func:`pipeline_peers` of the group it was built for).

* :func:`build_stage` / :class:`Stage` -- this rank's slice of the model.
* :func:`run_schedule` -- run one training step for this rank from a list of
  :class:`parlib.strategies.schedules.Op` (GPipe, 1F1B, ...), recording a timeline, the
  bytes sent and the peak saved-activation bytes; an optional *emulated* stage cost
  (:class:`parlib.measure.emulation.StageCost`, a time per row of the microbatch plus a
  fixed time per call) pads compute so that pipelining shows on a machine with fewer
  cores than ranks.
* :func:`rank_step` -- the whole experiment on one rank, for ``parlib.launch``.

Messages: sends use ``dist.isend`` (waited for at the end of the step) and receives a
blocking ``dist.recv``, in the order the schedule gives. With a blocking ``dist.send``
1F1B can deadlock: a rank sending its next activation and its neighbour sending a
gradient back both wait for a recv that comes after the other's send (gloo blocks on
large messages: measured with 16 MB both ways here).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.measure.emulation import StageCost
from parlib.measure.memory import SavedActivations
from parlib.measure.timeline import Recorder
from parlib.model import ModelConfig, TinyGPT, build_model, loss_fn, make_batch
from parlib.runtime.policy import device as this_device
from parlib.strategies.schedules import BACKWARD, FORWARD, Op, schedule

# --------------------------------------------------------------------------- stages


def partition(n_layers: int, p: int) -> list[range]:
    """Block indices of each of p stages: consecutive, sizes differing by at most one
    (earlier stages get the extra blocks)."""
    if p < 1 or p > n_layers:
        raise ValueError(f"cannot cut {n_layers} blocks into p={p} stages (need 1 <= p <= L)")
    base, extra = divmod(n_layers, p)
    out, start = [], 0
    for r in range(p):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class Stage(nn.Module):
    """Rank ``rank``'s consecutive slice of a :class:`TinyGPT`: the embedding on the first
    stage, its blocks, the head on the last. ``stage(x)`` runs them in order (tokens in on
    the first stage, hidden states in otherwise; logits out on the last)."""

    def __init__(self, model: TinyGPT, rank: int, p: int, prev_rank: int | None = None,
                 next_rank: int | None = None) -> None:
        super().__init__()
        if not 0 <= rank < p:
            raise ValueError(f"rank must be in [0, {p}), got {rank}")
        self.cfg: ModelConfig = model.cfg
        self.rank, self.p = rank, p  # the stage's index in its pipeline, and the pipeline's length
        # Global ranks of the neighbouring stages (None at the ends): in a pipeline group of
        # a larger mesh they are not rank - 1 and rank + 1.
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.layer_ids = partition(model.cfg.n_layers, p)[rank]
        self.embed = model.embed if rank == 0 else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in self.layer_ids)
        self.head = model.head if rank == p - 1 else None
        self._global = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                self._global[name] = f"blocks.{self.layer_ids[int(i)]}.{rest}"
            else:
                self._global[name] = name

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.p - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def activation_shape(self, batch: int) -> tuple[int, int, int]:
        """Shape of the hidden states crossing a stage boundary for ``batch`` rows: (b, s, h)."""
        return (batch, self.cfg.seq_len, self.cfg.d_model)

    def grads(self) -> dict[str, torch.Tensor]:
        """This stage's gradients by full-model name (CPU copies; zeros where None)."""
        return {self._global[n]: (prm.grad if prm.grad is not None else torch.zeros_like(prm))
                .detach().cpu().clone() for n, prm in self.named_parameters()}


def pipeline_peers(group: Any = None) -> tuple[int | None, int | None]:
    """Global ranks of the previous and next stage of this rank's pipeline ``group`` (the
    default group when None); None at the ends. Stage i of the group is its i-th rank."""
    group = group or dist.group.WORLD
    i, p = dist.get_rank(group), dist.get_world_size(group)
    prev_rank = dist.get_global_rank(group, i - 1) if i > 0 else None
    next_rank = dist.get_global_rank(group, i + 1) if i < p - 1 else None
    return prev_rank, next_rank


def build_stage(cfg: ModelConfig | None = None, seed: int = 0, rank: int | None = None,
                p: int | None = None, device: Any = None, group: Any = None) -> Stage:
    """Stage ``rank`` of ``p`` of ``build_model(cfg, seed)``, moved to ``device``.

    Inside a process group, ``rank`` and ``p`` default to this rank's index in the pipeline
    ``group`` (the default group when None) and its size, and the stage's neighbours are
    that group's adjacent ranks. Every rank builds the whole small model and keeps its
    slice; a model that does not fit on one device would build only its own layers."""
    peers: tuple[int | None, int | None] = (None, None)
    if dist.is_available() and dist.is_initialized():
        pipe = group or dist.group.WORLD
        mine, size = dist.get_rank(pipe), dist.get_world_size(pipe)
        rank = mine if rank is None else rank
        p = size if p is None else p
        if (rank, p) == (mine, size):
            peers = pipeline_peers(group)
    stage = Stage(build_model(cfg, seed), rank or 0, p or 1, *peers)
    return stage.to(device) if device is not None else stage


def microbatches(tensor: torch.Tensor, m: int) -> list[torch.Tensor]:
    """Cut a batch into m equal microbatches along dim 0."""
    if m < 1 or tensor.shape[0] % m:
        raise ValueError(f"batch of {tensor.shape[0]} rows does not split into m={m} "
                         f"equal microbatches")
    return list(tensor.chunk(m))


# --------------------------------------------------------------------------- one step


def run_schedule(
    stage: Stage,
    ops: Sequence[Op],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    m: int,
    *,
    recorder: Recorder | None = None,
    cost: StageCost | None = None,
    memory: SavedActivations | None = None,
) -> float | None:
    """One training step of this rank's stage, running ``ops`` in order.

    ``tokens`` / ``targets`` are the full batch (every rank may pass them; only the first
    stage reads tokens and only the last reads targets). Each microbatch's loss is divided
    by m, so the accumulated gradients equal the full-batch gradients. Gradients are
    accumulated into ``.grad`` (zero them before the step). Returns the full-batch loss on
    the last stage, None elsewhere.
    """
    if any(op.chunk for op in ops):
        raise ValueError("run_schedule runs one chunk per rank; interleaved ops are drawn, "
                         "not run")
    device = next(stage.parameters()).device
    xs = microbatches(tokens, m)
    ys = microbatches(targets, m)
    shape = stage.activation_shape(xs[0].shape[0])
    rec = recorder
    mem = memory if memory is not None else nullcontext()
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    pending: list[tuple[Any, torch.Tensor]] = []
    loss_total = 0.0

    def span(kind: str, mb: int) -> Any:
        return rec.span(kind, mb) if rec is not None else nullcontext()

    def nested(since: float) -> float:  # communication recorded inside a compute span
        return rec.seconds_since(since) if rec is not None else 0.0

    def begin(kind: str, rows: int) -> float:  # a forward or backward starts now
        return cost.start(kind, rows, stage.rank) if cost is not None else time.perf_counter()

    def send(t: torch.Tensor, dst: int, mb: int) -> None:
        t = t.detach().contiguous()
        with span("send", mb):
            pending.append((dist.isend(t, dst), t))
        if rec is not None:
            rec.count(dst, t.numel() * t.element_size(), sent=True)

    def recv(src: int, mb: int) -> torch.Tensor:
        buf = torch.empty(shape, device=device)
        with span("recv", mb):
            dist.recv(buf, src)
        if rec is not None:
            rec.count(src, buf.numel() * buf.element_size(), sent=False)
        return buf

    for op in ops:
        i = op.mb
        if op.kind == FORWARD:
            if stage.is_first:
                x = xs[i].to(device)
            else:
                x = recv(stage.prev_rank, i).requires_grad_()
            with span(FORWARD, i):
                t0 = begin(FORWARD, xs[i].shape[0])
                with mem:
                    y = stage(x)
                    if stage.is_last:
                        y = loss_fn(y, ys[i].to(device)) / m
                if cost is not None:
                    cost.pad(FORWARD, t0, xs[i].shape[0], stage.rank, nested(t0))
            inputs[i], outputs[i] = x, y
            if stage.is_last:
                loss_total += y.item()
            else:
                send(y, stage.next_rank, i)
        elif op.kind == BACKWARD:
            grad = None if stage.is_last else recv(stage.next_rank, i)
            with span(BACKWARD, i):
                t0 = begin(BACKWARD, xs[i].shape[0])
                torch.autograd.backward(outputs.pop(i), grad)
                if cost is not None:
                    cost.pad(BACKWARD, t0, xs[i].shape[0], stage.rank, nested(t0))
            x = inputs.pop(i)
            if not stage.is_first:
                send(x.grad, stage.prev_rank, i)
        else:
            raise ValueError(f"unknown op kind {op.kind!r}")
    for work, _ in pending:
        work.wait()
    if outputs:
        raise RuntimeError(f"schedule ended with microbatches {sorted(outputs)} never run "
                           f"backward")
    return loss_total if stage.is_last else None


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
        loss = run_schedule(stage, ops, tokens, targets, m, recorder=rec, cost=cost,
                            memory=tracker)
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
    from parlib.measure.timeline import align, makespan

    repeats = len(results[0]["spans"])
    runs = [align([r["spans"][k] for r in results]) for k in range(repeats)]
    runs.sort(key=makespan)
    return runs[len(runs) // 2]


# --------------------------------------------------------------------------- torch's own


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


__all__ = [
    "partition",
    "Stage",
    "build_stage",
    "pipeline_peers",
    "microbatches",
    "run_schedule",
    "rank_step",
    "gather_grads",
    "median_run",
    "CostPadded",
    "rank_torch_pipelining",
]
