"""A layout experts avoid, measured beside the one they chose: ZeRO-3 without model
parallelism against Megatron-LM's PTD-P on the same GPUs, held against the cost model.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21), Sec. 5.2 and Table 2: GPT models of 174.6 and 529.6
billion parameters on Selene (DGX A100 80 GB nodes, eight 200 Gb/s HDR NICs each), the same
global batch for both schemes as the GPU count doubles. Columns used: parameters,
model-parallel size, batch size, GPUs, microbatch size, achieved teraFLOP/s per GPU. The
paper's FLOP count includes the forward that recomputation reruns, so the metric is HFU (of
312 TFLOP/s). ZeRO-3 ran in DeepSpeed with no tensor or pipeline parallelism; its 529.6B run
needed 640 GPUs and a batch of 2560 to fit (the table's starred row).

None of these rows is in the fit of the training shares (:mod:`parlib.cost.calibration`):
they test the model where it is least sure, not where it was tuned. :func:`pairs` holds each
ZeRO-3 row beside the PTD-P row of the same model and GPU count (the 529.6B ZeRO-3 run on 640
GPUs beside PTD-P's on 560) and asks whether the model orders them as measured;
:func:`zero3_band` is the range of reported / predicted over the ZeRO-3 rows, which the
lessons print beside any ZeRO-3 layout that spans nodes.
"""

from __future__ import annotations

from collections.abc import Callable

from parlib.cost.estimate import Estimate
from parlib.cost.hardware import Hardware
from parlib.cost.layout import Layout
from parlib.cost.published import PublishedRun, _gpt

_SOURCE = "Narayanan et al. 2021 (Megatron-LM), Sec. 5.2, Table 2"
_SHAPES = {"174.6": (96, 12288, 96), "529.6": (128, 20480, 105)}  # heads, hidden, layers
# (billions, GPUs, batch, microbatch, teraFLOP/s per GPU)
ZERO3_ROWS = (("174.6", 384, 1536, 4, 144), ("174.6", 768, 1536, 2, 88),
              ("174.6", 1536, 1536, 1, 44), ("529.6", 640, 2560, 4, 138),
              ("529.6", 1120, 2240, 2, 98), ("529.6", 2240, 2240, 1, 48))
# (billions, model-parallel size, GPUs, batch, teraFLOP/s per GPU); microbatch 1
PTDP_ROWS = (("174.6", 96, 384, 1536, 153), ("174.6", 96, 768, 1536, 149),
             ("174.6", 96, 1536, 1536, 141), ("529.6", 280, 560, 2240, 171),
             ("529.6", 280, 1120, 2240, 167), ("529.6", 280, 2240, 2240, 159))
_UNKNOWN = ("DeepSpeed ZeRO-3's 2021 implementation: how it grouped its gathers (per "
            "parameter or per bucket), which NCCL channels and NICs they used, and how much "
            "of them overlapped compute")


def zero3_run(billions: str, gpus: int, batch: int, micro_batch: int,
              tflops: int) -> PublishedRun:
    """A ZeRO-3 row: pure data parallelism over every GPU, full recomputation."""
    heads, hidden, layers = _SHAPES[billions]
    return PublishedRun(
        name=f"ZeRO-3 {billions}B, {gpus} A100",
        source=(f"{_SOURCE}: ZeRO-3 without model parallelism, {billions}B, {gpus} GPUs, "
                f"batch {batch}, microbatch {micro_batch}, {tflops} teraFLOP/s per GPU"),
        model=_gpt(billions, heads, hidden, layers), hardware=Hardware.dgx_a100(gpus),
        layout=Layout(dp=gpus),
        settings=dict(m=batch // (gpus * micro_batch), global_batch=batch, zero=3,
                      recompute=True, sequence_parallel=False, loss="in_place"),
        metric="hfu", reported=tflops / 312, reported_tflops_per_device=tflops,
        assumed="full recomputation, fp16 gradients reduced in fp16, one unit a layer",
        cannot_know=_UNKNOWN, reported_params=float(billions))


def ptdp_run(billions: str, model_parallel: int, gpus: int, batch: int,
             tflops: int) -> PublishedRun:
    """A PTD-P row: t = 8 in each node, p = model-parallel size / 8, microbatch 1."""
    heads, hidden, layers = _SHAPES[billions]
    p, d = model_parallel // 8, gpus // model_parallel
    return PublishedRun(
        name=f"PTD-P {billions}B, {gpus} A100",
        source=(f"{_SOURCE}: PTD parallelism, {billions}B, model-parallel size "
                f"{model_parallel}, {gpus} GPUs, batch {batch}, microbatch 1, {tflops} "
                "teraFLOP/s per GPU"),
        model=_gpt(billions, heads, hidden, layers), hardware=Hardware.dgx_a100(gpus),
        layout=Layout(dp=d, tp=8, pp=p),
        settings=dict(m=batch // d, global_batch=batch, recompute=True,
                      sequence_parallel=False, loss="in_place"),
        metric="hfu", reported=tflops / 312, reported_tflops_per_device=tflops,
        assumed="t = 8 (a node), p = model-parallel size / 8, 1F1B (v = 1: not stated)",
        cannot_know="the schedule's interleaving (not in Table 2)",
        reported_params=float(billions))


ZERO3_RUNS = tuple(zero3_run(*row) for row in ZERO3_ROWS)
PTDP_RUNS = tuple(ptdp_run(*row) for row in PTDP_ROWS)


def pairs() -> list[tuple[PublishedRun, PublishedRun]]:
    """Each ZeRO-3 row with the PTD-P row of its model at its GPU count (the 529.6B ZeRO-3
    run on 640 GPUs with PTD-P's on 560, the nearest)."""
    out = []
    for z in ZERO3_RUNS:
        same = [r for r in PTDP_RUNS if r.reported_params == z.reported_params]
        out.append((z, min(same, key=lambda r: abs(r.layout.world - z.layout.world))))
    return out


def zero3_band() -> tuple[float, float]:
    """(lowest, highest) reported / predicted over the ZeRO-3 rows."""
    ratios = [run.ratio() for run in ZERO3_RUNS]
    return min(ratios), max(ratios)


def ordered_as_measured(
        as_run: Callable[[PublishedRun], PublishedRun] = lambda run: run) -> int:
    """How many of :func:`pairs` the model orders as measured (the faster scheme predicted
    faster), each run first passed through ``as_run`` (for instance one that slows its
    network; by default the runs as they are)."""
    return sum((z.reported > p.reported) == (as_run(z).estimate().hfu > as_run(p).estimate().hfu)
               for z, p in pairs())


def pairs_table() -> str:
    """Per pair: each scheme's reported / predicted, and ZeRO-3's rate over PTD-P's as
    measured and as predicted; then how many pairs the model orders as measured."""
    rows = [f"{'model, GPUs (ZeRO-3 / PTD-P)':<30} {'ZeRO-3 r/p':>10} {'PTD-P r/p':>9} "
            f"{'ZeRO-3/PTD-P measured':>21} {'predicted':>9}"]
    for z, p in pairs():
        ez, ep = z.estimate(), p.estimate()
        measured, predicted = z.reported / p.reported, ez.hfu / ep.hfu
        label = f"{z.reported_params}B, {z.layout.world} / {p.layout.world}"
        rows.append(f"{label:<30} {z.ratio(ez):>10.2f} {p.ratio(ep):>9.2f} "
                    f"{measured:>21.2f} {predicted:>9.2f}")
    low, high = zero3_band()
    rows.append(f"the model orders {ordered_as_measured()} of {len(ZERO3_RUNS)} pairs as "
                f"measured; ZeRO-3 "
                f"reported / predicted {low:.2f}-{high:.2f}")
    return "\n".join(rows)


def ptdp_band() -> tuple[float, float]:
    """(lowest, highest) reported / predicted over the PTD-P rows run beside them."""
    ratios = [run.ratio() for run in PTDP_RUNS]
    return min(ratios), max(ratios)


def zero3_held(est: Estimate) -> tuple[float, float] | None:
    """For a ZeRO-3 layout whose data-parallel ranks span nodes (not HSDP): its predicted MFU
    held to :func:`zero3_band`, (lowest, highest); None for any other layout."""
    if est.zero != 3 or est.shard_group or est.links.get("dp") != "inter-node":
        return None
    low, high = zero3_band()
    return low * est.mfu, high * est.mfu


def zero3_caution(est: Estimate) -> str:
    """For a ZeRO-3 layout whose data-parallel ranks span nodes (not HSDP): a sentence with
    the band the published ZeRO-3 rows came in at and how many of their pairs the model
    ordered as measured; "" for any other layout."""
    held = zero3_held(est)
    if held is None:
        return ""
    low, high = zero3_band()
    agree = ordered_as_measured()
    gpus = [run.layout.world for run in ZERO3_RUNS]
    return (f"ZeRO-3 across nodes is where the model is least sure: the published ZeRO-3 runs "
            f"of {min(gpus)}-{max(gpus)} A100s (Narayanan et al. 2021, Table 2) reached "
            f"{low:.2f}-{high:.2f} "
            f"of what it predicts for them, and it orders {agree} of {len(ZERO3_RUNS)} of "
            f"them as measured against the 3-D layout run beside them (parlib.cost.avoided); "
            f"held to that band this one is {held[0]:.0%}-{held[1]:.0%} MFU.")


__all__ = ["PTDP_ROWS", "PTDP_RUNS", "ZERO3_ROWS", "ZERO3_RUNS", "ordered_as_measured",
           "pairs", "pairs_table",
           "ptdp_band", "ptdp_run", "zero3_band", "zero3_caution", "zero3_held", "zero3_run"]
