"""What a training step reaches of the achievable rates: two fractions per device generation,
fitted to every published run of that generation at once.

The efficiency table (:mod:`parlib.cost.efficiency`) starts from ceilings: the best measured
matmul (MAMF) and the datasheet's memory bandwidth. Held against published runs with only
those, the model was optimistic everywhere: llm-foundry's FSDP runs reached a median 0.81
of its prediction on A100s and 0.68 on H100s, Megatron-LM's runs 0.85-0.89. Two things a
training step does are not in the ceilings:

- its matmuls (forward, the input's and the weights' gradients, at the step's shapes, with
  the framework around them) run below the best shape's rate: ``matmul``, a fraction of MAMF;
- its memory-bound work (norms, activations, residual adds, the casts and copies a stack adds,
  and the gaps between those small kernels) takes longer than the bytes the model counts
  (:func:`~parlib.cost.memory.memory_bound_bytes_per_layer`: each element touched once, as
  fused kernels would) streamed at the datasheet rate: ``memory``, the fraction of the
  datasheet bandwidth those counted bytes move at.

:func:`fit` finds both for one generation by least squares in log(reported / predicted) over
every published row of that generation (:func:`~parlib.cost.foundry.published_rows`:
:data:`~parlib.cost.published.RUNS` and :data:`~parlib.cost.foundry.FOUNDRY_RUNS`, no row
counted twice): one pair per generation, never per run or per table. The presets
store the result (:data:`~parlib.cost.efficiency.ACHIEVABLE`); a test re-runs the fit.
:func:`held_out_table` fits on one table and predicts the other, which says whether the pair
describes the hardware and its software or only the table it came from.

The H100's fitted memory fraction is low (about a fifth of the datasheet): per byte the model
counts, the 2023 stacks' memory-bound work ran no faster on H100s than on A100s. Read it as
"what non-matmul work costs in those stacks", not as what HBM3 can stream. Large streaming
kernels (the optimizer step, a cast of all the gradients) keep their own assumed 90%.
On A100s a pair fitted to one table keeps the other in the band; on H100s it does not
(:func:`held_out_table`): there the shares are the fit's, not a law.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from parlib.cost.efficiency import achievable
from parlib.cost.estimate import estimate
from parlib.cost.foundry import FOUNDRY_RUNS, published_rows
from parlib.cost.published import TARGET_BAND, PublishedRun

# The coarse grid, then a finer one around its best point.
MATMUL_GRID = tuple(x / 100 for x in range(60, 101, 4))
MEMORY_GRID = tuple(x / 100 for x in range(10, 101, 10))
FINE_STEP = 0.01


@dataclass(frozen=True)
class Fit:
    """One generation's fitted fractions: ``matmul`` of MAMF, ``memory`` of the datasheet's
    memory bandwidth; ``error`` the sum of squared log ratios over the ``rows`` fitted."""

    generation: str
    matmul: float
    memory: float
    error: float
    rows: int


def ratio_at(run: PublishedRun, matmul: float, memory: float) -> float:
    """The run's reported / predicted with its hardware's matmuls at ``matmul`` x its
    generation's MAMF fraction and memory-bound work at ``memory`` of the datasheet."""
    ceiling = achievable(run.hardware.generation).matmul_fraction
    hardware = replace(run.hardware, compute_efficiency=ceiling * matmul,
                       memory_efficiency=memory)
    est = estimate(run.model, hardware, run.layout, **run.settings)
    return run.reported / getattr(est, run.metric)


def _error(rows: tuple[PublishedRun, ...], matmul: float, memory: float) -> float:
    return sum(math.log(ratio_at(run, matmul, memory)) ** 2 for run in rows)


def fit(rows: tuple[PublishedRun, ...], generation: str = "") -> Fit:
    """The (matmul, memory) pair with the least squared log ratio over ``rows``: a grid of
    :data:`MATMUL_GRID` x :data:`MEMORY_GRID`, then steps of :data:`FINE_STEP` within one
    coarse step of its best point."""
    if not rows:
        raise ValueError("fit needs at least one published row")
    best = min(((_error(rows, a, b), a, b) for a in MATMUL_GRID for b in MEMORY_GRID))
    _, a0, b0 = best
    fine_a = [round(a0 + k * FINE_STEP, 2) for k in range(-4, 5)]
    fine_b = [round(b0 + k * FINE_STEP, 2) for k in range(-10, 11)]
    best = min(((_error(rows, a, b), a, b) for a in fine_a for b in fine_b
                if 0 < a <= 1 and 0 < b <= 1))
    error, matmul, memory = best
    return Fit(generation or rows[0].hardware.generation, matmul, memory, error, len(rows))


def in_band(rows: tuple[PublishedRun, ...], matmul: float, memory: float,
            band: tuple[float, float] = TARGET_BAND) -> tuple[int, float, float]:
    """(rows inside ``band``, lowest ratio, highest ratio) at ``matmul`` and ``memory``."""
    ratios = [ratio_at(run, matmul, memory) for run in rows]
    low, high = band
    return sum(low <= r <= high for r in ratios), min(ratios), max(ratios)


def held_out_table(generations: tuple[str, ...] = ("A100", "H100")) -> str:
    """Per generation: the pair fitted to every row, to llm-foundry's rows alone and to the
    other published rows alone, and how each predicts both sets (rows in the band, range)."""
    out = [f"{'generation':<10} {'fitted to':<16} {'matmul':>6} {'memory':>6}  "
           f"{'other published rows':<26} {'llm-foundry rows':<26}"]
    for gen in generations:
        rows = published_rows(gen)
        foundry = tuple(r for r in rows if r in FOUNDRY_RUNS)
        others = tuple(r for r in rows if r not in FOUNDRY_RUNS)
        for label, chosen in (("every row", rows), ("llm-foundry", foundry),
                              ("the others", others)):
            f = fit(chosen, gen)
            cells = []
            for part in (others, foundry):
                n, lo, hi = in_band(part, f.matmul, f.memory)
                cells.append(f"{n}/{len(part)} in band, {lo:.2f}-{hi:.2f}")
            out.append(f"{gen:<10} {label:<16} {f.matmul:>6.2f} {f.memory:>6.2f}  "
                       f"{cells[0]:<26} {cells[1]:<26}")
    return "\n".join(out)


__all__ = ["FINE_STEP", "MATMUL_GRID", "MEMORY_GRID", "Fit", "fit", "held_out_table",
           "in_band", "ratio_at"]
