"""MosaicML llm-foundry's FSDP benchmarks: every model size at every GPU count, held against
the cost model.

Source: mosaicml/llm-foundry, ``scripts/train/benchmarking/README.md``, the tables
"A100 40GB with 1600 Gbps node-node interconnect (RoCE)" and "H100 80GB BF16": MPT models
(125M to 70B) trained with FSDP ``FULL_SHARD`` in bf16. We take every row at sequence length
2048, the length at which the tables sweep the GPU count (8 to 128 A100s, 8 to 64 H100s), so
each model size is seen at each GPU count it was run at. Columns used: model, # GPUs,
MicroBatchSize, GradAccum, GlobalBatchSize, Throughput (T/s/GPU), MP Mode, Activation
Checkpointing, NumParams. The shapes are the repository's ``scripts/train/yamls/pretrain/
mpt-*.yaml`` (d_model, n_heads, n_layers; vocabulary 50,368, tied output, learned
positions); with them our parameter count equals the table's NumParams for every size.
The README's two other bf16 tables (128-512 H100s; A100 80GB) are kept out of every fit, in
:mod:`parlib.cost.foundry_held_out`.

Every row is predicted with the hardware presets as they are (one set of efficiencies per
device generation, nothing fitted to a row or to this table): reported / predicted near 1
means the model accounts for the run's time. :func:`foundry_table` prints the rows, the
share inside :data:`~parlib.cost.published.TARGET_BAND` and, per model, the ratio at its
largest GPU count over the ratio at its smallest (the trend: 1 when the model follows how
the runs slow as they spread).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

from parlib.cost.avoided import zero3_caution
from parlib.cost.estimate import Estimate
from parlib.cost.hardware import GB, Hardware
from parlib.cost.layout import Layout
from parlib.cost.model import Model
from parlib.cost.published import MOSAIC_RUNS, RUNS, TARGET_BAND, PublishedRun, comparison_table
from parlib.cost.sweeps import spearman

_SOURCE = "MosaicML llm-foundry, scripts/train/benchmarking/README.md"
# (n_layers, d_model, n_heads) of scripts/train/yamls/pretrain/mpt-<size>.yaml
MPT_SHAPES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12),
              "1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32),
              "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
# The trend target: per model, ratio at its largest GPU count within 15% of its smallest's.
TARGET_TREND = 0.15
# The in-band share the course asks of these rows.
TARGET_SHARE = 0.8

# "A100 40GB with 1600 Gbps node-node interconnect (RoCE)", sequence 2048, all rows:
# (size, GPUs, microbatch, grad accum, global batch, T/s/GPU, activation checkpointing)
A100_40GB_ROWS = (
    ("70b", 128, 4, 1, 512, 376, True), ("70b", 64, 2, 1, 128, 276, True),
    ("30b", 128, 6, 1, 768, 865, True), ("30b", 32, 4, 1, 128, 857, True),
    ("13b", 128, 16, 1, 2048, 1972, True), ("13b", 64, 16, 1, 1024, 1976, True),
    ("13b", 32, 14, 1, 448, 1998, True), ("13b", 16, 10, 1, 160, 1993, True),
    ("13b", 8, 4, 16, 512, 1668, True),
    ("7b", 128, 18, 1, 2304, 3623, True), ("7b", 64, 18, 1, 1152, 3665, True),
    ("7b", 32, 18, 1, 576, 3725, True), ("7b", 16, 16, 1, 256, 3645, True),
    ("7b", 8, 12, 4, 384, 3679, True),
    ("3b", 128, 6, 1, 768, 9538, False), ("3b", 64, 6, 1, 384, 9736, False),
    ("3b", 32, 6, 1, 192, 9914, False), ("3b", 16, 5, 1, 80, 9750, False),
    ("3b", 8, 5, 8, 320, 10065, False),
    ("1b", 128, 10, 1, 1280, 18647, False), ("1b", 64, 10, 1, 640, 19001, False),
    ("1b", 32, 10, 1, 320, 15555, False), ("1b", 16, 8, 1, 128, 19085, False),
    ("1b", 8, 8, 8, 512, 19271, False),
    ("760m", 128, 12, 1, 1536, 28940, False), ("760m", 64, 12, 1, 768, 29344, False),
    ("760m", 32, 12, 1, 384, 29648, False), ("760m", 16, 12, 1, 192, 29607, False),
    ("760m", 8, 12, 4, 384, 30173, False),
    ("350m", 128, 18, 1, 2304, 51934, False), ("350m", 64, 18, 1, 1152, 52689, False),
    ("350m", 32, 18, 1, 576, 53811, False), ("350m", 16, 18, 1, 288, 55413, False),
    ("350m", 8, 16, 4, 512, 55995, False),
    ("125m", 128, 26, 1, 3328, 123936, False), ("125m", 64, 26, 1, 1664, 125234, False),
    ("125m", 32, 26, 1, 832, 127122, False), ("125m", 16, 26, 1, 416, 130535, False),
    ("125m", 8, 26, 3, 624, 136334, False),
)
# "H100 80GB BF16", sequence 2048, all rows (same columns).
H100_80GB_ROWS = (
    ("70b", 64, 8, 4, 2048, 1039, True), ("70b", 32, 2, 16, 1024, 882, True),
    ("30b", 32, 14, 3, 1344, 2308, True), ("30b", 16, 10, 3, 480, 2263, True),
    ("30b", 8, 3, 21, 504, 2002, True),
    ("13b", 64, 2, 1, 128, 4800, False), ("13b", 32, 2, 1, 64, 4811, False),
    ("13b", 16, 2, 1, 32, 4767, False), ("13b", 8, 2, 1, 16, 4792, False),
    ("7b", 8, 6, 1, 48, 10643, False),
    ("3b", 64, 6, 3, 1152, 22525, False), ("3b", 32, 6, 3, 576, 23021, False),
    ("3b", 16, 10, 3, 480, 24142, False),
    ("1b", 64, 20, 1, 1280, 44402, False), ("1b", 32, 20, 1, 640, 45130, False),
    ("1b", 16, 20, 1, 320, 46037, False), ("1b", 8, 14, 1, 112, 45455, False),
    ("760m", 32, 24, 1, 768, 67971, False), ("760m", 16, 24, 1, 384, 68551, False),
    ("760m", 8, 24, 2, 384, 63147, False),
)


def a100_40gb(n_devices: int) -> Hardware:
    """MosaicML's A100 40GB nodes: a DGX A100's NVLink and 8 GPUs, 40 GB each (A100 40GB
    datasheet: 1,555 GB/s of HBM2), 1600 Gb/s of RoCE a node (the table's title): 200 GB/s,
    25 GB/s a GPU, as the DGX A100 preset's InfiniBand."""
    return Hardware.dgx_a100(n_devices, memory_bytes=40 * GB, memory_bandwidth=1555 * GB,
                             name="A100 40GB, 1600 Gb/s RoCE")


def mpt(size: str, seq_len: int = 2048) -> Model:
    """The MPT model of ``size`` ("125m" ... "70b") at ``seq_len`` (2048 unless given)."""
    if size not in MPT_SHAPES:
        raise ValueError(f"no MPT model of size {size!r}: llm-foundry's tables have "
                         f"{', '.join(MPT_SHAPES)}")
    layers, hidden, heads = MPT_SHAPES[size]
    return Model(layers, hidden, heads, seq_len, 50368, tied_embeddings=True,
                 name=f"MPT {size}")


# Per generation name: its nodes, the table's mixed-precision mode and the bytes a gradient is
# reduced in. "A100" is the A100 40GB table; "A100 80GB" the microbatch sweep's nodes.
_GENERATIONS = {"A100": (a100_40gb, "PURE", 2), "A100 80GB": (Hardware.dgx_a100, "DEFAULT", 4),
                "H100": (Hardware.dgx_h100, "DEFAULT", 4)}


def foundry_run(size: str, gpus: int, micro: int, accum: int, batch: int, tokens_per_gpu: int,
                checkpointing: bool, generation: str, seq_len: int = 2048) -> PublishedRun:
    """One table row as a :class:`PublishedRun`: FSDP FULL_SHARD as ZeRO-3 over all GPUs,
    activation checkpointing as full recomputation and none as "selective", attention fused
    either way (``fused_attention``: the README says "our models use Flash Attention", so no
    row streams s x s scores), MFU recomputed from T/s/GPU with our FLOPs per token.
    The A100 table's "PURE" bf16 reduces gradients in bf16; the H100 table's and the
    microbatch sweep's (``generation`` "A100 80GB") "DEFAULT" reduces them in fp32
    (``grad_reduce_bytes=4``). A global batch that is not micro x
    accum x GPUs (Composer's microbatching splits unevenly) is rounded to m = accum
    microbatches of the table's microbatch size. ``seq_len``: the row's sequence length (the
    tables' sweeps of it, :mod:`parlib.cost.foundry_sequence`)."""
    if generation not in _GENERATIONS:
        raise ValueError(f"generation must be one of {', '.join(map(repr, _GENERATIONS))}, "
                         f"got {generation!r}")
    model = mpt(size, seq_len)
    nodes, mode, reduce = _GENERATIONS[generation]
    hardware = nodes(gpus)
    ours = tokens_per_gpu * model.flops_per_token / hardware.peak_flops
    settings = dict(m=accum, global_batch=micro * accum * gpus, zero=3,
                    recompute=True if checkpointing else "selective",
                    grad_reduce_bytes=reduce, fused_attention=True, loss="fused")
    return PublishedRun(
        name=f"MPT {size}, {gpus} {generation}",
        source=(f"{_SOURCE}, {generation} table: {size}, seq {seq_len}, {gpus} GPUs, microbatch "
                f"{micro}, accum {accum}, global batch {batch}, AC {checkpointing}, "
                f"{tokens_per_gpu} T/s/GPU, MP {mode}"),
        model=model, hardware=hardware, layout=Layout(dp=gpus), settings=settings,
        metric="mfu", reported=ours, reported_tflops_per_device=None,
        reported_tokens_per_second_per_device=tokens_per_gpu,
        assumed=("FSDP FULL_SHARD as ZeRO-3 (a layer a unit); AC as full recomputation, "
                 "none as 'selective'; Flash attention in both; MFU recomputed from T/s/GPU "
                 "with our FLOP count"),
        cannot_know="MosaicML's cluster beyond the table's title; its software versions",
        reported_params=round(model.n_params / 1e9, 3))


FOUNDRY_RUNS = (tuple(foundry_run(*row, generation="A100") for row in A100_40GB_ROWS)
                + tuple(foundry_run(*row, generation="H100") for row in H100_80GB_ROWS))


# scripts/train/benchmarking/larger_mb_1.md (commit beb8dee): one node of 8 A100 80GB, FSDP
# FULL_SHARD, no activation checkpointing, MP DEFAULT, sequence 2048, 2 microbatches a step,
# only the microbatch size changed: (size, microbatch, T/s/GPU). Its 3b rows are left out: one
# is a single size on A100 40GB, two offload activations to the CPU (no term here for that).
MICROBATCH_SWEEP_ROWS = (("13b", 2, 2228), ("13b", 1, 1867),
                         ("7b", 6, 4715), ("7b", 4, 4513), ("7b", 2, 4044), ("7b", 1, 3366))
_SWEEP_SOURCE = "MosaicML llm-foundry, scripts/train/benchmarking/larger_mb_1.md (commit beb8dee)"


def microbatch_run(size: str, micro: int, tokens_per_gpu: int) -> PublishedRun:
    """One row of llm-foundry's microbatch sweep (:data:`MICROBATCH_SWEEP_ROWS`): 8 A100 80GB,
    2 microbatches of ``micro`` sequences a step, as :func:`foundry_run` reads a table row."""
    run = foundry_run(size, 8, micro, 2, micro * 2 * 8, tokens_per_gpu, False, "A100 80GB")
    return replace(run, name=f"MPT {size}, 8 A100 80GB, microbatch {micro}",
                   source=(f"{_SWEEP_SOURCE}: {size}, seq 2048, 8 A100 80GB, microbatch {micro},"
                           f" accum 2, AC False, {tokens_per_gpu} T/s/GPU, MP DEFAULT"))


# Not in FOUNDRY_RUNS: no fit of the training shares (parlib.cost.calibration) sees them.
MICROBATCH_RUNS = tuple(microbatch_run(*row) for row in MICROBATCH_SWEEP_ROWS)


def _ends(groups: dict[str, list[tuple[int, float]]]) -> dict[str, tuple[int, int, float]]:
    """Per group of (x, reported / predicted) points seen at two or more x: (smallest x,
    largest x, the ratio at the largest over the ratio at the smallest)."""
    out = {}
    for key, points in groups.items():
        points = sorted(points)
        if len(points) > 1:
            (small, r_small), (large, r_large) = points[0], points[-1]
            out[key] = (small, large, r_large / r_small)
    return out


def microbatch_sweep_lean(runs: tuple[PublishedRun, ...] = MICROBATCH_RUNS
                          ) -> dict[str, tuple[int, int, float, float]]:
    """Per model: (smallest microbatch, largest, lean, Spearman correlation of predicted and
    reported tokens/s over its rows). The lean is measured / predicted step time at the
    smallest microbatch over the same at the largest, the measure of
    :func:`parlib.cost.sweeps.microbatch_lean`, so the two sources read alike: above 1, the
    model charges the smaller microbatch too little against the larger."""
    ratios: dict[str, list[tuple[int, float]]] = {}
    rates: dict[str, list[tuple[float, float]]] = {}  # (predicted, reported)
    for run in runs:
        est = run.estimate()
        ratios.setdefault(run.model.name, []).append((est.micro_batch, run.ratio(est)))
        rates.setdefault(run.model.name, []).append((run.predicted(est), run.reported))
    return {name: (small, large, lean, spearman([p for p, _ in rates[name]],
                                                [r for _, r in rates[name]]))
            for name, (small, large, lean) in _ends(ratios).items()}


def microbatch_table(runs: tuple[PublishedRun, ...] = MICROBATCH_RUNS,
                     band: tuple[float, float] = TARGET_BAND) -> str:
    """The sweep's rows (:func:`~parlib.cost.published.comparison_table`), then per model the
    lean from its smallest microbatch to its largest and the order's rank correlation."""
    rows = [comparison_table(runs, band), "",
            f"{'model':<10} {'microbatch':>10} {'lean':>5} {'spearman':>8}"]
    for name, (small, large, lean, rho) in microbatch_sweep_lean(runs).items():
        rows.append(f"{name:<10} {small:>4} to {large:<2} {lean:>5.2f} {rho:>8.2f}")
    return "\n".join(rows)


def _model_and_generation(run: PublishedRun) -> str:
    return f"{run.model.name}, {run.hardware.generation}"


def trends(runs: tuple[PublishedRun, ...] = FOUNDRY_RUNS,
           key: Callable[[PublishedRun], str] = _model_and_generation
           ) -> dict[str, tuple[int, int, float]]:
    """Per model and table ("MPT 7b, A100"; another grouping by ``key``): (smallest GPU
    count, largest, ratio at the largest over ratio at the smallest). Groups seen at one
    count only are left out."""
    groups: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        groups.setdefault(key(run), []).append((run.layout.world, run.ratio()))
    return _ends(groups)


def in_band_share(runs: tuple[PublishedRun, ...] = FOUNDRY_RUNS,
                  band: tuple[float, float] = TARGET_BAND) -> float:
    """The share of ``runs`` whose reported / predicted lies in ``band``."""
    low, high = band
    return sum(low <= run.ratio() <= high for run in runs) / len(runs)


# A prediction this much above the best published MFU of its generation must say why.
ABOVE_BEST = 0.10


def best_published(generation: str,
                   runs: tuple[PublishedRun, ...] | None = None) -> PublishedRun:
    """The run with the highest reported MFU on ``generation`` ("A100", "H100") among
    :data:`parlib.cost.published.RUNS` and :data:`FOUNDRY_RUNS` (MFU rows only: HFU counts
    recomputation)."""
    pool = [r for r in (runs if runs is not None else RUNS + FOUNDRY_RUNS)
            if r.metric == "mfu" and r.hardware.generation == generation]
    if not pool:
        raise ValueError(f"no published MFU on {generation!r}")
    return max(pool, key=lambda r: r.reported)


def ratio_band(generation: str) -> tuple[float, float, float]:
    """(lowest, median, highest) reported / predicted over every published row on
    ``generation`` (:data:`~parlib.cost.published.RUNS` and :data:`FOUNDRY_RUNS`, llm-foundry's
    two MosaicML rows counted once): the model's error band on that generation."""
    return low_median_high([r.ratio() for r in published_rows(generation)])


def low_median_high(values: list[float]) -> tuple[float, float, float]:
    """(lowest, median, highest) of ``values`` (at least one)."""
    return min(values), statistics.median(values), max(values)


def published_rows(generation: str) -> tuple[PublishedRun, ...]:
    """Every published row on ``generation`` (:data:`RUNS` and :data:`FOUNDRY_RUNS`,
    llm-foundry's two MosaicML rows in ``RUNS`` counted once): the rows the training shares
    are fitted to (:mod:`parlib.cost.calibration`). A ValueError for a generation with none."""
    mosaic = {run.name for run in MOSAIC_RUNS}
    rows = tuple(r for r in RUNS + FOUNDRY_RUNS
                 if r.hardware.generation == generation and r.name not in mosaic)
    if not rows:
        raise ValueError(f"no published rows on {generation!r}")
    return rows


def most_matmul(generation: str) -> float:
    """The highest share of its step a published row on ``generation`` spends in matmuls
    (``compute``), as the model predicts it: how far the fitted shares were tested."""
    return max(e.time["compute"] / e.step_time
               for e in (r.estimate() for r in published_rows(generation)))


def above_best(mfu: float, generation: str) -> float:
    """How far a predicted ``mfu`` is above the best MFU published on ``generation``
    (:func:`best_published`), as a fraction: 0.1 is 10% above it, negative below it."""
    return mfu / best_published(generation).reported - 1


def against_published(mfu: float, generation: str, est: Estimate | None = None) -> str:
    """One sentence holding a predicted ``mfu`` against the best MFU published on its
    ``generation`` (:func:`best_published`), and, when it is more than :data:`ABOVE_BEST`
    above it, why: the band the published rows of that generation came in at
    (:func:`ratio_band`), that band applied to this prediction, and, given the prediction's
    :class:`~parlib.cost.estimate.Estimate` ``est``, its share of matmul time against the
    highest among those rows (:func:`most_matmul`: a step more matmul than any of them is
    beyond what the fitted shares were tested on). Given a ZeRO-3 ``est`` across nodes,
    whatever its MFU, it adds the band of the published ZeRO-3 runs at scale
    (:func:`parlib.cost.avoided.zero3_caution`)."""
    best = best_published(generation)
    above = above_best(mfu, generation)
    text = (f"predicted MFU {mfu:.0%} against the best published on {generation} among the "
            f"rows its shares are fitted to, {best.reported:.0%} ({best.name})")
    if above <= 0:
        text += ": at or below it."
    elif above <= ABOVE_BEST:
        text += f": {above:.0%} above it, within {ABOVE_BEST:.0%}."
    else:
        low, median, high = ratio_band(generation)
        text += (f": {above:.0%} above it. Why: the model's {generation} shares are fitted to "
                 f"published runs, which came in at {low:.2f}-{high:.2f} of its predictions "
                 f"(median {median:.2f}); held to that band this one is "
                 f"{low * mfu:.0%}-{high * mfu:.0%}.")
        if est is not None:
            ours, tested = est.time["compute"] / est.step_time, most_matmul(generation)
            text += (f" Its step is {ours:.0%} matmul; the most of any of those runs is "
                     f"{tested:.0%}" + (": this one is beyond what the shares were tested on."
                                        if ours > tested else "."))
    caution = zero3_caution(est) if est is not None else ""
    return text + (f" {caution}" if caution else "")


def foundry_table(runs: tuple[PublishedRun, ...] = FOUNDRY_RUNS,
                  band: tuple[float, float] = TARGET_BAND) -> str:
    """Each row's predicted and reported MFU and their ratio and the in-band share
    (:func:`~parlib.cost.published.comparison_table`), then the trend per model (ratio at
    the largest GPU count over the smallest's)."""
    rows = [comparison_table(runs, band, target=TARGET_SHARE), ""]
    rows.append(f"{'model':<22} {'GPUs':>9} {'ratio at most / at fewest GPUs':>31}")
    trend = trends(runs)
    within = 0
    for key, (small, large, change) in trend.items():
        within += abs(change - 1) <= TARGET_TREND
        rows.append(f"{key:<22} {small:>4}-{large:<4} {change:>31.2f}")
    rows.append(f"{within} of {len(trend)} models within {TARGET_TREND:.0%} of their fewest "
                f"GPUs' ratio")
    return "\n".join(rows)


__all__ = ["A100_40GB_ROWS", "ABOVE_BEST", "FOUNDRY_RUNS", "H100_80GB_ROWS", "MICROBATCH_RUNS",
           "MICROBATCH_SWEEP_ROWS", "MPT_SHAPES", "TARGET_SHARE", "TARGET_TREND", "a100_40gb",
           "above_best", "against_published", "best_published", "foundry_run", "foundry_table",
           "in_band_share", "low_median_high", "microbatch_sweep_lean", "microbatch_run",
           "microbatch_table", "most_matmul", "mpt", "published_rows", "ratio_band", "trends"]
