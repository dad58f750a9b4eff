"""Emulated costs: stand-ins for compute or communication a small machine cannot show.

Ranks that share two cores cannot compute at the same time, so a pipeline's overlap is
invisible in real compute. :class:`StageCost` pads each stage's forward and backward with
a sleep to the time a device would take: a time per row of the microbatch plus a small
fixed time per call, so that a microbatch of b rows costs b/B of the batch (plus the
overhead), as real compute does. Sleeping ranks do not compete for cores, so the
schedule's shape shows. :class:`SlowLink` adds to every collective the time a slower link
would take for its bytes (the alpha-beta ring formula), so a machine with one fast loopback
can show what a slow network does to a strategy. Everything emulated here says so in its
``describe()`` text, which figures carry in their captions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from parlib.cost.collectives import collective_time, message_time
from parlib.cost.model import BACKWARD_PER_FORWARD
from parlib.cost.pipeline import microbatch_time

# Real compute that outlasts its emulated time by less than this is not called an overrun
# (a piece of nearly no FLOPs, such as the norm after a layer's last all-reduce).
OVERRUN_SLACK = 1e-3


def _sleep_until(due: float, started: float, excluded: float) -> float:
    """Sleep until ``due`` seconds of compute have passed since ``started``, not counting
    ``excluded`` seconds spent communicating in between. Returns the seconds slept;
    negative: the real compute overran."""
    left = due - (time.perf_counter() - started - excluded)
    if left > 0:
        time.sleep(left)
    return left


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

    @classmethod
    def for_flops(cls, forward_flops_per_row: float, flops_per_second: float) -> StageCost:
        """An emulated device of ``flops_per_second``: a forward of b rows takes b x
        ``forward_flops_per_row`` / rate, a backward ``BACKWARD_PER_FORWARD`` (2) times that,
        nothing per call."""
        if not flops_per_second > 0 or forward_flops_per_row < 0:
            raise ValueError(f"need flops_per_second > 0 and forward_flops_per_row >= 0, got "
                             f"{flops_per_second!r}, {forward_flops_per_row!r}")
        forward = forward_flops_per_row / flops_per_second
        return cls(forward=forward, backward=BACKWARD_PER_FORWARD * forward)

    def start(self, kind: str, rows: int, stage: int = 0) -> float:
        """Called as a forward or backward begins; returns the time it began."""
        return time.perf_counter()

    def pad(self, kind: str, started: float, rows: int, stage: int = 0,
            excluded: float = 0.0) -> float:
        """Sleep until ``duration(kind, rows, stage)`` of compute has passed since
        ``started``, not counting ``excluded`` seconds spent communicating in between (a
        device does not compute while it waits for a tensor-parallel all-reduce).
        Returns the seconds slept; negative: the real compute overran the emulated time."""
        return _sleep_until(self.duration(kind, rows, stage), started, excluded)

    def describe(self) -> str:
        text = (f"emulated stage cost (time.sleep): forward {self.forward * 1e3:g} ms/row, "
                f"backward {self.backward * 1e3:g} ms/row, + {self.per_call * 1e3:g} ms per call")
        for stage, f in self.slow:
            text += f";\n  stage {stage} {f:g}x slower"
        return text


class PacedCost:
    """Emulated compute for a rank whose forward and backward contain communication points
    (tensor parallelism's all-reduces inside each layer). The compute between two points
    is padded to the time of its own FLOPs before the next point starts, so the rank
    reaches each all-reduce when a device of ``flops_per_second`` would, however the shared
    cores slowed its real compute (otherwise one rank's slow piece becomes its partner's
    wait, counted as communication).

    ``forward`` and ``backward`` are the FLOPs per row of the microbatch of each piece, in
    the order they run: one more piece than points (the last runs after the last point).
    The object is used as a :class:`StageCost` (``start``, ``pad``); the all-reduce wrapper
    calls :meth:`before_point` as each point begins.
    """

    def __init__(self, forward: Sequence[float], backward: Sequence[float],
                 flops_per_second: float) -> None:
        if not flops_per_second > 0 or min([*forward, *backward]) < 0:
            raise ValueError("need flops_per_second > 0 and pieces of >= 0 FLOPs")
        self.pieces = {"forward": list(forward), "backward": list(backward)}
        self.rate = flops_per_second
        self._due: list[float] = []  # emulated seconds from the span's start, per point
        self._total = 0.0
        self._index = 0
        self.started = 0.0  # when the current forward or backward began
        self._active = False
        self.points = 0  # communication points paced at
        self.late = 0  # of them, reached later than due (real compute outlasted its piece)

    def duration(self, kind: str, rows: int, stage: int = 0) -> float:
        return sum(self.pieces[kind]) * rows / self.rate

    def start(self, kind: str, rows: int, stage: int = 0) -> float:
        *due, self._total = accumulate(f * rows / self.rate for f in self.pieces[kind])
        self._due = due
        self._index, self._active = 0, True
        self.started = time.perf_counter()
        return self.started

    def before_point(self, excluded: float) -> None:
        """Pad the compute since the span began to the emulated time due at this point,
        not counting ``excluded`` seconds of communication since then."""
        if not self._active or self._index >= len(self._due):
            return
        if _sleep_until(self._due[self._index], self.started, excluded) < -OVERRUN_SLACK:
            self.late += 1
        self.points += 1
        self._index += 1

    def pad(self, kind: str, started: float, rows: int, stage: int = 0,
            excluded: float = 0.0) -> float:
        """Sleep until the span's whole emulated compute has passed, not counting
        ``excluded`` seconds of communication; returns the seconds slept (negative: the
        real compute overran)."""
        self._active = False
        return _sleep_until(self._total, started, excluded)

    def describe(self) -> str:
        return (f"emulated device: {self.rate / 1e9:g} GFLOP/s (time.sleep), paced at "
                f"{len(self.pieces['forward']) - 1} communication points per forward")


def default_cost(device: Any) -> StageCost | None:
    """Emulate on the CPU (ranks compete for cores), use real compute on GPUs."""
    return None if str(device).startswith("cuda") else StageCost(0.010, 0.020, 0.002)




# --------------------------------------------------------------------------------------
# Emulated links
# --------------------------------------------------------------------------------------

_SLOWED = ("all_reduce", "reduce_scatter", "all_gather")  # the ring ops cost prices
_link_stack: list[tuple["SlowLink", Any]] = []


def _sleep_until_time(due: float) -> None:
    left = due - time.perf_counter()
    if left > 0:
        time.sleep(left)


@dataclass(frozen=True)
class SlowLink:
    """Emulated slower link: inside ``with SlowLink(alpha, beta):`` each collective this
    rank calls through ``torch.distributed`` also takes the ring time of a link with
    ``alpha`` seconds per message step and ``beta`` seconds per byte
    (:func:`parlib.cost.collectives.collective_time`: an all-reduce of B bytes on N ranks
    adds 2(N-1) alpha + 2(N-1)/N B beta, a reduce-scatter or all-gather half that). It is a
    ``time.sleep`` after the real call, so it scales with the bytes and the message count
    the way a real link's time does; the emulated link is the real one plus this much.
    Point-to-point messages (``send``, ``recv`` and their async forms) add one message's
    alpha + B beta, paid by the sender and again by the receiver after the data arrives;
    a ``batch_isend_irecv`` pays the sum of its messages' times once all its handles have
    been waited for. Broadcast, all-to-all and barriers, which the cost layer has no ring
    time for, run unslowed.

    An asynchronous call's ``wait()`` returns no earlier than the emulated time after the
    call (so compute in between hides it, as on a real link). On a GPU the device is
    synchronised before the sleep. Enter it outside a :class:`~parlib.measure.CommLog` so
    the log's seconds include the emulated time. It is a view on
    :mod:`parlib.measure.intercept`, so it sees the same calls a ``CommLog`` does (DTensor's
    functional collectives included); collectives issued from C++ (DDP's reducer) are not
    slowed.
    """

    alpha: float = 0.0
    beta: float = 0.0

    def extra_seconds(self, op: str, nbytes: float, n: int) -> float:
        """The emulated time one collective (or, with ``op="p2p"``, one message) adds."""
        if op == "p2p":
            return message_time(nbytes, self.alpha, self.beta)
        return collective_time(op, nbytes, n, self.alpha, self.beta)

    def describe(self) -> str:
        return (f"emulated link: +{self.alpha * 1e6:g} us per message step and "
                f"+{self.beta * 1e9:g} ns per byte (time.sleep after each collective)")

    def around(self, call: Any, proceed: Callable[[], Any]) -> Any:
        """The interception layer's hook: the real call, then the emulated time."""
        if call.op in _SLOWED:
            extra = self.extra_seconds(call.op, call.nbytes, call.group_size)
        elif call.op in ("send", "recv"):
            extra = self.extra_seconds("p2p", call.nbytes, 2)
        elif call.op == "batch_isend_irecv":
            extra = sum(self.extra_seconds("p2p", p.tensor.numel() * p.tensor.element_size(), 2)
                        for p in call.arguments["p2p_op_list"])
        else:  # broadcast, all-to-all, barrier: no ring formula to emulate
            return proceed()
        from parlib.measure.intercept import on_wait

        called = time.perf_counter()
        result = proceed()
        if call.op == "recv" and call.async_op:  # the data has to arrive first
            return on_wait(result, lambda: time.sleep(extra))
        if call.async_op:  # a wait returns no earlier than the link would deliver
            return on_wait(result, lambda: _sleep_until_time(called + extra))
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        time.sleep(extra)
        return result

    def __enter__(self) -> SlowLink:
        from parlib.measure.intercept import observing

        subscription = observing(self)
        subscription.__enter__()
        _link_stack.append((self, subscription))
        return self

    def __exit__(self, *exc: Any) -> None:
        if not _link_stack or _link_stack[-1][0] is not self:
            raise RuntimeError("SlowLink blocks must be closed in the reverse order of opening")
        _, subscription = _link_stack.pop()
        subscription.__exit__(None, None, None)


__all__ = ["PacedCost", "SlowLink", "StageCost", "default_cost"]
