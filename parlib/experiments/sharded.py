"""The sharded-data-parallel chapter's harnesses: one model trained as plain data parallelism,
ZeRO-1, ZeRO-2 or ZeRO-3 (:class:`parlib.strategies.fsdp.FSDP`), with a memory probe that
samples what each rank holds, by kind, at every unit boundary of forward and backward; the
ledger those samples are held against (formulas from :mod:`parlib.cost`); ZeRO-3 on an
emulated device and link, to show prefetch on a timeline; and torch's FSDP2 beside ours.

Every function whose name ends in ``_run`` runs on the ranks (``parlib.launch``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlib.cost.memory import (
    activation_bytes_per_layer,
    model_activation_bytes,
    model_state_bytes_by_kind,
)
from parlib.cost.sharded import padded_numel
from parlib.measure.comm_log import CommLog
from parlib.measure.emulation import SlowLink
from parlib.measure.memory import (
    GatheredWeights,
    SavedActivations,
    optimizer_state_bytes,
    tensor_bytes,
)
from parlib.measure.tables import Table
from parlib.measure.timeline import Recorder, Span
from parlib.measure.timing import time_it
from parlib.model import ModelConfig, build_model, loss_fn, make_batch
from parlib.runtime.policy import device as this_device
from parlib.strategies.data import allreduce_gradients, local_batch
from parlib.strategies.fsdp import FSDP, _Note
from parlib.strategies.sharded import Zero2
from parlib.strategies.zero import Zero1

STAGES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
KINDS = ("params", "gathered", "grads", "optimizer", "shard copy", "activations", "buffers")


class Sharded:
    """One rank's model trained one way (``stage`` in :data:`STAGES`) with Adam: ``model``
    for the forward, :meth:`step` after backward, :meth:`sample` for the bytes held now."""

    def __init__(self, stage: str, cfg: ModelConfig, *, seed: int = 0, lr: float = 1e-3,
                 compute_dtype: torch.dtype | None = None, prefetch: bool = False,
                 recompute: bool = False, optimizer: str = "adam") -> None:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
        opt_cls = OPTIMIZERS[optimizer]
        self.stage, self.net = stage, build_model(cfg, seed).to(this_device())
        self.blocks = list(self.net.blocks)
        self.fsdp: FSDP | None = None
        self.shards: list[Any] = []
        self.model: nn.Module = self.net
        if stage == "ZeRO-3":
            self.fsdp = self.model = FSDP(self.net, compute_dtype, prefetch=prefetch,
                                          recompute=recompute)
            self.gathered = GatheredWeights(self.fsdp)  # observed through its gather hook
            self.optimizer: Any = opt_cls(self.fsdp.parameters(), lr=lr)
        elif stage == "ZeRO-2":
            self.optimizer = Zero2(self.net, opt_cls, lr=lr)
            self.shards = self.optimizer.shards
        elif stage == "ZeRO-1":
            self.optimizer = Zero1(self.net.parameters(), opt_cls, lr=lr)
            self.shards = self.optimizer.shards
        else:
            self.optimizer = opt_cls(self.net.parameters(), lr=lr)

    def step(self) -> None:
        if self.stage == "DP":
            allreduce_gradients(self.net)
        elif self.fsdp is not None:
            self.fsdp.finish_gradient_synchronization()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)  # gradients keep their memory

    def full_params(self) -> dict[str, torch.Tensor]:
        if self.fsdp is not None:
            return self.fsdp.gather_full_params()
        return {n: p.detach().cpu().clone() for n, p in self.net.named_parameters()}

    def sample(self, saved: SavedActivations | None) -> dict[str, int]:
        """Bytes this rank holds now, by kind (:data:`KINDS`)."""
        # FSDP: the shards themselves (inside a unit's forward its module's parameters
        # are the gathered weights, counted under "gathered")
        params = ([s for u in self.fsdp.units for s in u.shards] if self.fsdp
                  else list(self.net.parameters()))
        pending = [u.pending[0] for u in self.fsdp.units if u.pending] if self.fsdp else []
        return {"params": tensor_bytes(params),
                "gathered": self.gathered.now if self.fsdp else 0,
                "grads": tensor_bytes([p.grad for p in params]
                                      + [s.tensor.grad for s in self.shards]),
                "optimizer": optimizer_state_bytes(self.optimizer),
                "shard copy": tensor_bytes([s.tensor for s in self.shards]),
                "activations": saved.live if saved is not None else 0,
                "buffers": tensor_bytes(pending)}

    def counting(self, saved: SavedActivations) -> Any:
        """Count saved activations under FSDP too: its own saved-tensor hook (which keeps a
        note instead of a gathered weight) runs first, the counter sees the rest."""
        if self.fsdp is None:
            return saved
        fsdp, inner_pack, inner_unpack = self.fsdp, FSDP._pack.__get__(self.fsdp), FSDP._unpack

        def pack(t: torch.Tensor) -> Any:
            note = inner_pack(t)
            return note if isinstance(note, _Note) else saved._pack(t)

        fsdp._pack, fsdp._unpack = pack, lambda s: inner_unpack(saved._unpack(s))
        return saved


def _probe(run: Sharded, samples: list, step: int) -> tuple[SavedActivations, list, Any]:
    """Sample after every block's and the head's forward, and when each block's backward
    starts (the gradient of its output arrives); ``mark`` samples when called."""
    saved = run.counting(SavedActivations(run.model))

    def mark(phase: str) -> None:
        samples.append((step, phase, run.sample(saved)))

    def after_forward(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
        mark("forward")
        if out.requires_grad:
            out.register_hook(lambda g: mark("backward"))

    handles = [m.register_forward_hook(after_forward) for m in [*run.blocks, run.net.head]]
    return saved, handles, mark


def ledger_run(stages: tuple[str, ...], cfg: ModelConfig, batch: int, *, steps: int = 3,
               seed: int = 0, lr: float = 1e-3, optimizer: str = "adam",
               compute_dtype: torch.dtype | None = None) -> dict[str, dict]:
    """Each stage in turn on this rank: ``steps`` Adam steps on this rank's rows of the
    global ``batch``, every step's samples ``(step, phase, {kind: bytes})``, the bytes sent
    in the last step and the full weights at the end."""
    out = {}
    for stage in stages:
        run = Sharded(stage, cfg, seed=seed, lr=lr, compute_dtype=compute_dtype,
                      optimizer=optimizer)
        samples: list = []
        for step in range(steps):
            x, y = local_batch(batch, cfg, step, seed=seed, device=this_device())
            saved, handles, mark = _probe(run, samples, step)
            with CommLog() as log:
                with saved:
                    loss = loss_fn(run.model(x), y)
                    mark("loss")  # the loss keeps its log-softmax: forward's last bytes
                    loss.backward()
                run.step()
            for h in handles:
                h.remove()
            samples.append((step, "step", run.sample(None)))
            run.zero_grad()
        out[stage] = {"samples": samples, "sent": log.predicted_sent(),
                      "message bytes": log.total_bytes(), "params": run.full_params()}
    return out


def peak(samples: list, step: int | None = None) -> tuple[int, dict[str, int]]:
    """The largest total among the samples (of one step, if given) and its kinds."""
    chosen = [s for s in samples if step is None or s[0] == step]
    best = max(chosen, key=lambda s: sum(s[2].values()))
    return sum(best[2].values()), best[2]


def predicted_ledger(stage: str, cfg: ModelConfig, rows: int, world_size: int) -> dict[str, float]:
    """What one rank holds at its peak, by kind, from the cost layer: model states by ZeRO
    stage (sharded kinds on the padded counts each strategy cuts), one fp32 shard copy for
    ZeRO-1/2's inner optimizer, and the activations of ``rows`` rows. DP to ZeRO-2 peak when
    the loss is computed (every activation saved); ZeRO-3 when the last block's forward ends,
    with that block's and the root's weights gathered (the head has saved nothing yet)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if rows < 1 or world_size < 1:
        raise ValueError(f"rows and world_size must be >= 1, got {rows!r}, {world_size!r}")
    z = STAGES.index(stage)
    net = build_model(cfg)
    n = world_size
    full = sum(p.numel() for p in net.parameters())
    block_names = {id(p) for b in net.blocks for p in b.parameters()}
    if z == 3:  # FSDP pads each tensor
        padded = sum(padded_numel(p.numel(), n) for p in net.parameters())
    elif z == 2:  # Zero2 pads each unit: the blocks, then the rest
        rest = sum(p.numel() for p in net.parameters() if id(p) not in block_names)
        padded = sum(padded_numel(sum(p.numel() for p in b.parameters()), n)
                     for b in net.blocks) + padded_numel(rest, n)
    else:
        padded = padded_numel(full, n)
    unsharded = model_state_bytes_by_kind(full, n, 0)
    sharded = model_state_bytes_by_kind(padded, n, 3)
    out = {k: 0.0 for k in KINDS}
    for kind, from_stage in (("optimizer", 1), ("grads", 2), ("params", 3)):
        out[kind] = sharded[kind] if z >= from_stage else unsharded[kind]
    if z in (1, 2):
        out["shard copy"] = model_state_bytes_by_kind(padded, n, z, shard_copy=True)["shard copy"]
    layers = activation_bytes_per_layer(cfg.seq_len, rows, cfg.d_model, cfg.n_heads,
                                        recompute="selective", dtype_bytes=4, dropout=False)
    if z == 3:  # the peak: the last block's forward ends, its weights and the root's whole
        root = sum(p.numel() for p in net.parameters() if id(p) not in block_names)
        block = max(sum(p.numel() for p in b.parameters()) for b in net.blocks)
        out["gathered"] = model_state_bytes_by_kind(root + block, 1, 0)["params"]
        out["activations"] = cfg.n_layers * layers  # the head has not run yet
    else:  # the peak: forward ends, every activation saved
        out["activations"] = model_activation_bytes(cfg.seq_len, rows, cfg.d_model,
                                                    cfg.n_heads, cfg.n_layers, cfg.vocab_size)
    return out


def ledger_table(measured: dict[tuple[str, int], dict[str, int]],
                 predicted: dict[str, dict[str, float]], title: str = "") -> Table:
    """The memory ledger as a table, in KiB: per stage, a row of what the formula predicts
    (``predicted[stage]``, from :func:`predicted_ledger`: the same on every rank), then one
    row per rank of what it held at its peak (``measured[(stage, rank)]``, from :func:`peak`),
    with the measured peak's gap to the predicted one.

    Every byte count is one whole number in its own cell (no "measured / predicted" pairs),
    so that the eleven columns stay one line high in a notebook at laptop width and the text
    form fits 100 characters."""
    rows: list[list[Any]] = []
    for stage in (s for s in STAGES if s in predicted):
        want = sum(predicted[stage].values())
        rows.append([stage, "formula", *(round(predicted[stage][k] / 1024) for k in KINDS),
                     round(want / 1024), ""])
        for rank in sorted(r for s, r in measured if s == stage):
            kinds = measured[(stage, rank)]
            total = sum(kinds.values())
            rows.append([stage, f"rank {rank}", *(round(kinds[k] / 1024) for k in KINDS),
                         round(total / 1024), f"{total / want - 1:+.1%}"])
    return Table(["stage", "", *KINDS, "peak", "gap"], rows, title=title)


# prefetch on an emulated device ---------------------------------------------------------

def prefetch_run(cfg: ModelConfig, batch: int, *, prefetch: bool, flops_per_second: float,
                 alpha: float, beta: float, seed: int = 0) -> dict[str, Any]:
    """One ZeRO-3 step (after a warm-up) with each unit's compute padded to what a device of
    ``flops_per_second`` takes (2 FLOPs per weight per token forward, twice that backward)
    and each collective slowed to a link of ``alpha``, ``beta`` (:class:`SlowLink`):
    per-rank spans (forward/backward per block, "dp" for the collectives) and step time."""
    run = Sharded("ZeRO-3", cfg, seed=seed, prefetch=prefetch)
    fsdp, n = run.fsdp, dist.get_world_size()
    rec = Recorder()
    link = SlowLink(alpha, beta)
    x, y = local_batch(batch, cfg, 0, seed=seed, device=this_device())
    tokens = x.numel()

    def pad_to(started: float, seconds: float) -> None:
        time.sleep(max(0.0, started + seconds - time.perf_counter()))

    for i, unit in enumerate(fsdp.units[1:]):
        work = 2 * sum(unit.numels) * tokens / flops_per_second  # one forward, seconds
        issue, gather, scatter = unit._issue, unit.gather, unit.reduce_scatter_grads

        def timed_issue(dtype, async_op, issue=issue, unit=unit):
            t0 = time.perf_counter()
            out = issue(dtype, async_op)
            nbytes = out[0].numel() * out[0].element_size()
            unit.issued = (t0, link.extra_seconds("all_gather", nbytes, n))
            return out

        def timed_gather(dtype=None, gather=gather, unit=unit):
            fulls = gather(dtype)
            t0, extra = unit.issued  # the emulated link delivers at t0 + extra
            rec.spans.append(Span(rec.rank, "dp", t0, t0 + extra))
            return fulls

        def timed_scatter(grads, scatter=scatter):
            with rec.span("dp"):
                return scatter(grads)

        def timed_regather(regather=unit.regather, unit=unit, i=i, work=work):
            first = unit.regathered is None
            fulls = regather()
            if first:  # the weights are here: the unit's backward computes (emulated)
                with rec.span("backward", mb=i):
                    time.sleep(2 * work)
            return fulls

        unit._issue, unit.gather = timed_issue, timed_gather
        unit.reduce_scatter_grads, unit.regather = timed_scatter, timed_regather

        def fwd_pre(m, args, unit=unit):
            if getattr(unit, "computing", False):
                unit.t0 = time.perf_counter()

        def fwd_post(m, args, out, unit=unit, i=i, work=work):
            if getattr(unit, "computing", False):
                pad_to(unit.t0, work)
                rec.spans.append(Span(rec.rank, "forward", unit.t0, time.perf_counter(), i))

        run.blocks[i].register_forward_pre_hook(fwd_pre)
        run.blocks[i].register_forward_hook(fwd_post)
    for step in range(2):  # a warm-up, then the step drawn
        if step == 1:
            rec.spans.clear()
        with link:
            dist.barrier()
            t0 = time.perf_counter()
            loss_fn(run.model(x), y).backward()
            run.step()
            seconds = time.perf_counter() - t0
        run.zero_grad()
    return {"spans": rec.spans, "seconds": seconds}


# torch's FSDP2 beside ours ------------------------------------------------------------

def fsdp2_run(cfg: ModelConfig, batch: int, *, steps: int = 3, seed: int = 0, lr: float = 1e-3,
              repeats: int = 8) -> dict[str, dict]:
    """Ours (ZeRO-3) and ``fully_shard`` on the same model, data and ranks: full weights
    after ``steps`` Adam steps, model-state bytes this rank holds, bytes of one step's
    collectives, and the median step time over ``repeats`` steps (alternating the two)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    dev = this_device()
    ours = Sharded("ZeRO-3", cfg, seed=seed, lr=lr)
    net = build_model(cfg, seed).to(dev)
    # fully_shard's default mesh is on the machine's accelerator, whatever device the ranks
    # use (CPU ranks on a GPU machine; two ranks on one GPU): name this rank's device
    if dev.type == "cuda":
        torch.cuda.set_device(dev if dev.index is not None else torch.cuda.current_device())
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    theirs = torch.optim.Adam(net.parameters(), lr=lr)
    pairs = {"ours (parlib.FSDP)": (ours.model, ours.optimizer, ours.step),
             "FSDP2 (fully_shard)": (net, theirs, theirs.step)}
    out: dict[str, dict] = {k: {} for k in pairs}

    def one_step(model: nn.Module, opt: Any, step_fn: Any, step: int) -> None:
        x, y = local_batch(batch, cfg, step, seed=seed, device=dev)
        loss_fn(model(x), y).backward()
        step_fn()
        opt.zero_grad()

    for step in range(steps):
        for name, (model, opt, step_fn) in pairs.items():
            with CommLog() as log:
                one_step(model, opt, step_fn, step)
            out[name]["message bytes"] = log.total_bytes()
            out[name]["sent"] = log.predicted_sent()
    out["ours (parlib.FSDP)"]["params"] = ours.full_params()
    out["FSDP2 (fully_shard)"]["params"] = {n: p.full_tensor().cpu()
                                            for n, p in net.named_parameters()}
    for name, (model, opt, _) in pairs.items():
        params = list(model.parameters())
        out[name]["model states"] = (tensor_bytes(params) + optimizer_state_bytes(opt))
    times: dict[str, list[float]] = {k: [] for k in pairs}
    for _ in range(repeats):
        for name, (model, opt, step_fn) in pairs.items():
            times[name] += time_it(lambda: one_step(model, opt, step_fn, 0), repeats=1,
                                   warmup=0, barrier=True).times
    for name in pairs:
        out[name]["seconds"] = sorted(times[name])[len(times[name]) // 2]
    return out


def reference_cast(cfg: ModelConfig, batch: int, steps: int, dtype: torch.dtype, *,
                   seed: int = 0, lr: float = 0.1, optimizer: str = "sgd"
                   ) -> dict[str, torch.Tensor]:
    """One device, the whole batch, fp32 master weights cast to ``dtype`` for every forward
    (what ``FSDP(compute_dtype=dtype)`` computes): the low-precision reference."""
    net = build_model(cfg, seed)
    opt = OPTIMIZERS[optimizer](net.parameters(), lr=lr)
    for step in range(steps):
        x, y = make_batch(batch, cfg, step, seed)
        cast = {n: t.to(dtype) for n, t in [*net.named_parameters(), *net.named_buffers()]}
        loss_fn(torch.func.functional_call(net, cast, (x,)).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


__all__ = ["KINDS", "STAGES", "Sharded", "fsdp2_run", "ledger_run", "ledger_table", "peak",
           "predicted_ledger", "prefetch_run", "reference_cast"]
