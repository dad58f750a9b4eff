"""bench/gpu.py runs as a dry run on the CPU, and lists a rank function that fails; bench/cost.py's
defaults are the experiment's own constants; bench/combined.py's example runs as written."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_script_dry_run_measures_and_predicts(capsys):
    gpu = _load("gpu")
    assert gpu.main(["--device", "cpu", "--sections", "matmul", "step"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "float32" in out and "measured/predicted" in out


def test_gpu_script_lists_a_failing_rank_function(monkeypatch):
    gpu = _load("gpu")
    from parlib.experiments import pipeline

    monkeypatch.setitem(gpu.CASES, "broken", lambda world: (
        pipeline.rank_step, (gpu.SMALL,), dict(schedule_name="no such schedule")))
    status, detail = gpu.run_case("broken", 2, gpu.torch.device("cpu"), timeout=60)
    assert status == "FAIL" and detail
    status, detail = gpu.run_case("layouts.rank_time_layouts", 2, gpu.torch.device("cpu"),
                                  timeout=60)
    assert status == "ok" and "gradients match" in detail, detail


def test_gpu_script_runs_the_strategies_under_nccl_rules():
    gpu = _load("gpu")
    status, detail = gpu.run_case("nccl_rules.rank_nccl_rules", 2, gpu.torch.device("cpu"),
                                  timeout=120)
    # 4 schedules, 2 ring layouts, the experts; the exchange to itself needs NCCL
    assert status == "ok" and "7 checks under NCCL's rules" in detail, detail
    assert "skipped: exchange to self" in detail
    ranks = [{"ring zigzag": "ok", "experts all-to-all": "ok"},
             {"ring zigzag": "FAIL: output or gradients: 1 of 4 differ",
              "experts all-to-all": "ok"}]
    status, detail = gpu._rules_verdict(ranks, "1 s")
    assert (status, detail) == ("FAIL", "ring zigzag: output or gradients: 1 of 4 differ")


@pytest.mark.slow
def test_gpu_script_full_dry_run_passes_on_cpu(capsys):
    gpu = _load("gpu")
    assert gpu.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "(0 failing of" in out, out


def test_cost_script_defaults_are_the_experiments_constants():
    cost = _load("cost")
    from parlib.experiments import layouts as L

    ap_defaults = {a.dest: a.default for a in cost.build_parser()._actions}
    assert ap_defaults["slowdown"] == L.SLOWDOWN
    assert ap_defaults["flops_per_byte"] == L.SLOW_LINK_FLOPS_PER_BYTE
    assert set(ap_defaults["sections"]) == {"plan", "published", "foundry", "ranking",
                                            "avoided", "calibration", "heldout", "network",
                                            "layouts"}
    assert ap_defaults["link"] == "paced"
    assert "grid" in cost.SECTIONS and ap_defaults["grid"] is None


def test_cost_scripts_foundry_section_prints_every_llm_foundry_table(capsys):
    cost = _load("cost")
    from parlib.cost.foundry import foundry_table, microbatch_table
    from parlib.cost.foundry_held_out import foundry_held_out_table
    from parlib.cost.foundry_reruns import rerun_table
    from parlib.cost.foundry_sequence import sequence_table

    assert cost.main(["--sections", "foundry"]) == 0
    out = capsys.readouterr().out
    for table in (foundry_table(), rerun_table(), foundry_held_out_table(), sequence_table(),
                  microbatch_table()):
        assert table in out


def test_cost_script_scores_a_grid_file_and_asks_for_one(tmp_path, capsys):
    cost = _load("cost")
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"<!-- grid example -->\n```csv\n(.*?)```", readme, re.S).group(1)
    path = tmp_path / "grid.csv"
    path.write_text(example)
    assert cost.main(["--sections", "grid", "--grid", str(path)]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "median measured / predicted MFU: 0.95 over 4 rows" in out
    with pytest.raises(SystemExit, match="pass --grid FILE.csv"):
        cost.main(["--sections", "grid"])


def test_combined_scripts_second_example_runs_as_written(capsys):
    """bench/combined.py's docstring: ``python bench/combined.py --layouts 4d --steps 3
    --schedule gpipe``, as written (8 ranks: the 4-axis run, checked against one device)."""
    combined = _load("combined")
    line = next(x for x in combined.__doc__.splitlines() if "--layouts" in x)
    words = line.split()
    assert words[:2] == ["python", "bench/combined.py"], line
    combined.main(words[2:])
    out = capsys.readouterr().out
    assert "4d: t=2 x c=2 x p=2 e=2 on 8 ranks, gpipe" in out, out
    assert "every rank exact" in out and out.rstrip().endswith("measured / predicted: 1.00")
