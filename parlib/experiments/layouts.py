"""The choosing chapter's experiment: layouts of the tiny model predicted by the cost model, then
run
with the combining chapter's code on the ranks here, side by side.

Two cores cannot run four devices at once, so each rank plays an **emulated device** of
``flops_per_second``: its real forward and backward run, then a sleep pads each to the time
such a device would take for the FLOPs this rank does (its layers split t ways, plus the
output layer on the last stage; the pipeline chapter's :class:`~parlib.measure.emulation.StageCost`,
now per FLOP). Under tensor parallelism each piece of compute between two all-reduces is
padded on its own (:class:`~parlib.measure.emulation.PacedCost`), so a rank reaches every
all-reduce when a real device would; time inside the all-reduces is not padded over.
Communication is real (gloo here), and
``link=(alpha, beta)`` adds an emulated slower link on top
(:class:`~parlib.measure.emulation.SlowLink`, which also slows the pipeline's sends).

The gradient sync is one flat all-reduce after backward (:class:`Bucketed` with a single
bucket), so the prediction uses ``estimate(..., dp_overlap=False)``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parlib.cost import Hardware, Layout, Model, estimate
from parlib.cost.estimate import Estimate, check_layout
from parlib.cost.layout import AXES
from parlib.cost.model import BACKWARD_PER_FORWARD
from parlib.experiments.combined import axis_traffic, stage_split_dims
from parlib.experiments.pipeline import MeasuringHooks
from parlib.measure.emulation import OVERRUN_SLACK, PacedCost, SlowLink, StageCost
from parlib.measure.links import LinkFit, fit_link, timed_all_reduces
from parlib.measure.memory import SavedActivations, grad_bytes, optimizer_state_bytes, param_bytes
from parlib.measure.timeline import Recorder
from parlib.model import ModelConfig, build_model, make_batch, train_step
from parlib.runtime.policy import device as this_device
from parlib.strategies.combined import build_3d, train_step_3d
from parlib.strategies.data import Bucketed
from parlib.strategies.mesh import Mesh
from parlib.strategies.tensor import shard_of
from parlib.verify import close


@dataclass(frozen=True)
class Run:
    """One layout as this experiment runs it: the :class:`~parlib.cost.Layout` (or a mapping
    from axis name to size) and ``m``, the microbatches per data-parallel rank.
    ``str(run)`` is the layout's name ("t=2 x d=2")."""

    layout: Layout
    m: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout.of(self.layout))
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 1:
            raise ValueError(f"{self.layout}: m={self.m!r} microbatches must be a whole "
                             f"number >= 1")

    def __str__(self) -> str:
        return str(self.layout)


# Six ways to lay the tiny model on 4 ranks.
LAYOUTS: tuple[Run, ...] = (
    Run(Layout(dp=4), m=1),
    Run(Layout(dp=2, tp=2), m=1),
    Run(Layout(dp=2, pp=2), m=4),
    Run(Layout(pp=4), m=4),
    Run(Layout(tp=4), m=1),
    Run(Layout(tp=2, pp=2), m=4),
)


def make_adam(params: Sequence[torch.Tensor] | Any) -> torch.optim.Optimizer:
    """Adam, whose two moments are what the cost model's memory counts (8 bytes per fp32
    parameter), in its fused form: one pass over the parameters, the fastest on CPU too."""
    return torch.optim.Adam(params, lr=1e-3, fused=True)


def _check_layouts(runs: Sequence[Run], world_size: int, cfg: ModelConfig,
                   global_batch: int) -> None:
    model = Model.from_config(cfg)
    for run in runs:
        if not isinstance(run, Run):
            raise ValueError(f"a layout to run is a Run(Layout(...), m=...), got {run!r}")
        layout = run.layout
        if layout.world != world_size:
            product = " x ".join(a.symbol for a in AXES)
            raise ValueError(f"{layout}: {product} = {layout.world}, not the {world_size} "
                             f"ranks")
        try:  # the cost model's rules: heads, layers and batch divide evenly
            check_layout(model, world_size, layout, m=run.m, global_batch=global_batch)
        except ValueError as err:
            raise ValueError(f"{layout}: {err}") from None


# --------------------------------------------------------------------------- on the ranks


def _nothing() -> None:
    pass


def emulated_device(model: Model, layout: Layout, *, last: bool,
                    flops_per_second: float) -> StageCost | PacedCost:
    """The emulated compute of one rank of ``layout``: ``model.n_layers / pp`` layers split
    t = ``layout.tp`` ways (and the output layer if ``last``). With t > 1 each layer's
    attention and MLP halves end in an all-reduce, so the compute is paced at those points:
    forward runs attention, MLP, attention, MLP, ... then the output layer; backward runs
    the output layer and the last MLP, then attention, MLP, ... back to the first attention.
    Backward pieces cost ``BACKWARD_PER_FORWARD`` times their forward."""
    t, layers, s = layout.tp, model.n_layers // layout.pp, model.seq_len
    head = model.rank_forward_flops_per_token(layers=0, head=last) * s
    if t == 1:
        return StageCost.for_flops(model.rank_forward_flops_per_token(
            layers=layers, head=last) * s, flops_per_second)
    attention, mlp = (f * s for f in model.layer_forward_flops_per_token(t))
    forward = [attention, mlp] * layers + [head]
    backward = [head + mlp] + [attention, mlp] * (layers - 1) + [attention, 0.0]
    return PacedCost(forward, [BACKWARD_PER_FORWARD * f for f in backward], flops_per_second)


def _parts(rec: Recorder, took: float) -> dict[str, float]:
    """Seconds of one step by kind: compute (forward and backward, emulated padding
    included, the all-reduces inside them not), tp, recv (waiting for a neighbour, link
    time included), dp, and other (the optimizer step, copies, a pipeline's sends and the
    wait for them at the end of the step, the rest)."""
    total = {k: 0.0 for k in ("compute", "tp", "recv", "dp")}
    for span in rec.spans:
        kind = "compute" if span.kind in ("forward", "backward") else span.kind
        if kind in total:
            total[kind] += span.duration
    total["compute"] -= total["tp"]
    total["other"] = took - sum(total.values())
    return total


class _CountedCost:
    """An emulated cost that counts the pads where real compute overran the emulated time."""

    def __init__(self, cost: StageCost | PacedCost) -> None:
        self.cost, self.calls, self.overruns = cost, 0, 0

    def start(self, *args: Any) -> float:
        return self.cost.start(*args)

    def pad(self, *args: Any, **kwargs: Any) -> float:
        left = self.cost.pad(*args, **kwargs)
        self.calls += 1
        self.overruns += left < -OVERRUN_SLACK
        return left

    @property
    def late(self) -> int:
        """Overruns: at the ends of forwards and backwards, and (paced) at all-reduces."""
        return self.overruns + getattr(self.cost, "late", 0)

    @property
    def pieces(self) -> int:
        """Pieces of emulated compute: forwards and backwards, and the paced pieces."""
        return self.calls + getattr(self.cost, "points", 0)


def rank_time_layouts(layouts: Sequence[Run] = LAYOUTS, *,
                      cfg: ModelConfig | None = None, global_batch: int = 8,
                      flops_per_second: float | None, link: tuple[float, float] | None = None,
                      reference: dict[str, Any],
                      repeats: int = 5, warmup: int = 1, seed: int = 0) -> list[dict[str, Any]]:
    """Run on every rank of ``parlib.launch``: for each layout, one step checked against
    ``reference`` (:func:`parlib.verify.reference_step` on the full batch; compared with
    :func:`parlib.verify.close`), with its memory measured, then ``warmup`` + ``repeats``
    timed steps.

    ``flops_per_second``: the emulated device's rate (None: real compute, for one device
    per rank). ``link``: (alpha, beta) of an emulated slower link added to every message.
    Returns one dict per layout: ``layout`` and ``m`` (the run's), ``seconds`` (per timed
    step, this rank), ``memory`` (params, grads, optimizer, activations: bytes), ``worst``
    (largest gradient error), ``ok``, ``pieces`` and ``overruns`` (pieces of emulated
    compute, and those the real compute outlasted).
    """
    cfg = cfg or ModelConfig()
    world = dist.get_world_size()
    _check_layouts(layouts, world, cfg, global_batch)
    dev = this_device()
    shape = Model.from_config(cfg)
    out = []
    for run in layouts:
        layout, m = run.layout, run.m
        mesh = Mesh(layout)
        stage = build_3d(mesh, cfg, seed, dev)
        params = list(stage.parameters())
        optimizer = make_adam(params)
        # one flat all-reduce of every gradient (nothing to pool for d = 1)
        sync = (Bucketed(params, bucket_mb=1e9, group=mesh.group("dp"), first_bucket_mb=None)
                if layout.dp > 1 else _nothing)

        # 1. one step, checked against the single device, with its memory measured
        tokens, targets = make_batch(global_batch, cfg, 0, seed)
        tracker = SavedActivations(stage)
        train_step_3d(stage, mesh, optimizer, tokens.to(dev), targets.to(dev), m,
                      hooks=MeasuringHooks(stage.rank, memory=tracker), sync=sync,
                      mean_loss=False)
        worst, ok = 0.0, True
        dims = stage_split_dims(stage)
        for name, g in stage.grads().items():
            want = shard_of(reference["grads"][name], dims[name], mesh.coord("tp"), layout.tp)
            g = g.detach().cpu()
            worst = max(worst, (g - want).abs().max().item())
            ok = ok and close(g, want)
        memory = {"params": param_bytes(params), "grads": grad_bytes(params),
                  "optimizer": optimizer_state_bytes(optimizer),
                  "activations": tracker.peak}

        # 2. timed steps on the emulated device (and link)
        device_cost = (None if flops_per_second is None else
                       emulated_device(shape, layout, last=stage.is_last,
                                       flops_per_second=flops_per_second))
        cost = _CountedCost(device_cost) if device_cost is not None else None
        pacer = device_cost if isinstance(device_cost, PacedCost) else None
        seconds, parts = [], []
        with SlowLink(*link) if link else nullcontext():
            for step in range(warmup + repeats):
                tokens, targets = make_batch(global_batch, cfg, step + 1, seed)
                rec = Recorder(mesh.rank, dev)
                with axis_traffic(mesh, rec, pacer):  # times the all-reduces; pads skip them
                    dist.barrier()
                    start = time.perf_counter()
                    hooks = MeasuringHooks(stage.rank, rec, cost)
                    train_step_3d(stage, mesh, optimizer, tokens.to(dev), targets.to(dev), m,
                                  hooks=hooks, sync=sync, mean_loss=False)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    took = time.perf_counter() - start
                if step >= warmup:
                    seconds.append(took)
                    parts.append(_parts(rec, took))
        out.append({"layout": layout, "m": m, "seconds": seconds, "parts": parts, "memory": memory,
                    "worst": worst, "ok": ok, "pieces": cost.pieces if cost else 0,
                    "overruns": cost.late if cost else 0})
        dist.barrier()
        if dist.get_rank() == 0:  # progress: a launch of all six layouts takes minutes
            print(f"layout {len(out)} of {len(layouts)}, {layout}: checked, median step "
                  f"{statistics.median(seconds) * 1e3:.0f} ms", flush=True)
    return out


PACED_SIZES = tuple(2**k for k in range(10, 23, 3))  # 1 KiB to 4 MiB, as the quick fit
PAUSE = 2e-3  # seconds each rank sleeps before a timed all-reduce
# Timed calls per size: the calls' times have a long tail here (a rank descheduled by other
# work), and a step pays every call's, so the fit takes their mean, which needs many.
PACED_ROUNDS = 15


def rank_time_paced_all_reduce(sizes_bytes: Sequence[int], *, rounds: int = PACED_ROUNDS,
                               pause: float = PAUSE) -> tuple[list[list[float]], str, str]:
    """Run on every rank: all-reduce times as a paced layer issues them. Each call follows a
    barrier and a ``pause``-second sleep, so every rank arrives woken from a sleep, as it
    does at a tensor-parallel all-reduce after its padded compute (the launching chapter's
    fit calls straight after the barrier). Sizes interleaved over ``rounds``. Returns this
    rank's seconds per size (one per round), the device and the backend."""
    if rounds < 1 or not pause >= 0:
        raise ValueError(f"need rounds >= 1 and pause >= 0 s, got {rounds!r}, {pause!r}")
    dev = this_device()
    times = timed_all_reduces(sizes_bytes, dev, rounds=rounds, pause=pause)
    return times, str(dev), dist.get_backend()


# --------------------------------------------------------------------------- in the kernel


# The emulated device runs at one thread's rate over this: slow enough that four ranks'
# real compute, sharing two cores with whatever else runs, fits inside the padding.
SLOWDOWN = 16
# The emulated slow link moves one byte in the time the emulated device does this many
# FLOPs, so that bytes weigh as much against compute whatever this machine's rate is.
SLOW_LINK_FLOPS_PER_BYTE = 800


@dataclass(frozen=True)
class MeasuredRate:
    """FLOP/s of the tiny model's training step, one figure per timed step (``samples``),
    measured with ``threads`` threads."""

    samples: tuple[float, ...]
    threads: int

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """The lower and upper quartile of the samples."""
        if len(self.samples) < 2:
            return self.median, self.median
        q = statistics.quantiles(self.samples, n=4)
        return q[0], q[2]

    @property
    def spread(self) -> float:
        """Interquartile range over the median."""
        low, high = self.quartiles
        return (high - low) / self.median

    def describe(self) -> str:
        low, high = self.quartiles
        thread = "thread" if self.threads == 1 else "threads"
        return (f"{self.median / 1e9:.1f} GFLOP/s with {self.threads} {thread} (median of "
                f"{len(self.samples)} steps; quartiles {low / 1e9:.1f} to {high / 1e9:.1f}, "
                f"spread {self.spread:.0%})")


def paced_link_fit(launch: Any, world_size: int, *, sizes: Sequence[int] = PACED_SIZES,
                   rounds: int = PACED_ROUNDS, pause: float = PAUSE,
                   **launch_kwargs: Any) -> LinkFit:
    """The link as the paced layers use it: :func:`rank_time_paced_all_reduce` on
    ``world_size`` ranks (``launch`` is ``parlib.launch``); per size, the slowest rank's
    time of each round, averaged over the rounds (a step pays the sum of its calls, long
    ones included, so the mean, not the median), fitted to the alpha-beta line as the
    launching chapter fits it. The fit's ``spread`` holds, per size, the interquartile
    range of the rounds over their median."""
    results = launch(rank_time_paced_all_reduce, list(sizes), rounds=rounds, pause=pause,
                     world_size=world_size, **launch_kwargs)
    per_size = zip(*(r[0] for r in results))  # per size: every rank's times by round
    slowest = [[max(by_rank) for by_rank in zip(*ranks)] for ranks in per_size]
    mean = [statistics.fmean(rounds_) for rounds_ in slowest]
    spread = [_spread(rounds_) for rounds_ in slowest]
    _, dev, backend = results[0]
    return fit_link(world_size, list(sizes), mean, spread=spread, device=dev,
                    backend=backend)


def _spread(samples: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    q = statistics.quantiles(samples, n=4)
    return (q[2] - q[0]) / statistics.median(samples)


def measure_rate(cfg: ModelConfig | None = None, *, global_batch: int = 8, repeats: int = 21,
                 threads: int = 1, seed: int = 0) -> MeasuredRate:
    """FLOP/s of the whole model's training step in this process, with ``threads`` threads
    (each rank of a 4-rank launch on a small machine gets one), over ``repeats`` timed
    steps, counting the cost model's FLOPs (``Model.flops_per_token``)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: need a whole number of timed steps >= 1")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r}: need a whole number of threads >= 1")
    cfg = cfg or ModelConfig()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(cfg, seed)
        optimizer = make_adam(model.parameters())
        x, y = make_batch(global_batch, cfg, 0, seed)
        for _ in range(2):  # first calls: allocations, optimizer state
            train_step(model, optimizer, x, y)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            train_step(model, optimizer, x, y)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    flops = Model.from_config(cfg).flops_per_token * global_batch * cfg.seq_len
    return MeasuredRate(tuple(flops / s for s in seconds), threads)


def compute_rate(cfg: ModelConfig | None = None, *, global_batch: int = 8, repeats: int = 21,
                 threads: int = 1, seed: int = 0) -> float:
    """The median of :func:`measure_rate`: FLOP/s of the model's step with ``threads``
    threads."""
    return measure_rate(cfg, global_batch=global_batch, repeats=repeats, threads=threads,
                        seed=seed).median


def slow_link_beta(flops_per_second: float,
                   flops_per_byte: float = SLOW_LINK_FLOPS_PER_BYTE) -> float:
    """Seconds per byte of the emulated slow link: one byte takes as long as
    ``flops_per_byte`` FLOPs on a device of ``flops_per_second`` (rounded to two significant
    figures, so that it prints short; the prediction and the emulation use the same)."""
    if not flops_per_second > 0 or not flops_per_byte > 0:
        raise ValueError(f"need flops_per_second > 0 and flops_per_byte > 0, got "
                         f"{flops_per_second!r}, {flops_per_byte!r}")
    return float(f"{flops_per_byte / flops_per_second:.2g}")


def predict(layouts: Sequence[Run], cluster: Hardware, *,
            cfg: ModelConfig | None = None, global_batch: int = 8) -> list[Estimate]:
    """The cost model's estimate of each layout as this experiment runs it: fp32, Adam,
    no ZeRO, no recomputation, no sequence parallelism, the sync after backward, and the
    output layer as the course's code runs it: whole on every tensor-parallel rank of the
    last stage (``replicated_head``), which the emulated device charges too."""
    model = Model.from_config(cfg or ModelConfig())
    return [estimate(model, cluster, run.layout, m=run.m,
                     global_batch=global_batch, mixed_precision=False,
                     sequence_parallel=False, dp_overlap=False, replicated_head=True)
            for run in layouts]


def measured(results: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per layout, from every rank's :func:`rank_time_layouts` result: ``layout`` and
    ``m``, ``step_time`` (the median over steps of the slowest rank's time), ``spread``
    (interquartile range of those per-step times, over the median), ``memory`` (the rank
    holding the most: bytes by part), ``parts`` (seconds by kind, see ``_parts``: per kind
    the largest over ranks of its median over steps), ``ok``, ``worst``, ``overruns`` and
    ``pieces``."""
    rows = []
    for per_rank in zip(*results):
        steps = [max(times) for times in zip(*(r["seconds"] for r in per_rank))]
        med = statistics.median(steps)
        q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [med] * 3
        heaviest = max(per_rank, key=lambda r: sum(r["memory"].values()))
        parts = {k: max(statistics.median(step[k] for step in r["parts"]) for r in per_rank)
                 for k in per_rank[0]["parts"][0]}
        rows.append({"layout": per_rank[0]["layout"], "m": per_rank[0]["m"],
                     "step_time": med, "spread": (q[2] - q[0]) / med, "steps": steps,
                     "parts": parts, "memory": heaviest["memory"],
                     "ok": all(r["ok"] for r in per_rank),
                     "worst": max(r["worst"] for r in per_rank),
                     "overruns": sum(r["overruns"] for r in per_rank),
                     "pieces": sum(r["pieces"] for r in per_rank)})
    return rows


def rank_order(values: Sequence[float]) -> list[int]:
    """Indices of ``values`` from smallest to largest."""
    return sorted(range(len(values)), key=values.__getitem__)


def agreement(estimates: Sequence[Estimate], rows: Sequence[dict[str, Any]], *,
              band: float = 0.15, separated: float = 0.10) -> dict[str, Any]:
    """How far predictions and measurements agree: ``ratios`` (measured / predicted),
    ``within`` (how many ratios lie within 1 +- ``band``), ``pairs`` and ``pairs_same``
    (pairs of layouts, and those that prediction and measurement order alike),
    ``separated`` and ``separated_same`` (the same over the pairs the prediction puts more
    than ``separated`` apart), ``best`` (predicted, measured: the fastest layout's index)."""
    pred = [e.step_time for e in estimates]
    meas = [r["step_time"] for r in rows]
    ratios = [m / p for m, p in zip(meas, pred)]
    pairs = [(i, j) for i in range(len(pred)) for j in range(i + 1, len(pred))]
    same = [(i, j) for i, j in pairs if (pred[i] < pred[j]) == (meas[i] < meas[j])]
    apart = [(i, j) for i, j in pairs
             if max(pred[i], pred[j]) > (1 + separated) * min(pred[i], pred[j])]
    return {"ratios": ratios, "within": sum(abs(r - 1) <= band for r in ratios),
            "pairs": len(pairs), "pairs_same": len(same), "separated": len(apart),
            "separated_same": len(set(apart) & set(same)),
            "best": (rank_order(pred)[0], rank_order(meas)[0])}


def table(estimates: Sequence[Estimate], rows: Sequence[dict[str, Any]]) -> str:
    """Predicted against measured step time (ms) and memory (MiB) per layout, under a
    header that spells out each column."""
    lines = [f"{'':<10} {'step time, ms':^38}   {'model states, MiB':^19} "
             f"{'activations, MiB':^19}",
             f"{'layout':<10} {'predicted':>9} {'measured':>9} {'spread':>7} {'meas/pred':>10}   "
             f"{'measured':>9} {'predicted':>9} {'measured':>9} {'predicted':>9}"]
    for e, r in zip(estimates, rows):
        mem = r["memory"]
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        pred_states = e.memory["params"] + e.memory["grads"] + e.memory["optimizer"]
        pred_act = e.memory["activations"] + e.memory["pipeline_in_flight"]
        lines.append(
            f"{r['layout']:<10} {e.step_time * 1e3:>9.0f} "
            f"{r['step_time'] * 1e3:>9.0f} {r['spread']:>7.0%} "
            f"{r['step_time'] / e.step_time:>10.2f}   {states / 2**20:>9.2f} "
            f"{pred_states / 2**20:>9.2f} {mem['activations'] / 2**20:>9.2f} "
            f"{pred_act / 2**20:>9.2f}")
    lines.append("spread: interquartile range of the timed steps over their median; "
                 "meas/pred: measured / predicted")
    return "\n".join(lines)


def parts_table(estimates: Sequence[Estimate], rows: Sequence[dict[str, Any]]) -> str:
    """Where the step goes (ms), predicted / measured: compute, tensor-parallel all-reduces,
    pipeline (bubble and sends predicted; waiting to receive measured), gradient sync, and
    the rest (measured only: optimizer step, copies, a pipeline's sends)."""
    heads = ("compute", "tensor-par.", "pipeline", "grad. sync")
    lines = ["ms per step, predicted / measured",
             f"{'layout':<10} " + " ".join(f"{h:>11}" for h in heads) + f" {'other':>6}"]
    for e, r in zip(estimates, rows):
        pred = {"compute": e.time["compute"], "tp": e.time["tp_comm"],
                "recv": e.time["pp_bubble"] + e.time["pp_send"], "dp": e.time["dp_sync"]}
        cells = [f"{pred[k] * 1e3:>5.0f}/{r['parts'][k] * 1e3:<5.0f}" for k in pred]
        lines.append(f"{r['layout']:<10} {' '.join(cells)} "
                     f"{r['parts']['other'] * 1e3:>6.0f}")
    lines.append("tensor-par.: tensor-parallel all-reduces; pipeline: bubble and boundary "
                 "sends (measured: waiting to receive); grad. sync: the data-parallel "
                 "all-reduce; other: measured only (optimizer step, copies, a pipeline's "
                 "sends)")
    return "\n".join(lines)


__all__ = [
    "LAYOUTS",
    "MeasuredRate",
    "PACED_ROUNDS",
    "PACED_SIZES",
    "PAUSE",
    "Run",
    "SLOWDOWN",
    "SLOW_LINK_FLOPS_PER_BYTE",
    "agreement",
    "compute_rate",
    "emulated_device",
    "make_adam",
    "measure_rate",
    "measured",
    "paced_link_fit",
    "parts_table",
    "predict",
    "rank_order",
    "rank_time_layouts",
    "rank_time_paced_all_reduce",
    "slow_link_beta",
    "table",
]
