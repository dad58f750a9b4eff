"""Launch cost of a 4-rank job, four ways, side by side in one run.

    python bench/launch.py [--ranks 4] [--repeats 10]

Each way runs the same cell-style function (defined in __main__, so it must be shipped by
value) that all-reduces a small tensor and returns its rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import parlib


def job():
    t = torch.ones(4)
    dist.all_reduce(t)
    return dist.get_rank()


def _join(rank, world_size, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)


def _spawn_entry(rank, world_size, store_path, payload):
    _join(rank, world_size, store_path)
    cloudpickle.loads(payload)()
    dist.destroy_process_group()


def _fork_entry(rank, world_size, store_path):
    _join(rank, world_size, store_path)
    job()
    dist.destroy_process_group()


def via_start_processes(method, world_size):
    store = os.path.join(tempfile.mkdtemp(prefix="bench-"), "store")
    if method == "spawn":
        args = (world_size, store, cloudpickle.dumps(job))
        tmp.start_processes(_spawn_entry, args=args, nprocs=world_size, start_method="spawn")
    else:
        tmp.start_processes(_fork_entry, args=(world_size, store), nprocs=world_size,
                            start_method="fork")


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    n, reps = opts.ranks, opts.repeats
    rows = []
    # fork first: the parent has run no threaded torch op yet, so fork is safe here.
    rows.append(("torch start_processes(fork)", statistics.median(
        timed(lambda: via_start_processes("fork", n), max(3, reps // 2)))))
    first = timed(lambda: parlib.launch(job, world_size=n), 1)[0]
    rows.append(("parlib.launch, first (starts forkserver)", first))
    rows.append(("parlib.launch, subsequent", statistics.median(
        timed(lambda: parlib.launch(job, world_size=n), reps))))
    rows.append(("spawn + cloudpickle", statistics.median(
        timed(lambda: via_start_processes("spawn", n), max(2, reps // 4)))))
    ours = rows[2][1]
    print(f"\n{n}-rank launch of a cell-style function, median seconds "
          f"({os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]})")
    print(f"{'method':44s} {'seconds':>9s} {'vs parlib':>10s}")
    for name, secs in rows:
        print(f"{name:44s} {secs:9.3f} {secs / ours:9.1f}x")


if __name__ == "__main__":
    main()
