"""The course's measured link: alpha and beta fitted to all-reduce times, saved for later chapters.

The launching chapter times ``dist.all_reduce`` over a range of sizes (:func:`time_all_reduce`, run
on
every rank), fits the ring model with :func:`fit_link` and saves the result with
:func:`save_links`. Later chapters read it back with :func:`load_link` and, where no fit is
saved (the launching chapter has not run on this machine), measure a quick one themselves.

Where: ``$PARLIB_CACHE_DIR/links.json``, by default ``~/.cache/parlib/links.json``. One entry
per number of ranks N, each with the sizes, the measured medians, the fitted line and the
per-link alpha and beta (:func:`parlib.cost.per_link_alpha_beta`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parlib.cost import bus_bandwidth, collective_time, fit_alpha_beta, per_link_alpha_beta

FILE_NAME = "links.json"


def cache_dir() -> Path:
    """``$PARLIB_CACHE_DIR`` if set, else ``~/.cache/parlib``."""
    env = os.environ.get("PARLIB_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "parlib"


@dataclass
class LinkFit:
    """An all-reduce alpha-beta fit on ``n`` ranks: the line ``a + b x bytes`` and, undone
    from the ring, one link's ``alpha`` (s per message) and ``beta`` (s per byte)."""

    n: int
    sizes: list[int]
    seconds: list[float]
    a: float
    b: float
    alpha: float
    beta: float
    device: str = "cpu"
    backend: str = "gloo"
    spread: list[float] = field(default_factory=list)  # (q3 - q1) / median per size
    measured_at: str = ""

    def predict(self, nbytes: float) -> float:
        """Seconds of one ring all-reduce of ``nbytes`` on these ``n`` ranks."""
        return collective_time("all_reduce", nbytes, self.n, self.alpha, self.beta)

    @property
    def residuals(self) -> list[float]:
        """measured / fitted - 1, per size."""
        return [t / self.predict(s) - 1 for s, t in zip(self.sizes, self.seconds)]

    def bus_bandwidth(self, i: int = -1) -> float:
        """Bus bandwidth (bytes/s) measured at size index ``i``."""
        return bus_bandwidth(self.sizes[i], self.seconds[i], self.n)


def timed_all_reduces(sizes_bytes: Sequence[int], device: torch.device, *, rounds: int,
                      per_round: int = 1, pause: float = 0.0) -> list[list[float]]:
    """On every rank of a group: the seconds of each timed ``dist.all_reduce`` per size, sizes
    interleaved in ``rounds`` (so a busy moment on the machine hits every size alike),
    ``per_round`` calls per size per round, all ranks lined up at a barrier before each call
    and then sleeping ``pause`` seconds (0: none) before it starts."""
    tensors = [torch.ones(max(1, n // 4), device=device) for n in sizes_bytes]
    for t in tensors:  # warm-up: connections, buffers
        dist.all_reduce(t)
    times: list[list[float]] = [[] for _ in sizes_bytes]
    for _ in range(rounds):
        for i, t in enumerate(tensors):
            for _ in range(per_round):
                dist.barrier()
                if pause:
                    time.sleep(pause)
                t0 = time.perf_counter()
                dist.all_reduce(t)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[i].append(time.perf_counter() - t0)
    return times


def time_all_reduce(sizes_bytes: list[int], rounds: int = 7, per_round: int = 2
                    ) -> tuple[list[float], list[float], str, str]:
    """On every rank of a group: time ``dist.all_reduce`` at each size
    (:func:`timed_all_reduces`, no pause).

    Returns (median seconds per size, interquartile range / median per size, device,
    backend). Rank 0's clock; every rank returns its own.
    """
    if rounds < 1 or per_round < 1:
        raise ValueError("rounds and per_round must be >= 1")
    # NCCL moves GPU tensors (each rank's current GPU); gloo, here, CPU tensors.
    on_gpu = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    times = timed_all_reduces(sizes_bytes, dev, rounds=rounds, per_round=per_round)
    medians = [statistics.median(ts) for ts in times]
    iqr = []
    for ts, med in zip(times, medians):
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [med, med, med]
        iqr.append((q[2] - q[0]) / med)
    return medians, iqr, str(dev), dist.get_backend()


def fit_link(n: int, sizes_bytes: list[int], seconds: list[float], *, spread=None,
             device: str = "cpu", backend: str = "gloo") -> LinkFit:
    """Fit ``a + b x bytes`` to all-reduce times on ``n`` ranks and undo the ring."""
    a, b = fit_alpha_beta(sizes_bytes, seconds)
    alpha, beta = per_link_alpha_beta(a, b, n)
    return LinkFit(n=n, sizes=list(sizes_bytes), seconds=list(seconds), a=a, b=b, alpha=alpha,
                   beta=beta, device=device, backend=backend, spread=list(spread or []),
                   measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))


def save_links(fits: dict[int, LinkFit], path: str | Path | None = None) -> Path:
    """Write the fits (one per N) to ``path`` (default :func:`cache_dir` / links.json)."""
    path = Path(path) if path is not None else cache_dir() / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(n): asdict(f) for n, f in fits.items()}, indent=1))
    tmp.replace(path)
    return path


def load_link(n: int = 2, path: str | Path | None = None, *, backend: str | None = None
              ) -> LinkFit | None:
    """The saved fit for ``n`` ranks (and ``backend``, if given), or None when there is none."""
    path = Path(path) if path is not None else cache_dir() / FILE_NAME
    try:
        data = json.loads(path.read_text())
        fit = LinkFit(**data[str(n)])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if backend is not None and fit.backend != backend:
        return None
    if not (fit.alpha > 0 and fit.beta > 0):
        return None
    return fit


def load_or_measure(n: int, *, launch: Callable[..., list[Any]], backend: str | None = None,
                    **launch_kwargs: Any) -> tuple[LinkFit,
                    str]:
    """The launching chapter's saved fit for ``n`` ranks (and ``backend``), or, when there is
    none, a quick one measured now: ``launch`` (``parlib.launch``, passed in because launching
    ranks is the runtime's job) runs :func:`time_all_reduce` on ``n`` ranks, 1 KiB to
    4 MiB. Returns the fit and which of the two it is."""
    fit = load_link(n, backend=backend)
    if fit is not None:
        return fit, "the launching chapter's fit"
    sizes = [2**k for k in range(10, 23, 3)]
    seconds, spread, dev, used = launch(time_all_reduce, sizes, rounds=3, world_size=n,
                                        backend=backend, **launch_kwargs)[0]
    fit = fit_link(n, sizes, seconds, spread=spread, device=dev, backend=used)
    return fit, "a quick fit made now"


__all__ = ["LinkFit", "cache_dir", "fit_link", "load_link", "load_or_measure", "save_links",
           "time_all_reduce", "timed_all_reduces"]
