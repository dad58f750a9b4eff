"""Run a parlib rank function under torchrun, unchanged from the notebook.

    torchrun --nproc-per-node 4 -m parlib.run my_module:train [args...]

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; this initialises the default
process group from them (NCCL when every local rank has a GPU, else gloo), calls
``train(*args)`` (args are passed as strings) on every rank, and prints what it returned.
Restarted by ``--max-restarts`` after a rank died, the ranks meet again under keys of the new
attempt (:func:`this_attempts_store`); ``parlib.examples.long_run`` resumes from there.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any


def load(target: str) -> Callable[..., Any]:
    """'package.module:function' -> the function."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"parlib.run: expected MODULE:FUNCTION, got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"parlib.run: {target} is not callable")
    return obj


def this_attempts_store() -> Any:
    """Under torchrun's agent store, the store's keys of this attempt only; None elsewhere.

    With ``--rdzv-backend c10d`` (and ``--standalone``) the ranks share the agent's store,
    which outlives a restart (``--max-restarts``): without a prefix of its own, a restarted
    rank reads the address a rank of the failed attempt published and connects to a dead
    port (refused, or a hang). TORCHELASTIC_RESTART_COUNT is the attempt, the same on
    every rank torchrun restarts together."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False,
                           timeout=default_pg_timeout)  # what init_process_group waits
    return dist.PrefixStore(f"parlib/attempt-{attempt}/", shared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parlib.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="MODULE:FUNCTION to run on every rank")
    parser.add_argument("args", nargs="*", help="string arguments passed to the function")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    opts = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("parlib.run: RANK/WORLD_SIZE are not set: start it with torchrun")

    import torch
    import torch.distributed as dist

    from parlib.runtime.policy import threads_per_rank

    sys.path.insert(0, os.getcwd())
    fn = load(opts.target)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = opts.backend or ("nccl" if gpus >= local_world else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        os.environ["PARLIB_DEVICE"] = f"cuda:{local_rank}"
    else:
        os.environ["PARLIB_DEVICE"] = "cpu"
        torch.set_num_threads(threads_per_rank(local_world))
    os.environ["PARLIB_BACKEND"] = backend
    store = this_attempts_store()
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = fn(*opts.args)
        print(f"[rank {dist.get_rank()}] returned {result!r}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


__all__ = ["load", "main", "this_attempts_store"]


if __name__ == "__main__":
    raise SystemExit(main())
