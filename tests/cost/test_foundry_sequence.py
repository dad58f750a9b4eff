"""llm-foundry's sweeps of the sequence length, held against the cost model in no fit."""

import pytest

from parlib.cost import Hardware, Model, estimate
from parlib.cost.foundry import FOUNDRY_RUNS, mpt, published_rows
from parlib.cost.foundry_sequence import (
    SEQUENCE_ROWS,
    SEQUENCE_RUNS,
    attention_caution,
    attention_held,
    attention_share,
    beyond_fitted,
    fitted_attention_share,
    sequence_table,
    share_bands,
)
from parlib.cost.layout import Layout

# The tables' MFU column for a few rows: attention counted in full, as ours, and 6 FLOPs a
# token for each learned-position parameter (s x h), which ours leaves out (a lookup)
TABLE_MFU = {("H100", "1b", 65536): 0.2634, ("A100 80GB", "125m", 65536): 0.5413,
             ("A100", "13b", 8192): 0.4393}
PEAK = {"A100": 312e12, "A100 80GB": 312e12, "H100": 989.5e12}


def test_the_rows_are_read_at_their_sequence_length():
    assert {table: len(rows) for table, rows in SEQUENCE_ROWS.items()} == {
        "A100": 39, "A100 80GB": 50, "H100": 32}
    for table, rows in SEQUENCE_ROWS.items():
        for (size, seq, micro, accum, batch, tokens, ac), run in zip(rows, SEQUENCE_RUNS[table]):
            assert seq != 2048 and run.model.seq_len == seq and run.layout.dp == 8
            assert micro * accum * 8 == batch and run.estimate().micro_batch == micro
            assert run.reported == pytest.approx(
                tokens * mpt(size, seq).flops_per_token / PEAK[table])
            assert run.settings["recompute"] == (True if ac else "selective")
            if (table, size, seq) in TABLE_MFU:
                flops = run.model.flops_per_token
                positions = 6 * seq * run.model.d_model
                assert run.reported * (flops + positions) / flops == pytest.approx(
                    TABLE_MFU[table, size, seq], rel=0.002)
    names = [run.name for runs in SEQUENCE_RUNS.values() for run in runs]
    assert len(set(names)) == len(names)
    assert not set(names) & {run.name for run in FOUNDRY_RUNS}


def test_attention_share_is_attentions_forward_flops_over_the_forwards():
    model = mpt("1b", 65536)  # 24 layers, h = 2048
    attention = 4 * 24 * 65536 * 2048
    assert attention_share(model) == pytest.approx(
        attention / (attention + model.forward_flops_per_token - attention))
    assert attention_share(mpt("1b", 512)) < 0.1 < attention_share(model)


def test_the_fitted_share_is_the_largest_among_the_fitted_rows():
    for generation in ("A100", "H100"):
        shares = [attention_share(run.model) for run in published_rows(generation)]
        assert fitted_attention_share(generation) == max(shares)
        beyond = beyond_fitted(generation)
        assert beyond and all(attention_share(r.model) > max(shares) for r in beyond)
        assert all(r.hardware.generation == generation for r in beyond)


def test_bands_hold_each_rows_ratio_in_its_bucket():
    runs = SEQUENCE_RUNS["H100"]
    bands = share_bands(runs)
    assert sum(count for _, _, count, _ in bands) == len(runs)
    low, high, _, (least, _, most) = bands[-1]
    inside = [r.ratio() for r in runs if low <= attention_share(r.model) <= high]
    assert (least, most) == (min(inside), max(inside))
    # on H100s the model charges attention-heavy steps too little
    assert most < 0.8


def test_a_prediction_beyond_the_fitted_attention_is_held_to_the_band():
    long_seq = Model(32, 4096, 32, 131072, 128256, ffn_dim=14336, n_kv_heads=8,
                     gated_mlp=True, bias=False, learned_positions=False)
    est = estimate(long_seq, Hardware.dgx_h100(64), Layout(dp=4, cp=16), m=1,
                   global_batch=16, zero=2, recompute="selective")
    rows = beyond_fitted("H100")
    ratios = [r.ratio() for r in rows]
    assert attention_held(est) == pytest.approx((min(ratios) * est.mfu, max(ratios) * est.mfu))
    text = attention_caution(est)
    assert "beyond the 57% of any run the H100 shares are fitted to" in text
    assert f"held to that band this one is {min(ratios) * est.mfu:.0%}" in text
    # a short sequence says nothing
    short = estimate(mpt("7b"), Hardware.dgx_h100(8), Layout(dp=8), m=1, global_batch=48,
                     zero=3, recompute="selective", fused_attention=True)
    assert attention_held(short) is None and attention_caution(short) == ""


def test_the_table_prints_each_bucket_and_the_fitted_shares():
    table = sequence_table()
    assert "19 of 32 rows within reported/predicted 0.8-1.25" in table
    assert "the H100 shares are fitted to rows with attention at most 57% of the FLOPs" in table
    assert "H100          50% to 100%    11   0.55   0.68 (median)  0.77" in table


def test_low_median_high_takes_the_middle_or_the_mean_of_the_two_middles():
    from parlib.cost.foundry import low_median_high
    assert low_median_high([0.9, 0.5, 1.2]) == (0.5, 0.9, 1.2)
    assert low_median_high([1.0, 0.5, 1.2, 0.8]) == (0.5, 0.9, 1.2)
