"""The stages of :mod:`parlib.strategies.pipeline`: this rank's slice of the model
(:class:`Stage`, :func:`build_stage`, :meth:`Stage.from_modules`), its v slices for an
interleaved schedule (:class:`ChunkedStage`, :func:`build_chunks`), the layers' split
(:func:`partition`), the neighbours (:func:`pipeline_peers`) and the microbatches.
Everything here is importable from :mod:`parlib.strategies.pipeline` too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.comm import rank_and_size
from parlib.model import ModelConfig, TinyGPT, build_model

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



__all__ = [
    "ChunkedStage",
    "Stage",
    "build_chunks",
    "build_stage",
    "chunk_stages",
    "microbatches",
    "partition",
    "pipeline_peers",
]
