"""parlib.strategies.experts: the MoE layer on one device equals a dense computation of the
same routing; capacity keeps the first choices and drops what the formula says; expert
parallelism equals the single-device layer (outputs, routing, aux loss, every gradient) for
ep = 2 and 4 with and without drops, its all-to-all bytes equal the formula exactly, and
the tiny MoE model trained with EP, and with EP x DP, equals single-device training.
Ranks run with warnings as errors: an all-to-all outside autograd would warn or diverge."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist

import parlib
from parlib.cost.experts import (
    ep_all_to_all_bytes_per_layer,
    ep_count_bytes_per_layer,
    tokens_dropped,
)
from parlib.experiments.experts import RoutingRecorder
from parlib.measure import CommLog
from parlib.model import (
    ModelConfig,
    MoE,
    build_model,
    capacity_keep,
    loss_fn,
    make_batch,
    make_optimizer,
    route,
)
from parlib.strategies.experts import (
    ExpertParallelMoE,
    all_to_all,
    aux_loss,
    expert_parallel_copy,
    experts_of_rank,
    is_expert_parameter,
    split_rows,
    sync_gradients,
)
from parlib.strategies.mesh import Mesh
from parlib.verify import compare, reference_run

H, E, K = 16, 8, 2
LAYER = ModelConfig(d_model=H, n_heads=2, n_experts=E, top_k=K, expert_hidden=24)
CFG = ModelConfig(seq_len=8, d_model=16, n_heads=2, n_layers=2, n_experts=E, top_k=K,
                  expert_hidden=24)
STEPS, BATCH, LR = 3, 8, 0.1
FACTORS = (None, 1.0, 1.25)


def _moe(capacity_factor=None, seed=0):
    torch.manual_seed(seed)
    return MoE(ModelConfig(**{**LAYER.__dict__, "capacity_factor": capacity_factor}))


def _tokens(rank):
    """Rank r's tokens (12 + 4r of them: the split sizes differ) and upstream gradient."""
    gen = torch.Generator().manual_seed(100 + rank)
    n = 12 + 4 * rank
    return torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)


# ---- one device

def _dense(moe, x):
    """Every expert on every token, weighted by a (T, E) gate: the router's weight where a
    kept choice picked the expert, 0 elsewhere."""
    r = route(x, moe.router, moe.top_k, moe.capacity_factor)
    gate = torch.zeros_like(r.probs).scatter_add(1, r.experts, r.weights * r.keep)
    return sum(gate[:, e:e + 1] * expert(x) for e, expert in enumerate(moe.experts))


@pytest.mark.parametrize("capacity_factor", FACTORS)
def test_moe_layer_equals_the_dense_computation_of_its_routing(capacity_factor):
    # torch 2.13 has no mixture-of-experts layer for the CPU to compare with
    moe = _moe(capacity_factor)
    x, g = _tokens(0)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = moe(got_x)
    (got * g).sum().backward()
    got_grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    want = _dense(moe, want_x)
    (want * g).sum().backward()
    assert compare([got, got_x.grad], [want, want_x.grad])
    assert compare(got_grads, {n: p.grad for n, p in moe.named_parameters()})
    unweighted = sum(expert(x) * 0 for expert in moe.experts)
    assert not compare([got], [unweighted])


def test_capacity_keeps_first_choices_first():
    # 4 tokens, k = 2, E = 2, capacity 3: expert 0 is everyone's first choice, so the
    # first choices all fit but token 3's ... choice-major: 4 first choices of 0 -> one over
    experts = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    keep = capacity_keep(experts, 2, 3)
    # queue: first choices 0,0,0,1 then second choices 1,1,1,0: expert 0 gets 3 + 1 -> the
    # last (token 3's second choice) dropped; expert 1 gets 1 + 3 -> token 2's second dropped
    assert keep.tolist() == [[True, True], [True, True], [True, False], [True, False]]
    assert capacity_keep(experts, 2, None).all()


def _controlled_router(first, second):
    """A router (h = E) and tokens whose first and second choices are ``first``, ``second``."""
    n = len(first)
    router = torch.nn.Linear(E, E, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    x = torch.zeros(n, E)
    x[torch.arange(n), torch.tensor(first)] = 3.0
    x[torch.arange(n), torch.tensor(second)] = 2.0
    return router, x


@pytest.mark.parametrize("capacity_factor", [1.0, 1.25, 2.0])
def test_dropped_choices_are_the_formula(capacity_factor):
    # 16 tokens, k = 2 over 8 experts (fair share 4): experts 0 and 1 are popular
    first = [0] * 7 + [1] * 5 + [2, 3, 4, 5]
    second = [1] * 7 + [6] * 5 + [7, 7, 6, 7]
    router, x = _controlled_router(first, second)
    r = route(x, router, K, capacity_factor)
    assert r.experts[:, 0].tolist() == first and r.experts[:, 1].tolist() == second
    load = torch.bincount(r.experts.reshape(-1), minlength=E).tolist()
    assert load == [7, 12, 1, 1, 1, 1, 6, 3]
    dropped = int((~r.keep).sum())
    assert dropped == tokens_dropped(load, capacity_factor)
    assert dropped == {1.0: 3 + 8 + 2, 1.25: 2 + 7 + 1, 2.0: 4}[capacity_factor]
    # the ones dropped are the late ones: expert 1's first choices all fit before its seconds
    capacity = {1.0: 4, 1.25: 5, 2.0: 8}[capacity_factor]
    assert r.keep[7:12, 0].sum() == min(5, capacity)


def test_aux_loss_is_one_when_balanced_and_grows_with_imbalance():
    router, x = _controlled_router(list(range(E)), [(e + 1) % E for e in range(E)])
    balanced = route(x, router, K).aux_loss.item()
    router, x = _controlled_router([0] * E, [1] * E)
    skewed = route(x, router, K).aux_loss.item()
    assert abs(balanced - 1) < 1e-6 and skewed > 2


def test_aux_loss_of_the_model_sums_its_layers_and_reaches_the_routers():
    model = build_model(CFG)
    tokens, _ = make_batch(2, CFG)
    model(tokens)
    total = aux_loss(model)
    assert compare([total], [sum(block.mlp.aux_loss for block in model.blocks)])
    total.backward()
    for block in model.blocks:
        assert block.mlp.router.weight.grad.abs().sum() > 0
    # the last layer's experts do not change where its tokens go (earlier ones feed the
    # later routers)
    assert all(p.grad is None for p in model.blocks[-1].mlp.experts.parameters())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="E must be divisible by ep"):
        experts_of_rank(0, 3, 8)
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and n_experts=4"):
        ModelConfig(n_experts=4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        ModelConfig(n_experts=4, capacity_factor=0)
    with pytest.raises(ValueError, match="process group"):
        ExpertParallelMoE.from_moe(_moe(), None)
    with pytest.raises(ValueError, match="dense one"):
        expert_parallel_copy(build_model(ModelConfig(n_layers=1)), dist.group.WORLD)
    with pytest.raises(ValueError, match="no MoE layer has run"):
        aux_loss(build_model(CFG))
    assert type(build_model(ModelConfig()).blocks[0].mlp).__name__ == "MLP"  # dense: as before


# ---- on ranks

def _layer_vs_single(capacity_factor):
    """EP on this rank's tokens against the single-device layer on every rank's tokens."""
    group = dist.group.WORLD
    rank, ep = dist.get_rank(), dist.get_world_size()
    moe = _moe(capacity_factor)
    want_x, outs, aux = [], [], []
    for r in range(ep):  # one device: every rank's tokens through the whole layer
        x, g = _tokens(r)
        want_x.append(x.clone().requires_grad_())
        outs.append(moe(want_x[-1]))
        aux.append(moe.aux_loss.detach())
        (outs[-1] * g).sum().backward()
    want_routing = route(want_x[rank].detach(), moe.router, moe.top_k, capacity_factor)
    want = {n: p.grad.clone() for n, p in moe.named_parameters()}
    ep_moe = ExpertParallelMoE.from_moe(_moe(capacity_factor), group)
    seen = RoutingRecorder(ep_moe)  # observed from outside: the strategy keeps no record
    x, g = _tokens(rank)
    x.requires_grad_()
    with CommLog() as log:
        out = ep_moe(x)
        n_forward = len(log.records)
        (out * g).sum().backward()
    # a parameter autograd never reached (None) counts as a zero gradient: compared, not lost
    got = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
           for n, p in ep_moe.named_parameters()}
    dist.all_reduce(got["router.weight"])  # each rank's router saw only its own tokens
    routing = seen.last
    assert not hasattr(ep_moe, "last_routing")
    same_routing = (torch.equal(routing.experts, want_routing.experts)
                    and torch.equal(routing.keep, want_routing.keep))
    return {"out": compare([out, x.grad], [outs[rank], want_x[rank].grad]),
            "grads": compare(got, {n: want[n] for n in got}), "routing": same_routing,
            "aux": compare([ep_moe.aux_loss], [aux[rank]]),
            "records": [(rec.op, rec.nbytes) for rec in log.records], "n_forward": n_forward,
            "tokens": x.shape[0], "dropped": int((~routing.keep).sum()),
            "experts": sorted(ep_moe.experts.keys(), key=int)}


def _model_vs_single(ep):
    """The tiny MoE model on EP (x DP when the world is bigger than ep): losses, every
    gradient of every step and the final weights."""
    world = dist.group.WORLD
    mesh = Mesh(dp=dist.get_world_size(), ep=ep)
    ep_group, replicas = mesh.group("ep"), mesh.expert_replica_group()
    model = expert_parallel_copy(build_model(CFG), ep_group)
    opt = make_optimizer(model.parameters(), "sgd", LR)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(BATCH, CFG, step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(split_rows(tokens, world)), split_rows(targets, world))
        loss.backward()
        sync_gradients(model, world, replicas)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total / dist.get_world_size())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _bad_split():
    try:
        ExpertParallelMoE.from_moe(MoE(ModelConfig(d_model=H, n_heads=2, n_experts=6)),
                                   dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return None


def _on_ranks():
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = {cf: _layer_vs_single(cf) for cf in FACTORS}
        model = {"ep": _model_vs_single(dist.get_world_size())}
        if dist.get_world_size() == 4:
            model["ep2_dp2"] = _model_vs_single(2)
        try:
            all_to_all(torch.zeros(3, H), [1] * dist.get_world_size(),
                       [1] * dist.get_world_size(), dist.group.WORLD)
        except ValueError as err:
            layer["counts"] = str(err)
        layer["bad_split"] = _bad_split()
    return layer, model


@functools.lru_cache(maxsize=None)
def _results(ep):
    return parlib.launch(_on_ranks, world_size=ep, timeout=240)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("capacity_factor", FACTORS)
def test_ep_layer_equals_single_device(ep, capacity_factor):
    for rank, (layer, _) in enumerate(_results(ep)):
        got = layer[capacity_factor]
        where = f"rank {rank} of {ep}, capacity factor {capacity_factor}"
        assert got["routing"], where
        for key in ("out", "grads", "aux"):
            assert got[key], f"{where}, {key}: {got[key]}"
        assert got["experts"] == [str(e) for e in experts_of_rank(rank, ep, E)]
    if capacity_factor == 1.0:  # the drops happened, so the comparison covered them
        assert sum(layer[1.0]["dropped"] for layer, _ in _results(ep)) > 0


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("capacity_factor", FACTORS)
def test_all_to_all_bytes_equal_the_formula(ep, capacity_factor):
    total, formula = 0, 0
    for layer, _ in _results(ep):
        got = layer[capacity_factor]
        ops = [op for op, _ in got["records"]]
        # counts, dispatch, combine in forward; the combine's and the dispatch's gradients
        assert ops == ["all_to_all"] * 5 and got["n_forward"] == 3
        assert got["records"][0][1] == ep_count_bytes_per_layer(E)
        own = ep_all_to_all_bytes_per_layer(got["tokens"], H, K, passes=("forward",),
                                            dropped=got["dropped"]) // 2
        assert got["records"][1][1] == own  # this rank's kept choices, out
        assert got["records"][3][1] == own  # their gradients, out again in backward
        total += sum(n for _, n in got["records"][1:])
        formula += ep_all_to_all_bytes_per_layer(got["tokens"], H, K, dropped=got["dropped"])
    assert total == formula


@pytest.mark.parametrize("ep", [2, 4])
def test_bad_splits_are_named_on_the_ranks(ep):
    for layer, _ in _results(ep):
        assert layer["counts"].startswith("send counts")
        if ep == 4:
            assert "E must be divisible by ep" in layer["bad_split"]


def _check_training(results, key):
    ref = reference_run(CFG, steps=STEPS, batch=BATCH, lr=LR)
    seen = set()
    for rank, (_, model) in enumerate(results):
        losses, grads, params = model[key]
        where = f"rank {rank}, {key}"
        assert compare(losses, [torch.tensor(x) for x in ref.losses]), where
        for step in range(STEPS):
            result = compare(grads[step], {n: ref.grads[step][n] for n in grads[step]})
            assert result, f"{where}, step {step}: {result}"
        assert compare(params, {n: ref.params[n] for n in params}), where
        seen |= set(params)
    assert seen == set(ref.params)  # every expert lives somewhere, every gradient compared


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_training_equals_single_device(ep):
    _check_training(_results(ep), "ep")


def test_ep_times_dp_training_equals_single_device():
    _check_training(_results(4), "ep2_dp2")
    assert is_expert_parameter("blocks.0.mlp.experts.3.up.weight")
    assert not is_expert_parameter("blocks.0.mlp.router.weight")
