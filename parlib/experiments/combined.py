"""The combining chapter's experiment: a few 3-D (or up to five-axis) training steps on
every rank (:func:`rank_train_3d`, :func:`rank_train_nd`), the traffic of each axis
(:func:`axis_traffic`) and every rank's results paired with the single-device reference
(:func:`pair_with_reference`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from parlib.cost import Layout, mesh_sent_bytes_per_step
from parlib.experiments.pipeline import MeasuringHooks
from parlib.measure.emulation import PacedCost
from parlib.measure.memory import SavedActivations, param_bytes
from parlib.measure.timeline import Recorder
from parlib.measure.traffic import axis_traffic as measure_axis_traffic
from parlib.model import ModelConfig, make_batch, make_optimizer
from parlib.runtime.policy import device as this_device
from parlib.strategies.combined import MeshGradientSync, build_nd, train_step_nd
from parlib.strategies.experts import is_expert_parameter
from parlib.strategies.mesh import Mesh
from parlib.strategies.pipeline import Stage
from parlib.strategies.tensor import shard_of, split_dims
from parlib.verify import History


def axis_traffic(mesh: Mesh, recorder: Recorder, pacer: PacedCost | None = None
                 ) -> AbstractContextManager[dict[str, dict[str, float]]]:
    """:func:`parlib.measure.axis_traffic` on the mesh's groups (every axis but the
    pipeline's, whose messages go rank to rank): while active, each collective on an axis'
    group is a span of that axis' kind in ``recorder`` and is counted (``calls``,
    ``message_bytes``, ``sent_bytes`` per axis). A ``pacer`` (emulated compute) is told when
    each tensor-parallel collective begins."""
    groups = {name: mesh.group(name) for name in mesh.axes if name != "pp"}
    return measure_axis_traffic(groups, recorder, pacer, paced=("tp",))


# --------------------------------------------------------------------------- a whole run


def rank_train_3d(layout: Layout | Mapping[str, int], *, cfg: ModelConfig | None = None,
                  steps: int = 3, global_batch: int = 8, m: int = 2, seed: int = 0,
                  lr: float = 0.1, record: bool = False) -> dict[str, Any]:
    """:func:`rank_train_nd` with 1F1B (the combining chapter's 3-D runs): run on every
    rank of ``parlib.launch(..., world_size=layout.world)``; see there for what it
    returns."""
    return rank_train_nd(layout, cfg=cfg, steps=steps, global_batch=global_batch, m=m,
                         seed=seed, lr=lr, record=record)


def rank_train_nd(layout: Layout | Mapping[str, int], *, cfg: ModelConfig | None = None,
                  steps: int = 3, global_batch: int = 8, m: int = 2, seed: int = 0,
                  lr: float = 0.1, record: bool = False, schedule: str = "1f1b",
                  sequence_layout: str = "zigzag") -> dict[str, Any]:
    """Run on every rank of ``parlib.launch(..., world_size=layout.world)``: build the mesh
    of ``layout`` (a :class:`~parlib.cost.Layout` or a mapping from axis name to size, ep
    included) and this rank's part (:func:`build_nd`), train ``steps`` steps of
    :func:`train_step_nd` (``schedule``, the sequence split ``sequence_layout``) on batches
    0..steps-1, the gradients pooled in buckets (:class:`MeshGradientSync`, after backward).

    Returns ``rank``, ``schedule``, ``coord`` (index per axis), ``groups`` (global ranks
    per axis), ``losses`` (per step, last stage; None elsewhere), ``grads`` (per step, by
    full-model name, this rank's shard), ``params`` (after the last step), ``split``
    (dimension each parameter is cut along). With ``record``: ``spans`` of the last step
    (compute, pp send/recv, each axis' collectives), ``traffic`` (bytes per axis, last
    step), ``pp_sent`` (bytes), ``param_bytes`` (of which ``expert_param_bytes`` in experts
    split over ep) and ``peak_saved`` (activation bytes, last step).
    """
    cfg = cfg or ModelConfig()
    mesh = Mesh(Layout.of(layout))
    dev = this_device()
    stage = build_nd(mesh, cfg, seed, dev, sequence_layout=sequence_layout)
    optimizer = make_optimizer(stage.parameters(), "sgd", lr)
    # The data-parallel chapter's buckets (DDP's sizes: 1 MiB first, then 25 MiB), one
    # all-reduce each after the stage's last backward. Not overlapped: under 1F1B a
    # stage's gradients are complete only after its last microbatch's backward.
    sync = MeshGradientSync(stage, mesh)
    out: dict[str, Any] = {"rank": mesh.rank, "device": str(dev), "backend": dist.get_backend(),
                           "schedule": schedule,
                           "coord": {a: mesh.coord(a) for a in mesh.axes},
                           "groups": {a: mesh.ranks(a) for a in mesh.axes},
                           "losses": [], "grads": [], "split": stage_split_dims(stage)}
    for step in range(steps):
        tokens, targets = make_batch(global_batch, cfg, step, seed)
        last = record and step == steps - 1
        rec = Recorder(mesh.rank, dev)
        tracker = SavedActivations(stage) if last else None
        hooks = MeasuringHooks(stage.rank, rec, memory=tracker)
        dist.barrier()
        with axis_traffic(mesh, rec) if last else nullcontext({}) as traffic:
            loss = train_step_nd(stage, mesh, optimizer, tokens.to(dev), targets.to(dev), m,
                                 schedule=schedule, sequence_layout=sequence_layout,
                                 hooks=hooks, sync=sync)
        if last:
            split = [p for n, p in stage.named_parameters()
                     if mesh.ep > 1 and is_expert_parameter(n)]
            out.update(spans=rec.spans, traffic=traffic, pp_sent=sum(rec.sent.values()),
                       param_bytes=param_bytes(stage.parameters()), peak_saved=tracker.peak,
                       expert_param_bytes=param_bytes(split))
        out["losses"].append(loss)
        out["grads"].append(stage.grads())
    out["params"] = {stage.global_names[n]: prm.detach().cpu().clone()
                     for n, prm in stage.named_parameters()}
    dist.barrier()
    return out


def stage_split_dims(stage: Stage) -> dict[str, int | None]:
    """:func:`parlib.strategies.tensor.split_dims` of a stage, by full-model name."""
    return {stage.global_names[n]: dim for n, dim in split_dims(stage).items()}


def pair_with_reference(results: Sequence[dict[str, Any]], reference: History
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(got, want): every rank's losses, per-step gradients and final parameters, and the
    same pieces of ``reference`` (:func:`parlib.verify.reference_run` of the same steps,
    batch and seed: the shard each rank should hold), keyed
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
                want[key] = shard_of(reference.grads[step][name], r["split"][name],
                                     tp_index, t)
        for name, prm in r["params"].items():
            key = f"rank {rank} param {name}"
            got[key] = prm
            want[key] = shard_of(reference.params[name], r["split"][name], tp_index, t)
        for step, loss in enumerate(r["losses"]):
            if loss is not None:
                key = f"rank {rank} step {step} loss"
                got[key] = torch.tensor(loss)
                want[key] = torch.tensor(reference.losses[step])
    return got, want


def bytes_per_axis(layout: Layout | Mapping[str, int], results: Sequence[dict[str, Any]],
                   cfg: ModelConfig, global_batch: int, m: int
                   ) -> dict[int, dict[str, tuple[float, float]]]:
    """Rank -> axis -> (measured, predicted) bytes of the recorded step of a
    :func:`rank_train_nd` run (``record=True``): what the rank sent on tp, cp, dp (as
    :func:`axis_traffic` counts a collective) and pp (its pipeline sends), against
    :func:`parlib.cost.mesh_sent_bytes_per_step` for its stage and its parameters; on ep,
    the bytes put into the all-to-alls, the mean over the rank's ep group (a rank's own
    share depends on the routing, the mean does not). Not for a schedule that splits the
    backward (zb-h1): its W walks each microbatch's graph again, so every collective
    inside a layer's backward (the ring's, the all-to-alls, f's) runs twice."""
    split = {r.get("schedule") for r in results} & {"zb-h1"}
    if split:
        raise ValueError(f"bytes_per_axis predicts a step without split backward; this run "
                         f"used {split.pop()}, whose W repeats the backward's collectives: "
                         f"run it with schedule='1f1b' or 'gpipe'")
    layout = Layout.of(layout)
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for r in results:
        want = mesh_sent_bytes_per_step(
            layout, b=global_batch // (layout.dp * m), s=cfg.seq_len, h=cfg.d_model, m=m,
            layers=cfg.n_layers // layout.pp, stage=r["coord"]["pp"],
            shared_param_bytes=r["param_bytes"] - r["expert_param_bytes"],
            expert_param_bytes=r["expert_param_bytes"], n_experts=cfg.n_experts,
            top_k=cfg.top_k if cfg.n_experts else 0)
        got = {a: r["pp_sent"] if a == "pp" else r["traffic"][a]["sent_bytes"] for a in want}
        if "ep" in want:
            group = [results[q]["traffic"]["ep"]["message_bytes"] for q in r["groups"]["ep"]]
            got["ep"] = sum(group) / len(group)
        out[r["rank"]] = {a: (got[a], want[a]) for a in want}
    return out


__all__ = ["axis_traffic", "bytes_per_axis", "pair_with_reference", "rank_train_3d",
           "rank_train_nd", "stage_split_dims"]
