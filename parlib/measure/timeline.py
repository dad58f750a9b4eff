"""Record what each rank did and when (:func:`parlib.plots.draw_timeline` draws it).

Inside a rank::

    rec = Recorder()
    with rec.span("forward", mb=3):
        y = stage(x)
    return rec.spans            # gathered to the notebook by parlib.launch

In the notebook::

    spans = align(results)      # one list of spans per rank, time 0 = first span
    draw_timeline(spans, title="GPipe, m = 8", caption=run_label(...))
    measured_bubble(spans)      # 1 - busy / (p x step time)

Spans of kind ``forward``, ``backward`` and ``weight`` (a split backward's W) are compute;
``send`` and ``recv`` are communication (a ``recv`` span includes the time spent waiting
for the message), and so is a span named after a parallelism axis (:data:`AXES`: a
collective or message on that axis' group, recorded by
:func:`parlib.measure.traffic.axis_traffic`); any time a rank is not computing is idle.
Times come from ``time.perf_counter``, which on Linux
reads one clock for every process of a machine, so ranks on one machine line up.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from parlib.cost.layout import ALL_AXIS_NAMES

COMPUTE = ("forward", "backward", "weight")  # weight: a split backward's W
# Communication on one parallelism axis' group: the axes are the cost layer's table (the
# borrowed ep too: its all-to-alls run on groups of their own).
AXES = ALL_AXIS_NAMES
COMM = ("send", "recv", *AXES)
KINDS = (*COMPUTE, *COMM, "idle")


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

    def now(self) -> float:
        """The clock spans are stamped with (after a device sync on CUDA)."""
        if self._cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()


    @contextmanager
    def span(self, kind: str, mb: int | None = None, chunk: int = 0) -> Iterator[None]:
        if kind not in KINDS:
            raise ValueError(f"unknown span kind {kind!r}; use one of {KINDS}")
        start = self.now()
        try:
            yield
        finally:
            self.spans.append(Span(self.rank, kind, start, self.now(), mb, chunk))

    def count(self, peer: int, nbytes: int, sent: bool) -> None:
        (self.sent if sent else self.received)[peer] += int(nbytes)

    def seconds_since(self, start: float) -> float:
        """Total duration of the spans recorded that began at or after ``start`` (those
        nested in a span still open, such as the all-reduces inside a forward)."""
        return sum(s.duration for s in self.spans if s.start >= start)


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
    """Compute time (forward, backward and weight spans) of one rank."""
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


__all__ = [
    "Span",
    "Recorder",
    "COMPUTE",
    "AXES",
    "COMM",
    "KINDS",
    "align",
    "makespan",
    "busy_time",
    "measured_bubble",
    "idle_spans",
]
