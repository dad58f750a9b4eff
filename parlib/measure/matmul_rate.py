"""The largest matmul rate this machine achieves: a sweep of shapes, the best one kept, saved.

A datasheet's peak FLOP/s is never reached; what a training step's matmuls can reach is
the best *measured* rate over shapes (in the spirit of Stas Bekman's "maximum achievable
matmul FLOPS" finder, ML Engineering book). :func:`measure_matmul_rate` times
``torch.matmul`` over a sweep of (m, n, k) shapes for one dtype and thread count, shapes
interleaved over ``repeats`` rounds (a busy moment on the machine hits every shape alike),
and keeps the shape whose median rate is highest, with its spread. The default sweep is
small (128 to 512): seconds on a CPU. On a GPU pass larger shapes.

Saved like the launching chapter's link fit (:mod:`parlib.measure.links`):
``$PARLIB_CACHE_DIR/matmul_rate.json`` (default ``~/.cache/parlib``), one entry per
(dtype, threads, device); :func:`load_matmul_rate` reads one back, None when none is saved.
Pass its ``flops_per_second`` to :meth:`parlib.cost.Hardware.measured_here`.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from parlib.measure.links import cache_dir
from parlib.measure.timing import sync

FILE_NAME = "matmul_rate.json"
DEFAULT_SIZES = (128, 256, 512)  # every (m, n, k) from these: 27 shapes, seconds on a CPU
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m, k) x (k, n) matmul: m x n dot products of length k, a multiply and
    an add each: 2 m n k."""
    return 2 * m * n * k


@dataclass
class MatmulRate:
    """The best matmul rate measured: ``flops_per_second`` (median over ``repeats`` of the
    best shape), that ``shape`` (m, n, k), its ``spread`` ((q3 - q1) / median of its rates),
    the dtype, thread count and device it ran on, and every shape's median rate."""

    flops_per_second: float
    shape: tuple[int, int, int]
    spread: float
    dtype: str
    threads: int
    device: str
    repeats: int
    rates: dict[str, float] = field(default_factory=dict)  # "m x n x k" -> FLOP/s
    measured_at: str = ""

    def __str__(self) -> str:
        m, n, k = self.shape
        return (f"{self.flops_per_second / 1e9:.3g} GFLOP/s best ({self.dtype}, "
                f"{self.threads} thread{'s' * (self.threads != 1)}, {self.device}) at "
                f"{m} x {n} x {k}, spread {self.spread:.0%} over {self.repeats} repeats, "
                f"of {len(self.rates)} shapes")

    @property
    def key(self) -> str:
        return _key(self.dtype, self.threads, self.device)


def _key(dtype: str, threads: int, device: str) -> str:
    return f"{dtype}/threads={threads}/{device}"


def _dtype(dtype: str) -> torch.dtype:
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}") from None


def measure_matmul_rate(shapes: list[tuple[int, int, int]] | None = None, *,
                        dtype: str = "float32", threads: int | None = None,
                        repeats: int = 5, device: str = "cpu",
                        min_seconds: float = 2e-3) -> MatmulRate:
    """Time ``torch.matmul`` at every (m, n, k) of ``shapes`` (default: every combination of
    :data:`DEFAULT_SIZES`) and keep the fastest.

    Each timed sample runs the matmul enough times to last about ``min_seconds`` (so the
    clock's resolution does not matter); shapes are interleaved over ``repeats`` rounds;
    a shape's rate is the median of its samples. ``threads`` sets ``torch.set_num_threads``
    for the run (restored afterwards; default: the current setting).
    """
    shapes = (list(itertools.product(DEFAULT_SIZES, repeat=3)) if shapes is None
              else [tuple(s) for s in shapes])
    if not shapes:
        raise ValueError("shapes is empty: give at least one (m, n, k)")
    for shape in shapes:
        if len(shape) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                  for x in shape):
            raise ValueError(f"a shape is three positive integers (m, n, k), got {shape!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    torch_dtype, dev = _dtype(dtype), torch.device(device)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used = torch.get_num_threads()
        gen = torch.Generator().manual_seed(0)
        pairs = [(torch.randn(m, k, generator=gen).to(dev, torch_dtype),
                  torch.randn(k, n, generator=gen).to(dev, torch_dtype)) for m, n, k in shapes]
        calls = []
        for a, b in pairs:  # warm-up, and how many calls make one sample last min_seconds
            torch.matmul(a, b)
            sync(dev)
            t0 = time.perf_counter()
            torch.matmul(a, b)
            sync(dev)
            calls.append(max(1, round(min_seconds / max(time.perf_counter() - t0, 1e-9))))
        samples: list[list[float]] = [[] for _ in shapes]
        for _ in range(repeats):
            for i, ((a, b), shape) in enumerate(zip(pairs, shapes)):
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(calls[i]):
                    torch.matmul(a, b)
                sync(dev)
                seconds = (time.perf_counter() - t0) / calls[i]
                samples[i].append(matmul_flops(*shape) / seconds)
    finally:
        torch.set_num_threads(before)
    medians = [statistics.median(s) for s in samples]
    best = max(range(len(shapes)), key=medians.__getitem__)
    q = statistics.quantiles(samples[best], n=4) if repeats > 1 else [medians[best]] * 3
    return MatmulRate(flops_per_second=medians[best], shape=tuple(shapes[best]),
                      spread=(q[2] - q[0]) / medians[best], dtype=dtype, threads=used,
                      device=str(dev), repeats=repeats,
                      rates={" x ".join(map(str, s)): r for s, r in zip(shapes, medians)},
                      measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))


def save_matmul_rate(rate: MatmulRate, path: str | Path | None = None) -> Path:
    """Add ``rate`` to the saved ones (default :func:`~parlib.measure.links.cache_dir` /
    matmul_rate.json), replacing an earlier one of the same dtype, threads and device."""
    path = Path(path) if path is not None else cache_dir() / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    saved[rate.key] = asdict(rate)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved, indent=1))
    tmp.replace(path)
    return path


def load_matmul_rate(dtype: str = "float32", threads: int | None = None, device: str = "cpu",
                     path: str | Path | None = None) -> MatmulRate | None:
    """The saved rate for ``dtype``, ``threads`` (default: the current thread count) and
    ``device``, or None when there is none."""
    path = Path(path) if path is not None else cache_dir() / FILE_NAME
    threads = torch.get_num_threads() if threads is None else threads
    try:
        data = json.loads(path.read_text())[_key(dtype, threads, device)]
        data["shape"] = tuple(data["shape"])
        rate = MatmulRate(**data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rate if rate.flops_per_second > 0 else None


def main(argv: list[str] | None = None) -> MatmulRate:
    """``python -m parlib.measure.matmul_rate [--dtype D] [--threads N] [--repeats R]``:
    measure over the default sweep, print the best shape and the top five, save it."""
    import argparse

    parser = argparse.ArgumentParser(description="the best matmul FLOP/s over a sweep of "
                                                 "shapes, saved for later chapters")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    rate = measure_matmul_rate(dtype=args.dtype, threads=args.threads, repeats=args.repeats,
                               device=args.device)
    print(rate)
    for shape, r in sorted(rate.rates.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {shape:>16}: {r / 1e9:.3g} GFLOP/s")
    print(f"saved to {save_matmul_rate(rate)}")
    return rate


if __name__ == "__main__":
    main()


__all__ = ["DEFAULT_SIZES", "MatmulRate", "load_matmul_rate", "matmul_flops",
           "measure_matmul_rate", "save_matmul_rate"]
