"""Pipeline step time, measured over theory: four schedules at p = 4, m = 1, 4, 8, batch fixed.

Each stage's forward and backward are padded with a sleep to an *emulated* cost that scales
with the rows of the microbatch: rows x per-row time + a fixed per-call time (on a CPU with
fewer cores than ranks, real compute cannot overlap; see the pipeline chapter). An op of one
of the interleaved schedule's v chunks costs 1/v of that, and ZB-H1's B and W share a
backward (``--weight-share`` for W). The batch B is the same for every m. The theory
(parlib.cost.schedule_step_time) is each schedule's compute, e.g. (m + p - 1)(B/m c + o)
for GPipe and 1F1B, plus every boundary crossing on the critical path (a header and a
payload in flight together, alpha + beta x bytes), plus the time each rank spends in its
own sends and receives, serial with its compute (a receive and a send per op inside the
pipeline), which grows with the ops, and each emulated op's overrun (its sleep wakes a
little late). The message times are measured first, point to point in the runner's own
pattern (parlib.measure.crossings; the launching chapter's all-reduce fit prices a ring
step, not a crossing whose receive was posted early, and its alpha swung 0.27-1.17 ms
between quick fits here), and the overrun in this process
(parlib.experiments.pipeline.emulated_overrun). Gradients are checked against the
single-device model first; each row is the median of the repeats after
one warm-up step, with the fastest and slowest repeat; messages are the send spans the
runner recorded, against parlib.cost.messages_per_rank; "late ops" are the ops whose real
compute outlasted their emulated time by over 1 ms (where the theory cannot hold).

The last line is the worst ratio to theory R = max over rows of max(measured/theory,
theory/measured): a theory that predicts too long a step counts as much as one too short.

    python bench/pp.py [--p 4] [--ms 1 4 8] [--schedules gpipe 1f1b interleaved zb-h1]
                       [--t-f 0.01] [--t-b 0.02] [--t-call 0.002] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import parlib
from parlib import cost, verify
from parlib.experiments import pipeline as pp_runs
from parlib.experiments.schedule_lab import (
    lab_config,
    measured_messages,
    message_costs,
    predict,
    schedule_label,
)
from parlib.measure.crossings import measure_crossings
from parlib.measure.emulation import StageCost
from parlib.measure.timeline import align, makespan, measured_bubble
from parlib.model import ModelConfig
from parlib.plots import run_label


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=list(cost.PIPELINE_SCHEDULES),
                    choices=cost.PIPELINE_SCHEDULES)
    ap.add_argument("--v", type=int, default=2, help="chunks per rank (interleaved)")
    ap.add_argument("--weight-share", type=float, default=0.5,
                    help="W's part of ZB-H1's emulated backward")
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
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    t_start = time.perf_counter()
    # Interleaving cuts the model into p x v chunks: every schedule runs that same model,
    # the lab's small one (its real compute stays well inside the emulated op times).
    cfg = lab_config(args.p, args.v if "interleaved" in args.schedules else 1)
    cfg = replace(cfg, n_layers=max(cfg.n_layers, ModelConfig().n_layers))
    stage_cost = StageCost(args.t_f, args.t_b, args.t_call)
    # priced at this bench's shortest ops: a receiver wakes more slowly after a longer wait
    shortest = args.batch // max(args.ms)
    crossing = measure_crossings(launch=parlib.launch, backend="gloo",
                                 op_seconds=stage_cost.duration("forward", shortest))
    overrun = pp_runs.emulated_overrun(stage_cost, shortest)
    ref = verify.reference_step(cfg, seed=0, batch_size=args.batch)
    rows, skipped = [], []
    label = None
    for name in args.schedules:
        for m in args.ms:
            if name == "interleaved" and m % args.p:
                skipped.append(f"{schedule_label(name, args.v)} m={m} (needs m a multiple "
                               f"of p={args.p})")
                continue
            v = args.v if name == "interleaved" else 1
            payload = cost.boundary_bytes(args.batch // m, cfg.seq_len, cfg.d_model)
            pred = predict(name, args.p, m, args.batch, stage_cost, v=args.v,
                           weight_share=args.weight_share,
                           **message_costs(crossing, payload, overrun))
            res = pp_runs.run_pipeline(cfg, name, args.p, m, v=v, timeout=300,
                                       batch_size=args.batch, cost=stage_cost,
                                       repeats=args.repeats, weight_share=args.weight_share)
            same = verify.compare(pp_runs.gather_grads(res), ref["grads"])
            if not same:
                raise SystemExit(f"{name} m={m}: gradients {same}")
            label = run_label(args.p, res[0]["device"], res[0]["backend"], emulated=True)
            runs = sorted((align([r["spans"][k] for r in res]) for k in range(args.repeats)),
                          key=makespan)
            steps = [makespan(s) for s in runs]
            median = runs[len(runs) // 2]
            med = makespan(median)
            sent = sum(measured_messages(median).values())
            due = {"forward": pred.t_f, "backward": pred.t_b, "weight": pred.t_w}
            ops = [x for spans in median for x in spans if x.kind in due]
            # an op that outlasts its emulated time by over 1 ms: real compute overran
            late = sum(x.duration > due[x.kind] + 1e-3 for x in ops) / len(ops)
            rows.append(dict(name=name, m=m, theory=pred.step, msg=pred.message_part,
                             med=med, fast=steps[0], slow=steps[-1], ratio=med / pred.step,
                             bubble=measured_bubble(median), bubble_th=pred.bubble,
                             sent=sent, sent_th=sum(pred.messages.values()), late=late))
    print(f"\npipeline step time, {label}, batch B = {args.batch} for every m, "
          f"{cfg.n_layers} blocks")
    print(stage_cost.describe() + f"; interleaved v = {args.v}, ZB-H1 W = "
          f"{args.weight_share:g} of the backward")
    print(crossing.describe() + f"; a crossing is a {cost.HEADER_BYTES} B header + the payload")
    print(f"an emulated op overruns its due time by {overrun * 1e6:.0f} us (its sleep wakes late, "
          f"the hooks record it; measured now)")
    print(f"median of {args.repeats} after 1 warm-up step (fastest-slowest); theory = compute "
          f"(each op + its overrun) + crossings on the critical path + each op's own receive "
          f"and send (the (msgs) column: both); late ops: ops of the median step that outlast "
          f"their emulated time by over 1 ms (real compute overran: a loaded machine)")
    print(f"{'schedule':<16}{'m':>3}{'theory ms':>11}{'(msgs)':>8}{'measured ms':>13}"
          f"{'(min-max)':>13}{'ratio':>7}{'bubble':>8}{'theory':>8}{'sends':>7}{'theory':>8}"
          f"{'late ops':>10}")
    for r in rows:
        spread = f"({r['fast'] * 1e3:.0f}-{r['slow'] * 1e3:.0f})"
        print(f"{schedule_label(r['name'], args.v):<16}{r['m']:>3}{r['theory'] * 1e3:>11.1f}"
              f"{r['msg'] * 1e3:>8.1f}{r['med'] * 1e3:>13.1f}{spread:>13}{r['ratio']:>7.3f}"
              f"{r['bubble']:>8.3f}{r['bubble_th']:>8.3f}{r['sent']:>7}{r['sent_th']:>8}"
              f"{r['late']:>10.0%}")
    for item in skipped:
        print(f"skipped: {item}")
    for name in args.schedules:
        mine = [r for r in rows if r["name"] == name]
        if len(mine) < 2:
            continue
        first, last = mine[0], mine[-1]
        print(f"{schedule_label(name, args.v)}, m={last['m']} / m={first['m']} step: measured "
              f"{last['med'] / first['med']:.3f}, theory {last['theory'] / first['theory']:.3f};"
              f" its fixed-batch step times:")
        print("fixed batch step ms: "
              + ", ".join(f"m={r['m']} {r['med'] * 1e3:.0f}" for r in mine))
    messages_ok = all(r["sent"] == r["sent_th"] for r in rows)
    worst = max(max(r["ratio"], 1 / r["ratio"]) for r in rows)
    print(f"messages sent {'equal' if messages_ok else 'DIFFER FROM'} the count in every run; "
          f"gradients equal single-device in every run; {time.perf_counter() - t_start:.0f} s")
    print(f"worst ratio to theory {worst:.3f} (max of measured/theory and theory/measured; "
          f"target <= 1.05 on a quiet machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
