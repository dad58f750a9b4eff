"""Ranking published layout sweeps (parlib.cost.sweeps).

The issue's targets are Spearman >= 0.8 and the model's pick within 5% of the measured best.
Before the matmul rate depended on shape (costcore at 80a5a3e) the model missed both on
BigScience's two Jean Zay sweeps: Spearman 0.23 over 17 layouts and -0.86 over 7, the pick
at 0.85 of the best in each; it saw only the smaller bubble of more, smaller microbatches and
picked MBS 1. With each layer's matmuls charged at their shape's rate (tiles in waves over
the SMs, parlib.cost.efficiency.matmul_time) bigger microbatches and smaller t compute
faster: Spearman 0.34 and 0.14, the pick at 0.92 and 0.91 of the best. With Jean Zay's
network as BigScience measured it (a node's rings share 5.06 GB/s; the datasheet said 6.25
per GPU), ring collectives sharing a node's links (parlib.cost.hardware.Hardware.ring_link)
and NVLink at the A100's measured 78%: 0.55 with the pick the measured best over the 17
layouts, -0.14 with the pick at 0.91 over the 7 (the TP 8 sweep, all one t, where the
model's microbatch ordering is all that differs). Charging the serial kernel launches these
48-node runs used (CUDA_LAUNCH_BLOCKING=1) at the floor BigScience's 80-GPU readings put on
them (parlib.cost.launches, 3.49 ms a microbatch-layer): 0.65 and 0.68, the picks at 1.00
and 0.98 of the best. The issue's targets for these sweeps (0.6 each, nothing fitted to
them) are met, the course's own (0.8) not; the guards below are the issue's.
"""

import dataclasses

import pytest

from parlib.cost.layout import Layout
from parlib.cost.sweeps import (
    SWEEPS,
    Sweep,
    SweepPoint,
    microbatch_lean,
    ranking_table,
    ranks,
    spearman,
    sweep_table,
)

# Today's figures (see the docstring): 0.65 and 0.68, the picks 1.00 and 0.98. Before the
# serial launches were charged: 0.56 and -0.14, the TP 8 sweep's pick 0.91.
CORRELATION_AT_LEAST = 0.6
PICK_AT_LEAST = 0.95


def test_ranks_average_ties():
    assert ranks([10.0, 30.0, 20.0]) == [1, 3, 2]
    assert ranks([5.0, 1.0, 5.0, 2.0]) == [3.5, 1, 3.5, 2]


def test_spearman_against_a_hand_worked_case():
    # ranks x: 1 2 3 4 5, ranks y: 2 1 4 3 5; d^2 = 1+1+1+1+0 = 4;
    # rho = 1 - 6 * 4 / (5 * (25 - 1)) = 1 - 24/120 = 0.8
    assert spearman([1, 2, 3, 4, 5], [20, 10, 40, 30, 50]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 4, 9]) == pytest.approx(1.0)  # ranks, not values
    # ties: ranks y = 1.5 1.5 3; Pearson of (1,2,3) with them = 0.866
    assert spearman([1, 2, 3], [7, 7, 9]) == pytest.approx(3 ** 0.5 / 2)


def test_spearman_refuses_what_it_cannot_rank():
    with pytest.raises(ValueError, match="one length"):
        spearman([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="all values equal"):
        spearman([1, 2, 3], [4, 4, 4])


@pytest.mark.parametrize("sweep", SWEEPS, ids=lambda s: s.name)
def test_sweep_is_one_model_on_one_cluster_and_well_formed(sweep):
    print("\n" + sweep_table(sweep) + f"\n  source: {sweep.source}\n  precision: "
          f"{sweep.precision}\n  assumed: {sweep.assumed}")
    assert sweep.source and sweep.precision and sweep.assumed
    assert len({p.label for p in sweep.points}) == len(sweep.points)
    assert len({(p.layout, p.settings["m"]) for p in sweep.points}) == len(sweep.points)
    for point, est in zip(sweep.points, sweep.estimates()):
        assert point.layout.world == sweep.hardware.n_devices
        assert est.global_batch == point.settings["global_batch"]
    assert len(sweep_table(sweep).splitlines()) == len(sweep.points) + 2


@pytest.mark.parametrize("sweep", SWEEPS, ids=lambda s: s.name)
def test_ranking_does_not_regress(sweep):
    ests = sweep.estimates()
    rho, pick = sweep.correlation(ests), sweep.top_pick_ratio(ests)
    print(f"\n{sweep.name}: spearman {rho:.2f}, pick/best {pick:.2f}")
    assert rho >= CORRELATION_AT_LEAST
    assert pick >= PICK_AT_LEAST


def _without_serial_launches(sweep: Sweep) -> Sweep:
    return sweep.with_settings(host_seconds_per_layer=0.0)


def test_with_settings_changes_every_point_and_nothing_else():
    base = SWEEPS[1]
    changed = base.with_settings(host_seconds_per_layer=1.0, zero=0)
    assert [p.label for p in changed.points] == [p.label for p in base.points]
    for old, new in zip(base.points, changed.points):
        assert new.settings == {**old.settings, "host_seconds_per_layer": 1.0, "zero": 0}
        assert (new.layout, new.seconds_per_step) == (old.layout, old.seconds_per_step)
    assert base.points[0].settings["host_seconds_per_layer"] < 1.0  # the original is kept
    with pytest.raises(ValueError, match="zero must be"):
        base.with_settings(zero=5).estimates()


def test_the_serial_launches_are_what_lift_the_ranking():
    # without them the TP 8 sweep ranks no better than chance (-0.14) and its pick misses
    # the best by 9%: the term, measured on another table, is what the guards rest on
    from parlib.cost.sweeps import BIGSCIENCE_0221, BIGSCIENCE_0225
    assert _without_serial_launches(BIGSCIENCE_0221).correlation() < 0
    assert _without_serial_launches(BIGSCIENCE_0221).top_pick_ratio() < 0.92
    assert _without_serial_launches(BIGSCIENCE_0225).correlation() < CORRELATION_AT_LEAST
    for sweep in SWEEPS:
        assert all(p.settings["host_seconds_per_layer"] > 0 for p in sweep.points)


def _toy_sweep(seconds: list[float]) -> Sweep:
    base = SWEEPS[1]
    points = tuple(dataclasses.replace(p, seconds_per_step=s)
                   for p, s in zip(base.points, seconds))
    return dataclasses.replace(base, points=points)


def test_correlation_and_pick_come_from_the_measurements():
    base = SWEEPS[1]
    predicted = base.predicted()
    # measurements in the model's own order: a perfect ranking, a perfect pick
    agreeing = _toy_sweep([base.points[i].settings["global_batch"] / x
                           for i, x in enumerate(predicted)])
    assert agreeing.correlation() == pytest.approx(1.0)
    assert agreeing.top_pick_ratio() == pytest.approx(1.0)
    # the reverse order: -1, and the pick is the measured slowest
    reverse = _toy_sweep([base.points[i].settings["global_batch"] * x
                          for i, x in enumerate(predicted)])
    assert reverse.correlation() == pytest.approx(-1.0)
    assert reverse.top_pick_ratio() == pytest.approx(min(reverse.measured())
                                                     / max(reverse.measured()))


def test_ranking_table_prints_each_sweep():
    table = ranking_table()
    print("\n" + table)
    assert len(table.splitlines()) == 2 * len(SWEEPS) + 2
    assert max(len(line) for line in table.splitlines()) <= 100  # the course's line width
    for sweep in SWEEPS:
        assert f"{sweep.correlation():.2f}" in table
        measured = sweep.measured()
        best = sweep.points[max(range(len(measured)), key=measured.__getitem__)]
        assert f"model's pick {sweep.points[sweep.top_pick()].label}, measured best " \
               f"{best.label}" in table


def test_bad_sweeps_are_refused():
    point = SWEEPS[0].points[0]
    with pytest.raises(ValueError, match="seconds_per_step"):
        SweepPoint(Layout(dp=1), dict(m=1, global_batch=1), 0.0)
    with pytest.raises(ValueError, match="at least 3"):
        dataclasses.replace(SWEEPS[0], points=(point, point))


def test_what_serial_launches_leave_unexplained_is_the_step_from_mbs_2_to_4():
    # the module docstring's diagnosis: beyond what the model predicts, along the TP 8
    # sweep, per microbatch-layer no longer run, MBS 1 -> 2 and 4 -> 8 now save next to
    # nothing (serial launches charged: 3.8-4.4 and 5.0 ms before), MBS 2 -> 4 10.5-12.5 ms
    # (14.0-16.0 before)
    from parlib.cost.sweeps import BIGSCIENCE_0221 as sweep

    def excess_ms(sweep: Sweep, a: int, b: int) -> float:
        ests = sweep.estimates()
        measured = sweep.points[a].seconds_per_step - sweep.points[b].seconds_per_step
        predicted = ests[a].step_time - ests[b].step_time
        fewer = (ests[a].m - ests[b].m) * max(ests[a].stage_layers)
        return 1000 * (measured - predicted) / fewer

    before = _without_serial_launches(sweep)
    for one, two, four in ((0, 1, 2), (4, 5, 6)):  # PP 12 and PP 6, MBS 1, 2, 4
        assert 0 < excess_ms(sweep, one, two) < 1.0
        assert 3.5 < excess_ms(before, one, two) < 5.0
        assert 10.0 < excess_ms(sweep, two, four) < 13.0
        assert 13.0 < excess_ms(before, two, four) < 16.5
    assert 0 < excess_ms(sweep, 2, 3) < 2.0  # PP 12, MBS 4 -> 8
    assert 4.5 < excess_ms(before, 2, 3) < 5.5


def test_the_microbatch_lean_compares_one_layout_at_its_smallest_and_largest_microbatch():
    base = SWEEPS[1]  # PP 12 at MBS 1, 2, 4, 8 and PP 6 at MBS 1, 2, 4
    ests = base.estimates()
    # measured at the prediction times 1.2 at the smallest microbatch, 1.0 at the largest,
    # 1.5 in between (which the lean does not read)
    sizes = [(p.layout, e.micro_batch) for p, e in zip(base.points, ests)]
    smallest = {layout: min(mbs for lay, mbs in sizes if lay == layout) for layout, _ in sizes}
    largest = {layout: max(mbs for lay, mbs in sizes if lay == layout) for layout, _ in sizes}

    def factor(point, est):
        mbs = est.micro_batch
        return 1.2 if mbs == smallest[point.layout] else 1.0 if mbs == largest[point.layout] \
            else 1.5
    toy = dataclasses.replace(base, points=tuple(
        dataclasses.replace(p, seconds_per_step=factor(p, e) * e.step_time)
        for p, e in zip(base.points, ests)))
    lean = microbatch_lean((toy,))
    assert [label for label, _ in lean] == ["DP4 TP8 PP12 MBS1 GBS2048",
                                            "DP8 TP8 PP6 MBS1 GBS2048"]
    assert [x for _, x in lean] == pytest.approx([1.2, 1.2])
    # BigScience's own: the smaller microbatch ran further over its prediction in 7 of 9
    # layouts, up to 1.09x (the choosing chapter prints it; 1.17x before the serial
    # launches were charged)
    measured = [x for _, x in microbatch_lean()]
    assert len(measured) == 9 and sum(x > 1 for x in measured) == 7
    assert max(measured) == pytest.approx(1.09, abs=0.01)
