"""A measured grid scored against the cost model (parlib.cost.grid): each measure against a
hand-worked case, and every malformed file refused with its line named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parlib.cost.grid import COLUMNS, GRID_TARGETS, grid_table, read_grid, score_grid
from parlib.cost.held_out import MEMORY_FACTS, held_out_runs

ROOT = Path(__file__).resolve().parents[2]
SHAPE = "llama8b,32,4096,32,8,14336,128256,8192,true"
# (dp, tp, pp, micro_batch, zero, recompute) at each GPU count; every one fits on H100s
LAYOUTS = ((1, 1, 1, 1, 3, "full"), (1, 1, 1, 1, 3, "op"), (2, 2, 1, 1, 1, "selective"),
           (4, 4, 1, 2, 1, "selective"), (2, 1, 2, 1, 1, "full"))


def grid_text(measured=lambda gpus, i, predicted: predicted, extra: str = "") -> str:
    """A grid of the 8B shape on 8 and 16 H100s; ``measured(gpus, i, predicted)`` gives
    each row's tokens/s/GPU from the model's own prediction (None: did not run)."""
    lines = [",".join(COLUMNS)]
    for gpus in (8, 16):
        for i, (split, tp, pp, micro, zero, recompute) in enumerate(LAYOUTS):
            dp = gpus // split
            row = (f"{SHAPE},dgx_h100,{gpus},{dp},{tp},{pp},1,1,{micro},{gpus * 4},{zero},"
                   f"{recompute},true,unfused,,")
            predicted = _predicted(row)
            value = measured(gpus, i, predicted)
            lines.append(row + ("" if value is None else f"{value:.6f}"))
    return "\n".join(lines) + extra + "\n"


def _predicted(row: str) -> float:
    (only,) = read_grid(",".join(COLUMNS) + "\n" + row + "1\n")
    est = only.estimate()
    return est.global_batch * est.model.seq_len / est.step_time / est.hardware.n_devices


def test_a_grid_measured_at_half_the_prediction_orders_and_picks_perfectly():
    score = score_grid(read_grid(grid_text(lambda g, i, p: 0.5 * p)))
    assert [(c.model, c.gpus) for c in score.clusters] == [("llama8b", 8), ("llama8b", 16)]
    assert all(c.correlation == pytest.approx(1.0) for c in score.clusters)
    assert all(c.pick_ratio == pytest.approx(1.0) for c in score.clusters)
    assert score.median_rate == pytest.approx(0.5)
    assert score.meets() == {"correlation": True, "pick": True, "rate": False}
    table = grid_table(score)
    print("\n" + table)
    assert "median measured / predicted MFU: 0.50 over 10 rows" in table
    assert f"(target {GRID_TARGETS['rate']:g}: not met)" in table


def test_a_reversed_order_scores_minus_one_and_the_worst_pick():
    text = grid_text(lambda g, i, p: 1e6 / p)  # the predicted fastest measured slowest
    score = score_grid(read_grid(text))
    for c in score.clusters:
        assert c.correlation == pytest.approx(-1.0)
        measured = [r.measured for r in c.rows]
        assert c.pick_ratio == pytest.approx(min(measured) / max(measured))
    assert score.meets()["correlation"] is False


def test_two_swapped_rows_of_three_give_a_half():
    # ranks (1, 2, 3) against (1, 3, 2): 1 - 6 x 2 / (3 x 8) = 0.5
    def measured(gpus, i, predicted):
        if i >= 3:
            return None
        return predicted
    rows = read_grid(grid_text(measured))
    ests = [r.estimate() for r in rows[:3]]
    order = sorted(range(3), key=lambda k: ests[k].step_time)  # fastest first
    values = {order[0]: 300.0, order[1]: 100.0, order[2]: 200.0}

    def swapped(gpus, i, predicted):
        return values[i] if i < 3 else None
    score = score_grid(read_grid(grid_text(swapped)))
    assert score.clusters[0].correlation == pytest.approx(0.5)
    assert score.clusters[0].pick_ratio == pytest.approx(1.0)


def test_a_pick_that_did_not_run_scores_zero():
    rows = read_grid(grid_text())
    eight = [r for r in rows if r.hardware.n_devices == 8]
    ests = [r.estimate() for r in eight]
    pick = max(range(len(eight)), key=lambda k: ests[k].global_batch / ests[k].step_time)

    def measured(gpus, i, predicted):
        return None if (gpus == 8 and i == pick) else predicted
    score = score_grid(read_grid(grid_text(measured)))
    by_gpus = {c.gpus: c for c in score.clusters}
    assert by_gpus[8].pick_ratio == 0.0 and by_gpus[16].pick_ratio == pytest.approx(1.0)
    assert [r.line for r in score.fitting_not_run] == [2 + pick]
    assert score.picks() == {"llama8b": (pytest.approx(0.5), 0.0)}
    assert score.meets()["pick"] is False
    assert "(did not run)" in grid_table(score)


def test_a_gpu_count_where_nothing_ran_is_no_cluster_but_its_memory_counts():
    # 32 GPUs: every layout left empty, as if the nodes had never come up
    extra = "".join(f"\n{SHAPE},dgx_h100,32,{32 // s},{t},{p},1,1,{mb},128,{z},{rc},true,unfused,,"
                    for s, t, p, mb, z, rc in LAYOUTS)
    score = score_grid(read_grid(grid_text(extra=extra)))
    assert [c.gpus for c in score.clusters] == [8, 16]
    assert [r.line for r in score.fitting_not_run] == [12, 13, 14, 15, 16]


def test_a_layout_that_ran_though_the_model_says_it_does_not_fit_is_counted():
    # no ZeRO on 8 GPUs: 8B parameters x 16 bytes each on every GPU, over 80 GB
    extra = f"\n{SHAPE},dgx_h100,8,8,1,1,1,1,1,32,0,full,true,unfused,,1000"
    score = score_grid(read_grid(grid_text(extra=extra)))
    assert [r.line for r in score.ran_not_fitting] == [12]
    assert not score.clusters[0].estimates[-1].fits


def test_a_file_on_disk_reads_as_the_text_does(tmp_path):
    path = tmp_path / "grid.csv"
    path.write_text(grid_text())
    assert read_grid(path) == read_grid(grid_text()) == read_grid(str(path))


ROW = f"{SHAPE},dgx_h100,8,8,1,1,1,1,1,32,3,full,true,unfused,4,1000"


@pytest.mark.parametrize("row, message", [
    (ROW.replace(",dgx_h100,", ",tpu_v5,"), "hardware must be one of"),
    (ROW.replace(",8,8,1,1,1,1,1,32,", ",8,4,1,1,1,1,1,32,"), "multiply to 4, not gpus = 8"),
    (ROW.replace(",1,1,32,3,", ",1,3,32,3,"), "global_batch 32 is not a multiple of dp x "
                                               "micro_batch = 24"),
    (ROW.replace(",full,", ",some,"), "recompute must be one of"),
    (ROW.replace(",unfused,", ",liger,"), "loss must be one of"),
    (ROW.replace(",1000", ",fast"), "tokens_per_s_per_gpu must be a number or empty"),
    (ROW.replace(",1000", ",-5"), "tokens_per_s_per_gpu must be > 0"),
    (ROW.replace(",true,unfused", ",yes,unfused"), "fused_attention must be true or false"),
    (ROW.replace(",32,3,full", ",32,4,full"), "zero must be 0-3"),
    (ROW.replace(",unfused,4,", ",unfused,8,"), "grad_reduce_bytes must be 2, 4 or empty"),
    (ROW.replace("llama8b,32,", "llama8b,x,"), "layers must be a whole number"),
    (ROW.replace(",4096,32,8,", ",4096,32,5,"), "not divisible by n_kv_heads=5"),
])
def test_a_bad_value_is_refused_with_its_line(row, message):
    with pytest.raises(ValueError, match=r"grid line 2: .*" + re.escape(message)):
        read_grid(",".join(COLUMNS) + "\n" + row + "\n")


def test_a_missing_column_a_second_shape_and_an_unestimable_layout_are_refused():
    with pytest.raises(ValueError, match=r"lacks the columns \['loss'\]"):
        read_grid(",".join(c for c in COLUMNS if c != "loss") + "\n" + ROW + "\n")
    other = ROW.replace("llama8b,32,", "llama8b,16,")
    with pytest.raises(ValueError, match="grid line 3: model 'llama8b' has another shape"):
        read_grid(",".join(COLUMNS) + "\n" + ROW + "\n" + other + "\n")
    with pytest.raises(ValueError, match="no rows after the header"):
        read_grid(",".join(COLUMNS) + "\n")
    interleaved_without_pipeline = ROW.replace(",8,8,1,1,1,1,", ",8,8,1,1,1,2,")
    rows = read_grid(",".join(COLUMNS) + "\n" + interleaved_without_pipeline + "\n")
    with pytest.raises(ValueError, match="grid line 2: the model cannot estimate this layout"):
        score_grid(rows)


def test_the_readme_example_reads_and_scores():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- grid example -->\n```csv\n(.*?)```", readme, re.S)
    assert block, "the README's grid example is missing"
    rows = read_grid(block.group(1))
    score = score_grid(rows)
    print("\n" + grid_table(score))
    # the example is torchtitan's table as parlib.cost.held_out holds it: the same ratios of
    # reported to predicted, and the same verdicts on memory (the last row ran out of it)
    runs = held_out_runs()
    assert score.rate_ratios == pytest.approx([r.ratio() for r in runs], rel=1e-9)
    assert [e.fits for c in score.clusters for e in c.estimates] == [
        f.estimate().fits for f in MEMORY_FACTS] == [True, True, True, True, False]
    assert score.ran_not_fitting == score.fitting_not_run == ()
    assert [c.correlation for c in score.clusters] == [None, None]  # under 3 rows ran each
