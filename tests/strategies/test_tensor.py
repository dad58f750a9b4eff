"""parlib.strategies.tensor: TP (and TP + sequence parallelism) equals single-device training.

Every comparison is fp32, relative to the largest single-device value of the tensor, over
several SGD steps, on 2 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parlib
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
)

CFG = ModelConfig(seq_len=16, d_model=32, n_heads=4, n_layers=2)
B = 4
STEPS = 3
LR = 0.1
TOL = 1e-5
# Attention's k bias has a zero gradient in exact arithmetic (softmax ignores a constant
# added to every key's score), so its ~1e-10 rounding noise must not read as a relative
# error: errors are relative to the tensor's largest value, but at least FLOOR.
FLOOR = 1e-3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(FLOOR)).item()


def _train(model, steps):
    """SGD steps on the shared stream: per step the logits, loss and gradients by name."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    record = []
    for step in range(steps):
        x, y = make_batch(B, CFG, step)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        record.append((logits.detach().clone(), loss.item(), grads))
        opt.step()
    return record, {n: p.detach().clone() for n, p in model.named_parameters()}


def _tp_vs_single(sequence_parallel, steps=STEPS):
    """On each rank: the worst relative error of logits, loss, every gradient (every step)
    and the final parameters of the TP copy against the single-device run."""
    torch.set_num_threads(1)
    ref_record, ref_params = _train(build_model(CFG), steps)
    tp = tensor_parallel_copy(build_model(CFG), sequence_parallel=sequence_parallel)
    record, params = _train(tp, steps)
    errs = {"logits": 0.0, "loss": 0.0}
    for (logits, loss, grads), (ref_logits, ref_loss, ref_grads) in zip(record, ref_record):
        errs["logits"] = max(errs["logits"], rel_err(logits, ref_logits))
        errs["loss"] = max(errs["loss"], abs(loss - ref_loss) / abs(ref_loss))
        for name, want in local_shards(tp, ref_grads).items():
            errs[f"grad {name}"] = max(errs.get(f"grad {name}", 0.0), rel_err(grads[name], want))
    for name, want in local_shards(tp, ref_params).items():
        errs[f"param {name}"] = rel_err(params[name], want)
    n_local = sum(p.numel() for p in tp.parameters())
    return errs, len(ref_grads), n_local


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", [2, 4])
def test_tp_training_equals_single_device(t, sequence_parallel):
    for rank, (errs, n_full, n_local) in enumerate(
            parlib.launch(_tp_vs_single, sequence_parallel, world_size=t)):
        assert sum(k.startswith("grad ") for k in errs) == n_full  # every gradient compared
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank} of {t}: {bad}"
        assert n_local == tp_params_per_rank(Model.from_config(CFG), t)
    assert n_local < count_parameters(build_model(CFG))


def _layers_vs_full(gather_output):
    """One column- and one row-parallel layer against nn.Linear: output, input, weight and
    bias gradients, for a random (b, s, in) input and a random upstream gradient."""
    torch.set_num_threads(1)
    rank, t = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    full = torch.nn.Linear(8, 12)
    x = torch.randn(2, 3, 8, generator=gen)
    dy = torch.randn(2, 3, 12, generator=gen)
    errs = {}

    xf = x.clone().requires_grad_()
    yf = full(xf)
    yf.backward(dy)

    col = ColumnParallelLinear.from_linear(full, gather_output=gather_output)
    xc = x.clone().requires_grad_()
    yc = col(xc)
    mine = slice(rank * 12 // t, (rank + 1) * 12 // t)
    want_y = yf if gather_output else yf[..., mine]
    yc.backward(dy if gather_output else dy[..., mine])
    errs["column out"] = rel_err(yc, want_y)
    errs["column input grad"] = rel_err(xc.grad, xf.grad)
    errs["column weight grad"] = rel_err(col.weight.grad, full.weight.grad[mine])
    errs["column bias grad"] = rel_err(col.bias.grad, full.bias.grad[mine])

    row = RowParallelLinear.from_linear(full2 := torch.nn.Linear(12, 8))
    x2 = torch.randn(2, 3, 12, generator=gen)
    dy2 = torch.randn(2, 3, 8, generator=gen)
    x2f = x2.clone().requires_grad_()
    full2(x2f).backward(dy2)
    x2r = x2[..., mine].clone().requires_grad_()
    y2r = row(x2r)
    y2r.backward(dy2)
    errs["row out"] = rel_err(y2r, full2(x2))
    errs["row input grad"] = rel_err(x2r.grad, x2f.grad[..., mine])
    errs["row weight grad"] = rel_err(row.weight.grad, full2.weight.grad[:, mine])
    errs["row bias grad"] = rel_err(row.bias.grad, full2.bias.grad)
    return errs


@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("t", [2, 4])
def test_each_layer_input_weight_and_bias_gradients(t, gather_output):
    for rank, errs in enumerate(parlib.launch(_layers_vs_full, gather_output, world_size=t)):
        assert len(errs) == 8
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank} of {t}: {bad}"


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
    ref_record, _ = _train(build_model(CFG), 1)
    tp = tensor_parallel_copy(build_model(CFG))
    record, _ = _train(tp, 1)
    logits_err = rel_err(record[0][0], ref_record[0][0])
    ref_grads = local_shards(tp, ref_record[0][2])
    grad_errs = {n: rel_err(record[0][2][n], g) for n, g in ref_grads.items()}
    return logits_err, grad_errs


def test_dropping_f_backward_all_reduce_breaks_gradients():
    logits_err, grad_errs = parlib.launch(_without_f_backward, world_size=2)[0]
    assert logits_err < TOL  # forward is untouched: f is the identity there
    assert grad_errs["embed.tok.weight"] > 1e-2  # everything below a split layer is wrong
    assert grad_errs["blocks.0.ln1.weight"] > 1e-2
    assert grad_errs["head.proj.weight"] < TOL  # above the last split layer: still right


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
    return rel_err(model(x).detach(), ours(x).detach())


def test_torch_parallelize_module_plan_gives_the_same_logits():
    assert parlib.launch(_torch_tp_logits, world_size=2)[0] < TOL


def test_column_parallel_rejects_uneven_slices():
    # 8/8/8/6 rows of a 30-row weight: the all-gather would abort a rank with gloo's
    # "Received data size doesn't match expected size"; the constructor must say why.
    from tests.helpers.rank_fns import column_parallel_uneven

    with pytest.raises(parlib.RankError, match="ValueError.*30"):
        parlib.launch(column_parallel_uneven, world_size=4, timeout=60)
