"""A setting that differs across ranks, or a set-up that cannot run, gets a parlib message
naming the argument, the ranks and the fix, raised on every rank before any message.

Before, each case below ended otherwise: gloo's size-mismatch abort (uneven local sequence
length or dtype in ring attention, n_experts differing, m differing in run_schedule, a
different model per rank under FSDP or Zero2), a hang until the launch timeout (a
deadlocking op list), a silent run (causal differing), "mat2 must be a matrix"
(FSDP(units=["blocks"])) or a bare AssertionError (a stage built for p = 4 on 2 ranks).
Each test launches 2 ranks on tiny tensors; the hang case with a short timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlib
from parlib.model import ModelConfig, build_model, make_batch

TIMEOUT = 30  # s: every case fails at set-up; a hang on the old code ends here
PIPE = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=4)


def _error(fn, *args) -> str:
    """The launch's error message (the test fails if every rank returns)."""
    with pytest.raises(parlib.RankError) as info:
        parlib.launch(fn, *args, world_size=2, timeout=TIMEOUT)
    return str(info.value)


# ---------------------------------------------------------------- context parallelism

def _attention(kind: str, setting: str) -> None:
    from parlib.strategies.context import ATTENTIONS

    rank = dist.get_rank()
    s_local = 2 if setting == "length" and rank == 1 else 4
    dtype = torch.float64 if setting == "dtype" and rank == 1 else torch.float32
    causal = not (setting == "causal" and rank == 1)
    q = torch.randn(1, 2, s_local, 4, dtype=dtype)
    ATTENTIONS[kind](q, q, q, dist.group.WORLD, causal=causal)


@pytest.mark.parametrize("kind", ["ring", "all_gather"])
def test_uneven_local_sequence_length_is_named(kind):
    message = _error(_attention, kind, "length")
    assert "the local sequence length (q.shape[-2]) differs" in message
    assert "rank 0: 4, rank 1: 2" in message and "split_sequence" in message


def test_a_dtype_differing_across_ranks_is_named():
    message = _error(_attention, "ring", "dtype")
    assert "the dtype of q, k, v differs" in message
    assert "rank 0: torch.float32, rank 1: torch.float64" in message


def test_causal_differing_across_ranks_is_refused():
    message = _error(_attention, "ring", "causal")
    assert "causal differs" in message and "rank 0: True, rank 1: False" in message
    assert "pass the same causal=" in message


# ---------------------------------------------------------------- experts

def _experts_differ() -> None:
    from parlib.strategies.experts import ExpertParallelMoE

    n_experts = 2 if dist.get_rank() == 0 else 4
    cfg = ModelConfig(seq_len=4, d_model=8, n_heads=2, n_layers=1, n_experts=n_experts,
                      top_k=1, expert_hidden=8)
    ExpertParallelMoE.from_moe(build_model(cfg).blocks[0].mlp, dist.group.WORLD)


def test_n_experts_differing_across_ranks_is_named():
    message = _error(_experts_differ)
    assert "ExpertParallelMoE: n_experts differs" in message
    assert "rank 0: 2, rank 1: 4" in message and "ModelConfig(n_experts=E" in message


# ---------------------------------------------------------------- pipeline

def _pipeline(case: str) -> None:
    from parlib.strategies import schedules as S
    from parlib.strategies.pipeline import build_stage, run_schedule

    rank = dist.get_rank()
    tokens, targets = make_batch(4, PIPE, 0, 0)
    if case == "m":
        m = 2 if rank == 0 else 4
        ops = S.gpipe(2, m, rank)
    elif case == "deadlock":  # rank 0 waits for B0's gradient while rank 1 waits for F1
        m = 2
        ops = ([S.F(0), S.B(0), S.F(1), S.B(1)] if rank == 0
               else [S.F(0), S.F(1), S.B(0), S.B(1)])
    else:  # "p": a stage built for a pipeline of 4 ranks, run on 2
        m = 2
        stage = build_stage(PIPE, 0, p=4)
        run_schedule(stage, S.gpipe(4, m, rank), tokens, targets, m)
        return
    run_schedule(build_stage(PIPE, 0), ops, tokens, targets, m)


def test_m_differing_across_ranks_is_named():
    message = _error(_pipeline, "m")
    assert "run_schedule: m differs" in message and "rank 0: 2, rank 1: 4" in message
    assert "pass every rank the same m" in message


def test_a_deadlocking_op_list_raises_the_validators_message_instead_of_hanging():
    message = _error(_pipeline, "deadlock")
    assert "Timeout" not in message
    assert "deadlock: rank 0 waits at op 1 (B0)" in message
    assert "rank 1 waits at op 1 (F1)" in message


def test_a_stage_built_for_more_ranks_than_run_it_is_named():
    message = _error(_pipeline, "p")
    assert "built for p=4 ranks, but the default group has 2" in message
    assert "rank 0 holds stage 0" in message or "rank 1 holds stage 1" in message
    assert "AssertionError" not in message


# ---------------------------------------------------------------- sharded data parallelism

class _Net(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _sharded(kind: str, case: str) -> None:
    from parlib.strategies.sharded import FSDP, Zero2

    widths = [4, 4, 4] if case == "units" or dist.get_rank() == 0 else [4, 4, 4, 4]
    net = _Net(widths)
    if kind == "FSDP":
        model = FSDP(net, units=["blocks"] if case == "units" else None)
        model(torch.ones(2, 4)).sum().backward()
    else:
        Zero2(net, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("kind", ["FSDP", "Zero2"])
def test_a_different_model_per_rank_is_named(kind):
    message = _error(_sharded, kind, "model")
    assert f"{kind}: the model differs across the ranks of its group" in message
    assert "rank 0 has 4 parameters and buffers, rank 1 has 6" in message
    assert "'blocks.2.weight' (4, 4) float32 on rank 1" in message
    assert "Wrap the same model on every rank" in message


def test_fsdp_units_naming_a_module_list_asks_for_its_blocks():
    message = _error(_sharded, "FSDP", "units")
    assert "units names 'blocks', an nn.ModuleList" in message
    assert "units=['blocks.0', 'blocks.1']" in message
    assert "mat2" not in message
