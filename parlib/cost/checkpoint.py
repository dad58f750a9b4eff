"""Checkpoints: how many bytes a layout writes, and how often to write them.

What a training checkpoint holds per parameter is the model state less the gradients (they
are recomputed by the next step): the weights and the optimizer state, in the byte counts of
:func:`parlib.cost.memory.model_state_bytes_per_param`. With Adam in fp32 that is 4 + 8 = 12
bytes; in mixed precision 2 (the bf16 weights) + 12 (the fp32 master weights and both
moments) = 14. Adam also keeps one step counter per tensor it steps (torch: an fp32 scalar,
4 bytes), tiny but counted. The data position, the RNG states and the scheduler are a few
bytes each and not counted.

Which of those bytes each rank writes is what the strategy shards
(:func:`parlib.cost.memory.model_state_bytes_by_kind` says which kind is sharded from which
ZeRO stage): tensor parallelism splits every weight t ways and a pipeline gives each stage
1/p of the layers (balanced stages assumed), so a model slice is P / (t x p); over the d x c
data-parallel (and context-parallel) copies of a slice

- plain data parallelism holds it whole on every copy: one copy writes it (``writers="one"``,
  what DCP does with replicated tensors and what ``if rank == 0: torch.save`` does), or every
  rank writes its own (``writers="every"``: d x c times the bytes on disk);
- ZeRO-1 and ZeRO-2 shard the optimizer state over the copies, the weights stay whole;
- ZeRO-3 / FSDP shard everything.

Loaded on another number of ranks, each rank reads the overlap of its new piece with the
saved ones (:func:`reshard_reads`, from :func:`flat_shard_range`).

A checkpoint is written to be read after a failure. Young (1974) derived the interval
between checkpoints that minimises the time lost: with ``save_time`` (delta) to write one and
a mean time between failures M, writing every tau seconds of work spends delta / tau of the
time saving and loses, at a failure (rate 1 / M), on average the tau / 2 since the last
checkpoint, plus the restart time R. Their sum delta / tau + (tau / 2 + R) / M is smallest at

    tau_opt = sqrt(2 x delta x M)

where both halves are equal. Daly (2006) gives a higher-order estimate of which this is the
first term, accurate when delta << M (his correction is under 10% while delta < M / 10).

- J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9), 1974.
- J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3), 2006.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from parlib.cost.layout import Layout
from parlib.cost.memory import model_state_bytes_by_kind

# The strategy -> the ZeRO stage whose sharding it has (plain data parallelism: none).
CHECKPOINT_STRATEGIES = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
WRITERS = ("one", "every")
SAVED_KINDS = ("params", "optimizer")  # gradients are not saved
STEP_COUNTER_BYTES = 4  # torch's Adam: one fp32 scalar per tensor it steps


@dataclass(frozen=True)
class CheckpointBytes:
    """Bytes one checkpoint of a layout writes: ``per_rank``, what the busiest rank writes
    when one rank writes every replicated tensor (rank 0: its shard, the replicated tensors
    and the step counters; DCP spreads replicated tensors over their ranks, so its busiest
    rank writes at most this);
    ``total``, the bytes of the whole checkpoint; ``by_kind``, ``total`` split into
    "params", "optimizer" and "step"; ``ranks``, how many ranks share the writing."""

    per_rank: float
    total: float
    by_kind: dict[str, float]
    ranks: int


def checkpoint_bytes(n_params: float, strategy: str = "dp",
                     layout: Layout | Mapping[str, int] | None = None, *,
                     mixed_precision: bool = False, writers: str = "one",
                     step_tensors: int = 0) -> CheckpointBytes:
    """Bytes a checkpoint of a model of ``n_params`` parameters trained with Adam writes,
    per rank and in total, under ``strategy`` ("dp", "zero1", "zero2", "zero3" or "fsdp")
    and ``layout`` (``Layout(dp=4, tp=2)``; default one rank): see the module docstring.

    ``step_tensors``: the step counters of one model slice (torch's Adam keeps one per
    tensor it steps: the number of parameters for a plain optimizer or FSDP, one per flat
    shard for ``Zero1``), written once per slice like a replicated weight. Shards are
    written without their padding, so ``total`` is exact for any sizes; ``per_rank``
    divides evenly (a rank of an uneven split writes up to one element per tensor more).

    >>> fp32 = checkpoint_bytes(1000, "fsdp", {"dp": 4})
    >>> fp32.total, fp32.per_rank       # 12 bytes a parameter, split 4 ways
    (12000.0, 3000.0)
    >>> checkpoint_bytes(1000, "zero1", {"dp": 4}).per_rank   # 4P whole + 8P / 4
    6000.0
    """
    if strategy not in CHECKPOINT_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(CHECKPOINT_STRATEGIES)}, "
                         f"got {strategy!r}")
    if writers not in WRITERS:
        raise ValueError(f"writers must be 'one' (one copy of a replicated tensor is "
                         f"written) or 'every' (every rank writes its own), got {writers!r}")
    if step_tensors < 0:
        raise ValueError(f"step_tensors must be >= 0, got {step_tensors!r}")
    lay = Layout.of(layout or {})
    if lay["ep"] > 1:
        raise ValueError(f"checkpoint_bytes counts a dense model; {lay} has ep={lay['ep']}")
    copies = lay["dp"] * lay["cp"]  # ranks holding the same model slice
    slices = lay["tp"] * lay["pp"]
    stage = CHECKPOINT_STRATEGIES[strategy]
    mine = model_state_bytes_by_kind(n_params / slices, copies, stage, mixed_precision)
    whole = model_state_bytes_by_kind(n_params / slices, 1, stage, mixed_precision)
    per_rank: dict[str, float] = {}
    total: dict[str, float] = {}
    for kind in SAVED_KINDS:
        sharded = copies > 1 and mine[kind] != whole[kind]
        written = copies if sharded or writers == "every" else 1  # copies of each byte
        per_rank[kind] = mine[kind]
        total[kind] = mine[kind] * written * slices
    per_rank["step"] = step_tensors * STEP_COUNTER_BYTES
    total["step"] = per_rank["step"] * slices * (copies if writers == "every" else 1)
    return CheckpointBytes(sum(per_rank.values()), sum(total.values()), total, lay.world)


def staging_bytes(n_params: float, strategy: str = "dp",
                  layout: Layout | Mapping[str, int] | None = None, *,
                  mixed_precision: bool = False, step_tensors: int = 0) -> float:
    """Bytes of memory the staging copy of an asynchronous save holds on one rank until the
    write ends: everything that rank holds of the checkpoint's state, its shards, its own
    copy of every tensor held whole and its step counters (it copies before DCP decides
    which rank writes a replicated tensor), which is :func:`checkpoint_bytes`' ``per_rank``.
    Shards split evenly here; a rank that copies its padded piece stages up to one element
    per sharded tensor more.

    >>> staging_bytes(1000, "fsdp", {"dp": 4})       # 12 bytes a parameter, a quarter each
    3000.0
    >>> staging_bytes(1000, "zero1", {"dp": 4})      # the weights whole, Adam's state 1/4
    6000.0
    """
    return checkpoint_bytes(n_params, strategy, layout, mixed_precision=mixed_precision,
                            step_tensors=step_tensors).per_rank


def flat_shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Elements [start, stop) of a flat vector of ``numel`` that ``rank`` of ``world_size``
    holds (its real ones, padding excluded), as every sharded state of the course splits
    it: pieces of S = ceil(numel / N), the last ranks short or empty (``torch.chunk``'s rule,
    and a DTensor's ``Shard(0)``).

    >>> [flat_shard_range(10, 4, r) for r in range(4)]
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank!r}, "
                         f"world_size={world_size!r}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel!r}")
    size = -(-numel // world_size)
    return min(numel, rank * size), min(numel, (rank + 1) * size)


def reshard_reads(numel: int, saved_world_size: int, world_size: int,
                  rank: int) -> list[tuple[int, int, int]]:
    """What ``rank`` of ``world_size`` reads to rebuild its piece of a flat vector of
    ``numel`` saved by ``saved_world_size`` ranks: (saved rank, start, stop) global element
    ranges, in order, each the overlap of its piece with one saved piece.

    >>> reshard_reads(10, 4, 3, 1)    # new piece [4, 8): old rank 1's [3, 6), rank 2's [6, 9)
    [(1, 4, 6), (2, 6, 8)]
    """
    lo, hi = flat_shard_range(numel, world_size, rank)
    reads = []
    for saved_rank in range(saved_world_size):
        start, stop = flat_shard_range(numel, saved_world_size, saved_rank)
        if max(lo, start) < min(hi, stop):
            reads.append((saved_rank, max(lo, start), min(hi, stop)))
    return reads


def young_daly_interval(save_time: float, mtbf: float) -> float:
    """Seconds of work between checkpoints that minimise the time lost to saving and to
    failures: sqrt(2 x save_time x mtbf) (Young 1974; Daly 2006: the first-order term of
    his estimate, good while save_time << mtbf). Both in seconds.

    >>> round(young_daly_interval(60, 24 * 3600))   # a 1-minute save, a failure a day
    3220
    """
    _require_positive(save_time=save_time, mtbf=mtbf)
    return math.sqrt(2 * save_time * mtbf)


def checkpoint_overhead_per_hour(interval: float, save_time: float, mtbf: float,
                                 restart_time: float = 0.0) -> dict[str, float]:
    """Expected seconds per hour of work spent writing checkpoints every ``interval``
    seconds ("spent": 3600 x save_time / interval), lost to failures ("lost": 3600 / mtbf
    failures an hour, each losing interval / 2 of work plus ``restart_time``) and their
    "total". At :func:`young_daly_interval` "spent" equals the interval's share of "lost".

    >>> tau = young_daly_interval(60, 24 * 3600)
    >>> {k: round(v) for k, v in checkpoint_overhead_per_hour(tau, 60, 24 * 3600).items()}
    {'spent': 67, 'lost': 67, 'total': 134}
    """
    _require_positive(interval=interval, save_time=save_time, mtbf=mtbf)
    if restart_time < 0:
        raise ValueError(f"restart_time must be >= 0, got {restart_time!r}")
    spent = 3600 * save_time / interval
    lost = 3600 / mtbf * (interval / 2 + restart_time)
    return {"spent": spent, "lost": lost, "total": spent + lost}


def _require_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}")


__all__ = ["CHECKPOINT_STRATEGIES", "CheckpointBytes", "WRITERS", "checkpoint_bytes",
           "checkpoint_overhead_per_hour", "flat_shard_range", "reshard_reads",
           "staging_bytes", "young_daly_interval"]
