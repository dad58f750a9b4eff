"""bench/checkpoint.py runs on a tiny model: both tables, every layout, the ratios, the
staging copy measured next to its prediction."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import cloudpickle

ROOT = Path(__file__).parents[2]


def test_checkpoint_bench_prints_times_and_bytes(capsys):
    spec = importlib.util.spec_from_file_location("bench_checkpoint",
                                                  ROOT / "bench" / "checkpoint.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    cloudpickle.register_pickle_by_value(bench)  # the ranks cannot import it by this name
    assert bench.main(["--ranks", "2", "--rounds", "1", "--d-model", "16", "--layers",
                       "1"]) == 0
    out = capsys.readouterr().out
    assert "async call / save" in out and "disk/predicted" in out
    assert "fsdp x2" in out and "zero1 x2" in out
    assert "staged (busiest)" in out and "staged/predicted" in out
