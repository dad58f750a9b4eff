"""Published large training runs, to hold the cost model against: model, hardware, layout and
the utilisation each source reported.

Only figures stated in the cited tables are used as reported values; everything a table
does not say (microbatch size, interleaving, ZeRO stage, what is recomputed) is a modelling
choice, named in ``assumed``; what the model cannot know about a run is in ``cannot_know``.
The hardware presets run at their generation's achievable matmul fraction
(:mod:`parlib.cost.efficiency`: one number per device generation, never per run), so
reported / predicted near 1 means the model accounts for where the time went, below 1 that
it is too optimistic, above 1 that it charges the run for more than it paid.

:func:`comparison_table` prints predicted next to reported for :data:`RUNS`;
:func:`agreement` counts the runs whose ratio lies in a band.
"""

from __future__ import annotations

from dataclasses import dataclass

from parlib.cost.estimate import Estimate, estimate
from parlib.cost.hardware import Hardware
from parlib.cost.launches import SERIAL_LAUNCH_SECONDS_PER_LAYER
from parlib.cost.layout import Layout
from parlib.cost.model import Model

# The band the course asks for: reported / predicted within 0.8-1.25 (a factor 1.25 either way).
TARGET_BAND = (0.8, 1.25)


@dataclass(frozen=True)
class PublishedRun:
    """One run: what the source states, what we assume, and what it reported.

    ``metric`` is "hfu" when the source's FLOP count includes recomputation (Megatron-LM's
    teraFLOP/s) and "mfu" when it does not (Llama 3's "BF16 MFU"). ``settings`` are
    :func:`~parlib.cost.estimate.estimate`'s keyword arguments (m, global_batch, ...).
    ``reported`` is the fraction of the datasheet peak; the source's own rate comes with it
    as TFLOP/s per device or tokens/s per device where it states one (None where not).
    """

    name: str
    source: str
    model: Model
    hardware: Hardware
    layout: Layout
    settings: dict
    metric: str
    reported: float  # fraction of datasheet peak
    reported_tflops_per_device: float | None
    assumed: str
    cannot_know: str
    reported_params: float | None = None  # billions, where the table states it
    reported_tokens_per_second_per_device: float | None = None

    def __post_init__(self) -> None:
        if self.metric not in ("mfu", "hfu"):
            raise ValueError(f"{self.name}: metric must be 'mfu' or 'hfu', got {self.metric!r}")
        if not 0 < self.reported < 1:
            raise ValueError(f"{self.name}: reported must be a fraction of peak in (0, 1), "
                             f"got {self.reported!r}")

    def estimate(self) -> Estimate:
        return estimate(self.model, self.hardware, self.layout, **self.settings)

    def predicted(self, est: Estimate | None = None) -> float:
        """The model's figure for the source's metric (a fraction of datasheet peak)."""
        return getattr(est or self.estimate(), self.metric)

    def ratio(self, est: Estimate | None = None) -> float:
        """Reported / predicted: 1 when the model accounts for the run's time exactly."""
        return self.reported / self.predicted(est)


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM" (SC21). Sec. 5: GPT models with vocabulary 51,200 and sequence length
# 2048 on Selene, nodes of 8 80-GB A100s. Table 1 rows: parameters (billion), attention
# heads, hidden size, layers, t, p, GPUs, batch size, achieved teraFLOP/s per GPU and % of
# theoretical peak. Their FLOP count includes the forward that activation recomputation
# reruns, hence "hfu". The microbatch size and the layers per virtual pipeline stage (hence v)
# are not in the table; they are in the paper's scripts, Megatron-LM examples/sc21/
# run_table_1.sh (MBS; --num-layers-per-virtual-pipeline-stage): 76B MBS 2, 5 layers per
# virtual stage (v = 60 / 4 / 5 = 3); 145B MBS 2, 5 layers (v = 80 / 8 / 5 = 2); 1T MBS 1,
# no interleaving. (With microbatch 1 and v = 1 throughout, which these rows assumed before,
# the model gave 0.89, 0.88, 0.84 of reported / predicted.)
_MEGATRON = "Narayanan et al. 2021 (Megatron-LM), Table 1"
_MEGATRON_SCRIPT = "Megatron-LM examples/sc21/run_table_1.sh"
_MEGATRON_ASSUMED = ("full recomputation (the script's --recompute-method uniform); no sequence "
                     "parallelism (2021); no ZeRO")
_MEGATRON_UNKNOWN = ("what the memory-bound kernels (softmax, GeLU, LayerNorm, dropout) of 2021 "
                     "cost, and how much of the interleaved schedule's extra messages overlapped")


def _gpt(billions: str, heads: int, hidden: int, layers: int) -> Model:
    """Megatron-LM's GPT shapes: vocabulary 51,200, sequence 2048, tied embeddings."""
    return Model(layers, hidden, heads, 2048, 51200, tied_embeddings=True, dropout=True,
                 name=f"GPT {billions}B")


def _megatron_row(billions: str, heads: int, hidden: int, layers: int, t: int, p: int,
                  gpus: int, batch: int, tflops: int, percent: int, micro_batch: int,
                  layers_per_chunk: int | None) -> PublishedRun:
    """A Table 1 row; ``micro_batch`` and ``layers_per_chunk`` (None: not interleaved) are
    the paper's script's."""
    d = gpus // (t * p)
    v = 1 if layers_per_chunk is None else layers // p // layers_per_chunk
    interleaving = (f", {layers_per_chunk} layers per virtual stage (v = {v})"
                    if layers_per_chunk else ", not interleaved")
    return PublishedRun(
        name=f"GPT {billions}B, {gpus} A100",
        source=(f"{_MEGATRON}: {billions}B, {heads} heads, hidden {hidden}, {layers} layers, "
                f"t {t}, p {p}, {gpus} GPUs, batch {batch}, {tflops} teraFLOP/s per GPU, "
                f"{percent}% of peak; {_MEGATRON_SCRIPT}: MBS {micro_batch}{interleaving}"),
        model=_gpt(billions, heads, hidden, layers),
        hardware=Hardware.dgx_a100(gpus),
        layout=Layout(dp=d, tp=t, pp=p),
        settings=dict(m=batch // (d * micro_batch), global_batch=batch, recompute=True,
                      sequence_parallel=False, v=v, loss="in_place"),
        metric="hfu", reported=percent / 100, reported_tflops_per_device=tflops,
        assumed=_MEGATRON_ASSUMED, cannot_know=_MEGATRON_UNKNOWN,
        reported_params=float(billions))


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
# (MLSys 2023). The MFU and HFU of the 22B, 175B, 530B and 1T models with sequence
# parallelism and selective recomputation, as the Megatron-LM README's table repeats them
# ("measured using a data parallel size of one"), on A100 80 GB. The shapes and batch sizes
# are the paper's Table 3 configurations: GPT shapes of Megatron-LM (vocabulary 51,200,
# sequence 2048), t = 8 throughout, GPUs = t x p (d = 1).
_KORTHIKANTI = ("Korthikanti et al. 2022 (selective recomputation), Table 3 configuration; "
                "MFU/HFU as in the Megatron-LM README")
_KORTHIKANTI_ASSUMED = ("microbatch 1 (m = global batch, since d = 1); v = 1; the global "
                        "batches (4, 64, 280, 512) are Table 3's as recalled, not re-checked "
                        "against the paper here; no ZeRO (d = 1)")
_KORTHIKANTI_UNKNOWN = ("whether the 530B and 1T runs interleaved their pipeline, and how "
                        "much of the 1-node 22B run's step the unfused small kernels took")


def _korthikanti_row(billions: str, heads: int, hidden: int, layers: int, p: int,
                     batch: int, mfu: float, hfu: float) -> PublishedRun:
    gpus = 8 * p
    return PublishedRun(
        name=f"GPT {billions} sel., {gpus} A100",
        source=(f"{_KORTHIKANTI}: {billions}, {heads} heads, hidden {hidden}, {layers} "
                f"layers, t 8, p {p}, {gpus} GPUs, batch {batch}; MFU {mfu}%, HFU {hfu}%"),
        model=_gpt(billions, heads, hidden, layers),
        hardware=Hardware.dgx_a100(gpus),
        layout=Layout(dp=1, tp=8, pp=p),
        settings=dict(m=batch, global_batch=batch, recompute="selective",
                      sequence_parallel=True, loss="in_place"),
        metric="mfu", reported=mfu / 100, reported_tflops_per_device=None,
        assumed=_KORTHIKANTI_ASSUMED, cannot_know=_KORTHIKANTI_UNKNOWN)


# Dubey et al. 2024, "The Llama 3 Herd of Models": Table 3 (405B: 126 layers, model
# dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads, vocabulary 128,000) and
# Table 4 (GPUs, TP, CP, PP, DP, sequence length, batch size per DP, tokens per batch,
# TFLOPs per GPU, BF16 MFU) on H100 80 GB nodes of 8.
# Sec. 3.3.2 says the run interleaved its pipeline (Narayanan et al. 2021's schedule, V stages
# on each pipeline rank; Figure 6 draws V = 2: rank 0 runs stages 0 and 4), but neither the
# text nor Table 4 states the V it trained with. The rows take Figure 6's v = 2 (the L = 126
# layers in 32 chunks by the same rule) where the model's memory says it fits, and v = 1
# where it does not: the 8,192-GPU row holds 32 microbatches, and Megatron's interleaved
# warm-up would keep 47 chunks in flight on a stage (103 GB). At v = 1 the 16,384-GPU rows
# came out 1.27 and 1.21 of reported / predicted, at v = 2 0.97 and 0.92 (at v = 3, fits
# aside, the three rows would give 0.81, 0.88 and 0.83).
_LLAMA = "Dubey et al. 2024 (Llama 3), Tables 3 and 4"
_LLAMA_ASSUMED = ("126 layers in 16 stages, the first and last one layer short (the paper's "
                  "rule); microbatch 1 (batch per DP = m); {chunks}; attention scores not "
                  "stored (selective, as a fused attention kernel); their FSDP modelled as ZeRO-2")
# The chunks per rank the rows assume: Figure 6's, the smallest interleaving.
LLAMA_CHUNKS = 2
_LLAMA_UNKNOWN = ("the paper's tuned pipeline schedule: its chunks per rank V (unstated), its "
                  "flexible number of microbatches per round, and the stage inputs and outputs "
                  "it frees early, which change both the bubble and what a stage holds")


def _llama_405b(seq_len: int) -> Model:
    return Model(126, 16384, 128, seq_len, 128000, ffn_dim=53248, n_kv_heads=8,
                 gated_mlp=True, bias=False, learned_positions=False, name="Llama 3 405B")


def _llama_row(gpus: int, cp: int, dp: int, seq_len: int, batch_per_dp: int, tflops: int,
               percent: int) -> PublishedRun:
    context = f", CP {cp}" if cp > 1 else ""
    model, hardware = _llama_405b(seq_len), Hardware.dgx_h100(gpus)
    layout = Layout(dp=dp, cp=cp, tp=8, pp=16)
    settings = dict(m=batch_per_dp, global_batch=dp * batch_per_dp, zero=2,
                    recompute="selective", v=LLAMA_CHUNKS, loss="in_place")
    chunks = f"interleaved, v = {LLAMA_CHUNKS} chunks per rank (Figure 6's; V is not stated)"
    if not estimate(model, hardware, layout, **settings).fits:
        settings["v"] = 1
        chunks = (f"v = 1: at v = {LLAMA_CHUNKS} the model's memory says a stage would not "
                  f"hold its {batch_per_dp} microbatches' chunks in flight, so the bubble is "
                  "an upper bound")
    return PublishedRun(
        name=f"Llama 3 405B, {gpus} H100{context}",
        source=(f"{_LLAMA}: {gpus} GPUs, TP 8, CP {cp}, PP 16, DP {dp}, seq {seq_len}, "
                f"batch/DP {batch_per_dp}, {tflops} TFLOPs/GPU, {percent}% BF16 MFU"),
        model=model, hardware=hardware, layout=layout, settings=settings,
        metric="mfu", reported=percent / 100, reported_tflops_per_device=tflops,
        assumed=_LLAMA_ASSUMED.format(chunks=chunks), cannot_know=_LLAMA_UNKNOWN)


# BLOOM (BigScience, Le Scao et al. 2022), trained on Jean Zay: 48 nodes of 8 A100 80 GB,
# "4 NVLink inter-gpu connects" and 4 Omni-Path 100 Gb/s links per node (the BigScience
# 176B model page). The shape (70 layers, hidden 14,336, 112 heads, sequence 2048,
# vocabulary 250,680, global batch 2048) is the paper's. The rate is the "Rebalancing layers"
# table of bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md (02-28):
# 176B, DP 8, TP 4, PP 12, MBS 2, 112 heads, GBS 2048, 150.05 TFLOPs (the model page says
# "about 150 TFLOPs"). The training script (train/tr11-176B-ml/tr11-176B-ml.slurm) has the
# same TP 4, PP 12, MBS 2, GBS 2048, --checkpoint-activations, bf16 with DeepSpeed's ZeRO-1
# equivalent, and --pad-vocab-size-to 250880. Megatron-DeepSpeed's TFLOPs count the
# recomputed forward: "hfu".
# The cluster's network is the one BigScience measured (Hardware.jean_zay_a100).
JEAN_ZAY_A100 = Hardware.jean_zay_a100(384)
_BLOOM = Model(70, 14336, 112, 2048, 250880, tied_embeddings=True, learned_positions=False,
               dropout=True, name="BLOOM 176B")
BLOOM_RUN = PublishedRun(
    name="BLOOM 176B, 384 A100",
    source=("BigScience tr11-176B-ml chronicles-prequel.md, 'Rebalancing layers' (02-28): 70 "
            "layers, hidden 14336, 112 heads, DP 8, TP 4, PP 12, MBS 2, GBS 2048, 150.05 "
            "TFLOPs; model page: 384 A100 80GB, 'about 150 TFLOPs'; tr11-176B-ml.slurm"),
    model=_BLOOM,
    hardware=JEAN_ZAY_A100,
    layout=Layout(dp=8, tp=4, pp=12),
    settings=dict(m=128, global_batch=2048, zero=1, recompute=True, sequence_parallel=False,
                  loss="in_place", host_seconds_per_layer=SERIAL_LAUNCH_SECONDS_PER_LAYER),
    metric="hfu", reported=150.05 / 312, reported_tflops_per_device=150.05,
    assumed=("70 layers in 12 stages, the first and last one layer short (BigScience gave "
             "the embeddings those slots); vocabulary padded to 250,880; ZeRO-1; 1F1B, v = 1; "
             "serial kernel launches (CUDA_LAUNCH_BLOCKING=1, set against hangs on 40+ "
             "nodes) at parlib.cost.launches' floor of "
             f"{SERIAL_LAUNCH_SECONDS_PER_LAYER * 1e3:.2f} ms a microbatch-layer; "
             "the Jean Zay network as BigScience measured it (an all-reduce's 5.06 GB/s "
             "of bus bandwidth over 4 nodes: what a node's rings share), NVLink as a "
             "DGX's"),
    cannot_know=("the 4-link NVLink of a Jean Zay node (not a DGX's NVSwitch); a rate read "
                 "from one benchmark iteration; how much of the host's time serial launches "
                 "expose beyond the floor (the chronicles measured them at 91 against 97 "
                 "TFLOPs on 80 GPUs and no difference on 160)"))


# Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models", Sec. 2.4: 992
# 80 GB A100s, Fully Sharded Data Parallel with Megatron-LM tensor parallelism, "up to 147
# TFLOP/s per GPU"; Table 1: 175B, 96 layers, 96 heads, hidden 12,288, batch 2M tokens;
# GPT-2 vocabulary (50,272 with OPT's extra tokens), sequence 2048, learned positions.
OPT_RUN = PublishedRun(
    name="OPT 175B, 992 A100",
    source=("Zhang et al. 2022 (OPT), Sec. 2.4 and Table 1: 992 A100 80GB, FSDP + Megatron "
            "TP, up to 147 TFLOP/s per GPU; 96 layers, 96 heads, hidden 12288, batch 2M tokens"),
    model=Model(96, 12288, 96, 2048, 50272, tied_embeddings=True, dropout=True,
                name="OPT 175B"),
    hardware=Hardware.dgx_a100(992),
    layout=Layout(dp=124, tp=8),
    settings=dict(m=1, global_batch=992, zero=3, recompute=True, sequence_parallel=False,
                  loss="in_place"),
    metric="hfu", reported=147 / 312, reported_tflops_per_device=147,
    assumed=("TP 8 (992 = 124 x 8); 992 sequences per step (2.03M tokens: 2M is not a whole "
             "number of sequences per rank), 8 per rank in one microbatch; FSDP as ZeRO-3; "
             "full recomputation; 147 read as counting the recomputed forward (hfu)"),
    cannot_know=("'up to' 147: the best stretch of a run with restarts and hardware faults; "
                 "the nodes are Azure's, modelled as DGX A100"))


# torchtitan, docs/performance.md (at commit 041336434916): Llama 3 on 64 A100 80 GB with
# FSDP2, local batch 1 (global 64): 8B with "selective op" activation checkpointing 2973
# WPS (tokens/s per GPU), 58.2% MFU; 70B with full checkpointing 331 WPS, 51.7% MFU.
# Shapes: Meta's Llama 3 configurations (8B: 32 layers, 4096, 32 heads, 8 KV heads, FFN
# 14,336; 70B: 80 layers, 8192, 64 heads, 8 KV heads, FFN 28,672; vocabulary 128,256),
# torchtitan's sequence length 8192. What the code at that commit ran
# (torchtitan/parallelisms/parallelize_llama.py): FSDP2 with MixedPrecisionPolicy(
# param_dtype=torch.bfloat16, reduce_dtype=torch.float32), so the gradients are
# reduce-scattered in fp32 (grad_reduce_bytes=4); and the "op" selective checkpointing policy
# saves the outputs of the matmuls and of attention "except every second mm", counted per
# layer in forward order (wq, wk, wv, wo, w1, w3, w2): wk, wo and w3 are recomputed in the
# backward (``recompute="op"``: :attr:`Model.op_policy_flops_per_token`, and its memory
# :func:`~parlib.cost.memory.activation_bytes_per_layer`).
_TORCHTITAN = "torchtitan docs/performance.md (commit 0413364), FSDP2 on 64 A100"
_TORCHTITAN_UNKNOWN = ("the cluster's network and whether its A100 nodes are DGX-like; what "
                       "torchtitan's attention and norm kernels cost beside the matmuls")


def llama(family: str, size: str) -> Model:
    """Meta's Llama 2 and Llama 3 shapes as torchtitan trained them: Llama 3 8B (32 layers,
    4096, 32 heads, 8 KV heads, FFN 14,336) and 70B (80, 8192, 64, 8, 28,672), vocabulary
    128,256, sequence 8192; Llama 2 13B (40, 5120, 40 heads, no grouped KV, 13,824) and 70B
    (80, 8192, 64, 8, 28,672), vocabulary 32,000, sequence 4096."""
    shapes = {("Llama 3", "8B"): (32, 4096, 32, 8, 14336),
              ("Llama 3", "70B"): (80, 8192, 64, 8, 28672),
              ("Llama 2", "13B"): (40, 5120, 40, 40, 13824),
              ("Llama 2", "70B"): (80, 8192, 64, 8, 28672)}
    if (family, size) not in shapes:
        raise ValueError(f"no {family} {size} shape here; known: {sorted(shapes)}")
    layers, hidden, heads, kv_heads, ffn = shapes[family, size]
    seq, vocab = (8192, 128256) if family == "Llama 3" else (4096, 32000)
    return Model(layers, hidden, heads, seq, vocab, ffn_dim=ffn, n_kv_heads=kv_heads,
                 gated_mlp=True, bias=False, learned_positions=False,
                 name=f"{family} {size}")


def torchtitan_run(model: Model, batch: int, recompute: bool | str, checkpointing: str,
                   wps: int, mfu: float, name: str = "") -> PublishedRun:
    """One row of torchtitan's 64-A100 table: FSDP2 over every GPU, local batch ``batch``,
    its checkpointing as ``recompute``; ``wps`` tokens/s per GPU, ``mfu`` as torchtitan
    counted it (6 x all parameters)."""
    hardware = Hardware.dgx_a100(64)
    # torchtitan's MFU (at that commit) counts 6 x all parameters, the embedding's included,
    # which multiply nothing; the same WPS with our FLOPs per token is the comparable figure.
    ours = wps * model.flops_per_token / hardware.peak_flops
    # torchtitan's attention is scaled_dot_product_attention's fused (Flash) kernel
    settings = dict(m=1, global_batch=64 * batch, zero=3, recompute=recompute,
                    grad_reduce_bytes=4, fused_attention=True)
    return PublishedRun(
        name=name or f"{model.name}, 64 A100 FSDP",
        source=(f"{_TORCHTITAN}: {model.name}, batch {batch}, {checkpointing} AC, {wps} WPS, "
                f"{mfu}% MFU as torchtitan counts it ({ours:.1%} with our FLOPs per token)"),
        model=model,
        hardware=hardware,
        layout=Layout(dp=64),
        settings=settings,
        metric="mfu", reported=ours, reported_tflops_per_device=None,
        reported_tokens_per_second_per_device=wps,
        assumed=(f"sequence {model.seq_len}; FSDP2 as ZeRO-3, gradients reduce-scattered in "
                 f"fp32 (the code's reduce_dtype); {checkpointing} checkpointing as "
                 f"recompute={recompute!r}; DGX A100 nodes; MFU recomputed from WPS with our "
                 f"FLOP count (torchtitan's {mfu}% counts the embedding's parameters)"),
        cannot_know=_TORCHTITAN_UNKNOWN)


# MosaicML llm-foundry, scripts/train/benchmarking/README.md, table "H100 80GB BF16": MPT
# models with FSDP FULL_SHARD. Columns used: model, SeqLen, # GPUs, MFU, MicroBatchSize,
# GradAccum, GlobalBatchSize, Throughput (T/s/GPU), Activation Checkpointing, NumParams. The
# shapes are the repository's scripts/train/yamls/pretrain/mpt-7b.yaml and mpt-30b.yaml
# (d_model, n_heads, n_layers, vocabulary 50,368); with biases, learned positions and a tied
# output our parameter count is the table's NumParams exactly.
_MOSAIC = "MosaicML llm-foundry benchmarking README, 'H100 80GB BF16' table"
_MOSAIC_UNKNOWN = ("MosaicML's cluster (its nodes and network are not DGX H100 by name), and "
                   "what its Triton attention and unfused norms cost beside the matmuls")


def _mosaic_row(size: str, layers: int, hidden: int, heads: int, gpus: int, micro: int,
                accum: int, batch: int, checkpointing: bool, tokens_per_gpu: int, mfu: float,
                n_params: int) -> PublishedRun:
    model = Model(layers, hidden, heads, 2048, 50368, tied_embeddings=True, name=f"MPT {size}")
    hardware = Hardware.dgx_h100(gpus)
    # their MFU counts 6 x all parameters (embedding and positions too); ours does not
    ours = tokens_per_gpu * model.flops_per_token / hardware.peak_flops
    return PublishedRun(
        name=f"MPT {size}, {gpus} H100 FSDP",
        source=(f"{_MOSAIC}: {size}, seq 2048, {gpus} GPUs, microbatch {micro}, accum "
                f"{accum}, global batch {batch}, AC {checkpointing}, {tokens_per_gpu} "
                f"T/s/GPU, {mfu}% MFU as MosaicML counts it ({ours:.1%} with our FLOPs per "
                f"token), {n_params} params"),
        model=model,
        hardware=hardware,
        layout=Layout(dp=gpus),
        # without checkpointing, the fused (Triton) attention still stores no scores: "selective"
        settings=dict(m=accum, global_batch=batch, zero=3,
                      recompute=True if checkpointing else "selective",
                      fused_attention=True, loss="fused"),
        metric="mfu", reported=ours, reported_tflops_per_device=None,
        reported_tokens_per_second_per_device=tokens_per_gpu,
        assumed=("FSDP FULL_SHARD as ZeRO-3, gradients reduced in bf16 (Composer's 'DEFAULT' "
                 "mixed precision reduces in fp32 in some versions: with fp32 the ratio is the "
                 "same, the sync stays hidden); activation checkpointing as full "
                 "recomputation, none as 'selective' (the fused attention stores no scores); "
                 "DGX H100 nodes; MFU recomputed from T/s/GPU with our FLOP count"),
        cannot_know=_MOSAIC_UNKNOWN, reported_params=round(n_params / 1e9, 1))


MEGATRON_RUNS = (
    _megatron_row("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 2, 5),
    _megatron_row("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 2, 5),
    _megatron_row("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 1, None),
)
KORTHIKANTI_RUNS = (
    _korthikanti_row("22B", 64, 6144, 48, 1, 4, 41.5, 43.7),
    _korthikanti_row("175B", 96, 12288, 96, 8, 64, 51.4, 52.8),
    _korthikanti_row("530B", 128, 20480, 105, 35, 280, 56.0, 57.0),
    _korthikanti_row("1T", 160, 25600, 128, 64, 512, 56.3, 57.0),
)
LLAMA_RUNS = (
    _llama_row(8192, 1, 64, 8192, 32, 430, 43),
    _llama_row(16384, 1, 128, 8192, 16, 400, 41),
    _llama_row(16384, 16, 8, 131072, 16, 380, 38),
)
TORCHTITAN_RUNS = (
    torchtitan_run(llama("Llama 3", "8B"), 1, "op", "selective op", 2973, 58.2),
    torchtitan_run(llama("Llama 3", "70B"), 1, True, "full", 331, 51.7),
)
# Megatron-LM's and Llama 3's rows first.
MOSAIC_RUNS = (
    _mosaic_row("7B", 32, 4096, 32, 8, 6, 1, 48, False, 10643, 46.44, 6658859008),
    _mosaic_row("30B", 48, 7168, 56, 32, 14, 3, 1344, True, 2308, 43.92, 29975214080),
)
RUNS = (MEGATRON_RUNS + LLAMA_RUNS + KORTHIKANTI_RUNS + (BLOOM_RUN, OPT_RUN) + TORCHTITAN_RUNS
        + MOSAIC_RUNS)


def agreement(runs: tuple[PublishedRun, ...] = RUNS,
              band: tuple[float, float] = TARGET_BAND) -> tuple[int, int]:
    """(runs whose reported / predicted lies in ``band``, runs)."""
    low, high = band
    return sum(low <= run.ratio() <= high for run in runs), len(runs)


def comparison_table(runs: tuple[PublishedRun, ...] = RUNS,
                     band: tuple[float, float] = TARGET_BAND, *,
                     target: float | None = None) -> str:
    """Predicted (at the generation's achievable compute) next to reported, one row per run,
    then how many runs fall in ``band`` (and their share, against ``target`` if given)."""
    width = max(len(run.name) for run in runs)
    rows = [f"{'run':<{width}} {'fits':<5} {'GB/dev':>7} {'metric':<6} {'predicted':>9} "
            f"{'reported':>8} {'reported/predicted':>18}"]
    inside = 0
    for run in runs:
        est = run.estimate()
        pred = run.predicted(est)
        ratio = run.reported / pred
        inside += band[0] <= ratio <= band[1]
        rows.append(f"{run.name:<{width}} {str(est.fits):<5} {est.memory_total / 1e9:>7.1f} "
                    f"{run.metric:<6} {pred:>9.0%} {run.reported:>8.0%} {ratio:>18.2f}")
    rows.append(f"{inside} of {len(runs)} runs ({inside / len(runs):.0%}) within "
                f"reported/predicted {band[0]:g}-{band[1]:g}"
                + (f" (target {target:.0%})" if target is not None else ""))
    return "\n".join(rows)


def caveats_table(runs: tuple[PublishedRun, ...] = RUNS) -> str:
    """One line per run: what the cost model cannot know about it."""
    return "\n".join(f"{run.name:<30} {run.cannot_know}" for run in runs)


__all__ = ["BLOOM_RUN", "JEAN_ZAY_A100", "KORTHIKANTI_RUNS", "LLAMA_CHUNKS", "LLAMA_RUNS",
           "MEGATRON_RUNS", "MOSAIC_RUNS", "OPT_RUN", "RUNS", "TARGET_BAND", "TORCHTITAN_RUNS",
           "PublishedRun", "agreement", "caveats_table", "comparison_table", "llama",
           "torchtitan_run"]
