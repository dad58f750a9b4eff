"""llm-foundry's two other bf16 tables, in no fit: its FSDP runs on 128 to 512 H100s, where a
cost model that charged too little for sharded data parallelism across many nodes would show
it, and its A100 80GB table, MPT 70B on 32 and 64 GPUs among its rows.

Source: mosaicml/llm-foundry, ``scripts/train/benchmarking/README.md``, the tables "H100 80GB
BF16 (Large Scale, >= 128 GPUs)" (added in commit 5e85bd6, January 2024: MPT 1B to 70B on
128, 256 and 512 H100s, MP ``DEFAULT``, one microbatch a step, the same microbatch at every
GPU count) and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" (every row at
sequence 2048: MPT 70B on 32 and 64 GPUs in MP ``PURE``, the README's older numbers, and
each other size on 8 in MP ``DEFAULT``). FSDP ``FULL_SHARD`` throughout; the columns used
are those of :data:`~parlib.cost.foundry.A100_40GB_ROWS`. The large-scale table names no
network; its rows are read on DGX H100 nodes, as the "H100 80GB BF16" table's are.

None of these rows is in :data:`~parlib.cost.foundry.FOUNDRY_RUNS`, so no fit of the
training shares (:mod:`parlib.cost.calibration`) has seen them.
:func:`foundry_held_out_table` prints each table's rows against the model; per model the MFU
at 512 H100s over that at 128, reported and predicted (:func:`scale_fall`: does the model
fall as the runs fall?); and the trend of every llm-foundry row at sequence 2048 together
(:func:`table_trends`: per model and table, the ratio at its most GPUs over the ratio at its
fewest), both across each model's rows and within one setting (the same microbatch and
checkpointing), since a model's fewest-GPU and most-GPU rows often ran different settings and
a trend across them mixes the two.
"""

from __future__ import annotations

from dataclasses import replace

from parlib.cost.foundry import FOUNDRY_RUNS, TARGET_TREND, foundry_run, trends
from parlib.cost.published import TARGET_BAND, PublishedRun, comparison_table

_README = "MosaicML llm-foundry, scripts/train/benchmarking/README.md"
# (size, GPUs, microbatch, grad accum, global batch, T/s/GPU, activation checkpointing)
H100_LARGE_SCALE_ROWS = (
    ("70b", 512, 8, 1, 4096, 1007, True), ("70b", 256, 8, 1, 2048, 1035, True),
    ("70b", 128, 8, 1, 1024, 1058, True),
    ("30b", 512, 8, 1, 4096, 2115, True), ("30b", 256, 8, 1, 2048, 2148, True),
    ("30b", 128, 8, 1, 1024, 2199, True),
    ("13b", 512, 16, 1, 8192, 4952, True), ("13b", 256, 16, 1, 4096, 4989, True),
    ("13b", 128, 16, 1, 2048, 5080, True),
    ("7b", 512, 6, 1, 3072, 9670, False), ("7b", 256, 6, 1, 1536, 10119, False),
    ("7b", 128, 6, 1, 768, 10475, False),
    ("3b", 512, 8, 1, 4096, 21664, False), ("3b", 256, 8, 1, 2048, 22772, False),
    ("3b", 128, 8, 1, 1024, 23422, False),
    ("1b", 512, 12, 1, 6144, 39837, False), ("1b", 256, 12, 1, 3072, 42555, False),
    ("1b", 128, 12, 1, 1536, 44123, False),
)
# The A100 80GB table at sequence 2048, the same columns and then the MP mode.
A100_80GB_ROWS = (
    ("70b", 64, 8, 4, 2048, 410, True, "PURE"), ("70b", 32, 2, 16, 1024, 373, True, "PURE"),
    ("30b", 8, 3, 21, 504, 916, True, "DEFAULT"), ("13b", 8, 2, 3, 48, 2262, False, "DEFAULT"),
    ("7b", 8, 6, 2, 96, 4641, False, "DEFAULT"), ("3b", 8, 10, 2, 160, 10811, False, "DEFAULT"),
    ("1b", 8, 14, 4, 448, 20513, False, "DEFAULT"),
    ("760m", 8, 24, 2, 384, 32434, False, "DEFAULT"),
    ("350m", 8, 32, 2, 512, 58782, False, "DEFAULT"),
    ("125m", 8, 40, 2, 640, 142830, False, "DEFAULT"),
    ("125m", 8, 32, 2, 512, 141737, False, "DEFAULT"),
)


def _row_source(table: str, size: str, gpus: int, micro: int, accum: int, batch: int,
                tokens: int, checkpointing: bool, mode: str) -> str:
    return (f"{_README}, {table}: {size}, seq 2048, {gpus} GPUs, microbatch {micro}, accum "
            f"{accum}, global batch {batch}, AC {checkpointing}, {tokens} T/s/GPU, MP {mode}")


def large_scale_run(size: str, gpus: int, micro: int, accum: int, batch: int,
                    tokens_per_gpu: int, checkpointing: bool) -> PublishedRun:
    """A row of the large-scale table, read as :func:`~parlib.cost.foundry.foundry_run`
    reads the H100 table's."""
    run = foundry_run(size, gpus, micro, accum, batch, tokens_per_gpu, checkpointing, "H100")
    return replace(run, source=_row_source(
        "H100 80GB BF16 (Large Scale, >= 128 GPUs)", size, gpus, micro, accum, batch,
        tokens_per_gpu, checkpointing, "DEFAULT"))


def a100_80gb_run(size: str, gpus: int, micro: int, accum: int, batch: int,
                  tokens_per_gpu: int, checkpointing: bool, mode: str) -> PublishedRun:
    """A row of the A100 80GB table, on DGX A100 80GB nodes: :func:`~parlib.cost.foundry.
    foundry_run`'s reading, gradients reduced in bf16 for MP "PURE" as in the A100 40GB
    table, in fp32 for "DEFAULT"."""
    if mode not in ("PURE", "DEFAULT"):
        raise ValueError(f"mode must be 'PURE' or 'DEFAULT', got {mode!r}")
    run = foundry_run(size, gpus, micro, accum, batch, tokens_per_gpu, checkpointing,
                      "A100 80GB")
    return replace(run, name=f"MPT {size}, {gpus} A100 80GB RoCE, microbatch {micro}",
                   settings={**run.settings, "grad_reduce_bytes": 2 if mode == "PURE" else 4},
                   source=_row_source("A100 80GB with 1600 Gbps node-node interconnect (RoCE)",
                                      size, gpus, micro, accum, batch, tokens_per_gpu,
                                      checkpointing, mode))


# Not in FOUNDRY_RUNS: no fit of the training shares sees them.
LARGE_SCALE_RUNS = tuple(large_scale_run(*row) for row in H100_LARGE_SCALE_ROWS)
A100_80GB_RUNS = tuple(a100_80gb_run(*row) for row in A100_80GB_ROWS)


def scale_fall(runs: tuple[PublishedRun, ...] = LARGE_SCALE_RUNS
               ) -> dict[str, tuple[int, int, float, float]]:
    """Per model: (fewest GPUs, most, reported MFU at the most over at the fewest, the same
    predicted). Both below 1 and alike: the model falls as the runs fall."""
    out = {}
    for name in dict.fromkeys(run.model.name for run in runs):
        rows = sorted((run for run in runs if run.model.name == name),
                      key=lambda run: run.layout.world)
        if len(rows) > 1:
            few, most = rows[0], rows[-1]
            out[name] = (few.layout.world, most.layout.world, most.reported / few.reported,
                         most.predicted() / few.predicted())
    return out


def _table(run: PublishedRun) -> str:
    """A run's table as its GPU: "MPT 13b, H100 80GB" (the large-scale table's H100s are the
    H100 table's; the A100s come in 40 and 80 GB)."""
    return (f"{run.model.name}, {run.hardware.generation} "
            f"{run.hardware.memory_bytes / 1e9:.0f}GB")


def _setting(run: PublishedRun) -> str:
    return (f"{_table(run)}, microbatch {run.estimate().micro_batch}, "
            f"AC {run.settings['recompute'] is True}")


def table_trends(runs: tuple[PublishedRun, ...]) -> dict[str, tuple[int, int, float]]:
    """:func:`~parlib.cost.foundry.trends` per model and GPU ("MPT 13b, H100 80GB"): the
    A100s' two memories apart, the H100 tables together."""
    return trends(runs, _table)


def setting_trends(runs: tuple[PublishedRun, ...]) -> dict[str, tuple[int, int, float]]:
    """:func:`~parlib.cost.foundry.trends` within one setting ("MPT 13b, H100 80GB,
    microbatch 16, AC True")."""
    return trends(runs, _setting)


def _trend_line(label: str, trend: dict[str, tuple[int, int, float]]) -> str:
    misses = [f"{key} {small}-{large}: {change:.2f}"
              for key, (small, large, change) in trend.items() if abs(change - 1) > TARGET_TREND]
    within = len(trend) - len(misses)
    return (f"every llm-foundry row at sequence 2048, {label}: {within} of {len(trend)} within "
            f"{TARGET_TREND:.0%} of their fewest GPUs' ratio"
            + (f"; outside: {'; '.join(misses)}" if misses else ""))


def foundry_held_out_table(fitted: tuple[PublishedRun, ...] = FOUNDRY_RUNS,
                           band: tuple[float, float] = TARGET_BAND) -> str:
    """Each table's rows against the model (:func:`~parlib.cost.published.comparison_table`);
    per model the fall from 128 H100s to 512 (:func:`scale_fall`); then the trend over
    ``fitted`` and these rows together, per model and per setting, each miss named."""
    lines = [comparison_table(LARGE_SCALE_RUNS, band), "", comparison_table(A100_80GB_RUNS, band),
             "", f"{'model':<10} {'H100s':>8} {'MFU at most / at fewest: reported':>34} "
                 f"{'predicted':>9}"]
    for name, (few, most, reported, predicted) in scale_fall().items():
        lines.append(f"{name:<10} {few:>3}-{most:<4} {reported:>34.3f} {predicted:>9.3f}")
    every = fitted + LARGE_SCALE_RUNS + A100_80GB_RUNS
    lines.append(_trend_line("per model", table_trends(every)))
    lines.append(_trend_line("per setting", setting_trends(every)))
    return "\n".join(lines)


__all__ = ["A100_80GB_ROWS", "A100_80GB_RUNS", "H100_LARGE_SCALE_ROWS", "LARGE_SCALE_RUNS",
           "a100_80gb_run", "foundry_held_out_table", "large_scale_run", "scale_fall",
           "setting_trends", "table_trends"]
