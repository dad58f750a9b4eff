"""The cost model against published runs (parlib.cost.published cites each source and table).

The presets run at their generation's achievable matmul fraction (parlib.cost.efficiency),
one number per generation, never tuned per run. The issue's target is reported / predicted
within 0.8-1.25 for 8 of 10 runs. With costcore at 80a5a3e (memory-bound ops charged, uneven
stages) the model reached 9 of 16, four of them at the band's edge. With the shape-dependent
matmul rate (output tiles in waves over the SMs, parlib.cost.efficiency.matmul_time) it
reaches 10 of 16: Megatron-LM 76.1B 0.89, 145.6B 0.88, 1008B 0.84; Korthikanti 175B 0.86,
530B 0.87, 1T 0.85; Llama 3 on 8,192 GPUs 1.01 and on 16,384 with CP 1.21; torchtitan 70B
0.94; MPT 30B 0.84. Outside: Llama 3 on 16,384 without CP 1.27 (v = 1's bubble charged; the
run interleaved), and below the band Korthikanti 22B 0.80 (0.796), BLOOM 0.78, OPT 0.73,
torchtitan 8B 0.73, MPT 7B 0.66 (the model is optimistic on the smaller, faster-stepping
runs). The 11 A100 rows' median is 0.85 (0.79 before). test_agreement_does_not_regress
guards that count.
"""

import dataclasses

import pytest

from parlib.cost.estimate import estimate
from parlib.cost.published import (
    RUNS,
    TARGET_BAND,
    PublishedRun,
    agreement,
    caveats_table,
    comparison_table,
)

# What the model reaches today (see the module docstring); raise it when the model improves.
RUNS_IN_BAND_AT_LEAST = 10
# A run far outside this is a broken row or a broken model, not a modelling limit.
SANITY_BAND = (0.45, 1.3)


def test_enough_runs_from_enough_sources():
    assert len(RUNS) >= 10
    sources = {run.source.split(",")[0].split(":")[0].split(" (")[0] for run in RUNS}
    assert len(sources) >= 5, sources
    assert len({run.name for run in RUNS}) == len(RUNS)


def test_the_tables_print_one_row_per_run():
    table = comparison_table()
    print("\n" + table + "\n\n" + caveats_table())
    assert len(table.splitlines()) == len(RUNS) + 2
    inside, total = agreement()
    assert table.splitlines()[-1].startswith(f"{inside} of {total} runs")
    assert len(caveats_table().splitlines()) == len(RUNS)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_published_run_is_well_formed_and_fits(run):
    est = run.estimate()
    predicted = run.predicted(est)
    print(f"\n{run.name}: predicted {run.metric.upper()} {predicted:.1%}, reported "
          f"{run.reported:.1%}, ratio {run.ratio(est):.2f}; {est.memory_total / 1e9:.1f} GB\n"
          f"  source: {run.source}\n  assumed: {run.assumed}\n  cannot know: {run.cannot_know}")
    assert run.source and run.assumed and run.cannot_know
    if run.reported_params is not None:  # our parameter count reproduces the table's
        assert round(run.model.n_params / 1e9, 1) == run.reported_params
    assert est.fits, est.reason
    assert est.hardware.n_devices == est.layout.world == run.layout.world
    assert est.hardware.compute_efficiency < 1  # one achievable fraction per generation
    assert SANITY_BAND[0] <= run.ratio(est) <= SANITY_BAND[1]
    # the source's own rate is its utilisation of the same datasheet peak we use
    if run.reported_tflops_per_device is not None:
        assert run.reported_tflops_per_device * 1e12 / est.hardware.peak_flops == pytest.approx(
            run.reported, abs=0.01)
    if run.reported_tokens_per_second_per_device is not None:
        # reported is the source's tokens/s under our FLOP count; the source's own MFU (it
        # counts the embedding's parameters too) is at most 7% above it
        flops = run.reported_tokens_per_second_per_device * run.model.flops_per_token
        assert flops / est.hardware.peak_flops == pytest.approx(run.reported)
        stated = float(run.source.split("% MFU")[0].rsplit(" ", 1)[1]) / 100
        assert run.reported < stated < 1.07 * run.reported


def test_the_comparison_is_computed_from_estimate():
    run = RUNS[0]
    est = estimate(run.model, run.hardware, run.layout, **run.settings)
    assert run.predicted() == pytest.approx(est.hfu)
    assert run.ratio() == pytest.approx(run.reported / est.hfu)
    # half the achievable compute: the prediction moves, so nothing in it is a constant
    slower = dataclasses.replace(run, hardware=run.hardware.with_(
        compute_efficiency=run.hardware.compute_efficiency / 2))
    assert slower.predicted() < 0.6 * run.predicted()
    assert slower.ratio() > 1.6 * run.ratio()
    assert str(round(run.ratio(), 2)) in comparison_table((run,))


def test_agreement_counts_the_band():
    run = RUNS[0]
    assert agreement((run,), band=(0.0, 10.0)) == (1, 1)
    assert agreement((run,), band=(run.ratio() + 0.01, 10.0)) == (0, 1)


def test_agreement_does_not_regress():
    inside, total = agreement(band=TARGET_BAND)
    print(f"\n{inside} of {total} runs within {TARGET_BAND}")
    assert inside >= RUNS_IN_BAND_AT_LEAST


def test_a_malformed_run_is_refused():
    run = RUNS[0]
    with pytest.raises(ValueError, match="metric"):
        dataclasses.replace(run, metric="tflops")
    with pytest.raises(ValueError, match="fraction of peak"):
        dataclasses.replace(run, reported=45)
    assert isinstance(run, PublishedRun)
