"""Choose the layout: try every valid :class:`~parlib.cost.layout.Layout` (with m, v, ZeRO
stage and recomputation), keep the ones that fit, return the fastest, each with a one-line
reason (:func:`best_layouts`).

Every layout gets its best setting: the fastest (m, v, zero, recompute) that fits; among
settings equally fast the simplest (no ZeRO, no recomputation, fewest microbatches) wins.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from parlib.cost.estimate import RECOMPUTE, STEP_PARTS, Estimate, _evaluate, check_inputs
from parlib.cost.hardware import GB, Hardware
from parlib.cost.held_out import GIB, beyond_count_gib
from parlib.cost.layout import Layout
from parlib.cost.memory import check_loss
from parlib.cost.model import Model

_WHY_FASTER = {"compute": "less compute", "memory_bound": "fewer bytes through memory",
               "host": "fewer layer passes waiting on the host",
               "tp_comm": "less tensor-parallel traffic",
               "cp_comm": "less exposed ring-attention traffic",
               "ep_comm": "less expert all-to-all traffic",
               "pp_bubble": "a smaller pipeline bubble", "pp_send": "fewer stage-boundary sends",
               "dp_sync": "less gradient sync on the critical path",
               "optimizer": "less optimizer state to update per device"}


MAX_CP = 32  # Llama 3 trained 128k-token sequences with c = 16
# The estimate charges no loss of kernel efficiency on short blocks, which is what makes a
# short sequence split c ways slow in practice; so the search tries cp only where every rank
# keeps at least this many positions (Llama 3: 128k / 16 = 8k).
MIN_CP_POSITIONS = 4096


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def candidate_layouts(model: Model, hardware: Hardware, global_batch: int
                      ) -> Iterator[tuple[Layout, int, int]]:
    """Every valid (layout, m, v): t divides the heads, p is at most the layers (uneven
    stages when it does not divide them: :func:`~parlib.cost.stages.stage_layers`), 2c the
    sequence (the zig-zag split; c at most :data:`MAX_CP` and s/c at least
    :data:`MIN_CP_POSITIONS`, which keeps the search small), v a divisor of the most layers
    a stage holds (ceil(L / p), p x v at most L; uneven stages make uneven chunks,
    :func:`~parlib.cost.stages.rank_layers`), d x m the global batch, and m is a multiple of
    p when v > 1. For a
    mixture-of-experts model, every ep that divides both the experts and d x c."""
    n = hardware.n_devices
    for t in divisors(n):
        if model.n_heads % t:
            continue
        for p in divisors(n // t):
            if p > model.n_layers:
                continue
            for c in divisors(n // (t * p)):
                if c > 1 and (c > MAX_CP or model.seq_len % (2 * c)
                              or model.seq_len // c < MIN_CP_POSITIONS):
                    continue
                d = n // (t * p * c)
                if global_batch % d:
                    continue
                # v divides the most layers a stage holds (with uneven stages the chunks
                # are uneven too: stages.rank_layers)
                chunks = ([v for v in divisors(-(-model.n_layers // p))
                           if p * v <= model.n_layers] if p > 1 else [1])
                # ep for mixtures only: it divides the experts and d x c (whose ranks it borrows)
                eps = ([e for e in divisors(d * c) if model.n_experts % e == 0]
                       if model.is_moe else [1])
                for e in eps:
                    layout = Layout(dp=d, cp=c, tp=t, pp=p, ep=e)
                    for m in divisors(global_batch // d):
                        for v in chunks:
                            if v == 1 or m % p == 0:
                                yield layout, m, v


def _simplicity(est: Estimate) -> tuple:
    return (est.zero, bool(est.shard_group), RECOMPUTE.index(est.recompute), est.m, est.v)


def _faster(a: Estimate, b: Estimate) -> bool:
    """a beats b: clearly faster, or as fast (to 1e-9) and simpler."""
    if abs(a.step_time - b.step_time) > 1e-9 * max(a.step_time, b.step_time):
        return a.step_time < b.step_time
    return _simplicity(a) < _simplicity(b)


def best_layouts(model: Model, hardware: Hardware, *, global_batch: int, top: int = 5,
                 sequence_parallel: bool = True, mixed_precision: bool = True,
                 loss: str = "unfused") -> list[Estimate]:
    """The ``top`` fastest layouts that fit, fastest first, each with ``.reason``: one
    :class:`Estimate` per layout, at its best setting.

    Searched: t, p (uneven stages included), c, d, e (mixtures of experts only), m (so the
    microbatch size, global_batch / (d x m)), v, ZeRO 0-3 (0-2 with a pipeline), HSDP
    where the data-parallel ranks span nodes (:func:`hsdp_shard_group`) and recomputation
    (none, selective, full). Inputs, not searched: ``mixed_precision`` (the
    cost model has one compute rate, the training dtype's, so fp32 would only look bigger,
    never faster), ``sequence_parallel`` and ``loss`` (the cross-entropy's implementation,
    :func:`~parlib.cost.estimate.estimate`'s). The picks' ``binding`` names what limits each
    (:func:`binding_constraint`), and their reason ends with it.

    An empty list means no valid layout fits, not even with ZeRO-3 and full recomputation
    (or that no d divides the global batch).
    """
    check_inputs(model, hardware)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top!r}")
    check_loss(loss)
    best: dict[Layout, Estimate] = {}
    plain_fits: set[Layout] = set()  # fit with neither ZeRO nor recomputation
    smallest_split_that_fits = None
    for layout, m, v in candidate_layouts(model, hardware, global_batch):
        split = _split(layout)
        for recompute in RECOMPUTE:
            for zero, shard in _sharding_options(layout, hardware):
                est = _evaluate(model, hardware, layout, m, v, global_batch, zero, recompute,
                                sequence_parallel, mixed_precision, only_if_fits=True,
                                shard_group=shard, loss=loss)
                if est is None:
                    continue
                if zero == 0 and recompute is False:
                    plain_fits.add(layout)
                if smallest_split_that_fits is None or split < smallest_split_that_fits:
                    smallest_split_that_fits = split
                if layout not in best or _faster(est, best[layout]):
                    best[layout] = est
                if not shard:
                    break  # a higher ZeRO stage only adds traffic once this one fits
    ranked = sorted(best.values(), key=lambda e: (e.step_time, _simplicity(e)))[:top]
    for est in ranked:
        est.binding = binding_constraint(est, needed_help=est.layout not in plain_fits)
        est.reason = _reason(est, smallest_split_that_fits, best)
    return ranked


def hsdp_shard_group(layout: Layout, hardware: Hardware) -> int | None:
    """The shard group HSDP is tried with: the most data-parallel ranks whose group stays in
    one node (s x t consecutive ranks), where the d x c ranks span nodes, ZeRO-3 is allowed
    (no pipeline) and the model is dense (ep = 1); None where HSDP is not tried."""
    sync, t = layout.dp * layout.cp, layout.tp
    if layout.pp > 1 or layout.ep > 1 or sync == 1 or hardware.in_one_node(sync * t):
        return None
    fits = [s for s in divisors(sync) if 1 < s < sync and hardware.in_one_node(s * t)]
    return max(fits) if fits else None


def _sharding_options(layout: Layout, hardware: Hardware) -> list[tuple[int, int]]:
    """(zero, shard_group) to try, in order: HSDP first (always tried: its traffic is not
    ordered with the stages'), then ZeRO 0, 1, ... up to the first that fits."""
    shard = hsdp_shard_group(layout, hardware)
    return [(3, shard)] * bool(shard) + [(zero, 0) for zero in _zero_stages(layout)]


def _zero_stages(layout: Layout) -> tuple[int, ...]:
    """The ZeRO stages worth trying: none without data-parallel copies; never 3 with a
    pipeline (the estimate refuses it: every microbatch would re-gather the weights)."""
    if layout.dp * layout.cp == 1:
        return (0,)
    return (0, 1, 2) if layout.pp > 1 else (0, 1, 2, 3)


# What each step part waits on, as the planner names the constraint that binds.
_CONSTRAINT = {"compute": "compute", "memory_bound": "memory bandwidth",
               "host": "the host's serial kernel launches",
               "tp_comm": "the tensor-parallel link", "cp_comm": "the context-parallel link",
               "ep_comm": "the expert-parallel link", "pp_bubble": "the pipeline bubble",
               "pp_send": "the pipeline link", "dp_sync": "the data-parallel link",
               "optimizer": "the optimizer step"}
# Memory binds when the layout needed ZeRO or recomputation to fit, or has under this much
# of the device's memory to spare.
MEMORY_BINDS_ABOVE = 0.9
# Below this share of the step, nothing but compute is worth naming.
OVERHEAD_WORTH_NAMING = 0.05


def binding_constraint(est: Estimate, needed_help: bool | None = None) -> str:
    """What limits this layout, one phrase: "memory" when it had to shard (ZeRO) or
    recompute to fit, or fills more than :data:`MEMORY_BINDS_ABOVE` of memory; otherwise the
    largest part of the step beyond compute (a link, named with where it runs, the pipeline
    bubble, or memory bandwidth); "compute" when all of those together are under
    :data:`OVERHEAD_WORTH_NAMING` of the step.

    ``needed_help``: whether the layout failed to fit without ZeRO and recomputation (the
    planner knows; selective recomputation may be picked for speed alone). None: judged
    from the estimate, where ZeRO or full recomputation count as needed."""
    if needed_help is None:
        needed_help = bool(est.zero) or est.recompute is True
    needed = ([est.sharding] * bool(est.zero) + ["recomputation"] * bool(est.recompute)
              if needed_help else [])
    used = est.memory_total / est.hardware.memory_bytes
    if needed or used > MEMORY_BINDS_ABOVE:
        why = " and ".join(needed) + " to fit" if needed else f"{used:.0%} used"
        return f"memory ({why})"
    overhead = [k for k in STEP_PARTS if k != "compute"]
    if sum(est.time[k] for k in overhead) < OVERHEAD_WORTH_NAMING * est.step_time:
        return "compute"
    part = max(overhead, key=est.time.get)
    name = _CONSTRAINT[part]
    axis = part.split("_")[0]
    if name.endswith("link") and est.links.get(axis, "none") != "none":
        name += f" ({est.links[axis]})"
    return f"{name} ({est.time[part] / est.step_time:.0%} of the step)"


def _split(layout: Layout) -> int:
    """How many ways the model's weights are split: every axis but data and context
    parallelism's (a cp rank holds the whole weights of its stage and tensor shard)."""
    return layout.world // (layout.dp * layout.cp)


def _reason(est: Estimate, smallest_split: int, best: dict) -> str:
    """One line: why this much splitting, where the tensor-parallel group sits, what binds."""
    split = _split(est.layout)
    cap = est.hardware.memory_bytes
    pure = "pure data parallelism" if est.layout.cp == 1 else "data and context parallelism"
    if split == 1 and est.zero:
        why = f"{pure}, the model state sharded by {est.sharding}"
    elif split == 1:
        why = (f"{pure}: a whole copy fits on one device "
               f"({est.memory_total / GB:.1f} of {cap / GB:.0f} GB)")
    elif split == smallest_split:
        why = f"the weights need {split}-way splitting to fit"
    else:
        rival = min((e for e in best.values() if _split(e.layout) == smallest_split),
                    key=lambda e: e.step_time)
        ratio = rival.step_time / est.step_time
        name = rival.name + (f" with {rival.sharding}" if rival.zero else "")
        if ratio > 1:
            gain = max(STEP_PARTS, key=lambda k: rival.time[k] - est.time[k])
            why = (f"splits {split} ways though {smallest_split} would fit: "
                   f"{_WHY_FASTER[gain]} than {name}, which is {ratio:.2f}x as slow")
        else:
            why = (f"splits {split} ways though {smallest_split} would fit "
                   f"({name} is {1 / ratio:.2f}x as fast)")
    parts = [f"{est.layout}: {why}"]
    if est.layout.tp > 1:
        parts.append("kept in one node" if est.links["tp"] == "intra-node"
                     else "tensor parallelism spans nodes")
    if est.layout.cp > 1:
        total = est.time["cp_comm_total"]
        hidden = est.time["cp_comm_hidden"] / total if total else 1.0
        parts.append(f"the sequence split {est.layout.cp} ways (activations / "
                     f"{est.layout.cp}, ring K/V {hidden:.0%} hidden behind attention)")
    if est.layout.ep > 1:
        parts.append(f"experts split {est.layout.ep} ways (all-to-alls "
                     f"{est.time['ep_comm'] / est.step_time:.0%} of the step, "
                     f"{est.links['ep']})")
    if est.layout.pp > 1:
        bubble = est.time["pp_bubble"] / est.step_time
        parts.append(f"m = {est.m}" + (f", v = {est.v}" if est.v > 1 else "")
                     + f": bubble {bubble:.0%}")
    if est.zero and split > 1:
        parts.append(f"{est.sharding} to fit")
    if est.recompute:
        kind = "full" if est.recompute is True else "selective"
        parts.append(f"{kind} recomputation" + (" to fit" if est.binding.startswith("memory (")
                                                 else ""))
    bound = max(STEP_PARTS, key=est.time.get)
    parts.append(f"{est.memory_total / cap:.0%} of memory{_spare_caution(est)}; "
                 f"{est.time[bound] / est.step_time:.0%} of the step is {bound}")
    if est.binding:
        parts.append(f"binds: {est.binding}")
    return "; ".join(parts)


@functools.cache
def _measured_beyond_count() -> tuple[float, float]:
    return beyond_count_gib()  # two estimates: worked out once, on first use


def _spare_caution(est: Estimate) -> str:
    """Where a layout leaves less memory to spare than measured peaks ran beyond the
    model's count (:func:`parlib.cost.held_out.beyond_count_gib`), a parenthesis saying
    so: the count says it fits, but it is one to try before promising it."""
    least, most = _measured_beyond_count()
    spare = (est.hardware.memory_bytes - est.memory_total) / GIB
    if spare >= least:
        return ""
    return (f" ({spare:.1f} GiB spare, where measured peaks ran {least:.1f}-{most:.1f} GiB "
            "over the count: try it before promising it)")


def experts_split_or_whole(model: Model, hardware: Hardware, *, global_batch: int
                           ) -> tuple[Estimate | None, Estimate | None]:
    """For a mixture of experts: the fastest layout that splits the experts (e > 1) and
    the fastest that keeps every expert on every rank of its group (e = 1, sharding them
    with ZeRO where they must be), each at its best setting (:func:`best_layouts`); None
    where no such layout fits. Splitting pays four all-to-alls per MoE layer; keeping them
    whole pays their whole gradient sync (and, under ZeRO-3, a gather of every expert for
    every microbatch): which is faster depends on the model, the batch and the links."""
    if not model.is_moe:
        raise ValueError(f"{model.name or 'the model'} has no experts to split")
    ranked = best_layouts(model, hardware, global_batch=global_batch, top=10**9)
    split = next((e for e in ranked if e.layout.ep > 1), None)
    whole = next((e for e in ranked if e.layout.ep == 1), None)
    return split, whole


__all__ = ["MAX_CP", "MEMORY_BINDS_ABOVE", "MIN_CP_POSITIONS", "OVERHEAD_WORTH_NAMING",
           "best_layouts", "binding_constraint", "candidate_layouts", "divisors",
           "experts_split_or_whole", "hsdp_shard_group"]
