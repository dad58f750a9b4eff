"""The staging copy of an asynchronous save (parlib.strategies.checkpoint.async_save_checkpoint
with ``stats``): the memory it holds on each rank, measured as the storage of the staged
tensors, against ``parlib.cost.staging_bytes``. DCP's stager copies each piece's whole
storage, so a rank stages its padded shard: S = ceil(numel / N) elements a tensor, the
formula's even split plus at most one element of padding per sharded tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlib
from parlib import cost
from parlib.strategies.checkpoint import async_save_checkpoint, storage_bytes
from parlib.strategies.fsdp import FSDP
from parlib.strategies.zero import Zero1

N = 2
NUMELS = [35, 7, 21, 3]  # Linear(5, 7), Linear(7, 3): every size odd, so N = 2 pads them


def _staged(folder: str, strategy: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    if strategy == "fsdp":
        model = FSDP(model)
        opt = torch.optim.AdamW(model.parameters())
    else:
        opt = Zero1(model.parameters(), torch.optim.AdamW)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the optimizer's state exists
    stats: dict[str, int] = {}
    saves = dist.new_group(backend="gloo")
    async_save_checkpoint(f"{folder}/{strategy}", model, opt, group=saves,
                          stats=stats).result()
    return stats["staged_bytes"]


@pytest.mark.parametrize("strategy, step_tensors", [("fsdp", 4), ("zero1", 1)])
def test_the_staging_copy_holds_what_the_rank_holds_padded(tmp_path, strategy, step_tensors):
    got = parlib.launch(_staged, str(tmp_path), strategy, world_size=N, timeout=120)
    params = sum(NUMELS)
    predicted = cost.staging_bytes(params, strategy, {"dp": N}, step_tensors=step_tensors)
    if strategy == "fsdp":  # every tensor sharded: 12 bytes of each padded piece
        padded = sum(math.ceil(n / N) for n in NUMELS)
    else:  # the weights whole (4 bytes each), Adam's moments of one padded flat piece
        padded = math.ceil(params / N)
        predicted_whole = 4 * params + 8 * params / N + 4 * step_tensors
        assert predicted == predicted_whole
    want = (12 * padded if strategy == "fsdp" else 4 * params + 8 * padded) + 4 * step_tensors
    assert got == [want] * N
    sharded_tensors = len(NUMELS) if strategy == "fsdp" else 1
    assert 0 <= want - predicted <= 12 * sharded_tensors  # the padding, nothing else
    assert (want > predicted) == (strategy == "fsdp")  # FSDP pads every odd tensor; 66 / 2


def test_storage_bytes_counts_each_storage_once_and_whole():
    t = torch.zeros(10)
    assert storage_bytes({"a": t[:3], "b": [t[5:], torch.zeros(2, dtype=torch.float64)]}) == 56
