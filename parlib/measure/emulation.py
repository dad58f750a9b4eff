"""Emulated costs: stand-ins for compute or communication a small machine cannot show.

Ranks that share two cores cannot compute at the same time, so a pipeline's overlap is
invisible in real compute. :class:`StageCost` pads each stage's forward and backward with
a sleep to a set duration: sleeping ranks do not compete for cores, so the schedule's
shape shows. Everything emulated here says so in its ``describe()`` text, which figures
carry in their captions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageCost:
    """Emulated stage cost: each forward of one microbatch on one stage takes at least
    ``forward`` seconds and each backward at least ``backward`` (the real compute runs,
    then a sleep pads it). Use it where ranks share too few cores to compute at once."""

    forward: float = 0.0
    backward: float = 0.0

    @property
    def per_microbatch(self) -> float:
        return self.forward + self.backward

    def pad(self, kind: str, started: float) -> None:
        target = self.forward if kind == "forward" else self.backward
        left = target - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)

    def describe(self) -> str:
        return (f"emulated stage cost: forward padded to {self.forward * 1e3:g} ms and "
                f"backward to {self.backward * 1e3:g} ms per microbatch with time.sleep")


def default_cost(device: Any) -> StageCost | None:
    """Emulate on the CPU (ranks compete for cores), use real compute on GPUs."""
    return None if str(device).startswith("cuda") else StageCost(0.02, 0.04)


__all__ = ["StageCost", "default_cost"]
