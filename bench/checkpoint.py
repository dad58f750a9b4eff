"""Benchmark: a blocking DCP save against ``dcp.async_save`` of the course's sharded states, and
the bytes :func:`parlib.cost.checkpoint.checkpoint_bytes` predicts against those on disk.

    python bench/checkpoint.py                       # FSDP and Zero1 on 2 and 4 ranks
    python bench/checkpoint.py --ranks 2 --rounds 3 --strategies fsdp

For each strategy and rank count, after one AdamW step (so the optimizer state exists), in
rounds (median over rounds): a training step alone; a step plus a blocking
:func:`~parlib.strategies.checkpoint.save_checkpoint`; a step taken while
:func:`~parlib.strategies.checkpoint.async_save_checkpoint` writes in the background, plus the
time the async call itself blocks (staging the state into a copy). Saves run on a gloo group
of their own. Bytes: the checkpoint's total and the largest rank file, predicted and on disk
(DCP's files also hold a small header per tensor and the ``.metadata`` file; DCP spreads the
tensors held whole, Zero1's weights, over the ranks, so its largest file is under the
prediction for one rank writing them all). The staging copy, in memory until the write
ends: :func:`parlib.cost.checkpoint.staging_bytes` predicted per rank against the storage the
staged tensors hold on the busiest rank (``async_save_checkpoint(stats=...)``; the stager
copies padded pieces, up to one element per sharded tensor more).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parlib
from parlib.cost.checkpoint import checkpoint_bytes, staging_bytes
from parlib.measure.tables import Table, fmt_bytes
from parlib.model import ModelConfig, build_model, count_parameters, loss_fn, make_batch
from parlib.strategies.checkpoint import async_save_checkpoint, save_checkpoint
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP
from parlib.strategies.zero import Zero1

STRATEGIES = ("fsdp", "zero1")
ADAM = {"lr": 1e-3, "weight_decay": 0.1}


def _build(strategy: str, cfg: ModelConfig):
    model = build_model(cfg, seed=0)
    if strategy == "fsdp":
        net = FSDP(model)
        opt = torch.optim.AdamW(net.parameters(), **ADAM)
        return net, opt, len(list(net.parameters()))
    opt = Zero1(model.parameters(), torch.optim.AdamW, **ADAM)
    return model, opt, len(opt.shards)


def _train_step(net, opt, x, y) -> None:
    loss_fn(net(x), y).backward()
    if isinstance(net, FSDP):
        net.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad()


def _seconds(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sizes(path: str) -> tuple[int, int]:
    """(all files, the largest rank file) in bytes."""
    files = list(Path(path).iterdir())
    return (sum(f.stat().st_size for f in files),
            max(f.stat().st_size for f in files if f.suffix == ".distcp"))


def _rounds(strategy: str, cfg: ModelConfig, batch: int, rounds: int, folder: str) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    saves = dist.new_group(backend="gloo")  # the background save's collectives: apart
    net, opt, step_tensors = _build(strategy, cfg)
    x, y = (shard_rows(t, rank, n) for t in make_batch(batch, cfg, 0, 0))
    _train_step(net, opt, x, y)
    times: dict[str, list[float]] = {"step": [], "step + save": [], "step + async save": [],
                                     "async call": [], "save": []}
    for r in range(rounds):
        times["step"].append(_seconds(lambda: _train_step(net, opt, x, y)))
        path = f"{folder}/{strategy}-{n}-{r}"
        times["save"].append(_seconds(lambda: save_checkpoint(path, net, opt, group=saves)))
        times["step + save"].append(times["save"][-1] + _seconds(
            lambda: _train_step(net, opt, x, y)))
        future, staged = [], {}
        times["async call"].append(_seconds(lambda: future.append(async_save_checkpoint(
            f"{path}-async", net, opt, group=saves, stats=staged))))
        times["step + async save"].append(times["async call"][-1] + _seconds(
            lambda: _train_step(net, opt, x, y)))
        future[0].result()
    total, largest = _sizes(f"{folder}/{strategy}-{n}-0")
    params = count_parameters(build_model(cfg))
    predicted = checkpoint_bytes(params, strategy, {"dp": n}, step_tensors=step_tensors)
    busiest = torch.tensor([staged["staged_bytes"]])
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "disk": (total, largest), "predicted": (predicted.total, predicted.per_rank),
            "staging": (staging_bytes(params, strategy, {"dp": n}, step_tensors=step_tensors),
                        int(busiest.item()))}


def _run(strategies: list[str], cfg: ModelConfig, batch: int, rounds: int, folder: str):
    got = {s: _rounds(s, cfg, batch, rounds, folder) for s in strategies}
    return got if dist.get_rank() == 0 else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    ap.add_argument("--layers", type=int, default=ModelConfig.n_layers)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers)
    time_rows, byte_rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        for n in args.ranks:
            got = parlib.launch(_run, args.strategies, cfg, args.batch, args.rounds,
                                os.path.join(folder, str(n)), world_size=n, timeout=900)[0]
            for strategy, res in got.items():
                t = res["times"]
                time_rows.append([f"{strategy} x{n}", *(1e3 * t[k] for k in (
                    "step", "step + save", "step + async save", "async call")),
                    t["async call"] / t["save"]])
                (disk_total, disk_rank), (want_total, want_rank) = res["disk"], res["predicted"]
                staging_predicted, staged = res["staging"]
                byte_rows.append([f"{strategy} x{n}", fmt_bytes(want_total),
                                  fmt_bytes(disk_total), disk_total / want_total,
                                  fmt_bytes(want_rank), fmt_bytes(disk_rank),
                                  fmt_bytes(staging_predicted), fmt_bytes(staged),
                                  staged / staging_predicted])
    print(Table(["layout", "step ms", "+ save ms", "+ async save ms", "async call ms",
                 "async call / save"], time_rows,
                title="Step time with a checkpoint save, blocking vs async (median)"))
    print(Table(["layout", "total predicted", "on disk", "disk/predicted", "rank predicted",
                 "largest rank file", "staging predicted", "staged (busiest)",
                 "staged/predicted"], byte_rows,
                title="Checkpoint bytes: cost.checkpoint_bytes vs the files DCP wrote"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
