"""Published layout sweeps: many layouts of one model measured on one cluster, to see whether
the cost model ranks them as the measurements do.

A sweep's absolute rates test the efficiency numbers; its *order* tests the model's shape:
does more pipeline, tensor or data parallelism cost what the formulas say? Two measures per
sweep:

- :func:`spearman`: rank correlation of predicted with measured throughput (1: same order).
- :meth:`Sweep.top_pick_ratio`: the measured throughput of the layout the model ranks first
  (among the sweep's layouts it predicts to fit), over the measured best (1: it picked the
  best).

Throughput is sequences per second (global batch / step time), so points with a slightly
different global batch compare fairly. Every value comes from a table of measured step
times, with its source and precision; none is read off a figure.
:func:`ranking_table` prints both measures per sweep; :func:`sweep_table` one sweep's points.

Jean Zay's network is the one BigScience measured (:meth:`Hardware.jean_zay_a100`: a node's
rings share 5.06 GB/s), so a TP 8 layout, whose eight data-parallel groups leave each node at
once, pays its gradient sync at an eighth of it per group; with the datasheet's 6.25 GB/s
per GPU, and each rank's share of a ring charged to its own NIC, the measured steps were
1.3-1.7x the predicted ones. Now they are 0.77-1.00x on the 02-25 tables and 0.90-1.03x on
the 02-21 one (before that day's PCI-Express fix), with the A100's training fractions
(:mod:`parlib.cost.calibration`, fitted to the published rows, not to these sweeps).

Every one of these runs launched its kernels serially: on 40 or more nodes BigScience's jobs
hung without ``CUDA_LAUNCH_BLOCKING=1``, and every sweep here ran on 48. So each layer pass
of each microbatch waits for the host as well as for the GPU, and the model charges the
floor BigScience's own readings put on that wait, 3.49 ms a microbatch-layer
(:mod:`parlib.cost.launches`: measured on another table, the 80-GPU pair, not on these
sweeps). A GPU waits for it once per layer pass, and runs GBS x L / (d x p x MBS) passes a
step: more at larger t (fewer d x p on the same GPUs) and at smaller microbatches, the
layouts the model's shape-only order ranked too high.
Without it the correlations were 0.56 and -0.14 and the TP 8 sweep's pick reached 0.91 of
the best.

What the model still cannot know about BigScience's runs: along the TP 8 sweep, beyond what
the model predicts, MBS 1 -> 2 saved 0.3-0.9 ms per microbatch-layer no longer run and
MBS 4 -> 8 1.6 ms, both near nothing, but MBS 2 -> 4 10.5-12.5 ms (before the serial
launches were charged: 3.8-4.4, 14.0-16.0 and 5.0 ms). A cost per call saves the same at
every step; this one step is something else, steeper than the waves of
:func:`~parlib.cost.efficiency.matmul_time` say. (With the last wave charged whole, the
guide's ceiling, instead of half of it, the sweeps' correlations would be higher; the half
wave was chosen before the sweeps were seen, and stays.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parlib.cost.estimate import Estimate, estimate
from parlib.cost.hardware import Hardware
from parlib.cost.launches import SERIAL_LAUNCH_SECONDS_PER_LAYER
from parlib.cost.layout import Layout
from parlib.cost.model import Model

# The course's targets for a sweep: rank correlation at least 0.8, the model's pick within 5%
# of the best.
TARGET_CORRELATION = 0.8
TARGET_PICK = 0.95


@dataclass(frozen=True)
class SweepPoint:
    """One measured layout: ``settings`` are :func:`~parlib.cost.estimate.estimate`'s keyword
    arguments (m, global_batch, ...); ``seconds_per_step`` as the source measured it."""

    layout: Layout
    settings: dict
    seconds_per_step: float
    label: str = ""

    def __post_init__(self) -> None:
        if not self.seconds_per_step > 0:
            raise ValueError(f"{self.label or self.layout}: seconds_per_step must be > 0, got "
                             f"{self.seconds_per_step!r}")

    @property
    def measured(self) -> float:
        """Measured throughput: sequences per second."""
        return self.settings["global_batch"] / self.seconds_per_step


@dataclass(frozen=True)
class Sweep:
    """Layouts of one ``model`` measured on one ``hardware``; ``precision`` says how exact
    the measured values are, ``assumed`` what the source does not state."""

    name: str
    source: str
    precision: str
    model: Model
    hardware: Hardware
    points: tuple[SweepPoint, ...]
    assumed: str

    def __post_init__(self) -> None:
        if len(self.points) < 3:
            raise ValueError(f"{self.name}: a sweep needs at least 3 layouts to rank, got "
                             f"{len(self.points)}")

    def estimates(self) -> list[Estimate]:
        return [estimate(self.model, self.hardware, p.layout, **p.settings)
                for p in self.points]

    def with_settings(self, **changes: object) -> Sweep:
        """The same sweep with every point's estimate settings changed, to see what one term
        does to the ranking, e.g. ``with_settings(host_seconds_per_layer=0.0)``."""
        return replace(self, points=tuple(
            replace(p, settings={**p.settings, **changes}) for p in self.points))

    def predicted(self, estimates: list[Estimate] | None = None) -> list[float]:
        """Predicted throughput of each point: sequences per second."""
        ests = estimates or self.estimates()
        return [e.global_batch / e.step_time for e in ests]

    def measured(self) -> list[float]:
        return [p.measured for p in self.points]

    def correlation(self, estimates: list[Estimate] | None = None) -> float:
        """Spearman rank correlation of predicted with measured throughput."""
        return spearman(self.predicted(estimates), self.measured())

    def top_pick(self, estimates: list[Estimate] | None = None) -> int:
        """Index of the point the model ranks fastest among those it predicts to fit."""
        ests = estimates or self.estimates()
        fitting = [i for i, e in enumerate(ests) if e.fits]
        if not fitting:
            raise ValueError(f"{self.name}: the model predicts none of the layouts fits")
        predicted = self.predicted(ests)
        return max(fitting, key=predicted.__getitem__)

    def top_pick_ratio(self, estimates: list[Estimate] | None = None) -> float:
        """Measured throughput of the model's pick over the measured best."""
        measured = self.measured()
        return measured[self.top_pick(estimates)] / max(measured)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks (ties averaged)."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs two lists of one length, got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        raise ValueError(f"spearman needs at least 2 points, got {len(xs)}")
    rx, ry = ranks(list(xs)), ranks(list(ys))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        raise ValueError("spearman is undefined when one list has all values equal")
    return cov / (vx * vy) ** 0.5


# ---- BigScience's search for BLOOM's layout on Jean Zay (bigscience-workshop/bigscience,
# train/tr11-176B-ml/chronicles-prequel.md, "Choosing the fastest 3D topology"): 48 nodes of
# 8 A100 80 GB, 4 x 100 Gb/s Omni-Path per node, its network as BigScience measured it
# (Hardware.jean_zay_a100). Megatron-DeepSpeed, ZeRO-1, fp16. Sec/it is read at the 2nd
# iteration, printed to 0.01 s.
JEAN_ZAY = Hardware.jean_zay_a100(384)
_BIGSCIENCE = "bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md"
_BIGSCIENCE_PRECISION = ("Sec/it to 0.01 s, one reading (iteration 2) per layout; the table "
                         "repeats DP 8 TP 4 PP 12 MBS 2 at 110.48 s and 113.54 s: ~3% noise")
_BIGSCIENCE_ASSUMED = ("full activation recomputation, ZeRO-1 and serial kernel launches "
                       "(CUDA_LAUNCH_BLOCKING=1), as the production script (tr11-176B-ml.slurm) "
                       "has them, the launches at parlib.cost.launches' floor of "
                       f"{SERIAL_LAUNCH_SECONDS_PER_LAYER * 1e3:.2f} ms a "
                       "microbatch-layer; 1F1B (v = 1); no sequence parallelism; "
                       "the '250k' vocabulary as the script's padded 250,880; the network as "
                       "BigScience's all-reduce benchmark measured it (5.06 GB/s of bus "
                       "bandwidth over 4 nodes: what a node's rings share)")
_BLOOM_181B = Model(72, 14336, 64, 2048, 250880, tied_embeddings=True,
                    learned_positions=False, dropout=True, name="BigScience 181B (72 x 14336)")


def _point(dp: int, tp: int, pp: int, mbs: int, gbs: int, seconds: float) -> SweepPoint:
    return SweepPoint(
        layout=Layout(dp=dp, tp=tp, pp=pp),
        settings=dict(m=gbs // (dp * mbs), global_batch=gbs, zero=1, recompute=True,
                      sequence_parallel=False, loss="in_place",
                      host_seconds_per_layer=SERIAL_LAUNCH_SECONDS_PER_LAYER),
        seconds_per_step=seconds, label=f"DP{dp} TP{tp} PP{pp} MBS{mbs} GBS{gbs}")


# "GBS Variations", "some more configs with lower PP" and "Tweaking TP" (all dated 02-25,
# after the day's PCI-Express fix, so comparable with each other): NLAYERS 72, NHIDDEN 14336,
# NHEADS 64. Columns: DP, TP, PP, MBS, GBS, Sec/it. Left out: the GBS 1568 rows (another
# batch), OOM rows, and the second DP 8 TP 4 PP 12 MBS 2 row (kept in the precision note).
BIGSCIENCE_0225 = Sweep(
    name="BigScience 181B, 384 A100: DP x TP x PP x MBS",
    source=f"{_BIGSCIENCE}, tables dated 02-25 (GBS Variations, lower PP, Tweaking TP)",
    precision=_BIGSCIENCE_PRECISION,
    model=_BLOOM_181B,
    hardware=JEAN_ZAY,
    points=(
        _point(8, 8, 6, 4, 2048, 114.11),
        _point(8, 8, 6, 6, 2016, 123.57),
        _point(4, 8, 12, 4, 2048, 117.07),
        _point(4, 8, 12, 2, 2048, 128.82),
        _point(6, 8, 8, 4, 2016, 113.16),
        _point(12, 8, 4, 2, 2016, 125.52),
        _point(12, 8, 4, 4, 2016, 114.81),
        _point(24, 8, 2, 1, 2016, 145.45),
        _point(24, 8, 2, 2, 2016, 136.13),
        _point(8, 4, 12, 4, 2048, 111.89),
        _point(8, 4, 12, 2, 2048, 110.48),
        _point(16, 4, 6, 4, 2048, 117.11),
        _point(16, 4, 6, 2, 2048, 111.71),
        _point(16, 2, 12, 2, 2048, 112.50),
        _point(8, 2, 24, 1, 2048, 119.53),
        _point(8, 2, 24, 2, 2048, 122.75),
        _point(4, 4, 24, 1, 2048, 130.60),
    ),
    assumed=_BIGSCIENCE_ASSUMED)

# "48 node contenders" (02-21): the same 72 x 14336 model, TP 8, PP 12 or 6 with the
# microbatch size swept. Columns: DP, TP, PP, MBS, GBS, Sec/it.
BIGSCIENCE_0221 = Sweep(
    name="BigScience 181B, 384 A100: PP x MBS at TP 8",
    source=f"{_BIGSCIENCE}, '48 node contenders' (02-21)",
    precision=_BIGSCIENCE_PRECISION,
    model=_BLOOM_181B,
    hardware=JEAN_ZAY,
    points=(
        _point(4, 8, 12, 1, 2048, 143.31),
        _point(4, 8, 12, 2, 2048, 134.02),
        _point(4, 8, 12, 4, 2048, 123.69),
        _point(4, 8, 12, 8, 2048, 129.26),
        _point(8, 8, 6, 1, 2048, 139.82),
        _point(8, 8, 6, 2, 2048, 131.02),
        _point(8, 8, 6, 4, 2048, 121.48),
    ),
    assumed=_BIGSCIENCE_ASSUMED)

SWEEPS = (BIGSCIENCE_0225, BIGSCIENCE_0221)


def microbatch_lean(sweeps: tuple[Sweep, ...] = SWEEPS) -> list[tuple[str, float]]:
    """Per layout (one DP x TP x PP of one sweep) measured at two or more microbatch sizes:
    its label and measured / predicted step time at its smallest microbatch over the same at
    its largest. Above 1: the model charges the smaller microbatch too little against the
    larger one."""
    out = []
    for sweep in sweeps:
        by_layout: dict[Layout, list[tuple[int, float, str]]] = {}
        for point, est in zip(sweep.points, sweep.estimates()):
            by_layout.setdefault(point.layout, []).append(
                (est.micro_batch, point.seconds_per_step / est.step_time, point.label))
        for rows in by_layout.values():
            if len(rows) > 1:
                (_, small, label), (_, large, _) = min(rows), max(rows)
                out.append((label, small / large))
    return out


def sweep_table(sweep: Sweep) -> str:
    """One sweep's points: measured and predicted sequences per second, and their ranks."""
    ests = sweep.estimates()
    predicted, measured = sweep.predicted(ests), sweep.measured()
    rank_p, rank_m = ranks([-x for x in predicted]), ranks([-x for x in measured])
    pick = sweep.top_pick(ests)
    rows = [f"{sweep.name}", f"{'layout':<28} {'fits':<5} {'measured/s':>10} "
            f"{'predicted/s':>11} {'rank m':>6} {'rank p':>6}"]
    for i, point in enumerate(sweep.points):
        mark = "  <- model's pick" if i == pick else ""
        rows.append(f"{point.label:<28} {str(ests[i].fits):<5} {measured[i]:>10.2f} "
                    f"{predicted[i]:>11.2f} {rank_m[i]:>6g} {rank_p[i]:>6g}{mark}")
    return "\n".join(rows)


def ranking_table(sweeps: tuple[Sweep, ...] = SWEEPS) -> str:
    """Per sweep: layouts, Spearman correlation, the model's pick, the measured best, and the
    pick's measured throughput over the best's."""
    rows = [f"{'sweep':<46} {'layouts':>7} {'spearman':>8} {'pick/best':>9}"]
    for sweep in sweeps:
        ests = sweep.estimates()
        pick = sweep.top_pick(ests)
        measured = sweep.measured()
        best = max(range(len(measured)), key=measured.__getitem__)
        rows.append(f"{sweep.name:<46} {len(sweep.points):>7} {sweep.correlation(ests):>8.2f} "
                    f"{sweep.top_pick_ratio(ests):>9.2f}")
        rows.append(f"  model's pick {sweep.points[pick].label}, measured best "
                    f"{sweep.points[best].label}")
    rows.append(f"targets: spearman >= {TARGET_CORRELATION:g}, pick/best >= {TARGET_PICK:g}")
    return "\n".join(rows)


__all__ = ["BIGSCIENCE_0221", "BIGSCIENCE_0225", "JEAN_ZAY", "SWEEPS", "TARGET_CORRELATION",
           "TARGET_PICK", "Sweep", "SweepPoint", "microbatch_lean", "ranking_table", "ranks",
           "spearman",
           "sweep_table"]
