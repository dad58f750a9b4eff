"""Pipeline parallelism with plain torch.distributed point-to-point messages.

The shared model (``embed -> blocks -> head``) is cut into p stages of consecutive
layers; stage i runs on the i-th rank of a pipeline process group. A stage receives
activations from the previous stage, sends its output to the next, and on the way back
receives gradients from the next and sends the gradient of its input to the previous.
The neighbours are global ranks carried by the stage (``stage.prev_rank`` /
``stage.next_rank``, from :func:`pipeline_peers` of the group it was built for).

* :func:`build_stage` / :class:`Stage` -- this rank's slice of the model.
* :func:`build_chunks` / :class:`ChunkedStage` -- this rank's v slices for an interleaved
  schedule: the L blocks cut p*v ways, chunk c of rank r is virtual stage c*p + r.
* :func:`run_schedule` -- run one training step for this rank from a list of
  :class:`parlib.strategies.schedules.Op` (GPipe, 1F1B, interleaved, ZB-H1, or any list
  :func:`parlib.strategies.schedule_check.validate` accepts). An optional
  :class:`PipelineHooks` sees every compute op and every message (``parlib.experiments``
  uses it to record a timeline, count bytes and saved activations, and pad compute to an
  emulated cost); without one the step is plain torch.

Messages follow NCCL's rules (:class:`_Mailbox` says how): each is one
``dist.batch_isend_irecv``, matched by order, never by tag, and every rank posts them in
one order the ranks share (the schedule's replay), which cannot deadlock. Every payload
follows a small header (kind, microbatch, chunk): two neighbours whose schedules order the
microbatches differently would otherwise train on a mix without a word; the header turns
that into an error naming both.

Split backward (a schedule with W ops): B computes only the gradient of the stage's input
and sends it (the previous stage waits for it); W computes the weights' gradients later.
Here B is ``torch.autograd.grad(out, [x], grad, retain_graph=True)`` and W is
``torch.autograd.backward(out, grad, inputs=params)`` over the same graph. That is not
free: W walks the chunk's graph again from its output, so it redoes the input-gradient
products of every layer but the first on its way down to the earlier layers' weights
(about half a backward more per microbatch). Real implementations split each linear
layer's backward (dgrad X -> dX = dY W^T in B, wgrad dW = dY^T X in W, stashing dY), so
B + W costs one backward; an emulated cost (``parlib.experiments``) times them that way.
The stages live in :mod:`parlib.strategies.pipeline_stages` (importable from here).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from parlib.comm import agree, rank_and_size
from parlib.model import IGNORE_INDEX, loss_share
from parlib.strategies.pipeline_mail import RECV, _Mailbox, message_plan
from parlib.strategies.pipeline_stages import (
    ChunkedStage,
    Stage,
    build_chunks,
    build_stage,
    chunk_stages,
    microbatches,
    partition,
    pipeline_peers,
)
from parlib.strategies.schedule_check import ScheduleError, validate
from parlib.strategies.schedules import BACKWARD, FORWARD, WEIGHT, Op


class PipelineHooks:
    """What :func:`run_schedule` shows an observer; each method returns a context manager
    wrapped around the work. This base class observes nothing (plain torch).

    * ``compute(kind, mb, rows)`` -- around the forward (stage and loss), the backward or
      the weight gradients of microbatch ``mb`` of ``rows`` rows; ``kind`` is FORWARD,
      BACKWARD or WEIGHT.
    * ``compute_op(op, rows)`` -- what the runner calls; by default ``compute(op.kind,
      op.mb, rows)``. Override it to see the op's chunk too.
    * ``message(kind, peer, tensor, mb)`` -- around sending ("send") or receiving ("recv")
      ``tensor`` (the payload, header not included) to or from global rank ``peer``.
    """

    def compute(self, kind: str, mb: int, rows: int) -> AbstractContextManager[Any]:
        return nullcontext()

    def compute_op(self, op: Op, rows: int) -> AbstractContextManager[Any]:
        return self.compute(op.kind, op.mb, rows)

    def message(self, kind: str, peer: int, tensor: torch.Tensor,
                mb: int) -> AbstractContextManager[Any]:
        return nullcontext()


_KIND_CODE = {FORWARD: 0, BACKWARD: 1}  # header: which way the payload travels
_WHAT = {FORWARD: "activation", BACKWARD: "gradient"}


def _chunks_of(stage: Stage | ChunkedStage | Sequence[Stage]) -> list[Stage]:
    if isinstance(stage, Stage):
        return [stage]
    chunks = list(stage)
    if not chunks or not all(isinstance(c, Stage) for c in chunks):
        raise TypeError("run_schedule needs a Stage, a ChunkedStage or a list of Stages, got "
                        f"{type(stage).__name__}")
    return chunks


def _pipeline_group(stage: Stage, p: int) -> Any:
    """The process group of the pipeline ``stage`` belongs to, with exactly p ranks."""
    group = stage.group if stage.group is not None else dist.group.WORLD
    _, size = rank_and_size(group, "run_schedule")
    if size != p:
        where = "its pipeline group" if stage.group is not None else "the default group"
        raise ValueError(
            f"run_schedule: rank {dist.get_rank()} holds stage {stage.rank % p} of a pipeline "
            f"built for p={p} ranks, but {where} has {size}: build the stage for the ranks "
            f"that run it (build_stage(cfg, seed, group=g) takes rank and p from g) or run "
            f"it on {p} ranks")
    return group


def _check_whole_schedule(chunks: list[Stage], ops: Sequence[Op],
                          m: int) -> dict[int, list[Op]]:
    """Before any message: the pipeline's ranks agree on m and p, rank i holds stage i,
    and their op lists together pass validate (a deadlock raises instead of hanging).
    Returns every rank's op list (rank in the pipeline group -> ops)."""
    v = len(chunks)
    if chunks[0].p % v:
        raise ValueError(f"{v} chunks per rank but {chunks[0].p} virtual stages: build the "
                         f"chunks with build_chunks (p*v virtual stages)")
    p = chunks[0].p // v
    if p == 1:  # every stage on this rank: nothing to agree on
        sched = {0: list(ops)}
    else:
        group = _pipeline_group(chunks[0], p)
        every = agree("run_schedule", group, {
            "m": (m, "pass every rank the same m (microbatches per step)"),
            "the stages per rank (v)": (v, "build every rank's chunks with the same v"),
        }, payload=(chunks[0].rank % p, list(ops)))
        held = [stage for stage, _ in every]
        if held != list(range(p)):
            raise ValueError(f"run_schedule: the pipeline group's ranks hold stages {held}, "
                             f"in group order; rank i must hold stage i (build_stage(cfg, "
                             f"seed, group=g) without rank= builds it so)")
        sched = dict(every)
    try:
        validate(sched, p, m, v)
    except ScheduleError as err:
        raise ScheduleError(f"run_schedule: the ranks' op lists, checked together before "
                            f"any message, cannot run: {err}", problem=err.problem,
                            rank=err.rank, index=err.index, op=err.op) from None
    return sched


def run_schedule(
    stage: Stage | ChunkedStage | Sequence[Stage],
    ops: Sequence[Op],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    m: int,
    *,
    hooks: PipelineHooks | None = None,
) -> float | None:
    """One training step of this rank's stage, running ``ops`` in order.

    ``stage``: a :class:`Stage`, or the :class:`ChunkedStage` of :func:`build_chunks` when
    ``ops`` use v > 1 chunks (op.chunk picks the chunk). ``ops`` with WEIGHT ops split each
    backward into B (the input's gradient, sent at once) and W (the weights' gradients).
    ``tokens`` / ``targets`` are the full batch (every rank may pass them; only the first
    stage reads tokens and only the last reads targets). Each microbatch's loss is its
    share of the batch's (:func:`parlib.model.loss_share`: its tokens' summed loss over the
    batch's real tokens, targets of ``IGNORE_INDEX`` counting for nothing), so the
    accumulated gradients equal the full-batch gradients whatever m and the padding. Gradients are
    accumulated into ``.grad`` (zero them before the step). Returns the full-batch loss on
    the rank holding the last stage, None elsewhere. Raises ``RuntimeError`` when a
    neighbour sends another microbatch than the one this rank's next op expects. Before
    any message the ranks of the stage's pipeline group exchange their ``m`` and op lists
    (one ``all_gather_object``) and check the whole schedule with
    :func:`parlib.strategies.schedule_check.validate`: a schedule that would hang or
    mismatch raises its :class:`ScheduleError` on every rank instead.
    """
    chunks = _chunks_of(stage)
    _check_ops(ops, m, len(chunks))
    sched = _check_whole_schedule(chunks, ops, m)
    return _Step(chunks, ops, tokens, targets, m, hooks or PipelineHooks(), sched).run()


def _check_ops(ops: Sequence[Op], m: int, v: int) -> None:
    for i, op in enumerate(ops):
        if op.kind not in (FORWARD, BACKWARD, WEIGHT):
            raise ValueError(f"op {i} ({op!r}): unknown op kind {op.kind!r}")
        if not 0 <= op.mb < m:
            raise ValueError(f"op {i} ({op!r}): microbatch {op.mb} is not one of 0..{m - 1} "
                             f"(m={m})")
        if not 0 <= op.chunk < v:
            raise ValueError(
                f"op {i} ({op!r}) runs chunk {op.chunk}, but this rank has {v} chunk(s)"
                + ("; run_schedule runs one chunk per Stage: build the chunks of an "
                   "interleaved schedule with build_chunks(cfg, seed, v=...)" if v == 1 else ""))


class _Step:
    """One rank's step of :func:`run_schedule`: the ops in order, what they share (each
    microbatch's input and output until its backward, the W work a split backward leaves,
    the mailbox) and their messages."""

    def __init__(self, chunks: list[Stage], ops: Sequence[Op], tokens: torch.Tensor,
                 targets: torch.Tensor, m: int, hooks: PipelineHooks,
                 sched: dict[int, list[Op]]) -> None:
        self.chunks, self.ops, self.m, self.hooks = chunks, ops, m, hooks
        self.device = next(chunks[0].parameters()).device
        self.xs, self.ys = microbatches(tokens, m), microbatches(targets, m)
        self.batch_tokens = int((targets != IGNORE_INDEX).sum())  # the loss's divisor
        shape = chunks[0].activation_shape(self.xs[0].shape[0])  # (b/m, s, h)
        # virtual stage s = c*p + r: a neighbour's chunk is (s +- 1) // p
        self.p_ranks = chunks[0].p // len(chunks)
        self.split = any(op.kind == WEIGHT for op in ops)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.weight_work: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.loss_total = 0.0
        plan = None if self.p_ranks == 1 else message_plan(
            sched, self.p_ranks, len(chunks), chunks[0].rank % self.p_ranks,
            lambda kind, index: (self.source if kind == RECV else self.target)(ops[index]))
        self.mail = _Mailbox(self.device, shape, plan)

    def run(self) -> float | None:
        run_op = {FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight}
        for index, op in enumerate(self.ops):
            run_op[op.kind](index, op, self.chunks[op.chunk])
        self.mail.finish()
        if self.outputs:
            raise RuntimeError(f"schedule ended with (microbatch, chunk) "
                               f"{sorted(self.outputs)} never run backward")
        if self.weight_work:
            raise RuntimeError(f"schedule ended with (microbatch, chunk) "
                               f"{sorted(self.weight_work)} never run W (the weight gradients)")
        return self.loss_total if any(c.is_last for c in self.chunks) else None

    # ---- the three ops
    def forward(self, index: int, op: Op, st: Stage) -> None:
        i, key = op.mb, (op.mb, op.chunk)
        x = (self.xs[i].to(self.device) if st.is_first
             else self.recv(index, op, st).requires_grad_())
        with self.hooks.compute_op(op, self.xs[i].shape[0]):
            y = st(x)  # (b/m, s, h), logits (b/m, s, V) on the last stage
            if st.is_last:
                y = loss_share(y, self.ys[i].to(self.device), self.batch_tokens)
        self.inputs[key], self.outputs[key] = x, y
        if st.is_last:
            self.loss_total += y.item()
        else:
            self.send(y, st.next_rank, op, (st.rank + 1) // self.p_ranks, index)

    def backward(self, index: int, op: Op, st: Stage) -> None:
        key, rows = (op.mb, op.chunk), self.xs[op.mb].shape[0]
        if key not in self.outputs:
            raise RuntimeError(f"op {op!r}: its forward has not run on this rank")
        grad = None if st.is_last else self.recv(index, op, st)
        if not self.split:
            with self.hooks.compute_op(op, rows):
                torch.autograd.backward(self.outputs.pop(key), grad)
            x = self.inputs.pop(key)
            if not st.is_first:
                self.send(x.grad, st.prev_rank, op, (st.rank - 1) // self.p_ranks, index)
            return
        # Split: B follows only the path to the input (autograd skips the weights'
        # products) and keeps the graph for W, which walks it again to the weights and
        # so redoes B's input-gradient products of all but the first layer; a per-layer
        # dgrad/wgrad split (stashing each layer's output gradient) would not.
        out, x = self.outputs.pop(key), self.inputs[key]
        with self.hooks.compute_op(op, rows):
            # the first stage's input is tokens: no gradient to compute or send
            gx = None if st.is_first else torch.autograd.grad(
                out, [x], grad, retain_graph=True)[0]
        self.weight_work[key] = (out, grad)
        if gx is not None:
            self.send(gx, st.prev_rank, op, (st.rank - 1) // self.p_ranks, index)

    def weight(self, index: int, op: Op, st: Stage) -> None:
        key = (op.mb, op.chunk)
        if key not in self.weight_work:
            raise RuntimeError(f"op {op!r}: its backward B{op.mb} has not run on this rank")
        out, grad = self.weight_work.pop(key)
        self.inputs.pop(key)
        params = [prm for prm in st.parameters() if prm.requires_grad]
        with self.hooks.compute_op(op, self.xs[op.mb].shape[0]):
            torch.autograd.backward(out, grad, inputs=params)  # frees the graph

    # ---- messages
    def source(self, op: Op) -> int | None:
        """The rank whose message op needs before it can run (None: no message)."""
        st = self.chunks[op.chunk]
        if op.kind == FORWARD and not st.is_first:
            return st.prev_rank
        if op.kind == BACKWARD and not st.is_last:
            return st.next_rank
        return None

    def target(self, op: Op) -> int | None:
        """The rank op's result goes to (None: no message)."""
        st = self.chunks[op.chunk]
        if op.kind == FORWARD and not st.is_last:
            return st.next_rank
        if op.kind == BACKWARD and not st.is_first:
            return st.prev_rank
        return None

    def send(self, t: torch.Tensor, dst: int, op: Op, dst_chunk: int, index: int) -> None:
        """Post op ``index``'s output in the shared order (see :class:`_Mailbox`)."""
        t = t.detach().contiguous()
        header = torch.tensor([_KIND_CODE[op.kind], op.mb, dst_chunk], device=self.device)
        with self.hooks.message("send", dst, t, op.mb):
            self.mail.send(index, header, t, dst)

    def recv(self, index: int, op: Op, st: Stage) -> torch.Tensor:
        src = self.source(op)
        assert src is not None
        header, buf, works = self.mail.take(index, op)
        with self.hooks.message("recv", src, buf, op.mb):
            for work in works:
                work.wait()
            _check_header(header, src, op, st)
        return buf


def _check_header(header: torch.Tensor, src: int, op: Op, st: Stage) -> None:
    kind, mb, chunk = header.tolist()
    if (kind, mb, chunk) != (_KIND_CODE[op.kind], op.mb, op.chunk):
        sent = f"{_WHAT[FORWARD if kind == 0 else BACKWARD]} of microbatch {mb}"
        me = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(
            f"rank {me} (stage {st.rank}) at op {op!r} expected the "
            f"{_WHAT[op.kind]} of microbatch {op.mb} from rank {src}, but rank {src} "
            f"sent the {sent}"
            + (f" (for chunk {chunk})" if chunk or op.chunk else "")
            + ": the two stages' schedules order the microbatches differently; "
            "neighbouring stages must run their forwards (and backwards) in the "
            "same microbatch order")


__all__ = [
    "ChunkedStage",
    "PipelineHooks",
    "Stage",
    "build_chunks",
    "build_stage",
    "chunk_stages",
    "microbatches",
    "partition",
    "pipeline_peers",
    "run_schedule",
]
