"""The training fractions each generation's presets carry, re-fitted from the published rows
(parlib.cost.calibration), and the fit worked on cases whose answer is known."""

import dataclasses

import pytest

from parlib.cost import Hardware, Layout, Model, estimate
from parlib.cost.calibration import fit, held_out_table, in_band, ratio_at
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
