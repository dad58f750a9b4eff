"""parlib.check / parlib.explain: statuses, hints, bad input, modes, log, ring mutants."""

from __future__ import annotations

import json
import textwrap
import time

import numpy as np
import pytest
import torch

from parlib.course import registry
from parlib.course.check import check, explain
from parlib.course.question_types import Choice, Expression, Implementation, Numeric
from parlib.course.questions.ch00 import RING_SOLUTION
from parlib.course.registry import register
from parlib.course.results import CheckError, CheckFailed
from parlib.runtime.errors import trim_traceback
from tests.helpers.learner_code import learner

pytestmark = pytest.mark.usefixtures("clean_checks")




# --------------------------------------------------------------------------- numeric

@pytest.fixture
def numq():
    q = register(Numeric(
        "99.num", 100.0, unit="bytes", prompt="p", working="the **working**",
        mistakes={200.0: "you counted the send and the receive"},
    ))
    yield q
    registry._REGISTRY.pop("99.num", None)


def test_numeric_pass_within_tolerance(numq):
    r = check("99.num", 100.05)
    assert r.passed and r.status == "passed" and r.score == 1 and r.max_score == 1
    assert repr(r).count("\n") == 0
    assert "parlib.explain('99.num')" in repr(r)
    assert "passed" in r._repr_html_()


def test_numeric_outside_tolerance_fails(numq):
    r = check("99.num", 101.0)
    assert r.status == "failed" and r.score == 0 and "too high" in r.message


def test_numeric_accepts_numpy_and_torch_scalars(numq):
    assert check("99.num", np.float32(100.0)).passed
    assert check("99.num", torch.tensor(100.0)).passed
    assert check("99.num", 100).passed


def test_numeric_mistake_hint(numq):
    r = check("99.num", 200)
    assert r.status == "failed"
    assert "send and the receive" in r.message


def test_numeric_unit_factor_hint(numq):
    r = check("99.num", 800)
    assert r.status == "failed" and "bits" in r.message


@pytest.mark.parametrize("bad, words", [
    ("100", "not a string"),
    ("0.5", "not a string"),
    (float("nan"), "finite"),
    (float("inf"), "finite"),
    ([100, 100], "single number"),
    (np.ones(3), "single number"),
    (torch.ones(2, 2), "single number"),
    (True, "True/False"),
    ({"a": 1}, "single number"),
    (object(), "give a number"),
])
def test_numeric_bad_input_fails_without_raising(numq, bad, words):
    r = check("99.num", bad)
    assert r.status == "failed", r
    assert words in r.message
    assert not r.passed


@pytest.mark.parametrize("stub", [..., None])
def test_stub_is_not_attempted(numq, stub):
    r = check("99.num", stub)
    assert r.status == "not attempted"
    assert r.score == 0 and "not attempted" in repr(r)


def test_unknown_id_lists_nearby_ids():
    r = check("00.ring_byte", 1)
    assert r.status == "error"
    assert "00.ring_bytes" in r.message and "Did you mean" in r.message
    r = check(42, 1)
    assert r.status == "error" and "string" in r.message


def test_real_chapter00_numeric_questions():
    assert check("00.ring_bytes", 6 * 2**20).passed
    r = check("00.ring_bytes", 12 * 2**20)
    assert "send" in r.message and "receiv" in r.message
    assert check("00.p2p_time", 1.6977).passed
    assert "latency" in check("00.p2p_time", 1.6777).message
    assert check("00.all_gather_mib", 14).passed
    assert "own shard" in check("00.all_gather_mib", 16).message


# --------------------------------------------------------------------------- unit slips


def _numeric_questions() -> dict[str, Numeric]:
    return {qid: q for qid, q in registry.questions().items() if isinstance(q, Numeric)}


def _in_bytes(q: Numeric) -> bool:
    from parlib.course.question_types import _BYTE_UNIT

    return q.unit is not None and bool(_BYTE_UNIT.search(q.unit))


@pytest.mark.parametrize("factor, names", [
    (2**20 / 1e6, "2^20"), (1e6 / 2**20, "2^20"),  # MiB vs MB, either way
    (2**30 / 1e9, "2^30"), (1e9 / 2**30, "2^30"),  # GiB vs GB, either way
])
def test_binary_and_decimal_prefixes_are_named_in_every_question_in_bytes(factor, names):
    # before, GB for GiB (and GiB for GB) was "too low; check your working" wherever the
    # question had no mistake of its own for it, and MiB vs MB was named in every question,
    # microbatches and parameters included
    in_bytes = {qid: q for qid, q in _numeric_questions().items() if _in_bytes(q)}
    assert len(in_bytes) >= 10, sorted(in_bytes)
    for qid, q in in_bytes.items():
        r = check(qid, q.answer * factor)
        assert r.status == "failed" and names in r.message, (qid, r.message)


@pytest.mark.parametrize("unit, answer", [("bytes", 100.0), ("ms", 3.0), (None, 0.25),
                                          ("parameters", 1e6)])
def test_every_unit_slip_reaches_its_hint(unit, answer):
    from parlib.course.question_types import unit_slips

    q = register(Numeric("99.slips", answer, unit=unit, prompt="p", working="w"))
    try:
        for factor, hint in unit_slips(answer, unit):
            r = check("99.slips", answer * factor)
            assert r.status == "failed" and (hint or "looks like a percent") in r.message, (
                factor, r.message)
    finally:
        registry._REGISTRY.pop(q.id, None)


def test_prefixes_are_named_only_where_the_answer_is_in_bytes():
    counts = {qid: q for qid, q in _numeric_questions().items()
              if not _in_bytes(q) and q.unit is not None}
    assert counts, "some question counts things (parameters, microbatches, ...)"
    for qid, q in counts.items():
        r = check(qid, q.answer * 2**20 / 1e6)
        assert "MiB" not in r.message and "2^20" not in r.message, (qid, r.message)


def test_a_percent_is_named_in_every_question_that_asks_for_a_fraction():
    fractions = {qid: q for qid, q in _numeric_questions().items()
                 if q.unit is None and 0 < q.answer < 1}
    assert {"04.bubble", "04.bubble_naive", "04.interleaved_bubble", "04.zb_removed",
            "08.seed_bubble"} <= set(fractions)
    for qid, q in fractions.items():
        r = check(qid, 100 * q.answer)
        assert r.status == "failed" and "looks like a percent" in r.message, (qid, r.message)


def test_a_percent_is_named_for_a_plain_numeric_fraction():
    q = register(Numeric("99.frac", 0.3, prompt="p", working="w"))
    try:
        assert "looks like a percent" in check("99.frac", 30).message
        assert "looks like a percent" not in check("99.frac", 3).message
    finally:
        registry._REGISTRY.pop(q.id, None)


def test_every_tolerance_separates_the_slips_it_names():
    # a tolerance wide enough to accept a named slip accepts a wrong answer: before,
    # 06.params_per_rank (0.1%) accepted the router left out or sharded (0.03% off)
    from parlib.course.question_types import RoundedFraction, unit_slips

    for qid, q in _numeric_questions().items():
        for wrong in q.mistakes:
            assert not q._close(float(wrong), q.answer), (qid, wrong)
            if isinstance(q, RoundedFraction):  # a mistake to the fewest digits it accepts
                coarse = float(f"{float(wrong):.{q.min_digits}g}")
                assert check(qid, coarse).status == "failed", (qid, wrong, coarse)
                assert check(qid, float(wrong)).message.endswith(q.mistakes[wrong]), qid
        for factor, _ in unit_slips(q.answer, q.unit):
            assert not q._close(q.answer * factor, q.answer), (qid, factor)


def test_the_same_quantity_is_judged_the_same_way_everywhere():
    # 04.bubble and 08.seed_bubble ask for the same 3/11: 0.27 failed the first (rtol 1e-3)
    # and passed the second (judged by the rounding of its digits)
    from collections import defaultdict

    same = defaultdict(list)
    for q in _numeric_questions().values():
        same[(float(f"{q.answer:.9g}"), q.unit)].append(q)
    for group in same.values():
        rules = {(type(q), q.rtol, q.atol, getattr(q, "min_digits", None)) for q in group}
        assert len(rules) == 1, [q.id for q in group]
    for answer in (0.27, 0.273, 3 / 11, 0.3, 27, 0.28, 0.38):
        verdicts = {qid: check(qid, answer) for qid in ("04.bubble", "08.seed_bubble")}
        assert len({r.status for r in verdicts.values()}) == 1, (answer, verdicts)
    assert check("04.bubble", 0.27).passed


# --------------------------------------------------------------------------- choice / expr

def test_choice():
    assert check("00.dp_collective", "b").passed
    assert check("00.dp_collective", " (B) ").passed
    r = check("00.dp_collective", "A")
    assert r.status == "failed" and "start-up" in r.message
    r = check("00.dp_collective", "E")
    assert r.status == "failed" and "A, B, C, D" in r.message
    r = check("00.dp_collective", 2)
    assert r.status == "failed" and "letter" in r.message
    assert check("00.dp_collective", ...).status == "not attempted"


def test_expression():
    assert check("00.ring_formula", "2*(N-1)*n/N").passed
    assert check("00.ring_formula", "2*n - 2*n/N").passed
    r = check("00.ring_formula", "(N-1)/N*n")
    assert r.status == "failed" and "one phase" in r.message
    r = check("00.ring_formula", "2*(N-1)/N*x")
    assert r.status == "failed" and "unknown name" in r.message
    r = check("00.ring_formula", "__import__('os').system('true')")
    assert r.status == "failed"
    r = check("00.ring_formula", "2*(N-1")
    assert r.status == "failed" and "formula" in r.message
    assert check("00.ring_formula", 3.0).status == "failed"


def test_expression_definition_is_validated():
    with pytest.raises(CheckFailed):
        Expression("99.bad", "2*(", variables=["N"], prompt="p", working="w")
    with pytest.raises(ValueError):
        Choice("99.bad", "E", options={"A": "a"}, prompt="p", working="w")
    with pytest.raises(ValueError):
        Numeric("bad id", 1, prompt="p", working="w")


# --------------------------------------------------------------------------- modes / log

def test_strict_mode_raises_on_anything_but_pass(numq, monkeypatch):
    monkeypatch.setenv("PARLIB_CHECK_MODE", "strict")
    assert check("99.num", 100).passed
    with pytest.raises(CheckError):
        check("99.num", ...)
    with pytest.raises(AssertionError):
        check("99.num", 5)


def test_expect_fail_mode_raises_on_pass(numq, monkeypatch):
    monkeypatch.setenv("PARLIB_CHECK_MODE", "expect-fail")
    assert check("99.num", ...).status == "not attempted"
    assert check("99.num", 1).status == "failed"
    with pytest.raises(CheckError):
        check("99.num", 100)


def test_log_appends_one_json_line_per_check(numq, monkeypatch, tmp_path):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("PARLIB_CHECK_LOG", str(log))
    check("99.num", 100)
    check("99.num", ...)
    check("99.nope", 1)
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["passed", "not attempted", "error"]
    assert set(rows[0]) == {"id", "status", "score", "max_score", "message", "answer"}
    assert rows[0]["id"] == "99.num" and rows[0]["score"] == 1
    assert rows[0]["answer"] == 100 and rows[1]["answer"] == {"__kind__": "ellipsis"}


def test_summary_table(numq):
    assert "No checks" in repr(check.summary())
    check("99.num", 1)
    check("99.num", 100)  # latest result per question counts
    check("00.dp_collective", ...)
    s = check.summary()
    text = repr(s)
    assert "99.num" in text and "passed" in text and "not attempted" in text
    assert text.splitlines()[-1].split()[-1] == "1/2"
    assert "<table>" in s._repr_html_()


def test_explain_only_after_attempt(numq, capsys):
    explain("99.num")
    assert "Try question 99.num first" in capsys.readouterr().out
    check("99.num", 3)
    explain("99.num")
    assert "the **working**" in capsys.readouterr().out
    explain("99.nope")
    assert "no question" in capsys.readouterr().out


def test_check_never_raises_on_grader_bug():
    def broken(fn):
        raise KeyError("bug in the grader")
    register(Implementation("99.broken", broken, prompt="p", working="w"))
    try:
        r = check("99.broken", lambda: 1)
        assert r.status == "error"
    finally:
        registry._REGISTRY.pop("99.broken", None)


# --------------------------------------------------------------------------- tracebacks

def test_trim_traceback_keeps_learner_frames():
    tb = textwrap.dedent('''\
        Traceback (most recent call last):
          File "/x/site-packages/parlib/_rank.py", line 10, in run
            out = fn()
          File "/tmp/ipykernel_1/123.py", line 3, in my_ring
            dist.send(t, 9)
          File "/x/site-packages/torch/distributed/c10d_logger.py", line 81, in wrapper
            return func(*args, **kwargs)
        ValueError: Invalid destination rank
        ''')
    out = trim_traceback(tb)
    assert "my_ring" in out and "dist.send(t, 9)" in out
    assert "torch" not in out.replace("torch", "", 0) or "c10d_logger" not in out
    assert "c10d_logger" not in out and "runtime/worker.py" not in out
    assert out.splitlines()[-1] == "ValueError: Invalid destination rank"


def test_local_learner_exception_is_error_with_trimmed_traceback():
    def grader(fn):
        fn(1)
    register(Implementation("99.local", grader, prompt="p", working="w"))
    try:
        def my_fn(x):
            return x / 0
        r = check("99.local", my_fn)
        assert r.status == "error"
        assert "ZeroDivisionError" in r.message
        assert "my_fn" in r.traceback and "parlib/course" not in r.traceback
        assert "ZeroDivisionError" in repr(r)
    finally:
        registry._REGISTRY.pop("99.local", None)


# --------------------------------------------------------------------------- ring all-reduce

# Mutants are the worked answer's code with one change each.
PLACES = {
    "RIGHT": ("dist.send(chunks[send_i].contiguous(), right)",
              "dist.send(chunks[send_i].contiguous(), {})"),
    "LEFT": ("dist.recv(buf, left)", "dist.recv(buf, {})"),
    "ADD": ("if add:", "if {}:"),
    "GATHER_SEND": ("exchange((rank + 1 - s) % N,", "exchange({},"),
    "RESULT": ("return out", "return {}"),
}


def ring(**changes):
    src = RING_SOLUTION
    for key, value in changes.items():
        old, new = PLACES[key]
        assert old in src, f"the reference no longer has {old!r}"
        src = src.replace(old, new.format(value))
    return learner(src, "ring_all_reduce")


def test_ring_solution_passes():
    t0 = time.monotonic()
    r = check("00.ring_all_reduce", ring())
    assert r.passed, r
    assert time.monotonic() - t0 < 15


def test_ring_rejects_forgotten_own_contribution():
    r = check("00.ring_all_reduce", ring(ADD="False"))
    assert r.status == "failed", r
    assert "missing rank(s)" in r.message and "add each received chunk" in r.message
    assert "2 ranks" in r.message


def test_ring_rejects_wrong_chunk_index():
    r = check("00.ring_all_reduce", ring(GATHER_SEND="(rank - s) % N"))
    assert r.status == "failed", r
    assert "chunk" in r.message and "index" in r.message


def test_ring_rejects_rank0_only():
    src = """
    def reduce_to_zero(tensor):
        rank, N = dist.get_rank(), dist.get_world_size()
        out = tensor.clone()
        if rank == 0:
            buf = torch.empty_like(out)
            for src in range(1, N):
                dist.recv(buf, src)
                out += buf
        else:
            dist.send(out, 0)
        return out
    """
    r = check("00.ring_all_reduce", learner(src, "reduce_to_zero"))
    assert r.status == "failed", r
    assert "rank 0 has the right sum" in r.message and "every rank" in r.message


def test_ring_uneven_size_mismatch_crash_is_a_failure():
    # sends a chunk of the wrong length only when the length does not divide by N: gloo
    # aborts the process; reported as a failure with a hint, not an error
    f = ring(GATHER_SEND="(rank + 1 - s) % N if tensor.numel() % N == 0 else (rank - s) % N")
    r = check("00.ring_all_reduce", f)
    assert r.status == "failed", r
    assert "does not divide" in r.message or "SIGABRT" in r.message


def test_ring_rejects_wrong_neighbour_deadlock_bounded():
    # receives from the right instead of the left: rank 0 waits for rank 1, which never
    # sends to it -> a hang on 4 ranks, bounded by the timeout and reported as a failure
    t0 = time.monotonic()
    r = check("00.ring_all_reduce", ring(LEFT="right"), timeout=4)
    took = time.monotonic() - t0
    assert r.status == "failed", r
    assert "did not finish after 4 s" in r.message and "recv" in r.message
    assert took < 30


def test_ring_rejects_in_place_and_mutation():
    r = check("00.ring_all_reduce", ring(RESULT="tensor.copy_(out)"))
    assert r.status == "failed" and "input" in r.message and "clone" in r.message, r
    r = check("00.ring_all_reduce", ring(RESULT="(tensor.copy_(out), None)[1]"))
    assert r.status == "failed" and "in place" in r.message, r


def test_ring_rejects_wrong_type_and_shape():
    f = learner("def f(t):\n    return t.tolist()\n", "f")
    r = check("00.ring_all_reduce", f)
    assert r.status == "failed" and "torch.Tensor" in r.message, r
    f = learner("def f(t):\n    return t.clone()[:-1]\n", "f")
    r = check("00.ring_all_reduce", f)
    assert r.status == "failed" and "shape" in r.message, r
    f = learner("def f(t):\n    return t.double()\n", "f")
    r = check("00.ring_all_reduce", f)
    assert r.status == "failed" and "dtype" in r.message, r
    assert check("00.ring_all_reduce", 3).status == "failed"


def ring_stub_body(tensor):
    """A stub as a learner might leave it."""
    ...  # noqa: PIE790


def ring_stub_pass(tensor):
    pass


def test_ring_stubs_not_attempted():
    assert check("00.ring_all_reduce", ...).status == "not attempted"
    assert check("00.ring_all_reduce", None).status == "not attempted"
    assert check("00.ring_all_reduce", ring_stub_body).status == "not attempted"
    assert check("00.ring_all_reduce", ring_stub_pass).status == "not attempted"
    f = learner("def f(t):\n    raise NotImplementedError('your code here')\n", "f")
    assert check("00.ring_all_reduce", f).status == "not attempted"
    # only on one rank (world size 2): still not attempted, never "error"
    f = learner("def f(t):\n    if dist.get_rank() == 1:\n        raise NotImplementedError\n"
                "    return t.clone() * dist.get_world_size()\n", "f")
    r = check("00.ring_all_reduce", f)
    assert r.status == "not attempted", r


def test_ring_learner_raise_is_error_with_trimmed_traceback():
    f = learner("def check_sizes(t):\n    raise ValueError('sizes differ')\n\n"
                "def my_ring(t):\n    if dist.get_rank() == 1:\n"
                "        check_sizes(t)\n    return t.clone()\n", "my_ring")
    r = check("00.ring_all_reduce", f)
    assert r.status == "error", r
    assert "rank 1" in r.message and "ValueError: sizes differ" in r.message
    assert "my_ring" in r.traceback and "check_sizes" in r.traceback
    assert "torch/distributed" not in r.traceback and "runtime/worker.py" not in r.traceback
