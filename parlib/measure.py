"""Measuring what a parallel step costs: time, bytes communicated, memory.

Three pieces, used by every chapter:

- **Time**: :func:`time_it` runs a function after warm-up, synchronises the device around
  each repeat and reports the median (:class:`Timing`).
- **Communication**: :class:`CommLog` records every collective and point-to-point call a
  rank makes through ``torch.distributed`` (operation, bytes, group size, seconds) and,
  on Linux, the bytes this process really wrote to its sockets. :func:`predicted_sent_bytes`
  gives the textbook bytes per rank for a ring algorithm to put next to them.
- **Memory**: :func:`memory_breakdown` counts the bytes of parameters, gradients,
  optimizer state and the activations autograd saves for backward (via
  ``torch.autograd.graph.saved_tensors_hooks``), plus the CUDA peak on a GPU.

Results come back as :class:`Table`, which prints as text and renders as HTML in Jupyter.

Why a wrapper rather than ``torch.distributed.tensor.debug.CommDebugMode``: on torch 2.13
CommDebugMode does see plain ``dist.all_reduce`` calls (it counts ``c10d.allreduce_``), but
it reports counts only, with no bytes and no time. :class:`CommLog` patches the public
``torch.distributed`` functions for the duration of a ``with`` block, which sees the same
calls and can time them. Collectives issued from C++ (DistributedDataParallel's reducer)
are invisible to both; the socket byte counter still sees their traffic.
"""

from __future__ import annotations

import functools
import html
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

MiB = 2**20

# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units: '512 B', '3.31 MiB', '1.20 GiB'."""
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if value == 0:
            return "0"
        if abs(value) >= 1000 or abs(value) < 0.01:
            return f"{value:.3g}"
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.1f}"
    if value is None:
        return "-"
    return str(value)


class Table:
    """A small table: prints as aligned text, renders as HTML in a notebook.

    ``Table(["strategy", "steps/s"], [["naive", 12.3], ["ddp", 20.1]], title="...")``.
    Floats are shown with about three significant figures; strings are shown as given.
    """

    def __init__(self, columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str = ""):
        self.columns = list(columns)
        self.rows = [list(r) for r in rows]
        self.title = title
        for r in self.rows:
            if len(r) != len(self.columns):
                raise ValueError(f"row {r!r} has {len(r)} cells, expected {len(self.columns)}")

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]

    def _cells(self) -> list[list[str]]:
        return [[_fmt(v) for v in r] for r in self.rows]

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]

        def line(values: list[str]) -> str:
            out = []
            for i, v in enumerate(values):
                numeric = all(not isinstance(r[i], str) for r in self.rows) and self.rows
                out.append(v.rjust(widths[i]) if numeric else v.ljust(widths[i]))
            return "  ".join(out).rstrip()

        parts = [self.title] if self.title else []
        parts.append(line(self.columns))
        parts.append("  ".join("-" * w for w in widths))
        parts.extend(line(r) for r in cells)
        return "\n".join(parts)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
            for r in self._cells()
        )
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# --------------------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------------------


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU, whose ops are synchronous)."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class Timing:
    """Seconds per call: ``median`` over ``times`` (after ``warmup`` untimed calls)."""

    times: list[float]
    warmup: int

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> tuple[float, float]:
        """(min, max) of the timed repeats."""
        return min(self.times), max(self.times)

    @property
    def per_second(self) -> float:
        return 1.0 / self.median

    def __str__(self) -> str:
        lo, hi = self.spread
        return (
            f"{self.median * 1e3:.2f} ms median of {len(self.times)} "
            f"(min {lo * 1e3:.2f}, max {hi * 1e3:.2f}; {self.warmup} warm-up)"
        )

    __repr__ = __str__


def time_it(
    fn: Callable[[], Any],
    *,
    repeats: int = 10,
    warmup: int = 2,
    device: torch.device | str | None = None,
    barrier: bool = False,
    progress: bool | str = False,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones; median reported.

    The device is synchronised before and after each timed call, so queued GPU work is
    counted where it belongs. With ``barrier=True`` (inside a process group) every rank
    waits at a barrier before each call, so the ranks start each repeat together.
    ``progress`` shows a ``tqdm`` bar (pass a string to label it).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    use_barrier = barrier and dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    steps: Iterable[int] = range(repeats)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=progress if isinstance(progress, str) else "timing", leave=False)
    for _ in steps:
        if use_barrier:
            dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return Timing(times, warmup)


# --------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------


def predicted_sent_bytes(op: str, nbytes: float, n: int) -> float | None:
    """Bytes one rank sends for ``op`` on a message of ``nbytes`` in a ring of ``n`` ranks.

    ``nbytes`` is the full message: the tensor for all-reduce and broadcast, the *input* of
    reduce-scatter, the *output* of all-gather. Ring all-reduce = reduce-scatter then
    all-gather, each moving (n-1)/n of the message: 2(n-1)/n in total. ``None`` for an
    operation with no single textbook figure.
    """
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * nbytes
    if op in ("send", "isend"):
        return float(nbytes)
    if op in ("recv", "irecv", "barrier"):
        return 0.0
    return None


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
_originals: dict[str, Callable] = {}
_local = threading.local()


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


class CommLog:
    """Record every ``torch.distributed`` call this rank makes inside ``with CommLog() as log``.

    ``log.records`` is a list of :class:`CommRecord`. ``log.wire_bytes`` is what this
    process wrote to its sockets during the block (Linux ``/proc/self/io``; gloo sends over
    TCP, so this is the real traffic, collectives issued from C++ included; ``None`` where
    unavailable; on NCCL, GPU-to-GPU traffic does not pass through it). Prints inside the
    block add a few bytes. Nested and concurrent logs each get every record.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.wire_bytes: int | None = None
        self._w0: int | None = None

    def __enter__(self) -> "CommLog":
        with _lock:
            if not _active:
                for name in _OPS:
                    original = getattr(dist, name, None)
                    if original is None:
                        continue
                    _originals[name] = original
                    setattr(dist, name, _wrap(name, original))
            _active.append(self)
        self._w0 = _io_wchar()
        return self

    def __exit__(self, *exc: Any) -> None:
        w1 = _io_wchar()
        self.wire_bytes = None if self._w0 is None or w1 is None else w1 - self._w0
        with _lock:
            _active.remove(self)
            if not _active:
                for name, original in _originals.items():
                    setattr(dist, name, original)
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


# --------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage counted once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor (FSDP2): count this rank's shard
            t = t.to_local()
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    return tensor_bytes(list(params))


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    return tensor_bytes([p.grad for p in params])


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | Any) -> int:
    """Bytes of every tensor in ``optimizer.state`` (Adam: exp_avg, exp_avg_sq, step).

    Anything with an ``optimizer`` attribute (such as :class:`parlib.dp.Zero1`) is unwrapped.
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)
    tensors = []
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensor_bytes(tensors)


class _Saved:
    """What autograd keeps for a saved tensor; when it is freed, the count drops."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """Bytes autograd saves for backward inside ``with SavedActivations(model) as s``.

    Uses ``torch.autograd.graph.saved_tensors_hooks``; each storage counts once, and the
    model's own parameters (which autograd also saves) are left out. After the block:
    ``s.nbytes`` is every byte saved, ``s.live`` what is still held (backward frees what it
    used) and ``s.peak`` the most held at once, which is what a pipeline schedule changes.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] | torch.nn.Module = ()) -> None:
        if isinstance(exclude, torch.nn.Module):
            exclude = list(exclude.parameters())
        self._exclude = {
            (str(t.device), t.untyped_storage().data_ptr())
            for t in (x.to_local() if hasattr(x, "to_local") else x for x in exclude)
        }
        self._refs: dict[tuple[str, int], int] = {}
        self._size: dict[tuple[str, int], int] = {}
        self.nbytes = 0
        self.live = 0
        self.peak = 0
        self._hooks: Any = None

    def _release(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._size.pop(key)

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        key = (str(t.device), storage.data_ptr())
        if key in self._exclude or storage.nbytes() == 0:
            return t
        if key not in self._refs:
            self._refs[key] = 0
            self._size[key] = storage.nbytes()
            self.nbytes += storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)
        return saved

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


@dataclass
class MemoryReport:
    """Bytes one rank holds, by kind. ``cuda_peak`` is ``torch.cuda.max_memory_allocated``
    over the measured step (``None`` on the CPU)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    cuda_peak: int | None = None
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state: what ZeRO shards."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.activations + sum(self.extra.values())

    def as_dict(self) -> dict[str, int]:
        out = {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
        }
        out.update(self.extra)
        return out


def memory_breakdown(
    model: torch.nn.Module,
    optimizer: Any,
    step: Callable[[], Any],
    device: torch.device | str | None = None,
) -> MemoryReport:
    """Run ``step()`` once (forward + backward + optimizer step) and count this rank's bytes.

    Saved activations are counted during ``step``; parameters, gradients and optimizer
    state are counted after it (so Adam's moments exist). Wrappers that keep their own
    shards (:class:`parlib.dp.Zero1`) report through their ``optimizer`` attribute.
    """
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    params = list(model.parameters())
    with SavedActivations(params) as saved:
        step()
    peak = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    extra = {}
    if hasattr(optimizer, "extra_bytes"):
        extra = dict(optimizer.extra_bytes())
    return MemoryReport(
        params=param_bytes(params),
        grads=grad_bytes(params),
        optimizer=optimizer_state_bytes(optimizer),
        activations=saved.nbytes,
        cuda_peak=peak,
        extra=extra,
    )


def adam_bytes_per_param(mixed_precision: bool = False) -> int:
    """Model-state bytes per parameter with Adam: 4+4+8 = 16 in fp32; in mixed precision
    2 (bf16 weights) + 2 (bf16 grads) + 4 (fp32 master) + 8 (fp32 moments) = 16 too."""
    return 2 + 2 + 4 + 8 if mixed_precision else 4 + 4 + 4 + 4


def predicted_model_state_bytes(n_params: int, world_size: int = 1, zero_stage: int = 0) -> float:
    """Model-state bytes per rank with fp32 Adam (16 per parameter) under ZeRO stage 0-3.

    Stage 1 shards the optimizer state (8P/N), stage 2 also gradients, stage 3 also weights.
    """
    n = world_size
    p, g, o = 4.0 * n_params, 4.0 * n_params, 8.0 * n_params
    if zero_stage >= 1:
        o /= n
    if zero_stage >= 2:
        g /= n
    if zero_stage >= 3:
        p /= n
    return p + g + o


__all__ = [
    "MiB",
    "Table",
    "fmt_bytes",
    "sync",
    "Timing",
    "time_it",
    "predicted_sent_bytes",
    "CommRecord",
    "CommLog",
    "tensor_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "SavedActivations",
    "MemoryReport",
    "memory_breakdown",
    "adam_bytes_per_param",
    "predicted_model_state_bytes",
]
