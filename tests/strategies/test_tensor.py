"""parlib.strategies.tensor: TP (and TP + sequence parallelism) equals single-device training.

Every comparison is fp32, by :func:`parlib.verify.compare` (the course's one tolerance),
against :func:`parlib.verify.reference_run` over several SGD steps, on 2 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib import verify
from parlib.cost.model import Model
from parlib.cost.tensor import (
    sp_boundary_sent_bytes,
    sp_sent_bytes_per_layer,
    tp_message_bytes,
    tp_params_per_rank,
    tp_sent_bytes_per_layer,
)
from parlib.measure import CommLog
from parlib.model import ModelConfig, build_model, count_parameters, loss_fn, make_batch
from parlib.strategies import tensor_ops
from parlib.strategies.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    local_shards,
    tensor_parallel_copy,
    tensor_parallel_modules,
)

CFG = ModelConfig(seq_len=16, d_model=32, n_heads=4, n_layers=2)
B = 4
STEPS = 3
LR = 0.1


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """How far off a result is that must be clearly wrong (not a tolerance: agreement is
    :func:`parlib.verify.compare`'s)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def _history(model, steps):
    """The single-device run's SGD steps, on ``model`` (the TP copy or the full model)."""
    return verify.reference_run(CFG, steps=steps, batch=B, lr=LR, model=model,
                                record=("logits",))


def _tp_vs_single(sequence_parallel, steps=STEPS):
    """On each rank: the TP copy's logits, loss, every gradient (every step) and final
    parameters against the single-device run's, as (got, want) dicts keyed alike."""
    torch.set_num_threads(1)
    ref = _history(build_model(CFG), steps)
    tp = tensor_parallel_copy(build_model(CFG), sequence_parallel=sequence_parallel)
    run = _history(tp, steps)
    got, want = {}, {}
    for k in range(steps):
        got[f"step {k} logits"], want[f"step {k} logits"] = run.logits[k], ref.logits[k]
        got[f"step {k} loss"] = torch.tensor(run.losses[k])
        want[f"step {k} loss"] = torch.tensor(ref.losses[k])
        for name, shard in local_shards(tp, ref.grads[k]).items():
            got[f"step {k} grad {name}"], want[f"step {k} grad {name}"] = run.grads[k][name], shard
    for name, shard in local_shards(tp, ref.params).items():
        got[f"param {name}"], want[f"param {name}"] = run.params[name], shard
    n_local = sum(p.numel() for p in tp.parameters())
    return got, want, len(ref.grads[0]), n_local


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", [2, 4])
def test_tp_training_equals_single_device(t, sequence_parallel):
    for rank, (got, want, n_full, n_local) in enumerate(
            parlib.launch(_tp_vs_single, sequence_parallel, world_size=t)):
        # every gradient compared
        assert sum(k.startswith("step 0 grad ") for k in got) == n_full
        verdict = verify.compare(got, want)
        assert verdict.ok, f"rank {rank} of {t}: {verdict}"
        assert n_local == tp_params_per_rank(Model.from_config(CFG), t)
    assert n_local < count_parameters(build_model(CFG))


def _plan_vs_copy():
    """TinyGPT split by a plan of its linear layers (:func:`tensor_parallel_modules`, the
    path for any model) against :func:`tensor_parallel_copy`: every step's gradients and
    the final parameters, by name."""
    torch.set_num_threads(1)
    plan = {}
    for i in range(CFG.n_layers):
        block = f"blocks.{i}"
        plan |= {f"{block}.attn.{name}": "column" for name in ("q", "k", "v")}
        plan |= {f"{block}.attn.out": "row", f"{block}.mlp.up": "column",
                 f"{block}.mlp.down": "row"}
    by_plan = _history(tensor_parallel_modules(build_model(CFG), plan), STEPS)
    by_copy = _history(tensor_parallel_copy(build_model(CFG)), STEPS)
    got = {f"step {k} grad {n}": g for k, grads in enumerate(by_plan.grads)
           for n, g in grads.items()}
    want = {f"step {k} grad {n}": g for k, grads in enumerate(by_copy.grads)
            for n, g in grads.items()}
    got.update({f"param {n}": t for n, t in by_plan.params.items()})
    want.update({f"param {n}": t for n, t in by_copy.params.items()})
    return got, want


def test_a_plan_of_linear_layers_splits_tinygpt_as_the_copy_does():
    for rank, (got, want) in enumerate(parlib.launch(_plan_vs_copy, world_size=2)):
        assert set(got) == set(want)
        verdict = verify.compare(got, want)
        assert verdict.ok, f"rank {rank}: {verdict}"


def _layers_vs_full(gather_output):
    """One column- and one row-parallel layer against nn.Linear: output, input, weight and
    bias gradients, for a random (b, s, in) input and a random upstream gradient."""
    torch.set_num_threads(1)
    rank, t = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    full = torch.nn.Linear(8, 12)
    x = torch.randn(2, 3, 8, generator=gen)
    dy = torch.randn(2, 3, 12, generator=gen)
    pairs = {}  # name -> (got, want)

    xf = x.clone().requires_grad_()
    yf = full(xf)
    yf.backward(dy)

    col = ColumnParallelLinear.from_linear(full, gather_output=gather_output)
    xc = x.clone().requires_grad_()
    yc = col(xc)
    mine = slice(rank * 12 // t, (rank + 1) * 12 // t)
    want_y = yf if gather_output else yf[..., mine]
    yc.backward(dy if gather_output else dy[..., mine])
    pairs["column out"] = (yc, want_y)
    pairs["column input grad"] = (xc.grad, xf.grad)
    pairs["column weight grad"] = (col.weight.grad, full.weight.grad[mine])
    pairs["column bias grad"] = (col.bias.grad, full.bias.grad[mine])

    row = RowParallelLinear.from_linear(full2 := torch.nn.Linear(12, 8))
    x2 = torch.randn(2, 3, 12, generator=gen)
    dy2 = torch.randn(2, 3, 8, generator=gen)
    x2f = x2.clone().requires_grad_()
    full2(x2f).backward(dy2)
    x2r = x2[..., mine].clone().requires_grad_()
    y2r = row(x2r)
    y2r.backward(dy2)
    pairs["row out"] = (y2r, full2(x2))
    pairs["row input grad"] = (x2r.grad, x2f.grad[..., mine])
    pairs["row weight grad"] = (row.weight.grad, full2.weight.grad[:, mine])
    pairs["row bias grad"] = (row.bias.grad, full2.bias.grad)
    return pairs


@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("t", [2, 4])
def test_each_layer_input_weight_and_bias_gradients(t, gather_output):
    for rank, pairs in enumerate(parlib.launch(_layers_vs_full, gather_output, world_size=t)):
        assert len(pairs) == 8
        verdict = verify.compare({k: g for k, (g, _) in pairs.items()},
                                 {k: w for k, (_, w) in pairs.items()})
        assert verdict.ok, f"rank {rank} of {t}: {verdict}"


def _one_step_comm(sequence_parallel):
    torch.set_num_threads(1)
    tp = tensor_parallel_copy(build_model(CFG), sequence_parallel=sequence_parallel)
    x, y = make_batch(B, CFG, 0)
    with CommLog() as log:
        loss_fn(tp(x), y).backward()
    return [(r.op, r.nbytes, r.group_size, r.predicted_sent) for r in log.records]


@pytest.mark.parametrize("t", [2, 4])
def test_bytes_per_layer_equal_the_formula(t):
    s, h, L = CFG.seq_len, CFG.d_model, CFG.n_layers
    records = parlib.launch(_one_step_comm, False, world_size=t)[0]
    assert {op for op, *_ in records} == {"all_reduce"}
    assert len(records) == 4 * L  # 2 forward (g) + 2 backward (f) per layer
    assert all(nbytes == tp_message_bytes(B, s, h) for _, nbytes, _, _ in records)
    assert all(n == t for _, _, n, _ in records)
    assert sum(sent for *_, sent in records) / L == tp_sent_bytes_per_layer(B, s, h, t)


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_bytes_equal_the_formula(t):
    s, h, L = CFG.seq_len, CFG.d_model, CFG.n_layers
    records = parlib.launch(_one_step_comm, True, world_size=t)[0]
    ops = [op for op, *_ in records]
    # per layer 2 forward + 2 backward each; the two ends add one all-gather each way
    assert ops.count("reduce_scatter") == 4 * L
    assert ops.count("all_gather") == 4 * L + 2
    assert ops.count("all_reduce") == 6 * L  # the LayerNorm and row-bias gradients
    activations = sum(sent for op, _, _, sent in records if op != "all_reduce")
    vectors = sum(sent for op, _, _, sent in records if op == "all_reduce")
    # the split-sequence activations: same bytes as plain TP's all-reduces, plus both ends
    assert activations == (L * tp_sent_bytes_per_layer(B, s, h, t)
                           + sp_boundary_sent_bytes(B, s, h, t))
    assert activations + vectors == (L * sp_sent_bytes_per_layer(B, s, h, t)
                                     + sp_boundary_sent_bytes(B, s, h, t))


def _without_f_backward():
    """The TP copy with f's backward all-reduce dropped (forward unchanged)."""
    torch.set_num_threads(1)

    class IdentityBoth(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    tensor_ops.copy_to_tensor_parallel_region = lambda x, group=None: IdentityBoth.apply(
        x, group)
    ref = _history(build_model(CFG), 1)
    tp = tensor_parallel_copy(build_model(CFG))
    run = _history(tp, 1)
    return (run.logits[0], ref.logits[0]), run.grads[0], local_shards(tp, ref.grads[0])


def test_dropping_f_backward_all_reduce_breaks_gradients():
    logits, got, want = parlib.launch(_without_f_backward, world_size=2)[0]
    assert verify.close(*logits)  # forward is untouched: f is the identity there
    for name in ("embed.tok.weight", "blocks.0.ln1.weight"):  # below a split layer: wrong
        assert relative_error(got[name], want[name]) > 1e-2, name
    assert verify.close(got["head.proj.weight"], want["head.proj.weight"])  # above: right


def _bad_sizes():
    out = {}
    attempts = {
        "heads": lambda: tensor_parallel_copy(build_model(
            ModelConfig(seq_len=16, d_model=32, n_heads=2, n_layers=1))),
        "seq": lambda: tensor_parallel_copy(build_model(
            ModelConfig(seq_len=18, d_model=32, n_heads=4, n_layers=1)), sequence_parallel=True),
        "column": lambda: ColumnParallelLinear.from_linear(torch.nn.Linear(8, 6)),
        "row": lambda: RowParallelLinear.from_linear(torch.nn.Linear(6, 8)),
    }
    for key, attempt in attempts.items():
        try:
            attempt()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


def test_bad_t_names_the_problem():
    msgs = parlib.launch(_bad_sizes, world_size=4)[0]
    assert "n_heads=2" in msgs["heads"] and "t=4" in msgs["heads"]
    assert "seq_len=18" in msgs["seq"]
    assert "out_features=6" in msgs["column"]
    assert "in_features=6" in msgs["row"]


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="process group"):
        ColumnParallelLinear.from_linear(torch.nn.Linear(4, 4))


def _saved_bytes_per_block(sequence_parallel):
    from parlib.measure import SavedActivations

    torch.set_num_threads(1)
    tp = tensor_parallel_copy(build_model(CFG), sequence_parallel=sequence_parallel)
    x, _ = make_batch(B, CFG, 0)
    with torch.no_grad():
        h = tp.embed(x)
    if sequence_parallel:
        h = tensor_ops.scatter_to_sequence_parallel_region(h)
    with SavedActivations(tp) as saved:
        tp.blocks[0](h.requires_grad_())
    return saved.nbytes


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_divides_layernorm_activations_by_t(t):
    from parlib.cost.tensor import layernorm_saved_bytes_per_layer

    tp = parlib.launch(_saved_bytes_per_block, False, world_size=t)[0]
    sp = parlib.launch(_saved_bytes_per_block, True, world_size=t)[0]
    s, h = CFG.seq_len, CFG.d_model
    assert tp - sp == (layernorm_saved_bytes_per_layer(B, s, h, t)
                       - layernorm_saved_bytes_per_layer(B, s, h, t, sequence_parallel=True))


def _torch_tp_logits():
    from torch.distributed.device_mesh import init_device_mesh

    from parlib.strategies.tensor import torch_tensor_parallel

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch_tensor_parallel(build_model(CFG), mesh)
    ours = tensor_parallel_copy(build_model(CFG))
    x, _ = make_batch(B, CFG, 0)
    return model(x).detach(), ours(x).detach()


def test_torch_parallelize_module_plan_gives_the_same_logits():
    assert verify.close(*parlib.launch(_torch_tp_logits, world_size=2)[0])


def test_column_parallel_rejects_uneven_slices():
    # 8/8/8/6 rows of a 30-row weight: the all-gather would abort a rank with gloo's
    # "Received data size doesn't match expected size"; the constructor must say why.
    from tests.helpers.rank_fns import column_parallel_uneven

    with pytest.raises(parlib.RankError, match="ValueError.*30"):
        parlib.launch(column_parallel_uneven, world_size=4, timeout=60)
