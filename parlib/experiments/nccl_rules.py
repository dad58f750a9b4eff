"""The strategies' point-to-point code under NCCL's rules, against one device.

:func:`rank_nccl_rules` runs on every rank of ``parlib.launch``: inside
:func:`parlib.comm.nccl_rules` (tags dropped, an unbatched send and receive to one peer
refused) it runs one step of each pipeline schedule (GPipe, 1F1B, interleaved with v = 2,
ZB-H1), ring attention in both layouts (forward and backward) and the experts' all-to-all
training step, each compared with the single-device reference, and, on NCCL, a batch of
two messages a rank sends itself, received in the order sent (NCCL matches by order; gloo
cannot send to its own rank). ``bench/gpu.py`` runs it on one GPU with NCCL, the real
backend as far as one device can check it, and on gloo ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parlib import comm, verify
from parlib.experiments.context import attention_check
from parlib.experiments.experts import train_expert_parallel
from parlib.experiments.pipeline import rank_step
from parlib.model import ModelConfig
from parlib.runtime.policy import device as this_device
from parlib.strategies.context import LAYOUTS

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _verdict(result: Any, what: str) -> str:
    return "ok" if result else f"FAIL: {what}: {result}"


def _pipeline(cfg: ModelConfig, name: str, m: int, batch: int) -> str:
    got = rank_step(cfg, schedule_name=name, m=m, batch_size=batch, warmup=0)
    ref = verify.reference_step(cfg, batch_size=batch)
    grads = {n: g.cpu() for n, g in got["grads"].items()}
    if got["loss"] is not None and abs(got["loss"] - ref["loss"]) > 1e-5 * abs(ref["loss"]):
        return f"FAIL: loss {got['loss']} against one device's {ref['loss']}"
    return _verdict(verify.compare(grads, {n: ref["grads"][n] for n in grads}), "gradients")


def _experts(cfg: ModelConfig, batch: int) -> str:
    got = train_expert_parallel(cfg, dist.get_world_size(), steps=1, batch=batch)
    ref = verify.reference_run(cfg, steps=1, batch=batch)
    grads = got["grads"][0]
    return _verdict(verify.compare(grads, {n: ref.grads[0][n] for n in grads}), "gradients")


def _exchange_to_self() -> str:
    """Two messages of different sizes to this rank in one batch: received in order."""
    if dist.get_backend() != "nccl":
        return "skipped: gloo cannot send to its own rank"
    dev, me = this_device(), dist.get_rank()
    first, second = torch.arange(3.0, device=dev), torch.arange(5.0, device=dev) + 10
    got = [torch.empty(3, device=dev), torch.empty(5, device=dev)]
    for work in comm.exchange([(first, me), (second, me)], [(got[0], me), (got[1], me)]):
        work.wait()
    return _verdict(verify.compare([t.cpu() for t in got], [first.cpu(), second.cpu()]),
                    "the messages to itself")


def rank_nccl_rules(cfg: ModelConfig, moe_cfg: ModelConfig, *, m: int = 2,
                    batch: int = 8) -> dict[str, str]:
    """On every rank, inside :func:`parlib.comm.nccl_rules`: each check's verdict, "ok",
    "skipped: why" or "FAIL: what differed" (an error raised inside one is its verdict).
    ``cfg``: the pipeline's model (its blocks must split into 2 x world chunks for the
    interleaved schedule); ``moe_cfg``: the experts' (n_experts a multiple of the world)."""
    checks: dict[str, Callable[[], str]] = {
        f"pipeline {name}": (lambda name=name: _pipeline(cfg, name, m, batch))
        for name in SCHEDULES}
    for layout in LAYOUTS:
        checks[f"ring {layout}"] = lambda layout=layout: _verdict(
            attention_check("ring", layout=layout)["check"], "output or gradients")
    checks["experts all-to-all"] = lambda: _experts(moe_cfg, batch // 2)
    checks["exchange to self"] = _exchange_to_self
    out = {}
    with comm.nccl_rules():
        for name, check in checks.items():
            try:
                out[name] = check()
            except Exception as err:  # noqa: BLE001 (every check reports, none stops the rest)
                out[name] = f"FAIL: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return out


__all__ = ["SCHEDULES", "rank_nccl_rules"]
