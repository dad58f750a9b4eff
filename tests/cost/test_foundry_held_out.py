"""llm-foundry's large-scale H100 table and its A100 80GB table, held against the cost model
in no fit."""

import pytest

from parlib.cost.foundry import FOUNDRY_RUNS, MICROBATCH_RUNS, mpt, published_rows, trends
from parlib.cost.foundry_held_out import (
    A100_80GB_ROWS,
    A100_80GB_RUNS,
    H100_LARGE_SCALE_ROWS,
    LARGE_SCALE_RUNS,
    a100_80gb_run,
    foundry_held_out_table,
    scale_fall,
    setting_trends,
    table_trends,
)

# The tables' MFU column, whose FLOP count (attention included) is within 1% of ours
TABLE_MFU = {("70b", 512): 0.4125, ("13b", 128): 0.4218, ("1b", 512): 0.3665}
A100_80GB_MFU = {("70b", 64): 0.5333, ("70b", 32): 0.4856, ("7b", 8): 0.6423}


def test_the_large_scale_rows_are_read_as_the_table():
    assert len(LARGE_SCALE_RUNS) == len(H100_LARGE_SCALE_ROWS) == 18
    for (size, gpus, micro, accum, batch, tokens, ac), run in zip(H100_LARGE_SCALE_ROWS,
                                                                   LARGE_SCALE_RUNS):
        est = run.estimate()
        assert (run.layout.dp, est.micro_batch, est.m) == (gpus, micro, accum) == (gpus, micro, 1)
        assert micro * gpus == batch and gpus in (128, 256, 512)
        assert run.settings["recompute"] == (True if ac else "selective")
        assert run.settings["grad_reduce_bytes"] == 4  # MP DEFAULT: gradients reduced in fp32
        assert run.reported == pytest.approx(tokens * mpt(size).flops_per_token / 989.5e12)
        assert "Large Scale" in run.source and run.hardware.name.startswith("DGX H100")
        if (size, gpus) in TABLE_MFU:
            assert run.reported == pytest.approx(TABLE_MFU[size, gpus], rel=0.01)


def test_the_a100_80gb_rows_are_read_as_the_table_each_mode_its_reduction():
    assert len(A100_80GB_RUNS) == len(A100_80GB_ROWS) == 11
    for (size, gpus, micro, accum, batch, tokens, _, mode), run in zip(A100_80GB_ROWS,
                                                                        A100_80GB_RUNS):
        est = run.estimate()
        assert (run.layout.dp, est.micro_batch, est.m) == (gpus, micro, accum)
        assert micro * accum * gpus == batch
        assert run.hardware.memory_bytes == 80e9 and run.hardware.name == "DGX A100 80GB"
        assert run.settings["grad_reduce_bytes"] == {"PURE": 2, "DEFAULT": 4}[mode]
        assert run.reported == pytest.approx(tokens * mpt(size).flops_per_token / 312e12)
        assert f"MP {mode}" in run.source and "A100 80GB with 1600 Gbps" in run.source
        if (size, gpus) in A100_80GB_MFU:
            assert run.reported == pytest.approx(A100_80GB_MFU[size, gpus], rel=0.01)
    with pytest.raises(ValueError, match="mode must be 'PURE' or 'DEFAULT', got 'pure'"):
        a100_80gb_run("7b", 8, 6, 2, 96, 4641, False, "pure")


def test_every_held_out_layout_ran_and_the_model_says_it_fits():
    assert all(run.estimate().fits for run in LARGE_SCALE_RUNS + A100_80GB_RUNS)


def test_no_held_out_row_is_in_a_fit_or_shares_a_name():
    held = [run.name for run in LARGE_SCALE_RUNS + A100_80GB_RUNS]
    assert len(set(held)) == len(held)
    others = {run.name for run in FOUNDRY_RUNS + MICROBATCH_RUNS + published_rows("H100")
              + published_rows("A100")}
    assert not set(held) & others


def test_the_fall_is_the_mfu_at_most_gpus_over_fewest():
    fall = scale_fall()
    few, most, reported, predicted = fall["MPT 1b"]
    assert (few, most) == (128, 512)
    assert reported == pytest.approx(39837 / 44123)  # same model: MFU scales with T/s/GPU
    at = {run.layout.world: run for run in LARGE_SCALE_RUNS if run.model.name == "MPT 1b"}
    assert predicted == pytest.approx(at[512].estimate().mfu / at[128].estimate().mfu)
    # every model falls from 128 to 512 GPUs, measured and predicted
    assert all(r < 1 and p < 1 for _, _, r, p in fall.values())


def test_table_trends_keep_the_a100s_memories_apart_and_match_trends_on_one_table():
    every = FOUNDRY_RUNS + A100_80GB_RUNS
    trend = table_trends(every)
    ratio = {run.layout.world: run.ratio() for run in A100_80GB_RUNS
             if run.model.name == "MPT 70b"}
    assert trend["MPT 70b, A100 80GB"] == pytest.approx((32, 64, ratio[64] / ratio[32]))
    assert trend["MPT 70b, A100 40GB"] == pytest.approx(trends()["MPT 70b, A100"])
    assert list(table_trends(FOUNDRY_RUNS).values()) == list(trends().values())


def test_a_setting_trend_keeps_one_microbatch_and_checkpointing():
    every = FOUNDRY_RUNS + LARGE_SCALE_RUNS
    trend = setting_trends(every)
    ratio = {run.layout.world: run.ratio() for run in LARGE_SCALE_RUNS
             if run.model.name == "MPT 13b"}
    assert trend["MPT 13b, H100 80GB, microbatch 16, AC True"] == pytest.approx(
        (128, 512, ratio[512] / ratio[128]))
    small = trend["MPT 13b, H100 80GB, microbatch 2, AC False"]
    assert small[:2] == (8, 64)
    # across settings (microbatch 2 without checkpointing on 8 GPUs, 16 with it on 512) the
    # trend leaves the target; within either setting it stays in
    assert table_trends(every)["MPT 13b, H100 80GB"][2] > 1.15
    assert abs(small[2] - 1) < 0.15 and abs(ratio[512] / ratio[128] - 1) < 0.15


def test_the_table_counts_the_band_the_fall_and_both_trends():
    table = foundry_held_out_table()
    assert "18 of 18 runs (100%) within reported/predicted 0.8-1.25" in table
    assert "11 of 11 runs (100%) within reported/predicted 0.8-1.25" in table
    assert "MPT 1b     128-512" in table
    assert ("per model: 15 of 18 within 15% of their fewest GPUs' ratio; outside: MPT 70b, "
            "A100 40GB 64-128: 1.32; MPT 13b, A100 40GB 8-128: 1.15; MPT 13b, H100 80GB 8-512: "
            "1.17") in table
    assert ("per setting: 18 of 19 within 15% of their fewest GPUs' ratio; outside: MPT 1b, "
            "A100 40GB, microbatch 10, AC False 32-128: 1.22") in table
