"""Pipeline step time, measured over theory: GPipe and 1F1B at p = 4, m = 1, 4, 8.

Each stage's forward and backward are padded with a sleep to a fixed, *emulated* cost
(on a CPU with fewer cores than ranks, real compute cannot overlap; see the chapter). The
theory is (m + p - 1) x (t_f + t_b). Prints the median of the repeats after one warm-up
step, and checks the gradients against the single-device model first.

    python bench/pp.py [--p 4] [--ms 1 4 8] [--t-f 0.03] [--t-b 0.06] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import parlib
from parlib import cost, verify
from parlib.measure.emulation import StageCost
from parlib.measure.timeline import align, makespan, measured_bubble
from parlib.model import ModelConfig
from parlib.plots import run_label
from parlib.strategies import pipeline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    ap.add_argument("--t-f", type=float, default=0.03, help="emulated forward time (s)")
    ap.add_argument("--t-b", type=float, default=0.06, help="emulated backward time (s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)

    cfg = ModelConfig()
    stage_cost = StageCost(args.t_f, args.t_b)
    ref = verify.reference_step(cfg, seed=0, batch_size=args.batch)
    rows = []
    label = None
    t_start = time.perf_counter()
    for name in args.schedules:
        for m in args.ms:
            res = parlib.launch(pipeline.rank_step, cfg, schedule_name=name, m=m,
                                batch_size=args.batch, cost=stage_cost, repeats=args.repeats,
                                world_size=args.p, timeout=300)
            got = pipeline.gather_grads(res)
            same = verify.compare(got, ref["grads"])
            if not same:
                raise SystemExit(f"{name} m={m}: gradients {same}")
            label = run_label(args.p, res[0]["device"], res[0]["backend"], emulated=True)
            runs = [align([r["spans"][k] for r in res]) for k in range(args.repeats)]
            times = [makespan(s) for s in runs]
            med = statistics.median(times)
            theory = cost.ideal_step_time(args.p, m, stage_cost.per_microbatch)
            bubble = statistics.median(measured_bubble(s) for s in runs)
            rows.append((name, m, theory, med, med / theory, bubble,
                         cost.bubble_fraction(args.p, m)))
    print(f"\npipeline step time, {label}: t_f = {args.t_f * 1e3:g} ms, "
          f"t_b = {args.t_b * 1e3:g} ms, median of {args.repeats} after 1 warm-up step")
    print(f"{'schedule':<9}{'m':>3}{'theory ms':>11}{'measured ms':>13}{'ratio':>7}"
          f"{'bubble':>8}{'theory':>8}")
    for name, m, theory, med, ratio, bub, bub_th in rows:
        print(f"{name:<9}{m:>3}{theory * 1e3:>11.1f}{med * 1e3:>13.1f}{ratio:>7.3f}"
              f"{bub:>8.3f}{bub_th:>8.3f}")
    worst = max(r[4] for r in rows)
    print(f"worst ratio {worst:.3f} (target <= 1.05); gradients equal single-device in every "
          f"run; {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
