"""Benchmark: our ZeRO-3 step (parlib.strategies.fsdp.FSDP) against torch's FSDP2
(``torch.distributed.fsdp.fully_shard``), same model, same ranks, same data.

    python bench/fsdp.py                  # 2 and 4 ranks, CPU/gloo here; NCCL on GPUs
    python bench/fsdp.py --ranks 2 --rounds 6

Both are first checked against the single-device run (two Adam steps, the course tolerance).
Then steps/s of ours (without and with prefetch) and FSDP2's, interleaved in rounds in a
rotating order so that a noisy neighbour hits every one alike (median and IQR), bytes per step
measured with CommLog against :func:`parlib.cost.sharded.zero_sent_bytes_per_step` (ours:
asserted exact), and per-rank model-state bytes after a step (shards, gradients, optimizer
state; ours also the most gathered weights alive at once; the CUDA peak on a GPU; on the CPU
there is no allocator peak to read). Last line: ``ours vs FSDP2: R.RRx`` (ours without
prefetch, at the largest rank count run).
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.distributed as dist

import parlib
from parlib import measure, verify
from parlib.comm import quiet_renames
from parlib.cost.sharded import zero_sent_bytes_per_step
from parlib.measure.tables import Table, fmt_bytes
from parlib.model import ModelConfig, build_model, loss_fn, make_batch
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP

CFG = ModelConfig()
KINDS = ("ours", "ours+prefetch", "fsdp2")
ADAM = {"lr": 1e-3, "eps": 1e-4}  # eps: see tests/strategies/test_sharded.py


def _build(kind: str, dev: torch.device):
    model = build_model(CFG, seed=0).to(dev)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        net = fully_shard(model)
    else:
        net = FSDP(model, prefetch=kind == "ours+prefetch")
    return net, torch.optim.Adam(net.parameters(), **ADAM)


def _step(net, opt, x, y) -> None:
    loss_fn(net(x), y).backward()
    if isinstance(net, FSDP):
        net.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad()


def _full(net) -> dict[str, torch.Tensor]:
    if isinstance(net, FSDP):
        return net.gather_full_params()
    return {n: p.full_tensor().detach().cpu() for n, p in net.named_parameters()}


def _race(batch: int, rounds: int, steps_per_round: int):
    quiet_renames()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2's notice
    rank, n, dev = dist.get_rank(), dist.get_world_size(), parlib.device()
    ref = verify.reference_run(CFG, steps=2, batch=batch, device=dev,
                               optimizer=lambda ps: torch.optim.Adam(ps, **ADAM)).params
    nets = {k: _build(k, dev) for k in KINDS}
    gathered = {k: measure.GatheredWeights(net) for k, (net, _) in nets.items()
                if isinstance(net, FSDP)}  # ours: the full weights held, from outside
    sent, states = {}, {}
    for kind, (net, opt) in nets.items():
        for step in range(2):
            x, y = (shard_rows(t, rank, n).to(dev) for t in make_batch(batch, CFG, step, 0))
            with measure.CommLog() as log:
                _step(net, opt, x, y)
        cmp = verify.compare(_full(net), ref)
        if not cmp:
            raise AssertionError(f"{kind}: {cmp}")
        sent[kind] = log.predicted_sent()
        params = list(net.parameters())
        states[kind] = [measure.param_bytes(params), measure.optimizer_state_bytes(opt),
                        gathered[kind].peak if kind in gathered else None]
        if kind != "fsdp2":
            padded = sum(u.total * n for u in net.units)
            want = zero_sent_bytes_per_step(padded, n, 3)
            if sent[kind] != want:
                raise AssertionError(f"{kind}: sent {sent[kind]} bytes, formula {want}")
            sent["formula"] = want
    x, y = (shard_rows(t, rank, n).to(dev) for t in make_batch(batch, CFG, 0, 0))
    times = {k: [] for k in KINDS}
    order = list(KINDS)
    for _ in range(rounds):
        order = order[1:] + order[:1]
        for kind in order:
            net, opt = nets[kind]
            t = measure.time_it(lambda: _step(net, opt, x, y), repeats=steps_per_round,
                                warmup=1, device=dev, barrier=True)
            times[kind].extend(t.times)
    return (times, sent, states) if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    args = ap.parse_args()
    ratio = None
    for n in args.ranks:
        times, sent, states = parlib.launch(_race, args.batch, args.rounds, args.steps,
                                            world_size=n, timeout=900)[0]
        rows = []
        for kind in KINDS:
            med = statistics.median(times[kind])
            q1, _, q3 = statistics.quantiles(times[kind], n=4)
            shard, optim, gathered = states[kind]
            rows.append([kind, 1 / med, f"{1 / q3:.2f}-{1 / q1:.2f}", fmt_bytes(sent[kind]),
                         fmt_bytes(shard), fmt_bytes(optim), fmt_bytes(gathered)])
        print(Table(["", "steps/s", "IQR", "sent/step", "param shards", "Adam state",
                     "gathered peak"], rows,
                    title=f"{n} ranks, batch {args.batch}, formula {fmt_bytes(sent['formula'])}"
                          " sent/step (ZeRO-3)"))
        ratio = statistics.median(times["fsdp2"]) / statistics.median(times["ours"])
        ratio_p = statistics.median(times["fsdp2"]) / statistics.median(times["ours+prefetch"])
        print(f"{n} ranks: ours {ratio:.2f}x, ours+prefetch {ratio_p:.2f}x FSDP2's steps/s\n")
    print(f"ours vs FSDP2: {ratio:.2f}x")


if __name__ == "__main__":
    main()
