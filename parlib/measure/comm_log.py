"""Recording communication: every collective and point-to-point call a rank makes.

:class:`CommLog` records each call's operation, message bytes, group size and seconds,
and, on Linux, the bytes this process really wrote to its sockets. While a ``CommLog`` is
active it **patches the collective functions process-wide**, both where they are defined
(``torch.distributed.distributed_c10d``, which ``torch.distributed`` re-exports) and under
their ``torch.distributed`` names, so a call is seen however it is spelled; every thread
of this rank goes through the wrappers; they are restored when the last log closes.

``CommLog(deep=True)`` also lists in ``log.pg_calls`` every operation that reached a
``ProcessGroup`` object or a functional-collective op (``torch.ops._c10d_functional``),
whatever Python function issued it (a call made straight on ``dist.group.WORLD`` included):
the checks use it to be sure what a learner's function really did. It patches those
methods process-wide too; it adds nothing per tensor operation.

Why a wrapper rather than ``torch.distributed.tensor.debug.CommDebugMode``: on torch 2.13
CommDebugMode does see plain ``dist.all_reduce`` calls (it counts ``c10d.allreduce_``), but
it reports counts only, with no bytes and no time. Collectives issued from C++
(DistributedDataParallel's reducer) are invisible to both; the socket byte counter still
sees their traffic. The textbook bytes come from :func:`parlib.cost.predicted_sent_bytes`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parlib.cost import predicted_sent_bytes
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

    @property
    def predicted_sent(self) -> float | None:
        return predicted_sent_bytes(self.op, self.nbytes, self.group_size)


# public name -> (normalised op name, how to find the message tensor and its bytes)
def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


_OPS: dict[str, tuple[str, Callable[[tuple, dict], int]]] = {
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "broadcast": ("broadcast", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "reduce": ("reduce", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "reduce_scatter_single": (
        "reduce_scatter",
        lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input")),
    ),
    "reduce_scatter_tensor": (
        "reduce_scatter",
        lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input")),
    ),
    "reduce_scatter": (
        "reduce_scatter",
        lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input_list")),
    ),
    "all_gather_single": (
        "all_gather",
        lambda a, k: _nbytes(a[0] if a else k.get("output_tensor")),
    ),
    "all_gather_into_tensor": (
        "all_gather",
        lambda a, k: _nbytes(a[0] if a else k.get("output_tensor")),
    ),
    "all_gather": ("all_gather", lambda a, k: _nbytes(a[0] if a else k.get("tensor_list"))),
    "all_to_all_single": (
        "all_to_all",
        lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input")),
    ),
    "all_to_all": (
        "all_to_all",
        lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input_tensor_list")),
    ),
    "send": ("send", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "recv": ("recv", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "isend": ("send", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "irecv": ("recv", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "barrier": ("barrier", lambda a, k: 0),
}
_ALWAYS_ASYNC = {"isend", "irecv"}

_lock = threading.Lock()
_active: list["CommLog"] = []
_originals: dict[tuple[Any, str], Callable] = {}  # (module, name) -> function it had
_local = threading.local()
_MODULES = (c10d, dist)  # where a collective is defined, and its public re-export


class _TimedWork:
    """Wraps an async ``Work`` so that ``wait()`` stamps the record's completion time."""

    def __init__(self, work: Any, record: CommRecord, t0: float):
        self._work = work
        self._record = record
        self._t0 = t0

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._record.seconds != self._record.seconds:  # first wait
            self._record.seconds = time.perf_counter() - self._t0
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _group_size(args: tuple, kwargs: dict) -> int:
    group = kwargs.get("group")
    try:
        return dist.get_world_size(group) if group is not None else dist.get_world_size()
    except Exception:  # noqa: BLE001 - a group this rank is not in, or no process group
        return 1


def _wrap(name: str, original: Callable) -> Callable:
    op, size_of = _OPS[name]

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0) or not _active:  # nested call inside another one
            return original(*args, **kwargs)
        is_async = name in _ALWAYS_ASYNC or bool(kwargs.get("async_op", False))
        try:
            nbytes = size_of(args, kwargs)
        except Exception:  # noqa: BLE001 - odd call shapes are still forwarded
            nbytes = 0
        record = CommRecord(op, nbytes, _group_size(args, kwargs), float("nan"), is_async)
        w0 = None if is_async else _io_wchar()
        _local.depth = 1
        t0 = time.perf_counter()
        try:
            result = original(*args, **kwargs)
        finally:
            _local.depth = 0
        if not is_async:
            record.seconds = time.perf_counter() - t0
            w1 = _io_wchar()
            record.wire_bytes = None if w0 is None or w1 is None else w1 - w0
        for log in list(_active):
            log.records.append(record)
        if is_async and result is not None:
            return _TimedWork(result, record, t0)
        return result

    wrapper.__parlib_original__ = original  # type: ignore[attr-defined]
    return wrapper


# ProcessGroup method (or functional op) -> normalised op name, for CommLog(deep=True)
_PG_METHODS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_single": "all_gather", "all_gather_single_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_anysource": "recv",
    "barrier": "barrier", "monitored_barrier": "barrier",
}
_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
_deep_active: list["CommLog"] = []
_deep_originals: list[tuple[Any, str, Any, bool]] = []  # (owner, name, value, was_own_attr)


def _deep_wrap(op: str, original: Callable) -> Callable:
    def spy(*args: Any, **kwargs: Any) -> Any:
        for log in list(_deep_active):
            log.pg_calls.append(op)
        return original(*args, **kwargs)

    return spy


def _deep_patch() -> None:
    from torch._C._distributed_c10d import ProcessGroup

    targets: list[tuple[Any, dict[str, str]]] = [(ProcessGroup, _PG_METHODS)]
    try:
        targets.append((torch.ops._c10d_functional, _FUNCTIONAL_OPS))
    except Exception:  # noqa: BLE001 - a torch without functional collectives
        pass
    for owner, names in targets:
        for name, op in names.items():
            try:
                original = getattr(owner, name)
            except (AttributeError, RuntimeError):
                continue
            own = name in vars(owner)  # restore the raw entry (a pybind11 instancemethod)
            _deep_originals.append((owner, name, vars(owner).get(name), own))
            setattr(owner, name, _deep_wrap(op, original))


def _deep_restore() -> None:
    for owner, name, original, own in reversed(_deep_originals):
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    _deep_originals.clear()


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

    def __enter__(self) -> "CommLog":
        with _lock:
            if not _active:
                for name in _OPS:
                    wrappers: dict[int, Callable] = {}  # one wrapper per distinct function
                    for module in _MODULES:
                        original = getattr(module, name, None)
                        if original is None:
                            continue
                        _originals[(module, name)] = original
                        if id(original) not in wrappers:
                            wrappers[id(original)] = _wrap(name, original)
                        setattr(module, name, wrappers[id(original)])
            _active.append(self)
            if self._deep:
                if not _deep_active:
                    _deep_patch()
                _deep_active.append(self)
        self._w0 = _io_wchar()
        return self

    def __exit__(self, *exc: Any) -> None:
        w1 = _io_wchar()
        self.wire_bytes = None if self._w0 is None or w1 is None else w1 - self._w0
        with _lock:
            if self._deep:
                _deep_active.remove(self)
                if not _deep_active:
                    _deep_restore()
            _active.remove(self)
            if not _active:
                for (module, name), original in _originals.items():
                    setattr(module, name, original)
                _originals.clear()

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
