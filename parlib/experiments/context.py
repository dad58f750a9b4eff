"""The context-parallel chapter's harnesses: functions to run on the ranks of one cp group
(``parlib.launch(fn, ..., world_size=cp)``), each returning plain numbers the notebook
prints, checks and plots.

- :func:`attention_check`: ring or all-gather attention against single-device attention,
  forward and backward, with the messages it sent (CommLog).
- :func:`emulated_imbalance`: the causal mask's work per rank, contiguous against zig-zag,
  on a real ring of exchanges with an **emulated** compute cost (a sleep proportional to
  each unmasked chunk pair's area), so it does not depend on how many cores there are.
- :func:`train_split_model`: the tiny model trained with its sequence split, for
  :func:`parlib.verify.reference_run` to compare against.
- :func:`saved_activations`: the bytes autograd keeps for backward per rank, at several s.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlib import comm
from parlib.measure import CommLog, SavedActivations
from parlib.model import ModelConfig, build_model, loss_fn, make_batch, make_optimizer
from parlib.runtime.policy import device as this_device
from parlib.strategies.context import (
    ATTENTIONS,
    average_gradients,
    context_parallel_copy,
    mean_over_group,
    ring_schedule,
    split_sequence,
)
from parlib.verify import compare


def _group(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


def attention_check(kind: str = "ring", *, causal: bool = True, layout: str = "zigzag",
                    b: int = 2, heads: int = 2, seq_len: int = 32, head_dim: int = 8,
                    seed: int = 0, group: Any = None) -> dict[str, Any]:
    """On each rank: ``kind`` attention ("ring" or "all_gather") of this rank's share of
    random q, k, v (b, heads, seq_len, head_dim) against the same positions of
    single-device attention, output and the gradients of q, k and v (``"check"``, a
    :func:`parlib.verify.compare` result), and every call it made, as (op, bytes,
    predicted bytes sent) in ``"forward"`` and ``"backward"``."""
    if kind not in ATTENTIONS:
        raise ValueError(f"kind must be one of {sorted(ATTENTIONS)}, got {kind!r}")
    group = _group(group)
    gen = torch.Generator().manual_seed(seed)  # the same tensors on every rank
    q, k, v, d_out = (torch.randn(b, heads, seq_len, head_dim, generator=gen)
                      for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=causal)
    want.backward(d_out)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return split_sequence(t, group, layout, dim=2)

    mine = [cut(t).requires_grad_() for t in (q, k, v)]
    with CommLog() as forward:
        got = ATTENTIONS[kind](*mine, group, causal=causal, layout=layout)
    with CommLog() as backward:
        got.backward(cut(d_out))
    names = ("output", "dq", "dk", "dv")
    check = compare(dict(zip(names, [got] + [t.grad for t in mine])),
                    dict(zip(names, [cut(want)] + [cut(t.grad) for t in full])))

    def calls(log: CommLog) -> list[tuple[str, int, float]]:
        return [(r.op, r.nbytes, r.predicted_sent) for r in log.records]

    return {"check": check, "forward": calls(forward), "backward": calls(backward)}


def emulated_imbalance(layout: str, *, seq_len: int = 64, pair_seconds: float = 0.01,
                       group: Any = None) -> dict[str, Any]:
    """One causal ring-attention forward with an emulated compute cost, on each rank.

    The ring's exchanges are real (K/V blocks sent on at every step, as
    :func:`parlib.strategies.context.ring_attention` does); the compute of each chunk pair
    the mask leaves (:func:`parlib.strategies.context.ring_schedule`) is replaced by a sleep
    of ``pair_seconds`` x its area in units of a zig-zag chunk pair ((s / 2cp)^2 scores):
    a contiguous pair counts 4. Returns this rank's ``"units"`` of work, ``"busy"`` (seconds
    of emulated compute) and ``"total"`` (seconds from the first step to the last exchange,
    waiting for slower ranks included)."""
    group = _group(group)
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    unit = seq_len // (2 * cp)  # a zig-zag chunk's positions
    schedule = ring_schedule(group, seq_len, layout, causal=True)
    block = torch.zeros(2, 1, 1, seq_len // cp, 4)  # a stand-in K/V block to pass on
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prev = dist.get_global_rank(group, (rank - 1) % cp)
    dist.barrier(group=group)
    start = time.perf_counter()
    busy = units = 0.0
    for step, pairs in enumerate(schedule):
        works, incoming = [], None
        if step < cp - 1:
            incoming = torch.empty_like(block)
            works = comm.exchange([(block, nxt)], [(incoming, prev)], group)
        area = sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in pairs)
        work = area / unit ** 2
        began = time.perf_counter()
        time.sleep(work * pair_seconds)  # emulated: the compute this step's pairs would take
        busy += time.perf_counter() - began
        units += work
        for w in works:
            w.wait()
        if incoming is not None:
            block = incoming
    total = time.perf_counter() - start
    return {"units": units, "busy": busy, "total": total}


def train_split_model(cfg: ModelConfig, *, steps: int = 3, batch: int = 4, lr: float = 0.1,
                      layout: str = "zigzag", attention: str = "ring", seed: int = 0,
                      group: Any = None) -> dict[str, Any]:
    """The tiny model trained with SGD for ``steps`` with its sequence split over
    ``group``: each rank's loss is the mean over its tokens, the reported loss the mean
    over all ranks' tokens, gradients averaged over the group before each step. Returns
    ``"losses"``, ``"grads"`` (per step, by name) and ``"params"``, as
    :func:`parlib.verify.reference_run` does for one device."""
    group = _group(group)
    dev = this_device()  # NCCL reduces only tensors on this rank's GPU
    model = context_parallel_copy(build_model(cfg, seed), group, layout, attention).to(dev)
    opt = make_optimizer(model.parameters(), "sgd", lr)
    losses, grads = [], []
    for step in range(steps):
        tokens, targets = (t.to(dev) for t in make_batch(batch, cfg, step, seed))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(split_sequence(tokens, group, layout)),
                       split_sequence(targets, group, layout))
        loss.backward()
        average_gradients(model, group)
        losses.append(float(mean_over_group(loss, group)))
        grads.append({n: p.grad.cpu().clone() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}}


def saved_activations(cfg: ModelConfig, seq_lens: list[int], *, batch: int = 1,
                      layout: str = "zigzag", attention: str = "ring", seed: int = 0,
                      group: Any = None) -> dict[int, int]:
    """For each s in ``seq_lens``: the bytes autograd saves for backward in one forward of
    the tiny model (``cfg`` with seq_len = s) on this rank's s/cp positions, the model's
    own parameters left out (:class:`parlib.measure.SavedActivations`)."""
    group = _group(group)
    out = {}
    for s in seq_lens:
        at_s = dataclasses.replace(cfg, seq_len=s)
        model = context_parallel_copy(build_model(at_s, seed), group, layout, attention)
        tokens, targets = make_batch(batch, at_s, 0, seed)
        with SavedActivations(model) as saved:
            loss = loss_fn(model(split_sequence(tokens, group, layout)),
                           split_sequence(targets, group, layout))
        out[s] = saved.nbytes
        loss.backward()
    return out


__all__ = ["attention_check", "emulated_imbalance", "saved_activations", "train_split_model"]
