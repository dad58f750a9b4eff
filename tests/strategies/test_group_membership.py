"""A rank that is not a member of the group it passes is refused, by every strategy entry
point that takes a group, before any collective (parlib.comm.rank_and_size, the one check):
torch gives a non-member rank -1 and size -1, which ring attention turned into outputs 0.5
away from the right ones with no error. The members of the same group still get the right
answer (the single-device attention of tests/strategies/test_context.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlib
from parlib.model import ModelConfig, build_model
from parlib.strategies import context, experts, tensor, tensor_ops
from parlib.strategies.sharded import FSDP, Zero2
from parlib.strategies.zero import Zero1
from tests.strategies.test_context import HEADS, KINDS, B, D, S, _attention_vs_single

MEMBERS = [0, 2]
MOE = ModelConfig(seq_len=8, d_model=16, n_heads=2, n_layers=1, n_experts=2, top_k=1,
                  expert_hidden=8)


def _entry_points(g) -> dict:
    """Every entry point called with ``g``, as a thunk (this rank's inputs, shaped as a
    member's would be)."""
    local = torch.zeros(B, HEADS, S // len(MEMBERS), D)
    linear = nn.Linear(4, 4)
    return {
        "ring_attention": lambda: context.ring_attention(local, local, local, g),
        "all_gather_attention": lambda: context.all_gather_attention(local, local, local, g),
        "split_sequence": lambda: context.split_sequence(torch.zeros(1, S), g),
        "average_gradients": lambda: context.average_gradients(linear, g),
        "mean_over_group": lambda: context.mean_over_group(torch.ones(()), g),
        "ExpertParallelMoE": lambda: experts.ExpertParallelMoE.from_moe(
            build_model(MOE).blocks[0].mlp, g),
        "split_rows": lambda: experts.split_rows(torch.zeros(4, 1), g),
        "FSDP": lambda: FSDP(nn.Linear(4, 4), group=g),
        "Zero1": lambda: Zero1(linear.parameters(), torch.optim.SGD, group=g, lr=0.1),
        "Zero2": lambda: Zero2(nn.Linear(4, 4), torch.optim.SGD, group=g, lr=0.1),
        "DataParallel": lambda: parlib.DataParallel(nn.Linear(4, 4), group=g),
        "ColumnParallelLinear": lambda: tensor.ColumnParallelLinear.from_linear(linear, g),
        "copy_to_tensor_parallel_region":
            lambda: tensor_ops.copy_to_tensor_parallel_region(torch.ones(2), g),
    }


def _errors_off_the_group(g) -> dict[str, str | None]:
    errors: dict[str, str | None] = {}
    for name, call in _entry_points(g).items():
        try:
            call()
            errors[name] = None
        except (RuntimeError, ValueError) as err:
            errors[name] = str(err)
    return errors


def _in_and_out():
    torch.set_num_threads(1)
    g = dist.new_group(MEMBERS)  # every rank must call it, members or not
    if dist.get_rank() in MEMBERS:
        return {kind: bool(_attention_vs_single(True, "zigzag", kind, g)[0]) for kind in KINDS}
    return _errors_off_the_group(g)


@pytest.fixture(scope="module")
def results():
    return parlib.launch(_in_and_out, world_size=4, timeout=120)


def test_members_get_the_single_device_answer(results):
    for rank in MEMBERS:
        assert results[rank] == {"ring": True, "all_gather": True}, f"rank {rank}"


@pytest.mark.parametrize("rank", [1, 3])
def test_a_rank_outside_the_group_is_refused_by_every_entry_point(results, rank):
    for name, err in results[rank].items():
        assert err is not None, f"{name} on rank {rank}: no error"
        assert f"global rank {rank} is not a member of the group" in err, f"{name}: {err}"


def test_the_error_names_the_entry_point(results):
    errors = results[1]
    assert errors["ring_attention"].startswith("ring_attention: ")
    assert errors["all_gather_attention"].startswith("all_gather_attention: ")
    assert errors["Zero2"].startswith("Zero2: ")


def _outside_a_group_made_last():
    """On rank 1, dist.new_group([0, 2]) returns the same NON_GROUP_MEMBER sentinel as any
    other group it is left out of, so its ranks cannot be named; a real group's are."""
    g = dist.new_group([0, 1])
    if dist.get_rank() == 2:
        try:
            context.split_sequence(torch.zeros(1, S), g)
        except RuntimeError as err:
            return str(err)
    return None


def test_a_group_the_rank_is_not_in_is_not_misnamed():
    err = parlib.launch(_outside_a_group_made_last, world_size=3)[2]
    assert err.startswith("split_sequence: global rank 2 is not a member")
    assert "NON_GROUP_MEMBER" in err
