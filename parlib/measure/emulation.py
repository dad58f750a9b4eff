"""Emulated costs: stand-ins for compute or communication a small machine cannot show.

Ranks that share two cores cannot compute at the same time, so a pipeline's overlap is
invisible in real compute. :class:`StageCost` pads each stage's forward and backward with
a sleep to the time a device would take: a time per row of the microbatch plus a small
fixed time per call, so that a microbatch of b rows costs b/B of the batch (plus the
overhead), as real compute does. Sleeping ranks do not compete for cores, so the
schedule's shape shows. Everything emulated here says so in its ``describe()`` text,
which figures carry in their captions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from parlib.cost.pipeline import microbatch_time


@dataclass(frozen=True)
class StageCost:
    """Emulated stage cost. Each forward of a microbatch of b rows on one stage takes at
    least ``b x forward + per_call`` seconds and each backward ``b x backward + per_call``
    (the real compute runs, then a sleep pads it). ``slow`` maps a stage index to a factor
    its times are multiplied by (an unbalanced pipeline). Use it where ranks share too few
    cores to compute at once."""

    forward: float = 0.0   # seconds per row (sample) of the microbatch
    backward: float = 0.0  # seconds per row
    per_call: float = 0.0  # fixed seconds per forward or backward call, whatever its size
    slow: tuple[tuple[int, float], ...] = ()  # (stage, factor) pairs

    def __post_init__(self) -> None:
        if min(self.forward, self.backward, self.per_call) < 0:
            raise ValueError(f"emulated times must be >= 0, got {self}")
        if any(f <= 0 for _, f in self.slow):
            raise ValueError(f"slow-stage factors must be > 0, got {self.slow}")

    def factor(self, stage: int) -> float:
        return dict(self.slow).get(stage, 1.0)

    def duration(self, kind: str, rows: int, stage: int = 0) -> float:
        """Seconds the forward (``kind="forward"``) or backward of ``rows`` rows takes."""
        per_row = self.forward if kind == "forward" else self.backward
        return microbatch_time(rows, per_row, self.per_call) * self.factor(stage)

    def stage_time(self, rows: int, stage: int = 0) -> float:
        """Forward + backward of one microbatch of ``rows`` rows on ``stage`` (t_f + t_b)."""
        return self.duration("forward", rows, stage) + self.duration("backward", rows, stage)

    @property
    def per_row(self) -> float:
        """Forward + backward seconds per row, without the per-call part."""
        return self.forward + self.backward

    def with_slow_stage(self, stage: int, factor: float) -> StageCost:
        """The same cost with ``stage`` ``factor`` x slower."""
        return StageCost(self.forward, self.backward, self.per_call,
                         tuple((s, f) for s, f in self.slow if s != stage) + ((stage, factor),))

    def pad(self, kind: str, started: float, rows: int, stage: int = 0) -> None:
        """Sleep until ``duration(kind, rows, stage)`` has passed since ``started``."""
        left = self.duration(kind, rows, stage) - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)

    def describe(self) -> str:
        text = (f"emulated stage cost (time.sleep): forward {self.forward * 1e3:g} ms/row, "
                f"backward {self.backward * 1e3:g} ms/row, + {self.per_call * 1e3:g} ms per call")
        for stage, f in self.slow:
            text += f";\n  stage {stage} {f:g}x slower"
        return text


def default_cost(device: Any) -> StageCost | None:
    """Emulate on the CPU (ranks compete for cores), use real compute on GPUs."""
    return None if str(device).startswith("cuda") else StageCost(0.010, 0.020, 0.002)


__all__ = ["StageCost", "default_cost"]
