"""Data x tensor x pipeline parallelism at once (3-D parallelism), on a :class:`Mesh`.

Each rank holds one pipeline stage's layers (pp), with those layers' matrices split over
its tensor-parallel group (tp), and is one of d copies that see different rows of the
batch (dp). One training step:

1. take this data-parallel rank's B/d rows of the batch;
2. run the stage's 1F1B schedule over m microbatches, sending activations and their
   gradients to the neighbouring stages (``mesh.pp_prev`` / ``mesh.pp_next``), with the
   tensor-parallel all-reduces inside every layer (over ``mesh.group("tp")``);
3. average the gradients over ``mesh.group("dp")``, then step the optimizer.

Every piece is an earlier chapter's, handed its group: :func:`build_3d` cuts a
:class:`~parlib.strategies.pipeline.Stage` and splits its blocks with
:func:`~parlib.strategies.tensor.tensor_parallel_block`; :func:`train_step_3d` runs
:func:`~parlib.strategies.pipeline.run_schedule` and
:func:`~parlib.strategies.data.allreduce_gradients`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.cost import predicted_sent_bytes
from parlib.measure.emulation import PacedCost, StageCost
from parlib.measure.memory import SavedActivations, param_bytes
from parlib.measure.timeline import Recorder, Span
from parlib.model import ModelConfig, build_model, make_batch, make_optimizer, train_step
from parlib.runtime.policy import device as this_device
from parlib.strategies.data import allreduce_gradients, shard_rows
from parlib.strategies.mesh import Mesh
from parlib.strategies.pipeline import Stage, run_schedule
from parlib.strategies.schedules import one_f_one_b
from parlib.strategies.tensor import tensor_parallel_block


def build_3d(mesh: Mesh, cfg: ModelConfig | None = None, seed: int = 0,
             device: Any = None) -> Stage:
    """This rank's part of ``build_model(cfg, seed)``: stage ``mesh.coord("pp")`` of
    ``mesh.pp`` (peers ``mesh.pp_prev`` / ``mesh.pp_next``), its blocks split over
    ``mesh.group("tp")``. Every rank builds the whole tiny model and keeps its part."""
    cfg = cfg or ModelConfig()
    if cfg.n_layers % mesh.pp:
        raise ValueError(f"pp={mesh.pp} does not divide the model's {cfg.n_layers} layers")
    stage = Stage(build_model(cfg, seed), mesh.coord("pp"), mesh.pp, mesh.pp_prev,
                  mesh.pp_next)
    if mesh.tp > 1:
        # Same attribute names, so Stage's local-to-global parameter names still hold.
        stage.blocks = nn.ModuleList(tensor_parallel_block(b, mesh.group("tp"))
                                     for b in stage.blocks)
    return stage.to(device) if device is not None else stage


def split_dims(stage: Stage) -> dict[str, int | None]:
    """For each of the stage's parameters (full-model name): the dimension tensor
    parallelism cut it along, or None if this rank holds it whole."""
    out: dict[str, int | None] = {}
    for mod_name, module in stage.named_modules():
        dims = getattr(module, "split_dims", {})
        for p_name, _ in module.named_parameters(recurse=False):
            local = f"{mod_name}.{p_name}" if mod_name else p_name
            out[stage._global[local]] = dims.get(p_name)
    return out


def train_step_3d(stage: Stage, mesh: Mesh, optimizer: torch.optim.Optimizer,
                  tokens: torch.Tensor, targets: torch.Tensor, m: int, *,
                  recorder: Recorder | None = None,
                  memory: SavedActivations | None = None,
                  cost: StageCost | PacedCost | None = None,
                  sync: Callable[[], Any] | None = None,
                  mean_loss: bool = True) -> float | None:
    """One 3-D step on the global batch (tokens, targets): this dp rank's rows, 1F1B over
    m microbatches, gradients averaged over the dp group, optimizer step. Returns the
    global batch's mean loss on the last stage's ranks, None on the others.

    ``cost``: an emulated compute time for each forward and backward (the pipeline chapter).
    ``sync``: pools the gradients instead of one all-reduce per parameter (for example a
    :class:`~parlib.strategies.data.Bucketed` over ``mesh.group("dp")``).
    ``mean_loss=False`` skips the loss's all-reduce and returns this rank's own loss."""
    optimizer.zero_grad(set_to_none=True)
    x = shard_rows(tokens, mesh.coord("dp"), mesh.dp)
    y = shard_rows(targets, mesh.coord("dp"), mesh.dp)
    ops = one_f_one_b(mesh.pp, m, mesh.coord("pp"))
    loss = run_schedule(stage, ops, x, y, m, recorder=recorder, memory=memory, cost=cost)
    if sync is not None:
        sync()
    else:
        allreduce_gradients(stage, group=mesh.group("dp"))
    optimizer.step()
    if loss is None or not mean_loss:
        return loss
    total = torch.tensor([loss], device=next(stage.parameters()).device)
    dist.all_reduce(total, group=mesh.group("dp"))  # the mean of d equal-sized means
    return total.item() / mesh.dp


# --------------------------------------------------------------------------- measuring


@contextmanager
def axis_traffic(mesh: Mesh, recorder: Recorder, pacer: PacedCost | None = None
                 ) -> Iterator[dict[str, dict[str, float]]]:
    """While active, every ``dist.all_reduce`` on this rank is timed into ``recorder`` as a
    span of kind "tp" or "dp" (by the mesh group it ran on) and counted: the yielded dict
    gets, per axis, ``calls``, ``message_bytes`` and ``sent_bytes`` (the ring all-reduce's
    2(N-1)/N of each message, :func:`parlib.cost.predicted_sent_bytes`). A ``pacer``
    (emulated compute) is told when each tensor-parallel all-reduce begins, with the
    communication recorded since its span began."""
    groups = {"tp": mesh.group("tp"), "dp": mesh.group("dp")}
    counts = {axis: {"calls": 0, "message_bytes": 0, "sent_bytes": 0.0} for axis in groups}
    original = dist.all_reduce

    def timed(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        axis = next((a for a, g in groups.items() if g is group), None)
        if axis is None:
            return original(tensor, *args, group=group, **kwargs)
        if pacer is not None and axis == "tp":
            pacer.before_point(recorder.seconds_since(pacer.started))
        t0 = recorder._now()
        out = original(tensor, *args, group=group, **kwargs)
        recorder.spans.append(Span(recorder.rank, axis, t0, recorder._now()))
        nbytes = tensor.numel() * tensor.element_size()
        n = mesh.size(axis)
        counts[axis]["calls"] += 1
        counts[axis]["message_bytes"] += nbytes
        counts[axis]["sent_bytes"] += predicted_sent_bytes("all_reduce", nbytes, n) or 0.0
        return out

    dist.all_reduce = timed
    try:
        yield counts
    finally:
        dist.all_reduce = original


# --------------------------------------------------------------------------- a whole run


def rank_train_3d(dp: int, pp: int, tp: int, *, cfg: ModelConfig | None = None,
                  steps: int = 3, global_batch: int = 8, m: int = 2, seed: int = 0,
                  lr: float = 0.1, record: bool = False) -> dict[str, Any]:
    """Run on every rank of ``parlib.launch(..., world_size=dp*pp*tp)``: build the mesh and
    this rank's part, train ``steps`` steps of :func:`train_step_3d` on batches 0..steps-1.

    Returns ``rank``, ``coord`` (pp, dp, tp), ``groups`` (global ranks per axis),
    ``losses`` (per step, last stage; None elsewhere), ``grads`` (per step, by full-model
    name, this rank's shard), ``params`` (after the last step), ``split`` (dimension each
    parameter is cut along). With ``record``: ``spans`` of the last step (compute, pp
    send/recv, tp and dp all-reduces), ``traffic`` (bytes per axis, last step), ``pp_sent``
    (bytes), ``param_bytes`` and ``peak_saved`` (activation bytes, last step).
    """
    cfg = cfg or ModelConfig()
    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    dev = this_device()
    stage = build_3d(mesh, cfg, seed, dev)
    optimizer = make_optimizer(stage.parameters(), "sgd", lr)
    out: dict[str, Any] = {"rank": mesh.rank, "device": str(dev), "backend": dist.get_backend(),
                           "coord": {a: mesh.coord(a) for a in ("pp", "dp", "tp")},
                           "groups": {a: mesh.ranks(a) for a in ("pp", "dp", "tp")},
                           "losses": [], "grads": [], "split": split_dims(stage)}
    for step in range(steps):
        tokens, targets = make_batch(global_batch, cfg, step, seed)
        last = record and step == steps - 1
        rec = Recorder(mesh.rank, dev)
        tracker = SavedActivations(stage) if last else None
        dist.barrier()
        if last:
            with axis_traffic(mesh, rec) as traffic:
                loss = train_step_3d(stage, mesh, optimizer, tokens.to(dev), targets.to(dev),
                                     m, recorder=rec, memory=tracker)
            out.update(spans=rec.spans, traffic=traffic, pp_sent=sum(rec.sent.values()),
                       param_bytes=param_bytes(stage.parameters()),
                       peak_saved=tracker.peak)
        else:
            loss = train_step_3d(stage, mesh, optimizer, tokens.to(dev), targets.to(dev), m,
                                 recorder=rec)
        out["losses"].append(loss)
        out["grads"].append(stage.grads())
    out["params"] = {stage._global[n]: prm.detach().cpu().clone()
                     for n, prm in stage.named_parameters()}
    dist.barrier()
    return out


def single_device_history(cfg: ModelConfig | None = None, *, steps: int = 3,
                          global_batch: int = 8, seed: int = 0,
                          lr: float = 0.1) -> dict[str, Any]:
    """The same training on one device with :func:`parlib.model.train_step`: ``losses``
    and ``grads`` (by name) of every step, ``params`` after the last."""
    model = build_model(cfg, seed)
    optimizer = make_optimizer(model.parameters(), "sgd", lr)
    losses, grads = [], []
    for step in range(steps):
        x, y = make_batch(global_batch, cfg, step, seed)
        losses.append(train_step(model, optimizer, x, y))
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def shard_of(full: torch.Tensor, dim: int | None, tp_index: int, t: int) -> torch.Tensor:
    """The piece of a full tensor that tensor-parallel rank ``tp_index`` of t holds."""
    return full if dim is None else full.chunk(t, dim=dim)[tp_index]


def pair_with_reference(results: Sequence[dict[str, Any]], reference: dict[str, Any]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(got, want): every rank's losses, per-step gradients and final parameters, and the
    same pieces of :func:`single_device_history` (the shard each rank should hold), keyed
    alike ("rank 3 step 1 grad blocks.0.attn.q.weight"); compare them with
    :func:`parlib.verify.compare`."""
    got: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    for r in results:
        rank, t = r["rank"], len(r["groups"]["tp"])
        tp_index = r["coord"]["tp"]
        for step, grads in enumerate(r["grads"]):
            for name, g in grads.items():
                key = f"rank {rank} step {step} grad {name}"
                got[key] = g
                want[key] = shard_of(reference["grads"][step][name], r["split"][name],
                                     tp_index, t)
        for name, prm in r["params"].items():
            key = f"rank {rank} param {name}"
            got[key] = prm
            want[key] = shard_of(reference["params"][name], r["split"][name], tp_index, t)
        for step, loss in enumerate(r["losses"]):
            if loss is not None:
                key = f"rank {rank} step {step} loss"
                got[key] = torch.tensor(loss)
                want[key] = torch.tensor(reference["losses"][step])
    return got, want


__all__ = [
    "axis_traffic",
    "build_3d",
    "pair_with_reference",
    "rank_train_3d",
    "shard_of",
    "single_device_history",
    "split_dims",
    "train_step_3d",
]
