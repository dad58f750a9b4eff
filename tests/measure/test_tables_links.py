"""Table alignment and wrapping; the saved all-reduce fit (parlib.measure.links)."""

from __future__ import annotations

import json

import pytest

import parlib
from parlib import cost
from parlib.measure import Table, links
from parlib.plots import WHO_PAYS


def test_text_columns_left_numbers_right_in_html():
    t = Table(["collective", "who pays for it"], WHO_PAYS)
    html = t._repr_html_()
    assert html.count('style="text-align: left"') == 2 * (1 + len(WHO_PAYS))
    mixed = Table(["N", "what"], [[2, "a"], [4, "b"]])._repr_html_()
    assert "<td>2</td>" in mixed and '<td style="text-align: left">a</td>' in mixed


def test_long_text_column_wraps_to_max_width():
    t = Table(["collective", "who pays for it"], WHO_PAYS)
    lines = str(t).splitlines()
    assert max(len(x) for x in lines) <= 100
    # every word of the long column survives the wrapping, in order
    words = " ".join(x[len("reduce-scatter  "):].strip() for x in lines[2:]).split()
    assert words == " ".join(r[1] for r in WHO_PAYS).split()
    narrow = Table(["a", "b"], [["x" * 10, "word " * 30]], max_width=40)
    assert max(len(x) for x in str(narrow).splitlines()) <= 40


def test_fit_recovers_alpha_beta_and_round_trips(tmp_path, monkeypatch):
    alpha, beta, n = 50e-6, 1 / 2e9, 4
    sizes = [2**k for k in range(10, 23, 2)]
    seconds = [cost.collective_time("all_reduce", s, n, alpha, beta) for s in sizes]
    fit = links.fit_link(n, sizes, seconds)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6) and fit.beta == pytest.approx(beta, rel=1e-6)
    assert max(abs(r) for r in fit.residuals) < 1e-6
    # bus bandwidth tends to 1/beta as latency stops mattering
    assert fit.bus_bandwidth() < 1 / beta
    monkeypatch.setenv("PARLIB_CACHE_DIR", str(tmp_path))
    assert links.load_link(n) is None
    path = links.save_links({n: fit})
    assert path == tmp_path / "links.json"
    back = links.load_link(n)
    assert back is not None and back.alpha == fit.alpha and back.sizes == sizes
    assert links.load_link(2) is None and links.load_link(n, backend="nccl") is None
    path.write_text("{not json")
    assert links.load_link(n) is None
    path.write_text(json.dumps({str(n): {"n": n}}))
    assert links.load_link(n) is None


def test_time_all_reduce_on_two_ranks():
    sizes = [2**10, 2**16]
    medians, iqr, dev, backend = parlib.launch(links.time_all_reduce, sizes, rounds=2,
                                               per_round=2, world_size=2)[0]
    assert len(medians) == len(iqr) == 2 and all(t > 0 for t in medians)
    assert backend in ("gloo", "nccl")
    with pytest.raises(parlib.RankError, match="rounds"):
        parlib.launch(links.time_all_reduce, sizes, rounds=0, world_size=2)


def test_load_or_measure_prefers_the_saved_fit(tmp_path, monkeypatch):
    alpha, beta, n = 50e-6, 1 / 2e9, 4
    calls = []

    def fake_launch(fn, sizes, *, rounds, world_size, backend, **kwargs):
        calls.append((fn, world_size, backend, kwargs))
        seconds = [cost.collective_time("all_reduce", s, n, alpha, beta) for s in sizes]
        return [(seconds, [0.0] * len(sizes), "cpu", "gloo")] * world_size

    monkeypatch.setenv("PARLIB_CACHE_DIR", str(tmp_path))
    fit, source = links.load_or_measure(n, launch=fake_launch, timeout=9)
    assert source == "a quick fit made now" and fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert calls == [(links.time_all_reduce, n, None, {"timeout": 9})]
    links.save_links({n: fit})
    again, source = links.load_or_measure(n, launch=fake_launch)
    assert source == "the launching chapter's fit" and again.alpha == fit.alpha and len(calls) == 1
