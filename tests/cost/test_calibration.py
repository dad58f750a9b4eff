"""The training fractions each generation's presets carry, re-fitted from the published rows
(parlib.cost.calibration), and the fit worked on cases whose answer is known."""

import dataclasses

import pytest

from parlib.cost import Hardware, Layout, Model, estimate
from parlib.cost.avoided import ZERO3_RUNS
from parlib.cost.calibration import (
    at_network_share,
    fit,
    held_out_table,
    implied_network_share,
    in_band,
    network_fit,
    network_sweep,
    network_table,
    ratio_at,
    telling_rows,
)
from parlib.cost.efficiency import A100_TRAINING, ACHIEVABLE, H100_TRAINING
from parlib.cost.foundry import FOUNDRY_RUNS, published_rows
from parlib.cost.published import MOSAIC_RUNS, RUNS, PublishedRun


@pytest.mark.parametrize("generation, stored", [("A100", A100_TRAINING),
                                                ("H100", H100_TRAINING)])
def test_the_presets_hold_what_the_fit_finds(generation, stored):
    found = fit(published_rows(generation), generation)
    print(f"\n{found}")
    assert (found.matmul, found.memory) == stored
    row = ACHIEVABLE[generation]
    assert (row.training_matmul, row.memory_bandwidth) == stored
    assert f"{stored[0]:.0%} of MAMF" in row.source and "fitted" in row.source


def test_rows_count_once_and_stay_on_their_generation():
    rows = published_rows("H100")
    # llm-foundry's 20 H100 rows and Llama 3's three; the two MosaicML rows of RUNS are
    # llm-foundry's own (MPT 7B on 8, 30B on 32), counted once
    assert len(rows) == 20 + 3 and len(MOSAIC_RUNS) == 2
    assert not {r.name for r in MOSAIC_RUNS} & {r.name for r in rows}
    assert all(r.hardware.generation == "H100" for r in rows)
    assert len(published_rows("A100")) == sum(r.hardware.generation == "A100"
                                       for r in RUNS + FOUNDRY_RUNS) == 50
    with pytest.raises(ValueError, match="no published rows"):
        published_rows("TPU")


def _one_device_run(reported: float) -> PublishedRun:
    # one device, no memory bandwidth given: the step is compute alone
    model = Model(4, 512, 8, 1024, 1000, name="toy")
    hardware = Hardware.dgx_a100(8).with_(n_devices=1, memory_bandwidth=float("inf"))
    return PublishedRun("toy", "by hand", model, hardware, Layout(), dict(m=1, global_batch=4),
                        "mfu", reported, None, "", "")


def test_the_matmul_fraction_scales_compute_time_by_hand():
    run = _one_device_run(0.3)
    # compute alone: MFU is proportional to the matmul rate, so half the rate doubles the ratio
    assert ratio_at(run, 0.5, 0.9) == pytest.approx(2 * ratio_at(run, 1.0, 0.9))


def test_the_memory_fraction_scales_memory_bound_time_by_hand():
    # with a bandwidth given, halving the fraction doubles the layers' memory-bound time M:
    # the step goes from T to T + M, and the ratio (proportional to the step) with it
    run = _one_device_run(0.3)
    run = dataclasses.replace(run, hardware=run.hardware.with_(memory_bandwidth=1e12))
    ceiling = ACHIEVABLE["A100"].matmul_fraction
    hw = run.hardware.with_(compute_efficiency=ceiling, memory_efficiency=1.0)
    at_one = estimate(run.model, hw, run.layout, **run.settings)
    grow = (at_one.step_time + at_one.time["memory_bound"]) / at_one.step_time
    assert at_one.time["memory_bound"] > 0
    assert ratio_at(run, 1.0, 0.5) == pytest.approx(grow * ratio_at(run, 1.0, 1.0))


def test_the_fit_recovers_fractions_it_was_given():
    # every A100 row of llm-foundry "reported" at exactly what (0.72, 0.45) predicts
    rows = tuple(r for r in FOUNDRY_RUNS if r.hardware.generation == "A100")
    made_up = tuple(dataclasses.replace(r, reported=r.reported / ratio_at(r, 0.72, 0.45))
                    for r in rows)
    found = fit(made_up, "A100")
    assert (found.matmul, found.memory) == (0.72, 0.45)
    assert found.error == pytest.approx(0, abs=1e-12) and found.rows == len(rows)
    assert in_band(made_up, 0.72, 0.45)[0] == len(rows)
    with pytest.raises(ValueError, match="at least one"):
        fit(())


def test_a_fraction_fitted_on_one_table_predicts_the_other_on_a100s():
    table = held_out_table(("A100",))
    print("\n" + table)
    foundry = tuple(r for r in published_rows("A100") if r in FOUNDRY_RUNS)
    others = tuple(r for r in published_rows("A100") if r not in FOUNDRY_RUNS)
    from_foundry = fit(foundry, "A100")
    assert in_band(others, from_foundry.matmul, from_foundry.memory)[0] >= len(others) - 1
    from_others = fit(others, "A100")
    assert in_band(foundry, from_others.matmul, from_others.memory)[0] >= 0.9 * len(foundry)
    assert len(table.splitlines()) == 4


def test_on_h100s_neither_table_predicts_the_other():
    # what the choosing chapter and the README say: fitted to llm-foundry's H100 rows alone,
    # the shares put none of Llama 3's three runs in the band; fitted to those three, none of
    # llm-foundry's twenty
    rows = published_rows("H100")
    foundry = tuple(r for r in rows if r in FOUNDRY_RUNS)
    llama = tuple(r for r in rows if r not in FOUNDRY_RUNS)
    assert (len(foundry), len(llama)) == (20, 3)
    from_foundry, from_llama = fit(foundry, "H100"), fit(llama, "H100")
    assert in_band(llama, from_foundry.matmul, from_foundry.memory)[0] == 0
    assert in_band(foundry, from_llama.matmul, from_llama.memory)[0] == 0


# ---- the network's rate, held to the runs (not fitted)

def _sync_heavy_run(reported: float) -> PublishedRun:
    # ZeRO-3 over two nodes, one sequence a GPU: the gathers take about as long as compute
    model = Model(8, 4096, 32, 2048, 32000, name="wide")
    return PublishedRun("wide", "by hand", model, Hardware.dgx_a100(16), Layout(dp=16),
                        dict(m=1, global_batch=16, zero=3), "mfu", reported, None, "", "")


def test_a_network_share_slows_the_rings_across_nodes_by_hand():
    run = _sync_heavy_run(0.3)
    half = at_network_share(run, 0.5)
    assert half.hardware.inter_node.bandwidth == run.hardware.inter_node.bandwidth / 2
    assert half.hardware.inter_node.alpha == run.hardware.inter_node.alpha
    # a ring of 8 ranks a node: 1/8 of each rank's bytes leave through a card, at 8 x 25 GB/s
    # before and 8 x 12.5 after (NVLink's 7/8 stays faster), so the ring's rate halves
    assert half.hardware.ring_link(16, 16).bandwidth == pytest.approx(
        run.hardware.ring_link(16, 16).bandwidth / 2)
    assert half.hardware.ring_link(16, 16).bandwidth == pytest.approx(100e9)
    with pytest.raises(ValueError, match="share must be > 0"):
        at_network_share(run, 0)


def test_the_implied_share_recovers_a_made_up_rate():
    probe = _sync_heavy_run(0.3)
    at_a_third = at_network_share(probe, 0.3).estimate()
    assert at_a_third.time["dp_sync_total"] > 0.5 * at_a_third.time["compute"]
    run = dataclasses.replace(probe, reported=at_a_third.mfu)
    assert implied_network_share(run) == pytest.approx(0.3, rel=0.01)
    # a run whose time does not hang on the network implies no share: inside one node, at
    # 0.9 of its prediction, no rate of the cards between nodes makes up the difference
    inside = dataclasses.replace(probe, hardware=Hardware.dgx_a100(8), layout=Layout(dp=8),
                                 settings=dict(m=1, global_batch=8, zero=3))
    inside = dataclasses.replace(inside, reported=0.9 * inside.estimate().mfu)
    assert implied_network_share(inside) is None
    assert implied_network_share(dataclasses.replace(inside, reported=inside.reported / 0.8)) \
        is None  # and none at 1.125 either: faster than predicted at any rate


def test_no_one_network_rate_keeps_every_table_in_the_band():
    table = network_table()
    print("\n" + table)
    implied = {run.name: share for run, share in telling_rows()}
    zero3 = [implied[r.name] for r in ZERO3_RUNS]  # every Table 2 ZeRO-3 row can tell
    h100 = [share for run, share in telling_rows()
            if run in FOUNDRY_RUNS and run.hardware.generation == "H100"]
    # what the chapter and the README state: Table 2's ZeRO-3 runs imply about a tenth of the
    # ring rate, llm-foundry's H100 runs that can tell a little under half
    assert 0.05 < min(zero3) and max(zero3) < 0.125
    assert len(h100) >= 3 and 0.3 < min(h100) and max(h100) < 0.5
    for run in ZERO3_RUNS:
        assert f"{implied[run.name]:.3f}" in table
    sweep = network_sweep((1.0, 0.1))
    assert sweep[1.0]["Table 2 ZeRO-3"] == (0, 6) and sweep[1.0]["other published"][0] >= 13
    # at a tenth, Table 2's ZeRO-3 rows come in and half the other published runs fall out
    assert sweep[0.1]["Table 2 ZeRO-3"] == (6, 6) and sweep[0.1]["other published"][0] <= 10
    for row in sweep.values():
        assert f"{row['other published'][0]}/{row['other published'][1]}" in table
    assert all(row["Table 2 PTD-P"] == (6, 6) for row in sweep.values())
    # the pairs are counted the one way avoided.py counts them: none as measured at the full
    # rate, four of six at a tenth, where ZeRO-3 pays its slower network and PTD-P little
    assert sweep[1.0]["pairs as measured"] == (0, 6)
    assert sweep[0.1]["pairs as measured"] == (4, 6)


@pytest.mark.parametrize("generation", ["A100", "H100"])
def test_the_fitted_rows_do_not_want_a_slower_network(generation):
    fits = network_fit(generation, (1.0, 0.5, 0.25))
    print("\n" + "\n".join(f"{share}: {f}" for share, f in fits.items()))
    errors = [f.error for f in fits.values()]
    assert errors[0] < errors[1] < errors[2] and errors[2] > 2 * errors[0]
    # at the full rate the fit is the presets' own
    assert (fits[1.0].matmul, fits[1.0].memory) == (A100_TRAINING if generation == "A100"
                                                    else H100_TRAINING)
