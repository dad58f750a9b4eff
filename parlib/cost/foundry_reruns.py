"""llm-foundry's own second runs of its A100 40GB layouts: how far one table row moves when
the same layout runs again, beside how far the cost model is from it.

Source: mosaicml/llm-foundry, ``scripts/train/benchmarking/torch2.md`` (commit 985460c,
August 2023): one node of 8 A100 40GB, FSDP ``FULL_SHARD``, MP ``PURE``, the columns of the
README's tables, run on a later software stack than the README's A100 40GB table (its rows
date from before May 2023; the README above its tables reads "TODO: Update tables with torch
2.0").
Six of its layouts at sequence 2048 repeat a row of the README's A100 40GB table: model,
GPU count, microbatch, accumulation and activation checkpointing all the same
(:data:`RERUN_ROWS`), three of them run twice. (The file repeats itself too: MPT 125M at
microbatch 24, accumulation 3, no checkpointing, six runs at 104,410-134,605 tokens/s/GPU; no
README row has that layout.)

:func:`rerun_spread` is each re-run's tokens/s over the README's for the same layout;
:func:`rerun_trends` the trend of :func:`parlib.cost.foundry.trends` (ratio at a model's most
GPUs over the ratio at its fewest) with the README's 8-GPU row replaced by each re-run in
turn. Where two readings of one layout differ by more than
:data:`~parlib.cost.foundry.TARGET_TREND`, a trend that misses the target by less than that
cannot tell the model's error from the table's.
"""

from __future__ import annotations

from dataclasses import replace

from parlib.cost.foundry import (
    A100_40GB_ROWS,
    FOUNDRY_RUNS,
    TARGET_TREND,
    foundry_run,
    trends,
)
from parlib.cost.published import PublishedRun

_SOURCE = "MosaicML llm-foundry, scripts/train/benchmarking/torch2.md (commit 985460c)"
RERUN_GPUS = 8
# torch2.md's A100 40GB rows at sequence 2048 whose layout is a README row's, all on 8 GPUs:
# (size, T/s/GPU of each run). Its other rows change the checkpointing, the microbatch or the
# accumulation of every README layout they share a model with, so they repeat none.
RERUN_ROWS = (("13b", (1948,)), ("7b", (3643,)), ("3b", (9958,)), ("1b", (19264, 19143)),
              ("760m", (29381, 29642)), ("350m", (41294, 44925)))


def readme_row(size: str) -> tuple:
    """The README's A100 40GB row of ``size`` on :data:`RERUN_GPUS` GPUs
    (:data:`~parlib.cost.foundry.A100_40GB_ROWS`)."""
    rows = [row for row in A100_40GB_ROWS if row[0] == size and row[1] == RERUN_GPUS]
    if not rows:
        raise ValueError(f"the README's A100 40GB table has no {size!r} row on {RERUN_GPUS} "
                         f"GPUs; it has {sorted({row[0] for row in A100_40GB_ROWS})}")
    return rows[0]


def rerun_run(size: str, tokens_per_gpu: int) -> PublishedRun:
    """A re-run of the README's 8-GPU layout of ``size`` that made ``tokens_per_gpu``: the
    README row as :func:`~parlib.cost.foundry.foundry_run` reads it, with the re-run's rate."""
    _, gpus, micro, accum, batch, _, checkpointing = readme_row(size)
    run = foundry_run(size, gpus, micro, accum, batch, tokens_per_gpu, checkpointing, "A100")
    return replace(run, name=f"{run.name} (re-run)",
                   source=(f"{_SOURCE}: {size}, seq 2048, {gpus} A100 40GB, microbatch {micro},"
                           f" accum {accum}, AC {checkpointing}, {tokens_per_gpu} T/s/GPU, "
                           f"MP PURE"))


def rerun_spread(rows: tuple = RERUN_ROWS) -> dict[str, tuple[float, ...]]:
    """Per model size: each re-run's tokens/s over the README's for the same layout."""
    return {size: tuple(tokens / readme_row(size)[5] for tokens in readings)
            for size, readings in rows}


def _key(size: str) -> str:
    return f"MPT {size}, A100"


def rerun_trends(rows: tuple = RERUN_ROWS,
                 runs: tuple[PublishedRun, ...] = FOUNDRY_RUNS
                 ) -> dict[str, tuple[float, tuple[float, ...]]]:
    """Per model ("MPT 13b, A100"): (its trend over ``runs``, the README's rows; its trend
    with the README's 8-GPU row replaced by each re-run in turn)."""
    readme = trends(runs)
    out = {}
    for size, readings in rows:
        others = tuple(run for run in runs if not (
            run.model.name == f"MPT {size}" and run.hardware.generation == "A100"
            and run.layout.world == RERUN_GPUS))
        swapped = tuple(trends(others + (rerun_run(size, tokens),))[_key(size)][2]
                        for tokens in readings)
        out[_key(size)] = (readme[_key(size)][2], swapped)
    return out


def _within(trend: float) -> bool:
    return abs(trend - 1) <= TARGET_TREND


def rerun_table(rows: tuple = RERUN_ROWS) -> str:
    """Per layout: the table's (the README's) tokens/s and the re-runs', re-run over table,
    the model's reported / predicted for each reading and its trend with each; then how far
    the readings of one layout spread against the trend target."""
    spread, trend = rerun_spread(rows), rerun_trends(rows)
    lines = [f"{'model, 8 A100 40GB':<19} {'table':>7} {'re-runs':>13} {'re-run/table':>13} "
             f"{'r/p table':>10} {'r/p re-runs':>11} {'trend table':>12} "
             f"{'trend re-runs':>13}"]
    for size, readings in rows:
        readme = foundry_run(*readme_row(size), generation="A100")
        reruns = [rerun_run(size, tokens) for tokens in readings]
        at_readme, swapped = trend[_key(size)]
        lines.append(
            f"{'MPT ' + size:<19} {readme_row(size)[5]:>7} "
            f"{', '.join(map(str, readings)):>13} "
            f"{', '.join(f'{r:.2f}' for r in spread[size]):>13} {readme.ratio():>10.2f} "
            f"{', '.join(f'{run.ratio():.2f}' for run in reruns):>11} {at_readme:>12.2f} "
            f"{', '.join(f'{t:.2f}' for t in swapped):>13}")
    moves = [r for size in spread for r in spread[size]]
    beyond = sum(any(not _within(r) for r in spread[size]) for size in spread)
    met_readme = sum(_within(at) for at, _ in trend.values())
    met_each = sum(all(_within(t) for t in swapped) for _, swapped in trend.values())
    lines.append(f"re-runs at {min(moves):.2f}-{max(moves):.2f} of llm-foundry's table; "
                 f"{beyond} of {len(rows)} layouts move by more than the trend target's "
                 f"{TARGET_TREND:.0%}")
    lines.append(f"trend within {TARGET_TREND:.0%} for {met_readme} of {len(rows)} of these "
                 f"models with the table's rows, for {met_each} with every re-run in their "
                 f"place")
    return "\n".join(lines)


__all__ = ["RERUN_GPUS", "RERUN_ROWS", "readme_row", "rerun_run", "rerun_spread",
           "rerun_table", "rerun_trends"]
