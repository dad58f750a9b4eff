"""Benchmark: our ZeRO-3 step (parlib.strategies.fsdp.FSDP) against torch's FSDP2
(``torch.distributed.fsdp.fully_shard``), same model, same ranks, same data.

    python bench/fsdp.py                  # 2 and 4 ranks, CPU/gloo here; NCCL on GPUs
    python bench/fsdp.py --ranks 2 --rounds 6
    python bench/fsdp.py --ranks --hsdp 2x2   # only HSDP: 4 ranks, 2 copies x 2 shards

Both are first checked against the single-device run (two Adam steps, the course tolerance).
Then steps/s of ours (without and with prefetch) and FSDP2's, interleaved in rounds in a
rotating order so that a noisy neighbour hits every one alike (median and IQR), bytes per step
measured with CommLog against :func:`parlib.cost.sharded.zero_sent_bytes_per_step` (ours:
asserted exact), and per-rank model-state bytes after a step (shards, gradients, optimizer
state; ours also the most gathered weights alive at once; the CUDA peak on a GPU; on the CPU
there is no allocator peak to read). Last line: ``ours vs FSDP2: R.RRx`` (ours without
prefetch, at the largest rank count run).

``--hsdp RxS`` (default 2x2; ``none`` skips it) races HSDP too: ours, ``FSDP(model,
group=shard_group, replicate_group=copies)``, against FSDP2's ``fully_shard(..., mesh=mesh)``
on the same DeviceMesh ("replicate", "shard"), both checked against one device first; the
bytes sent on each axis (``dp_shard``, ``dp_replicate``) measured and, for ours, asserted
equal to :func:`parlib.cost.sharded.hsdp_sent_bytes_per_step`. Its line: ``HSDP RxS: ours vs
FSDP2: R.RRx (steps/s; FSDP2's median step time / ours)``.
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
from parlib.cost.sharded import hsdp_sent_bytes_per_step, zero_sent_bytes_per_step
from parlib.measure.tables import Table, fmt_bytes
from parlib.measure.traffic import axis_traffic
from parlib.model import ModelConfig, build_model, loss_fn, make_batch
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP

CFG = ModelConfig()
KINDS = ("ours", "ours+prefetch", "fsdp2")
HSDP_KINDS = ("ours", "fsdp2")
ADAM = {"lr": 1e-3, "eps": 1e-4}  # eps: see tests/strategies/test_sharded.py


def _build(kind: str, dev: torch.device, mesh=None):
    """``mesh``: None (every rank one shard group) or a 2-D DeviceMesh ("replicate",
    "shard"), HSDP: FSDP2 takes the mesh, ours its two groups."""
    model = build_model(CFG, seed=0).to(dev)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    elif mesh is None:
        net = FSDP(model, prefetch=kind == "ours+prefetch")
    else:
        net = FSDP(model, group=mesh.get_group("shard"),
                   replicate_group=mesh.get_group("replicate"))
    return net, torch.optim.Adam(net.parameters(), **ADAM)


def _axes(mesh) -> dict:
    """The groups whose traffic is counted apart."""
    if mesh is None:
        return {"dp": None}
    return {"dp_shard": mesh.get_group("shard"), "dp_replicate": mesh.get_group("replicate")}


def _formula(net: FSDP, mesh) -> dict[str, float]:
    """Ours: the bytes per axis the cost model predicts for the padded shards."""
    padded = sum(u.total for u in net.units) * net.world_size
    if mesh is None:
        return {"dp": zero_sent_bytes_per_step(padded, net.world_size, 3)}
    return hsdp_sent_bytes_per_step(padded, net.world_size, net.replicas)


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


def _race(batch: int, rounds: int, steps_per_round: int, hsdp: tuple[int, int] | None = None):
    quiet_renames()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2's notice
    rank, n, dev = dist.get_rank(), dist.get_world_size(), parlib.device()
    ref = verify.reference_run(CFG, steps=2, batch=batch, device=dev,
                               optimizer=lambda ps: torch.optim.Adam(ps, **ADAM)).params
    mesh = None
    if hsdp is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, hsdp, mesh_dim_names=("replicate", "shard"))
    kinds = KINDS if mesh is None else HSDP_KINDS
    nets = {k: _build(k, dev, mesh) for k in kinds}
    gathered = {k: measure.GatheredWeights(net) for k, (net, _) in nets.items()
                if isinstance(net, FSDP)}  # ours: the full weights held, from outside
    sent, states = {}, {}
    for kind, (net, opt) in nets.items():
        for step in range(2):
            x, y = (shard_rows(t, rank, n).to(dev) for t in make_batch(batch, CFG, step, 0))
            with measure.CommLog() as log, axis_traffic(_axes(mesh)) as counts:
                _step(net, opt, x, y)
        cmp = verify.compare(_full(net), ref)
        if not cmp:
            raise AssertionError(f"{kind}: {cmp}")
        sent[kind] = log.predicted_sent()
        sent[kind, "axes"] = {axis: c["sent_bytes"] for axis, c in counts.items()}
        params = list(net.parameters())
        states[kind] = [measure.param_bytes(params), measure.optimizer_state_bytes(opt),
                        gathered[kind].peak if kind in gathered else None]
        if kind != "fsdp2":
            want = _formula(net, mesh)
            if sent[kind, "axes"] != want:
                raise AssertionError(f"{kind}: sent {sent[kind, 'axes']} bytes, formula {want}")
            sent["formula"] = sum(want.values())
            sent["formula", "axes"] = want
    x, y = (shard_rows(t, rank, n).to(dev) for t in make_batch(batch, CFG, 0, 0))
    times = {k: [] for k in kinds}
    order = list(kinds)
    for _ in range(rounds):
        order = order[1:] + order[:1]
        for kind in order:
            net, opt = nets[kind]
            t = measure.time_it(lambda: _step(net, opt, x, y), repeats=steps_per_round,
                                warmup=1, device=dev, barrier=True)
            times[kind].extend(t.times)
    return (times, sent, states) if rank == 0 else None


def _table(title: str, times: dict, sent: dict, states: dict) -> Table:
    rows = []
    for kind in times:
        med = statistics.median(times[kind])
        q1, _, q3 = statistics.quantiles(times[kind], n=4)
        shard, optim, gathered = states[kind]
        by_axis = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in sent[kind, "axes"].items())
        rows.append([kind, 1 / med, f"{1 / q3:.2f}-{1 / q1:.2f}", by_axis,
                     fmt_bytes(shard), fmt_bytes(optim), fmt_bytes(gathered)])
    return Table(["", "steps/s", "IQR", "sent/step by axis", "param shards", "Adam state",
                  "gathered peak"], rows, title=title)


def _ratios(times: dict, kind: str, steps_per_round: int) -> list[float]:
    """FSDP2's median step time / ``kind``'s, round by round (the two ran back to back)."""
    def rounds(k: str) -> list[list[float]]:
        return [times[k][i:i + steps_per_round] for i in range(0, len(times[k]),
                                                               steps_per_round)]
    return [statistics.median(theirs) / statistics.median(ours)
            for ours, theirs in zip(rounds(kind), rounds("fsdp2"))]


def _mesh_shape(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    replicas, _, shards = text.partition("x")
    return int(replicas), int(shards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--hsdp", type=_mesh_shape, default=(2, 2),
                    help="RxS: also race HSDP, R copies x S shards (none: skip)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    args = ap.parse_args()
    ratio = None
    for n in args.ranks:
        times, sent, states = parlib.launch(_race, args.batch, args.rounds, args.steps,
                                            world_size=n, timeout=900)[0]
        print(_table(f"{n} ranks, batch {args.batch}, formula {fmt_bytes(sent['formula'])}"
                     " sent/step (ZeRO-3)", times, sent, states))
        ratio = statistics.median(times["fsdp2"]) / statistics.median(times["ours"])
        ratio_p = statistics.median(times["fsdp2"]) / statistics.median(times["ours+prefetch"])
        print(f"{n} ranks: ours {ratio:.2f}x, ours+prefetch {ratio_p:.2f}x FSDP2's steps/s\n")
    if args.hsdp is not None:
        r, s = args.hsdp
        times, sent, states = parlib.launch(_race, args.batch, args.rounds, args.steps,
                                            args.hsdp, world_size=r * s, timeout=900)[0]
        want = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in sent["formula", "axes"].items())
        print(_table(f"HSDP {r} x {s} ({r} copies, each sharded {s} ways), batch "
                     f"{args.batch}, formula {want} sent/step", times, sent, states))
        per_round = _ratios(times, "ours", args.steps)
        hsdp_ratio = statistics.median(times["fsdp2"]) / statistics.median(times["ours"])
        print(f"HSDP {r}x{s}: ours vs FSDP2: {hsdp_ratio:.2f}x (steps/s; FSDP2's median step "
              f"time / ours; per round {min(per_round):.2f}-{max(per_round):.2f}, "
              f"{len(per_round)} rounds)")
    if ratio is not None:
        print(f"ours vs FSDP2: {ratio:.2f}x")


if __name__ == "__main__":
    main()
