"""A measured grid of layouts, scored against the cost model in one pass.

Whoever has measured many layouts of a few dense models (each model at several GPU counts,
several layouts at each count, some of which did not run) can hold the model to all of them
at once, from one CSV file:

- **order**: within each model and GPU count (a *cluster*), does the model rank the layouts
  as measured? Spearman's rank correlation of predicted with measured throughput
  (:func:`~parlib.cost.sweeps.spearman`), over the layouts that ran; its median over the
  clusters.
- **pick**: in each cluster, the measured throughput of the layout the model ranks first
  among those it predicts to fit (whether it ran or not: a pick that did not run scores
  0), over the best measured; per model, the median over its clusters and the worst one.
- **rate**: measured / predicted MFU over the rows that ran; the median.
- **memory**: layouts that ran though the model says they do not fit, and layouts the model
  says fit that did not run.

:data:`GRID_TARGETS` are the course's thresholds for these. :func:`read_grid` reads the file,
:func:`score_grid` scores it and :func:`grid_table` prints the score
(``python bench/cost.py --sections grid --grid FILE``).

The file has a header row naming these columns (any order; other columns are ignored):

- ``model``: a name; rows of one name must give one shape.
- ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn``, ``vocab``, ``seq``: the shape.
  ``gated``: ``true`` for a gated MLP (SwiGLU, three matrices), ``false`` for two. Every
  model is read as Llama's kind: no biases, no learned positions, untied output layer.
- ``hardware``: ``dgx_a100``, ``dgx_h100`` or ``dgx_h200`` (:class:`Hardware`'s presets,
  nodes of 8); ``gpus``: how many.
- ``dp``, ``tp``, ``pp``, ``cp``, ``v``: the layout; their product (``v`` aside) is ``gpus``.
- ``micro_batch``, ``global_batch``: sequences; ``global_batch`` is a multiple of
  ``dp x micro_batch``.
- ``zero``: 0-3; ``recompute``: ``none``, ``selective``, ``full`` or ``op``;
  ``fused_attention``: ``true`` or ``false``; ``loss``: ``unfused``, ``in_place`` or
  ``fused`` (:data:`~parlib.cost.memory.LOSSES`); ``grad_reduce_bytes``: ``4`` where the
  gradients are reduced in fp32 (FSDP2's ``reduce_dtype``), ``2`` in bf16, empty for their
  own dtype.
- ``tokens_per_s_per_gpu``: what was measured; empty for a layout that did not run (out of
  memory, or failed).

Each row is predicted with :func:`~parlib.cost.estimate.estimate` as the presets stand
(tensor parallelism with sequence parallelism, ZeRO over every data-parallel rank: HSDP's
groups have no column); nothing is fitted to the grid.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from parlib.cost.estimate import Estimate, estimate
from parlib.cost.hardware import Hardware
from parlib.cost.layout import Layout
from parlib.cost.memory import check_loss
from parlib.cost.model import Model
from parlib.cost.sweeps import spearman

# The thresholds the course holds the model to on a measured grid: the median rank
# correlation within a cluster, every model's median pick over the best measured, and the
# median measured / predicted MFU.
GRID_TARGETS = {"correlation": 0.7, "pick": 0.85, "rate": 0.6}

HARDWARE: dict[str, Callable[[int], Hardware]] = {
    "dgx_a100": Hardware.dgx_a100, "dgx_h100": Hardware.dgx_h100,
    "dgx_h200": Hardware.dgx_h200}
RECOMPUTE = {"none": False, "selective": "selective", "full": True, "op": "op"}
_RECOMPUTE_NAMES = {mode: name for name, mode in RECOMPUTE.items()}
_SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")
_AXES = ("dp", "tp", "pp", "cp")
COLUMNS = ("model", *_SHAPE, "gated", "hardware", "gpus", *_AXES, "v", "micro_batch",
           "global_batch", "zero", "recompute", "fused_attention", "loss",
           "grad_reduce_bytes", "tokens_per_s_per_gpu")


@dataclass(frozen=True)
class GridRow:
    """One measured layout: what :func:`estimate` needs, and ``measured`` tokens per second
    per GPU (None: it did not run). ``line`` is its line in the file."""

    model: Model
    hardware: Hardware
    layout: Layout
    settings: dict
    measured: float | None
    line: int

    def estimate(self) -> Estimate:
        return estimate(self.model, self.hardware, self.layout, **self.settings)

    @property
    def measured_mfu(self) -> float | None:
        """Measured tokens per second per GPU as MFU, with the model's FLOPs per token."""
        if self.measured is None:
            return None
        return self.measured * self.model.flops_per_token / self.hardware.peak_flops


@dataclass(frozen=True)
class ClusterScore:
    """One model at one GPU count: its rows, their estimates, and the three measures
    (``correlation`` None with fewer than 3 rows that ran or all of them measured alike;
    ``pick`` None when the model says none fits)."""

    model: str
    gpus: int
    rows: tuple[GridRow, ...]
    estimates: tuple[Estimate, ...]
    correlation: float | None
    pick: int | None
    pick_ratio: float


@dataclass(frozen=True)
class GridScore:
    """``clusters``: those where at least one layout ran; ``rate_ratios``: measured / predicted
    MFU of every row that ran; the memory disagreements over every row."""

    clusters: tuple[ClusterScore, ...]
    rate_ratios: tuple[float, ...]
    ran_not_fitting: tuple[GridRow, ...]
    fitting_not_run: tuple[GridRow, ...]

    @property
    def median_correlation(self) -> float | None:
        values = [c.correlation for c in self.clusters if c.correlation is not None]
        return statistics.median(values) if values else None

    def picks(self) -> dict[str, tuple[float, float]]:
        """Per model: (median, worst) of its clusters' pick ratios."""
        by_model: dict[str, list[float]] = {}
        for c in self.clusters:
            by_model.setdefault(c.model, []).append(c.pick_ratio)
        return {name: (statistics.median(r), min(r)) for name, r in by_model.items()}

    @property
    def median_rate(self) -> float | None:
        return statistics.median(self.rate_ratios) if self.rate_ratios else None

    def meets(self) -> dict[str, bool]:
        """Whether each of :data:`GRID_TARGETS` is met (a measure with nothing to measure
        is not)."""
        corr, rate = self.median_correlation, self.median_rate
        return {"correlation": corr is not None and corr >= GRID_TARGETS["correlation"],
                "pick": all(median >= GRID_TARGETS["pick"]
                            for median, _ in self.picks().values()),
                "rate": rate is not None and rate >= GRID_TARGETS["rate"]}


def _fail(line: int, message: str) -> ValueError:
    return ValueError(f"grid line {line}: {message}")


def _whole(value: str, column: str, line: int, least: int = 1) -> int:
    try:
        number = int(value)
    except ValueError:
        raise _fail(line, f"{column} must be a whole number, got {value!r}") from None
    if number < least:
        raise _fail(line, f"{column} must be >= {least}, got {number}")
    return number


def _flag(value: str, column: str, line: int) -> bool:
    if value.lower() not in ("true", "false"):
        raise _fail(line, f"{column} must be true or false, got {value!r}")
    return value.lower() == "true"


def _row(fields: dict[str, str], line: int) -> GridRow:
    shape = [_whole(fields[c], c, line) for c in _SHAPE]
    layers, hidden, heads, kv_heads, ffn, vocab, seq = shape
    try:
        model = Model(layers, hidden, heads, seq, vocab, ffn_dim=ffn, n_kv_heads=kv_heads,
                      gated_mlp=_flag(fields["gated"], "gated", line), bias=False,
                      learned_positions=False, name=fields["model"])
    except ValueError as err:
        raise _fail(line, str(err)) from None
    if fields["hardware"] not in HARDWARE:
        raise _fail(line, f"hardware must be one of {sorted(HARDWARE)}, got "
                          f"{fields['hardware']!r}")
    gpus = _whole(fields["gpus"], "gpus", line)
    sizes = {a: _whole(fields[a], a, line) for a in _AXES}
    if math.prod(sizes.values()) != gpus:
        raise _fail(line, f"dp x tp x pp x cp = {sizes} multiply to "
                          f"{math.prod(sizes.values())}, not gpus = {gpus}")
    micro, batch = (_whole(fields[c], c, line) for c in ("micro_batch", "global_batch"))
    if batch % (sizes["dp"] * micro):
        raise _fail(line, f"global_batch {batch} is not a multiple of dp x micro_batch = "
                          f"{sizes['dp'] * micro}")
    zero = _whole(fields["zero"], "zero", line, least=0)
    if zero > 3:
        raise _fail(line, f"zero must be 0-3, got {zero}")
    if fields["recompute"] not in RECOMPUTE:
        raise _fail(line, f"recompute must be one of {sorted(RECOMPUTE)}, got "
                          f"{fields['recompute']!r}")
    try:
        check_loss(fields["loss"])
    except ValueError as err:
        raise _fail(line, str(err)) from None
    reduce = fields["grad_reduce_bytes"]
    if reduce not in ("", "2", "4"):
        raise _fail(line, f"grad_reduce_bytes must be 2, 4 or empty, got {reduce!r}")
    settings = dict(m=batch // (sizes["dp"] * micro), global_batch=batch, zero=zero,
                    grad_reduce_bytes=int(reduce) if reduce else None,
                    v=_whole(fields["v"], "v", line),
                    recompute=RECOMPUTE[fields["recompute"]], loss=fields["loss"],
                    fused_attention=_flag(fields["fused_attention"], "fused_attention", line))
    return GridRow(model, HARDWARE[fields["hardware"]](gpus), Layout(**sizes), settings,
                   _measured(fields["tokens_per_s_per_gpu"], line), line)


def _measured(value: str, line: int) -> float | None:
    if not value.strip():
        return None
    try:
        number = float(value)
    except ValueError:
        raise _fail(line, f"tokens_per_s_per_gpu must be a number or empty (did not run), "
                          f"got {value!r}") from None
    if not number > 0:
        raise _fail(line, f"tokens_per_s_per_gpu must be > 0 (empty: did not run), got "
                          f"{number}")
    return number


def read_grid(source: str | Path) -> tuple[GridRow, ...]:
    """The rows of a grid CSV: ``source`` a path, or the text itself (a string with a line
    break). A missing column, a bad value or a model name given two shapes raises
    ValueError naming the line."""
    text = source if isinstance(source, str) and "\n" in source else Path(source).read_text()
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"grid: the header lacks the columns {missing}")
    rows: list[GridRow] = []
    shapes: dict[str, Model] = {}
    for fields in reader:
        fields = {k: (v or "").strip() for k, v in fields.items() if k is not None}
        row = _row(fields, reader.line_num)
        first = shapes.setdefault(row.model.name, row.model)
        if first != row.model:
            raise _fail(reader.line_num, f"model {row.model.name!r} has another shape than "
                                         f"on an earlier line")
        rows.append(row)
    if not rows:
        raise ValueError("grid: no rows after the header")
    return tuple(rows)


def _estimate(row: GridRow) -> Estimate:
    try:
        return row.estimate()
    except ValueError as err:
        raise _fail(row.line, f"the model cannot estimate this layout: {err}") from None


def _cluster(rows: list[GridRow]) -> ClusterScore:
    ests = tuple(_estimate(r) for r in rows)
    predicted = [e.global_batch * e.model.seq_len / e.step_time for e in ests]
    ran = [i for i, r in enumerate(rows) if r.measured is not None]
    correlation = None
    measured = [rows[i].measured for i in ran]
    if len(ran) >= 3 and len(set(measured)) > 1 and len({predicted[i] for i in ran}) > 1:
        correlation = spearman([predicted[i] for i in ran], measured)
    fitting = [i for i, e in enumerate(ests) if e.fits]
    pick = max(fitting, key=predicted.__getitem__) if fitting else None
    best = max(measured, default=0.0)
    got = rows[pick].measured if pick is not None else None
    ratio = (got or 0.0) / best if best else 0.0
    return ClusterScore(rows[0].model.name, rows[0].hardware.n_devices, tuple(rows), ests,
                        correlation, pick, ratio)


def score_grid(rows: Iterable[GridRow]) -> GridScore:
    """Score every cluster (rows of one model and GPU count) and the grid as a whole."""
    clusters: dict[tuple[str, int], list[GridRow]] = {}
    for row in rows:
        clusters.setdefault((row.model.name, row.hardware.n_devices), []).append(row)
    every = [_cluster(c) for c in clusters.values()]
    # a cluster where nothing ran has no best to hold a pick to, but its memory verdicts count
    scored = tuple(c for c in every if any(r.measured is not None for r in c.rows))
    rates, ran_not_fitting, fitting_not_run = [], [], []
    for c in every:
        for row, est in zip(c.rows, c.estimates):
            if row.measured is not None:
                rates.append(row.measured_mfu / est.mfu)
                if not est.fits:
                    ran_not_fitting.append(row)
            elif est.fits:
                fitting_not_run.append(row)
    return GridScore(scored, tuple(rates), tuple(ran_not_fitting), tuple(fitting_not_run))


def _label(row: GridRow, est: Estimate) -> str:
    """A row as the table names it: layout, microbatch, recomputation, ZeRO, line."""
    return (f"{row.layout} micro {est.micro_batch} recompute "
            f"{_RECOMPUTE_NAMES[est.recompute]} ZeRO-{est.zero}, line {row.line}")


def grid_table(score: GridScore) -> str:
    """Per cluster: rows, rows that ran, the correlation, the pick and its ratio; then the
    grid's medians against :data:`GRID_TARGETS` and the memory disagreements."""
    lines = [f"{'model':<20} {'GPUs':>5} {'rows':>4} {'ran':>4} {'spearman':>8} "
             f"{'pick/best':>9}  model's pick"]
    for c in score.clusters:
        corr = "-" if c.correlation is None else f"{c.correlation:.2f}"
        pick = "none fits" if c.pick is None else (
            _label(c.rows[c.pick], c.estimates[c.pick])
            + ("" if c.rows[c.pick].measured is not None else " (did not run)"))
        lines.append(f"{c.model:<20} {c.gpus:>5} {len(c.rows):>4} "
                     f"{sum(r.measured is not None for r in c.rows):>4} {corr:>8} "
                     f"{c.pick_ratio:>9.2f}  {pick}")
    meets = score.meets()
    corr, rate = score.median_correlation, score.median_rate
    lines.append("")
    lines.append(f"median spearman within a cluster: "
                 f"{'- (no cluster has 3 layouts that ran)' if corr is None else f'{corr:.2f}'} "
                 f"(target {GRID_TARGETS['correlation']:g}: "
                 f"{'met' if meets['correlation'] else 'not met'})")
    for name, (median, worst) in score.picks().items():
        lines.append(f"{name}: pick / best median {median:.2f}, worst {worst:.2f}")
    lines.append(f"every model's median pick / best >= {GRID_TARGETS['pick']:g}: "
                 f"{'met' if meets['pick'] else 'not met'}")
    lines.append(f"median measured / predicted MFU: {'-' if rate is None else f'{rate:.2f}'} "
                 f"over {len(score.rate_ratios)} rows that ran (target "
                 f"{GRID_TARGETS['rate']:g}: {'met' if meets['rate'] else 'not met'})")
    lines.append(f"ran though predicted not to fit: {len(score.ran_not_fitting)}; predicted "
                 f"to fit but did not run: {len(score.fitting_not_run)}")
    return "\n".join(lines)


__all__ = ["COLUMNS", "GRID_TARGETS", "HARDWARE", "RECOMPUTE", "ClusterScore", "GridRow",
           "GridScore", "grid_table", "read_grid", "score_grid"]
