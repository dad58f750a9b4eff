"""The course's formulas, in pure Python (no torch): importable anywhere, instant.

- :mod:`parlib.cost.layout`: ``Layout``, the size of every axis of parallelism and the rank
  order (which axis varies fastest), written once; ``AXES``, the axes as data.
- :mod:`parlib.cost.collectives`: bytes a collective sends, the alpha-beta time model and
  its fit to measured times.
- :mod:`parlib.cost.pipeline`: the bubble, step times with microbatches, microbatches in
  flight, stage-boundary bytes.
- :mod:`parlib.cost.memory`: model-state bytes per parameter and per ZeRO stage,
  activation and logits bytes per layer.
- :mod:`parlib.cost.tensor`: bytes a tensor-parallel layer sends, parameters per rank.
- :mod:`parlib.cost.sharded`: bytes a ZeRO stage sends per step (shards padded to N pieces).
- :mod:`parlib.cost.context`: ring and all-gather attention bytes, activation memory per
  context-parallel rank, causal work per rank.
- :mod:`parlib.cost.checkpoint`: bytes a checkpoint writes per rank and in total under each
  strategy, and the checkpoint interval that loses least time (Young/Daly).
- :mod:`parlib.cost.experts`: mixture-of-experts parameters per ep rank, all-to-all bytes,
  capacity and dropped tokens, compute per token, load imbalance.
- :mod:`parlib.cost.combined`: bytes each axis sends per step when the five combine.

Built on them, the choosing chapter's cost model:

- :mod:`parlib.cost.model`: ``Model``, a transformer's parameter count and FLOPs per token.
- :mod:`parlib.cost.hardware`: ``Hardware`` and ``Link``, presets with their sources (not
  ``parlib.Cluster``, which keeps ranks warm).
- :mod:`parlib.cost.efficiency`: ``ACHIEVABLE``, the fraction of datasheet matmul rate and
  memory bandwidth each device generation reaches, with sources; the presets use it.
- :mod:`parlib.cost.stages`: layers per pipeline stage when p does not divide L.
- :mod:`parlib.cost.estimate`: ``estimate``, memory and step time of one layout.
- :mod:`parlib.cost.planner`: ``best_layouts``, the fastest layouts that fit, with reasons.
- :mod:`parlib.cost.published`: published runs to hold the model against.
- :mod:`parlib.cost.foundry`: llm-foundry's FSDP benchmarks, every model size at every GPU
  count, held against the model the same way.
- :mod:`parlib.cost.foundry_reruns`: llm-foundry's own second runs of six of those layouts,
  how far one row moves when its layout runs again.
- :mod:`parlib.cost.foundry_held_out`: llm-foundry's two other bf16 tables (its runs on 128
  to 512 H100s, its A100 80GB table), in no fit, and the trend of every row together.
- :mod:`parlib.cost.foundry_sequence`: llm-foundry's sweeps of the sequence length, in no
  fit, by attention's share of the FLOPs, and the caution beside a prediction beyond them.
- :mod:`parlib.cost.calibration`: the two training shares of each generation (matmuls of the
  best measured matmul, memory-bound work of the bandwidth), fitted to every published run
  of it, and each table held against a fit to the other; and the network's rate each run
  implies, with every table held at a few slower rates (no one rate fits them all).
- :mod:`parlib.cost.held_out`: published rows no fit has seen (torchtitan's Llama 2 runs),
  their rates and whether each layout fits, beside a layout that ran out of memory.
- :mod:`parlib.cost.avoided`: a layout experts avoid (ZeRO-3 alone on hundreds of GPUs)
  measured beside the one they chose, held against the model.
- :mod:`parlib.cost.launches`: what serial kernel launches (``CUDA_LAUNCH_BLOCKING=1``) add
  to every layer pass, from the one pair of readings that measured it (BigScience's).
- :mod:`parlib.cost.sweeps`: published layout sweeps, the model's order against the measured.
- :mod:`parlib.cost.grid`: a grid of layouts someone measured (a CSV file), scored against
  the model: the order within each cluster size, the model's pick, the rate, the memory.

Each formula is written once, in the module named for it; the estimate and the planner call
those functions rather than restating them.
"""

from parlib.cost.checkpoint import (
    CheckpointBytes,
    checkpoint_bytes,
    checkpoint_overhead_per_hour,
    flat_shard_range,
    reshard_reads,
    staging_bytes,
    young_daly_interval,
)
from parlib.cost.collectives import (
    bus_bandwidth,
    collective_time,
    fit_alpha_beta,
    message_time,
    per_link_alpha_beta,
    predicted_sent_bytes,
)
from parlib.cost.combined import mesh_sent_bytes_per_step
from parlib.cost.context import (
    all_gather_kv_sent_bytes_per_layer,
    causal_block_work,
    causal_unmasked_scores,
    cp_activation_bytes_per_layer,
    kv_block_bytes,
    ring_attention_sent_bytes_per_layer,
    ring_sends_per_layer,
)
from parlib.cost.efficiency import ACHIEVABLE, Achievable, achievable, achievable_fraction
from parlib.cost.estimate import Estimate, estimate
from parlib.cost.experts import (
    ep_all_to_all_bytes_per_layer,
    ep_count_bytes_per_layer,
    ep_expected_sent_fraction,
    expert_capacity,
    expert_flops_per_token,
    expert_params,
    load_imbalance,
    moe_params_per_rank,
    tokens_dropped,
)
from parlib.cost.hardware import Hardware, Link
from parlib.cost.layout import AXES, Axis, Layout
from parlib.cost.memory import (
    activation_bytes_per_layer,
    adam_bytes_per_param,
    logits_bytes,
    loss_peak_bytes,
    memory_bound_bytes_per_layer,
    model_state_bytes,
    model_state_bytes_by_kind,
    model_state_bytes_per_param,
    model_state_formula,
)
from parlib.cost.model import Model
from parlib.cost.pipeline import (
    HEADER_BYTES,
    PIPELINE_SCHEDULES,
    best_microbatches,
    boundary_bytes,
    bubble_fraction,
    bubble_ratio,
    critical_path_messages,
    crossing_time,
    fixed_batch_step_time,
    ideal_step_time,
    imbalanced_step_time,
    in_flight_microbatches,
    messages_per_op,
    messages_per_rank,
    microbatch_time,
    min_microbatches,
    op_times,
    schedule_compute_time,
    schedule_step_time,
)
from parlib.cost.planner import best_layouts, binding_constraint, candidate_layouts
from parlib.cost.sharded import padded_numel, zero_sent_bytes_per_step
from parlib.cost.stages import stage_imbalance, stage_layers
from parlib.cost.tensor import tp_message_bytes, tp_sent_bytes_per_layer

__all__ = [
    "AXES",
    "Axis",
    "Estimate",
    "Hardware",
    "Layout",
    "Link",
    "Model",
    "activation_bytes_per_layer",
    "adam_bytes_per_param",
    "all_gather_kv_sent_bytes_per_layer",
    "best_layouts",
    "best_microbatches",
    "boundary_bytes",
    "bubble_fraction",
    "bubble_ratio",
    "bus_bandwidth",
    "candidate_layouts",
    "causal_block_work",
    "causal_unmasked_scores",
    "collective_time",
    "cp_activation_bytes_per_layer",
    "estimate",
    "fit_alpha_beta",
    "fixed_batch_step_time",
    "ideal_step_time",
    "imbalanced_step_time",
    "in_flight_microbatches",
    "kv_block_bytes",
    "logits_bytes",
    "loss_peak_bytes",
    "mesh_sent_bytes_per_step",
    "message_time",
    "microbatch_time",
    "min_microbatches",
    "model_state_bytes",
    "model_state_bytes_by_kind",
    "model_state_bytes_per_param",
    "model_state_formula",
    "padded_numel",
    "per_link_alpha_beta",
    "predicted_sent_bytes",
    "ring_attention_sent_bytes_per_layer",
    "ring_sends_per_layer",
    "tp_message_bytes",
    "tp_sent_bytes_per_layer",
    "zero_sent_bytes_per_step",
    # the pipeline schedule lab
    "HEADER_BYTES",
    "PIPELINE_SCHEDULES",
    "critical_path_messages",
    "crossing_time",
    "messages_per_op",
    "messages_per_rank",
    "op_times",
    "schedule_compute_time",
    "schedule_step_time",
    # the experts chapter
    "ep_all_to_all_bytes_per_layer",
    "ep_count_bytes_per_layer",
    "ep_expected_sent_fraction",
    "expert_capacity",
    "expert_flops_per_token",
    "expert_params",
    "load_imbalance",
    "moe_params_per_rank",
    "tokens_dropped",
    # achievable rates, memory-bound operations, stages, the planner's binding constraint
    "ACHIEVABLE",
    "Achievable",
    "achievable",
    "achievable_fraction",
    "memory_bound_bytes_per_layer",
    "stage_imbalance",
    "stage_layers",
    "binding_constraint",
    # long runs: checkpoints
    "CheckpointBytes",
    "checkpoint_bytes",
    "checkpoint_overhead_per_hour",
    "flat_shard_range",
    "reshard_reads",
    "staging_bytes",
    "young_daly_interval",
]
