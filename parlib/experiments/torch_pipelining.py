"""The pipeline chapter's stages under ``torch.distributed.pipelining``'s own schedules,
padded to the same emulated cost as our runs, to race them.

:data:`TORCH_SCHEDULES` maps our names to torch's classes: ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B (v chunks per rank, virtual stage c*p + rank as ours) and
ScheduleInterleavedZeroBubble with one stage per rank, which is ZB-H1 (its backward split
into I, the input's gradient, and W, the weights'; measured: the same op order as ours).
All four run on gloo on the CPU with torch 2.13. Under the emulated cost torch's I is
padded to the whole backward and its W is not padded (torch computes the weights'
gradients outside the stage module, where no hook sees them), so a ZB-H1 time is not a
like-for-like race; its gradients and its op order are (:func:`torch_orders_as_ops`,
:func:`compare_orders`). :func:`race_torch` runs ours and torch's side by side.

:func:`gpipe_backward_orders`: torch's GPipe runs its backwards in the order 0..m-1, ours
m-1..0; both are valid schedules with the same peak. Torch 2.13's ``Schedule1F1B`` has a
``pipeline_order`` too; on its last rank it lists the forwards as F1..Fm (one more than the
microbatch it runs: m = 8 lists an F8), so :func:`compare_orders` reports that rank as
differing from ours at its first op although the run's gradients equal single-device; the
other ranks' orders equal ours.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.measure.emulation import StageCost
from parlib.measure.timeline import align, makespan
from parlib.model import ModelConfig, loss_fn, make_batch
from parlib.runtime.policy import device as this_device
from parlib.strategies.pipeline import Stage, build_chunks, build_stage
from parlib.strategies.schedule_check import validate
from parlib.strategies.schedules import BACKWARD, FORWARD, WEIGHT, Op, all_ranks, peaks

# our schedule name -> torch.distributed.pipelining's class; the interleaved ones hold v
# chunks (PipelineStages) per rank
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}
_MULTI = ("interleaved", "zb-h1")  # built from a list of PipelineStages


class _ChunkCost:
    """A StageCost whose durations are ``factor`` (1/v) of the stage's: one chunk's share."""

    def __init__(self, base: StageCost, factor: float) -> None:
        self.base, self.factor = base, factor

    def start(self, kind: str, rows: int, stage: int = 0) -> float:
        return self.base.start(kind, rows, stage)

    def pad(self, kind: str, started: float, rows: int, stage: int = 0) -> float:
        due = self.base.duration(kind, rows, stage) * self.factor
        left = due - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        return left


class CostPadded(nn.Module):
    """A :class:`Stage` whose forward and backward are padded to a :class:`StageCost`,
    for running it inside a schedule we do not control (torch.distributed.pipelining).
    The embedding's backward on the first stage is left out of the padding (it is tiny).
    The clock starts when the output's gradient arrives and the pad ends the backward when
    the input's gradient is made (tensor hooks, which also fire inside torch's split
    backward, where only the input's gradient is computed).
    Each microbatch is padded to the cost of its own rows (the schedule cuts the batch)."""

    def __init__(self, stage: Stage, cost: StageCost | _ChunkCost) -> None:
        super().__init__()
        self.stage = stage
        self._state = {"cost": cost, "t0": 0.0, "stage": stage.rank}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        st = self.stage
        t0 = self._state["cost"].start(FORWARD, rows, st.rank)
        if st.embed is not None:
            x = st.embed(x)
        state = self._state
        if x.requires_grad:
            # the gradient reaching the stage's input ends its backward: pad it there
            x = x.view_as(x)
            x.register_hook(lambda g: state["cost"].pad(BACKWARD, state["t0"], rows,
                                                         st.rank) and None)
        for block in st.blocks:
            x = block(x)
        if st.head is not None:
            x = st.head(x)
        state["cost"].pad(FORWARD, t0, rows, st.rank)
        # the gradient of the stage's output arriving starts its backward's clock (a hook on
        # the output itself: torch detaches it in place after the backward, not possible
        # for a view)
        x.register_hook(lambda g: state.__setitem__(
            "t0", state["cost"].start(BACKWARD, rows, st.rank)))
        return x


def rank_torch_pipelining(
    cfg: ModelConfig | None = None,
    *,
    schedule_name: str = "gpipe",
    m: int = 4,
    batch_size: int = 8,
    seed: int = 0,
    cost: StageCost | None = None,
    repeats: int = 3,
    warmup: int = 1,
    v: int = 2,
) -> dict[str, Any]:
    """Run on every rank: the same stages under ``torch.distributed.pipelining``'s schedule
    for ``schedule_name`` (a key of :data:`TORCH_SCHEDULES`; the interleaved ones with v
    chunks per rank, so the model needs p x v blocks). Returns ``loss`` (last stage, mean of
    the microbatch losses), ``grads`` (last step), ``times`` (s, each repeat, this rank,
    barrier to end) and ``order`` (torch's action order for every rank, as strings, when
    the schedule has one: ``pipeline_order``; else None)."""
    import torch.distributed.pipelining as pipelining

    if schedule_name not in TORCH_SCHEDULES:
        raise ValueError(f"no torch schedule for {schedule_name!r}; pick one of "
                         f"{sorted(TORCH_SCHEDULES)}")
    cfg = cfg or ModelConfig()
    rank, p = dist.get_rank(), dist.get_world_size()
    dev = this_device()
    kind = getattr(pipelining, TORCH_SCHEDULES[schedule_name])
    multi = schedule_name in _MULTI
    v = v if schedule_name == "interleaved" else 1
    if multi:
        chunked = build_chunks(cfg, seed, rank, p, v, dev)
        chunks = list(chunked)
        first_here = chunks[0].is_first
        last_here = chunks[-1].is_last
        modules = [CostPadded(c, _ChunkCost(cost, 1 / v)) if cost is not None else c
                   for c in chunks]
        pipe_stages = [pipelining.PipelineStage(mod, c.rank, p * v, dev)
                       for mod, c in zip(modules, chunks)]
        sched = kind(pipe_stages, n_microbatches=m, loss_fn=loss_fn)
        params: Any = chunked
    else:
        stage = build_stage(cfg, seed, rank, p, dev)
        first_here, last_here = stage.is_first, stage.is_last
        module = CostPadded(stage, cost) if cost is not None else stage
        sched = kind(pipelining.PipelineStage(module, rank, p, dev), n_microbatches=m,
                     loss_fn=loss_fn)
        params = stage
    tokens, targets = make_batch(batch_size, cfg, 0, seed)
    tokens, targets = tokens.to(dev), targets.to(dev)
    times, loss = [], None
    for it in range(warmup + repeats):
        params.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        dist.barrier()
        t0 = time.perf_counter()
        args = (tokens,) if first_here else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if last_here else {}
        sched.step(*args, **kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if it >= warmup:
            times.append(time.perf_counter() - t0)
        if losses:
            loss = torch.stack([x.detach() for x in losses]).mean().item()
    dist.barrier()
    order = getattr(sched, "pipeline_order", None)
    order = ({r: [str(a) if a is not None else "" for a in acts] for r, acts in order.items()}
             if order is not None else None)
    return {"rank": rank, "loss": loss, "grads": params.grads(), "times": times,
            "order": order}


_TORCH_KIND = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": WEIGHT}


def torch_orders_as_ops(order: dict[int, list[str]], p: int) -> dict[int, list[Op]]:
    """torch's ``pipeline_order`` (strings like ``"2F0"``: stage, kind, microbatch; empty
    for an idle slot) as our op lists: stage s on rank s % p is chunk s // p; torch's full
    backward B and input backward I are our B, its W our W. Other actions (none in these
    schedules' compute orders) are dropped."""
    import re

    out: dict[int, list[Op]] = {}
    for r in range(p):
        ops = []
        for text in order[r]:
            found = re.fullmatch(r"(\d+)([FBIW])(\d+)", text)
            if found:
                s, k, mb = int(found[1]), found[2], int(found[3])
                ops.append(Op(_TORCH_KIND[k], mb, s // p))
        out[r] = ops
    return out


def compare_orders(ours: dict[int, list[Op]], theirs: dict[int, list[Op]],
                   ) -> dict[int, dict[str, Any]]:
    """Per rank: whether the two op orders are the same, and the first position where they
    differ (None if they do not), with both ops there."""
    out = {}
    for r in sorted(ours):
        a, b = ours[r], theirs.get(r, [])
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                     None if len(a) == len(b) else min(len(a), len(b)))
        out[r] = {"same": first is None, "first_difference": first,
                  "ours": a[first] if first is not None and first < len(a) else None,
                  "theirs": b[first] if first is not None and first < len(b) else None}
    return out


def race_torch(
    schedules: Sequence[str] = tuple(TORCH_SCHEDULES),
    *,
    p: int = 4,
    m: int = 8,
    batch_size: int = 8,
    cost: StageCost | None = None,
    repeats: int = 3,
    v: int = 2,
    cfg: ModelConfig | None = None,
    timeout: float = 120.0,
) -> list[dict[str, Any]]:
    """Ours and torch's run of each schedule, side by side in one call, on the same model,
    ranks and emulated ``cost``: both checked against the single-device step first (raises
    ``AssertionError`` otherwise). One dict per schedule: ``ours_s`` / ``torch_s`` (median
    step, slowest rank), ``ratio`` (torch / ours), ``order`` (:func:`compare_orders` where
    torch has a ``pipeline_order``, else None) and ``like_for_like`` (False for ZB-H1, whose
    W torch's run leaves unpadded)."""
    from parlib.experiments.pipeline import gather_grads, run_pipeline
    from parlib.runtime import launch
    from parlib.verify import compare, reference_step

    cfg = cfg or ModelConfig(n_layers=max(p * v, ModelConfig().n_layers))
    ref = reference_step(cfg, seed=0, batch_size=batch_size)
    rows = []
    for name in schedules:
        vv = v if name == "interleaved" else 1
        ours = run_pipeline(cfg, name, p, m, v=vv, timeout=timeout, batch_size=batch_size,
                            cost=cost, repeats=repeats)
        theirs = launch(rank_torch_pipelining, cfg, schedule_name=name, m=m,
                        batch_size=batch_size, cost=cost, repeats=repeats, v=v,
                        world_size=p, timeout=timeout)
        for who, res in (("ours", ours), ("torch's", theirs)):
            same = compare(gather_grads(res), ref["grads"])
            if not same:
                raise AssertionError(f"{who} {name}: gradients differ from single-device: "
                                     f"{same}")
        runs = [align([r["spans"][k] for r in ours]) for k in range(repeats)]
        ours_s = statistics.median(makespan(s) for s in runs)
        torch_s = statistics.median(max(r["times"][k] for r in theirs) for k in range(repeats))
        order = theirs[0]["order"]
        rows.append({
            "schedule": name, "torch_class": TORCH_SCHEDULES[name], "ours_s": ours_s,
            "torch_s": torch_s, "ratio": torch_s / ours_s,
            "order": (compare_orders(all_ranks(name, p, m, vv), torch_orders_as_ops(order, p))
                      if order is not None else None),
            "like_for_like": name != "zb-h1"})
    return rows


def gpipe_backward_orders(p: int, m: int) -> dict[str, Any]:
    """Our GPipe (backwards m-1..0: the newest activations first) next to torch's
    ScheduleGPipe (backwards 0..m-1, in microbatch order): both whole schedules, each
    validated (both run to the end), and their peak in-flight activations per rank (the same:
    m on every rank, all forwards run before the first backward)."""
    ours = all_ranks("gpipe", p, m)
    torch_like = {r: [Op(FORWARD, i) for i in range(m)] + [Op(BACKWARD, i) for i in range(m)]
                  for r in range(p)}
    validate(ours, p, m)
    validate(torch_like, p, m)
    return {"ours": ours, "torch": torch_like, "peak_ours": peaks(ours),
            "peak_torch": peaks(torch_like)}


def format_gpipe_backward_orders(p: int, m: int) -> str:
    """:func:`gpipe_backward_orders` as text for the notebook."""
    cmp = gpipe_backward_orders(p, m)
    same_peak = cmp["peak_ours"] == cmp["peak_torch"]
    return "\n".join([
        f"GPipe, p = {p}, m = {m}, every rank:",
        f"  ours : {' '.join(map(repr, cmp['ours'][0]))}",
        f"  torch: {' '.join(map(repr, cmp['torch'][0]))}",
        f"  both valid; peak in flight per rank ours {cmp['peak_ours']}, torch "
        f"{cmp['peak_torch']}: {'the same' if same_peak else 'DIFFERENT'}",
    ])


__all__ = ["TORCH_SCHEDULES", "CostPadded", "compare_orders", "format_gpipe_backward_orders",
           "gpipe_backward_orders", "race_torch", "rank_torch_pipelining",
           "torch_orders_as_ops"]
