"""A pipeline boundary crossing, timed the way the pipeline runner pays it.

The runner (:func:`parlib.strategies.pipeline.run_schedule`) sends each activation or
gradient as a small header and then the payload (two sends in one ``dist.batch_isend_irecv``,
matched by order, no tags, as NCCL matches them), and posts the two matching receives ahead
when it can, so a message usually travels while its receiver still computes. Two times
decide what that costs a step, and :func:`time_crossings` measures both on two ranks,
interleaving the sizes over the rounds so that a busy moment hits every size alike:

* the **latency**: from the moment the sender's batch of two sends returns to the moment a
  receiver that is already waiting holds both messages. Both moments are read on the one
  clock (``time.perf_counter``) that every process of a machine reads, but that
  difference can come out negative: gloo may deliver while the sender, descheduled, has
  not yet returned from posting. So the whole crossing is timed instead, from *before*
  the sends (it cannot be negative: no message arrives before it is sent), and the latency
  is that line less the sender's own posting time, never below zero;
* a rank's **own time** in a message, serial with its compute: posting the two sends,
  and posting the two receives plus collecting a message that is already there.

:func:`measure_crossings` fits ``alpha + beta x bytes`` to the whole crossings and to the
sends (one line for header and payload together: both are in flight at once) and returns a
:class:`CrossingFit`. The launching chapter's all-reduce fit (:mod:`parlib.measure.links`)
prices a ring step, which waits for the slowest rank at every step; a crossing whose
receive was posted early costs less, and on a shared machine that fit's alpha swings more.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parlib.cost import HEADER_BYTES, crossing_time, fit_alpha_beta

# The header alone up to a large activation (payload bytes).
DEFAULT_SIZES = (0, 32 * 1024, 128 * 1024, 512 * 1024)


@dataclass
class CrossingFit:
    """Measured costs of one boundary crossing (seconds; bytes are header + payload).

    ``alpha`` + ``beta`` x bytes: the whole crossing, from before the sends are posted to
    an already waiting receiver holding both messages; ``send_alpha`` + ``send_beta`` x
    bytes: the sender's own time posting them; ``receive``: the receiver's own time posting
    its receives and collecting a message already there. :meth:`latency` is the first less
    the second. ``sizes`` (payload bytes) with the means they were fitted to
    (``latencies``: the whole crossings)."""

    alpha: float
    beta: float
    send_alpha: float
    send_beta: float
    receive: float
    sizes: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    sends: list[float] = field(default_factory=list)
    rounds: int = 0

    def whole(self, payload_bytes: float) -> float:
        """Seconds from before the sends to an already waiting receiver holding both."""
        return crossing_time(payload_bytes, self.alpha, self.beta)

    def latency(self, payload_bytes: float) -> float:
        """Seconds from the sends' return to an already waiting receiver holding both: the
        whole crossing less the sender's posting time (a rank's own time, priced apart),
        zero where the message was there before the sends returned."""
        return max(0.0, self.whole(payload_bytes) - self.send(payload_bytes))

    def send(self, payload_bytes: float) -> float:
        """The sender's own seconds posting a header and a payload of this size."""
        return crossing_time(payload_bytes, self.send_alpha, self.send_beta)

    def own_time(self, payload_bytes: float) -> float:
        """A rank's own seconds per message it handles, the mean of a send and a receive
        (a rank inside the pipeline handles one of each per op)."""
        return (self.send(payload_bytes) + self.receive) / 2

    def describe(self) -> str:
        return (f"crossing (timed now, {self.rounds} rounds, point-to-point in the runner's "
                f"pattern): {self.alpha * 1e6:.0f} us + {self.beta * 1e9:.2f} ns/B from "
                f"before the sends; a rank's own time: send {self.send_alpha * 1e6:.0f}"
                f" us + {self.send_beta * 1e9:.2f} ns/B, receive {self.receive * 1e6:.0f} us")


def _batch(op: Callable[..., Any], tensors: list[torch.Tensor], peer: int) -> list[Any]:
    """The runner's way: one batch, no tags (the messages match in order)."""
    return dist.batch_isend_irecv([dist.P2POp(op, t, peer) for t in tensors])


def time_crossings(sizes_bytes: Sequence[int] = DEFAULT_SIZES, rounds: int = 20,
                   op_seconds: float = 0.012) -> dict[str, list[float]] | None:
    """On both ranks of a 2-rank group: time ``rounds`` crossings per payload size, one
    warm-up round first. In each round and size rank 0 sends to a waiting rank 1 (the
    latency), then rank 1 sends to rank 0 while rank 0 is still busy (a message already
    there). Each sender first sleeps ``op_seconds`` as an emulated op, so a receiver waits
    about that long: set it near the op time of the pipeline to be priced,
    since a rank that has waited longer wakes more slowly (measured here: a latency of
    0.19-0.27 ms after 4 ms waits, 0.55-0.60 ms after 12 ms). Returns the trimmed means
    (:func:`trimmed_mean`) on rank 0 (``latency``: the whole crossing, from before the
    sends, and ``send``, per size; ``receive`` one, in seconds), None on rank 1."""
    if dist.get_world_size() != 2:
        raise ValueError(f"time_crossings runs on 2 ranks, got {dist.get_world_size()}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rank = dist.get_rank()
    peer = 1 - rank
    # NCCL moves GPU tensors (each rank's current GPU); gloo, here, CPU tensors.
    on_gpu = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    def done(works: list[Any]) -> None:
        for w in works:
            w.wait()
        if on_gpu:
            torch.cuda.synchronize(dev)

    payloads = [torch.zeros(max(1, n // 4), device=dev) for n in sizes_bytes]
    latency: list[list[float]] = [[] for _ in sizes_bytes]
    send: list[list[float]] = [[] for _ in sizes_bytes]
    receive: list[float] = []
    for k in range(rounds + 1):
        for i, payload in enumerate(payloads):
            for sender in (0, 1):
                dist.barrier()
                if rank == sender:
                    time.sleep(op_seconds)
                    t0 = time.perf_counter()
                    works = _batch(dist.isend, [torch.zeros(3, dtype=torch.int64, device=dev),
                                                payload], peer)
                    t1 = time.perf_counter()
                    done(works)
                    mine = [t0, t1 - t0]  # t0: a crossing cannot end before it
                else:
                    header = torch.empty(3, dtype=torch.int64, device=dev)
                    buf = torch.empty_like(payload)
                    ta = time.perf_counter()
                    works = _batch(dist.irecv, [header, buf], peer)
                    posted = time.perf_counter() - ta
                    if sender == 1:  # rank 0 stays busy: the message is there when it waits
                        time.sleep(2 * op_seconds)
                    tc = time.perf_counter()
                    done(works)
                    td = time.perf_counter()
                    mine = [td, posted + (td - tc)]
                both: list[Any] = [None, None]
                dist.all_gather_object(both, mine)
                if k == 0:
                    continue  # warm-up: connections, buffers
                sent, got = both[sender], both[1 - sender]
                send[i].append(sent[1])
                if sender == 0:
                    latency[i].append(got[0] - sent[0])
                else:
                    receive.append(got[1])
    if rank != 0:
        return None
    return {"latency": [trimmed_mean(x) for x in latency],
            "send": [trimmed_mean(x) for x in send],
            "receive": [trimmed_mean(receive)]}


def trimmed_mean(xs: Sequence[float], cut: float = 0.1) -> float:
    """Mean of ``xs`` without its lowest and highest ``cut`` fraction. A step pays the sum
    of many crossings, so the mean is what to predict with (on this machine a latency is
    often either about 30 us or about 350 us, and a median jumps between the two); the
    trim drops the rare stall of several milliseconds."""
    if not xs:
        raise ValueError("no times to average")
    ordered = sorted(xs)
    k = int(len(ordered) * cut)
    kept = ordered[k:len(ordered) - k] or ordered
    return statistics.fmean(kept)


def measure_crossings(*, launch: Callable[..., list[Any]], backend: str | None = None,
                      sizes_bytes: Sequence[int] = DEFAULT_SIZES, rounds: int = 20,
                      op_seconds: float = 0.012, **launch_kwargs: Any) -> CrossingFit:
    """Run :func:`time_crossings` on 2 ranks (``launch``: ``parlib.launch``, passed in
    because launching ranks is the runtime's job) and fit it. About 5 s at the defaults."""
    got = launch(time_crossings, list(sizes_bytes), rounds, op_seconds, world_size=2,
                 backend=backend, **launch_kwargs)[0]
    total = [HEADER_BYTES + n for n in sizes_bytes]
    alpha, beta = fit_alpha_beta(total, got["latency"], what="crossing")
    send_alpha, send_beta = fit_alpha_beta(total, got["send"], what="send")
    # a line through noisy points can dip below zero; no part of a message is negative
    return CrossingFit(max(alpha, 0.0), max(beta, 0.0), max(send_alpha, 0.0),
                       max(send_beta, 0.0), got["receive"][0],
                       list(sizes_bytes), got["latency"], got["send"], rounds)


__all__ = ["DEFAULT_SIZES", "CrossingFit", "measure_crossings", "time_crossings", "trimmed_mean"]
