"""Serial kernel launches (parlib.cost.launches) and how estimate() charges them: the floor
worked by hand from BigScience's readings, the term worked by hand on a toy layout, and a
clear error for every bad input."""

import dataclasses

import pytest

from parlib.cost import Hardware, Layout, Link, Model, estimate
from parlib.cost.launches import (
    BIGSCIENCE_80_GPUS,
    SERIAL_LAUNCH_SECONDS_PER_LAYER,
    SerialLaunchPair,
    host_seconds_per_layer,
)

TOY = Model(4, 8, 2, 4, 16)
TOY_HW = Hardware(4, 2, 1e9, 1e9, Link(1e-6, 1e9), Link(1e-5, 1e8))


def test_the_floor_by_hand_from_bigscience_readings():
    pair = BIGSCIENCE_80_GPUS
    # one step at GBS 512: 853.81 s x 512/2048 x 97.82 / rate
    queued = 853.81 / 4 * 97.82 / 97.20
    serial = 853.81 / 4 * 97.82 / 91.04
    assert pair.seconds(97.20) == pytest.approx(queued)
    assert (queued, serial) == pytest.approx((214.81, 229.35), abs=0.01)
    # (512 + 10 - 1) slots of 80 / 10 layers on the critical path
    assert pair.layer_passes == 521 * 8
    assert host_seconds_per_layer(pair) == pytest.approx((serial - queued) / 4168)
    assert SERIAL_LAUNCH_SECONDS_PER_LAYER == pytest.approx(3.487e-3, abs=1e-6)


def test_a_serial_run_that_was_faster_has_nothing_to_charge():
    faster = dataclasses.replace(BIGSCIENCE_80_GPUS, serial_tflops=98.0)
    with pytest.raises(ValueError, match="serial run was faster"):
        host_seconds_per_layer(faster)
    same = dataclasses.replace(BIGSCIENCE_80_GPUS, serial_tflops=97.20)
    assert host_seconds_per_layer(same) == 0


@pytest.mark.parametrize("field, value, message", [
    ("layers", 0, "layers must be an int"),
    ("stages", True, "stages must be an int"),
    ("microbatches", 2.5, "microbatches must be an int"),
    ("serial_tflops", 0.0, "serial_tflops must be > 0"),
    ("reference_seconds", -1.0, "reference_seconds must be > 0"),
    ("stages", 3, "do not split evenly"),
])
def test_bad_pairs_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BIGSCIENCE_80_GPUS, **{field: value})


def test_the_host_term_by_hand_without_a_pipeline():
    # d=4, m=3: every device runs 3 microbatches x 4 layers = 12 layer passes
    plain = estimate(TOY, TOY_HW, Layout(dp=4), m=3, global_batch=12)
    waits = estimate(TOY, TOY_HW, Layout(dp=4), m=3, global_batch=12,
                     host_seconds_per_layer=1e-3)
    assert plain.time["host"] == 0
    assert waits.time["host"] == pytest.approx(12e-3)
    assert waits.step_time - plain.step_time == pytest.approx(12e-3)
    assert waits.mfu < plain.mfu


def test_the_host_term_widens_the_bubble_with_the_slots():
    # p=4, m=2: the busiest stage runs 2 microbatches x 1 layer; the bubble's 3 slots wait
    # as long again each, so the step grows by (m + p - 1) x L/p = 5 layer passes
    plain = estimate(TOY, TOY_HW, Layout(pp=4), m=2, global_batch=2)
    waits = estimate(TOY, TOY_HW, Layout(pp=4), m=2, global_batch=2,
                     host_seconds_per_layer=1e-3)
    assert waits.time["host"] == pytest.approx(2e-3)
    assert waits.time["pp_bubble"] - plain.time["pp_bubble"] == pytest.approx(3e-3)
    assert waits.step_time - plain.step_time == pytest.approx(5e-3)


@pytest.mark.parametrize("bad", [-1e-3, True, "3 ms", None])
def test_bad_host_seconds_are_refused(bad):
    with pytest.raises(ValueError, match="host_seconds_per_layer"):
        estimate(TOY, TOY_HW, Layout(dp=4), m=1, global_batch=4, host_seconds_per_layer=bad)


def test_a_toy_pair_by_hand():
    # 4 layers in 2 stages, 2 microbatches; the reference step: 10 s for 4 microbatches at
    # 100 TFLOPs -> 5 s for 2 at 100, 10 s at 50; 5 s over (2 + 1) x 2 = 6 layer passes
    pair = SerialLaunchPair(source="toy", layers=4, stages=2, microbatches=2,
                            queued_tflops=100.0, serial_tflops=50.0, reference_seconds=10.0,
                            reference_microbatches=4, reference_tflops=100.0)
    assert (pair.seconds(100.0), pair.seconds(50.0)) == pytest.approx((5.0, 10.0))
    assert pair.layer_passes == 6
    assert host_seconds_per_layer(pair) == pytest.approx(5.0 / 6)
