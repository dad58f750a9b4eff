"""02.zero3_linear: one ZeRO-3 unit (a linear layer): all-gather the shard, compute, free;
in backward gather again and reduce-scatter the gradient. Trained as every linear layer of a
TinyGPT's blocks, on 2 and 4 ranks and on two 2-rank sub-groups of 4 ranks, against
single-device training; the gathered weights kept and the gradient buffers are measured."""

from __future__ import annotations

import functools
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from parlib.course.on_ranks import Case, Diagnosis, RankExercise, World, always, off_by
from parlib.course.registry import register
from parlib.verify import close, reference_run

CFG_KW = dict(seq_len=8, d_model=16, n_heads=2, n_layers=2)
BATCH = 8  # global batch: divides by 2 and 4
STEPS = 3
LR = 0.1
SEED = 3
WORLDS = (2, 4)
_LINEARS = ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.up", "mlp.down")

ZERO3_SOLUTION = '''\
def zero3_linear(x, shard, group=None):
    """y = x @ W.T, with W all-gathered from every rank's rows; shard.grad: my rows'
    share of dL/dW, averaged over the group."""

    class Zero3Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            n = dist.get_world_size(group)
            weight = torch.empty(n * shard.shape[0], shard.shape[1])
            comm.all_gather(weight, shard, group=group)     # every rank's rows, in order
            ctx.save_for_backward(x, shard)                 # the shard, not the full W
            return x @ weight.T                             # W is freed on return

        @staticmethod
        def backward(ctx, grad_y):
            x, shard = ctx.saved_tensors
            n = dist.get_world_size(group)
            weight = torch.empty(n * shard.shape[0], shard.shape[1])
            comm.all_gather(weight, shard, group=group)     # gathered again for backward
            grad_x = grad_y @ weight
            grad_w = grad_y.T @ x                           # (out, in): my batch's dL/dW
            grad_shard = torch.empty_like(shard)
            comm.reduce_scatter(grad_shard, grad_w, group=group)  # sum of my rows only
            return grad_x, grad_shard / n                   # the sum -> the average

    return Zero3Linear.apply(x, shard)
'''


def cfg():
    from parlib.model import ModelConfig

    return ModelConfig(**CFG_KW)


# A collective has no autograd kernel: called on a tensor autograd tracks, outside an
# autograd.Function, torch 2.13 fails inside work.wait() on some ranks and not others (the
# rest then hang). The recorder stops every rank at the call instead, before any message.
_NO_AUTOGRAD = "called with grad mode on, on a tensor that requires grad"


def _tracked(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_tracked(v) for v in value)
    return isinstance(value, torch.Tensor) and value.requires_grad


class _Pending:
    """An async collective's handle: the result lands in the learner's output tensors only
    at ``wait()`` (until then they hold NaN), so a compute that reads them before waiting
    fails every time instead of only when the race is lost."""

    def __init__(self, work: Any, outs: list[torch.Tensor]) -> None:
        self._work = work
        self._results = [t.detach().clone() for t in outs]
        self._outs = outs
        for t in outs:
            if t.is_floating_point():
                t.detach().fill_(float("nan"))

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        for t, result in zip(self._outs, self._results):
            t.detach().copy_(result)
        self._outs, self._results = [], []
        return True

    def is_completed(self) -> bool:
        return not self._outs

    def __getattr__(self, name: str) -> Any:  # the rest of a Work's methods
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._work, name)


def _storage(t: Any) -> Any:
    """The plain CPU storage under ``t``, or None (not a tensor, a tensor subclass with no
    storage of its own such as a functional collective's pending result, a freed one)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return None
    try:
        storage = t.untyped_storage()
        return storage if storage.data_ptr() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _holds_weights(t: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Does the storage under ``t`` hold other ranks' rows of some unit's W (``weights``:
    each unit's rows this rank does not own, as they are at the first step)?"""
    storage = _storage(t)
    if storage is None or not t.is_floating_point() or storage.nbytes() % t.element_size():
        return False
    flat = torch.empty(0, dtype=t.dtype).set_(storage).detach()
    return any(bool(torch.isin(w.to(t.dtype), flat).float().mean() > 0.5) for w in weights
               if flat.numel() >= w.numel())


class _Recorder:
    """Every collective the learner's unit issues while ``on``: the op (an all-reduce whose
    output holds a unit's weights is "all_reduce_gather"), the bytes it wrote, weakrefs to
    those tensors and whether it was functional. An async one reaches its outputs at
    ``wait()`` only (:class:`_Pending`); ``waits`` counts those issued."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, int, list[weakref.ref], bool]] = []
        self.weights: list[torch.Tensor] = []  # other ranks' rows of each unit's W
        self.asynchronous = 0

    def around(self, call: Any, proceed: Callable[[], Any]) -> Any:
        args = call.arguments
        keys = [k for k in ("output_tensor", "output", "tensor_list", "tensor") if k in args]
        # a functional collective (no output argument) is differentiable: allowed here
        if (self.on and keys and torch.is_grad_enabled()
                and any(_tracked(v) for v in args.values())):
            raise RuntimeError(f"{call.name} was {_NO_AUTOGRAD}")
        result = proceed()
        if not self.on:
            return result
        out = args[keys[0]] if keys else result  # a functional collective returns it
        outs = [t for t in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(t, torch.Tensor)]
        if keys and call.async_op and result is not None:
            result.wait()
        op = call.op
        if op == "all_reduce" and any(_holds_weights(t, self.weights) for t in outs):
            op = "all_reduce_gather"
        self.calls.append((op, sum(t.numel() * t.element_size() for t in outs),
                           [weakref.ref(t) for t in outs], not keys))
        if keys and call.async_op and result is not None:
            self.asynchronous += 1
            return _Pending(result, outs)
        return result


class _Unit(torch.nn.Module):
    """A linear layer as one ZeRO-3 unit: this rank's rows of the weight (the shard) and the
    bias (replicated), driven by the learner's zero3_linear."""

    def __init__(self, linear: torch.nn.Linear, fn: Callable, group: Any, rank: int,
                 n: int) -> None:
        super().__init__()
        rows = linear.out_features // n
        self.shard = torch.nn.Parameter(linear.weight.detach()[rank * rows:(rank + 1) * rows]
                                        .clone())
        self.bias = linear.bias
        self.out_features = linear.out_features  # attention counts its heads from it
        self.fn, self.group = fn, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fn(x.reshape(-1, x.shape[-1]), self.shard, self.group)
        return y.reshape(*x.shape[:-1], -1) + self.bias


def _saved_by_autograd(root: Any) -> Iterator[Any]:
    """Every tensor the autograd graph under ``root`` keeps for backward: the saved tensors
    of each node (``_saved_*``, an autograd.Function's ``saved_tensors``)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names = [n for n in dir(node) if n.startswith("_saved_")] + ["saved_tensors"]
        for name in names:
            try:
                value = getattr(node, name)
            except Exception:  # noqa: BLE001 - freed, or not a tensor-saving node
                continue
            yield from (value if isinstance(value, (list, tuple)) else [value])
        stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))


# A collective's worker thread can hold its buffers for a moment after wait() returns (gloo's
# does): a temporary of the learner's (a list all-gather's pieces) may still be alive at the
# first look. Storage the learner keeps is there at every look; the smallest of a few looks,
# this far apart, counts it and not the moment's temporaries.
KEPT_LOOKS, KEPT_LOOK_GAP_S = 3, 0.02


def _kept_bytes(logits: torch.Tensor, weights: list[torch.Tensor]) -> int:
    """Bytes of storage alive between forward and backward that hold other ranks' rows of
    a unit's W, whatever refers to it: autograd's saved tensors, or any Python object (a
    ctx attribute, a module, a global). Judged by storage, so a view, a ``.detach()``, a
    ``torch.cat`` of a list all-gather or an all-reduced buffer count the same; a cycle's
    garbage is collected first, and ``weights`` themselves (the harness's) are left out.
    The smallest of :data:`KEPT_LOOKS` looks: what a collective's thread still held for a
    moment is not the learner's."""
    kept = _kept_bytes_now(logits, weights)
    for _ in range(KEPT_LOOKS - 1):
        if not kept:
            break
        time.sleep(KEPT_LOOK_GAP_S)
        kept = min(kept, _kept_bytes_now(logits, weights))
    return kept


def _kept_bytes_now(logits: torch.Tensor, weights: list[torch.Tensor]) -> int:
    """One look of :func:`_kept_bytes`."""
    gc.collect()
    mine = {w.untyped_storage().data_ptr() for w in weights}
    candidates = list(_saved_by_autograd(logits.grad_fn))
    # type(), not isinstance: an instance check may touch a deprecated object's attributes
    candidates += [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]
    storages: dict[int, int] = {}
    for t in candidates:
        storage = _storage(t)
        if storage is None or storage.data_ptr() in mine or storage.data_ptr() in storages:
            continue
        storages[storage.data_ptr()] = storage.nbytes() if _holds_weights(t, weights) else 0
    return sum(storages.values())


def _others_rows(weight: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """The rows of ``weight`` that ``rank`` does not own, flattened: what only a gather
    brings it."""
    rows = weight.shape[0] // n
    kept = torch.cat([weight[:rank * rows], weight[(rank + 1) * rows:]])
    return kept.detach().reshape(-1).clone()


def _train(fn: Callable, group: Any, seed: int) -> dict[str, Any]:
    """STEPS steps of data-parallel SGD over ``group`` with every block linear a learner's
    unit; the replicated parameters' gradients averaged by the harness."""
    import torch.distributed as dist

    from parlib.measure.intercept import observing
    from parlib.model import build_model, loss_fn
    from parlib.strategies import data as dp

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    model = build_model(cfg(), seed)
    rec = _Recorder()
    for block in model.blocks:
        for path in _LINEARS:
            parent, name = path.split(".")
            owner = getattr(block, parent)
            rec.weights.append(_others_rows(getattr(owner, name).weight, rank, n))
            setattr(owner, name, _Unit(getattr(owner, name), fn, group, rank, n))
    named = dict(model.named_parameters())
    shards = [k for k in named if k.endswith(".shard")]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"logits": [], "grads": [], "rank": rank, "n": n}
    with observing(rec):
        for step in range(STEPS):
            x, y = dp.local_batch(BATCH, cfg(), step, seed, rank=rank, world_size=n)
            opt.zero_grad(set_to_none=True)
            rec.on = True
            try:
                logits = model(x)
            except RuntimeError as exc:
                if _NO_AUTOGRAD not in str(exc):
                    raise
                return {**out, "error": str(exc).splitlines()[0], "error_kind": "no_autograd"}
            finally:
                rec.on = False
            if step == 0:  # what the units still hold between forward and backward
                out["kept_bytes"] = _kept_bytes(logits, rec.weights)
                out["forward_ops"] = [(op, functional) for op, _, _, functional in rec.calls]
                rec.calls.clear()
            rec.on = True
            try:
                loss_fn(logits, y).backward()
            except RuntimeError as exc:
                if "invalid gradient" not in str(exc):
                    raise
                return {**out, "error": str(exc).splitlines()[0], "error_kind": "full"}
            finally:
                rec.on = False
            if step == 0:
                out["backward_ops"] = [(op, nbytes) for op, nbytes, _, _ in rec.calls]
                rec.calls.clear()
                # what the shards' gradients keep: a view of a whole gradient keeps it all
                out["grad_storage"] = sum(named[k].grad.untyped_storage().nbytes()
                                          for k in shards if named[k].grad is not None)
                out["shard_bytes"] = sum(named[k].numel() * named[k].element_size()
                                         for k in shards)
            for k, p in named.items():  # replicated: plain data parallelism, averaged
                if k not in shards:
                    dist.all_reduce(p.grad, group=group)
                    p.grad /= n
            out["async_ops"] = rec.asynchronous
            out["logits"].append(logits.detach().clone())
            out["grads"].append({k: None if p.grad is None else p.grad.detach().clone()
                                 for k, p in named.items()})
            opt.step()
    out["params"] = {k: p.detach().clone() for k, p in named.items()}
    return out


def _zero3_rank(fn: Callable, setting: str) -> dict[str, Any]:
    """On each rank: ``"world"``, the default group; ``"pairs"``, ranks {0, 1} and {2, 3}
    as two groups training apart (different seeds)."""
    import torch.distributed as dist

    if setting == "world":
        return _train(fn, None, SEED)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = dist.get_rank() // 2
    try:
        return {**_train(fn, groups[pair], SEED + pair), "pair": pair}
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - a group ignored shows up as any error
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "pair": pair,
                "in_group": True}


@functools.lru_cache(maxsize=None)
def _history(seed: int) -> Any:
    return reference_run(cfg(), steps=STEPS, batch=BATCH, lr=LR, seed=seed,
                         record=("logits",))


def _reference(world: World) -> Any:
    return {0: _history(SEED)} if world.args[0] == "world" else {
        0: _history(SEED), 1: _history(SEED + 1)}


def _ref_name(name: str) -> str:
    return name.replace(".shard", ".weight")


def _mine(full: torch.Tensor, name: str, rank: int, n: int) -> torch.Tensor:
    """This rank's piece of a reference tensor: its rows for a shard, all of it otherwise."""
    if not name.endswith(".shard"):
        return full
    rows = full.shape[0] // n
    return full[rank * rows:(rank + 1) * rows]


def _first_wrong(case: Case) -> tuple[int, Any] | None:
    for rank, res in enumerate(case.results):
        if "error" in res:
            return rank, ("error", 0, None)
        ref = case.reference[res.get("pair", 0)]
        r, n = res["rank"], res["n"]
        for step in range(STEPS):
            rows = BATCH // n
            if not close(res["logits"][step], ref.logits[step][r * rows:(r + 1) * rows]):
                return rank, ("logits", step, None)
            for name, got in res["grads"][step].items():
                want = _mine(ref.grads[step][_ref_name(name)], name, r, n)
                if got is None or not close(got, want):
                    return rank, ("grad", step, name)
        for name, got in res["params"].items():
            if not close(got, _mine(ref.params[_ref_name(name)], name, r, n)):
                return rank, ("param", STEPS - 1, name)
    return None


def _kind(case: Case) -> str:
    return case.step[0]


def _grads(case: Case) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(the learner's gradient, this rank's piece of the reference, the full reference)."""
    _, step, name = case.step
    res = case.report
    full = case.reference[res.get("pair", 0)].grads[step][_ref_name(name)]
    return res["grads"][step][name], _mine(full, name, res["rank"], res["n"]), full


def _is_shard_grad(case: Case) -> bool:
    return _kind(case) == "grad" and case.step[2].endswith(".shard")


def _wrong_dim(case: Case) -> bool:
    got, want, full = _grads(case)
    res = case.report
    if got is None or full.shape[1] % res["n"]:
        return False
    cols = full.shape[1] // res["n"]
    columns = full[:, res["rank"] * cols:(res["rank"] + 1) * cols].reshape(want.shape)
    return off_by(got, columns, 1) or off_by(got, columns, res["n"])


def _functional(case: Case) -> bool:
    """Did the forward call a functional collective (one autograd differentiates)?"""
    return any(functional for res in case.results for _, functional in
               res.get("forward_ops", []))


def _ops(case: Case, which: str) -> list[str]:
    return [op for op, _ in case.results[0][which]]


def _all_reduced(case: Case) -> str:
    rank, res = next((r, res) for r, res in enumerate(case.results)
                     if any(op == "all_reduce" for op, _ in res["backward_ops"]))
    reduced = sum(nbytes for op, nbytes in res["backward_ops"] if op == "all_reduce")
    return (f"your numbers are right, but rank {rank}'s backward all-reduced the whole "
            f"gradients: {reduced} bytes of reduced gradient on every rank, where "
            f"reduce-scatters leave each rank its shards' {res['shard_bytes']} bytes "
            f"({case.world} times the memory; the shards' gradients keep "
            f"{res['grad_storage']} bytes of storage). ZeRO shards the gradients: "
            f"reduce-scatter them, so that rank r receives only the sum of its own rows "
            f"(comm.reduce_scatter)")


def _wrong_value(case: Case) -> Any:
    """The learner's tensor that ``first_wrong`` found wrong."""
    kind, step, name = case.step
    res = case.report
    if kind == "logits":
        return res["logits"][step]
    if kind == "grad":
        return res["grads"][step][name]
    return res["params"].get(name) if kind == "param" else None


def _used_before_wait(case: Case) -> bool:
    """An async collective, and NaN where its output was read: its output holds NaN until
    ``wait()`` (:class:`_Pending`), and this model's numbers are never NaN otherwise."""
    got = _wrong_value(case) if _kind(case) != "error" else None
    return bool(case.report.get("async_ops")) and isinstance(got, torch.Tensor) and bool(
        got.isnan().any())


def _gathers_by_all_reduce(case: Case) -> bool:
    return any(op == "all_reduce_gather" for res in case.results
               for which in ("forward_ops", "backward_ops") for op, _ in res.get(which, []))


def _gathered_by_all_reduce(case: Case) -> str:
    rank = next(r for r, res in enumerate(case.results) if any(
        op == "all_reduce_gather" for which in ("forward_ops", "backward_ops")
        for op, _ in res.get(which, [])))
    n = case.results[rank]["n"]
    return (f"your numbers are right, but rank {rank} gathers W with an all-reduce (each rank's "
            f"rows in a zero-padded buffer, summed): an all-reduce is not a gather. It sends "
            f"2 x (N-1)/N of the whole W per rank where an all-gather sends (N-1)/N, twice the "
            f"traffic of every gather (N = {n}), to add zeros. Gather with comm.all_gather "
            f"(every rank's rows, in rank order)")


def _kept(case: Case) -> str:
    rank, res = max(enumerate(case.results), key=lambda item: item[1]["kept_bytes"])
    return (f"your numbers are right, but after the forward pass rank {rank} still holds "
            f"{res['kept_bytes']} bytes of gathered weights (every unit's full W): "
            f"ZeRO-3 frees each unit's weights as soon as its forward returns. Save the shard "
            f"(ctx.save_for_backward(x, shard), not the gathered weight) and all-gather "
            f"again in backward")


def _ignores_group(case: Case) -> str:
    what = case.report.get("error") or "its numbers differ from its pair's single-device run"
    return (f"right on the whole world, but wrong when the unit's group is a sub-group "
            f"(ranks {{0, 1}} and {{2, 3}} as two groups; rank {case.rank}: {what}). Pass "
            f"group=group to every collective and use dist.get_world_size(group)")


DIAGNOSES = [
    Diagnosis("ignores_group", lambda c: c.setting.args[0] == "pairs", _ignores_group),
    Diagnosis("collective_without_autograd",
              lambda c: _kind(c) == "error" and c.report.get("error_kind") == "no_autograd",
              lambda c: f"rank {c.rank}: {c.report['error']}. A collective has no autograd "
              f"kernel: called on the shard (which requires grad) outside an autograd "
              f"Function, it cannot take part in backward. Do the all-gather inside "
              f"forward of a torch.autograd.Function and write its backward (gather "
              f"again, reduce-scatter) yourself"),
    Diagnosis("full_parameter_gradient", lambda c: _kind(c) == "error",
              lambda c: f"rank {c.rank}: {c.report['error']}. Each rank keeps and updates "
              f"only its shard, the rows it owns: backward must return the gradient of the "
              f"shard (shard's shape), not of the whole weight. Reduce-scatter dL/dW so "
              f"that rank r receives the sum of its rows"),
    Diagnosis("differentiable_collective", _functional,
              "you let autograd differentiate through a functional all-gather: its backward "
              "sums the ranks' gradients (a reduce-scatter) without dividing by N, and "
              "autograd keeps the gathered W until backward, the memory ZeRO-3 exists to "
              "save. Write a torch.autograd.Function: all-gather in forward, keep only the "
              "shard, gather again and reduce-scatter (then / N) in backward"),
    Diagnosis("used_before_wait", _used_before_wait,
              lambda c: f"rank {c.rank}'s {'forward' if c.step[0] == 'logits' else 'backward'}"
              f" computed with an async collective's output before work.wait() (or never "
              f"waited): a race. async_op=True returns at once, "
              f"and the tensor it writes holds its result only once wait() has returned; "
              f"here it held NaN until then. Call work.wait() before the first compute that "
              f"reads it"),
    Diagnosis("no_shard_gradient", lambda c: _is_shard_grad(c) and _grads(c)[0] is None,
              lambda c: f"rank {c.rank}'s shard got no gradient: a collective is invisible "
              f"to autograd, so the gathered weight does not lead back to the shard. Wrap "
              f"the unit in a torch.autograd.Function whose backward returns the shard's "
              f"gradient"),
    Diagnosis("gradient_times_N",
              lambda c: _is_shard_grad(c) and off_by(_grads(c)[0], _grads(c)[1],
                                                     c.report["n"]),
              lambda c: f"rank {c.rank}'s shard gradient is {c.report['n']} times too big: "
              f"the reduce-scatter sums the ranks' gradients, and each rank's is already the "
              f"mean over its own rows of the batch. Divide by the group's size"),
    Diagnosis("wrong_dimension", lambda c: _is_shard_grad(c) and _wrong_dim(c),
              lambda c: f"rank {c.rank}'s shard gradient holds columns of dL/dW: the "
              f"shards are cut along dim 0, rows [r * out/N, (r + 1) * out/N) of W "
              f"(out_features, in_features). Reduce-scatter dL/dW as it is (contiguous "
              f"rows), not its columns"),
    Diagnosis("wrong_output", lambda c: c.step[:2] == ("logits", 0),
              lambda c: f"rank {c.rank}'s logits differ from single-device training in the "
              f"first forward: all-gather the shards in rank order along dim 0 (W is "
              f"(N * out/N, in)) and return x @ W.T"),
    Diagnosis("wrong_gradient", lambda c: c.step[:2] == ("grad", 0),
              lambda c: f"rank {c.rank}'s gradient of {c.step[2]} differs from "
              f"single-device training in the first step (the logits were right): check "
              f"backward's dL/dx = dL/dy @ W and dL/dW = dL/dy.T @ x"),
    Diagnosis("breaks_training", always,
              lambda c: f"the first step was right, but by step {c.step[1] + 1} rank "
              f"{c.rank}'s {c.step[0]} ({c.step[2] or 'the model output'}) differ from "
              f"single-device training: the weights changed between steps. Does your "
              f"function write into the shard in place (as a collective's output, say)? "
              f"Only the optimizer may change it"),
    Diagnosis("kept_gathered_weights", lambda c: c.results[0]["kept_bytes"] > 0 or any(
        res["kept_bytes"] > 0 for res in c.results), _kept, right=True),
    Diagnosis("gathered_by_all_reduce", _gathers_by_all_reduce, _gathered_by_all_reduce,
              right=True),
    Diagnosis("all_reduced_gradients", lambda c: "all_reduce" in _ops(c, "backward_ops"),
              _all_reduced, right=True),
]

_PAIRS = "on two 2-rank groups of a 4-rank world"

QUESTION = register(RankExercise(
    "02.zero3_linear",
    probe=_zero3_rank,
    worlds=[World(n, ("world",)) for n in WORLDS] + [World(4, ("pairs",), _PAIRS)],
    reference=_reference,
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    solution=ZERO3_SOLUTION,
    timeout=120.0,
    hang_hint="the ranks' collectives did not match{t} ({where}): every rank of the group "
              "must call the same all-gathers and reduce-scatters in the same order, with "
              "group=group",
    prompt="""
        Write zero3_linear(x, shard, group=None) -> Tensor, one ZeRO-3 unit: a linear layer
        y = x @ W.T (no bias) whose weight W (out_features, in_features) is cut along dim 0
        over the group's N ranks; rank r holds rows [r * out/N, (r + 1) * out/N) as
        `shard`, an (out/N, in) parameter. x is (tokens, in_features), this rank's tokens.
        Forward: all-gather the shards into W, compute, and keep nothing of W. Backward:
        all-gather W again, return dL/dx, and reduce-scatter dL/dW so that shard.grad is
        this rank's rows of the gradient averaged over the group. Use a
        torch.autograd.Function defined inside the function, and comm.all_gather /
        comm.reduce_scatter (from parlib). Checked as every linear layer of a TinyGPT's
        blocks, 3 SGD steps on 2 and 4 ranks and on two 2-rank groups of 4 ranks, against
        single-device training (rtol 1e-4), with the gathered weights left after forward
        and the gradient buffers measured.
    """,
    explanation="""
        Forward gathers the full weight (the shards side by side along dim 0, in rank
        order), computes x @ W.T and lets W go: saving the shard instead of W is what makes
        the unit's weights exist in full only while it computes. That is why backward must
        gather again (the third P x (N-1)/N of ZeRO-3's bytes per step).

        Backward computes this rank's full dL/dW from its own tokens; the average over the
        ranks is the single-device gradient, and a reduce-scatter delivers to rank r just
        the sum of its rows, N times less memory than an all-reduce's whole gradient.
        Divide by N for the average. dL/dx needs no communication: each rank's tokens are
        its own.
    """,
))

__all__ = ["ZERO3_SOLUTION"]
