"""Observing real runs: time, bytes communicated, memory, timelines, emulated costs.

- :mod:`~parlib.measure.timing`: :func:`time_it` (warm-up, device sync, median, spread).
- :mod:`~parlib.measure.tables`: :class:`Table` (text and HTML), :func:`fmt_bytes`,
  :func:`print_wrapped`.
- :mod:`~parlib.measure.intercept`: the one interception of ``torch.distributed`` (every
  collective and point-to-point call, one table of ops and their bytes). While an
  observer is subscribed it **patches ``torch.distributed`` process-wide** (every thread
  of the rank goes through it); the originals come back when the last one leaves. The
  three views on it:
- :mod:`~parlib.measure.comm_log`: :class:`CommLog` records every call a rank makes.
- :mod:`~parlib.measure.traffic`: :func:`axis_traffic` counts and times the calls on each
  parallelism axis' group (spans of kind "tp", "dp", ...).
- :mod:`~parlib.measure.memory`: bytes of parameters, gradients, optimizer state and saved
  activations (:class:`SavedActivations`, :func:`memory_breakdown`), and what a forward
  leaves alive whoever holds it (:class:`KeptAllocations`).
- :mod:`~parlib.measure.timeline`: spans per rank (:class:`Recorder`) and their analysis;
  :mod:`~parlib.measure.trace` writes them as a Chrome/Perfetto trace
  (:func:`save_chrome_trace`), the format ``torch.profiler`` exports.
- :mod:`~parlib.measure.emulation`: emulated stage cost and slow links (:class:`SlowLink`,
  the third view), labelled as such.
- :mod:`~parlib.measure.links`: the all-reduce alpha-beta fit the launching chapter saves and later
  chapters read (:func:`load_link`).
- :mod:`~parlib.measure.crossings`: a pipeline boundary crossing timed the way the runner
  pays it (:func:`measure_crossings`: latency, each rank's own time, an emulated op's slack).
- :mod:`~parlib.measure.matmul_rate`: the best matmul FLOP/s over a sweep of shapes, saved
  and read back the same way (:func:`measure_matmul_rate`, :func:`load_matmul_rate`).

The names below load their module on first use, so that ``parlib.measure.timeline`` (no
torch) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "MiB": "tables", "Table": "tables", "fmt_bytes": "tables", "print_wrapped": "tables",
    "LINE_WIDTH": "tables",
    "Timing": "timing", "sync": "timing", "time_it": "timing",
    "CommLog": "comm_log", "CommRecord": "comm_log",
    "GatheredWeights": "memory", "KeptAllocations": "memory", "MemoryReport": "memory",
    "SavedActivations": "memory",
    "grad_bytes": "memory",
    "memory_breakdown": "memory", "optimizer_state_bytes": "memory", "param_bytes": "memory",
    "tensor_bytes": "memory",
    "axis_traffic": "traffic",
    "Recorder": "timeline", "Span": "timeline", "align": "timeline", "busy_time": "timeline",
    "idle_spans": "timeline", "makespan": "timeline", "measured_bubble": "timeline",
    "chrome_trace": "trace", "save_chrome_trace": "trace",
    "PacedCost": "emulation", "SlowLink": "emulation", "StageCost": "emulation",
    "default_cost": "emulation",
    "LinkFit": "links", "fit_link": "links", "load_link": "links", "save_links": "links",
    "load_or_measure": "links",
    "time_all_reduce": "links", "timed_all_reduces": "links",
    "CrossingFit": "crossings", "measure_crossings": "crossings",
    "time_crossings": "crossings",
    "MatmulRate": "matmul_rate", "load_matmul_rate": "matmul_rate",
    "matmul_flops": "matmul_rate", "measure_matmul_rate": "matmul_rate",
    "save_matmul_rate": "matmul_rate",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
