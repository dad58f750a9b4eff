"""Warm ranks vs a fresh launch: dispatch cost through Cluster.run, side by side in one run.

    python bench/dispatch.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import parlib


def noop():
    return None


def all_reduce_bytes(n_bytes):
    t = torch.ones(n_bytes // 4)
    dist.all_reduce(t)


def median_seconds(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--launch-repeats", type=int, default=10)
    opts = parser.parse_args()
    work = [("no-op", noop, ()), ("all-reduce 1 KiB", all_reduce_bytes, (1 << 10,)),
            ("all-reduce 1 MiB", all_reduce_bytes, (1 << 20,))]
    print(f"{'ranks':>5s} {'work':18s} {'Cluster.run':>12s} {'launch':>10s} {'ratio':>8s}")
    for n in (2, 4):
        with parlib.Cluster(n) as cluster:
            warm = {name: median_seconds(lambda f=f, a=a: cluster.run(f, *a), opts.repeats)
                    for name, f, a in work}
        for name, f, a in work:
            fresh = median_seconds(lambda f=f, a=a: parlib.launch(f, *a, world_size=n),
                                   opts.launch_repeats, warmup=1)
            print(f"{n:5d} {name:18s} {warm[name] * 1e3:9.2f} ms {fresh * 1e3:7.1f} ms "
                  f"{fresh / warm[name]:7.0f}x")
    print(f"(medians; {os.cpu_count()} cores, torch {torch.__version__}, gloo on CPU)")


if __name__ == "__main__":
    main()
