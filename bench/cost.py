"""Benchmark of the choosing chapter's cost model: the planner and the published runs (pure Python,
no ranks, a second or two), and predicted against measured layouts here (a minute or two).

    python bench/cost.py                      # every section but grid
    python bench/cost.py --sections plan      # only the planner timing and its top 5

Sections, each a function printing one table:

- ``plan``: how long the planner (``best_layouts``) takes for a 1-trillion-parameter model
  on 4096 H100s (target: under 1 s; median of repeats, each a fresh search), then its top 5 layouts.
- ``published``: predicted against reported utilisation of the published runs in
  ``parlib.cost.published`` (``comparison_table``).
- ``foundry``: predicted against reported MFU of every row of llm-foundry's FSDP benchmark
  tables at sequence 2048 (``parlib.cost.foundry.foundry_table``): the share in band and,
  per model, the ratio at its most GPUs over the ratio at its fewest; llm-foundry's own
  re-runs of six 8-GPU layouts and how far they move those ratios
  (``parlib.cost.foundry_reruns.rerun_table``); its two other bf16 tables, in no fit, and
  the trend with them (``parlib.cost.foundry_held_out.foundry_held_out_table``); its sweeps
  of the sequence length by attention's share of the FLOPs
  (``parlib.cost.foundry_sequence.sequence_table``); then llm-foundry's one-node microbatch
  sweep, in no fit, and the model's lean from the smallest
  microbatch to the largest (``microbatch_table``).
- ``ranking``: the model's order of the layouts of published sweeps against the measured
  order (``parlib.cost.sweeps.ranking_table``).
- ``avoided``: ZeRO-3 without model parallelism beside Megatron-LM's PTD-P on 384-2240 A100s
  (Narayanan et al. 2021, Table 2), predicted against reported, and whether the model orders
  each pair as measured (``parlib.cost.avoided``).
- ``calibration``: each generation's two training shares (matmuls of MAMF, memory-bound work
  of the datasheet bandwidth) fitted to every published row, to llm-foundry's alone and to the
  others alone, and how each fit predicts both sets (``parlib.cost.calibration``).
- ``heldout``: torchtitan's Llama 2 rows on 64 A100s, in no fit: predicted against reported,
  and whether the model says each layout fits, beside what happened (one ran out of memory);
  then two peaks torchtitan measured (Llama 3.1 8B on 8 and 128 H100s) against the model's
  count (``parlib.cost.held_out``).
- ``network``: the share of the inter-node rate each run that can tell implies (ZeRO-3 alone
  across nodes, sync at least a third of compute); at each of 1, 1/2, 1/4, 1/8 of the rate,
  how many llm-foundry and Table 2 rows stay in the band and how many Table 2 pairs are
  ordered as measured; and each generation's fit error at those shares
  (``parlib.cost.calibration.network_table``, ``network_fit``).
- ``grid``: a measured grid of your own (``--grid FILE``, a CSV as ``parlib.cost.grid``
  describes): per model and GPU count, the rank correlation of predicted with measured
  throughput and the model's pick against the best measured; the medians against the
  course's targets (``parlib.cost.grid.grid_table``). Run only when named.
- ``layouts``: the choosing chapter's six 4-rank layouts of the tiny model, predicted with the link
  measured here and emulated devices, then run with the combining chapter's code:
  measured / predicted per layout, with the measured link and with an emulated slow one
  (``SlowLink``). The prediction charges the output layer as the course's code runs it (whole
  on every tensor-parallel rank of the last stage). The link is fitted to all-reduces each
  timed after a short sleep, as the paced layers issue them, per size the mean over rounds
  of the slowest rank (a step pays every call, the long ones too); ``--link fit``: the
  launching chapter's saved fit instead. The
  emulated device runs at the tiny model's one-thread rate (median of
  ``--rate-repeats`` steps, spread printed) / ``--slowdown``; the slow link moves a byte in
  the time of ``--flops-per-byte`` emulated FLOPs, so its weight against compute does not
  depend on this machine's speed. Prints "N of 6 within 15%" and "N of 15 pairs in order"
  for each link, and the load average. About a minute on a quiet machine; the only section
  that launches ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from parlib.cost import AXES, Hardware, Model, best_layouts
from parlib.cost.estimate import Estimate
from parlib.cost.hardware import GB
from parlib.cost.published import comparison_table
from parlib.cost.sweeps import ranking_table

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
    print(f"  predicted with matmuls at {hardware.compute_efficiency:.0%} of peak (the "
          f"{hardware.generation or 'given'} efficiency): a prediction, not a bound\n")
    print(layout_table(ranked))


def published_section(args: argparse.Namespace) -> None:
    print("\npublished runs: predicted (each GPU generation's efficiency) against reported "
          "(sources and assumptions: parlib/cost/published.py)\n")
    print(comparison_table())


def _load() -> str:
    """The machine's load average (1, 5, 15 minutes), or a note where it cannot be read."""
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def layouts_section(args: argparse.Namespace) -> None:
    import parlib
    from parlib import verify
    from parlib.experiments import layouts as L
    from parlib.measure.links import load_or_measure

    print(f"\nlayouts: {_load()}")
    if args.link == "paced":  # all-reduces timed as the paced layers issue them
        fit = L.paced_link_fit(parlib.launch, 4, timeout=300)
        source = (f"all-reduces each after a {L.PAUSE * 1e3:g} ms pause, as the layers issue "
                  f"them, mean of {L.PACED_ROUNDS} rounds (spread per size "
                  + ", ".join(f"{x:.0%}" for x in fit.spread) + ")")
    else:
        fit, source = load_or_measure(4, launch=parlib.launch)
    one_thread = L.measure_rate(repeats=args.rate_repeats)
    rate = one_thread.median / args.slowdown
    beta = L.slow_link_beta(rate, args.flops_per_byte)
    here = Hardware.measured_here(4, allreduce_fit=(fit.a, fit.b), fit_ranks=fit.n,
                                 flops_per_second=rate)
    print(f"4 ranks, link from {source} ({fit.backend}: alpha "
          f"{here.intra_node.alpha * 1e6:.0f} us, {here.intra_node.bandwidth / 1e9:.2f} GB/s)")
    print(f"compute rate of the tiny model's step: {one_thread.describe()}")
    print(f"emulated devices at that rate / {args.slowdown:g} = {rate / 1e9:.2f} GFLOP/s; "
          f"emulated slow link: a byte per {args.flops_per_byte:g} emulated FLOPs = "
          f"{beta * 1e9:.0f} ns per byte")
    reference = verify.reference_step()  # one device, the full batch of 8
    band = args.band
    for title, link in (("measured link", None),
                        (f"+ emulated {beta * 1e9:.0f} ns per byte (SlowLink)", (0.0, beta))):
        hardware = here.slowed_by(*link) if link else here
        predicted = L.predict(L.LAYOUTS, hardware)
        results = parlib.launch(L.rank_time_layouts, flops_per_second=rate, link=link,
                                reference=reference,
                                repeats=args.layout_repeats, world_size=4, timeout=600)
        rows = L.measured(results)
        agree = L.agreement(predicted, rows, band=band)
        print(f"\n{title}: every layout matches one device: {all(r['ok'] for r in rows)}; "
              f"overruns {sum(r['overruns'] for r in rows)} of "
              f"{sum(r['pieces'] for r in rows)} pieces; {_load()}\n")
        print(L.table(predicted, rows))
        print("\nwhere the step goes:")
        print(L.parts_table(predicted, rows))
        tp = [(r["layout"], r["parts"]["tp"] / e.time["tp_comm"]) for e, r in zip(predicted, rows)
              if e.time["tp_comm"] > 0]
        print("tensor-parallel all-reduces, measured / predicted: "
              + ", ".join(f"{name} {x:.2f}" for name, x in tp))
        sent = [sum(e.bytes_sent.values()) for e in predicted]
        fewest = min(range(len(sent)), key=sent.__getitem__)
        measured_order = L.rank_order([r["step_time"] for r in rows])
        print(f"\n{agree['within']} of {len(rows)} within {band:.0%}; {agree['pairs_same']} of "
              f"{agree['pairs']} pairs in order ({agree['separated_same']} of "
              f"{agree['separated']} pairs predicted > 10% apart); fastest predicted "
              f"{L.LAYOUTS[agree['best'][0]].layout}, measured "
              f"{L.LAYOUTS[agree['best'][1]].layout}; fewest bytes sent: "
              f"{L.LAYOUTS[fewest].layout}, measured place {measured_order.index(fewest) + 1} "
              f"of {len(rows)}")


def ranking_section(args: argparse.Namespace) -> None:
    print("\npublished sweeps: the model's ranking of each sweep's layouts against the "
          "measured one (sources: parlib/cost/sweeps.py)\n")
    print(ranking_table())


def foundry_section(args: argparse.Namespace) -> None:
    from parlib.cost.foundry import foundry_table, microbatch_table
    from parlib.cost.foundry_held_out import foundry_held_out_table
    from parlib.cost.foundry_reruns import rerun_table
    from parlib.cost.foundry_sequence import sequence_table
    print("\nllm-foundry's FSDP benchmarks, every model size x GPU count at sequence 2048: "
          "predicted against reported (sources: parlib/cost/foundry.py)\n")
    print(foundry_table())
    print("\nllm-foundry's own re-runs of the README's 8-GPU A100 40GB layouts on a later "
          "stack (torch2.md): how far one row moves, beside the model's ratio and trend "
          "(sources: parlib/cost/foundry_reruns.py)\n")
    print(rerun_table())
    print("\nllm-foundry's two other bf16 tables, in no fit (its runs on 128-512 H100s, its "
          "A100 80GB table): predicted against reported, the fall in MFU from 128 H100s to "
          "512, and the trend of every row together (sources: parlib/cost/foundry_held_out.py)"
          "\n")
    print(foundry_held_out_table())
    print("\nllm-foundry's sweeps of the sequence length (512-65,536 tokens, one node), in no "
          "fit: reported / predicted by attention's share of the FLOPs (sources: "
          "parlib/cost/foundry_sequence.py)\n")
    print(sequence_table())
    print("\nllm-foundry's microbatch sweep on one node of 8 A100 80GB, in no fit: predicted "
          "against reported; lean: measured / predicted step at the smallest microbatch over "
          "the same at the largest\n")
    print(microbatch_table())


def avoided_section(args: argparse.Namespace) -> None:
    from parlib.cost.avoided import PTDP_RUNS, ZERO3_RUNS, pairs_table
    from parlib.cost.published import comparison_table
    print("\na layout experts avoid, measured beside the one they chose: ZeRO-3 alone and "
          "PTD-P on the same GPUs (sources: parlib/cost/avoided.py)\n")
    print(comparison_table(ZERO3_RUNS + PTDP_RUNS))
    print()
    print(pairs_table())


def calibration_section(args: argparse.Namespace) -> None:
    from parlib.cost.calibration import held_out_table
    print("\neach generation's training shares, fitted to one set of published rows and held "
          "against the other (sources: parlib/cost/calibration.py)\n")
    print(held_out_table())


def heldout_section(args: argparse.Namespace) -> None:
    from parlib.cost.held_out import held_out_runs, memory_reading_table, memory_table
    from parlib.cost.published import comparison_table
    print("\nrows no fit has seen: torchtitan's Llama 2 runs on 64 A100s, whether each "
          "layout fits, and two measured peaks (sources: parlib/cost/held_out.py)\n")
    print(comparison_table(held_out_runs()))
    print()
    print(memory_table())
    print()
    print(memory_reading_table())


def network_section(args: argparse.Namespace) -> None:
    from parlib.cost.calibration import network_fit, network_table
    print("\nthe network each run implies, and whether one rate fits every table "
          "(sources: parlib/cost/calibration.py)\n")
    print(network_table())
    print(f"\n{'generation':<10} {'share':>6} {'matmul':>6} {'memory':>6} {'fit error':>9}")
    for gen in ("A100", "H100"):
        for share, f in network_fit(gen).items():
            print(f"{gen:<10} {share:>6.3g} {f.matmul:>6.2f} {f.memory:>6.2f} {f.error:>9.3f}")


def grid_section(args: argparse.Namespace) -> None:
    from parlib.cost.grid import grid_table, read_grid, score_grid
    if args.grid is None:
        raise SystemExit("the grid section scores a measured grid: pass --grid FILE.csv "
                         "(its columns: parlib/cost/grid.py)")
    print(f"\na measured grid against the model ({args.grid})\n")
    print(grid_table(score_grid(read_grid(args.grid))))


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "plan": plan_section,
    "published": published_section,
    "foundry": foundry_section,
    "ranking": ranking_section,
    "avoided": avoided_section,
    "calibration": calibration_section,
    "heldout": heldout_section,
    "network": network_section,
    "layouts": layouts_section,
    "grid": grid_section,
}
# what runs when --sections is not given: every section but the grid, which needs a file
DEFAULT_SECTIONS = [name for name in SECTIONS if name != "grid"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=DEFAULT_SECTIONS)
    ap.add_argument("--grid", default=None,
                    help="grid: a CSV of measured layouts (columns: parlib/cost/grid.py)")
    ap.add_argument("--repeats", type=int, default=5, help="planner searches to time")
    ap.add_argument("--global-batch", type=int, default=4096, help="sequences per step")
    ap.add_argument("--slowdown", type=float, default=16.0,
                    help="layouts: emulated device = one thread's rate / this")
    ap.add_argument("--flops-per-byte", type=float, default=800.0,
                    help="layouts: the emulated slow link moves a byte in the time of this "
                         "many emulated FLOPs")
    ap.add_argument("--rate-repeats", type=int, default=21,
                    help="layouts: timed steps of the one-thread compute rate")
    ap.add_argument("--band", type=float, default=0.15,
                    help="layouts: measured / predicted counts as agreeing within 1 +- this")
    ap.add_argument("--layout-repeats", type=int, default=5, help="layouts: timed steps")
    ap.add_argument("--link", choices=("fit", "paced"), default="paced",
                    help="layouts: predict with the launching chapter's link fit (or a quick "
                         "one), or with all-reduces timed each after a pause, as the layers "
                         "issue them")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in args.sections:
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
