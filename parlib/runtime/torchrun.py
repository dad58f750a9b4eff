"""Run a parlib rank function under torchrun, unchanged from the notebook.

    torchrun --nproc-per-node 4 -m parlib.run my_module:train [args...]

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; this initialises the default
process group from them (NCCL when every local rank has a GPU, else gloo), calls
``train(*args)`` (args are passed as strings) on every rank, and prints what it returned.
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
    dist.init_process_group(backend)
    try:
        result = fn(*opts.args)
        print(f"[rank {dist.get_rank()}] returned {result!r}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


__all__ = ["load", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
