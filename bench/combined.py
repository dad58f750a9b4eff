"""Benchmark: pipeline, data, context, tensor and expert parallelism at once, on real ranks.

    python bench/combined.py                      # 8 ranks (4 axes) and 16 ranks (5 axes)
    python bench/combined.py --layouts 4d --steps 3 --schedule gpipe

A mixture-of-experts variant of the course model, trained a few steps with every axis on:
``4d`` is pp = 2 x cp = 2 x tp = 2 on 8 ranks (ep = 2 over the cp ranks), ``5d`` is
pp = 2 x dp = 2 x cp = 2 x tp = 2 on 16 ranks (ep = 2, an expert's copies on dp). The
sequence is split zig-zag, the pipeline runs ``--schedule`` (1F1B by default). Each run is
first checked against one device (every loss, every rank's share of every gradient and
weight, every step: parlib.verify.compare); then the bytes each axis sent in the last step
are put next to ``parlib.cost.mesh_sent_bytes_per_step`` (per rank; ep: what a rank puts into
its all-to-alls, the mean over its ep group), and the last step's time is its makespan
over all ranks (ranks share this machine's cores: a CPU figure, not a cluster's).
Last line: ``bytes per axis measured / predicted: R.RR`` (all axes, all runs; 1.00 is exact).
"""

from __future__ import annotations

import argparse
import time

import parlib
from parlib import verify
from parlib.cost import Layout
from parlib.experiments import combined as runs
from parlib.measure.tables import fmt_bytes
from parlib.measure.timeline import align, makespan
from parlib.model import ModelConfig

LAYOUTS = {"4d": Layout(pp=2, cp=2, tp=2, ep=2), "5d": Layout(pp=2, dp=2, cp=2, tp=2, ep=2)}
AXIS_ORDER = ("tp", "cp", "ep", "dp", "pp")


def _run(name: str, cfg: ModelConfig, args: argparse.Namespace,
         reference: verify.History) -> tuple[float, float]:
    layout = LAYOUTS[name]
    results = parlib.launch(runs.rank_train_nd, layout, cfg=cfg, steps=args.steps,
                            global_batch=args.batch, m=args.m, record=True,
                            schedule=args.schedule, sequence_layout="zigzag",
                            world_size=layout.world, timeout=1800)
    got, want = runs.pair_with_reference(results, reference)
    verdict = verify.compare(got, want)
    if not verdict.ok:
        raise AssertionError(f"{name} ({layout}) differs from one device: {verdict}")
    table = runs.bytes_per_axis(layout, results, cfg, args.batch, args.m)
    measured = sum(g for axes in table.values() for g, _ in axes.values())
    predicted = sum(w for axes in table.values() for _, w in axes.values())
    exact = all(g == w for axes in table.values() for g, w in axes.values())
    step = makespan(align([r["spans"] for r in results]))
    print(f"{name}: {layout} on {layout.world} ranks, {args.schedule}, {len(got)} tensors "
          f"over {args.steps} steps: {verdict}; last step {step * 1e3:.0f} ms")
    print(f"    bytes rank 0 sent in its last step, measured (predicted), every rank "
          f"{'exact' if exact else 'NOT exact'}:")
    print("    " + "  ".join(f"{a} {fmt_bytes(table[0][a][0])} ({fmt_bytes(table[0][a][1])})"
                             for a in AXIS_ORDER if a in table[0]))
    return measured, predicted


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["4d", "5d"])
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument("--m", type=int, default=2, help="microbatches per step")
    ap.add_argument("--seq", type=int, default=16, help="s (divisible by 2 x cp)")
    ap.add_argument("--hidden", type=int, default=32, help="h")
    ap.add_argument("--experts", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = ModelConfig(vocab_size=64, seq_len=args.seq, d_model=args.hidden, n_heads=4,
                      n_layers=2, n_experts=args.experts, top_k=2, expert_hidden=args.hidden)
    t0 = time.perf_counter()
    print(f"MoE model: L={cfg.n_layers}, h={cfg.d_model}, s={cfg.seq_len}, E={cfg.n_experts}, "
          f"k={cfg.top_k}; B={args.batch}, m={args.m}, zig-zag sequence split, fp32")
    reference = verify.reference_run(cfg, steps=args.steps, batch=args.batch)
    measured = predicted = 0.0
    for name in args.layouts:
        got, want = _run(name, cfg, args, reference)
        measured, predicted = measured + got, predicted + want
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"bytes per axis measured / predicted: {measured / predicted:.2f}")


if __name__ == "__main__":
    main()
