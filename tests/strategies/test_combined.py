"""3-D parallelism (dp x tp x pp) trains exactly like one device, for four layouts."""

from __future__ import annotations

import copy

import pytest

import parlib
from parlib import verify
from parlib.cost import Layout
from parlib.experiments import combined as C
from parlib.model import ModelConfig

# heads and widths divide t = 1, 2, 4; layers divide p = 1, 2, 4
CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
STEPS, BATCH, M = 2, 8, 2


def check(results, reference):
    got, want = C.pair_with_reference(results, reference)
    return verify.compare(got, want), len(got)


@pytest.fixture(scope="module")
def reference():
    return verify.reference_run(CFG, steps=STEPS, batch=BATCH)


@pytest.mark.parametrize("d,t,p", [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1)])
def test_3d_training_equals_single_device(d, t, p, reference):
    results = parlib.launch(C.rank_train_3d, Layout(dp=d, tp=t, pp=p), cfg=CFG, steps=STEPS,
                            global_batch=BATCH, m=M, world_size=d * t * p, timeout=300)
    verdict, checked = check(results, reference)
    assert verdict.ok, str(verdict)
    # every rank, every step, every gradient and parameter it holds, and the losses
    n_params = len(reference.params)
    assert checked >= (STEPS + 1) * n_params * d * t
    losses = [r["losses"] for r in results if r["coord"]["pp"] == p - 1]
    assert len(losses) == d * t and all(len(x) == STEPS and None not in x for x in losses)
    if t > 1:  # the matrices really are split
        r0 = results[0]
        assert r0["grads"][0]["blocks.0.mlp.up.weight"].shape[0] == 4 * CFG.d_model // t


def test_the_check_rejects_wrong_results():
    results = parlib.launch(C.rank_train_3d, Layout(dp=2, tp=2, pp=2), cfg=CFG, steps=1,
                            global_batch=BATCH, m=M, world_size=8, timeout=300)
    ref = verify.reference_run(CFG, steps=1, batch=BATCH)
    assert check(results, ref)[0].ok
    # DP gradients summed instead of averaged
    doubled = copy.deepcopy(results)
    g = doubled[3]["grads"][0]
    g["blocks.0.attn.q.weight"] = 2 * g["blocks.0.attn.q.weight"]
    assert not check(doubled, ref)[0].ok
    # tensor-parallel shards in the wrong order
    swapped = copy.deepcopy(results)
    for r in swapped:
        r["coord"]["tp"] = 1 - r["coord"]["tp"]
    assert not check(swapped, ref)[0].ok
    # one rank's step lost
    stale = copy.deepcopy(results)
    stale[6]["params"] = {n: v + 1e-3 for n, v in stale[6]["params"].items()}
    bad = check(stale, ref)[0]
    assert not bad.ok and bad.where.startswith("rank 6")
