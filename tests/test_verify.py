"""parlib.verify: the one single-device reference run, and the one comparison rule."""

from __future__ import annotations

import pytest
import torch

from parlib.model import ModelConfig, build_model, loss_fn, make_batch, make_optimizer, train_step
from parlib.verify import compare, reference_params, reference_run, reference_step

CFG = ModelConfig()


def test_reference_run_is_plain_training():
    h = reference_run(CFG, steps=3, batch=8, record=("params_per_step",))
    model = build_model(CFG, 0)
    opt = make_optimizer(model.parameters(), "sgd", 0.1)
    for step in range(3):
        x, y = make_batch(8, CFG, step, 0)
        assert train_step(model, opt, x, y) == pytest.approx(h.losses[step], rel=1e-6)
        assert compare(dict(model.named_parameters()), h.params_per_step[step])
    assert compare(dict(model.named_parameters()), h.params)
    assert list(h.params.values())[0].data_ptr() != next(model.parameters()).data_ptr()


def test_microbatches_give_the_whole_batchs_gradient_in_pieces():
    whole = reference_run(CFG, steps=2, batch=8)
    parts = reference_run(CFG, steps=2, batch=8, microbatches=4, record=("microbatch_grads",))
    assert compare(parts.grads[1], whole.grads[1])
    summed = {n: sum(mb[n] for mb in parts.microbatch_grads[0]) for n in whole.grads[0]}
    assert compare(summed, whole.grads[0])
    first = parts.microbatch_grads[0][0]
    model = build_model(CFG, 0)
    x, y = make_batch(8, CFG, 0, 0)
    (loss_fn(model(x[:2]), y[:2]) / 4).backward()
    assert compare({n: p.grad for n, p in model.named_parameters()}, first)


def test_optimizer_as_a_function_and_the_two_views():
    momentum = reference_run(CFG, steps=2, optimizer=lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9))
    plain = reference_run(CFG, steps=2)
    assert not compare(momentum.params, plain.params)  # momentum changes the second step
    step = reference_step(CFG)
    assert step["loss"] == plain.losses[0] and compare(step["grads"], plain.grads[0])
    assert compare(reference_params(CFG, steps=2, global_batch=8), list(plain.params.values()))


def test_bad_requests_are_named():
    with pytest.raises(ValueError, match="cannot record"):
        reference_run(CFG, record=("activations",))
    with pytest.raises(ValueError, match="must divide the batch"):
        reference_run(CFG, batch=8, microbatches=3)


def test_the_rule_rejects_a_real_bug_and_accepts_reordered_sums():
    h = reference_run(CFG, steps=1)
    halved = {n: g / 2 for n, g in h.grads[0].items()}  # a missing x N
    assert not compare(halved, h.grads[0])
    wobble = {n: g * (1 + 1e-7) for n, g in h.grads[0].items()}
    assert compare(wobble, h.grads[0])
