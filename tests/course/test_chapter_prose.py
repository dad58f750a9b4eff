"""The prose of the tensor-parallel, combining, choosing and long-runs chapters quotes only
numbers the run prints or computes, or that are stated inputs: every number in a markdown
cell appears as a token of the notebook's code (an input the run uses, so the run prints
what follows from it), or is listed below with the computation that gives it, or is a
citation. Stated
expectations are worded as such ("expect", "should") and the run's own figure is printed
next to them. Also: what the issue behind this guard found stale stays gone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
NOTEBOOKS = ("03_tensor_parallel", "07_combining", "08_choosing", "09_long_runs")
_NUMBER = re.compile(r"(?<![\w.^/-])\d+(?:,\d{3})*(?:\.\d+)?")
_CITATION = re.compile(r"et al\.,? (19|20)\d\d|\b(19|20)\d\d\b(?=[,)]| \()")


def _cells(name: str, kind: str) -> list[str]:
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def _prose(text: str) -> str:
    """Markdown without code spans, formulas and headings."""
    text = re.sub(r"`[^`]*`|\$\$.*?\$\$|\$[^$]*\$", " ", text, flags=re.S)
    return re.sub(r"^#+ .*$", " ", text, flags=re.M)


def _stated() -> dict[str, dict[str, float]]:
    """Numbers the prose states, each with the computation (from the course's own
    definitions) that gives it."""
    from parlib.cost import Hardware, Model, checkpoint_bytes
    from parlib.cost.published import RUNS
    from parlib.model import ModelConfig

    cfg = ModelConfig()
    gpt13b = Model(40, 5120, 40, 2048, 51200)
    llama = [r for r in RUNS if "405" in r.name]
    return {
        "03_tensor_parallel": {
            "16": 16,  # bytes per parameter of mixed-precision Adam (cost.adam_bytes_per_param)
            "1.5": (2 * 3 / 4) / (2 * 1 / 2),  # 2(t-1)/t from t = 2 to t = 4
            "256": cfg.vocab_size,  # the embedding's rows
            "12": 4 + 2 * 4,  # 12h^2 per layer: q, k, v, out (4h^2), up and down (2 x 4h^2)
            "10": 10,  # Korthikanti et al.'s "10 sbh", quoted with its source
            "4.2": 4.2,  # the section of that paper the prose cites (4.2.2)
        },
        "07_combining": {"80": Hardware.dgx_a100(8).memory_bytes / 1e9},
        "08_choosing": {
            "210": round(16 * gpt13b.n_params / 1e9, -1),
            "405": 405 if llama else None,
            "8,192": 8192 if llama else None,
            "16,384": 16384 if llama else None,
        },
        # bytes a parameter of a mixed-precision Adam checkpoint (bf16 and fp32 weights, moments)
        "09_long_runs": {"14": checkpoint_bytes(1, mixed_precision=True).total},
    }


def unexplained_numbers(markdown: list[str], code: list[str],
                        stated: dict[str, float]) -> list[str]:
    """Numbers in ``markdown`` that are neither a token of ``code``, nor in ``stated``,
    nor a citation's year."""
    tokens = set(_NUMBER.findall("\n".join(code)))
    tokens |= {t.replace(",", "") for t in tokens}
    out = []
    for text in markdown:
        prose = _prose(text)
        years = {m.start() for m in re.finditer(r"\b(19|20)\d\d\b", prose)
                 if _CITATION.search(prose[max(0, m.start() - 12):m.end() + 3])}
        for m in _NUMBER.finditer(prose):
            n = m.group(0)
            if n in tokens or n.replace(",", "") in tokens or n in stated or m.start() in years:
                continue
            out.append(f"{n!r} in: {' '.join(prose[max(0, m.start() - 50):m.end() + 30].split())}")
    return out


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_number_in_the_prose_is_printed_computed_or_stated(name):
    stated = _stated()[name]
    # the listed computations still give the numbers the prose quotes
    for text, value in stated.items():
        assert value is not None and float(text.replace(",", "")) == pytest.approx(value), text
    bad = unexplained_numbers(_cells(name, "markdown"), _cells(name, "code"), stated)
    assert not bad, f"{name}: numbers in prose that the run neither prints nor states:\n" + \
        "\n".join(bad)


def test_the_guard_catches_a_quoted_figure():
    md = ["rank 0 made 16 tp all-reduces and 34 dp all-reduces (Smith et al. 2021)"]
    bad = unexplained_numbers(md, ["rank = 0\nn_tp = 4 * L * m  # 16 in all"], {})
    assert len(bad) == 1 and "'34'" in bad[0], bad


def test_what_the_issue_found_stale_stays_gone():
    combining = "\n".join(_cells("07_combining", "markdown"))
    choosing = "\n".join(_cells("08_choosing", "markdown"))
    # the timeline's colours and counts come from the run (plots.AXIS_STYLE, the spans)
    for colour in ("red", "brown", "green", "purple"):
        assert not re.search(rf"\b{colour}\b", combining), colour
    assert "AXIS_STYLE" in "\n".join(_cells("07_combining", "code"))
    assert "no single strategy can hold" not in combining
    assert "the pipeline is the axis that crosses them" not in combining
    assert "lean on data parallelism" not in choosing
    assert "This is the bandwidth-bound case of section 2, measured" not in choosing
    assert "More devices in data parallelism do not help" not in choosing
    # the choosing chapter's model now runs at achievable rates: a prediction, not a bound;
    # the rate here is one thread's, its spread printed; the slow link follows that rate
    choosing_code = "\n".join(_cells("08_choosing", "code"))
    for stale in ("lower bound", "upper bound", "at peak compute", "5 MB/s", "200 ns"):
        assert stale not in choosing, stale
    for stale in ("one core", "within 25%", "peak compute", "beta=200e-9", "m=64)"):
        assert stale not in choosing_code, stale
    assert "measure_rate()" in choosing_code and "slow_link_beta(EMULATED_RATE)" in choosing_code
    for term in ("**MFU**", "**HFU**"):  # defined where first used
        assert term in choosing, term
    # the experts chapter's advice on splitting them names the other ways to fit them, and the
    # choosing chapter's cost model predicts the fastest of each kind for its Mixtral shape
    # (there keeping the experts whole comes out ahead: tests/cost/test_planner.py)
    experts = "\n".join(_cells("06_expert_parallel", "markdown"))
    assert "ZeRO-3 shards them" in experts and "cost model predicts the fastest" in experts
    assert "keeping the experts whole, sharded within each node, comes out" in experts
    assert "experts_split_or_whole(model, hardware" in choosing_code
    tensor = "\n".join(_cells("03_tensor_parallel", "markdown"))
    assert "by construction" in tensor  # the slow-link race's agreement is said to be built in
