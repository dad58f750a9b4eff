"""The cost model against published runs (parlib.cost.published cites each paper and table).

The presets compute at peak, so a prediction is an upper bound on utilisation; the band
below says: the reported figure is between 45% and 110% of the prediction. Below 45% the
model would be far too optimistic; above 100% it charges the run for more than it paid
(110% leaves room for the one run whose pipeline schedule we model cruder than it was).
"""

import pytest

from parlib.cost.published import RUNS, comparison_table

BAND = (0.45, 1.10)


def test_the_comparison_table_prints():
    table = comparison_table()
    print("\n" + table)
    assert len(table.splitlines()) == len(RUNS) + 1


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_published_run_fits_and_utilisation_is_in_band(run):
    est = run.estimate()
    predicted = run.predicted(est)
    print(f"\n{run.name}: predicted {run.metric.upper()} {predicted:.1%} at peak compute, "
          f"reported {run.reported:.0%} ({run.reported_tflops_per_device} TFLOP/s per GPU); "
          f"{est.memory_total / 1e9:.1f} GB of {est.hardware.memory_bytes / 1e9:.0f} GB\n"
          f"  source: {run.source}\n  assumed: {run.assumed}")
    if run.reported_params is not None:  # our parameter count reproduces the table's
        assert round(run.model.n_params / 1e9, 1) == run.reported_params
    assert est.fits, est.reason
    assert est.hardware.n_devices == est.layout.world == run.layout.world
    assert BAND[0] <= run.reported / predicted <= BAND[1]
    # the paper's own per-GPU rate is its utilisation of the same peak we use
    assert run.reported_tflops_per_device * 1e12 / est.hardware.peak_flops == pytest.approx(
        run.reported, abs=0.01)
