"""The expert-parallel chapter's harnesses: functions to run on the ranks
(``parlib.launch(fn, ..., world_size=ep)``), each returning plain numbers the notebook
prints, checks and plots, and two single-device ones.

- :func:`layer_traffic`: one MoE layer with its experts split over the ranks, forward and
  backward on this rank's tokens, at several capacity factors: the check against the
  single-device layer, every all-to-all (CommLog), the load per expert and the drops.
- :func:`emulated_step`: the busiest rank against the mean, with the dispatch real and the
  experts' compute **emulated** (a sleep proportional to the rows each rank computes).
- :func:`train_expert_parallel`: the tiny MoE model trained with EP (x DP when the world
  is bigger than ep), for :func:`parlib.verify.reference_run` to compare against.
- :func:`dense_moe_output`: every expert on every token, weighted by the router's gate
  (the single-device computation torch 2.13 has no MoE layer for).
- :func:`grouped_moe_output`: the experts as PyTorch's grouped matmul
  (``torch.nn.functional.grouped_mm``), the kernel MoE layers are built on.
- :func:`router_balance`: the tiny MoE model trained on one device with and without the
  load-balancing loss, the imbalance of its routing at every step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlib.cost.experts import load_imbalance
from parlib.measure import CommLog
from parlib.model import (
    ModelConfig,
    MoE,
    Routing,
    build_model,
    loss_fn,
    make_batch,
    make_optimizer,
    route,
)
from parlib.runtime.policy import device as this_device
from parlib.strategies.experts import (
    ExpertParallelMoE,
    aux_loss,
    dispatch_plan,
    expert_parallel_copy,
    split_rows,
    sync_gradients,
)
from parlib.strategies.mesh import Mesh
from parlib.verify import compare


class RoutingRecorder:
    """The routing an MoE layer (:class:`parlib.model.MoE` or
    :class:`~parlib.strategies.experts.ExpertParallelMoE`) used on its last forward,
    observed from outside: a forward pre-hook routes the same tokens with the layer's own
    router (routing is deterministic), so the strategy keeps no record of its own.

        seen = RoutingRecorder(layer)
        layer(x)
        seen.last.keep      # (T, k): which choices fitted under the capacity
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self.last: Routing | None = None
        self._handle = layer.register_forward_pre_hook(self._route)

    def _route(self, layer: torch.nn.Module, args: tuple[Any, ...]) -> None:
        tokens = args[0].detach().reshape(-1, args[0].shape[-1])
        with torch.no_grad():
            self.last = route(tokens, layer.router, layer.top_k, layer.capacity_factor)

    def remove(self) -> None:
        """Stop observing."""
        self._handle.remove()

def _group(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


def _layer(cfg: ModelConfig, capacity_factor: float | None, seed: int) -> MoE:
    """The same MoE layer (weights from ``seed``) on every rank and on one device."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoE(dataclasses.replace(cfg, capacity_factor=capacity_factor))


def layer_tokens(cfg: ModelConfig, tokens: int, rank: int, seed: int = 0,
                 skew: float = 0.0) -> torch.Tensor:
    """Rank ``rank``'s (tokens, h) inputs: random, plus ``skew`` times a direction every
    token shares (correlated tokens: they tend to pick the same experts)."""
    gen = torch.Generator().manual_seed(1000 * seed + rank + 1)
    x = torch.randn(tokens, cfg.d_model, generator=gen)
    shared = torch.randn(cfg.d_model, generator=torch.Generator().manual_seed(seed))
    return x + skew * shared


def layer_traffic(cfg: ModelConfig, tokens: int = 32,
                  capacity_factors: Sequence[float | None] = (None, 1.0, 1.25, 2.0),
                  seed: int = 0, group: Any = None) -> dict[Any, dict[str, Any]]:
    """On each rank, for each capacity factor: one MoE layer with E/ep experts here, forward
    and backward on this rank's ``tokens`` tokens, against the single-device layer on the
    same tokens (``"check"``: outputs and input gradients), with ``"records"`` (op, bytes)
    of every call, ``"load"`` (choices per expert before capacity), ``"dropped"`` and
    ``"computed"`` (rows this rank's experts ran)."""
    group = _group(group)
    rank = dist.get_rank(group)
    dev = this_device()  # NCCL moves only tensors on this rank's GPU
    out = {}
    for factor in capacity_factors:
        x = layer_tokens(cfg, tokens, rank, seed).to(dev)
        d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank)).to(dev)
        single = _layer(cfg, factor, seed).to(dev)
        want_x = x.clone().requires_grad_()
        want = single(want_x)
        want.backward(d_out)
        layer = ExpertParallelMoE.from_moe(_layer(cfg, factor, seed), group).to(dev)
        seen = RoutingRecorder(layer)
        got_x = x.clone().requires_grad_()
        with CommLog() as log:
            got = layer(got_x)
            n_forward = len(log.records)
            got.backward(d_out)
        r = seen.last
        records = [(rec.op, rec.nbytes) for rec in log.records]
        out[factor] = {
            "check": compare({"output": got, "d_input": got_x.grad},
                             {"output": want, "d_input": want_x.grad}),
            "records": records, "n_forward": n_forward, "tokens": tokens,
            "load": torch.bincount(r.experts.reshape(-1), minlength=len(single.experts)).tolist(),
            "dropped": int((~r.keep).sum()),
            "computed": records[2][1] // (cfg.d_model * x.element_size()),
        }
    return out


def emulated_step(cfg: ModelConfig, tokens: int = 64, skew: float = 0.0,
                  row_seconds: float = 0.0005, seed: int = 0,
                  group: Any = None) -> dict[str, float]:
    """One MoE layer's forward with the routing, the counts and the token all-to-all real,
    and each rank's expert compute **emulated**: a sleep of ``row_seconds`` per row it
    computes (proportional to its tokens, whatever the cores are doing), then the combine
    all-to-all, which waits for the slowest. Returns this rank's ``"rows"``, ``"busy"``
    and ``"total"`` seconds (first dispatch to the end of the combine)."""
    group = _group(group)
    rank, ep = dist.get_rank(group), dist.get_world_size(group)
    layer = _layer(cfg, None, seed)
    x = layer_tokens(cfg, tokens, rank, seed, skew)
    with torch.no_grad():
        plan = dispatch_plan(route(x, layer.router, layer.top_k), len(layer.experts), ep)
        incoming = torch.empty_like(plan["per_expert"])
        dist.all_to_all_single(incoming, plan["per_expert"], group=group)
        send = plan["per_rank"].tolist()
        recv = incoming.view(ep, -1).sum(1).tolist()
        dist.barrier(group=group)
        start = time.perf_counter()
        arrived = x.new_empty((sum(recv), x.shape[1]))
        dist.all_to_all_single(arrived, x[plan["token"]], recv, send, group=group)
        began = time.perf_counter()
        time.sleep(arrived.shape[0] * row_seconds)  # emulated: the experts' matmuls
        busy = time.perf_counter() - began
        back = x.new_empty((sum(send), x.shape[1]))
        dist.all_to_all_single(back, arrived, send, recv, group=group)
        total = time.perf_counter() - start
    return {"rows": float(arrived.shape[0]), "busy": busy, "total": total}


def _expert_groups(ep: int) -> tuple[Any, Any]:
    """(ep group, experts' replica group) of this rank, ep groups of consecutive ranks. At
    ep = 1 (one rank, or experts not split) each rank is its own ep group and every rank
    replicates every expert: a Mesh has no ep groups then."""
    if ep > 1:
        mesh = Mesh(dp=dist.get_world_size(), ep=ep)
        return mesh.group("ep"), mesh.expert_replica_group()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective
    return alone[dist.get_rank()], dist.group.WORLD


def train_expert_parallel(cfg: ModelConfig, ep: int, *, steps: int = 3, batch: int = 8,
                          lr: float = 0.1, seed: int = 0) -> dict[str, Any]:
    """The tiny MoE model trained on every rank of the world: experts split over groups of
    ``ep`` consecutive ranks, replicated over world/ep of them, every rank on its own rows
    (data parallel over the world). Returns the ``"losses"`` (mean over the world), every
    step's ``"grads"`` and the final ``"params"`` this rank holds, and ``"bytes"`` (the
    token all-to-alls of the first step, this rank)."""
    world = dist.group.WORLD
    ep_group, replicas = _expert_groups(ep)
    dev = this_device()  # NCCL moves only tensors on this rank's GPU
    model = expert_parallel_copy(build_model(cfg, seed), ep_group).to(dev)
    opt = make_optimizer(model.parameters(), "sgd", lr)
    losses, grads, sent = [], [], 0
    for step in range(steps):
        tokens, targets = (t.to(dev) for t in make_batch(batch, cfg, step, seed))
        opt.zero_grad(set_to_none=True)
        with CommLog() as log:
            loss = loss_fn(model(split_rows(tokens, world)), split_rows(targets, world))
            loss.backward()
        if step == 0:  # every call but the counts (E x 8 bytes, the first of each layer)
            sent = sum(r.nbytes for r in log.records if r.op == "all_to_all") - \
                cfg.n_layers * cfg.n_experts * 8
        sync_gradients(model, world, replicas)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
        grads.append({n: p.grad.cpu().clone() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads, "bytes": sent,
            "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}}


def dense_moe_output(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token (T, h), weighted by a (T, E) gate: the router's weight
    where a kept choice picked that expert, 0 elsewhere. E/k times the compute of the MoE
    layer, no gathering or scattering of tokens: the reference it must equal."""
    r = route(x, moe.router, moe.top_k, moe.capacity_factor)
    gate = torch.zeros_like(r.probs).scatter_add(1, r.experts, r.weights * r.keep)
    return sum(gate[:, e:e + 1] * expert(x) for e, expert in enumerate(moe.experts))


def grouped_moe_output(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer with its experts as two calls of PyTorch's grouped matmul
    (``torch.nn.functional.grouped_mm``): the kept choices sorted by expert, each group of
    rows times its own expert's matrix (groups ending at ``offs``), the biases added per
    row, then combined in token order times the router weight."""
    r = route(x, moe.router, moe.top_k, moe.capacity_factor)
    plan = dispatch_plan(r, len(moe.experts), 1)
    offs = plan["per_expert"].cumsum(0).to(torch.int32)
    up = torch.stack([e.up.weight for e in moe.experts]).transpose(1, 2)  # (E, h, f)
    down = torch.stack([e.down.weight for e in moe.experts]).transpose(1, 2)  # (E, f, h)
    up_bias = torch.stack([e.up.bias for e in moe.experts])[plan["expert"]]
    down_bias = torch.stack([e.down.bias for e in moe.experts])[plan["expert"]]
    hidden = F.gelu(F.grouped_mm(x[plan["token"]], up, offs=offs) + up_bias)
    y = F.grouped_mm(hidden, down, offs=offs) + down_bias
    return torch.zeros_like(x).index_add(0, plan["token"], y * plan["weight"][:, None])


def router_balance(cfg: ModelConfig, *, steps: int = 300, aux_weight: float = 0.0,
                   batch: int = 8, lr: float = 0.1, seed: int = 0) -> dict[str, list[float]]:
    """The tiny MoE model trained on one device, loss + ``aux_weight`` x the load-balancing
    loss. Per step: ``"imbalance"`` (the first MoE layer's busiest expert's choices over
    the mean, :func:`parlib.cost.experts.load_imbalance`), ``"aux"`` and ``"loss"``."""
    model = build_model(cfg, seed)
    opt = make_optimizer(model.parameters(), "sgd", lr)
    first = model.blocks[0].mlp
    seen: dict[str, list[float]] = {"imbalance": [], "aux": [], "loss": []}
    for step in range(steps):
        tokens, targets = make_batch(batch, cfg, step, seed)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(tokens), targets)
        aux = aux_loss(model)
        (loss + aux_weight * aux).backward()
        opt.step()
        load = torch.bincount(first.last_routing.experts.reshape(-1),
                              minlength=cfg.n_experts).tolist()
        seen["imbalance"].append(load_imbalance(load))
        seen["aux"].append(float(aux.detach()))
        seen["loss"].append(float(loss.detach()))
    return seen


__all__ = ["RoutingRecorder", "dense_moe_output", "emulated_step", "grouped_moe_output",
           "layer_tokens", "layer_traffic", "router_balance", "train_expert_parallel"]
