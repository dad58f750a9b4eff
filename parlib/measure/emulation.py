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

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parlib.cost.collectives import collective_time
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




# --------------------------------------------------------------------------------------
# Emulated links
# --------------------------------------------------------------------------------------

# torch.distributed name -> (the op name parlib.cost knows, where the message tensor is:
# positional index, keyword). The message is the tensor for all-reduce, the input of a
# reduce-scatter and the output of an all-gather, as in parlib.cost.collectives.
_LINK_OPS: dict[str, tuple[str, int, str]] = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
}
_link_stack: list[tuple["SlowLink", dict[str, Any]]] = []


def _message_bytes(message: Any) -> int:
    if isinstance(message, (list, tuple)):
        return sum(_message_bytes(m) for m in message)
    return message.numel() * message.element_size() if hasattr(message, "numel") else 0


class _SlowWork:
    """An async collective's handle whose ``wait()`` returns no earlier than ``ready``."""

    def __init__(self, work: Any, ready: float) -> None:
        self._work, self._ready = work, ready

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        left = self._ready - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@dataclass(frozen=True)
class SlowLink:
    """Emulated slower link: inside ``with SlowLink(alpha, beta):`` each collective this
    rank calls through ``torch.distributed`` also takes the ring time of a link with
    ``alpha`` seconds per message step and ``beta`` seconds per byte
    (:func:`parlib.cost.collectives.collective_time`: an all-reduce of B bytes on N ranks
    adds 2(N-1) alpha + 2(N-1)/N B beta, a reduce-scatter or all-gather half that). It is a
    ``time.sleep`` after the real call, so it scales with the bytes and the message count
    the way a real link's time does; the emulated link is the real one plus this much.

    An asynchronous call's ``wait()`` returns no earlier than the emulated time after the
    call (so compute in between hides it, as on a real link). On a GPU the device is
    synchronised before the sleep. Enter it outside a :class:`~parlib.measure.CommLog` so
    the log's seconds include the emulated time. Collectives that bypass the Python
    functions (DDP's C++ reducer, DTensor's functional collectives) are not slowed.
    """

    alpha: float = 0.0
    beta: float = 0.0

    def extra_seconds(self, op: str, nbytes: float, n: int) -> float:
        """The emulated time one collective adds (the alpha-beta ring formula)."""
        return collective_time(op, nbytes, n, self.alpha, self.beta)

    def describe(self) -> str:
        return (f"emulated link: +{self.alpha * 1e6:g} us per message step and "
                f"+{self.beta * 1e9:g} ns per byte (time.sleep after each collective)")

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        import torch
        import torch.distributed as dist

        op, index, key = _LINK_OPS[name]

        @functools.wraps(original)
        def slowed(*args: Any, **kwargs: Any) -> Any:
            message = args[index] if len(args) > index else kwargs.get(key)
            group = kwargs.get("group")
            n = dist.get_world_size(group) if group is not None else dist.get_world_size()
            extra = self.extra_seconds(op, _message_bytes(message), n)
            called = time.perf_counter()
            result = original(*args, **kwargs)
            if kwargs.get("async_op", False) and result is not None:
                return _SlowWork(result, called + extra)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            time.sleep(extra)
            return result

        return slowed

    def __enter__(self) -> SlowLink:
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in _LINK_OPS if hasattr(dist, name)}
        for name, original in originals.items():
            setattr(dist, name, self._wrap(name, original))
        _link_stack.append((self, originals))
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        if not _link_stack or _link_stack[-1][0] is not self:
            raise RuntimeError("SlowLink blocks must be closed in the reverse order of opening")
        _, originals = _link_stack.pop()
        for name, original in originals.items():
            setattr(dist, name, original)


__all__ = ["SlowLink", "StageCost", "default_cost"]
