"""Benchmark: our data-parallel syncs against torch DDP, and the cost of CommLog.

    python bench/dp.py            # 2 ranks, CPU/gloo here; NCCL on GPUs
    python bench/dp.py --rounds 8 --batch 16

Prints steps/s of the no-sync floor, naive, bucketed, bucketed+overlapped and DDP training
steps (same model, same data, interleaved in rounds in a rotating order so that a noisy
neighbour hits every strategy alike), the median and interquartile range (IQR) of each, their
ratios to DDP, and instrumented vs plain all-reduce of 16 MiB. Each strategy's parameters
are first checked against the single-device run. ``--model small-tensors`` races the data-parallel
chapter's
``cfg_race`` (8 thin blocks, about 100 gradient tensors), where per-message latency shows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import parlib
from parlib import measure, verify
from parlib.experiments import data as dp_runs
from parlib.model import ModelConfig, train_step
from parlib.plots import run_label
from parlib.strategies import data as dp

KINDS = ("single", "naive", "bucketed", "overlapped", "ddp")
MODELS = {
    "default": ModelConfig(),
    "small-tensors": ModelConfig(seq_len=32, d_model=32, n_heads=2, n_layers=8),
}


def _iqr(times: list[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(times, n=4)
    return q1, q3


def _race(kinds, cfg, global_batch, rounds, steps_per_round, bucket_mb):
    """On each rank: check every strategy against single-device, then time them in rounds."""
    rank = dist.get_rank()
    dev = parlib.device()
    ref = verify.reference_params(cfg, steps=2, global_batch=global_batch, device=dev)
    setups = {k: dp_runs.setup(k, cfg, bucket_mb=bucket_mb, device=dev) for k in kinds}
    for k, (model, opt, sync) in setups.items():
        if k == "single":  # the no-sync floor: each rank alone, nothing to compare
            continue
        for step in range(2):
            x, y = dp.local_batch(global_batch, cfg, step, device=dev)
            train_step(model, opt, x, y, sync)
        verdict = verify.compare(list(model.parameters()), ref)
        if not verdict.ok:
            raise AssertionError(f"{k}: parameters differ from single-device: {verdict}")
    x, y = dp.local_batch(global_batch, cfg, 0, device=dev)
    times = {k: [] for k in kinds}
    order = list(kinds)
    for _ in range(rounds):
        order = order[1:] + order[:1]  # rotate: no strategy always runs first
        for k in order:
            model, opt, sync = setups[k]
            t = measure.time_it(
                lambda: train_step(model, opt, x, y, sync),
                repeats=steps_per_round,
                warmup=1,
                device=dev,
                barrier=True,
            )
            times[k].extend(t.times)
    return (times, dist.get_backend(), str(dev)) if rank == 0 else None


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
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--model", choices=sorted(MODELS), default="default")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per strategy per round")
    ap.add_argument(
        "--bucket-mb", type=float, default=25.0, help="bucket cap (first bucket 1 MiB), as DDP"
    )
    args = ap.parse_args(argv)
    cfg = MODELS[args.model]
    n = args.world_size
    t0 = time.perf_counter()
    times, backend, device = parlib.launch(
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
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [[k, 1.0 / med[k], med[k] * 1e3, "{:.1f}-{:.1f}".format(*(q * 1e3 for q in _iqr(v))),
             med["ddp"] / med[k]] for k, v in times.items()]
    print(
        measure.Table(
            ["strategy", "steps/s", "median ms", "IQR ms", "x DDP"],
            rows,
            title=f"Training steps, B={args.batch}, model {args.model} ({label}), "
            f"{len(times['ddp'])} steps each; parameters checked first",
        )
    )
    best = min((k for k in KINDS if k not in ("ddp", "single")), key=med.get)
    ratio = med["ddp"] / med[best]
    overlap = _iqr(times[best])[0] <= _iqr(times["ddp"])[1] and \
        _iqr(times["ddp"])[0] <= _iqr(times[best])[1]
    print(f"best of ours: {best} at {ratio:.3f}x DDP (target >= 0.95); the IQRs "
          f"{'overlap: within the noise' if overlap else 'do not overlap'}")
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
