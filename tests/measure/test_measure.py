"""parlib.measure: tables, timing, communication and memory accounting."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import cost, measure
from parlib.model import ModelConfig, build_model, count_parameters, loss_fn, make_batch


def test_table_text_and_html():
    t = measure.Table(["name", "ms"], [["naive", 140.83], ["ddp", 50.3]], title="race <1>")
    text = str(t)
    assert text.splitlines()[0] == "race <1>"
    assert "naive" in text and "140.8" in text and "50.3" in text
    html = t._repr_html_()
    assert "<table>" in html and "race &lt;1&gt;" in html
    assert '<td style="text-align: left">naive</td>' in html and "<td>140.8</td>" in html
    assert t.column("ms") == [140.83, 50.3]
    with pytest.raises(ValueError):
        measure.Table(["a", "b"], [[1]])


def test_fmt_bytes():
    assert measure.fmt_bytes(512) == "512 B"
    assert measure.fmt_bytes(3 * 2**20) == "3.00 MiB"
    assert measure.fmt_bytes(1.5 * 2**30) == "1.50 GiB"


def test_time_it_warmup_and_median():
    calls = []
    t = measure.time_it(lambda: calls.append(1), repeats=5, warmup=3)
    assert len(calls) == 8 and len(t.times) == 5 and t.warmup == 3
    assert min(t.times) <= t.median <= max(t.times)
    assert "median of 5" in str(t)
    with pytest.raises(ValueError):
        measure.time_it(lambda: None, repeats=0)


def _comm_ranks():
    n = dist.get_world_size()
    t = torch.ones(2**18)  # 1 MiB
    originals = dist.all_reduce, dist.broadcast
    with measure.CommLog() as log:
        dist.all_reduce(t)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        dist.broadcast(t, src=0)
        out = torch.empty(2**18 * n)
        dist.all_gather_into_tensor(out, torch.ones(2**18))  # calls all_gather_single inside
    restored = (dist.all_reduce, dist.broadcast) == originals
    cdm_count = None
    try:
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as cdm:
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
        cdm_count = cdm.get_total_counts()
    except ImportError:
        pass
    return {
        "ops": [(r.op, r.nbytes, r.group_size, r.async_op) for r in log.records],
        "sync_wire": log.records[0].wire_bytes,
        "seconds_ok": all(r.seconds > 0 for r in log.records),
        "restored": restored,
        "cdm_count": cdm_count,
        "total": log.total_bytes("all_reduce"),
        "pred": log.predicted_sent("all_reduce"),
        "table": str(log.table()),
    }


@pytest.mark.parametrize("n", [2, 4])
def test_commlog_records_every_call(n):
    res = parlib.launch(_comm_ranks, world_size=n)
    mib = 2**20
    for r in res:
        assert r["ops"] == [
            ("all_reduce", mib, n, False),
            ("all_reduce", mib, n, True),
            ("broadcast", mib, n, False),
            ("all_gather", n * mib, n, False),
        ]
        assert r["seconds_ok"] and r["restored"]
        assert r["total"] == 2 * mib and r["pred"] == pytest.approx(2 * 2 * (n - 1) / n * mib)
        assert "all_reduce" in r["table"]
        if r["cdm_count"] is not None:
            assert r["cdm_count"] == 2  # CommDebugMode sees plain calls too (counts only)
        if sys.platform.startswith("linux"):
            # gloo sends over TCP: the bytes written match the ring formula (+ headers)
            assert r["sync_wire"] == pytest.approx(2 * (n - 1) / n * mib, rel=0.02)


def test_saved_activations_counts_inputs_not_params():
    lin = torch.nn.Linear(10, 20)
    x = torch.randn(5, 10, requires_grad=True)  # so the weight is saved for the input grad
    with measure.SavedActivations(lin) as s:
        lin(x).sum().backward()
    assert s.nbytes == 5 * 10 * 4  # the input, saved for the weight gradient
    with measure.SavedActivations() as s2:
        lin(x).sum().backward()
    assert s2.nbytes == 5 * 10 * 4 + 20 * 10 * 4  # now the weight counts too


def test_memory_breakdown_adam_is_16_bytes_per_param():
    cfg = ModelConfig(n_layers=1, d_model=32, seq_len=16)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = make_batch(2, cfg)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    rep = measure.memory_breakdown(model, opt, step)
    p = count_parameters(model)
    assert rep.params == 4 * p and rep.grads == 4 * p
    n_tensors = len(list(model.parameters()))
    # two fp32 moments per parameter, plus Adam's scalar step counter per tensor
    assert 8 * p <= rep.optimizer <= 8 * p + 8 * n_tensors
    assert rep.activations > 0 and rep.cuda_peak is None
    assert rep.model_states == rep.params + rep.grads + rep.optimizer
    assert cost.model_state_bytes(p) == 16 * p


def _commlog_restores_after_error():
    original = dist.all_reduce
    try:
        with measure.CommLog():
            assert dist.all_reduce is not original  # patched inside the block
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    return dist.all_reduce is original


def test_commlog_restores_dist_functions_after_an_error():
    assert parlib.launch(_commlog_restores_after_error, world_size=1) == [True]


def test_stage_cost_scales_with_rows():
    from parlib.measure.emulation import StageCost, default_cost

    c = StageCost(0.005, 0.010, 0.001)
    assert c.duration("forward", 8) == pytest.approx(0.041)
    assert c.duration("backward", 1) == pytest.approx(0.011)
    # a microbatch of b rows costs b/B of the batch, plus the per-call time
    assert c.stage_time(2) - 2 * c.per_call == pytest.approx((c.stage_time(8) - 0.002) / 4)
    slow = c.with_slow_stage(2, 2.0)
    assert slow.stage_time(4, 2) == pytest.approx(2 * c.stage_time(4))
    assert slow.stage_time(4, 1) == pytest.approx(c.stage_time(4))
    assert "emulated" in slow.describe() and "stage 2 2x slower" in slow.describe()
    assert default_cost("cuda:0") is None and default_cost("cpu").per_row > 0
    with pytest.raises(ValueError):
        StageCost(-1.0)


def _commlog_sees_every_spelling():
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import ProcessGroup

    t = torch.ones(4)
    pg_allreduce = vars(ProcessGroup)["allreduce"]
    with measure.CommLog(deep=True) as log:
        c10d.all_reduce(t)  # the function torch.distributed re-exports, called where defined
        dist.group.WORLD.allreduce([t]).wait()  # straight on the process group
        if dist.get_rank() == 0:
            c10d.send(t, 1)
        else:
            c10d.recv(t, 0)
    restored = c10d.all_reduce is dist.all_reduce and vars(ProcessGroup)["allreduce"] is \
        pg_allreduce
    with measure.CommLog() as shallow:
        dist.all_reduce(t)  # still works after the deep patch is undone
    return [r.op for r in log.records], log.pg_calls, restored, shallow.count("all_reduce")


def test_commlog_sees_collectives_however_they_are_called():
    out = parlib.launch(_commlog_sees_every_spelling, world_size=2)
    for rank, (ops, pg_calls, restored, after) in enumerate(out):
        assert ops == ["all_reduce", "send" if rank == 0 else "recv"], ops
        assert pg_calls == ["all_reduce", "all_reduce", "send" if rank == 0 else "recv"]
        assert restored and after == 1
