"""Communication per parallelism axis: calls, bytes and timeline spans, by process group.

:func:`axis_traffic` is a view on :mod:`parlib.measure.intercept`: every collective or
point-to-point call made on one of the named groups (a mesh's ``dp``, ``tp``, ``pp``
groups, or any other axis) is counted on that axis and, with a recorder, drawn as a span
of kind ``"<axis>"`` (:data:`parlib.measure.timeline.AXES`). Calls on other groups pass
through uncounted. HSDP's two data-parallel axes may be counted apart, as
``"dp_shard"`` and ``"dp_replicate"`` (:data:`SUB_AXES`; torchtitan's names): their spans
are drawn as ``"dp"``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from parlib.measure.emulation import PacedCost
from parlib.measure.intercept import Call, observing, on_wait
from parlib.measure.timeline import AXES, Recorder, Span

# axes counted on their own and drawn as the axis they split: HSDP's shard and replicate groups
SUB_AXES = {"dp_shard": "dp", "dp_replicate": "dp"}


class _AxisCounter:
    def __init__(self, groups: Mapping[str, Any], recorder: Recorder | None,
                 pacer: PacedCost | None, paced: Collection[str]) -> None:
        self.groups = dict(groups)
        self.recorder, self.pacer, self.paced = recorder, pacer, frozenset(paced)
        self.counts = {axis: {"calls": 0, "message_bytes": 0, "sent_bytes": 0.0}
                       for axis in self.groups}

    def axis_of(self, group: Any) -> str | None:
        if group is None:
            group = dist.group.WORLD
        return next((a for a, g in self.groups.items() if g is group), None)

    def around(self, call: Call, proceed: Callable[[], Any]) -> Any:
        axis = self.axis_of(call.group)
        if axis is None:
            return proceed()
        rec, pacer = self.recorder, self.pacer
        if pacer is not None and rec is not None and axis in self.paced:
            # pad the compute since the span began, not counting communication in it
            pacer.before_point(rec.seconds_since(pacer.started))
        t0 = rec.now() if rec is not None else time.perf_counter()
        result = proceed()
        counts = self.counts[axis]
        counts["calls"] += 1
        counts["message_bytes"] += call.nbytes
        counts["sent_bytes"] += call.sent_bytes or 0.0
        if rec is None:
            return result

        def done() -> None:
            rec.spans.append(Span(rec.rank, SUB_AXES.get(axis, axis), t0, rec.now()))

        if call.async_op:
            return on_wait(result, done)
        done()
        return result


@contextmanager
def axis_traffic(groups: Mapping[str, Any], recorder: Recorder | None = None,
                 pacer: PacedCost | None = None, paced: Collection[str] = ("tp",)
                 ) -> Iterator[dict[str, dict[str, float]]]:
    """While active, every collective and point-to-point call on ``groups[axis]`` is
    counted on ``axis``: the yielded dict gets, per axis, ``calls``, ``message_bytes`` and
    ``sent_bytes`` (what this rank sends, :func:`parlib.cost.predicted_sent_bytes`: the
    ring all-reduce's 2(N-1)/N of each message, an all-to-all's pieces for other ranks).
    With a ``recorder``, each call is also a span of kind ``axis`` (an async call's span
    ends when it has been waited for). A ``pacer`` (emulated compute) is told when each
    call on a ``paced`` axis begins, with the communication recorded since its span began
    (tensor parallelism's all-reduces sit inside the forward; it needs the recorder)."""
    unknown = [a for a in groups if a not in AXES and a not in SUB_AXES]
    if unknown:
        raise ValueError(f"unknown axis {', '.join(map(repr, unknown))}: timeline spans "
                         f"are named after one of {', '.join(AXES)} (or HSDP's "
                         f"{', '.join(SUB_AXES)}, drawn as dp)")
    if pacer is not None and recorder is None:
        raise ValueError("a pacer needs the recorder: it is told the communication "
                         "seconds recorded since its span began")
    counter = _AxisCounter(groups, recorder, pacer, paced)
    with observing(counter):
        yield counter.counts


__all__ = ["SUB_AXES", "axis_traffic"]
