"""doctor, the torchrun entry's loader, the magic's argument errors, the GPU path."""

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib.runtime.doctor import report
from parlib.runtime.magic import ranks_magic
from parlib.runtime.torchrun import load


def test_doctor_reports_each_world_size():
    text = report()
    for n in (1, 2, 4, 8):
        assert f"N={n}: " in text
    assert "forkserver" in text or "spawn" in text


def test_run_load_resolves_and_rejects():
    assert load("os.path:join") is __import__("os").path.join
    with pytest.raises(SystemExit, match="MODULE:FUNCTION"):
        load("os.path.join")


def test_magic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ranks"):
        ranks_magic("--nonsense", "x = 1")
    with pytest.raises(ValueError, match="ranks"):
        ranks_magic("explode")


@pytest.mark.gpu
def test_nccl_one_rank_on_gpu():
    def f():
        t = torch.ones(4, device=parlib.device())
        dist.all_reduce(t)
        return str(t.device), dist.get_backend(), t.sum().item()

    assert parlib.launch(f, world_size=1, backend="nccl") == [("cuda:0", "nccl", 4.0)]
