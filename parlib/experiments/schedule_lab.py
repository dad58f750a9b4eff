"""The pipeline schedule lab: every schedule run on real ranks next to its simulation and
its formula.

For each schedule (GPipe, 1F1B, interleaved, ZB-H1) :func:`run_schedule_lab` runs one
training step on p ranks under an *emulated* stage cost (a sleep pads each op to the time
of its rows, :class:`parlib.measure.emulation.StageCost`), after checking its gradients
against the single-device model, and returns a :class:`LabRun` per schedule: the measured
timeline (the median of the repeats) next to the simulated one, and four numbers each
measured and predicted:

* step time -- measured: the median makespan of the repeats (with their spread);
  predicted: :func:`parlib.cost.schedule_step_time`, compute plus each boundary crossing on
  the critical path charged at the alpha-beta time of a header and a payload message, plus
  the rank's own time in each send and receive (one crossing's time each, by default);
* bubble -- idle fraction of the step (communication counts as idle); predicted from the
  same formula: 1 - the ranks' compute / (p x predicted step);
* peak in-flight activations per rank -- measured from the ops as they ran (a (microbatch,
  chunk) is held from the start of its forward to the end of its backward, or of its W
  when the backward is split); predicted from the schedule's op lists; the table counts
  them in microbatches of a whole stage (an interleaved chunk's count 1/v);
* messages sent per rank -- measured: the send spans the runner recorded; predicted:
  :func:`parlib.cost.messages_per_rank`.

:func:`lab_table` / :func:`format_lab_table` put them side by side and
:func:`parlib.plots.draw_schedule_lab` draws the timelines.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from parlib import cost as formulas
from parlib.experiments import pipeline as pp_runs
from parlib.experiments.simulate import simulate
from parlib.measure.crossings import CrossingFit
from parlib.measure.emulation import StageCost
from parlib.measure.timeline import COMPUTE, Span, align, makespan, measured_bubble
from parlib.model import ModelConfig
from parlib.strategies.schedules import Op, all_ranks, peak_in_flight, peaks
from parlib.verify import compare, reference_step

LAB_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
DEFAULT_COST = StageCost(forward=0.01, backward=0.02, per_call=0.002)


def schedule_label(name: str, v: int = 2) -> str:
    """How the lab names a schedule: 'GPipe', '1F1B', 'interleaved v=2', 'ZB-H1'."""
    return {"gpipe": "GPipe", "1f1b": "1F1B", "zb-h1": "ZB-H1"}.get(
        name, f"interleaved v={v}" if name == "interleaved" else name)


@dataclass
class Prediction:
    """What the formulas say for one schedule: the op times (s, each with the emulation's
    slack), the time of a boundary crossing and of a rank's own part of a message (s), the
    step time (s) and its message part, the bubble, peak in-flight activations and messages
    per rank."""

    t_f: float
    t_b: float
    t_w: float
    t_cross: float
    t_local: float
    step: float
    message_part: float
    bubble: float
    peak_in_flight: dict[int, int]
    messages: dict[int, int]


def message_costs(fit: CrossingFit, payload_bytes: float,
                  overrun: float = 0.0) -> dict[str, float]:
    """The measured crossing ``fit`` (:func:`parlib.measure.crossings.measure_crossings`) as
    :func:`predict` takes it for a payload of this size: ``t_cross`` (the latency) and
    ``t_local`` (a rank's own time per message), with ``t_slack`` = ``overrun``, an
    emulated op's measured overrun (:func:`parlib.experiments.pipeline.emulated_overrun`)."""
    return {"t_cross": fit.latency(payload_bytes), "t_local": fit.own_time(payload_bytes),
            "t_slack": overrun}


def predict(name: str, p: int, m: int, batch: int, stage_cost: StageCost, *, v: int = 2,
            weight_share: float = 0.5, t_cross: float = 0.0,
            t_local: float | None = None, t_slack: float = 0.0) -> Prediction:
    """The formulas' numbers for ``name`` on p ranks, m microbatches of a ``batch``-row
    batch, under ``stage_cost`` (v chunks for the interleaved schedule; ``weight_share`` of
    ZB-H1's backward is W), each boundary crossing taking ``t_cross`` seconds, each send
    or receive ``t_local`` seconds of the rank's own time (default: t_cross) and each
    emulated op ``t_slack`` seconds more than its due time (:func:`message_costs` gives
    all three from a measured crossing)."""
    vv = v if name == "interleaved" else 1
    share = weight_share if name == "zb-h1" else 0.0
    t_f, t_b, t_w = formulas.op_times(batch, m, stage_cost.forward, stage_cost.backward,
                                      stage_cost.per_call, vv, share)
    if t_slack < 0:
        raise ValueError(f"t_slack must be >= 0, got {t_slack}")
    t_f, t_b = t_f + t_slack, t_b + t_slack
    t_w = t_w + t_slack if t_w else 0.0
    t_local = t_cross if t_local is None else t_local
    step = formulas.schedule_step_time(name, p, m, t_f, t_b, t_w, vv, t_cross, t_local)
    compute = formulas.schedule_compute_time(name, p, m, t_f, t_b, t_w, vv)
    busy = vv * m * (t_f + t_b + t_w)  # every rank runs every op of its stage once
    sched = all_ranks(name, p, m, vv) if name == "interleaved" else all_ranks(name, p, m)
    return Prediction(t_f, t_b, t_w, t_cross, t_local, step, step - compute,
                      1 - busy / step if step > 0 else 0.0, peaks(sched),
                      formulas.messages_per_rank(name, p, m, vv))


def measured_peak_in_flight(spans_by_rank: Sequence[Sequence[Span]]) -> dict[int, int]:
    """Most (microbatch, chunk) activations each rank held at once in a recorded step:
    held from the start of a forward span to the end of its backward span, or of its
    weight span when the rank split its backward. A rank runs its ops one after another,
    so the ops in the order they started give the schedule's own count
    (:func:`~parlib.strategies.schedules.peak_in_flight`) of what ran."""
    out = {}
    for rank, spans in enumerate(spans_by_rank):
        ran = sorted((x for x in spans if x.kind in COMPUTE), key=lambda x: x.start)
        out[rank] = peak_in_flight([Op(x.kind, x.mb, x.chunk) for x in ran])
    return out


def measured_messages(spans_by_rank: Sequence[Sequence[Span]]) -> dict[int, int]:
    """Payload messages each rank sent in a recorded step (one send span per payload; the
    header before it travels inside the same span)."""
    return {r: sum(x.kind == "send" for x in spans) for r, spans in enumerate(spans_by_rank)}


@dataclass
class LabRun:
    """One schedule in the lab: its ``measured`` timeline (median repeat, spans per rank,
    seconds from the step's start) and ``simulated`` one (the simulator with the same op
    times and message time), the step time of every repeat, the gradient check, and the
    measured and predicted numbers."""

    name: str
    p: int
    m: int
    v: int
    measured: list[list[Span]]
    simulated: list[list[Span]]
    steps: list[float]
    prediction: Prediction
    gradients: str
    device: str = "cpu"
    backend: str = "gloo"

    @property
    def title(self) -> str:
        return schedule_label(self.name, self.v)

    @property
    def step(self) -> float:
        """Median measured step time (s)."""
        return statistics.median(self.steps)

    @property
    def spread(self) -> tuple[float, float]:
        """Fastest and slowest repeat (s)."""
        return min(self.steps), max(self.steps)

    @property
    def bubble(self) -> float:
        return measured_bubble(self.measured)

    @property
    def peak_in_flight(self) -> dict[int, int]:
        return measured_peak_in_flight(self.measured)

    @property
    def messages(self) -> dict[int, int]:
        return measured_messages(self.measured)

    @property
    def ratio(self) -> float:
        """Measured over predicted step time."""
        return self.step / self.prediction.step


def lab_config(p: int, v: int = 2, *, seq_len: int = 32, d_model: int = 64) -> ModelConfig:
    """The model the lab runs: p x v blocks, so every rank holds v chunks of one block, and
    narrower and shorter than the course's default (s = 32, h = 64), so that its real
    compute stays a small part of each emulated op: on two cores shared by four ranks, the
    default model's real backward took about a sixth of its emulated time, and ranks
    computing at once delayed each other's messages (bench/pp.py's worst ratio to theory
    1.09-1.10 with it here, 1.03-1.05 with this one)."""
    return ModelConfig(n_layers=p * v, seq_len=seq_len, d_model=d_model)


def run_schedule_lab(
    schedules: Sequence[str] = LAB_SCHEDULES,
    *,
    p: int = 4,
    m: int = 8,
    batch: int = 8,
    stage_cost: StageCost = DEFAULT_COST,
    v: int = 2,
    weight_share: float = 0.5,
    alpha: float = 0.0,
    beta: float = 0.0,
    crossings: CrossingFit | None = None,
    repeats: int = 3,
    cfg: ModelConfig | None = None,
    timeout: float = 300.0,
) -> list[LabRun]:
    """Run each of ``schedules`` on p ranks (m microbatches of a ``batch``-row batch, the
    emulated ``stage_cost``, v chunks for the interleaved one, ``weight_share`` of ZB-H1's
    backward as W) ``repeats`` times after one warm-up step; raise ``AssertionError`` if its
    gradients differ from the single-device model's. ``crossings``: a crossing measured
    with :func:`parlib.measure.crossings.measure_crossings`, which prices the messages in
    the prediction and the simulation (its latency and each rank's own time per message,
    with the emulated ops' overrun measured now,
    :func:`parlib.experiments.pipeline.emulated_overrun`); without it, ``alpha`` (s) and
    ``beta`` (s/byte) of a link fit price each crossing and each rank's own part of a
    message alike. Returns one :class:`LabRun` each. A schedule that cannot run with these
    numbers (interleaved with m not a multiple of p, an unknown name) raises ``ValueError``
    before any rank starts."""
    cfg = cfg or lab_config(p, v)
    payload = formulas.boundary_bytes(batch // m, cfg.seq_len, cfg.d_model)
    if crossings is not None:
        overrun = (pp_runs.emulated_overrun(stage_cost, batch // m)
                   if isinstance(stage_cost, StageCost) else 0.0)
        priced = message_costs(crossings, payload, overrun)
    else:
        priced = {"t_cross": formulas.crossing_time(payload, alpha, beta)
                  if alpha or beta else 0.0}
    ref = reference_step(cfg, seed=0, batch_size=batch)
    out = []
    for name in schedules:
        pred = predict(name, p, m, batch, stage_cost, v=v, weight_share=weight_share,
                       **priced)
        vv = v if name == "interleaved" else 1
        res = pp_runs.run_pipeline(cfg, name, p, m, v=vv, timeout=timeout, batch_size=batch,
                                   cost=stage_cost, repeats=repeats,
                                   weight_share=weight_share)
        same = compare(pp_runs.gather_grads(res), ref["grads"])
        if not same:
            raise AssertionError(f"{schedule_label(name, v)}, m={m}: gradients differ from "
                                 f"the single-device model's: {same}")
        runs = [align([r["spans"][k] for r in res]) for k in range(repeats)]
        runs.sort(key=makespan)
        steps = [makespan(s) for s in runs]
        # the simulator takes a whole stage's times (it divides them among the v chunks);
        # each F and B carries its rank's own message time
        extra = formulas.messages_per_op(p, vv) * pred.t_local
        t_f, t_b = pred.t_f + extra, pred.t_b + extra
        sim = simulate(name, p, m, v=vv, t_f=t_f * vv, t_b=(t_b + pred.t_w) * vv,
                       t_w=pred.t_w * vv if pred.t_w else None, t_comm=pred.t_cross)
        out.append(LabRun(name, p, m, vv, runs[len(runs) // 2], sim, steps, pred, str(same),
                          res[0]["device"], res[0]["backend"]))
    return out


def lab_table(runs: Sequence[LabRun]) -> list[dict[str, Any]]:
    """One row per schedule: step time (ms, measured median and its spread, predicted),
    bubble, peak in-flight activations (most over ranks) and messages (all ranks), each
    measured and predicted. Peaks are in microbatches of a whole stage, whatever the
    schedule: a microbatch in one of an interleaved rank's v chunks holds 1/v of the
    stage's layers, so it counts 1/v (an interleaved 8 chunk-microbatches is 4)."""
    rows = []
    for run in runs:
        pred = run.prediction
        fast, slow = run.spread
        per_rank = {r: k / run.v for r, k in run.peak_in_flight.items()}
        rows.append({
            "schedule": run.title,
            "step_ms": run.step * 1e3,
            "step_spread_ms": (fast * 1e3, slow * 1e3),
            "step_ms_predicted": pred.step * 1e3,
            "ratio": run.ratio,
            "bubble": run.bubble,
            "bubble_predicted": pred.bubble,
            "peak_in_flight": max(per_rank.values()),
            "peak_in_flight_predicted": max(pred.peak_in_flight.values()) / run.v,
            "peak_in_flight_per_rank": per_rank,
            "messages": sum(run.messages.values()),
            "messages_predicted": sum(pred.messages.values()),
            "messages_per_rank": run.messages,
        })
    return rows


def format_lab_table(runs: Sequence[LabRun]) -> str:
    """:func:`lab_table` as aligned text, measured / predicted in each column (peaks in
    stage-microbatches)."""
    head = (f"{'schedule':<17}{'step ms (min-max)':>22}{'predicted':>11}{'ratio':>7}"
            f"{'bubble':>15}{'peak, stage-mb':>16}{'messages':>12}")
    lines = [head]
    for row in lab_table(runs):
        fast, slow = row["step_spread_ms"]
        lines.append(
            f"{row['schedule']:<17}"
            + f"{row['step_ms']:.1f} ({fast:.0f}-{slow:.0f})".rjust(22)
            + f"{row['step_ms_predicted']:>11.1f}{row['ratio']:>7.3f}"
            + f"{row['bubble']:.3f} / {row['bubble_predicted']:.3f}".rjust(15)
            + f"{row['peak_in_flight']:g} / {row['peak_in_flight_predicted']:g}".rjust(16)
            + f"{row['messages']} / {row['messages_predicted']}".rjust(12))
    return "\n".join(lines)


__all__ = ["DEFAULT_COST", "LAB_SCHEDULES", "LabRun", "Prediction", "format_lab_table",
           "lab_config", "lab_table", "measured_messages", "measured_peak_in_flight",
           "message_costs", "predict", "run_schedule_lab", "schedule_label"]
