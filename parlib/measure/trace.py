"""A timeline as a trace file: spans per rank in the Chrome trace event format, the format
``torch.profiler`` writes (``prof.export_chrome_trace``), so one run's spans open in
Perfetto (https://ui.perfetto.dev, "Open trace file") or ``chrome://tracing`` beside, or
instead of, a profiler's trace. For example::

    import torch, parlib
    from parlib.measure import Recorder, align, save_chrome_trace

    def step():
        rec, a = Recorder(), torch.ones(256, 256)
        with rec.span("forward", mb=0):
            a @ a
        return rec.spans

    spans = align(parlib.launch(step, world_size=2))   # one list of Spans per rank
    path = save_chrome_trace(spans, "step_trace.json")

Each rank is a process (``pid``, named "rank r"); compute and communication are two
threads of it (``tid`` 0 and 1), so a collective that runs beside the compute shows as a
second lane, as a profiler shows a communication stream. Each span is a complete event
(``"ph": "X"``) with its start and duration in microseconds, its kind as the event's name
and category, and its microbatch and chunk in ``args``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from parlib.measure.timeline import COMPUTE, Span

_UNIT_TO_MICROSECONDS = {"s": 1e6, "ms": 1e3, "us": 1.0}


def chrome_trace(spans_by_rank: Sequence[Iterable[Span]], unit: str = "s") -> dict[str, Any]:
    """The trace of ``spans_by_rank`` (one iterable of spans per rank, times in ``unit``:
    "s", as :class:`~parlib.measure.timeline.Recorder` stamps them, "ms" or "us") as a
    JSON-ready dict: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    if unit not in _UNIT_TO_MICROSECONDS:
        raise ValueError(f"unit must be one of {', '.join(_UNIT_TO_MICROSECONDS)}, got "
                         f"{unit!r} (schedule time units have no clock to put on a trace)")
    scale = _UNIT_TO_MICROSECONDS[unit]
    events: list[dict[str, Any]] = []
    for index, spans in enumerate(spans_by_rank):
        spans = list(spans)
        rank = spans[0].rank if spans else index
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        for tid, lane in ((0, "compute"), (1, "communication")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": lane}})
        for span in spans:
            args = {"chunk": span.chunk} if span.chunk else {}
            if span.mb is not None:
                args["mb"] = span.mb
            name = span.kind if span.mb is None else f"{span.kind} {span.mb}"
            events.append({"ph": "X", "name": name, "cat": span.kind, "pid": rank,
                           "tid": 0 if span.kind in COMPUTE else 1,
                           "ts": span.start * scale, "dur": span.duration * scale,
                           "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(spans_by_rank: Sequence[Iterable[Span]], path: str | Path,
                      unit: str = "s") -> Path:
    """Write :func:`chrome_trace` of ``spans_by_rank`` to ``path`` (JSON) and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans_by_rank, unit)))
    return path


__all__ = ["chrome_trace", "save_chrome_trace"]
