"""Benchmark: an MoE layer with expert parallelism vs the same experts replicated on every rank.

    python bench/ep.py                         # ep = 2 and 4, CPU/gloo
    python bench/ep.py --ep 2 --tokens 1024 --repeats 5

Every rank holds its own tokens. Expert parallelism: each rank holds E/ep experts and
sends each token's choices to their experts' ranks and back (all_to_all_single).
Replicated: every rank holds all E experts and runs them in a plain loop on its own
tokens, no communication. Both are first checked against each other (outputs, input
gradients, every parameter gradient summed over the ranks, parlib.verify.compare, in fp64). Then
one forward + backward is timed (median of ``--repeats``, the slowest rank), the token
all-to-all bytes are recorded with CommLog and put next to the formula (summed over the
ranks), and the imbalance is the busiest rank's computed choices over the mean.
Last line: ``ep all-to-all bytes / formula: R.RR`` (measured / formula, all runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import parlib
from parlib import measure
from parlib.comm import quiet_renames
from parlib.cost.experts import ep_all_to_all_bytes_per_layer, load_imbalance
from parlib.experiments.experts import RoutingRecorder
from parlib.measure.tables import fmt_bytes
from parlib.model import ModelConfig, MoE
from parlib.strategies.experts import ExpertParallelMoE
from parlib.verify import compare


def _fwd_bwd(layer, x, g):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    (layer(x) * g).sum().backward()


def _gathered(value):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _layers(cfg, dtype=torch.float32):
    """(every expert on this rank, this rank's experts of the EP layer): the same weights."""
    torch.manual_seed(0)
    replicated = MoE(cfg).to(dtype)
    torch.manual_seed(0)
    return replicated, ExpertParallelMoE.from_moe(MoE(cfg).to(dtype), dist.group.WORLD)


def _check(cfg, x, g):
    """The same outputs, input gradients and every parameter's gradient, in fp64: the two
    sum the experts' gradients in different orders (over ranks, or in one matmul), and over
    hundreds of tokens fp32 rounding alone reaches the tolerance."""
    replicated, ep_layer = _layers(cfg, torch.float64)
    x = x.detach().double().requires_grad_()
    g = g.double()
    want = replicated(x)
    (want * g).sum().backward()
    want_dx = x.grad.clone()
    x.grad = None
    got = ep_layer(x)
    (got * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in replicated.named_parameters()}
    for t in grads.values():  # the replicated experts saw only this rank's tokens
        dist.all_reduce(t)
    dist.all_reduce(ep_layer.router.weight.grad)
    ok = compare([got, x.grad], [want, want_dx])
    ok_grads = compare({n: p.grad for n, p in ep_layer.named_parameters()},
                       {n: grads[n] for n, _ in ep_layer.named_parameters()})
    if not (ok and ok_grads):
        raise AssertionError(f"rank {dist.get_rank()}: EP differs from the replicated "
                             f"experts: {ok}; {ok_grads}")


def _race(cfg, tokens, repeats):
    quiet_renames()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    replicated, ep_layer = _layers(cfg)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, cfg.d_model, generator=gen).requires_grad_()
    g = torch.randn(tokens, cfg.d_model, generator=gen)
    _check(cfg, x, g)
    seen = RoutingRecorder(ep_layer)  # the routing, observed from outside
    with measure.CommLog() as log:
        _fwd_bwd(ep_layer, x, g)
    seen.remove()
    records = [r for r in log.records if r.op == "all_to_all"]
    token_bytes = sum(r.nbytes for r in records[1:])  # the first: the counts
    dropped = int((~seen.last.keep).sum())
    formula = ep_all_to_all_bytes_per_layer(tokens, cfg.d_model, cfg.top_k, dropped=dropped)
    computed = records[2].nbytes // (cfg.d_model * 4)  # the combine: the rows computed here
    row = {}
    for name, layer in (("ep", ep_layer), ("replicated", replicated)):
        timing = measure.time_it(lambda layer=layer: _fwd_bwd(layer, x, g), repeats=repeats,
                                 warmup=1, barrier=True)
        row[name] = max(_gathered(statistics.median(timing.times)))
    row["bytes"] = sum(_gathered(token_bytes))
    row["formula"] = sum(_gathered(formula))
    row["imbalance"] = load_imbalance(_gathered(computed))
    return row if rank == 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="expert-parallel ranks")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64, help="h")
    ap.add_argument("--expert-hidden", type=int, default=256, help="f")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    cfg = ModelConfig(d_model=args.hidden, n_heads=1, n_experts=args.experts,
                      top_k=args.top_k, expert_hidden=args.expert_hidden)
    t0 = time.perf_counter()
    print(f"MoE layer, E={args.experts}, k={args.top_k}, h={args.hidden}, "
          f"f={args.expert_hidden}, {args.tokens} tokens per rank, fp32, no capacity limit; "
          "time = forward + backward, the slowest rank; bytes = token all-to-all inputs, "
          "all ranks (formula in brackets); imbalance = busiest rank's choices / mean")
    print(f"{'ep':>3} {'replicated':>11} {'EP':>9} {'EP/rep':>7} {'bytes':>21} "
          f"{'imbalance':>9}")
    measured = formula = 0
    for ep in args.ep:
        row = parlib.launch(_race, cfg, args.tokens, args.repeats, world_size=ep,
                            timeout=1800)[0]
        measured, formula = measured + row["bytes"], formula + row["formula"]
        print(f"{ep:>3} {row['replicated'] * 1e3:>9.1f}ms {row['ep'] * 1e3:>7.1f}ms "
              f"{row['ep'] / row['replicated']:>7.2f} {fmt_bytes(row['bytes']):>9} "
              f"({fmt_bytes(row['formula'])}) {row['imbalance']:>9.2f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"ep all-to-all bytes / formula: {measured / formula:.2f}")


if __name__ == "__main__":
    main()
