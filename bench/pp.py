"""Pipeline step time, measured over theory: GPipe and 1F1B at p = 4, m = 1, 4, 8, batch fixed.

Each stage's forward and backward are padded with a sleep to an *emulated* cost that scales
with the rows of the microbatch: rows x per-row time + a fixed per-call time (on a CPU with
fewer cores than ranks, real compute cannot overlap; see the pipeline chapter). The batch B is the
same for every m, so the theory is (m + p - 1) x (B/m x c + o) (parlib.cost.
fixed_batch_step_time): more microbatches shorten the step towards the bubble-free B x c.
Prints the median of the repeats after one warm-up step, and checks the gradients against
the single-device model first.

    python bench/pp.py [--p 4] [--ms 1 4 8] [--t-f 0.01] [--t-b 0.02] [--t-call 0.002]
"""

from __future__ import annotations

import argparse
import statistics
import time

import parlib
from parlib import cost, verify
from parlib.experiments import pipeline as pp_runs
from parlib.measure.emulation import StageCost
from parlib.measure.timeline import align, makespan, measured_bubble
from parlib.model import ModelConfig
from parlib.plots import run_label


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    ap.add_argument("--t-f", type=float, default=0.01, help="emulated forward time per row (s)")
    ap.add_argument("--t-b", type=float, default=0.02, help="emulated backward time per row (s)")
    ap.add_argument("--t-call", type=float, default=0.002,
                    help="emulated fixed time per forward or backward call (s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    bad = [m for m in args.ms if args.batch % m]
    if bad:
        ap.error(f"--batch {args.batch} does not split into m = {bad} equal microbatches")

    cfg = ModelConfig()
    stage_cost = StageCost(args.t_f, args.t_b, args.t_call)
    ref = verify.reference_step(cfg, seed=0, batch_size=args.batch)
    rows = []
    label = None
    t_start = time.perf_counter()
    for name in args.schedules:
        for m in args.ms:
            res = parlib.launch(pp_runs.rank_step, cfg, schedule_name=name, m=m,
                                batch_size=args.batch, cost=stage_cost, repeats=args.repeats,
                                world_size=args.p, timeout=300)
            got = pp_runs.gather_grads(res)
            same = verify.compare(got, ref["grads"])
            if not same:
                raise SystemExit(f"{name} m={m}: gradients {same}")
            label = run_label(args.p, res[0]["device"], res[0]["backend"], emulated=True)
            runs = [align([r["spans"][k] for r in res]) for k in range(args.repeats)]
            med = statistics.median(makespan(s) for s in runs)
            theory = cost.ideal_step_time(args.p, m, stage_cost.stage_time(args.batch // m))
            bubble = statistics.median(measured_bubble(s) for s in runs)
            rows.append((name, m, theory, med, med / theory, bubble,
                         cost.bubble_fraction(args.p, m)))
    print(f"\npipeline step time, {label}, batch B = {args.batch} for every m")
    print(stage_cost.describe())
    print(f"median of {args.repeats} after 1 warm-up step; theory (m+p-1)(B/m c + o)")
    print(f"{'schedule':<9}{'m':>3}{'theory ms':>11}{'measured ms':>13}{'ratio':>7}"
          f"{'bubble':>8}{'theory':>8}")
    for name, m, theory, med, ratio, bub, bub_th in rows:
        print(f"{name:<9}{m:>3}{theory * 1e3:>11.1f}{med * 1e3:>13.1f}{ratio:>7.3f}"
              f"{bub:>8.3f}{bub_th:>8.3f}")
    for name in args.schedules:
        mine = [r for r in rows if r[0] == name]
        first, last = mine[0], mine[-1]
        print(f"{name}, m={last[1]} / m={first[1]} step: measured {last[3] / first[3]:.3f}, "
              f"theory {last[2] / first[2]:.3f}; its fixed-batch step times:")
        print("fixed batch step ms: "
              + ", ".join(f"m={m} {med * 1e3:.0f}" for _, m, _, med, *_ in mine))
    worst = max(r[4] for r in rows)
    print(f"worst ratio to theory {worst:.3f} (target <= 1.05 on a quiet machine); gradients "
          f"equal single-device in every run; {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
