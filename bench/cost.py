"""Benchmark of the chapter 05 cost model (pure Python, no ranks, a second or two).

    python bench/cost.py                      # every section
    python bench/cost.py --sections plan      # only the planner timing and its top 5

Sections, each a function printing one table:

- ``plan``: how long ``plan`` takes for a 1-trillion-parameter model on 4096 H100s
  (target: under 1 s; median of repeats, each a fresh search), then its top 5 layouts.
- ``published``: predicted (at peak compute) against reported utilisation of the published
  runs in ``parlib.cost.published``.

A section is a function in SECTIONS; the predicted-vs-measured table of 4-rank layouts run
here joins as one more once the chapters whose code it runs exist.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from parlib.cost import Cluster, Model, plan
from parlib.cost.estimate import Estimate
from parlib.cost.hardware import GB
from parlib.cost.published import comparison_table

# Narayanan et al. 2021, Table 1: the 1008.0B row's shape (GPT, vocabulary 51,200, s = 2048).
TRILLION = Model(128, 25600, 160, 2048, 51200, tied_embeddings=True, dropout=True,
                 name="GPT 1T")


def time_plan(model: Model, cluster: Cluster, global_batch: int, repeats: int
              ) -> tuple[list[float], list[Estimate]]:
    """Seconds of each of ``repeats`` full searches, and the last search's answer."""
    seconds, ranked = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ranked = plan(model, cluster, global_batch=global_batch)
        seconds.append(time.perf_counter() - start)
    return seconds, ranked


def layout_table(ranked: list[Estimate]) -> str:
    """One row per estimate: layout, schedule, memory, step time and its parts, MFU."""
    rows = [f"{'#':>2} {'d':>5} {'t':>3} {'p':>4} {'v':>2} {'m':>5} {'ZeRO':>4} "
            f"{'recompute':>9} {'GB/dev':>7} {'step s':>7} {'compute':>7} {'tp':>6} "
            f"{'bubble':>6} {'dp':>6} {'MFU':>5}"]
    rc = {False: "-", "selective": "selective", True: "full"}
    for i, e in enumerate(ranked, 1):
        share = {k: e.time[k] / e.step_time for k in ("compute", "tp_comm", "pp_bubble",
                                                       "dp_sync")}
        rows.append(f"{i:>2} {e.d:>5} {e.t:>3} {e.p:>4} {e.v:>2} {e.m:>5} {e.zero:>4} "
                    f"{rc[e.recompute]:>9} {e.memory_total / GB:>7.1f} {e.step_time:>7.2f} "
                    f"{share['compute']:>7.0%} {share['tp_comm']:>6.0%} "
                    f"{share['pp_bubble']:>6.0%} {share['dp_sync']:>6.0%} {e.mfu:>5.0%}")
    rows += [f"{i:>2}: {e.reason}" for i, e in enumerate(ranked, 1)]
    return "\n".join(rows)


def plan_section(args: argparse.Namespace) -> None:
    cluster = Cluster.dgx_h100(4096)
    seconds, ranked = time_plan(TRILLION, cluster, args.global_batch, args.repeats)
    print(f"\nplan({TRILLION.name}, {TRILLION.n_params / 1e12:.2f} T params; {cluster}; "
          f"global batch {args.global_batch} x {TRILLION.seq_len} tokens)")
    print(f"  search time: median {statistics.median(seconds):.3f} s of {args.repeats} "
          f"(min {min(seconds):.3f}, max {max(seconds):.3f}); target < 1 s")
    print("  predicted at peak compute (compute_efficiency 1): MFU is an upper bound\n")
    print(layout_table(ranked))


def published_section(args: argparse.Namespace) -> None:
    print("\npublished runs: predicted at peak compute vs reported "
          "(sources and assumptions: parlib/cost/published.py)\n")
    print(comparison_table())


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "plan": plan_section,
    "published": published_section,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--repeats", type=int, default=5, help="plan searches to time")
    ap.add_argument("--global-batch", type=int, default=4096, help="sequences per step")
    args = ap.parse_args(argv)
    for name in args.sections:
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
