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

The network is held to the runs too, but not fitted. :func:`implied_network_share` inverts
the model for one run: the share of the inter-node link's rate at which it predicts what the
run reported. :func:`network_table` asks that of every run that can tell (where the ratio
moves with the rate: :func:`telling_rows`) and holds every table at a few shares of the rate:

- llm-foundry's FSDP runs that can tell (on H100s) imply a little under
  half the ring rate the model charges (:meth:`Hardware.ring_link`), its two outlier A100
  rows less; but each generation's rows fitted together do not want a slower network: the
  fit's error barely moves between 0.8 and 2 times the rate and grows steeply below half of
  it (:func:`network_fit`);
- DeepSpeed's ZeRO-3 runs of 2021 (:mod:`parlib.cost.avoided`) imply about a tenth of it,
  close to an eighth: as if every rank's bytes crossed its own network card;
- at a tenth of the rate Table 2's ZeRO-3 rows come into the band and half the other
  published runs (Llama 3's, OPT's, BLOOM's, torchtitan's) fall out of it: no one rate keeps every
  table in the band.

A slower network cannot explain Table 2 without breaking the runs the model matches, so what
Table 2 shows is a cost of that 2021 stack the model does not describe (how it grouped and
issued its collectives is not in the paper). The model keeps the ring rate, and the lessons
print Table 2's band beside any ZeRO-3 layout across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from parlib.cost.avoided import PTDP_RUNS, ZERO3_RUNS, ordered_as_measured, pairs
from parlib.cost.efficiency import achievable
from parlib.cost.estimate import estimate
from parlib.cost.foundry import FOUNDRY_RUNS, published_rows
from parlib.cost.hardware import Link
from parlib.cost.published import RUNS, TARGET_BAND, PublishedRun

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


# A run can tell the network's rate where its ratio moves with it: at half the share it
# implies, its reported / predicted is at least this many times that at twice the share.
TELLING_SPREAD = 1.25
# The shares of the inter-node rate :func:`network_table` holds every table at; 1/8 is each
# rank's bytes through its own card in nodes of 8.
NETWORK_SHARES = (1.0, 0.5, 0.25, 0.125, 0.1)


def at_network_share(run: PublishedRun, share: float) -> PublishedRun:
    """The run on hardware whose inter-node link carries ``share`` of its bandwidth (latency
    unchanged); every ring across nodes slows with it (:meth:`Hardware.ring_link`)."""
    if not share > 0:
        raise ValueError(f"share must be > 0, got {share!r}")
    link = run.hardware.inter_node
    slower = Link(alpha=link.alpha, bandwidth=link.bandwidth * share)
    return replace(run, hardware=run.hardware.with_(inter_node=slower))


def implied_network_share(run: PublishedRun, low: float = 1 / 64, high: float = 4.0
                          ) -> float | None:
    """The share of the inter-node link's rate at which the model predicts exactly what
    ``run`` reported, found by bisection in log space between ``low`` and ``high``; None when
    no share there does (the run is faster than predicted even at ``high``, or slower even
    at ``low``: something else than the network is off)."""
    def ratio(share: float) -> float:
        return at_network_share(run, share).ratio()

    if ratio(high) > 1 or ratio(low) < 1:  # a slower network only lowers the prediction
        return None
    for _ in range(40):
        middle = math.sqrt(low * high)
        low, high = (low, middle) if ratio(middle) < 1 else (middle, high)
    return math.sqrt(low * high)


def network_fit(generation: str, shares: tuple[float, ...] = NETWORK_SHARES
                ) -> dict[float, Fit]:
    """For each of ``shares``: the training shares fitted (:func:`fit`) to every published
    row of ``generation`` with its inter-node link at that share of its rate. Where the
    error is least is the network rate those rows prefer."""
    rows = published_rows(generation)
    return {share: fit(tuple(at_network_share(r, share) for r in rows), generation)
            for share in shares}


def telling_rows() -> tuple[tuple[PublishedRun, float], ...]:
    """Every published run (both generations' fitted rows and :mod:`~parlib.cost.avoided`'s)
    that can tell the network's rate, with the share it implies: one exists, and the run's
    reported / predicted at half that share is at least :data:`TELLING_SPREAD` times that at
    twice it. A run the model predicts slower than reported at any rate implies none."""
    out = []
    for run in published_rows("A100") + published_rows("H100") + ZERO3_RUNS + PTDP_RUNS:
        share = implied_network_share(run)
        if share is None:
            continue
        spread = (at_network_share(run, share / 2).ratio()
                  / at_network_share(run, share * 2).ratio())
        if spread >= TELLING_SPREAD:
            out.append((run, share))
    return tuple(out)


def network_sweep(shares: tuple[float, ...] = NETWORK_SHARES
                  ) -> dict[float, dict[str, tuple[int, int]]]:
    """At each of ``shares`` of the inter-node rate: (rows in the band, rows) of each table
    (the other published runs, llm-foundry's, Table 2's ZeRO-3 and PTD-P rows), and under
    "pairs as measured" (Table 2 pairs the model orders as measured, pairs)."""
    tables = {"other published": tuple(r for r in RUNS if r not in FOUNDRY_RUNS),
              "llm-foundry": FOUNDRY_RUNS, "Table 2 ZeRO-3": ZERO3_RUNS,
              "Table 2 PTD-P": PTDP_RUNS}
    low, high = TARGET_BAND
    out = {}
    for share in shares:
        row = {}
        for name, rows in tables.items():
            ratios = [at_network_share(r, share).ratio() for r in rows]
            row[name] = (sum(low <= x <= high for x in ratios), len(ratios))
        ordered = ordered_as_measured(lambda run: at_network_share(run, share))
        row["pairs as measured"] = (ordered, len(pairs()))
        out[share] = row
    return out


def network_table(shares: tuple[float, ...] = NETWORK_SHARES) -> str:
    """The runs that can tell (:func:`telling_rows`) and the share of the inter-node rate
    each implies; then :func:`network_sweep` at ``shares``."""
    lines = [f"{'run that can tell':<28} {'ratio at the full rate':>22} {'implied share':>14}"]
    for run, share in telling_rows():
        lines.append(f"{run.name:<28} {run.ratio():>22.2f} {share:>14.3f}")
    sweep = network_sweep(shares)
    names = list(next(iter(sweep.values())))
    lines += ["", f"{'share':>6} " + " ".join(f"{name:>17}" for name in names)]
    for share, row in sweep.items():
        lines.append(f"{share:>6.3g} " + " ".join(f"{f'{k}/{n}':>17}" for k, n in row.values()))
    return "\n".join(lines)


__all__ = ["FINE_STEP", "MATMUL_GRID", "MEMORY_GRID", "NETWORK_SHARES", "TELLING_SPREAD", "Fit",
           "at_network_share", "fit", "held_out_table", "implied_network_share", "in_band",
           "network_fit", "network_sweep", "network_table", "ratio_at", "telling_rows"]
