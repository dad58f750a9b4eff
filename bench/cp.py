"""Benchmark: ring attention vs all-gather attention vs single-device attention.

    python bench/cp.py                        # cp = 2 and 4, s = 256, 1024, 2048, CPU/gloo
    python bench/cp.py --cp 2 --seq 512 4096 --repeats 5

Causal attention (b, a, s, d) with the sequence split over cp ranks (zig-zag layout).
Each variant is first checked against single-device attention (output and the three
input gradients, parlib.verify.compare). Then one forward + backward is timed (median of
``--repeats``, the slowest rank's), the bytes autograd saves for backward are measured per
rank (parlib.measure.SavedActivations), and the bytes one rank sends are recorded with
CommLog and put next to the formula. Single-device attention runs on rank 0 alone.
Last line: ``ring vs all-gather: R.RRx`` (all-gather time / ring time at the largest s and
cp; above 1 means the ring is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlib
from parlib import measure
from parlib.comm import quiet_renames
from parlib.cost.context import (
    LSE_BYTES,
    all_gather_kv_sent_bytes_per_layer,
    ring_attention_sent_bytes_per_layer,
)
from parlib.measure.tables import fmt_bytes
from parlib.strategies.context import all_gather_attention, ring_attention, split_sequence
from parlib.verify import compare

KINDS = {"ring": ring_attention, "all_gather": all_gather_attention}
FORMULA = {"ring": ring_attention_sent_bytes_per_layer,
           "all_gather": all_gather_kv_sent_bytes_per_layer}
LAYOUT = "zigzag"


def _fwd_bwd(fn, tensors, d_out):
    for t in tensors:
        t.grad = None
    fn(*tensors).backward(d_out)


def _slowest(seconds: float) -> float:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, seconds)
    return max(every)


def _race(sizes, b, heads, d, repeats):
    """On each rank, for each s: check, time, measure memory and bytes of both variants."""
    quiet_renames()
    torch.set_num_threads(1)
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    rows = []
    for s in sizes:
        gen = torch.Generator().manual_seed(s)
        q, k, v, d_out = (torch.randn(b, heads, s, d, generator=gen) for _ in range(4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, is_causal=True)
        want.backward(d_out)
        mine_out = split_sequence(d_out, group, LAYOUT, dim=2)
        row = {"s": s}
        for kind, attend in KINDS.items():
            mine = [split_sequence(t, group, LAYOUT, dim=2).requires_grad_() for t in (q, k, v)]

            def fn(*qkv, attend=attend):
                return attend(*qkv, group, causal=True, layout=LAYOUT)

            got = fn(*mine)
            got.backward(mine_out)
            ok = compare([got] + [t.grad for t in mine],
                         [split_sequence(t, group, LAYOUT, dim=2)
                          for t in [want] + [t.grad for t in full]])
            if not ok:
                raise AssertionError(f"{kind} at s={s}: {ok}")
            with measure.SavedActivations() as saved:
                out = fn(*mine)
            del out
            with measure.CommLog() as log:
                _fwd_bwd(fn, mine, mine_out)
            sent = sum(r.nbytes if r.op == "send" else (r.predicted_sent or 0)
                       for r in log.records if r.op != "recv")
            timing = measure.time_it(lambda: _fwd_bwd(fn, mine, mine_out), repeats=repeats,
                                     warmup=1, barrier=True)
            row[kind] = {"seconds": _slowest(statistics.median(timing.times)),
                         "saved": saved.nbytes, "sent": sent,
                         "formula": FORMULA[kind](b, s, heads * d, cp)}
        dist.barrier()
        if rank == 0:
            single = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            timing = measure.time_it(
                lambda: _fwd_bwd(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True),
                                 single, d_out), repeats=repeats, warmup=1)
            row["single"] = statistics.median(timing.times)
        dist.barrier()
        rows.append(row)
    return rows if rank == 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="context-parallel ranks")
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048],
                    help="sequence lengths s (divisible by 2 x cp)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"causal attention, b={args.batch}, a={args.heads}, d={args.head_dim}, fp32, "
          f"{LAYOUT} layout; time = forward + backward, the slowest rank; saved = bytes kept "
          f"for backward on one rank; sent = bytes one rank sends (formula in brackets)")
    print(f"{'cp':>3} {'s':>6} {'single':>9} {'ring':>9} {'all-gather':>10} "
          f"{'ring saved':>11} {'a-g saved':>10} {'ring sent':>20} {'a-g sent':>20}")
    last = None
    for cp in args.cp:
        rows = parlib.launch(_race, args.seq, args.batch, args.heads, args.head_dim,
                             args.repeats, world_size=cp, timeout=1800)[0]
        for row in rows:
            ring, gather = row["ring"], row["all_gather"]
            for kind in (ring, gather):
                assert kind["sent"] == kind["formula"], f"bytes differ from the formula: {kind}"
            print(f"{cp:>3} {row['s']:>6} {row['single'] * 1e3:>7.1f}ms "
                  f"{ring['seconds'] * 1e3:>7.1f}ms {gather['seconds'] * 1e3:>8.1f}ms "
                  f"{fmt_bytes(ring['saved']):>11} {fmt_bytes(gather['saved']):>10} "
                  f"{fmt_bytes(ring['sent']):>9} ({fmt_bytes(ring['formula'])}) "
                  f"{fmt_bytes(gather['sent']):>9} ({fmt_bytes(gather['formula'])})")
            local = row["s"] // cp
            ring_saved = (4 * args.batch * args.heads * local * args.head_dim * 4
                          + args.batch * args.heads * local * LSE_BYTES)
            if ring["saved"] != ring_saved:
                print(f"    ring saved {ring['saved']} B, expected q, k, v, out, lse = "
                      f"{ring_saved} B")
            last = gather["seconds"] / ring["seconds"]
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"ring vs all-gather: {last:.2f}x")


if __name__ == "__main__":
    main()
