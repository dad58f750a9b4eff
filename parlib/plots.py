"""The course's shared drawings: one palette, one caption rule, and the figures that more
than one chapter draws (a chapter's one-off figures stay in its notebook).

- :data:`COLORS` and :func:`run_label`: the colour of each kind of work and the
  "what ran it" caption every figure carries.
- :func:`draw_collective`: who holds what before and after a collective (the launching chapter).
- :func:`draw_timeline`: a Gantt chart of spans per rank (pipelines, and any step), the
  communication of every parallelism axis included (:data:`AXIS_STYLE`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from parlib.measure.timeline import AXES, COMPUTE, Span

# One colour per kind of work, the same in every chapter. Idle is light grey so that
# pipeline bubbles read as empty space.
COLORS: dict[str, str] = {
    "forward": "#4C72B0",  # compute, forward pass
    "backward": "#DD8452",  # compute, backward pass
    "comm": "#55A868",  # communication (send, recv, collectives)
    "send": "#55A868",
    "recv": "#8CC79A",
    "optimizer": "#8172B3",
    "idle": "#E5E5E5",
    "theory": "#333333",  # dashed lines / outlines for predictions
}

# Where a timeline draws each axis' communication (all in the communication colour): a
# strip above or below the rank's row, hatched where two axes share a side.
AXIS_STYLE: dict[str, tuple[str, str | None]] = {
    "tp": ("above", None), "cp": ("above", "////"), "ep": ("above", "xxxx"),
    "dp": ("below", None), "pp": ("below", "////"),
}
_POINT_TO_POINT = ("send", "recv")


def run_label(world_size: int, device: str, backend: str, emulated: bool = False) -> str:
    """The 'what ran it' caption every figure carries, e.g. '4 ranks, CPU, gloo'."""
    dev = "CPU" if str(device).startswith("cpu") else str(device).split(":")[0].upper()
    label = f"{world_size} rank{'s' if world_size != 1 else ''}, {dev}, {backend}"
    if emulated:
        label += ", emulated stage cost"
    return label


# The collectives the course uses and the strategy that pays for each (the launching chapter's
# table).
WHO_PAYS = [
    ("broadcast", "every strategy, once: the same initial weights on every rank"),
    ("all-reduce", "data parallelism: gradients after every step; tensor parallelism: "
                   "partial activations after a row-split layer"),
    ("reduce-scatter", "ZeRO / FSDP: each rank keeps only its shard of the summed gradients"),
    ("all-gather", "ZeRO / FSDP: parameters rebuilt before use; tensor parallelism: "
                   "activations after a column-split layer"),
    ("send / recv", "pipeline parallelism: activations forward and gradients backward "
                    "across each stage boundary"),
]


def draw_collective(name: str, before: Sequence[Sequence[float]],
                    after: Sequence[Sequence[float]], caption: str = "", ax_pair=None):
    """Draw what each rank holds before and after a collective.

    ``before[r]`` and ``after[r]`` are the values rank r holds (lists may differ in length:
    a reduce-scatter shrinks them, an all-gather grows them). Returns the figure.
    """
    import matplotlib.pyplot as plt

    n = len(before)
    if len(after) != n:
        raise ValueError(f"before has {n} ranks but after has {len(after)}")
    width = max(max(len(v) for v in before), max(len(v) for v in after))
    if ax_pair is None:
        fig, ax_pair = plt.subplots(1, 2, figsize=(2.2 + 0.7 * width * 2, 0.5 + 0.5 * n))
    else:
        fig = ax_pair[0].figure
    for ax, rows, label in ((ax_pair[0], before, "before"), (ax_pair[1], after, "after")):
        for r, values in enumerate(rows):
            for c, value in enumerate(values):
                ax.add_patch(plt.Rectangle((c, n - 1 - r), 0.95, 0.9,
                                           color=COLORS["comm"] if label == "after"
                                           else COLORS["forward"], alpha=0.85))
                ax.text(c + 0.47, n - 1 - r + 0.45, _short(value), ha="center", va="center",
                        color="white", fontsize=9)
        ax.set_xlim(-0.1, width)
        ax.set_ylim(-0.1, n)
        ax.set_yticks([n - 1 - r + 0.45 for r in range(n)], [f"rank {r}" for r in range(n)])
        ax.set_xticks([])
        ax.set_title(f"{name}: {label}", fontsize=10)
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    if caption:
        fig.suptitle(caption, fontsize=9, y=0.02, va="bottom", color="#555555")
    fig.tight_layout(rect=(0, 0.06 if caption else 0, 1, 1))
    return fig


def _short(value: float) -> str:
    value = float(value)
    return f"{value:.0f}" if value.is_integer() else f"{value:.2g}"


# axes draw_timeline has drawn on: the ones whose time axis a shared row must not narrow
_TIMELINE_AXES: weakref.WeakSet[Any] = weakref.WeakSet()


def draw_timeline(
    spans_by_rank: Sequence[Iterable[Span]],
    ax: Any = None,
    *,
    title: str | None = None,
    caption: str | None = None,
    unit: str = "ms",
    ideal: float | None = None,
    show_comm: bool = True,
    legend: bool = True,
    labels: bool = True,
    row_labels: Sequence[str] | None = None,
) -> Any:
    """Gantt chart: one row per stage (stage 0 on top), one box per op coloured by kind
    with its microbatch number inside, idle time light grey, communication as thin strips:
    pipeline sends and receives under each row, each axis' collectives (spans of kind
    "tp", "dp", ...) above or below it as :data:`AXIS_STYLE` places them. ``unit``: "ms"
    (spans in seconds, drawn in ms), "s", or "t" (schedule time units, drawn as they are).
    ``ideal``: draw the predicted step end as a dashed line (same units as the spans).
    ``row_labels``: one label per row, top first (default "stage r"). On axes that share
    their x-axis with timelines drawn before, the time axis only widens, to the longest
    step of them all. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lists = [list(s) for s in spans_by_rank]
    p = len(lists)
    scale = {"ms": 1e3, "s": 1.0, "t": 1.0}[unit]
    xlabel = {"ms": "time (ms)", "s": "time (s)", "t": "time (forward time units)"}[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.55 * p + 1.3))
    flat = [x for s in lists for x in s]
    t0 = min((x.start for x in flat), default=0.0)
    t1 = max((x.end for x in flat), default=1.0)
    width_total = (t1 - t0) * scale or 1.0
    h = 0.8
    comm_h = 0.1  # a strip above and one below fit the gap between two rows (1 - h)
    for rank, spans in enumerate(lists):
        y = p - 1 - rank
        ax.broken_barh([(0.0, width_total)], (y - h / 2, h), facecolors=COLORS["idle"],
                       edgecolors="none")
        for x in spans:
            left, w = (x.start - t0) * scale, x.duration * scale
            if x.kind in COMPUTE:
                ax.broken_barh([(left, w)], (y - h / 2, h), facecolors=COLORS[x.kind],
                               edgecolors="white", linewidth=0.6,
                               hatch="//" if x.chunk % 2 else None)
                if labels and x.mb is not None and w > 0.012 * width_total:
                    ax.text(left + w / 2, y, str(x.mb), ha="center", va="center",
                            color="white", fontsize=8 if w > 0.03 * width_total else 6,
                            fontweight="bold")
            elif x.kind in _POINT_TO_POINT and show_comm:
                ax.broken_barh([(left, max(w, 0.002 * width_total))],
                               (y - h / 2 - comm_h, comm_h),
                               facecolors=COLORS[x.kind], edgecolors="none")
            elif x.kind in AXES and show_comm:
                side, hatch = AXIS_STYLE[x.kind]
                bottom = y + h / 2 if side == "above" else y - h / 2 - comm_h
                ax.broken_barh([(left, max(w, 0.002 * width_total))], (bottom, comm_h),
                               facecolors=COLORS["comm"], hatch=hatch,
                               edgecolors="white" if hatch else "none", linewidth=0)
    if ideal is not None:
        ax.axvline(ideal * scale, color=COLORS["theory"], linestyle="--", linewidth=1.2)
        ax.text(ideal * scale, p - 0.45, "predicted end ", color=COLORS["theory"],
                fontsize=8, va="bottom", ha="right")
    if row_labels is not None and len(row_labels) != p:
        raise ValueError(f"{len(row_labels)} row labels for {p} rows")
    ax.set_yticks(range(p))
    ax.set_yticklabels(list(reversed(row_labels if row_labels is not None
                                     else [f"stage {r}" for r in range(p)])))
    ax.set_ylim(-0.75, p - 0.2)
    right = max(width_total, (ideal or 0) * scale) * 1.01
    # rows sharing a time axis: widen it to the longest step drawn so far, never narrow it,
    # so that a shorter step drawn later neither clips the longer ones nor hides their end
    drawn = [a.get_xlim()[1] for a in ax.get_shared_x_axes().get_siblings(ax)
             if a is not ax and a in _TIMELINE_AXES]
    right = max([right, *drawn])
    _TIMELINE_AXES.add(ax)
    ax.set_xlim(0, right)
    ax.set_xlabel(xlabel)
    full = title or ""
    if caption:
        full = f"{full}\n{caption}" if full else caption
    if full:
        ax.set_title(full, fontsize=10)
    if legend:
        handles = [Patch(color=COLORS["forward"], label="forward"),
                   Patch(color=COLORS["backward"], label="backward"),
                   Patch(color=COLORS["idle"], label="idle (bubble)")]
        if show_comm and any(x.kind in _POINT_TO_POINT for x in flat):
            handles.append(Patch(color=COLORS["recv"], label="send / recv (thin strip)"))
        if show_comm:
            for axis in AXES:
                if any(x.kind == axis for x in flat):
                    side, hatch = AXIS_STYLE[axis]
                    handles.append(Patch(facecolor=COLORS["comm"], hatch=hatch,
                                         edgecolor="white" if hatch else COLORS["comm"],
                                         label=f"{axis} collectives ({side} the row)"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize=8, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


# ---- the context-parallel chapter: causal work per rank, activations per rank against s

def _busy_and_waiting(runs: dict[str, Sequence[dict[str, float]]], xlabel: str,
                      legend: tuple[str, str], ax=None, **legend_kw):
    """One bar per rank, grouped by run: its ``"busy"`` seconds, then the rest of its
    ``"total"`` as waiting; ``legend`` names the two parts."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 2.4 + 0.3 * sum(len(r) for r in runs.values())))
    labels, ticks, y = [], [], 0.0
    for name, ranks in runs.items():
        for rank, r in enumerate(ranks):
            ticks.append(y)
            busy, wait = r["busy"] * 1e3, max(r["total"] - r["busy"], 0.0) * 1e3
            ax.barh(y, busy, color=COLORS["forward"])
            ax.barh(y, wait, left=busy, color=COLORS["idle"], edgecolor=COLORS["theory"],
                    linewidth=0.3)
            labels.append(f"{name}, rank {rank}")
            y += 1
        y += 0.5
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(handles=[Patch(color=COLORS["forward"], label=legend[0]),
                       Patch(color=COLORS["idle"], label=legend[1])],
              fontsize=8, frameon=False, **legend_kw)
    return ax


def draw_causal_imbalance(runs: dict[str, Sequence[dict[str, float]]], caption: str = "",
                          ax=None):
    """Per rank, emulated compute (busy) and the waiting around it, one group of bars per
    layout: ``runs[layout][rank]`` has ``"busy"`` and ``"total"`` seconds
    (:func:`parlib.experiments.context.emulated_imbalance`). Returns the axes."""
    ax = _busy_and_waiting(runs, "ms (one causal ring-attention forward)",
                           ("compute (emulated)", "waiting for the ring"), ax,
                           loc="lower right")
    if caption:
        ax.set_title(caption, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


def draw_memory_vs_length(measured: dict[int, dict[int, float]],
                          predicted: dict[int, dict[int, float]] | None = None,
                          caption: str = "", ax=None):
    """Bytes per rank against the sequence length, one line per cp: ``measured[cp][s]``
    (dots and line) and ``predicted[cp][s]`` (dashed). Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.2))
    for cp, points in sorted(measured.items()):
        xs = sorted(points)
        line, = ax.plot(xs, [points[s] / 2**20 for s in xs], "o-", label=f"c = {cp}, measured")
        if predicted and cp in predicted:
            ax.plot(xs, [predicted[cp][s] / 2**20 for s in xs], "--", color=line.get_color(),
                    label=f"c = {cp}, formula")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("MiB saved for backward, per rank")
    ax.legend(fontsize=8, frameon=False)
    if caption:
        ax.set_title(caption, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


__all__ = ["AXIS_STYLE", "COLORS", "WHO_PAYS", "draw_causal_imbalance", "draw_collective",
           "draw_memory_vs_length", "draw_timeline", "run_label"]


# The sharded-data-parallel chapter: memory over a training step, by kind ------------------

MEMORY_COLORS: dict[str, str] = {
    "params": "#4C72B0", "gathered": "#8DA0CB", "grads": "#DD8452", "optimizer": "#55A868",
    "shard copy": "#A6D854", "activations": "#C44E52", "buffers": "#937860",
}


def draw_memory_over_time(samples_by_stage: dict[str, Sequence[Sequence[Any]]],
                          predicted_peak: dict[str, float] | None = None, *,
                          title: str | None = None, caption: str | None = None) -> Any:
    """One column per strategy, one row per rank: the bytes each rank holds at every sample
    ``(step, phase, {kind: bytes})`` as stacked areas by kind, MiB on the y axis, the same
    scale everywhere; ``predicted_peak`` (by strategy) as a dashed line. Returns the figure."""
    import matplotlib.pyplot as plt

    stages = list(samples_by_stage)
    ranks = len(next(iter(samples_by_stage.values())))
    fig, axes = plt.subplots(ranks, len(stages), figsize=(2.6 * len(stages), 1.9 * ranks + 0.9),
                             sharey=True, squeeze=False)
    top = max(sum(s[2].values()) for per_rank in samples_by_stage.values()
              for samples in per_rank for s in samples) / 2**20
    kinds = list(MEMORY_COLORS)
    for col, stage in enumerate(stages):
        for rank, samples in enumerate(samples_by_stage[stage]):
            ax = axes[rank][col]
            xs = list(range(len(samples)))
            ax.stackplot(xs, [[s[2].get(k, 0) / 2**20 for s in samples] for k in kinds],
                         colors=[MEMORY_COLORS[k] for k in kinds], linewidth=0)
            for i in range(1, len(samples)):  # a thin line where a new step begins
                if samples[i][0] != samples[i - 1][0]:
                    ax.axvline(i - 0.5, color="#999999", lw=0.6)
            if predicted_peak is not None:
                ax.axhline(predicted_peak[stage] / 2**20, color=COLORS["theory"], ls="--", lw=1)
            ax.set_ylim(0, top * 1.1)
            ax.set_xticks([])
            if rank == 0:
                ax.set_title(stage, fontsize=10)
            if col == 0:
                ax.set_ylabel(f"rank {rank}\nMiB")
            if rank == ranks - 1:
                ax.set_xlabel("samples: steps (grey lines),\nforward then backward", fontsize=8)
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
    from matplotlib.patches import Patch

    handles = [Patch(color=MEMORY_COLORS[k], label=k) for k in kinds]
    if predicted_peak is not None:
        handles.append(plt.Line2D([], [], color=COLORS["theory"], ls="--",
                                  label="predicted peak"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    full = title or ""
    if caption:
        full = f"{full}\n{caption}" if full else caption
    if full:
        fig.suptitle(full, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


__all__ += ["MEMORY_COLORS", "draw_memory_over_time"]

# ---- the expert-parallel chapter: load per expert, busiest rank, balance over training

def _tidy(ax, caption: str) -> None:
    if caption:
        ax.set_title(caption, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def draw_tokens_per_expert(load: Sequence[int], capacities: dict[Any, int] | None = None,
                           caption: str = "", ax=None):
    """Choices per expert (bars, ``load[e]``) and each capacity factor's capacity (dashed
    lines, ``capacities[factor]``): what sticks out above a line is dropped. The legend sits
    to the right of the axes, clear of every bar and line. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.0))
    ax.bar(range(len(load)), load, color=COLORS["forward"])
    styles = ("--", "-.", ":", (0, (5, 1)))
    for style, (factor, capacity) in zip(styles, (capacities or {}).items()):
        ax.axhline(capacity, color=COLORS["theory"], linestyle=style, linewidth=1,
                   label=f"capacity at factor {factor}: {capacity}")
    ax.set_xticks(range(len(load)))
    ax.set_xlabel("expert")
    ax.set_ylabel("choices routed to it")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no 2.5 choices
    if capacities:  # beside the axes: a capacity line can sit at any height, under any corner
        ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _tidy(ax, caption)
    return ax


def draw_expert_imbalance(runs: dict[str, Sequence[dict[str, float]]], caption: str = "",
                          ax=None):
    """Per rank, emulated expert compute (busy) and the wait for the combine, one group of
    bars per case: ``runs[case][rank]`` has ``"busy"`` and ``"total"`` seconds
    (:func:`parlib.experiments.experts.emulated_step`). Returns the axes."""
    ax = _busy_and_waiting(runs, "ms (dispatch, experts, combine of one MoE layer)",
                           ("experts (emulated)", "all-to-all and waiting"), ax,
                           loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    _tidy(ax, caption)
    return ax


def draw_balance_over_steps(curves: dict[str, Sequence[float]], window: int = 20,
                            caption: str = "", ax=None):
    """The busiest expert's choices over the mean at every training step, one line per
    run (``curves[label]``), and its running mean over ``window`` steps. Returns the
    axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.0))
    for label, values in curves.items():
        line, = ax.plot(values, alpha=0.25, linewidth=0.8)
        spans = [values[max(0, i - window + 1):i + 1] for i in range(len(values))]
        smooth = [sum(span) / len(span) for span in spans]
        ax.plot(smooth, color=line.get_color(), label=f"{label} (mean of {window} steps)")
    ax.axhline(1.0, color=COLORS["theory"], linestyle="--", linewidth=1, label="balanced")
    ax.set_xlabel("training step")
    ax.set_ylabel("busiest expert / mean")
    ax.legend(fontsize=8, frameon=False)
    _tidy(ax, caption)
    return ax


__all__ += ["draw_balance_over_steps", "draw_expert_imbalance", "draw_tokens_per_expert"]

# ---- the pipeline schedule lab: measured next to simulated timelines

# A split backward's W (the weights' gradients): the backward family, darker than B.
COLORS["weight"] = "#A0522D"


def draw_schedule_lab(runs: Sequence[Any], caption: str = "", unit: str = "ms"):
    """For each schedule, its measured timeline (left) next to its simulated one (right),
    on one time axis per schedule, the formula's predicted step end dashed on both. ``runs``:
    :class:`parlib.experiments.schedule_lab.LabRun` objects (anything with ``title``,
    ``measured`` and ``simulated`` spans per rank, and ``prediction.step``). Forward,
    backward and W (a split backward's weight gradients, darker) keep the course colours;
    hatched boxes are a rank's second chunk. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from parlib.measure.timeline import makespan

    runs = list(runs)
    if not runs:
        raise ValueError("no schedules to draw")
    p = max(len(r.measured) for r in runs)
    fig, axes = plt.subplots(len(runs), 2, figsize=(13, (0.45 * p + 1.0) * len(runs) + 1.2),
                             squeeze=False, sharex="row")
    for row, run in zip(axes, runs):
        predicted = getattr(getattr(run, "prediction", None), "step", None)
        for ax, spans, side in ((row[0], run.measured, "measured"),
                                (row[1], run.simulated, "simulated")):
            draw_timeline(spans, ax, unit=unit, ideal=predicted, legend=False,
                          title=f"{run.title}: {side}")
            ax.set_xlabel("")
        row[0].set_xlabel(f"time ({unit})", fontsize=8)
        row[1].set_xlabel(f"time ({unit})", fontsize=8)
        right = max(makespan(run.measured), makespan(run.simulated), predicted or 0.0)
        row[0].set_xlim(0, right * {"ms": 1e3, "s": 1.0, "t": 1.0}[unit] * 1.02)
    handles = [Patch(color=COLORS["forward"], label="forward (F)"),
               Patch(color=COLORS["backward"], label="backward (B)"),
               Patch(color=COLORS["weight"], label="weight gradients (W)"),
               Patch(facecolor="white", edgecolor="#777777", hatch="//",
                     label="second chunk (interleaved)"),
               Patch(color=COLORS["recv"], label="send / recv (thin strip)"),
               Patch(color=COLORS["idle"], label="idle (bubble)"),
               plt.Line2D([], [], color=COLORS["theory"], ls="--", label="predicted end")]
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=8, frameon=False)
    title = "Pipeline schedules, measured next to simulated"
    if "emulated" not in (caption or ""):  # a run_label caption already says it
        title += " (emulated stage cost)"
    fig.suptitle(f"{title}\n{caption}" if caption else title, fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    return fig


__all__ += ["draw_schedule_lab"]


# --------------------------------------------------------------------------------------
# One rank's step, one row per axis
# --------------------------------------------------------------------------------------

AXIS_ROW_ORDER = ("tp", "cp", "ep", "dp", "pp")  # fastest-varying first, the pipeline last


def draw_axis_rows(spans: Iterable[Span], ax: Any = None, *, title: str | None = None,
                   caption: str = "", bytes_by_axis: dict[str, float] | None = None,
                   unit: str = "ms") -> Any:
    """One rank's step with one row per parallelism axis: its compute on top (forward,
    backward, coloured as everywhere), then each axis' communication in the
    communication colour (hatched as :data:`AXIS_STYLE` hatches it), in
    :data:`AXIS_ROW_ORDER`; the pp row holds the pipeline's sends and receives (a receive
    includes its wait). Only axes with spans get a row. ``bytes_by_axis``: bytes per axis,
    written into the row labels. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    from parlib.measure.tables import fmt_bytes

    spans = list(spans)
    scale = {"ms": 1e3, "s": 1.0}[unit]
    t0 = min((x.start for x in spans), default=0.0)

    def row_of(x: Span) -> str | None:
        if x.kind in COMPUTE:
            return "compute"
        return "pp" if x.kind in _POINT_TO_POINT else (x.kind if x.kind in AXES else None)

    rows = ["compute"] + [a for a in AXIS_ROW_ORDER if any(row_of(x) == a for x in spans)]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.2))
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        for x in (x for x in spans if row_of(x) == row):
            colour = COLORS[x.kind] if row == "compute" else COLORS["comm"]
            hatch = AXIS_STYLE.get(row, (None, None))[1] if row != "compute" else None
            ax.broken_barh([((x.start - t0) * scale, max(x.duration * scale, 1e-3))],
                           (y - 0.35, 0.7), facecolors=colour, hatch=hatch,
                           edgecolors="white", linewidth=0.4)
    labels = []
    for row in rows:
        calls = sum(row_of(x) == row for x in spans)
        what = ("message" if row == "pp" else "call") + ("s" if calls != 1 else "")
        extra = (f", {fmt_bytes(bytes_by_axis[row])}"
                 if bytes_by_axis and row in bytes_by_axis else "")
        labels.append(row if row == "compute" else f"{row} ({calls} {what}{extra})")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(list(reversed(labels)))
    ax.set_xlabel({"ms": "time (ms)", "s": "time (s)"}[unit])
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in COMPUTE
                       if any(x.kind == k for x in spans)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    _tidy(ax, "\n".join(t for t in (title, caption) if t))
    return ax


__all__ += ["AXIS_ROW_ORDER", "draw_axis_rows"]
