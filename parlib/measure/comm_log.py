"""Recording communication: every collective and point-to-point call a rank makes.

:class:`CommLog` records each call's operation, message bytes, group size and seconds,
and, on Linux, the bytes this process really wrote to its sockets. It is a view on
:mod:`parlib.measure.intercept`, the one interception of ``torch.distributed``: while a
``CommLog`` is active every collective and point-to-point call of the rank (every thread,
however the call is spelled: ``dist``, ``distributed_c10d``, the functional collectives)
is recorded; the originals come back when the last log closes.

``CommLog(deep=True)`` also lists in ``log.pg_calls`` every operation that reached a
``ProcessGroup`` object or a functional-collective op (``torch.ops._c10d_functional``),
whatever Python function issued it (a call made straight on ``dist.group.WORLD`` included):
the checks use it to be sure what a learner's function really did
(:func:`parlib.measure.intercept.spying`); it adds nothing per tensor operation.

Why a wrapper rather than ``torch.distributed.tensor.debug.CommDebugMode``: on torch 2.13
CommDebugMode does see plain ``dist.all_reduce`` calls (it counts ``c10d.allreduce_``), but
it reports counts only, with no bytes and no time. Collectives issued from C++
(DistributedDataParallel's reducer) are invisible to both; the socket byte counter still
sees their traffic. The textbook bytes come from :func:`parlib.cost.predicted_sent_bytes`
(an all-to-all's from its split sizes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parlib.cost import predicted_sent_bytes
from parlib.measure.intercept import Call, observing, on_wait, spying
from parlib.measure.tables import Table, fmt_bytes


def _io_wchar() -> int | None:
    """Bytes this process has passed to write-like system calls (sockets included)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class CommRecord:
    """One call: ``op`` (normalised name), ``nbytes`` (full message, see
    :func:`predicted_sent_bytes`), ``group_size``, ``seconds`` (call to completion: for an
    async call, until its ``wait()`` returned; ``nan`` if never waited), ``async_op``, and
    ``wire_bytes`` (bytes this process wrote while a blocking call ran; ``None`` for async
    calls or where the OS does not tell)."""

    op: str
    nbytes: int
    group_size: int
    seconds: float
    async_op: bool
    wire_bytes: int | None = None
    sent_bytes: float | None = None  # from the interception layer's table, when known

    @property
    def predicted_sent(self) -> float | None:
        """Bytes this rank sends: the textbook ring figure, or the count of an all-to-all's
        pieces addressed to other ranks."""
        if self.sent_bytes is not None:
            return self.sent_bytes
        return predicted_sent_bytes(self.op, self.nbytes, self.group_size)


class _Recording:
    """The interception layer's observer behind every open :class:`CommLog`: one record
    per call, handed to each open log."""

    def around(self, call: Call, proceed: Callable[[], Any]) -> Any:
        record = CommRecord(call.op, call.nbytes, call.group_size, float("nan"),
                            call.async_op, sent_bytes=call.sent_bytes)
        w0 = None if call.async_op else _io_wchar()
        t0 = time.perf_counter()
        result = proceed()
        for log in list(_active):
            log.records.append(record)
        if call.async_op:
            def done() -> None:
                record.seconds = time.perf_counter() - t0

            return on_wait(result, done)
        record.seconds = time.perf_counter() - t0
        w1 = _io_wchar()
        record.wire_bytes = None if w0 is None or w1 is None else w1 - w0
        return result


_lock = threading.Lock()
_active: list["CommLog"] = []
_recording = _Recording()
_subscription: list[Any] = []  # the open observing() context while any log is active


class CommLog:
    """Record every ``torch.distributed`` call this rank makes inside ``with CommLog() as log``.

    ``log.records`` is a list of :class:`CommRecord`. ``log.wire_bytes`` is what this
    process wrote to its sockets during the block (Linux ``/proc/self/io``; gloo sends over
    TCP, so this is the real traffic, collectives issued from C++ included; ``None`` where
    unavailable; on NCCL, GPU-to-GPU traffic does not pass through it). Prints inside the
    block add a few bytes. Nested and concurrent logs each get every record.
    """

    def __init__(self, *, deep: bool = False) -> None:
        self.records: list[CommRecord] = []
        self.wire_bytes: int | None = None
        self.pg_calls: list[str] = []  # ops that reached a ProcessGroup (deep=True only)
        self._w0: int | None = None
        self._deep = deep
        self._spy: Any = None

    def __enter__(self) -> "CommLog":
        with _lock:
            if not _active:
                subscription = observing(_recording)
                subscription.__enter__()
                _subscription.append(subscription)
            _active.append(self)
        if self._deep:
            self._spy = spying(self.pg_calls.append)
            self._spy.__enter__()
        self._w0 = _io_wchar()
        return self

    def __exit__(self, *exc: Any) -> None:
        w1 = _io_wchar()
        self.wire_bytes = None if self._w0 is None or w1 is None else w1 - self._w0
        if self._spy is not None:
            self._spy.__exit__(None, None, None)
            self._spy = None
        with _lock:
            _active.remove(self)
            if not _active:
                _subscription.pop().__exit__(None, None, None)

    # summaries -------------------------------------------------------------------------
    def select(self, op: str | None = None) -> list[CommRecord]:
        return [r for r in self.records if op is None or r.op == op]

    def count(self, op: str | None = None) -> int:
        return len(self.select(op))

    def total_bytes(self, op: str | None = None) -> int:
        """Sum of message sizes (see :class:`CommRecord`)."""
        return sum(r.nbytes for r in self.select(op))

    def predicted_sent(self, op: str | None = None) -> float:
        """Textbook ring bytes this rank sends for the recorded calls."""
        return sum(r.predicted_sent or 0.0 for r in self.select(op))

    def seconds(self, op: str | None = None) -> float:
        """Seconds spent in (blocking) or waiting on (async) the recorded calls."""
        return sum(r.seconds for r in self.select(op) if r.seconds == r.seconds)

    def table(self, title: str = "") -> Table:
        """One row per operation: calls, message bytes, predicted sent bytes, seconds."""
        ops = sorted({r.op for r in self.records})
        rows = []
        for op in ops:
            recs = self.select(op)
            wire = [r.wire_bytes for r in recs]
            wire_total = None if any(w is None for w in wire) else sum(wire)
            rows.append(
                [
                    op,
                    len(recs),
                    recs[0].group_size,
                    fmt_bytes(self.total_bytes(op)),
                    fmt_bytes(self.predicted_sent(op)),
                    fmt_bytes(wire_total),
                    self.seconds(op) * 1e3,
                ]
            )
        cols = ["op", "calls", "N", "message", "ring sends (formula)", "written (measured)", "ms"]
        return Table(cols, rows, title=title)


__all__ = ["CommLog", "CommRecord"]
