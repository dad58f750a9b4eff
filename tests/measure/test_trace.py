"""The timeline as a Chrome/Perfetto trace, checked against torch.profiler's own trace."""

import json
import textwrap
import time

import pytest
import torch

from parlib.measure import trace
from parlib.measure.timeline import Recorder, Span


def _complete(events):
    return [e for e in events if e["ph"] == "X"]


def test_spans_become_complete_events_in_microseconds_one_process_per_rank():
    spans = [[Span(0, "forward", 0.0, 0.002, mb=0), Span(0, "send", 0.002, 0.0025, mb=0)],
             [Span(1, "recv", 0.0, 0.0021, mb=0), Span(1, "backward", 0.003, 0.007, mb=1,
                                                           chunk=1)]]
    events = trace.chrome_trace(spans)["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    done = _complete(events)
    assert [(e["pid"], e["name"], e["tid"]) for e in done] == [
        (0, "forward 0", 0), (0, "send 0", 1), (1, "recv 0", 1), (1, "backward 1", 0)]
    backward = done[-1]
    assert backward["ts"] == pytest.approx(3000) and backward["dur"] == pytest.approx(4000)
    assert backward["args"] == {"chunk": 1, "mb": 1} and backward["cat"] == "backward"
    in_ms = trace.chrome_trace([[Span(0, "dp", 1.0, 1.5)]], unit="ms")["traceEvents"]
    assert _complete(in_ms)[0]["ts"] == 1000 and _complete(in_ms)[0]["name"] == "dp"


def test_schedule_time_units_are_refused():
    with pytest.raises(ValueError, match="schedule time units"):
        trace.chrome_trace([[Span(0, "forward", 0, 1)]], unit="t")


def test_agrees_with_torch_profilers_trace_of_the_same_run(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    # spans of tens of milliseconds: ours encloses the profiler's, and on a loaded machine a
    # preemption between the two enters (or exits) lands in ours alone, a few milliseconds at
    # most; against such spans that stays inside the tolerance, and a wrong unit (a factor
    # of 1000) or a wrong field does not
    rec, a = Recorder(rank=0), torch.ones(200, 200)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, repeats in enumerate((100, 400, 200)):
            with rec.span("forward", mb=i), record_function(f"forward {i}"):
                for _ in range(repeats):
                    a @ a
            time.sleep(0.005)
    prof.export_chrome_trace(str(tmp_path / "profiler.json"))
    theirs = [e for e in json.loads((tmp_path / "profiler.json").read_text())["traceEvents"]
              if e.get("cat") == "user_annotation"]
    path = trace.save_chrome_trace([rec.spans], tmp_path / "ours.json")
    ours = _complete(json.loads(path.read_text())["traceEvents"])
    # same events, the same fields, the same unit: durations and the gaps between starts
    # agree (the two clocks have different origins, so starts are compared as gaps)
    assert [e["name"] for e in ours] == [e["name"] for e in theirs]
    for mine, torch_s in zip(ours, theirs):
        assert mine["ph"] == torch_s["ph"] == "X"
        assert torch_s["dur"] > 5000  # microseconds: the spans are as long as intended
        assert mine["dur"] == pytest.approx(torch_s["dur"], rel=0.1, abs=2000)
    for k in (1, 2):
        assert ours[k]["ts"] - ours[0]["ts"] == pytest.approx(
            theirs[k]["ts"] - theirs[0]["ts"], rel=0.1, abs=2000)


def test_the_module_docstring_example_runs_as_written(tmp_path, monkeypatch):
    after = trace.__doc__.split("::\n", 1)[1].splitlines()
    block = []
    for line in after:
        if line and not line.startswith("    "):
            break
        block.append(line)
    example = "\n".join(block)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(textwrap.dedent(example), namespace)  # noqa: S102 - our own docstring
    events = json.loads((tmp_path / "step_trace.json").read_text())["traceEvents"]
    assert sorted(e["pid"] for e in _complete(events)) == [0, 1]
    assert namespace["path"].name == "step_trace.json"
