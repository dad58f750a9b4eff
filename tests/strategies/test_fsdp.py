"""parlib.FSDP as a drop-in, checked against one device.

Two ranks on gloo, seeded differently; a toy model with a frozen layer, a buffer, tied weights
(embedding = output head), an embedding and a branch only rank 0's rows use (so rank 1 has no
gradient for it). With SGD (momentum) and AdamW (weight decay, two parameter groups): every
rank starts from rank 0's weights; after K steps the gathered weights equal the single-device
run on the whole batch, in fp32 with the course tolerance, and in bf16 / fp16 compute against
a single-device run that casts the same way (a stated tolerance); the frozen layer is
bitwise unchanged; every trainable parameter ends with an fp32 gradient of its shard's shape;
no warning is raised on the ranks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import parlib
from parlib import verify
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP, norms_and_biases
from tests.helpers.toy_model import RANK0_SEED, K, N, global_batch, seeded_toy

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# bf16 keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%), fp16 11 bits; the ranks sum
# their halves of the gradient in that dtype where one device rounds the whole-batch sum once
LOW_PRECISION_TOL = {"bf16": (2e-2, 2e-3), "fp16": (5e-3, 5e-4)}  # (rtol, atol) on weights
CASES = [(opt, dt) for opt in ("sgd", "adamw") for dt in DTYPES]
# norm weights and biases kept whole (replicate=norms_and_biases): here the linears' biases,
# one of them (extra.bias) without a gradient on rank 1
REPLICATED_CASES = [("sgd", "fp32"), ("adamw", "fp32"), ("adamw", "bf16")]


def make_optimizer(named: list[tuple[str, torch.Tensor]], kind: str) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW with weight decay on everything but biases (by name: a
    shard is flat, so its ndim no longer tells a matrix from a bias)."""
    params = [p for _, p in named if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    decay = [p for n, p in named if p.requires_grad and not n.endswith("bias")]
    rest = [p for n, p in named if p.requires_grad and n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, weight_decay=0.1)


def reference(kind: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """One device, the whole batch, rank 0's initial weights; with ``dtype``, every weight
    and buffer cast to it for the forward (fp32 master weights, as FSDP's compute_dtype)."""
    model = seeded_toy(RANK0_SEED)
    opt = make_optimizer(list(model.named_parameters()), kind)
    for step in range(K):
        tokens, targets, flag = global_batch(step)
        if dtype is None:
            logits = model(tokens, flag)
        else:
            cast = {n: t.to(dtype) for n, t in [*model.named_parameters(),
                                                 *model.named_buffers()]}
            logits = torch.func.functional_call(model, cast, (tokens, flag))
        F.cross_entropy(logits, targets).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(kind: str, dtype_name: str, replicate: bool = False) -> dict:
    rank = torch.distributed.get_rank()
    model = seeded_toy(RANK0_SEED + rank)  # every rank different before wrapping
    frozen = seeded_toy(RANK0_SEED).frozen.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp = FSDP(model, compute_dtype=DTYPES[dtype_name],
                    replicate=norms_and_biases if replicate else None)
        res: dict = {"initial": fsdp.gather_full_params()}
        opt = make_optimizer(list(fsdp.module.named_parameters()), kind)
        for step in range(K):
            tokens, targets, flag = (shard_rows(t, rank, N) for t in global_batch(step))
            logits = fsdp(tokens, flag)
            res["logits dtype"] = logits.dtype
            F.cross_entropy(logits, targets).backward()
            fsdp.finish_gradient_synchronization()
            res["grads"] = {n: (tuple(p.grad.shape), p.grad.dtype, tuple(p.shape))
                            for n, p in fsdp.module.named_parameters() if p.requires_grad}
            res["replicated grads"] = [p.grad.clone() for p in fsdp.replicated]
            opt.step()
            opt.zero_grad()
        res["final"] = fsdp.gather_full_params()
    res["warnings"] = [str(w.message) for w in caught]
    res["frozen same"] = torch.equal(model.frozen.weight, frozen)
    res["tied"] = model.head.weight is model.embed.weight
    res["shard names"] = [n for n, p in fsdp.module.named_parameters() if p.requires_grad]
    return res


def _all_cases() -> dict:
    out = {case: _train(*case) for case in CASES}
    out.update({(*case, "replicated"): _train(*case, replicate=True) for case in REPLICATED_CASES})
    for bad, args in {"dtype": (seeded_toy(0), torch.int8),
                      "meta": (seeded_toy(0).to("meta"),),
                      "fp64": (seeded_toy(0).double(),)}.items():
        try:
            FSDP(*args)
        except (ValueError, TypeError) as e:
            out[bad] = str(e)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return parlib.launch(_all_cases, world_size=N, timeout=300)


@pytest.mark.parametrize("kind,dtype", CASES)
def test_every_rank_starts_from_rank_0s_weights(results, kind, dtype):
    want = dict(seeded_toy(RANK0_SEED).named_parameters())
    for res in results:
        got = res[(kind, dtype)]["initial"]
        assert list(got) == list(want)  # the unwrapped module's names, tied ones once
        assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("kind,dtype", CASES)
def test_k_steps_equal_the_single_device_run(results, kind, dtype):
    want = reference(kind, DTYPES[dtype])
    for rank, res in enumerate(results):
        r = res[(kind, dtype)]
        if dtype == "fp32":
            cmp = verify.compare(r["final"], want)
            assert cmp, f"{kind} rank {rank}: {cmp}"
        else:
            rtol, atol = LOW_PRECISION_TOL[dtype]
            for n, w in want.items():
                assert torch.allclose(r["final"][n], w, rtol=rtol, atol=atol), (kind, dtype, n)
        assert r["frozen same"] and torch.equal(r["final"]["frozen.weight"], want["frozen.weight"])
        assert r["tied"]
        assert r["warnings"] == []


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_computes_in_it_and_is_closer_to_the_cast_run(results, dtype):
    """The ranks really compute in the low dtype, and end nearer the one-device run that
    casts the same way than that run is to fp32 training (on this toy after K steps: bf16
    1.3e-3 vs 1.8e-3 largest difference, fp16 1.2e-5 vs 5.4e-5)."""
    want = reference("sgd", DTYPES[dtype])
    fp32 = reference("sgd", None)
    r = results[0][("sgd", dtype)]
    assert r["logits dtype"] == DTYPES[dtype]
    gap = max((fp32[n] - want[n]).abs().max().item() for n in want)
    ours_gap = max((r["final"][n] - want[n]).abs().max().item() for n in want)
    assert ours_gap < gap


@pytest.mark.parametrize("kind,dtype", CASES)
def test_gradients_are_fp32_shards(results, kind, dtype):
    full = dict(seeded_toy(0).named_parameters())
    for res in results:
        r = res[(kind, dtype)]
        assert r["shard names"] == [n for n, p in full.items() if p.requires_grad]
        for name, (grad_shape, grad_dtype, shape) in r["grads"].items():
            assert grad_dtype == torch.float32
            assert grad_shape == shape == (-(-full[name].numel() // N),)


def test_bad_input_is_named(results):
    res = results[0]
    assert "compute_dtype" in res["dtype"]
    assert "meta" in res["meta"]
    assert "fp32" in res["fp64"]


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        FSDP(seeded_toy(0))


@pytest.mark.parametrize("kind,dtype", REPLICATED_CASES)
def test_replicated_parameters_stay_whole_with_averaged_gradients(results, kind, dtype):
    """Biases kept whole on every rank: same gradients on both ranks (averaged, rank 1's
    missing one counted as zeros), full shapes, the run still equal to one device."""
    want = reference(kind, DTYPES[dtype])
    full = dict(seeded_toy(0).named_parameters())
    rs = [res[(kind, dtype, "replicated")] for res in results]
    for r in rs:
        assert r["warnings"] == []
        for name, (grad_shape, grad_dtype, shape) in r["grads"].items():
            whole = name.endswith("bias")
            assert grad_dtype == torch.float32 and grad_shape == shape
            assert shape == (tuple(full[name].shape) if whole
                             else (-(-full[name].numel() // N),)), name
        if dtype == "fp32":
            cmp = verify.compare(r["final"], want)
            assert cmp, f"{kind}: {cmp}"
        else:
            rtol, atol = LOW_PRECISION_TOL[dtype]
            assert all(torch.allclose(r["final"][n], w, rtol=rtol, atol=atol)
                       for n, w in want.items())
    assert len(rs[0]["replicated grads"]) == 2  # hidden.bias, extra.bias
    for a, b in zip(rs[0]["replicated grads"], rs[1]["replicated grads"]):
        assert torch.equal(a, b)


def _replicate_forms() -> dict:
    """What each form of replicate= keeps whole on this rank, or the error it raises."""
    out = {}
    for key, replicate in {"readme string": "norms_and_biases", "rule": norms_and_biases,
                           "names": ["hidden.bias"], "typo": "norm_and_bias",
                           "unknown name": ["hidden.bais"], "number": 3}.items():
        try:
            model = seeded_toy(0)
            # the README's example, as written
            fsdp = parlib.FSDP(model, replicate=replicate)
            named = {id(p): n for n, p in fsdp.module.named_parameters()}
            out[key] = sorted(named[id(p)] for p in fsdp.replicated)
        except (ValueError, TypeError) as err:
            out[key] = f"{type(err).__name__}: {err}"
    return out


def test_replicate_by_a_rules_name_keeps_what_the_rule_keeps_and_bad_forms_are_refused():
    for res in parlib.launch(_replicate_forms, world_size=N, timeout=120):
        assert res["readme string"] == res["rule"] == ["extra.bias", "hidden.bias"], res
        assert res["names"] == ["hidden.bias"]
        assert res["typo"].startswith("ValueError") and "'norms_and_biases'" in res["typo"]
        assert "does not have: hidden.bais" in res["unknown name"]
        assert res["number"].startswith("TypeError") and "got 3" in res["number"]
