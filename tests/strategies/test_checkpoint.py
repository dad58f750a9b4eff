"""Sharded checkpoints with DCP (parlib.strategies.checkpoint): FSDP, Zero1, Zero2 with AdamW.

A tiny model whose parameter counts do not divide by 2, 3 or 4 (so the last rank's shard is
short, or empty: the head's bias has 3 elements over 4 ranks). On 4 and on 2 ranks, a run
stopped after SAVE_AT steps, saved, rebuilt from other weights and loaded continues
bit-exactly: every later loss and weight equal to the uninterrupted run's. Loaded on another
number of ranks (4 -> 2, 2 -> 4, 4 -> 3) the next steps equal the single-device run within
``parlib.verify``'s rule. An FSDP checkpoint loads into a plain model; a checkpoint of another
strategy or model is refused by name.
"""

from __future__ import annotations

import math
import os
import signal
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import parlib
from parlib import cost, verify
from parlib.model import ModelConfig, build_model
from parlib.strategies.checkpoint import (
    async_save_checkpoint,
    checkpoint_path,
    checkpoint_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from parlib.strategies.data import shard_rows
from parlib.strategies.fsdp import FSDP
from parlib.strategies.pipeline import ChunkedStage, build_chunks, build_stage
from parlib.strategies.sharded import Zero2
from parlib.strategies.tensor import TensorParallelGPT, shard_of, split_dims
from parlib.strategies.zero import Zero1

B, K, SAVE_AT = 12, 6, 3  # rows (divisible by 2, 3 and 4), steps, the step saved after
LR, DECAY = 1e-2, 0.1
STRATEGIES = ("fsdp", "zero1", "zero2")
OTHER_SEED = 77  # the weights a resumed run is built with, before the load overwrites them


class Tiny(nn.Module):
    """Two blocks (FSDP's units) and a root: 35 + 7, 2 x (49 + 7), 21 + 3 = 178 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([nn.Linear(7, 7) for _ in range(2)])
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(B, 5, generator=g), torch.randint(3, (B,), generator=g)


def build(strategy: str, seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = Tiny()
    if strategy == "fsdp":
        fsdp = FSDP(model)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=LR, weight_decay=DECAY)
    if strategy == "zero2":  # not a torch optimizer, but steps and zeroes like one
        return model, Zero2(model, torch.optim.AdamW, lr=LR, weight_decay=DECAY)
    return model, Zero1(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=DECAY)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, FSDP):
        return model.gather_full_params()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model: nn.Module, opt: Any, steps: range) -> dict[str, list]:
    """Steps ``steps`` on this rank's rows; the global loss and the full weights after each."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, list] = {"losses": [], "weights": []}
    for step in steps:
        x, y = (shard_rows(t, rank, n) for t in batch(step))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if isinstance(model, FSDP):
            model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / n)
        out["weights"].append(weights(model))
    return out


def resume(strategy: str, path: str) -> dict[str, list]:
    """Build from other weights, load ``path``, train the steps after SAVE_AT."""
    model, opt = build(strategy, OTHER_SEED + dist.get_rank())
    stats: dict[str, int] = {}
    extra = load_checkpoint(path, model, opt, stats=stats)
    return {**train(model, opt, range(extra["step"], K)), "read": stats["read_bytes"]}


def _uninterrupted_and_resumed(folder: str) -> dict[str, dict]:
    res = {}
    for strategy in STRATEGIES:
        path = f"{folder}/{strategy}-{dist.get_world_size()}"
        model, opt = build(strategy, dist.get_rank())
        whole = train(model, opt, range(K))
        model, opt = build(strategy, dist.get_rank())
        train(model, opt, range(SAVE_AT))
        save_checkpoint(path, model, opt, extra={"step": SAVE_AT})
        res[strategy] = {"whole": whole, "resumed": resume(strategy, path)}
    return res


def _resume_all(folder: str, saved_on: int) -> dict[str, dict]:
    return {s: resume(s, f"{folder}/{s}-{saved_on}") for s in STRATEGIES}


def reference() -> dict[str, list]:
    """One device, the whole batch, rank 0's initial weights (seed 0), AdamW."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    out: dict[str, list] = {"losses": [], "weights": []}
    for step in range(K):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict[int, dict]]:
    """Uninterrupted and resumed runs on 4 and on 2 ranks, each saving after SAVE_AT."""
    folder = str(tmp_path_factory.mktemp("checkpoints"))
    return folder, {n: parlib.launch(_uninterrupted_and_resumed, folder, world_size=n,
                                     timeout=300)[0] for n in (4, 2)}


def test_the_tiny_model_splits_unevenly():
    numels = [p.numel() for p in Tiny().parameters()]
    assert sum(numels) % 4 and sum(numels) % 3 and 3 in numels  # 3 over 4 ranks: one empty


@pytest.mark.parametrize("n", [4, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stop_and_resume_on_the_same_layout_is_bit_exact(runs, strategy, n):
    res = runs[1][n][strategy]
    whole, resumed = res["whole"], res["resumed"]
    assert resumed["losses"] == whole["losses"][SAVE_AT:]  # floats, exactly
    for got, want in zip(resumed["weights"], whole["weights"][SAVE_AT:]):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), strategy


# the flat vectors each strategy shards: FSDP every parameter, Zero1 all 178 as one, Zero2
# one per unit (each block, then the rest: embed and head)
FLAT_VECTORS = {"fsdp": [35, 7, 49, 7, 49, 7, 21, 3], "zero1": [178], "zero2": [56, 56, 66]}


def read_bytes_predicted(strategy: str, world_size: int, rank: int) -> int:
    """The weights (4 bytes) and Adam's moments (8) of this rank's pieces (FSDP; under Zero1
    and Zero2 the weights whole), and every step counter (4 bytes each)."""
    ranges = [cost.flat_shard_range(n, world_size, rank) for n in FLAT_VECTORS[strategy]]
    pieces = sum(hi - lo for lo, hi in ranges)
    weights = 4 * pieces if strategy == "fsdp" else 4 * 178
    return weights + 8 * pieces + 4 * len(FLAT_VECTORS[strategy])


@pytest.fixture(scope="module")
def resharded(runs):
    """Every rank's resumed run, loaded on ``loaded_on`` ranks from ``saved_on``'s
    checkpoint (each launched once)."""
    done: dict[tuple[int, int], list] = {}

    def get(saved_on: int, loaded_on: int) -> list:
        if (saved_on, loaded_on) not in done:
            done[saved_on, loaded_on] = parlib.launch(_resume_all, runs[0], saved_on,
                                                      world_size=loaded_on, timeout=300)
        return done[saved_on, loaded_on]
    return get


@pytest.mark.parametrize("saved_on, loaded_on", [(4, 2), (2, 4), (4, 3)])
def test_each_rank_reads_only_its_pieces(resharded, saved_on, loaded_on):
    """DCP reads, per rank, the bytes of its new pieces (cost.flat_shard_range) and what it
    holds whole; the pieces of other ranks stay unread."""
    for rank, res in enumerate(resharded(saved_on, loaded_on)):
        for strategy in STRATEGIES:
            assert res[strategy]["read"] == read_bytes_predicted(strategy, loaded_on, rank)


@pytest.mark.parametrize("saved_on, loaded_on", [(4, 2), (2, 4), (4, 3)])
def test_resharded_run_continues_as_one_device(resharded, saved_on, loaded_on):
    ref = reference()
    got = resharded(saved_on, loaded_on)[0]
    for strategy in STRATEGIES:
        for step, (loss, w) in enumerate(zip(got[strategy]["losses"], got[strategy]["weights"]),
                                         start=SAVE_AT):
            assert verify.close(torch.tensor(loss), torch.tensor(ref["losses"][step]))
            comparison = verify.compare(w, ref["weights"][step])
            assert comparison, f"{strategy} {saved_on} -> {loaded_on}, step {step}: {comparison}"


def test_the_uninterrupted_runs_match_one_device(runs):
    """The ground the resharding test stands on: every layout's own run is the reference's."""
    ref = reference()
    for n, res in runs[1].items():
        for strategy in STRATEGIES:
            for step, w in enumerate(res[strategy]["whole"]["weights"]):
                assert verify.compare(w, ref["weights"][step]), (n, strategy, step)


def test_fsdp_checkpoint_loads_into_a_plain_model_and_optimizer(runs):
    """Flat keys under the unwrapped names: one process, no process group, DCP reads the
    four shards of every tensor into whole ones."""
    torch.manual_seed(OTHER_SEED)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert load_checkpoint(f"{runs[0]}/fsdp-4", model, opt) == {"step": SAVE_AT}
    ref = reference()
    assert verify.compare(dict(model.named_parameters()), ref["weights"][SAVE_AT - 1])
    assert {int(s["step"]) for s in opt.state.values()} == {SAVE_AT}
    state = checkpoint_state(model, opt)
    assert "model.head.bias" in state and "optim.head.bias.exp_avg" in state


def _wrong_loads(folder: str) -> list[str]:
    """Loading a Zero1 checkpoint into FSDP, a checkpoint into another model, and Zero1's own
    state_dict on another world size."""
    errors = []
    fsdp, opt = build("fsdp", 0)
    other = nn.Linear(5, 7)
    for model, optimizer, path in [(fsdp, opt, f"{folder}/zero1-2"),
                                   (other, None, f"{folder}/fsdp-2")]:
        try:
            load_checkpoint(path, model, optimizer)
        except ValueError as err:
            errors.append(str(err))
    zero1 = Zero1(Tiny().parameters(), torch.optim.AdamW, lr=LR)
    state = zero1.state_dict()  # as torch.save would keep it, from a run on 4 ranks
    state["layout"] = {**state["layout"], "world_size": 4}
    try:
        zero1.load_state_dict(state)
    except ValueError as err:
        errors.append(str(err))
    return errors


def test_a_checkpoint_of_another_strategy_or_model_is_refused_by_name(runs):
    errors = parlib.launch(_wrong_loads, runs[0], world_size=2, timeout=120)[0]
    assert len(errors) == 3
    assert "optim.flat0.exp_avg" in errors[0] and "another model or strategy" in errors[0]
    assert "model.blocks.0.weight" in errors[1]
    assert "'world_size': 4" in errors[2] and "checkpoint.save_checkpoint" in errors[2]


def tensor_bytes(path: str) -> float:
    """The tensors' bytes a checkpoint holds, from DCP's metadata: every saved chunk."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata.values()
    return sum(math.prod(chunk.sizes) * meta.properties.dtype.itemsize
               for meta in saved if isinstance(meta, TensorStorageMetadata)
               for chunk in meta.chunks)


@pytest.mark.parametrize("n", [4, 2])
@pytest.mark.parametrize("strategy, step_tensors", [("fsdp", 8), ("zero1", 1), ("zero2", 3)])
def test_the_checkpoint_holds_the_bytes_the_cost_formula_predicts(runs, strategy,
                                                                  step_tensors, n):
    """12 bytes a parameter (the weight, Adam's two moments; no padding, each replicated
    tensor once) and a 4-byte step per tensor stepped: FSDP's 8 parameters, Zero1's one
    flat vector, Zero2's three units."""
    params = sum(p.numel() for p in Tiny().parameters())
    want = cost.checkpoint_bytes(params, strategy, {"dp": n}, step_tensors=step_tensors)
    assert tensor_bytes(f"{runs[0]}/{strategy}-{n}") == want.total == 12 * params + 4 * step_tensors


def _async_save_is_a_snapshot(folder: str) -> bool:
    """Save in the background, change the weights at once; the checkpoint has the old."""
    saves = dist.new_group(backend="gloo")
    model, opt = build("fsdp", 0)
    train(model, opt, range(1))
    before = weights(model)
    future = async_save_checkpoint(f"{folder}/async", model, opt, group=saves, extra={"step": 1})
    train(model, opt, range(1, 3))
    future.result()
    fresh, fresh_opt = build("fsdp", OTHER_SEED)
    load_checkpoint(f"{folder}/async", fresh, fresh_opt)
    after = weights(fresh)
    return all(torch.equal(after[k], before[k]) for k in before)


def test_async_save_writes_the_state_of_the_moment_it_was_called(tmp_path):
    assert all(parlib.launch(_async_save_is_a_snapshot, str(tmp_path), world_size=2,
                             timeout=120))


def _two_fsdp_replicas(folder: str) -> dict[str, torch.Tensor]:
    """4 ranks as 2 copies of FSDP over 2 ranks ({0, 1} and {2, 3}, each FSDP's ``group``),
    one step each on the same rows; the 4 ranks save together (DCP over all ranks)."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    mine = groups[rank // 2]
    torch.manual_seed(0)
    fsdp = FSDP(Tiny(), group=mine, broadcast_from=rank // 2 * 2)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR, weight_decay=DECAY)
    x, y = (shard_rows(t, rank % 2, 2) for t in batch(0))
    F.cross_entropy(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    opt.step()
    save_checkpoint(f"{folder}/replicas", fsdp, opt, extra={"step": 1})
    return fsdp.gather_full_params()


def test_fsdp_on_a_subgroup_shards_over_its_group_and_copies_are_written_once(tmp_path):
    """The shards' mesh is FSDP's own group: both copies describe the same slices, and DCP
    writes each once (the bytes of one copy), which load whole into one plain model."""
    saved = parlib.launch(_two_fsdp_replicas, str(tmp_path), world_size=4, timeout=120)
    assert all(torch.equal(saved[2][k], saved[0][k]) for k in saved[0])
    params = sum(p.numel() for p in Tiny().parameters())
    assert tensor_bytes(f"{tmp_path}/replicas") == 12 * params + 4 * 8
    model = Tiny()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_checkpoint(f"{tmp_path}/replicas", model)
    assert all(torch.equal(p, saved[0][n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_saved_pieces_are_the_cost_modules_flat_shard_ranges(runs, strategy):
    """DCP recorded, for every sharded tensor, the pieces cost.flat_shard_range names: the
    course's split is the DTensor's, so resharding reads cost.reshard_reads' ranges."""
    saved = FileSystemReader(f"{runs[0]}/{strategy}-4").read_metadata().state_dict_metadata
    sharded = 0
    for meta in saved.values():
        if not isinstance(meta, TensorStorageMetadata) or len(meta.chunks) < 2:
            continue
        sharded += 1
        numel = meta.size[0]
        got = {(c.offsets[0], c.sizes[0]) for c in meta.chunks if c.sizes[0]}
        want = {(lo, hi - lo) for lo, hi in (cost.flat_shard_range(numel, 4, r)
                                             for r in range(4)) if hi > lo}
        assert got == want
    assert sharded >= (8 * 3 if strategy == "fsdp" else 2)  # FSDP: weights and moments


def test_one_process_saves_and_loads_a_plain_model_with_its_extra(tmp_path):
    """No process group: DCP saves and loads in this process. ``extra`` comes back as it
    went: a tensor (an RNG state) as a tensor, a dict as a dict."""
    model, fresh = Tiny(), Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    F.cross_entropy(model(batch(0)[0]), batch(0)[1]).backward()
    opt.step()
    extra = {"rng": torch.get_rng_state(), "data": {"epoch": 1, "row": 12}}
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save_checkpoint(tmp_path / "plain", model, opt, extra=extra)
        got = load_checkpoint(tmp_path / "plain", fresh, fresh_opt)
    assert torch.equal(got["rng"], extra["rng"]) and got["data"] == extra["data"]
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert fresh_opt.param_groups[0]["lr"] == LR  # the hyperparameters come back too
    assert all(torch.equal(fresh_opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])
               for a, b in zip(fresh.parameters(), model.parameters()))


PIPE_CFG = ModelConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=4)


def _fake_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """An AdamW step on gradients that need no pipeline schedule: 0.1 x each weight."""
    for p in model.parameters():
        p.grad = 0.1 * p.detach()
    opt.step()


def _save_stages(folder: str) -> None:
    stage = build_stage(PIPE_CFG, seed=0)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    _fake_step(stage, opt)
    save_checkpoint(f"{folder}/pipeline", stage, opt, extra={"step": 1})


def _load_stages(folder: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Plain stages (p = 2) and interleaved ones (p = 2, v = 2), from other weights."""
    out = []
    for stages in ([build_stage(PIPE_CFG, seed=5)], list(build_chunks(PIPE_CFG, seed=5, v=2))):
        opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=LR)
        model = stages[0] if len(stages) == 1 else ChunkedStage(stages, dist.get_rank(), 2)
        load_checkpoint(f"{folder}/pipeline", model, opt)
        named = {s.global_names[n]: p for s in stages for n, p in s.named_parameters()}
        out.append({"weights": {n: p.detach() for n, p in named.items()},
                    "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in named.items()}})
    return out


def test_pipeline_stages_of_four_load_into_two_plain_and_interleaved(tmp_path):
    """Stages save under the full model's names, so stage 1 of 2 (blocks 2, 3 and the head)
    reads what stages 2 and 3 of 4 wrote, as does an interleaved rank's pair of chunks."""
    parlib.launch(_save_stages, str(tmp_path), world_size=4, timeout=120)
    got = parlib.launch(_load_stages, str(tmp_path), world_size=2, timeout=120)
    full = build_model(PIPE_CFG, seed=0)
    opt = torch.optim.AdamW(full.parameters(), lr=LR)
    _fake_step(full, opt)
    for layout in range(2):  # plain stages, interleaved chunks
        weights = {n: w for rank in got for n, w in rank[layout]["weights"].items()}
        moments = {n: m for rank in got for n, m in rank[layout]["exp_avg"].items()}
        assert weights.keys() == dict(full.named_parameters()).keys()
        for name, p in full.named_parameters():
            assert torch.equal(weights[name], p.detach()), name
            assert torch.equal(moments[name], opt.state[p]["exp_avg"]), name


def _fake_step_fsdp_gpt(folder: str) -> None:
    fsdp = FSDP(build_model(PIPE_CFG, seed=0))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    _fake_step(fsdp, opt)  # on the shards: the padding stays zero
    save_checkpoint(f"{folder}/fsdp-gpt", fsdp, opt)


def _tensor_parallel_load_and_save(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    tp = TensorParallelGPT(build_model(PIPE_CFG, seed=5))
    opt = torch.optim.AdamW(tp.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as caught:  # ShardedTensor's: silenced
        warnings.simplefilter("always")
        load_checkpoint(f"{folder}/fsdp-gpt", tp, opt)
        save_checkpoint(f"{folder}/tp", tp, opt)
    return {"warnings": [str(w.message) for w in caught],
            "weights": {n: p.detach() for n, p in tp.named_parameters()},
            "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in tp.named_parameters()},
            "dims": split_dims(tp)}


def test_fsdp_on_four_into_tensor_parallel_on_two_and_back_to_one(tmp_path):
    """Column-parallel pieces are ranges of the flat vectors FSDP saved; row-parallel ones a
    run of columns in every row. Saved from t = 2, they load whole into one plain model."""
    parlib.launch(_fake_step_fsdp_gpt, str(tmp_path), world_size=4, timeout=120)
    got = parlib.launch(_tensor_parallel_load_and_save, str(tmp_path), world_size=2,
                        timeout=120)
    full = build_model(PIPE_CFG, seed=0)
    opt = torch.optim.AdamW(full.parameters(), lr=LR)
    _fake_step(full, opt)
    dims = got[0]["dims"]
    assert got[0]["warnings"] == [] == got[1]["warnings"]
    assert sorted(d for d in dims.values() if d is not None).count(1) == 2 * PIPE_CFG.n_layers
    for rank, res in enumerate(got):
        for name, p in full.named_parameters():
            assert torch.equal(res["weights"][name], shard_of(p.detach(), dims[name], rank, 2))
            assert torch.equal(res["exp_avg"][name],
                               shard_of(opt.state[p]["exp_avg"], dims[name], rank, 2)), name
    plain = build_model(PIPE_CFG, seed=7)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_checkpoint(tmp_path / "tp", plain, plain_opt)
    for (name, p), q in zip(full.named_parameters(), plain.parameters()):
        assert torch.equal(q, p) and torch.equal(plain_opt.state[q]["exp_avg"],
                                                 opt.state[p]["exp_avg"]), name


def test_latest_checkpoint_skips_a_save_a_dead_rank_cut_short(tmp_path):
    """A save that never wrote its .metadata (a rank died during it) is not resumed from."""
    assert latest_checkpoint(tmp_path) is None
    for step, complete in [(2, True), (10, True), (12, False)]:
        path = checkpoint_path(tmp_path, step)
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"shard")
        if complete:
            (path / ".metadata").write_bytes(b"")
    (tmp_path / "step-notanumber").mkdir()
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "step-00000010")


SAVE_EVERY, DIES_BEFORE = 2, 5  # checkpoints after 2, 4, 6 steps; rank 2 killed in the 6th


def _train_saving_every_two_steps(folder: str, strategy: str, kill: bool) -> dict:
    """Resume from the newest complete checkpoint in ``folder`` if any; train to K, saving
    every SAVE_EVERY steps; with ``kill``, rank 2 is killed (SIGKILL) as the sixth step
    (index DIES_BEFORE) begins."""
    rank = dist.get_rank()
    model, opt = build(strategy, rank)
    found = latest_checkpoint(folder)
    start = load_checkpoint(found[1], model, opt)["step"] if found else 0
    for step in range(start, K):
        if kill and step == DIES_BEFORE and rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        train(model, opt, range(step, step + 1))
        if (step + 1) % SAVE_EVERY == 0:
            save_checkpoint(checkpoint_path(folder, step + 1), model, opt,
                            extra={"step": step + 1})
    return {"start": start, "weights": weights(model)}


def test_a_killed_rank_is_named_and_the_next_launch_resumes_to_the_same_weights(runs,
                                                                                tmp_path):
    """The failure names rank 2; relaunched, the run resumes from the checkpoint taken after
    four steps (redoing the fifth, the work lost) and ends bit-exactly where the run that
    never failed ended."""
    with pytest.raises(parlib.RankError, match="rank 2"):
        parlib.launch(_train_saving_every_two_steps, str(tmp_path), "fsdp", True,
                      world_size=4, timeout=120)
    assert latest_checkpoint(tmp_path)[0] == DIES_BEFORE - 1
    got = parlib.launch(_train_saving_every_two_steps, str(tmp_path), "fsdp", False,
                        world_size=4, timeout=120)[0]
    assert got["start"] == DIES_BEFORE - 1
    want = runs[1][4]["fsdp"]["whole"]["weights"][-1]
    assert all(torch.equal(got["weights"][k], want[k]) for k in want)
