"""llm-foundry's sweeps of the sequence length, in no fit: where attention is most of the
work, does the cost model still account for the step?

Source: mosaicml/llm-foundry, ``scripts/train/benchmarking/README.md``, every row of its A100
40GB, A100 80GB and H100 bf16 tables at a sequence length other than 2048 (512 to 65,536
tokens; all on one node of 8 GPUs, FSDP ``FULL_SHARD``; MP ``PURE`` on the A100 40GB table,
``DEFAULT`` on the others), read as :func:`~parlib.cost.foundry.foundry_run` reads the rows
at 2048. MFU counts attention's FLOPs in full (12 x L x s x h a token, as llm-foundry's own
MFU does), and the model runs them at its matmul rate, as batched (s, head_dim, s) matmuls.

None of these rows is in a fit (:mod:`parlib.cost.calibration`). :func:`sequence_table`
prints, per table, reported / predicted by attention's share of the FLOPs: on the A100s the
model charges small models at long sequences too much and large ones about right; on the
H100s it charges too little, the more so the larger attention's share (the runs there fell
as the sequence grew, where the model's MFU rises). :func:`attention_caution` says so beside
any prediction whose attention share is beyond what the fitted rows of its generation held,
with the band these rows came in at.
"""

from __future__ import annotations

from dataclasses import replace

from parlib.cost.estimate import Estimate
from parlib.cost.foundry import foundry_run, low_median_high, published_rows
from parlib.cost.model import Model
from parlib.cost.published import TARGET_BAND, PublishedRun

GPUS = 8
# (size, sequence, microbatch, grad accum, global batch, T/s/GPU, activation checkpointing)
SEQUENCE_ROWS = {
    "A100": (
        ('13b', 512, 16, 16, 2048, 1763, True), ('13b', 1024, 8, 16, 1024, 1727, True),
        ('13b', 4096, 2, 16, 256, 1603, True), ('13b', 8192, 1, 16, 128, 1407, True),
        ('7b', 512, 48, 4, 1536, 3895, True), ('7b', 1024, 24, 4, 768, 3854, True),
        ('7b', 4096, 6, 4, 192, 3366, True), ('7b', 8192, 3, 4, 96, 2887, True),
        ('7b', 16384, 1, 4, 32, 2249, True), ('3b', 512, 20, 8, 1280, 11324, False),
        ('3b', 1024, 10, 8, 640, 10731, False), ('3b', 4096, 2, 8, 128, 8777, False),
        ('3b', 8192, 1, 8, 64, 7149, False), ('3b', 16384, 2, 8, 128, 4465, True),
        ('3b', 32768, 1, 4, 32, 2955, True), ('1b', 512, 32, 8, 2048, 21782, False),
        ('1b', 1024, 16, 8, 1024, 20959, False), ('1b', 4096, 4, 8, 256, 16856, False),
        ('1b', 8192, 2, 8, 128, 13474, False), ('1b', 16384, 1, 8, 64, 9715, False),
        ('1b', 32768, 1, 4, 32, 5095, True), ('760m', 512, 48, 4, 1536, 34938, False),
        ('760m', 1024, 24, 4, 768, 33422, False), ('760m', 4096, 6, 4, 192, 25863, False),
        ('760m', 8192, 3, 4, 96, 20106, False), ('760m', 16384, 1, 4, 32, 13914, False),
        ('760m', 32768, 1, 4, 32, 7183, True), ('350m', 512, 64, 4, 2048, 66284, False),
        ('350m', 1024, 32, 4, 1024, 62523, False), ('350m', 4096, 8, 4, 256, 46833, False),
        ('350m', 8192, 4, 4, 128, 34933, False), ('350m', 16384, 2, 4, 64, 22896, False),
        ('350m', 32768, 1, 4, 32, 13416, False), ('125m', 512, 104, 3, 2496, 156735, False),
        ('125m', 1024, 52, 3, 1248, 148289, False), ('125m', 4096, 13, 3, 312, 115162, False),
        ('125m', 8192, 5, 3, 120, 86858, False), ('125m', 16384, 2, 3, 48, 55484, False),
        ('125m', 32768, 1, 4, 32, 32651, False),
    ),
    "A100 80GB": (
        ('30b', 512, 12, 21, 2016, 967, True), ('30b', 1024, 6, 21, 1008, 946, True),
        ('30b', 4096, 1, 21, 168, 814, True), ('30b', 8192, 1, 21, 168, 574, True),
        ('13b', 1024, 40, 3, 960, 2330, True), ('13b', 4096, 10, 3, 240, 2060, True),
        ('13b', 8192, 5, 3, 120, 1795, True), ('13b', 16384, 3, 3, 72, 1431, True),
        ('13b', 32768, 1, 3, 24, 1016, True), ('7b', 1024, 64, 2, 1024, 4357, True),
        ('7b', 4096, 16, 2, 256, 3684, True), ('7b', 8192, 8, 2, 128, 3206, True),
        ('7b', 16384, 4, 2, 64, 2453, True), ('7b', 32768, 2, 2, 32, 1672, True),
        ('7b', 65536, 1, 2, 16, 1013, True), ('3b', 512, 40, 6, 1920, 12127, False),
        ('3b', 1024, 20, 6, 960, 11580, False), ('3b', 4096, 5, 6, 240, 9457, False),
        ('3b', 8192, 3, 6, 144, 7695, False), ('3b', 16384, 1, 6, 48, 5529, False),
        ('3b', 32768, 3, 6, 144, 3029, True), ('3b', 65536, 1, 2, 16, 1767, True),
        ('1b', 512, 56, 4, 1792, 23148, False), ('1b', 1024, 18, 4, 576, 22112, False),
        ('1b', 4096, 7, 4, 224, 17807, False), ('1b', 8192, 3, 4, 96, 13814, False),
        ('1b', 16384, 2, 4, 64, 9956, False), ('1b', 32768, 1, 4, 32, 6275, False),
        ('1b', 65536, 1, 2, 16, 3044, True), ('760m', 512, 96, 2, 1536, 29446, False),
        ('760m', 1024, 48, 2, 768, 29765, False), ('760m', 4096, 12, 2, 192, 27351, False),
        ('760m', 8192, 6, 2, 96, 20933, False), ('760m', 16384, 3, 2, 48, 14274, False),
        ('760m', 32768, 1, 2, 16, 8802, False), ('760m', 65536, 1, 2, 16, 4143, True),
        ('350m', 512, 128, 2, 2048, 69330, False), ('350m', 1024, 64, 2, 1024, 64813, False),
        ('350m', 4096, 16, 2, 256, 49555, False), ('350m', 8192, 8, 2, 128, 36569, False),
        ('350m', 16384, 4, 2, 64, 23559, False), ('350m', 32768, 2, 2, 32, 13652, False),
        ('350m', 65536, 1, 2, 16, 7524, False), ('125m', 512, 128, 2, 2048, 165681, False),
        ('125m', 1024, 64, 2, 1024, 156468, False), ('125m', 4096, 16, 2, 256, 118396, False),
        ('125m', 8192, 8, 2, 128, 90392, False), ('125m', 16384, 4, 2, 64, 60040, False),
        ('125m', 32768, 2, 2, 32, 36407, False), ('125m', 65536, 1, 2, 16, 20368, False),
    ),
    "H100": (
        ('30b', 1024, 6, 21, 1008, 2084, True), ('30b', 4096, 1, 21, 168, 1802, True),
        ('30b', 8192, 1, 21, 168, 1384, True), ('13b', 1024, 40, 3, 960, 5502, True),
        ('13b', 4096, 10, 3, 240, 4717, True), ('13b', 16384, 3, 3, 72, 2985, True),
        ('13b', 32768, 1, 3, 24, 1976, True), ('7b', 1024, 64, 2, 1024, 10203, True),
        ('7b', 4096, 16, 2, 256, 8611, True), ('7b', 8192, 8, 2, 128, 6935, True),
        ('7b', 32768, 2, 2, 32, 3318, True), ('7b', 65536, 1, 2, 16, 1956, True),
        ('3b', 512, 40, 6, 1920, 27965, False), ('3b', 1024, 20, 6, 960, 27046, False),
        ('3b', 4096, 5, 6, 240, 20964, False), ('3b', 8192, 3, 6, 144, 16578, False),
        ('3b', 16384, 1, 6, 48, 11152, False), ('3b', 32768, 3, 6, 144, 5873, True),
        ('3b', 65536, 1, 2, 16, 3262, True), ('1b', 512, 56, 4, 1792, 52275, False),
        ('1b', 1024, 18, 4, 576, 48910, False), ('1b', 4096, 7, 4, 224, 38535, False),
        ('1b', 8192, 3, 4, 96, 29157, False), ('1b', 16384, 2, 4, 64, 19649, False),
        ('1b', 32768, 1, 4, 32, 12025, False), ('1b', 65536, 1, 2, 16, 5506, True),
        ('760m', 512, 96, 2, 1536, 83749, False), ('760m', 1024, 48, 2, 768, 78581, False),
        ('760m', 4096, 12, 2, 192, 55459, False), ('760m', 8192, 6, 2, 96, 41825, False),
        ('760m', 16384, 3, 2, 48, 27815, False), ('760m', 32768, 1, 2, 16, 16291, False),
    ),
}


def sequence_run(table: str, size: str, seq_len: int, micro: int, accum: int, batch: int,
                 tokens_per_gpu: int, checkpointing: bool) -> PublishedRun:
    """A row of ``table`` ("A100", the 40GB table; "A100 80GB"; "H100") at ``seq_len``."""
    run = foundry_run(size, GPUS, micro, accum, batch, tokens_per_gpu, checkpointing, table,
                      seq_len=seq_len)
    return replace(run, name=f"MPT {size}, {GPUS} {table}, seq {seq_len}")


# Not in FOUNDRY_RUNS: no fit of the training shares sees them.
SEQUENCE_RUNS = {table: tuple(sequence_run(table, *row) for row in rows)
                 for table, rows in SEQUENCE_ROWS.items()}
# Attention's share of the FLOPs, in buckets: [0, 0.1), [0.1, 0.25), [0.25, 0.5), [0.5, 1)
# (a model with weights spends some FLOPs on them: the share is below 1)
SHARE_EDGES = (0.0, 0.1, 0.25, 0.5, 1.0)


def attention_share(model: Model) -> float:
    """Attention's share of a model's FLOPs a token: 4 x L x s x h of the forward's."""
    return model.attention_flops_per_token / model.forward_flops_per_token


def _band(runs: list[PublishedRun]) -> tuple[float, float, float]:
    return low_median_high([run.ratio() for run in runs])


def share_bands(runs: tuple[PublishedRun, ...]
                ) -> list[tuple[float, float, int, tuple[float, float, float]]]:
    """Per bucket of attention share (:data:`SHARE_EDGES`) holding rows: (from, to, rows,
    (lowest, median, highest) reported / predicted)."""
    out = []
    for low, high in zip(SHARE_EDGES, SHARE_EDGES[1:]):
        inside = [run for run in runs if low <= attention_share(run.model) < high]
        if inside:
            out.append((low, high, len(inside), _band(inside)))
    return out


def fitted_attention_share(generation: str) -> float:
    """The largest attention share among the rows the ``generation``'s shares are fitted to
    (:func:`~parlib.cost.foundry.published_rows`): how far the fit was tested."""
    return max(attention_share(run.model) for run in published_rows(generation))


def beyond_fitted(generation: str) -> list[PublishedRun]:
    """These rows on ``generation`` (both A100 tables for "A100") whose attention share is
    above :func:`fitted_attention_share`."""
    tested = fitted_attention_share(generation)
    return [run for runs in SEQUENCE_RUNS.values() for run in runs
            if run.hardware.generation == generation and attention_share(run.model) > tested]


def _beyond(est: Estimate) -> tuple[list[PublishedRun], tuple[float, float, float]] | None:
    """For a prediction whose attention share is beyond its generation's fitted rows, with
    rows here beyond them too: (those rows, their lowest, median and highest reported /
    predicted); None otherwise."""
    generation = est.hardware.generation
    if attention_share(est.model) <= fitted_attention_share(generation):
        return None
    rows = beyond_fitted(generation)
    return (rows, _band(rows)) if rows else None


def attention_held(est: Estimate) -> tuple[float, float] | None:
    """For a prediction whose attention share is beyond its generation's fitted rows (and
    with rows here beyond them too): its MFU held to the band those rows came in at
    (lowest, highest); None otherwise."""
    beyond = _beyond(est)
    if beyond is None:
        return None
    _, (low, _, high) = beyond
    return low * est.mfu, high * est.mfu


def attention_caution(est: Estimate) -> str:
    """A sentence for a prediction whose attention share is beyond what its generation's
    fitted rows held (:func:`attention_held`); "" for any other."""
    beyond = _beyond(est)
    if beyond is None:
        return ""
    rows, (low, median, high) = beyond
    generation = est.hardware.generation
    return (f"Attention is {attention_share(est.model):.0%} of this model's FLOPs, beyond the "
            f"{fitted_attention_share(generation):.0%} of any run the {generation} shares are "
            f"fitted to; llm-foundry's {generation} runs beyond it ({len(rows)}, one node, "
            f"sequences of up to {max(r.model.seq_len for r in rows):,} tokens) reached "
            f"{low:.2f}-{high:.2f} of what the model predicts for them (median {median:.2f}); "
            f"held to that band this one is {low * est.mfu:.0%}-{high * est.mfu:.0%} MFU.")


def sequence_table(band: tuple[float, float] = TARGET_BAND) -> str:
    """Per table: reported / predicted (lowest, median, highest) in each bucket of attention
    share, and how many rows lie in ``band``; then each generation's fitted share."""
    lines = [f"{'table':<10} {'attention share':>15} {'rows':>4} {'reported/predicted':>25}"]
    for table, runs in SEQUENCE_RUNS.items():
        for low, high, count, (least, median, most) in share_bands(runs):
            lines.append(f"{table:<10} {low:>6.0%} to {high:<5.0%} {count:>4} "
                         f"{least:>6.2f} {median:>6.2f} (median) {most:>5.2f}")
        inside = sum(band[0] <= run.ratio() <= band[1] for run in runs)
        lines.append(f"{table:<10} {inside} of {len(runs)} rows within reported/predicted "
                     f"{band[0]:g}-{band[1]:g}")
    for generation in ("A100", "H100"):
        lines.append(f"the {generation} shares are fitted to rows with attention at most "
                     f"{fitted_attention_share(generation):.0%} of the FLOPs")
    return "\n".join(lines)


__all__ = ["GPUS", "SEQUENCE_ROWS", "SEQUENCE_RUNS", "SHARE_EDGES", "attention_caution",
           "attention_held", "attention_share", "beyond_fitted", "fitted_attention_share",
           "sequence_run", "sequence_table", "share_bands"]
