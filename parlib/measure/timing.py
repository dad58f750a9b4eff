"""Timing a step: warm-up, device synchronisation around each repeat, median and spread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


__all__ = ["Timing", "sync", "time_it"]
