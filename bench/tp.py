"""Benchmark: our tensor-parallel step against torch's parallelize_module (DTensor), t = 2.

    python bench/tp.py                 # 2 ranks, CPU/gloo here; NCCL on GPUs
    python bench/tp.py --rounds 8 --batch 16

Both copies are cut from the same TinyGPT: attention q, k, v column-parallel and out
row-parallel, MLP up column-parallel and down row-parallel; torch's with ColwiseParallel /
RowwiseParallel on a 1-D DeviceMesh. Each is first checked against the single-device run
(logits, loss and parameters after two SGD steps). Then training steps are timed in
interleaved rounds (so a noisy neighbour hits both alike) and the bytes one rank sends per
layer are recorded with CommLog and put next to the formula. Last line:
``ours vs DTensor: R.RRx`` (steps/s ratio; above 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import parlib
from parlib import measure, verify
from parlib.comm import quiet_renames
from parlib.cost.tensor import tp_message_bytes, tp_sent_bytes_per_layer
from parlib.model import ModelConfig, build_model, loss_fn, make_batch
from parlib.plots import run_label
from parlib.strategies.tensor import (
    local_shards,
    tensor_parallel_copy,
    torch_tensor_parallel,
)

KINDS = ("ours", "dtensor")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(model, opt, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    loss_fn(logits, y).backward()
    opt.step()
    return logits


def _race(cfg, batch, rounds, steps_per_round, lr=0.1):
    """On each rank: check both copies against single-device, time them in rounds, and
    record one step of ours with CommLog."""
    from torch.distributed.device_mesh import init_device_mesh

    quiet_renames()
    torch.set_num_threads(1)
    dev = parlib.device()
    t = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (t,))
    models = {"ours": tensor_parallel_copy(build_model(cfg).to(dev)),
              "dtensor": torch_tensor_parallel(build_model(cfg).to(dev), mesh)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=lr) for k, m in models.items()}

    # single-device reference: logits of step 0, parameters after two steps
    ref = verify.reference_run(cfg, steps=2, batch=batch, lr=lr, device=dev, record=("logits",))
    batches = [tuple(a.to(dev) for a in make_batch(batch, cfg, s)) for s in range(2)]
    errors = {}
    for k, model in models.items():
        logits = [_step(model, opts[k], x, y).detach() for x, y in batches][0]
        params = {n: _full(p.detach()) for n, p in model.named_parameters()}
        want = local_shards(model, ref.params) if k == "ours" else ref.params
        verdict = verify.compare({"logits": _full(logits), **params},
                                 {"logits": ref.logits[0], **want})
        if not verdict.ok:
            raise AssertionError(f"{k}: differs from single-device: {verdict}")
        errors[k] = verdict.worst

    x, y = batches[0]
    times = {k: [] for k in KINDS}
    for r in range(rounds):
        order = KINDS if r % 2 == 0 else KINDS[::-1]
        for k in order:
            timing = measure.time_it(lambda: _step(models[k], opts[k], x, y),
                                     repeats=steps_per_round, warmup=1, device=dev,
                                     barrier=True)
            times[k].extend(timing.times)

    wire = {}
    for k in KINDS:  # the socket bytes see DTensor's collectives too (gloo: TCP)
        with measure.CommLog() as log:
            _step(models[k], opts[k], x, y)
        wire[k] = log.wire_bytes
        if k == "ours":
            records = [(r.op, r.nbytes, r.predicted_sent) for r in log.records]
    med = {k: statistics.median(v) for k, v in times.items()}
    if dist.get_rank() != 0:
        return None
    return med, errors, records, wire, dist.get_backend(), str(dev)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=2, help="tensor-parallel degree (ranks)")
    ap.add_argument("--batch", type=int, default=8, help="batch b (every rank sees all of it)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per copy per round")
    args = ap.parse_args(argv)
    cfg = ModelConfig()
    t0 = time.perf_counter()
    med, errors, records, wire, backend, device = parlib.launch(
        _race, cfg, args.batch, args.rounds, args.steps, world_size=args.t, timeout=900)[0]
    label = run_label(args.t, device, backend)
    rows = [[k, 1.0 / med[k], med[k] * 1e3, med["dtensor"] / med[k], errors[k]]
            for k in KINDS]
    print(measure.Table(
        ["copy", "steps/s", "ms/step", "x DTensor", "max abs err vs 1 device"], rows,
        title=f"Tensor-parallel training steps, b={args.batch}, s={cfg.seq_len}, "
              f"h={cfg.d_model}, L={cfg.n_layers} ({label}); checked first"))

    b, s, h, L = args.batch, cfg.seq_len, cfg.d_model, cfg.n_layers
    sent = sum(p for _, _, p in records)
    formula = tp_sent_bytes_per_layer(b, s, h, args.t)
    ops = sorted({op for op, _, _ in records})
    sizes = sorted({n for _, n, _ in records})
    wire_ours = f"{wire['ours'] / L:,.0f}" if wire["ours"] else "-"
    wire_dt = f"{wire['dtensor'] / L:,.0f}" if wire["dtensor"] else "-"
    print(measure.Table(
        ["per layer per step", "value"],
        [["all-reduce calls (ours, CommLog)", f"{len(records) / L:g}"],
         ["message bytes (CommLog)", ", ".join(f"{n:,}" for n in sizes)],
         ["message bytes (formula b*s*h*4)", f"{tp_message_bytes(b, s, h):,}"],
         ["ring bytes sent (CommLog records)", f"{sent / L:,.0f}"],
         ["ring bytes sent (formula)", f"{formula:,.0f}"],
         ["written to sockets, ours", wire_ours],
         ["written to sockets, DTensor", wire_dt]],
        title=f"What one rank sends per layer, ops {ops}"))
    if sent / L != formula:
        raise SystemExit(f"measured {sent / L} bytes per layer, formula {formula}")
    print(f"bytes per layer equal the formula exactly ({formula:.0f} B); "
          f"bench wall time {time.perf_counter() - t0:.1f} s")
    print(f"ours vs DTensor: {med['dtensor'] / med['ours']:.2f}x")


if __name__ == "__main__":
    main()
