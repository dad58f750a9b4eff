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

Messages follow NCCL's rules (:class:`_Mailbox`): an op's sends and the next op's
receive are posted together as one ``dist.batch_isend_irecv``, never as separate
``isend`` and ``irecv`` to one peer (NCCL can deadlock on that pair), and messages match
by the order they were posted, never by tag (NCCL ignores tags). The next op's receive is
posted ahead, so that its message travels while this op computes, when this op sends
nothing; otherwise it joins this op's sends after the compute (NCCL runs one rank's
batches in order, so a receive posted ahead would hold back a send its sender may be
waiting for: GPipe with m = 1 can deadlock so). With a blocking ``dist.send`` 1F1B can
deadlock: a rank sending its next activation and its neighbour sending a gradient back
both wait for a recv that comes after the other's send; batched, the two meet. Every
payload follows a small header (kind, microbatch, chunk): two neighbours whose schedules
order the microbatches differently would otherwise pair one microbatch's activation with
another's and train on the mix without a word; the header turns that into an error
naming both. The header's chunk is the receiver's (the chunk whose op consumes the payload).

Split backward (a schedule with W ops): B computes only the gradient of the stage's input
and sends it (the previous stage waits for it); W computes the weights' gradients later.
Here B is ``torch.autograd.grad(out, [x], grad, retain_graph=True)`` and W is
``torch.autograd.backward(out, grad, inputs=params)`` over the same graph. That is not
free: W walks the chunk's graph again from its output, so it redoes the input-gradient
products of every layer but the first on its way down to the earlier layers' weights
(about half a backward more per microbatch). Real implementations split each linear
layer's backward (dgrad X -> dX = dY W^T in B, wgrad dW = dY^T X in W, stashing dY), so
B + W costs one backward; an emulated cost (``parlib.experiments``) times them that way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib import comm
from parlib.comm import agree, rank_and_size
from parlib.model import ModelConfig, TinyGPT, build_model, loss_fn
from parlib.strategies.schedule_check import ScheduleError, validate
from parlib.strategies.schedules import BACKWARD, FORWARD, WEIGHT, Op

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
    the first stage, hidden states in otherwise; logits out on the last). ``group``: the
    pipeline's process group (None: the default group), whose ranks check the schedule
    together before a step. Any other model: :meth:`from_modules`."""

    def __init__(self, model: TinyGPT, rank: int, p: int, prev_rank: int | None = None,
                 next_rank: int | None = None, group: Any = None) -> None:
        super().__init__()
        if not 0 <= rank < p:
            raise ValueError(f"rank must be in [0, {p}), got {rank}")
        self.cfg: ModelConfig | None = model.cfg
        self.layer_ids = partition(model.cfg.n_layers, p)[rank]
        self._hold(model.embed if rank == 0 else None, [model.blocks[i] for i in self.layer_ids],
                   model.head if rank == p - 1 else None, rank, p, (prev_rank, next_rank), group)
        self.row_shape: tuple[int, ...] = (model.cfg.seq_len, model.cfg.d_model)
        # local parameter name -> its name in the full model ("blocks.0.x" -> "blocks.2.x")
        self.global_names: dict[str, str] = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                self.global_names[name] = f"blocks.{self.layer_ids[int(i)]}.{rest}"
            else:
                self.global_names[name] = name

    def _hold(self, first: nn.Module | None, layers: Sequence[nn.Module],
              last: nn.Module | None, rank: int, p: int,
              peers: tuple[int | None, int | None], group: Any) -> None:
        self.rank, self.p = rank, p  # the stage's index in its pipeline, and the pipeline's length
        self.chunk = 0  # which of its rank's model chunks this is (interleaved: rank = c*p + r)
        # Global ranks of the neighbouring stages (None at the ends): in a pipeline group of
        # a larger mesh they are not rank - 1 and rank + 1.
        self.prev_rank, self.next_rank = peers
        self.group = group
        self.embed = first
        self.blocks = nn.ModuleList(layers)
        self.head = last

    @classmethod
    def from_modules(cls, first: nn.Module | None, layers: Sequence[nn.Module],
                     last: nn.Module | None, *, row_shape: Sequence[int],
                     names_from: nn.Module | None = None, group: Any = None) -> Stage:
        """This rank's stage of any model, from the modules it runs in order: ``first``
        (tokens -> hidden states, e.g. the embedding) on the pipeline group's first rank
        only, then ``layers`` (hidden states in, hidden states out: one tensor each), then
        ``last`` (hidden states -> logits, e.g. the final norm and the head) on its last rank
        only; ``None`` elsewhere. ``row_shape``: one row's hidden states at a stage boundary,
        (seq_len, hidden). ``names_from``: the whole model, whose parameter names
        :meth:`grads` then uses. The rank, p and neighbours come from ``group`` (None: the
        default group); the last stage's logits go to :func:`parlib.model.loss_fn`."""
        rank, p = rank_and_size(group or dist.group.WORLD, "Stage.from_modules")
        for module, end, where in ((first, 0, "first"), (last, p - 1, "last")):
            if (module is not None) != (rank == end):
                raise ValueError(
                    f"Stage.from_modules on rank {rank} of a {p}-rank pipeline: {where}= goes "
                    f"to the pipeline's {where} rank (rank {end}) only; "
                    + ("pass it here" if rank == end else "pass None here"))
        stage = cls.__new__(cls)
        nn.Module.__init__(stage)
        stage.cfg, stage.layer_ids = None, range(0)
        stage._hold(first, list(layers), last, rank, p, pipeline_peers(group), group)
        stage.row_shape = tuple(row_shape)
        # by identity: a wrapped layer's tensors keep their names in the whole model
        whole = [*names_from.named_parameters(), *names_from.named_buffers()] if names_from \
            else []
        full = {id(t): n for n, t in whole}
        stage.global_names = {n: full.get(id(t), n)
                              for n, t in [*stage.named_parameters(), *stage.named_buffers()]}
        return stage

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

    def activation_shape(self, batch: int) -> tuple[int, ...]:
        """Shape of the hidden states crossing a stage boundary for ``batch`` rows: (b, s, h)."""
        return (batch, *self.row_shape)

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
    stage = Stage(build_model(cfg, seed), rank or 0, p or 1, *peers, group=group)
    return stage.to(device) if device is not None else stage


class ChunkedStage(nn.Module):
    """The v model chunks of one rank for an interleaved schedule: ``chunked[c]`` is a
    :class:`Stage` for virtual stage c*p + rank of p*v (its ``rank`` and ``p`` are the
    virtual stage's index and p*v, its ``chunk`` is c, its neighbours global ranks).
    ``rank`` / ``p`` / ``v`` are this rank's index in its pipeline, the pipeline's length and
    the chunks per rank; :meth:`grads` merges the chunks' gradients by full-model name."""

    def __init__(self, chunks: Sequence[Stage], rank: int, p: int) -> None:
        super().__init__()
        if not chunks:
            raise ValueError("a ChunkedStage needs at least one chunk")
        self.chunks = nn.ModuleList(chunks)
        self.rank, self.p, self.v = rank, p, len(chunks)

    def __getitem__(self, c: int) -> Stage:
        return self.chunks[c]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[Stage]:  # type: ignore[override]
        return iter(self.chunks)  # type: ignore[arg-type]

    def grads(self) -> dict[str, torch.Tensor]:
        """Every chunk's gradients by full-model name (CPU copies; zeros where None)."""
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            out.update(chunk.grads())  # type: ignore[operator]
        return out


def chunk_stages(model: TinyGPT, rank: int, p: int, v: int,
                 peers: Sequence[int] | None = None, group: Any = None) -> ChunkedStage:
    """Rank ``rank``'s v chunks of ``model`` in a pipeline of p ranks: the L blocks cut
    p*v ways, chunk c is virtual stage c*p + rank. ``peers``: the global rank of each
    pipeline index (default: index i is global rank i); ``group``: the pipeline's process
    group (None: the default group)."""
    if v < 1:
        raise ValueError(f"v (model chunks per rank) must be >= 1, got {v}")
    if not 0 <= rank < p:
        raise ValueError(f"rank must be in [0, {p}), got {rank}")
    if p * v > model.cfg.n_layers:
        raise ValueError(f"cannot cut {model.cfg.n_layers} blocks into p*v = {p}*{v} = "
                         f"{p * v} chunks: interleaving needs at least p*v blocks")
    peers = list(range(p)) if peers is None else list(peers)
    if len(peers) != p:
        raise ValueError(f"peers must name the global rank of each of the {p} pipeline "
                         f"indices, got {peers}")
    n = p * v
    chunks = []
    for c in range(v):
        s = c * p + rank
        stage = Stage(model, s, n, peers[(s - 1) % p] if s > 0 else None,
                      peers[(s + 1) % p] if s < n - 1 else None, group)
        stage.chunk = c
        chunks.append(stage)
    return ChunkedStage(chunks, rank, p)


def build_chunks(cfg: ModelConfig | None = None, seed: int = 0, rank: int | None = None,
                 p: int | None = None, v: int = 2, device: Any = None,
                 group: Any = None) -> ChunkedStage:
    """Rank ``rank``'s v chunks of ``build_model(cfg, seed)`` for an interleaved schedule
    (see :class:`ChunkedStage`), moved to ``device``. ``rank`` and ``p`` default to this
    rank's index in the pipeline ``group`` (the default group when None) and its size."""
    peers: list[int] | None = None
    if dist.is_available() and dist.is_initialized():
        group = group or dist.group.WORLD
        mine, size = rank_and_size(group)
        rank = mine if rank is None else rank
        p = size if p is None else p
        if p == size:
            peers = [dist.get_global_rank(group, i) for i in range(size)]
    chunked = chunk_stages(build_model(cfg, seed), rank or 0, p or 1, v, peers, group)
    return chunked.to(device) if device is not None else chunked


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


class _Mailbox:
    """One rank's messages in :func:`run_schedule`, as NCCL takes them.

    Each op's sends (a header, then its payload) and the next op's receive (the same two)
    are posted together, one ``dist.batch_isend_irecv`` (:func:`parlib.comm.exchange`), and
    match by order, never by tag. A receive is waited for when its op runs, the sends at
    the end of the step. One rank holding every chunk (p = 1) sends to itself: a queue, in
    order.

    Not covered by :func:`parlib.comm.nccl_rules`: NCCL gives a batch one work, so waiting
    for a receive also waits for the sends beside it, and runs a rank's batches in order.
    Where a send waits for its receiver (messages beyond NCCL's buffers) that ties the two
    ranks closer than gloo does. Emulated on gloo (each batch waited for whole, in
    order), GPipe, 1F1B and ZB-H1 on 2 and 4 ranks and the interleaved order on 4 ran;
    the interleaved order on 2 ranks, whose two neighbours are one rank, deadlocked."""

    def __init__(self, device: torch.device, shape: tuple[int, ...], alone: bool) -> None:
        self.device, self.shape, self.alone = device, shape, alone
        self.outbox: list[tuple[torch.Tensor, int]] = []  # sends not yet posted
        self.batches: list[tuple[list[Any], list[torch.Tensor]]] = []  # send works, tensors
        self.posted: dict[int, tuple[torch.Tensor, torch.Tensor, list[Any]]] = {}
        self.to_self: deque[tuple[torch.Tensor, torch.Tensor]] = deque()

    def send(self, header: torch.Tensor, payload: torch.Tensor, dst: int) -> None:
        """Queue a message for the next :meth:`post`."""
        if self.alone:
            self.to_self.append((header, payload.clone()))
        else:
            self.outbox += [(header, dst), (payload, dst)]

    def post(self, index: int, src: int | None) -> None:
        """Post the queued sends and, from ``src`` (None: no message), op ``index``'s
        receive unless it is posted already, as one batch."""
        recvs = []
        if src is not None and not self.alone and index not in self.posted:
            header = torch.empty(3, dtype=torch.int64, device=self.device)
            recvs = [(header, src), (torch.empty(self.shape, device=self.device), src)]
        if not (self.outbox or recvs):
            return
        works = comm.exchange(self.outbox, recvs)
        # gloo: a work per message, the receives last; NCCL: one for the whole batch. Each
        # is waited for once (gloo never returns from a second wait on a receive).
        split = len(self.outbox) if len(works) == len(self.outbox) + len(recvs) else 0
        sends, own = (works[:split], works[split:]) if recvs else (works, [])
        self.batches.append((sends, [t for t, _ in self.outbox + recvs]))  # kept alive
        if recvs:
            self.posted[index] = (recvs[0][0], recvs[1][0], own)
        self.outbox = []

    def take(self, index: int, op: Op) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        """(header, payload, the works to wait for) of op ``index``'s message."""
        if self.alone:
            if not self.to_self:
                raise RuntimeError(f"op {op!r} waits for a message this rank never sent "
                                   f"itself (a deadlock: validate the schedule)")
            return (*self.to_self.popleft(), [])
        return self.posted.pop(index)

    def finish(self) -> None:
        """Wait for every send (each receive was waited for by its op)."""
        for works, _ in self.batches:
            for work in works:
                work.wait()


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


def _check_whole_schedule(chunks: list[Stage], ops: Sequence[Op], m: int) -> None:
    """Before any message: the pipeline's ranks agree on m and p, rank i holds stage i,
    and their op lists together pass validate (a deadlock raises instead of hanging)."""
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
    stage reads tokens and only the last reads targets). Each microbatch's loss is divided
    by m, so the accumulated gradients equal the full-batch gradients. Gradients are
    accumulated into ``.grad`` (zero them before the step). Returns the full-batch loss on
    the rank holding the last stage, None elsewhere. Raises ``RuntimeError`` when a
    neighbour sends another microbatch than the one this rank's next op expects. Before
    any message the ranks of the stage's pipeline group exchange their ``m`` and op lists
    (one ``all_gather_object``) and check the whole schedule with
    :func:`parlib.strategies.schedule_check.validate`: a schedule that would hang or
    mismatch raises its :class:`ScheduleError` on every rank instead.
    """
    chunks = _chunks_of(stage)
    v = len(chunks)
    split = any(op.kind == WEIGHT for op in ops)
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
    _check_whole_schedule(chunks, ops, m)
    hooks = hooks or PipelineHooks()
    device = next(chunks[0].parameters()).device
    xs = microbatches(tokens, m)
    ys = microbatches(targets, m)
    shape = chunks[0].activation_shape(xs[0].shape[0])  # (b/m, s, h)
    p_ranks = chunks[0].p // v  # virtual stage s = c*p + r: a neighbour's chunk is (s +- 1) // p
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    weight_work: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    loss_total = 0.0
    last_here = any(c.is_last for c in chunks)
    mail = _Mailbox(device, shape, alone=p_ranks == 1)

    def send(t: torch.Tensor, dst: int, op: Op, dst_chunk: int, index: int) -> None:
        """Post op ``index``'s output with the next op's receive (see :class:`_Mailbox`)."""
        t = t.detach().contiguous()
        header = torch.tensor([_KIND_CODE[op.kind], op.mb, dst_chunk], device=device)
        with hooks.message("send", dst, t, op.mb):
            mail.send(header, t, dst)
            post(index + 1)

    def source(op: Op) -> int | None:
        """The rank whose message op needs before it can run (None: no message)."""
        st = chunks[op.chunk]
        if op.kind == FORWARD and not st.is_first:
            return st.prev_rank
        if op.kind == BACKWARD and not st.is_last:
            return st.next_rank
        return None

    def sends(op: Op) -> bool:
        st = chunks[op.chunk]
        return op.kind == FORWARD and not st.is_last or op.kind == BACKWARD and not st.is_first

    def post(index: int) -> None:
        mail.post(index, source(ops[index]) if index < len(ops) else None)

    def recv(index: int, op: Op, st: Stage) -> torch.Tensor:
        src = source(op)
        assert src is not None
        post(index)  # posted already (ahead, or with the last op's sends): nothing to do
        header, buf, works = mail.take(index, op)
        with hooks.message("recv", src, buf, op.mb):
            for work in works:
                work.wait()
            check(header, src, op, st)
        return buf

    def check(header: torch.Tensor, src: int, op: Op, st: Stage) -> None:
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

    post(0)
    for index, op in enumerate(ops):
        if not sends(op):  # the next op's input travels while this op computes (NCCL would
            post(index + 1)  # hold this op's sends behind it: with them, after it, if any)
        i, st = op.mb, chunks[op.chunk]
        key = (op.mb, op.chunk)
        rows = xs[i].shape[0]
        if op.kind == FORWARD:
            x = xs[i].to(device) if st.is_first else recv(index, op, st).requires_grad_()
            with hooks.compute_op(op, rows):
                y = st(x)  # (b/m, s, h), logits (b/m, s, V) on the last stage
                if st.is_last:
                    y = loss_fn(y, ys[i].to(device)) / m
            inputs[key], outputs[key] = x, y
            if st.is_last:
                loss_total += y.item()
            else:
                send(y, st.next_rank, op, (st.rank + 1) // p_ranks, index)
        elif op.kind == BACKWARD:
            if key not in outputs:
                raise RuntimeError(f"op {op!r}: its forward has not run on this rank")
            grad = None if st.is_last else recv(index, op, st)
            if not split:
                with hooks.compute_op(op, rows):
                    torch.autograd.backward(outputs.pop(key), grad)
                x = inputs.pop(key)
                if not st.is_first:
                    send(x.grad, st.prev_rank, op, (st.rank - 1) // p_ranks, index)
                continue
            # Split: B follows only the path to the input (autograd skips the weights'
            # products) and keeps the graph for W, which walks it again to the weights and
            # so redoes B's input-gradient products of all but the first layer; a per-layer
            # dgrad/wgrad split (stashing each layer's output gradient) would not.
            out, x = outputs.pop(key), inputs[key]
            with hooks.compute_op(op, rows):
                # the first stage's input is tokens: no gradient to compute or send
                gx = None if st.is_first else torch.autograd.grad(
                    out, [x], grad, retain_graph=True)[0]
            weight_work[key] = (out, grad)
            if gx is not None:
                send(gx, st.prev_rank, op, (st.rank - 1) // p_ranks, index)
        else:  # WEIGHT
            if key not in weight_work:
                raise RuntimeError(f"op {op!r}: its backward B{op.mb} has not run on this rank")
            out, grad = weight_work.pop(key)
            inputs.pop(key)
            params = [prm for prm in st.parameters() if prm.requires_grad]
            with hooks.compute_op(op, rows):
                torch.autograd.backward(out, grad, inputs=params)  # frees the graph
    mail.finish()
    if outputs:
        raise RuntimeError(f"schedule ended with (microbatch, chunk) {sorted(outputs)} never "
                           f"run backward")
    if weight_work:
        raise RuntimeError(f"schedule ended with (microbatch, chunk) {sorted(weight_work)} "
                           f"never run W (the weight gradients)")
    return loss_total if last_here else None


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
