"""Record what each rank did and when, and draw it as a Gantt chart.

Inside a rank::

    rec = Recorder()
    with rec.span("forward", mb=3):
        y = stage(x)
    return rec.spans            # gathered to the notebook by parlib.launch

In the notebook::

    spans = align(results)      # one list of spans per rank, time 0 = first span
    draw(spans, title="GPipe, m = 8", caption=run_label(...))
    measured_bubble(spans)      # 1 - busy / (p x step time)

Spans of kind ``forward`` and ``backward`` are compute; ``send`` and ``recv`` are
communication (a ``recv`` span includes the time spent waiting for the message); any time
a rank is not computing is idle. Times come from ``time.perf_counter``, which on Linux
reads one clock for every process of a machine, so ranks on one machine line up.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Sequence

from parlib.style import COLORS

COMPUTE = ("forward", "backward")
COMM = ("send", "recv")
KINDS = ("forward", "backward", "send", "recv", "idle")


@dataclass(frozen=True)
class Span:
    """One interval of work on one rank: ``kind`` from :data:`KINDS`, times in seconds
    (or schedule time units), ``mb`` the microbatch (None when not tied to one)."""

    rank: int
    kind: str
    start: float
    end: float
    mb: int | None = None
    chunk: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


class Recorder:
    """Collects this rank's spans. ``span(kind, mb)`` is a context manager; ``sent`` and
    ``received`` count bytes by peer rank (filled by whoever calls :meth:`count`).

    On a CUDA device the recorder synchronises before reading the clock, so a span covers
    the kernels it launched, not just their launch.
    """

    def __init__(self, rank: int | None = None, device: Any = None) -> None:
        if rank is None:
            try:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else 0
            except Exception:  # noqa: BLE001 - torch.distributed missing: one process
                rank = 0
        self.rank = int(rank)
        self.spans: list[Span] = []
        self.sent: dict[int, int] = defaultdict(int)
        self.received: dict[int, int] = defaultdict(int)
        self._cuda = device is not None and str(device).startswith("cuda")

    def _now(self) -> float:
        if self._cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def span(self, kind: str, mb: int | None = None, chunk: int = 0) -> Iterator[None]:
        if kind not in KINDS:
            raise ValueError(f"unknown span kind {kind!r}; use one of {KINDS}")
        start = self._now()
        try:
            yield
        finally:
            self.spans.append(Span(self.rank, kind, start, self._now(), mb, chunk))

    def add(self, kind: str, start: float, end: float, mb: int | None = None,
            chunk: int = 0) -> None:
        self.spans.append(Span(self.rank, kind, start, end, mb, chunk))

    def count(self, peer: int, nbytes: int, sent: bool) -> None:
        (self.sent if sent else self.received)[peer] += int(nbytes)

    def clear(self) -> None:
        self.spans.clear()
        self.sent.clear()
        self.received.clear()


# --------------------------------------------------------------------------- analysis


def align(spans_by_rank: Sequence[Iterable[Span]]) -> list[list[Span]]:
    """Shift every rank's spans so that the earliest span of any rank starts at 0."""
    lists = [sorted(s, key=lambda x: x.start) for s in spans_by_rank]
    t0 = min((s[0].start for s in lists if s), default=0.0)
    return [[replace(x, start=x.start - t0, end=x.end - t0) for x in s] for s in lists]


def makespan(spans_by_rank: Sequence[Iterable[Span]]) -> float:
    """Step time: from the first span's start to the last span's end, over all ranks."""
    flat = [x for s in spans_by_rank for x in s]
    if not flat:
        return 0.0
    return max(x.end for x in flat) - min(x.start for x in flat)


def busy_time(spans: Iterable[Span]) -> float:
    """Compute time (forward + backward) of one rank."""
    return sum(x.duration for x in spans if x.kind in COMPUTE)


def measured_bubble(spans_by_rank: Sequence[Iterable[Span]]) -> float:
    """Idle fraction of the step: 1 - (compute time of all ranks) / (p x step time)."""
    lists = [list(s) for s in spans_by_rank]
    total = makespan(lists) * len(lists)
    if total <= 0:
        return 0.0
    return 1.0 - sum(busy_time(s) for s in lists) / total


def idle_spans(spans_by_rank: Sequence[Iterable[Span]]) -> list[list[Span]]:
    """The gaps between compute spans on each rank, from step start to step end."""
    lists = [sorted((x for x in s if x.kind in COMPUTE), key=lambda x: x.start)
             for s in spans_by_rank]
    flat = [x for s in spans_by_rank for x in s]
    if not flat:
        return [[] for _ in lists]
    t0, t1 = min(x.start for x in flat), max(x.end for x in flat)
    out = []
    for rank, s in enumerate(lists):
        gaps, t = [], t0
        for x in s:
            if x.start > t:
                gaps.append(Span(rank, "idle", t, x.start))
            t = max(t, x.end)
        if t1 > t:
            gaps.append(Span(rank, "idle", t, t1))
        out.append(gaps)
    return out


# --------------------------------------------------------------------------- drawing


def draw(
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
) -> Any:
    """Gantt chart: one row per stage (stage 0 on top), one box per op coloured by kind
    with its microbatch number inside, idle time light grey, communication as a thin
    strip under each row. ``unit``: "ms" (spans in seconds, drawn in ms), "s", or "t"
    (schedule time units, drawn as they are). ``ideal``: draw the predicted step end as a
    dashed line (same units as the spans). Returns the matplotlib Axes.
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
    comm_h = 0.14
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
            elif x.kind in COMM and show_comm:
                ax.broken_barh([(left, max(w, 0.002 * width_total))],
                               (y - h / 2 - comm_h, comm_h),
                               facecolors=COLORS[x.kind], edgecolors="none")
    if ideal is not None:
        ax.axvline(ideal * scale, color=COLORS["theory"], linestyle="--", linewidth=1.2)
        ax.text(ideal * scale, p - 0.45, "predicted end ", color=COLORS["theory"],
                fontsize=8, va="bottom", ha="right")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {r}" for r in reversed(range(p))])
    ax.set_ylim(-0.75, p - 0.2)
    right = max(width_total, (ideal or 0) * scale)
    ax.set_xlim(0, right * 1.01)
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
        if show_comm and any(x.kind in COMM for x in flat):
            handles.append(Patch(color=COLORS["recv"], label="send / recv (thin strip)"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize=8, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


__all__ = [
    "Span",
    "Recorder",
    "COMPUTE",
    "COMM",
    "KINDS",
    "align",
    "makespan",
    "busy_time",
    "measured_bubble",
    "idle_spans",
    "draw",
]
