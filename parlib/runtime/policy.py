"""Device and backend policy: which backend and device a launch uses, how many threads
each rank gets, and :func:`device` (this rank's torch.device)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from dataclasses import dataclass
from typing import Any

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Plan:
    """Which backend and device a launch uses, and why."""

    backend: str
    device_type: str  # "cpu" or "cuda"
    reason: str


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(world_size: int, backend: str | None = None) -> Plan:
    """The device policy: NCCL with one GPU per rank when there are enough GPUs, else gloo."""
    gpus = cuda_count()
    if backend is None:
        if gpus >= world_size:
            why = f"{gpus} CUDA GPU(s) >= {world_size} ranks: one GPU per rank"
            return Plan("nccl", "cuda", why)
        why = "no CUDA GPU found" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"
        return Plan("gloo", "cpu", f"{why}: ranks run on the CPU")
    if backend == "nccl":
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: {world_size} ranks, {gpus} GPU(s) "
                "found. Use backend='gloo' (or leave backend=None) to run on the CPU."
            )
        return Plan("nccl", "cuda", "backend='nccl' asked for")
    if backend == "gloo":
        return Plan("gloo", "cpu", "backend='gloo' asked for: ranks run on the CPU")
    raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)} or None")


def threads_per_rank(world_size: int) -> int:
    """max(1, cores // world_size): more threads than cores makes every rank slower."""
    return max(1, (os.cpu_count() or 1) // world_size)


def max_ranks() -> int:
    """The most ranks a launch may start: 8 per core (at least 16), or ``PARLIB_MAX_RANKS``."""
    try:
        return int(os.environ["PARLIB_MAX_RANKS"])
    except (KeyError, ValueError):
        return max(16, 8 * (os.cpu_count() or 1))


def validate_sizes(world_size: Any, timeout: Any) -> None:
    """A clear ValueError for a world size or timeout no launch can use.

    ``timeout=float("inf")`` means no time limit.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    limit = max_ranks()
    if world_size > limit:
        raise ValueError(
            f"world_size={world_size} is more ranks than this machine can run: each rank is a "
            f"process (tens of MB), and {os.cpu_count()} core(s) allow at most {limit} here. "
            f"Use fewer ranks, or set the environment variable PARLIB_MAX_RANKS={world_size} "
            "if you really mean it."
        )
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not timeout > 0):
        raise ValueError(
            f"timeout must be a positive number of seconds (float('inf') for none), "
            f"got {timeout!r}"
        )


def start_context() -> Any:
    methods = mp.get_all_start_methods()
    if "forkserver" not in methods:  # Windows: slower, but safe
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo: creating any optimizer imports it (about 2 s); once here, not per rank
    ctx.set_forkserver_preload(["parlib.runtime.worker", "torch._dynamo"])
    return ctx


def loopback_ifname() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


def device():
    """This rank's torch.device: its GPU under NCCL, else the CPU.

    Outside a launched rank (or under torchrun), it follows the process group's backend,
    or picks ``cuda`` when a GPU is present.
    """
    import torch
    import torch.distributed as dist

    name = os.environ.get("PARLIB_DEVICE")
    if name:
        return torch.device(name)
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


__all__ = ["BACKENDS", "Plan", "device", "plan", "threads_per_rank"]
