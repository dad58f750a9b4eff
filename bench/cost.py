"""Benchmark of the choosing chapter's cost model: the planner and the published runs (pure Python,
no ranks, a second or two), and predicted against measured layouts here (about a minute).

    python bench/cost.py                      # every section
    python bench/cost.py --sections plan      # only the planner timing and its top 5

Sections, each a function printing one table:

- ``plan``: how long the planner (``best_layouts``) takes for a 1-trillion-parameter model
  on 4096 H100s (target: under 1 s; median of repeats, each a fresh search), then its top 5 layouts.
- ``published``: predicted (at peak compute) against reported utilisation of the published
  runs in ``parlib.cost.published``.
- ``layouts``: the choosing chapter's six 4-rank layouts of the tiny model, predicted with the link
  measured here (the launching chapter's fit) and emulated devices, then run with the combining
  chapter's code:
  measured / predicted per layout, with the measured link and with an emulated slow one
  (``SlowLink``, +200 ns per byte). About a minute; the only section that launches ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from parlib.cost import AXES, Hardware, Model, best_layouts
from parlib.cost.estimate import Estimate
from parlib.cost.hardware import GB
from parlib.cost.published import comparison_table

# Narayanan et al. 2021, Table 1: the 1008.0B row's shape (GPT, vocabulary 51,200, s = 2048).
TRILLION = Model(128, 25600, 160, 2048, 51200, tied_embeddings=True, dropout=True,
                 name="GPT 1T")


def time_plan(model: Model, hardware: Hardware, global_batch: int, repeats: int
              ) -> tuple[list[float], list[Estimate]]:
    """Seconds of each of ``repeats`` full searches, and the last search's answer."""
    seconds, ranked = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ranked = best_layouts(model, hardware, global_batch=global_batch)
        seconds.append(time.perf_counter() - start)
    return seconds, ranked


def layout_table(ranked: list[Estimate]) -> str:
    """One row per estimate: layout, schedule, memory, step time and its parts, MFU."""
    sizes = " ".join(f"{a.symbol:>4}" for a in AXES)
    rows = [f"{'#':>2} {sizes} {'v':>2} {'m':>5} {'ZeRO':>4} "
            f"{'recompute':>9} {'GB/dev':>7} {'step s':>7} {'compute':>7} {'tp':>6} "
            f"{'bubble':>6} {'dp':>6} {'MFU':>5}"]
    rc = {False: "-", "selective": "selective", True: "full"}
    for i, e in enumerate(ranked, 1):
        share = {k: e.time[k] / e.step_time for k in ("compute", "tp_comm", "pp_bubble",
                                                       "dp_sync")}
        sizes = " ".join(f"{n:>4}" for n in e.layout.values())
        rows.append(f"{i:>2} {sizes} {e.v:>2} {e.m:>5} {e.zero:>4} "
                    f"{rc[e.recompute]:>9} {e.memory_total / GB:>7.1f} {e.step_time:>7.2f} "
                    f"{share['compute']:>7.0%} {share['tp_comm']:>6.0%} "
                    f"{share['pp_bubble']:>6.0%} {share['dp_sync']:>6.0%} {e.mfu:>5.0%}")
    rows += [f"{i:>2}: {e.reason}" for i, e in enumerate(ranked, 1)]
    return "\n".join(rows)


def plan_section(args: argparse.Namespace) -> None:
    hardware = Hardware.dgx_h100(4096)
    seconds, ranked = time_plan(TRILLION, hardware, args.global_batch, args.repeats)
    print(f"\nbest_layouts({TRILLION.name}, {TRILLION.n_params / 1e12:.2f} T params; "
          f"{hardware}; "
          f"global batch {args.global_batch} x {TRILLION.seq_len} tokens)")
    print(f"  search time: median {statistics.median(seconds):.3f} s of {args.repeats} "
          f"(min {min(seconds):.3f}, max {max(seconds):.3f}); target < 1 s")
    print("  predicted at peak compute (compute_efficiency 1): MFU is an upper bound\n")
    print(layout_table(ranked))


def published_section(args: argparse.Namespace) -> None:
    print("\npublished runs: predicted at peak compute vs reported "
          "(sources and assumptions: parlib/cost/published.py)\n")
    print(comparison_table())


def layouts_section(args: argparse.Namespace) -> None:
    import parlib
    from parlib import verify
    from parlib.experiments import layouts as L
    from parlib.measure.links import load_or_measure

    fit, source = load_or_measure(4, launch=parlib.launch)
    one_core = L.compute_rate()
    rate = one_core / args.slowdown
    here = Hardware.measured_here(4, allreduce_fit=(fit.a, fit.b), fit_ranks=fit.n,
                                 flops_per_second=rate)
    print(f"\nlayouts: 4 ranks, link from {source} ({fit.backend}: alpha "
          f"{here.intra_node.alpha * 1e6:.0f} us, {here.intra_node.bandwidth / 1e9:.2f} GB/s); "
          f"emulated devices at one core / {args.slowdown:g} = {rate / 1e9:.2f} GFLOP/s")
    reference = verify.reference_step()  # one device, the full batch of 8
    for title, link in (("measured link", None),
                        (f"+ emulated {args.slow_beta * 1e9:g} ns per byte (SlowLink)",
                         (0.0, args.slow_beta))):
        hardware = here.slowed_by(*link) if link else here
        predicted = L.predict(L.LAYOUTS, hardware)
        results = parlib.launch(L.rank_time_layouts, flops_per_second=rate, link=link,
                                reference=reference,
                                repeats=args.layout_repeats, world_size=4, timeout=600)
        rows = L.measured(results)
        agree = L.agreement(predicted, rows)
        print(f"\n{title}: every layout matches one device: {all(r['ok'] for r in rows)}; "
              f"overruns {sum(r['overruns'] for r in rows)} of "
              f"{sum(r['pieces'] for r in rows)} pieces\n")
        print(L.table(predicted, rows))
        print(f"\n{agree['within']} of 6 within 25%; {agree['pairs_same']} of "
              f"{agree['pairs']} pairs in the predicted order ({agree['separated_same']} of "
              f"{agree['separated']} pairs predicted > 10% apart); fastest predicted "
              f"{L.LAYOUTS[agree['best'][0]].layout}, measured "
              f"{L.LAYOUTS[agree['best'][1]].layout}")


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "plan": plan_section,
    "published": published_section,
    "layouts": layouts_section,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--repeats", type=int, default=5, help="planner searches to time")
    ap.add_argument("--global-batch", type=int, default=4096, help="sequences per step")
    ap.add_argument("--slowdown", type=float, default=16.0,
                    help="layouts: emulated device = one core's rate / this")
    ap.add_argument("--slow-beta", type=float, default=200e-9,
                    help="layouts: seconds per byte the emulated slow link adds")
    ap.add_argument("--layout-repeats", type=int, default=5, help="layouts: timed steps")
    args = ap.parse_args(argv)
    for name in args.sections:
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
