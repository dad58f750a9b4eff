"""09.zero1_checkpoint: describe a ``Zero1`` optimizer's state to DCP so that a run saved on
one number of ranks resumes on another. The learner's ``zero1_state(optimizer)`` returns the
dict DCP saves from and loads into; the check runs it on 4 ranks, in sub-groups: saved on
4 ranks and loaded on 2 ({1, 3}), saved on 3 and loaded on 2 ({0, 3}), saved on 2 ({1, 3})
and loaded on 3. The model has two flat vectors (one parameter group each): 35 weights,
which none of those sizes divides, and 9 biases, which leave rank 3 of 4 an empty piece.

After each load, every rank of the new group reports Adam's state of its pieces against
a single-device AdamW run at the saved step (the moments within ``parlib.verify``'s rule,
the step count exactly), then trains on and reports the next steps' losses and weights
against the same run (the uninterrupted run: Zero1 on any number of ranks equals it
within the rule). A DCP error on save or load is read and named, not shown raw.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlib.course.answers import no_process_exit
from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always
from parlib.course.registry import register
from parlib.verify import close, compare

SAVE_AT, MORE, ROWS, LR, DECAY = 3, 2, 12, 1e-2, 0.1
# (name, the ranks that save, the ranks that load): sub-groups of one launch of 4 ranks
SCENARIOS = (("4 -> 2", (0, 1, 2, 3), (1, 3)), ("3 -> 2", (0, 1, 2), (0, 3)),
             ("2 -> 3", (1, 3), (0, 1, 2)))
OTHER_SEED = 77  # the resumed run's weights before the load: only the load can fix them
MOMENTS = ("exp_avg", "exp_avg_sq")

ZERO1_STATE_SOLUTION = '''\
def zero1_state(optimizer):
    group = optimizer.group if optimizer.group is not None else dist.group.WORLD
    device = optimizer.shards[0].tensor.device.type  # "cpu" with gloo, "cuda" with NCCL
    mesh = DeviceMesh.from_group(group, device)  # the ranks that share the vectors
    rank = mesh.get_local_rank()
    state = {}
    for i, shard in enumerate(optimizer.shards):
        numel = sum(p.numel() for p in shard.params)  # the flat vector, unpadded
        real = max(0, min(shard.size, numel - rank * shard.size))  # padding cut off
        for name, value in optimizer.optimizer.state[shard.tensor].items():
            if value.dim() == 0:  # Adam's step: the same on every rank, saved once
                state[f"flat{i}.{name}"] = value
            else:  # a view of this rank's piece: DCP saves from it and loads into it
                state[f"flat{i}.{name}"] = DTensor.from_local(
                    value[:real], mesh, [Shard(0)], shape=(numel,), stride=(1,),
                    run_check=False)
    return state
'''


class Small(nn.Module):
    """3 -> 5 -> 4: weights of 15 + 20 = 35 elements, biases of 5 + 4 = 9."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def param_groups(model: Small) -> list[dict[str, Any]]:
    """Two flat vectors under Zero1: the weights (decayed), the biases (not)."""
    return [{"params": [model.a.weight, model.b.weight]},
            {"params": [model.a.bias, model.b.bias], "weight_decay": 0.0}]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(ROWS, 3, generator=g), torch.randint(4, (ROWS,), generator=g)


def reference() -> dict[str, Any]:
    """One device, the whole batch, AdamW: the flat moments after SAVE_AT steps (one vector
    per parameter group) and the losses and weights of the steps after."""
    torch.manual_seed(0)
    model = Small()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=DECAY)
    out: dict[str, Any] = {"losses": [], "weights": []}
    for step in range(SAVE_AT + MORE):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == SAVE_AT - 1:
            out["moments"] = {name: [torch.cat([opt.state[p][name].reshape(-1)
                                                for p in g["params"]])
                                     for g in opt.param_groups] for name in MOMENTS}
        if step >= SAVE_AT:
            out["losses"].append(loss.item())
            out["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _train(model: Small, opt: Any, steps: range, ranks: tuple[int, ...]) -> list[float]:
    import torch.distributed as dist

    index, n = ranks.index(dist.get_rank()), len(ranks)
    losses = []
    for step in steps:
        x, y = (t.chunk(n)[index] for t in batch(step))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # this rank's rows; the group's mean is compared
    return losses


def _build(seed: int, group: Any, ranks: tuple[int, ...]) -> tuple[Small, Any]:
    from parlib.strategies.zero import Zero1

    torch.manual_seed(seed)
    model = Small()
    return model, Zero1(param_groups(model), torch.optim.AdamW, lr=LR, weight_decay=DECAY,
                        group=group, broadcast_from=ranks[0])


@torch.no_grad()
def _init_state(model: Small, opt: Any) -> None:
    """A fresh optimizer has no state for DCP to load into: one step on zero gradients at a
    learning rate of 0 creates it (moments 0, step 1) and moves no weight, as
    ``torch.distributed.checkpoint.state_dict`` does for torch's optimizers."""
    rates = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    for g, lr in zip(opt.param_groups, rates):
        g["lr"] = lr


def _dcp_error(err: BaseException) -> str:
    """DCP's own words: a CheckpointException (a BaseException) carries each rank's."""
    failures = list((getattr(err, "failures", None) or {}).values())
    first = failures[0] if failures else err
    first = first[0] if isinstance(first, tuple) and first else first  # (error, frames)
    first = getattr(first, "exc", first)
    return f"{type(first).__name__}: {first}"[:600]


def _call(fn: Any, opt: Any, report: dict[str, Any]) -> dict[str, Any] | None:
    with no_process_exit():
        state = fn(opt)
    if not isinstance(state, dict):
        report["problem"] = ("form", type(state).__name__)
        return None
    return state


def _dcp(action: str, fn: Any, model: Small, opt: Any, path: str, group: Any,
         report: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.api import CheckpointException

    state = _call(fn, opt, report)
    if state is None:
        return
    state = {**{f"model.{n}": p.detach() for n, p in model.named_parameters()}, **state}
    try:
        (save if action == "save" else load)(state, checkpoint_id=path, process_group=group)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
        report["problem"] = (action, _dcp_error(err))


def _agree(report: dict[str, Any]) -> bool:
    """Every rank of the world learns whether any rank met a problem (then all stop)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if "problem" in report else 0])
    dist.all_reduce(flag)
    return bool(flag.item())


def _pieces(opt: Any, ref: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's loaded Adam state, piece by piece, against the reference at SAVE_AT."""
    out = []
    for i, shard in enumerate(opt.shards):
        state = opt.optimizer.state[shard.tensor]
        numel = ref["moments"]["exp_avg"][i].numel()
        real = max(0, min(shard.size, numel - shard.lo))
        for name in MOMENTS:
            got, want = state[name][:real], ref["moments"][name][i][shard.lo:shard.lo + real]
            out.append({"flat": i, "name": name, "range": (shard.lo, shard.lo + real),
                        "ok": close(got, want), "zero": not bool(got.any())})
        out.append({"flat": i, "name": "step", "got": float(state["step"]),
                    "ok": float(state["step"]) == SAVE_AT})
    return out


def _scenario(fn: Any, folder: str, name: str, saved: tuple, loaded: tuple,
              ref: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = dist.new_group(list(saved)), dist.new_group(list(loaded))  # every rank makes both
    report: dict[str, Any] = {"scenario": name, "saved": saved, "loaded": loaded}
    path = f"{folder}/{len(saved)}-to-{len(loaded)}"
    if rank in saved:
        model, opt = _build(0, groups[0], saved)
        _train(model, opt, range(SAVE_AT), saved)
        _dcp("save", fn, model, opt, path, groups[0], report)
    if _agree(report):
        return report
    if rank in loaded:
        model, opt = _build(OTHER_SEED + rank, groups[1], loaded)
        _init_state(model, opt)
        _dcp("load", fn, model, opt, path, groups[1], report)
    if _agree(report) or rank not in loaded:
        return report
    report["pieces"] = _pieces(opt, ref)
    losses = _train(model, opt, range(SAVE_AT, SAVE_AT + MORE), loaded)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    mean = torch.tensor(losses)
    dist.all_reduce(mean, group=groups[1])
    report["steps_ok"] = (all(close(m / len(loaded), torch.tensor(w))
                              for m, w in zip(mean, ref["losses"]))
                          and bool(compare(weights, ref["weights"][-1])))
    return report


def _probe(fn: Any) -> list[dict[str, Any]]:
    """Every scenario in turn on this rank, up to the first where a rank met a problem."""
    import logging

    import torch.distributed as dist

    # DCP's planner logs each fault it finds in a plan; the verdict names it once
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    folder = [tempfile.mkdtemp(prefix="zero1_check_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    ref, reports = reference(), []
    try:
        for name, saved, loaded in SCENARIOS:
            reports.append(_scenario(fn, folder[0], name, saved, loaded, ref))
            if _agree_wrong(reports[-1]):
                break
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    return reports


def _wrong(report: dict[str, Any]) -> bool:
    return ("problem" in report or not report.get("steps_ok", True)
            or not all(p["ok"] for p in report.get("pieces", [])))


def _agree_wrong(report: dict[str, Any]) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if _wrong(report) else 0])
    dist.all_reduce(flag)
    return bool(flag.item())


# --------------------------------------------------------------------------- the verdicts


def _first_wrong(case: Case) -> tuple[int, str] | None:
    """The first rank that met a problem, else the first with a wrong piece, else the first
    whose next steps differ (a wrong piece on one rank moves every rank's weights)."""
    tests = (lambda r: "problem" in r, lambda r: not all(p["ok"] for p in r.get("pieces", [])),
             _wrong)
    for test in tests:
        for rank, reports in enumerate(case.results):
            if reports and test(reports[-1]):
                return rank, reports[-1]["scenario"]
    return None


def _last(c: Case) -> dict[str, Any]:
    return c.results[c.rank][-1]


def _where(c: Case) -> str:
    r = _last(c)
    return (f"saved on ranks {list(r['saved'])}, loaded on ranks {list(r['loaded'])} "
            f"({r['scenario']})")


def _problem(kind: str, *words: str):
    def when(c: Case) -> bool:
        problem = _last(c).get("problem")
        return (problem is not None and problem[0] == kind
                and all(w in problem[1] for w in words))
    return when


def _dcp_words(c: Case) -> str:
    return _last(c)["problem"][1][:200].rstrip(".")


def _bad_pieces(c: Case, name: str | None = None) -> list[dict[str, Any]]:
    return [p for p in _last(c).get("pieces", []) if not p["ok"]
            and (name is None or (p["name"] == "step") == (name == "step"))]


def _step_not_saved(c: Case) -> bool:
    bad = _bad_pieces(c, "step")
    return bool(bad) and bad[0]["got"] == 1


def _ranks_with_unloaded_moments(c: Case) -> list[int]:
    return [r for r, reports in enumerate(c.results) if reports and any(
        not p["ok"] and p["zero"] for p in reports[-1].get("pieces", []) if p["name"] != "step")]


def _wrong_state(c: Case) -> str:
    if not _bad_pieces(c):
        return (f"{_where(c)}: Adam's state was loaded, but the steps after the load "
                "differ from the uninterrupted run's: leave the optimizer as it is")
    return (f"{_where(c)}: after the load rank {c.rank}'s {_moment_text(c)} are not the "
            "saved run's. Each rank's piece is the first real = max(0, min(S, numel - r x S)) "
            "elements of its S (the padding comes last), elements [r x S, r x S + real) of "
            "the flat vector (S = ceil(numel / N), r its rank in the optimizer's group)")


def _moment_text(c: Case) -> str:
    p = next(p for p in _bad_pieces(c) if p["name"] != "step")
    return f"flat vector {p['flat']}'s {p['name']}, elements [{p['range'][0]}, {p['range'][1]})"


DIAGNOSES = (
    Diagnosis("not_a_dict", lambda c: _last(c).get("problem", ("",))[0] == "form",
              lambda c: f"{_where(c)}: rank {c.rank}'s zero1_state returned a "
              f"{_last(c)['problem'][1]}: return a dict of name -> tensor, the state DCP "
              "saves from and loads into"),
    Diagnosis("wrong_offsets", _problem("save", "overlapping chunks"),
              lambda c: f"{_where(c)}: DCP refused the save, the pieces the ranks described "
              f"overlap ({_dcp_words(c)}). A DTensor made with from_local and no shape= "
              "assumes every rank holds numel / N elements, so on uneven sizes it puts the "
              "pieces at the wrong offsets: give shape=(numel,) and stride=(1,), numel "
              "the vector's real length, and each rank's real elements (its padding cut off)"),
    Diagnosis("pieces_missing", _problem("save", "invalid fill"),
              lambda c: f"{_where(c)}: DCP refused the save, the described pieces do not "
              f"fill the vector ({_dcp_words(c)}): some ranks gave no piece (only rank 0's "
              "shard, say). Every rank of the optimizer's group holds a different piece of "
              "Adam's moments and must describe its own"),
    Diagnosis("saved_once", _problem("load", "ize mismatch"),
              lambda c: f"{_where(c)}: DCP could not load ({_dcp_words(c)}). A plain tensor "
              "is taken to be the same on every rank, so DCP wrote one copy of it (rank 0's "
              "piece only) and the new ranks' pieces have another size. Describe each piece "
              "as a DTensor sharded on dimension 0 over the optimizer's group"),
    Diagnosis("group_rank", lambda c: _problem("save", "exceeds dimension size")(c)
              or _problem("load", "exceeds dimension size")(c),
              lambda c: f"{_where(c)}: DCP's {_last(c)['problem'][0]} failed on rank "
              f"{c.rank}: your pieces are not the sizes their description says "
              f"({_dcp_words(c)}). In a sub-group a rank's piece is given by its rank in the "
              "optimizer's group (mesh.get_local_rank(), or dist.get_rank(optimizer.group)), "
              "not by its global rank"),
    Diagnosis("dcp_refused", lambda c: _last(c).get("problem", ("",))[0] in ("save", "load"),
              lambda c: f"{_where(c)}: DCP's {_last(c)['problem'][0]} failed on rank "
              f"{c.rank}: {_dcp_words(c)}. The names must be the same whatever the layout "
              "(flat vector i, its exp_avg), every piece a DTensor over the optimizer's group"),
    Diagnosis("step_not_saved", _step_not_saved,
              lambda c: f"{_where(c)}: after the load rank {c.rank}'s Adam step count is 1 "
              f"(a fresh optimizer's), the saved run's was {SAVE_AT}. Adam's bias correction "
              "divides by 1 - beta^step, so the next updates come out wrong: put the step "
              "(a 0-dimensional tensor, the same on every rank) in the state too"),
    Diagnosis("moments_not_loaded", lambda c: bool(_ranks_with_unloaded_moments(c)),
              lambda c: f"{_where(c)}: after the load, {_moment_text(c)} on rank {c.rank} "
              "are still a fresh optimizer's zeros (ranks with unloaded moments: "
              f"{_ranks_with_unloaded_moments(c)}). They were saved but not loaded: DCP loads "
              "in place, into the tensors your dict holds, so on every rank they must be "
              "views of the optimizer's state (a slice, not .clone() or a new tensor)"),
    Diagnosis("wrong_state", always, _wrong_state),
)

HANG_HINT = ("your function did not finish on every rank{t} ({where}): zero1_state runs "
             "on the ranks of the optimizer's group only; make no collective on another group")


QUESTION = register(RankExercise(
    "09.zero1_checkpoint",
    probe=_probe,
    worlds=[World(4)],
    reference=lambda world: None,
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    where="",
    hang_hint=HANG_HINT,
    solution=ZERO1_STATE_SOLUTION,
    timeout=180.0,
    prompt="""
        Write zero1_state(optimizer) -> dict, run on every rank of a Zero1 optimizer's
        group: the state DCP saves from (dcp.save) and loads into (dcp.load), such that a
        run saved on one number of ranks resumes on another. Zero1 keeps one flat vector per
        parameter group (optimizer.shards[i]: .params, .size = S = ceil(numel / N), .tensor
        the piece its inner optimizer, optimizer.optimizer, steps); Adam's state of piece i
        is optimizer.optimizer.state[shard.tensor]: exp_avg and exp_avg_sq (S elements, the
        last ranks' padded with zeros) and step. Checked on 4 ranks in sub-groups: saved on
        4 and loaded on 2, 3 -> 2 and 2 -> 3, on vectors of 35 and 9 elements: Adam's state
        after the load and the next steps against the uninterrupted run.
    """,
    explanation="""
        Zero1 splits each flat vector as torch.chunk does: rank r of N holds elements
        [r x S, (r + 1) x S), S = ceil(numel / N), its real part max(0, min(S, numel - r x S))
        long (the rest is padding). That is a DTensor sharded on dimension 0 over a mesh of
        the optimizer's group, given its global shape (numel,): DCP then records which rank
        holds which range and, at load, reads for each new rank the ranges its new piece
        needs, on any number of ranks. Three things decide it: the real elements only, the
        global shape given (without it DTensor assumes even pieces and misplaces the last
        ones), and views, not copies (dcp.load writes into the tensors it is given). Adam's
        step is a plain 0-dimensional tensor, the same on every rank: DCP writes one copy.
        A fresh optimizer has no state yet: the check first takes one step at a learning
        rate of 0 on zero gradients, which creates it and moves nothing, as torch's
        torch.distributed.checkpoint.state_dict does.
    """,
    after="""
        parlib.strategies.checkpoint does the same for Zero1, Zero2 and FSDP (FlatPiece),
        with the weights and the hyperparameters: save_checkpoint and load_checkpoint.
    """,
))

__all__ = ["SCENARIOS", "ZERO1_STATE_SOLUTION", "reference"]
