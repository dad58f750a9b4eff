"""Published large training runs, to hold the cost model against: model, hardware, layout and
the utilisation each paper reported.

Only figures stated in the cited tables are used as reported values; everything the tables
do not say (microbatch size, interleaving, ZeRO stage, what is recomputed) is a modelling
choice, named in ``assumed``. The presets run at peak compute (``compute_efficiency`` 1),
so a prediction is an upper bound: reported / predicted is the efficiency of the real
kernels, which the cost model does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

from parlib.cost.estimate import Estimate, estimate
from parlib.cost.hardware import Hardware
from parlib.cost.layout import Layout
from parlib.cost.model import Model


@dataclass(frozen=True)
class PublishedRun:
    """One run: what the paper states, what we assume, and what it reported.

    ``metric`` is "hfu" when the paper's FLOP count includes recomputation (Megatron-LM's
    teraFLOP/s) and "mfu" when it does not (Llama 3's "BF16 MFU"). ``settings`` are
    :func:`~parlib.cost.estimate.estimate`'s keyword arguments (m, global_batch, ...).
    """

    name: str
    source: str
    model: Model
    hardware: Hardware
    layout: Layout
    settings: dict
    metric: str
    reported: float  # fraction of peak
    reported_tflops_per_device: float
    assumed: str
    reported_params: float | None = None  # billions, where the table states it

    def estimate(self) -> Estimate:
        return estimate(self.model, self.hardware, self.layout, **self.settings)

    def predicted(self, est: Estimate | None = None) -> float:
        """The model's figure for the paper's metric, at peak compute."""
        return getattr(est or self.estimate(), self.metric)


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM" (SC21). Sec. 5: GPT models with vocabulary 51,200 and sequence length
# 2048 on Selene, nodes of 8 80-GB A100s. Table 1 rows: parameters (billion), attention
# heads, hidden size, layers, t, p, GPUs, batch size, achieved teraFLOP/s per GPU and % of
# theoretical peak. Their FLOP count includes the forward that activation recomputation
# reruns, hence "hfu".
_MEGATRON = "Narayanan et al. 2021 (Megatron-LM), Table 1"
_MEGATRON_ASSUMED = ("microbatch 1 (not in the table); 1F1B without interleaving (v = 1); "
                     "full recomputation; no sequence parallelism (2021); no ZeRO")


def _megatron_row(billions: str, heads: int, hidden: int, layers: int, t: int, p: int,
                  gpus: int, batch: int, tflops: int, percent: int) -> PublishedRun:
    d = gpus // (t * p)
    return PublishedRun(
        name=f"GPT {billions}B, {gpus} A100",
        source=(f"{_MEGATRON}: {billions}B, {heads} heads, hidden {hidden}, {layers} layers, "
                f"t {t}, p {p}, {gpus} GPUs, batch {batch}, {tflops} teraFLOP/s per GPU, "
                f"{percent}% of peak"),
        model=Model(layers, hidden, heads, 2048, 51200, tied_embeddings=True, dropout=True,
                    name=f"GPT {billions}B"),
        hardware=Hardware.dgx_a100(gpus),
        layout=Layout(dp=d, tp=t, pp=p),
        settings=dict(m=batch // d, global_batch=batch, recompute=True,
                      sequence_parallel=False),
        metric="hfu", reported=percent / 100, reported_tflops_per_device=tflops,
        assumed=_MEGATRON_ASSUMED, reported_params=float(billions))


# Dubey et al. 2024, "The Llama 3 Herd of Models": Table 3 (405B: 126 layers, model
# dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads, vocabulary 128,000) and
# Table 4 (GPUs, TP, CP, PP, DP, sequence length 8192, batch size per DP, 16M tokens per
# batch, TFLOPs per GPU, BF16 MFU) on H100 80 GB nodes of 8.
_LLAMA = "Dubey et al. 2024 (Llama 3), Tables 3 and 4"
_LLAMA_405B = Model(128, 16384, 128, 8192, 128000, ffn_dim=53248, n_kv_heads=8,
                    gated_mlp=True, bias=False, learned_positions=False, name="Llama 3 405B")
_LLAMA_ASSUMED = ("128 layers, not 126, so that 16 stages divide them evenly (+1.6% params); "
                  "microbatch 1 (batch per DP = m); v = 1, so the bubble is an upper bound; "
                  "attention scores not stored (selective, as a fused attention kernel); "
                  "their FSDP modelled as ZeRO-2")


def _llama_row(gpus: int, dp: int, batch_per_dp: int, tflops: int, percent: int
               ) -> PublishedRun:
    return PublishedRun(
        name=f"Llama 3 405B, {gpus} H100",
        source=(f"{_LLAMA}: {gpus} GPUs, TP 8, CP 1, PP 16, DP {dp}, seq 8192, batch/DP "
                f"{batch_per_dp}, {tflops} TFLOPs/GPU, {percent}% BF16 MFU"),
        model=_LLAMA_405B,
        hardware=Hardware.dgx_h100(gpus),
        layout=Layout(dp=dp, tp=8, pp=16),
        settings=dict(m=batch_per_dp, global_batch=dp * batch_per_dp, zero=2,
                      recompute="selective"),
        metric="mfu", reported=percent / 100, reported_tflops_per_device=tflops,
        assumed=_LLAMA_ASSUMED)


RUNS = (
    _megatron_row("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    _megatron_row("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    _megatron_row("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
    _llama_row(8192, 64, 32, 430, 43),
    _llama_row(16384, 128, 16, 400, 41),
)


def comparison_table(runs: tuple[PublishedRun, ...] = RUNS) -> str:
    """Predicted (at peak compute) next to reported, one row per run."""
    rows = [f"{'run':<26} {'fits':<5} {'GB/dev':>7} {'metric':<6} {'predicted':>9} "
            f"{'reported':>8} {'reported/predicted':>18}"]
    for run in runs:
        est = run.estimate()
        pred = run.predicted(est)
        rows.append(f"{run.name:<26} {str(est.fits):<5} {est.memory_total / 1e9:>7.1f} "
                    f"{run.metric:<6} {pred:>9.0%} {run.reported:>8.0%} "
                    f"{run.reported / pred:>18.2f}")
    return "\n".join(rows)


__all__ = ["RUNS", "PublishedRun", "comparison_table"]
