"""Pipeline parallelism with plain torch.distributed point-to-point messages.

The shared model (``embed -> blocks -> head``) is cut into p stages of consecutive
layers; stage i runs on the i-th rank of a pipeline process group. A stage receives
activations from the previous stage, sends its output to the next, and on the way back
receives gradients from the next and sends the gradient of its input to the previous.
The neighbours are global ranks carried by the stage (``stage.prev_rank`` /
``stage.next_rank``, from :func:`pipeline_peers` of the group it was built for).

* :func:`build_stage` / :class:`Stage` -- this rank's slice of the model.
* :func:`run_schedule` -- run one training step for this rank from a list of
  :class:`parlib.strategies.schedules.Op` (GPipe, 1F1B, ...). An optional
  :class:`PipelineHooks` sees every compute op and every message (``parlib.experiments``
  uses it to record a timeline, count bytes and saved activations, and pad compute to an
  emulated cost); without one the step is plain torch.

Messages: sends use ``dist.isend`` (waited for at the end of the step) and receives a
blocking ``dist.recv``, in the order the schedule gives. With a blocking ``dist.send``
1F1B can deadlock: a rank sending its next activation and its neighbour sending a
gradient back both wait for a recv that comes after the other's send (gloo blocks on
large messages: measured with 16 MB both ways here). Every payload follows a small header
(kind, microbatch, chunk): two neighbours whose schedules order the microbatches
differently would otherwise pair one microbatch's activation with another's and train on
the mix without a word; the header turns that into an error naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.comm import rank_and_size
from parlib.model import ModelConfig, TinyGPT, build_model, loss_fn
from parlib.strategies.schedules import BACKWARD, FORWARD, Op

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
        # local parameter name -> its name in the full model ("blocks.0.x" -> "blocks.2.x")
        self.global_names: dict[str, str] = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                self.global_names[name] = f"blocks.{self.layer_ids[int(i)]}.{rest}"
            else:
                self.global_names[name] = name

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
        return {self.global_names[n]: (prm.grad if prm.grad is not None else torch.zeros_like(prm))
                .detach().cpu().clone() for n, prm in self.named_parameters()}


def pipeline_peers(group: Any = None) -> tuple[int | None, int | None]:
    """Global ranks of the previous and next stage of this rank's pipeline ``group`` (the
    default group when None); None at the ends. Stage i of the group is its i-th rank."""
    group = group or dist.group.WORLD
    i, p = rank_and_size(group, "pipeline_peers")
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
        mine, size = rank_and_size(group or dist.group.WORLD)
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


class PipelineHooks:
    """What :func:`run_schedule` shows an observer; each method returns a context manager
    wrapped around the work. This base class observes nothing (plain torch).

    * ``compute(kind, mb, rows)`` -- around the forward (stage and loss) or the backward
      of microbatch ``mb`` of ``rows`` rows; ``kind`` is FORWARD or BACKWARD.
    * ``message(kind, peer, tensor, mb)`` -- around sending ("send") or receiving ("recv")
      ``tensor`` (the payload, header not included) to or from global rank ``peer``.
    """

    def compute(self, kind: str, mb: int, rows: int) -> AbstractContextManager[Any]:
        return nullcontext()

    def message(self, kind: str, peer: int, tensor: torch.Tensor,
                mb: int) -> AbstractContextManager[Any]:
        return nullcontext()


_KIND_CODE = {FORWARD: 0, BACKWARD: 1}  # header: which way the payload travels
_WHAT = {FORWARD: "activation", BACKWARD: "gradient"}


def run_schedule(
    stage: Stage,
    ops: Sequence[Op],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    m: int,
    *,
    hooks: PipelineHooks | None = None,
) -> float | None:
    """One training step of this rank's stage, running ``ops`` in order.

    ``tokens`` / ``targets`` are the full batch (every rank may pass them; only the first
    stage reads tokens and only the last reads targets). Each microbatch's loss is divided
    by m, so the accumulated gradients equal the full-batch gradients. Gradients are
    accumulated into ``.grad`` (zero them before the step). Returns the full-batch loss on
    the last stage, None elsewhere. Raises ``RuntimeError`` when a neighbour sends another
    microbatch than the one this rank's next op expects.
    """
    if any(op.chunk for op in ops):
        raise ValueError("run_schedule runs one chunk per rank; interleaved ops are drawn, "
                         "not run")
    hooks = hooks or PipelineHooks()
    device = next(stage.parameters()).device
    xs = microbatches(tokens, m)
    ys = microbatches(targets, m)
    shape = stage.activation_shape(xs[0].shape[0])  # (b/m, s, h)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    pending: list[tuple[Any, torch.Tensor]] = []  # isend works and the tensors they read
    loss_total = 0.0

    def send(t: torch.Tensor, dst: int, op: Op) -> None:
        t = t.detach().contiguous()
        header = torch.tensor([_KIND_CODE[op.kind], op.mb, op.chunk], device=device)
        with hooks.message("send", dst, t, op.mb):
            pending.append((dist.isend(header, dst), header))
            pending.append((dist.isend(t, dst), t))

    def recv(src: int, op: Op) -> torch.Tensor:
        header = torch.empty(3, dtype=torch.int64, device=device)
        buf = torch.empty(shape, device=device)
        with hooks.message("recv", src, buf, op.mb):
            dist.recv(header, src)
            kind, mb, chunk = header.tolist()
            if (kind, mb, chunk) != (_KIND_CODE[op.kind], op.mb, op.chunk):
                sent = f"{_WHAT[FORWARD if kind == 0 else BACKWARD]} of microbatch {mb}"
                raise RuntimeError(
                    f"rank {dist.get_rank()} (stage {stage.rank}) at op {op!r} expected the "
                    f"{_WHAT[op.kind]} of microbatch {op.mb} from rank {src}, but rank {src} "
                    f"sent the {sent}"
                    + (f" (chunk {chunk})" if chunk else "")
                    + ": the two stages' schedules order the microbatches differently; "
                    "neighbouring stages must run their forwards (and backwards) in the "
                    "same microbatch order")
            dist.recv(buf, src)
        return buf

    for op in ops:
        i = op.mb
        rows = xs[i].shape[0]
        if op.kind == FORWARD:
            x = xs[i].to(device) if stage.is_first else recv(stage.prev_rank, op).requires_grad_()
            with hooks.compute(FORWARD, i, rows):
                y = stage(x)  # (b/m, s, h), logits (b/m, s, V) on the last stage
                if stage.is_last:
                    y = loss_fn(y, ys[i].to(device)) / m
            inputs[i], outputs[i] = x, y
            if stage.is_last:
                loss_total += y.item()
            else:
                send(y, stage.next_rank, op)
        elif op.kind == BACKWARD:
            grad = None if stage.is_last else recv(stage.next_rank, op)
            with hooks.compute(BACKWARD, i, rows):
                torch.autograd.backward(outputs.pop(i), grad)
            x = inputs.pop(i)
            if not stage.is_first:
                send(x.grad, stage.prev_rank, op)
        else:
            raise ValueError(f"unknown op kind {op.kind!r}")
    for work, _ in pending:
        work.wait()
    if outputs:
        raise RuntimeError(f"schedule ended with microbatches {sorted(outputs)} never run "
                           f"backward")
    return loss_total if stage.is_last else None


__all__ = [
    "PipelineHooks",
    "Stage",
    "build_stage",
    "microbatches",
    "partition",
    "pipeline_peers",
    "run_schedule",
]
