"""Benchmark: our data-parallel syncs against torch DDP, and the cost of CommLog.

    python bench/dp.py            # 2 ranks, CPU/gloo here; NCCL on GPUs
    python bench/dp.py --rounds 8 --batch 16

Prints steps/s of naive, bucketed, bucketed+overlapped and DDP training steps (same model,
same data, interleaved in rounds so that a noisy neighbour hits every strategy alike), their
ratios to DDP, and instrumented vs plain all-reduce of 16 MiB. Each strategy's parameters
are first checked against the single-device run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import parlib
from parlib import measure, verify
from parlib.model import ModelConfig, train_step
from parlib.plots import run_label
from parlib.strategies import data as dp

KINDS = ("naive", "bucketed", "overlapped", "ddp")


def _race(kinds, cfg, global_batch, rounds, steps_per_round, bucket_mb):
    """On each rank: check every strategy against single-device, then time them in rounds."""
    rank = dist.get_rank()
    dev = parlib.device()
    ref = verify.reference_params(cfg, steps=2, global_batch=global_batch, device=dev)
    setups = {k: dp.setup(k, cfg, bucket_mb=bucket_mb, device=dev) for k in kinds}
    for k, (model, opt, sync) in setups.items():
        for step in range(2):
            x, y = dp.local_batch(global_batch, cfg, step, device=dev)
            train_step(model, opt, x, y, sync)
        err = verify.max_abs_diff(model.parameters(), ref)
        if err > 1e-5:
            raise AssertionError(f"{k}: parameters differ from single-device by {err:.3g}")
    x, y = dp.local_batch(global_batch, cfg, 0, device=dev)
    times = {k: [] for k in kinds}
    for _ in range(rounds):
        for k, (model, opt, sync) in setups.items():
            t = measure.time_it(
                lambda: train_step(model, opt, x, y, sync),
                repeats=steps_per_round,
                warmup=1,
                device=dev,
                barrier=True,
            )
            times[k].extend(t.times)
    med = {k: statistics.median(v) for k, v in times.items()}
    return (med, dist.get_backend(), str(dev)) if rank == 0 else None


def _allreduce_overhead(nbytes, repeats):
    """Median seconds of a plain all-reduce and of one recorded by CommLog, in alternating
    pairs (which goes first alternates too), each call started together on all ranks; and
    the median over pairs of plain / logged, which cancels load that changes between pairs."""
    dev = parlib.device()
    t = torch.ones(nbytes // 4, device=dev)
    times = {"plain": [], "logged": []}

    def one(kind):
        if kind == "plain":
            return measure.time_it(
                lambda: dist.all_reduce(t), repeats=1, warmup=0, device=dev, barrier=True
            ).median
        with measure.CommLog():
            return measure.time_it(
                lambda: dist.all_reduce(t), repeats=1, warmup=0, device=dev, barrier=True
            ).median

    for _ in range(3):
        dist.all_reduce(t)  # warm-up
    for i in range(repeats):
        order = ("plain", "logged") if i % 2 == 0 else ("logged", "plain")
        for kind in order:
            times[kind].append(one(kind))
    pair_ratios = [p / q for p, q in zip(times["plain"], times["logged"])]
    return (statistics.median(times["plain"]), statistics.median(times["logged"]),
            statistics.median(pair_ratios))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="global batch B (B/N rows per rank)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per strategy per round")
    ap.add_argument(
        "--bucket-mb", type=float, default=25.0, help="bucket cap (first bucket 1 MiB), as DDP"
    )
    args = ap.parse_args(argv)
    cfg = ModelConfig()
    n = args.world_size
    t0 = time.perf_counter()
    med, backend, device = parlib.launch(
        _race,
        KINDS,
        cfg,
        args.batch,
        args.rounds,
        args.steps,
        args.bucket_mb,
        world_size=n,
        timeout=600,
    )[0]
    label = run_label(n, device, backend)
    rows = [[k, 1.0 / med[k], med[k] * 1e3, med["ddp"] / med[k]] for k in KINDS]
    print(
        measure.Table(
            ["strategy", "steps/s", "ms/step", "x DDP"],
            rows,
            title=f"Training steps, B={args.batch} ({label}); parameters checked first",
        )
    )
    best = min((k for k in KINDS if k != "ddp"), key=med.get)
    ratio = med["ddp"] / med[best]
    print(f"best of ours: {best} at {ratio:.3f}x DDP (target >= 0.95)")
    plain, logged, paired = parlib.launch(_allreduce_overhead, 16 * 2**20, 200, world_size=n)[0]
    print(
        measure.Table(
            ["all_reduce 16 MiB", "ms"], [["plain", plain * 1e3], ["inside CommLog", logged * 1e3]]
        )
    )
    print(f"instrumented / plain throughput: {plain / logged:.3f}x from the medians, "
          f"{paired:.3f}x as the median of side-by-side pairs (target >= 0.97)")
    print(f"bench wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
