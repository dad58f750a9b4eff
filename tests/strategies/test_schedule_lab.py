"""The schedule lab (measured next to simulated and predicted), its plot, and the race with
torch.distributed.pipelining's own schedules."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import pytest

from parlib import cost
from parlib.experiments import schedule_lab as lab
from parlib.experiments import torch_pipelining as tp
from parlib.experiments.simulate import simulate
from parlib.measure.emulation import StageCost
from parlib.measure.timeline import Span, makespan
from parlib.model import ModelConfig
from parlib.strategies.schedules import BACKWARD, FORWARD, Op, all_ranks

matplotlib.use("Agg")

CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
COST = StageCost(forward=0.004, backward=0.008, per_call=0.001)


def test_measured_peak_and_messages_from_spans():
    spans = [[Span(0, "forward", 0, 1, 0), Span(0, "send", 1, 1.1, 0),
              Span(0, "forward", 1, 2, 1), Span(0, "send", 2, 2.1, 1),
              Span(0, "backward", 3, 4, 1), Span(0, "backward", 4, 5, 0)],
             [Span(1, "forward", 1, 2, 0), Span(1, "backward", 2, 3, 0),  # split: W releases
              Span(1, "forward", 3, 4, 1), Span(1, "weight", 4, 5, 0),
              Span(1, "backward", 5, 6, 1), Span(1, "weight", 6, 7, 1)]]
    assert lab.measured_peak_in_flight(spans) == {0: 2, 1: 2}
    assert lab.measured_messages(spans) == {0: 2, 1: 0}
    one_at_a_time = [[Span(0, "forward", 0, 1, 0), Span(0, "backward", 1, 2, 0),
                      Span(0, "forward", 2, 3, 1), Span(0, "backward", 3, 4, 1)]]
    assert lab.measured_peak_in_flight(one_at_a_time) == {0: 1}


def test_prediction_comes_from_the_cost_formulas():
    pred = lab.predict("zb-h1", 4, 8, 8, StageCost(0.01, 0.02, 0.002), t_cross=1e-3)
    t_f, t_b, t_w = cost.op_times(8, 8, 0.01, 0.02, 0.002, 1, 0.5)
    assert (pred.t_f, pred.t_b, pred.t_w) == pytest.approx((t_f, t_b, t_w))
    assert pred.step == pytest.approx(cost.schedule_step_time("zb-h1", 4, 8, t_f, t_b, t_w,
                                                              1, 1e-3, 1e-3))
    # 12 crossings on the critical path, and 11 slots of an F and a B with 2 messages each
    assert pred.message_part == pytest.approx(12e-3 + 11 * 2 * 2 * 1e-3)
    latency_only = lab.predict("zb-h1", 4, 8, 8, StageCost(0.01, 0.02, 0.002), t_cross=1e-3,
                               t_local=0.0)
    assert latency_only.message_part == pytest.approx(12e-3)
    assert pred.peak_in_flight == {0: 4, 1: 4, 2: 4, 3: 4}
    assert pred.messages == {0: 8, 1: 16, 2: 16, 3: 8}
    busy = 8 * (t_f + t_b + t_w)
    assert pred.bubble == pytest.approx(1 - busy / pred.step)


def test_emulated_overrun_is_small_and_positive():
    from parlib.experiments.pipeline import emulated_overrun

    over = emulated_overrun(StageCost(0.002, 0.004, 0.001), rows=1, repeats=5)
    assert 0 <= over < 0.02  # a 3 ms op: its sleep and the hooks add well under 20 ms
    with pytest.raises(ValueError, match="repeats"):
        emulated_overrun(COST, 1, repeats=0)


def test_measured_crossing_prices_latency_own_time_and_slack():
    from parlib.measure.crossings import CrossingFit

    # the whole crossing 0.5 ms, of which 0.3 ms posting the sends: a 0.2 ms latency
    fit = CrossingFit(alpha=5e-4, beta=0.0, send_alpha=3e-4, send_beta=0.0, receive=1e-4)
    priced = lab.message_costs(fit, 4096, overrun=1e-4)
    assert priced == pytest.approx({"t_cross": 2e-4, "t_local": 2e-4, "t_slack": 1e-4})
    pred = lab.predict("gpipe", 4, 8, 8, StageCost(0.01, 0.02, 0.002), **priced)
    # hand-worked: F 12 ms, B 22 ms, each + 0.1 ms slack; 11 slots of an F and a B, each op
    # with 2 messages of 0.2 ms; 6 crossings of 0.2 ms on the critical path
    assert pred.t_f == pytest.approx(12.1e-3) and pred.t_b == pytest.approx(22.1e-3)
    assert pred.step == pytest.approx(11 * (34.2e-3 + 4 * 0.2e-3) + 6 * 0.2e-3)
    with pytest.raises(ValueError, match="t_slack"):
        lab.predict("gpipe", 4, 8, 8, StageCost(0.01, 0.02, 0.002), t_slack=-1.0)


def test_lab_table_measured_from_the_run_predicted_from_cost():
    runs = lab.run_schedule_lab(("1f1b", "interleaved"), p=2, m=2, batch=4, stage_cost=COST,
                                repeats=1, alpha=1e-5, beta=1e-10, cfg=CFG, timeout=120)
    rows = lab.lab_table(runs)
    assert [r["schedule"] for r in rows] == ["1F1B", "interleaved v=2"]
    for run, row in zip(runs, rows):
        v = 2 if run.name == "interleaved" else 1
        t_f, t_b, _ = cost.op_times(4, 2, COST.forward, COST.backward, COST.per_call, v)
        payload = cost.boundary_bytes(2, CFG.seq_len, CFG.d_model)
        t_cross = cost.crossing_time(payload, 1e-5, 1e-10)
        assert row["step_ms_predicted"] == pytest.approx(
            1e3 * cost.schedule_step_time(run.name, 2, 2, t_f, t_b, 0.0, v, t_cross, t_cross))
        assert row["step_ms"] == pytest.approx(1e3 * makespan(run.measured))
        # the sleeps pad every op to at least its emulated time: never faster than compute
        assert row["step_ms"] >= 0.95 * 1e3 * cost.schedule_compute_time(run.name, 2, 2, t_f,
                                                                          t_b, 0.0, v)
        assert row["messages"] == row["messages_predicted"] == sum(
            cost.messages_per_rank(run.name, 2, 2, v).values())
        assert row["peak_in_flight"] == row["peak_in_flight_predicted"]
        assert run.peak_in_flight == run.prediction.peak_in_flight
        # one unit in the table, a whole stage's microbatch: an interleaved chunk's counts 1/v
        assert row["peak_in_flight"] == max(run.peak_in_flight.values()) / v
        assert row["peak_in_flight_per_rank"] == {r: k / v for r, k in
                                                  run.peak_in_flight.items()}
        assert makespan(run.simulated) == pytest.approx(run.prediction.step)
    text = lab.format_lab_table(runs)
    assert "interleaved v=2" in text and "peak, stage-mb" in text


def _chapter_lab_settings() -> tuple[int, int, int, str]:
    """p, the lab's m and v as the pipeline chapter sets them, and the chapter's prose."""
    path = Path(__file__).parents[2] / "notebooks/04_pipeline_parallel.ipynb"
    cells = json.loads(path.read_text())["cells"]
    code, text = ("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == kind)
                  for kind in ("code", "markdown"))
    p = int(re.search(r"^p = (\d+)", code, re.M).group(1))
    v, m = map(int, re.search(r"^V, M_LAB = (\d+), (\d+)", code, re.M).groups())
    return p, m, v, text


def test_chapter_lab_runs_where_gpipe_holds_more_than_1f1b():
    # the lab's table, with simulated timelines in place of the ranks' (the peaks follow
    # from the op lists either way): at m = p every schedule's peak reads p and the chapter
    # could not show what 1F1B saves; at m > p GPipe's m exceeds 1F1B's p
    p, m, v, text = _chapter_lab_settings()
    runs = []
    for name in lab.LAB_SCHEDULES:
        vv = v if name == "interleaved" else 1
        sim = simulate(name, p, m, v=vv, t_f=1.0, t_b=2.0,
                       t_w=1.0 if name == "zb-h1" else None)
        pred = lab.predict(name, p, m, 2 * m, COST, v=v)
        runs.append(lab.LabRun(name, p, m, vv, sim, sim, [makespan(sim)], pred, "simulated"))
    rows = {run.name: row for run, row in zip(runs, lab.lab_table(runs))}
    peak = {name: row["peak_in_flight"] for name, row in rows.items()}
    assert all(row["peak_in_flight_predicted"] == row["peak_in_flight"] for row in rows.values())
    assert peak["gpipe"] == m > peak["1f1b"] == peak["zb-h1"] == p
    # interleaved: section 6's 2(p-1) + (v-1)p + 1 chunk-microbatches, 1/v of a stage each
    assert peak["interleaved"] == cost.in_flight_microbatches(p, m, v) / v
    assert p < peak["interleaved"] < peak["gpipe"]
    # the prose states these settings and the peaks they give
    assert f"m = {m} microbatches" in text and f"p + (p-1)/v = {p + (p - 1) / v:g}" in text


def _fake_runs():
    out = []
    for name in ("1f1b", "zb-h1"):
        sim = simulate(name, 2, 2, t_f=0.01, t_b=0.02, t_w=0.01)
        out.append(SimpleNamespace(title=lab.schedule_label(name), measured=sim, simulated=sim,
                                   prediction=SimpleNamespace(step=makespan(sim))))
    return out


def test_draw_schedule_lab_renders_measured_next_to_simulated():
    from matplotlib.colors import to_hex

    from parlib.plots import COLORS, draw_schedule_lab

    fig = draw_schedule_lab(_fake_runs(), caption="2 ranks, CPU, gloo")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["1F1B: measured", "1F1B: simulated", "ZB-H1: measured",
                      "ZB-H1: simulated"]
    assert "emulated stage cost" in fig._suptitle.get_text()
    # said once, whether the caption says it or not
    labelled = draw_schedule_lab(_fake_runs(), caption="2 ranks, CPU, gloo, emulated stage cost")
    assert labelled._suptitle.get_text().count("emulated stage cost") == 1
    zb = fig.axes[2]
    faces = {to_hex(c) for coll in zb.collections for c in coll.get_facecolors()}
    assert to_hex(COLORS["weight"]) in faces and to_hex(COLORS["backward"]) in faces
    assert COLORS["weight"] not in (COLORS["backward"], COLORS["forward"])
    with pytest.raises(ValueError, match="no schedules"):
        draw_schedule_lab([])


def test_gpipe_backward_orders_differ_and_peak_the_same():
    cmp = tp.gpipe_backward_orders(4, 3)
    assert cmp["ours"][0][3:] == [Op(BACKWARD, 2), Op(BACKWARD, 1), Op(BACKWARD, 0)]
    assert cmp["torch"][0][3:] == [Op(BACKWARD, 0), Op(BACKWARD, 1), Op(BACKWARD, 2)]
    assert cmp["peak_ours"] == cmp["peak_torch"] == {0: 3, 1: 3, 2: 3, 3: 3}
    text = tp.format_gpipe_backward_orders(4, 3)
    assert "B2 B1 B0" in text and "B0 B1 B2" in text and "the same" in text


def test_torch_orders_parse_and_differences_are_found():
    order = {0: ["0F0", "", "2F0", "2I0", "2W0", "0B0"], 1: ["1F0", "3F0", "3B0", "1B0"]}
    ops = tp.torch_orders_as_ops(order, 2)
    assert ops[0] == [Op(FORWARD, 0), Op(FORWARD, 0, 1), Op(BACKWARD, 0, 1),
                      Op("weight", 0, 1), Op(BACKWARD, 0)]
    cmp = tp.compare_orders({0: ops[0], 1: ops[1]}, {0: ops[0], 1: ops[1][::-1]})
    assert cmp[0]["same"] and not cmp[1]["same"] and cmp[1]["first_difference"] == 0


def test_race_torch_interleaved_and_zero_bubble_match_ours():
    rows = tp.race_torch(("interleaved", "zb-h1"), p=2, m=2, batch_size=4, repeats=1,
                         cfg=CFG, timeout=120)
    by_name = {r["schedule"]: r for r in rows}
    assert by_name["zb-h1"]["torch_class"] == "ScheduleInterleavedZeroBubble"
    assert all(x["same"] for x in by_name["zb-h1"]["order"].values())  # torch's ZB = ZB-H1
    assert all(x["same"] for x in by_name["interleaved"]["order"].values())
    assert not by_name["zb-h1"]["like_for_like"] and by_name["interleaved"]["like_for_like"]
    assert all(r["ours_s"] > 0 and r["torch_s"] > 0 for r in rows)
    assert all_ranks("zb-h1", 2, 2)  # the order compared against


def test_lab_refuses_what_a_schedule_cannot_run_before_launching():
    with pytest.raises(ValueError, match="multiple of p"):
        lab.run_schedule_lab(("interleaved",), p=2, m=3, batch=6, cfg=CFG)
    with pytest.raises(ValueError, match="unknown schedule"):
        lab.run_schedule_lab(("pipedream",), p=2, m=2, batch=4, cfg=CFG)
    with pytest.raises(ValueError, match="no torch schedule"):
        tp.rank_torch_pipelining(CFG, schedule_name="pipedream")
