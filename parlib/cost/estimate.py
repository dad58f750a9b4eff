"""Memory per device and time per step of one :class:`~parlib.cost.layout.Layout`, from the
formulas of this package: does it fit, how long does a step take, and where does the time go.

Ranks are numbered in the layout's rank order (tp fastest, then dp, pp slowest), so a group
of an axis lies in a block of ``layout.span(axis)`` consecutive ranks: a TP group is t
adjacent ranks (in one node when t divides devices_per_node), a DP group spans t x d ranks
and a pipeline all of them; a group is charged the slowest link inside that block
(:meth:`Hardware.link_for`), except that ring collectives (TP's all-reduces, the gradient
sync) across nodes share the node's NICs: a group with g ranks in each node sends 1/g of its
bytes through them (:meth:`Hardware.ring_link`; ``Estimate.crossing``).

What the model assumes, in one place:

- Compute is spread evenly over devices at ``peak_flops x compute_efficiency`` (the
  presets: their generation's achievable matmul fraction, :mod:`parlib.cost.efficiency`)
  for large matmuls; full recomputation adds the layers' forward, selective the attention
  scores'.
- The matmul rate depends on shape (hardware with ``multiprocessors``, as the presets):
  each layer's FLOPs are charged at the rate of its per-device matmuls, the forward's
  shapes standing for the backward's too (same FLOPs, same tiles), each shape at
  :func:`~parlib.cost.efficiency.shape_efficiency` (its output tiles in waves over the SMs
  plus half a wave's tail), weighted by FLOPs. Rows are one microbatch's tokens on a
  device, b x s / c: QKV (rows, h, (h + 2 kv) / t), the attention output (rows, h / t, h),
  the MLP (rows, h, f / t, twice f when gated) and (rows, f / t, h), attention's scores
  and values as b x heads / t x c batched (s / c, head_dim, s / c) and
  (s / c, s / c, head_dim) matmuls, the experts' (balanced routing) rows x e x k / E tokens
  each, E / e experts batched; the output layer (rows, h, V / t). Bigger microbatches or
  less tensor parallelism make bigger matmuls that run nearer the best rate.
- Memory-bound operations (norms, residual adds, the MLP's activation, dropout, and the
  softmax over stored attention scores; none with a fused kernel: "selective",
  ``fused_attention`` or context parallelism) are charged their bytes over the achievable
  memory bandwidth (:func:`~parlib.cost.memory.memory_bound_bytes_per_layer`, backward twice the
  forward's bytes, full recomputation one more forward), and so is the unfused
  cross-entropy over the logits (:func:`~parlib.cost.memory.loss_bytes_per_token`, spread
  evenly as the output layer's FLOPs are): the step part ``memory_bound``, beside
  ``compute`` (which counts only FLOPs). Adam's update reads and writes the optimizer state
  a rank holds once a step, after the sync
  (:func:`~parlib.cost.memory.optimizer_step_bytes_per_param`): the part ``optimizer``.
  Reducing bf16 gradients in fp32 (``grad_reduce_bytes=4``) first casts every gradient
  element the rank computed, before each reduction (every microbatch with ZeRO-2 and
  ZeRO-3): :func:`~parlib.cost.memory.gradient_cast_bytes_per_param`, in ``memory_bound``.
  Hardware without a memory bandwidth charges nothing for either.
- Tensor parallelism: 2 all-reduces of (b, s, h) per layer forward, 2 backward (one more
  forward's worth with full recomputation), on the critical path. Sequence parallelism
  (default on) moves the same bytes and splits the norms' activations too.
- Context parallelism (c > 1): every rank holds s/c positions (zig-zag split: the causal
  work is balanced), so activations, logits, TP and pipeline messages are /c; attention
  runs blockwise (a fused kernel: no scores stored) and keeps an fp32 log-sum-exp per query
  row. Ring attention per layer: c - 1 K/V blocks forward (again with full recomputation),
  c - 1 K/V blocks plus their gradients backward, each step's transfer overlapping that
  step's attention compute (1/c of the layer's attention); only the excess is exposed.
  cp ranks hold the same weights: the gradient sync (and ZeRO's sharding) runs over d x c.
- Expert parallelism (e > 1, a mixture-of-experts model): ep borrows ranks, it does not
  multiply the world size (DeepSeek-style): e divides d x c, and for the dense part
  (attention, norms, embeddings, router) the ep ranks are plain data-parallel ranks; each
  group of e of them splits every MoE layer's experts e ways (``Model.layer_expert_params
  / e`` per rank, tensor parallelism splitting them t ways too), so an expert has
  d x c / e copies and its gradients sync (and ZeRO shards) over those. Compute counts
  top_k experts per token (:func:`~parlib.cost.experts.expert_flops_per_token`; a capacity
  factor pads the experts' work and buffers by that factor). Per MoE layer per microbatch
  four all-to-alls (dispatch and combine, forward and backward; two more with full
  recomputation) of the rank's b x s/(c t) tokens x k choices x h
  (:func:`~parlib.cost.experts.ep_all_to_all_bytes_per_layer`), routing balanced, on the
  critical path: the step part ``ep_comm``.
- Pipeline stages: when p does not divide the L layers, the first and last stages get one
  layer fewer (Llama 3's rule, :func:`~parlib.cost.stages.stage_layers`); the layers' share
  of compute and memory-bound time follows the slowest stage (most layers), the output
  layer's stays spread evenly; memory is the worst stage's. Interleaved (v > 1), the same
  rule splits the L layers into p x v chunks, chunk j on rank j mod p
  (:func:`~parlib.cost.stages.rank_layers`; p x v <= L); a rank's chunks are charged as
  equal in the bubble (1/v of its work each) and in what the first rank holds in flight.
- Pipeline: 1F1B, interleaved over v model chunks per rank when v > 1; the bubble is
  bubble_fraction(p, m, v) of the step; each of the v*m + p - 1 slots sends one boundary
  forward and one back, 1/t of it per TP rank (Megatron's scatter/gather). The first stage
  holds in_flight_microbatches(p, m, v) microbatches (chunks) of activations.
- Data parallelism: the sync runs as one collective per unit, never one for the model
  (:func:`sync_collectives`): plain data parallelism one all-reduce per gradient bucket
  (Megatron-LM's max(40M, 1M x ranks) elements, :func:`bucket_elements`), ZeRO-1 a
  reduce-scatter and an all-gather per bucket, ZeRO-2 the same but the reduce-scatters
  every microbatch (sharded gradients cannot accumulate whole), ZeRO-3 (FSDP) per layer and
  for the root (embedding, output layer) per microbatch two all-gathers and a
  reduce-scatter. Each collective pays its algorithm's latency (rings for gathers and
  scatters, NCCL's tree for an all-reduce where that is faster:
  :func:`~parlib.cost.collectives.nccl_algorithm`) and its bytes at the bus bandwidth of its
  message's size (``Hardware.collective_half_bytes``,
  :func:`~parlib.cost.collectives.size_efficiency`); TP's all-reduces and EP's all-to-alls
  too. Stages 0-1: the sync overlaps the backward of the last microbatch; ZeRO-2: every
  microbatch's reduce-scatter overlaps its own backward. ZeRO-3 overlaps by phase: each
  microbatch's forward gathers hide behind forward compute, its backward gathers and
  reduce-scatters behind backward compute (recomputation included): a gradient cannot be
  sent before the backward makes it, so backward traffic never hides behind the forward;
  and each microbatch's first forward gather, first backward gather and last
  reduce-scatter (one layer's each) hide behind nothing. The gradients go at their own
  dtype's bytes (2 in mixed precision) unless ``grad_reduce_bytes`` says otherwise (4: an
  fp32 reduction, FSDP2's reduce_dtype). The rest of the sync is exposed. ZeRO-3 with a
  pipeline (p > 1) is refused: every stage would re-gather its weights for each
  microbatch's forward and backward (v x m times a step, on the links the pipeline also
  uses), which DeepSpeed refuses too. ZeRO-2 with a pipeline is charged, not refused:
  DeepSpeed's pipeline engine refuses it, but Llama 3 405B trained that way (its FSDP
  shards gradients and optimizer state beside a 16-stage pipeline), so the model charges
  what it costs: a reduce-scatter of the stage's gradients every microbatch.
- Overlap is not free: compute that runs beside a collective runs slower
  (``Hardware.overlap_slowdown``; the presets 18.9%, a published mean), so every second of
  communication hidden behind compute (``dp_sync_hidden``, ``cp_comm_hidden``) adds that
  share of a second to ``dp_sync`` (``cp_comm``); ``dp_overlap_cost`` and
  ``cp_overlap_cost`` hold what it added. With a unit's gather prefetched one unit ahead
  (FSDP2's default depth), a unit's collectives hide behind the unit before it; the model
  sums them over the phase, which is the same for equal layers.
- Memory is that of the worst stage: first (embedding, most in flight) or last (output
  layer and what its loss holds over the logits at the backward's start, by the loss's
  implementation: :func:`~parlib.cost.memory.loss_peak_bytes`). Nothing is charged for
  framework buffers or fragmentation (:mod:`parlib.cost.held_out` measures what that left).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from parlib.cost.collectives import collective_time, message_time, predicted_sent_bytes
from parlib.cost.context import LSE_BYTES, kv_block_bytes, ring_attention_sent_bytes_per_layer
from parlib.cost.efficiency import shape_efficiency
from parlib.cost.experts import ep_all_to_all_bytes_per_layer
from parlib.cost.hardware import GB, Hardware
from parlib.cost.layout import Layout
from parlib.cost.memory import (
    MEMORY_BOUND_BACKWARD_PER_FORWARD,
    activation_bytes_per_layer,
    check_loss,
    gradient_cast_bytes_per_param,
    loss_bytes_per_token,
    loss_peak_bytes,
    memory_bound_bytes_per_layer,
    model_state_bytes_by_kind,
    model_state_bytes_per_param,
    optimizer_step_bytes_per_param,
)
from parlib.cost.model import BACKWARD_PER_FORWARD, Model
from parlib.cost.pipeline import boundary_bytes, bubble_fraction, in_flight_microbatches
from parlib.cost.stages import rank_layers
from parlib.cost.tensor import ALL_REDUCES_PER_LAYER, tp_message_bytes, tp_sent_bytes_per_layer

RECOMPUTE = (False, "selective", True)  # True means full recomputation
# what estimate also takes: torchtitan's per-operation policy (the planner does not search it)
OP_POLICY = "op"
ZERO3_WITH_PIPELINE = (
    "ZeRO-3 with a pipeline (p = {p}) is refused: each stage would re-gather its weights "
    "for every microbatch's forward and backward, on the links the pipeline uses too "
    "(DeepSpeed refuses the combination); use zero=1 or zero=2 with a pipeline")
# they sum to a step
STEP_PARTS = ("compute", "memory_bound", "host", "tp_comm", "cp_comm", "ep_comm",
              "pp_bubble", "pp_send", "dp_sync", "optimizer")
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "pipeline_in_flight")


@dataclass
class Estimate:
    """One layout's predicted memory (bytes per device) and time (seconds per step).

    ``memory`` holds bytes per device of the worst pipeline stage (``stage``): params,
    grads, optimizer, activations (one microbatch), pipeline_in_flight (the others held).
    ``time`` holds the parts of a step, which add up to ``step_time``: compute (FLOPs at
    the achievable rate), memory_bound (norms, softmax, elementwise, the loss over the
    logits: bytes over memory bandwidth), host (the host's time the GPU waits for, where
    launches are serial: ``host_seconds_per_layer``), tp_comm, cp_comm (the exposed part of
    ring attention's K/V traffic),
    ep_comm (the experts' all-to-alls), pp_bubble, pp_send and dp_sync (the exposed part of
    the gradient sync), optimizer (Adam's memory-bound pass over this rank's optimizer
    state, once a step), and beside them cp_comm_total, cp_comm_hidden, dp_sync_total and
    dp_sync_hidden (the parts that overlap compute). ``stage_layers`` lists the layers of
    each pipeline stage; ``binding`` (set by the planner for its picks) names what limits
    the layout: "memory", "compute", "memory bandwidth", "the pipeline bubble" or a link.
    ``bytes_sent`` (per device per step) and ``links`` ("intra-node", "inter-node" or
    "none") are keyed by axis name ("pp", "dp", "cp", "tp", and "ep" where e > 1);
    ``crossing`` holds, for the ring collectives' axes ("tp", "dp"), the share of those
    bytes that leave the node (:meth:`Hardware.ring_crossing_share`; the other axes' bytes
    cross whole where their link is inter-node).
    ``layout.tp`` and so on are the sizes; ``m`` microbatches per step per data-parallel
    rank, ``v`` model chunks per pipeline rank.
    """

    model: Model = field(repr=False)
    hardware: Hardware = field(repr=False)
    layout: Layout
    m: int
    v: int
    global_batch: int
    zero: int
    recompute: bool | str
    micro_batch: int
    memory: dict[str, float]
    time: dict[str, float]
    bytes_sent: dict[str, float]
    links: dict[str, str]
    stage: str
    model_flops: float
    hardware_flops: float
    reason: str = field(default="")
    stage_layers: list[int] = field(default_factory=list)
    binding: str = field(default="")
    crossing: dict[str, float] = field(default_factory=dict)
    shard_group: int = field(default=0)  # HSDP: ZeRO-3 over groups of this many (0: not)

    @property
    def sharding(self) -> str:
        """How the model state is sharded, in words: "" (not), "ZeRO-2", or HSDP's groups."""
        if self.shard_group:
            copies = self.layout.dp * self.layout.cp // self.shard_group
            return f"HSDP (ZeRO-3 over {self.shard_group}, {copies} copies)"
        return f"ZeRO-{self.zero}" if self.zero else ""

    @property
    def memory_total(self) -> float:
        return sum(self.memory[k] for k in MEMORY_PARTS)

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.hardware.memory_bytes

    @property
    def step_time(self) -> float:
        return sum(self.time[k] for k in STEP_PARTS)

    @property
    def device_work(self) -> float:
        """Seconds of a step the devices spend on their own work, waiting on no link and no
        other stage: compute, memory_bound and optimizer. The rest of ``step_time`` is
        traffic left exposed and the pipeline's bubble."""
        return self.time["compute"] + self.time["memory_bound"] + self.time["optimizer"]

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's training FLOPs per second over the devices'
        datasheet peak (``n_devices x peak_flops``). The model's FLOPs are 6 x (weights a
        token multiplies: every layer's matrices, the active experts, the output layer) x
        tokens plus attention's 12 x L x s x h per token (:attr:`Model.flops_per_token`);
        recomputation is not counted (it is not the model's work)."""
        return self.model_flops / (self.step_time * self.hardware.n_devices
                                   * self.hardware.peak_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: as ``mfu`` but counting the FLOPs the devices really
        run, recomputation included (selective: the attention scores again; full: every
        layer's forward again; and ``extra_recompute_flops_per_token``'s). HFU >= MFU,
        equal without recomputation."""
        return self.mfu * self.hardware_flops / self.model_flops

    @property
    def inter_node_bytes(self) -> float:
        """Bytes one device sends per step over inter-node links (a ring collective's
        share that leaves the node, :attr:`crossing`)."""
        return sum(v * self.crossing.get(k, 1.0) for k, v in self.bytes_sent.items()
                   if self.links[k] == "inter-node")

    @property
    def name(self) -> str:
        """The layout's name, with the model chunks per rank when interleaved: "d=8 x p=8 v=2"."""
        return f"{self.layout}" + (f" v={self.v}" if self.v > 1 else "")

    def describe(self) -> str:
        """One line: fits or not (by how much), and what the step is bound by."""
        used = f"{self.memory_total / GB:.1f} of {self.hardware.memory_bytes / GB:.0f} GB"
        if not self.fits:
            biggest = max(MEMORY_PARTS, key=self.memory.get)
            return f"does not fit: {used} ({biggest} {self.memory[biggest] / GB:.1f} GB)"
        part = max(STEP_PARTS, key=self.time.get)
        return (f"fits ({used}); step {self.step_time:.3g} s, "
                f"{self.time[part] / self.step_time:.0%} {part}")

    def __str__(self) -> str:
        rc = {False: "", "selective": ", selective recompute", True: ", full recompute",
              OP_POLICY: ", per-op recompute"}
        zero = f", {self.sharding}" if self.zero else ""
        return (f"{self.name} m={self.m}{zero}{rc[self.recompute]}: "
                f"{self.memory_total / GB:.1f} GB, step {self.step_time:.3g} s, "
                f"MFU {self.mfu:.0%}" + (f" ({self.reason})" if self.reason else ""))


def estimate(model: Model, hardware: Hardware, layout: Layout, *, m: int,
             global_batch: int, zero: int = 0, recompute: bool | str = False, v: int = 1,
             sequence_parallel: bool = True, mixed_precision: bool = True,
             dp_overlap: bool = True, replicated_head: bool = False,
             extra_recompute_flops_per_token: float = 0.0,
             grad_reduce_bytes: int | None = None, fused_attention: bool = False,
             shard_group: int | None = None, loss: str = "unfused",
             host_seconds_per_layer: float = 0.0) -> Estimate:
    """Predict one layout, e.g. ``Layout(dp=8, tp=8)`` (a mapping of axis sizes is taken as
    one): m microbatches per step per data-parallel rank, ``global_batch`` sequences per
    step, v model chunks per pipeline rank (v > 1: the interleaved schedule).

    ``recompute``: False, "selective" (attention scores recomputed, as FlashAttention),
    True (full) or "op" (torchtitan's per-operation policy: every other matmul's output and
    attention's kept, the rest rerun, :func:`~parlib.cost.memory.activation_bytes_per_layer`;
    dense models with ``fused_attention=True`` only). ``mixed_precision``: bf16 activations
    and messages with fp32 Adam state (16 bytes per parameter); False is fp32 throughout,
    as the course's CPU runs.
    ``dp_overlap=False``: the gradient sync starts after the whole backward (nothing
    hidden), as the combining chapter's ``train_step_3d`` does.
    ``replicated_head=True``: the embedding and the output layer are not split by tensor
    parallelism (every tensor-parallel rank holds them whole and computes the whole output
    layer, on the last pipeline stage only), as the course's own tensor-parallel and
    pipeline code runs them: compute is the busiest stage's, and the pipeline's bubble
    (fill and drain through the other stages) is charged at the other stages' mean compute.
    The default spreads the output layer's FLOPs evenly over the devices (a
    vocabulary-parallel head) and splits its weights t ways.
    ``extra_recompute_flops_per_token``: forward FLOPs per token that another per-operation
    checkpointing policy reruns in the backward beyond what ``recompute`` names; they are
    charged as layer compute and counted in HFU, and the memory stays ``recompute``'s (an
    upper bound for such a policy).
    ``grad_reduce_bytes``: bytes per gradient element the data-parallel sync sends (None:
    the gradients' own, 2 in mixed precision, 4 in fp32; 4 for an fp32 reduction of bf16
    gradients, as FSDP2's ``reduce_dtype=torch.float32``).
    ``fused_attention=True``: attention runs as one fused kernel (FlashAttention) whatever
    ``recompute`` says, so no layer stores or streams its s x s scores; by default only
    "selective" (and context parallelism's blockwise attention) keeps them on chip.
    ``loss``: the cross-entropy's implementation, which sets what its backward holds for the
    logits (:func:`~parlib.cost.memory.loss_peak_bytes`): "unfused" (PyTorch's, the default:
    what the course's code and a plain training loop run), "in_place" (Megatron-LM's) or
    "fused" (one kernel, as flash-attn's).
    ``shard_group=s`` (with ``zero=3``): HSDP, ZeRO-3 inside groups of s consecutive ranks
    of the d x c data-parallel ranks (best inside a node), the d x c / s copies replicated:
    the gathers and reduce-scatters run in the shard group, then one all-reduce of each
    unit's 1/s gradient piece across the copies (:func:`hsdp_collectives`).
    ``host_seconds_per_layer``: seconds the GPU waits for the host on every layer pass of
    every microbatch (forward, recomputation and backward together), charged as ``host`` on
    the critical path, so the pipeline's bubble grows with it: what serial kernel launches
    (``CUDA_LAUNCH_BLOCKING=1``) expose (:mod:`parlib.cost.launches`). 0, the default: the
    host queues kernels ahead of the GPU and its time hides.
    Raises ValueError naming the problem for a layout that cannot exist.
    """
    check_inputs(model, hardware)
    layout = Layout.of(layout)
    check_layout(model, hardware.n_devices, layout, m=m, global_batch=global_batch, v=v)
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if zero == 3 and layout.pp > 1:
        raise ValueError(ZERO3_WITH_PIPELINE.format(p=layout.pp))
    if not (any(recompute is r for r in RECOMPUTE) or recompute == OP_POLICY):
        raise ValueError(f"recompute must be False, 'selective', True or 'op', got "
                         f"{recompute!r}")
    if recompute == OP_POLICY and (model.is_moe or fused_attention is not True):
        raise ValueError("recompute='op' is torchtitan's policy for dense layers with a fused "
                         "attention kernel: pass fused_attention=True (and a dense model)")
    extra = extra_recompute_flops_per_token
    if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not extra >= 0:
        raise ValueError(f"extra_recompute_flops_per_token must be a number >= 0, got "
                         f"{extra!r}")
    if extra and recompute is True:
        raise ValueError("extra_recompute_flops_per_token adds to a partial policy; full "
                         "recomputation (recompute=True) already reruns every layer's forward")
    if grad_reduce_bytes is not None and grad_reduce_bytes not in (2, 4):
        raise ValueError(f"grad_reduce_bytes must be None, 2 (bf16/fp16) or 4 (fp32), got "
                         f"{grad_reduce_bytes!r}")
    if not isinstance(fused_attention, bool):
        raise ValueError(f"fused_attention must be True or False, got {fused_attention!r}")
    if shard_group is not None:
        check_hsdp(layout, zero, shard_group)
    check_loss(loss)
    host = host_seconds_per_layer
    if isinstance(host, bool) or not isinstance(host, (int, float)) or not host >= 0:
        raise ValueError(f"host_seconds_per_layer must be a number of seconds >= 0, got "
                         f"{host!r}")
    est = _evaluate(model, hardware, layout, m, v, global_batch, zero, recompute,
                    sequence_parallel, mixed_precision, dp_overlap,
                    replicated_head=replicated_head, extra_recompute_flops_per_token=extra,
                    grad_reduce_bytes=grad_reduce_bytes, fused_attention=fused_attention,
                    shard_group=shard_group or 0, loss=loss,
                    host_seconds_per_layer=host)
    est.reason = est.describe()
    return est


def check_layout(model: Model, n_devices: int, layout: Layout, *, m: int,
                 global_batch: int, v: int = 1) -> None:
    """A ValueError naming the problem when ``layout`` (m microbatches, v chunks) cannot lay
    ``model`` out on ``n_devices`` devices with ``global_batch`` sequences per step."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a parlib.cost.Layout, e.g. Layout(dp=2, tp=2), got "
                         f"{type(layout).__name__}")
    for name, value in (("m", m), ("v", v), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if layout.world != n_devices:
        raise ValueError(f"the layout {layout} is {layout.world} devices, but the hardware "
                         f"has {n_devices}")
    d, t, p = layout.dp, layout.tp, layout.pp
    if model.n_heads % t:
        raise ValueError(f"t = {t} does not divide the model's {model.n_heads} attention heads")
    if p > model.n_layers:
        raise ValueError(f"p = {p} stages need at least one layer each, but the model has "
                         f"{model.n_layers} layers")
    if v > 1 and p == 1:
        raise ValueError(f"v = {v} model chunks per rank need a pipeline (p > 1)")
    if p * v > model.n_layers:
        raise ValueError(f"v = {v}: p x v = {p * v} model chunks need at least one layer "
                         f"each, but the model has {model.n_layers} layers")
    if v > 1 and m % p:
        raise ValueError(f"the interleaved schedule (v = {v}) needs m a multiple of p; got "
                         f"m = {m}, p = {p}")
    e = layout.ep
    if e > 1 and not model.is_moe:
        raise ValueError(f"e = {e}: expert parallelism needs a mixture-of-experts model "
                         f"(Model(..., n_experts=E)); this one is dense")
    if e > 1 and layout.ep_borrows != ("dp", "cp"):
        raise ValueError(f"{layout!r}: the cost model prices ep over dp x cp (experts split "
                         f"over tp like the MLP); ep borrowing tp too is not modelled")
    if e > 1 and model.n_experts % e:
        raise ValueError(f"e = {e} does not divide the model's {model.n_experts} experts")
    c = layout.cp
    if c > 1 and model.seq_len % (2 * c):
        raise ValueError(f"c = {c} needs the sequence length {model.seq_len} to split into "
                         f"2c = {2 * c} equal chunks (the zig-zag split)")
    if global_batch % (d * m):
        raise ValueError(f"global_batch = {global_batch} is not divisible by d x m = {d} x {m}"
                         f" = {d * m}: each data-parallel rank runs m equal microbatches")


def check_hsdp(layout: Layout, zero: int, shard_group: int) -> None:
    """A ValueError naming the problem when HSDP with groups of ``shard_group`` ranks
    cannot run on ``layout``."""
    copies = layout.dp * layout.cp
    if isinstance(shard_group, bool) or not isinstance(shard_group, int) or shard_group < 1:
        raise ValueError(f"shard_group must be a whole number >= 1 (the ranks of one shard "
                         f"group, e.g. the GPUs of a node), got {shard_group!r}")
    if zero != 3:
        raise ValueError(f"shard_group={shard_group} is HSDP, ZeRO-3 inside each shard group: "
                         f"pass zero=3 (got zero={zero})")
    if layout.ep > 1:
        raise ValueError(f"shard_group={shard_group}: HSDP is modelled for dense models "
                         f"only; drop shard_group, or use ep = 1 (got ep = {layout.ep})")
    if copies % shard_group:
        fits = [g for g in range(1, copies + 1) if copies % g == 0]
        raise ValueError(f"shard_group={shard_group} does not divide the d x c = {copies} "
                         f"data-parallel ranks it groups: pick one of {fits}")


def check_inputs(model: Model, hardware: Hardware) -> None:
    """A clear error when the model or hardware is of the wrong kind."""
    if not isinstance(model, Model):
        raise ValueError(f"model must be a parlib.cost.Model, got {type(model).__name__} "
                         f"(for the course's ModelConfig use Model.from_config(cfg))")
    if not isinstance(hardware, Hardware):
        raise ValueError(f"hardware must be a parlib.cost.Hardware, got "
                         f"{type(hardware).__name__} (parlib.Cluster runs ranks here; "
                         f"parlib.cost.Hardware describes the machines a layout runs on)")


@dataclass(frozen=True)
class _Step:
    """What every part of one step's estimate reads: the inputs, the shapes one device works
    on (``b`` sequences a microbatch, ``s_local`` positions of each), the layers each
    pipeline rank holds, and the links each axis' groups run on."""

    model: Model
    hardware: Hardware
    layout: Layout
    m: int
    v: int
    global_batch: int
    zero: int
    recompute: bool | str
    sequence_parallel: bool
    mixed_precision: bool
    b: int
    s_local: int
    act_bytes: int
    per_stage: tuple[int, ...]
    spans: dict[str, int]
    links: dict[str, Any]
    rings: dict[str, Any]
    fused_attention: bool = False
    shard_group: int = 0  # HSDP: ZeRO-3 over groups of this many sync ranks (0: not HSDP)
    loss: str = "unfused"  # the cross-entropy's implementation (memory.LOSSES)

    @property
    def full(self) -> bool:
        return self.recompute is True

    @property
    def slowest(self) -> int:
        return max(self.per_stage)

    @property
    def passes(self) -> tuple[str, ...]:
        """The passes over each layer a microbatch makes: full recomputation a second
        forward."""
        return ("forward", "backward") + (("forward",) if self.full else ())

    @property
    def scores_stored(self) -> bool:
        """Whether attention writes its s x s scores to memory: not with a fused kernel
        (``fused_attention``, "selective", or context parallelism's blockwise attention)."""
        return (self.layout.cp == 1 and self.recompute != "selective"
                and not self.fused_attention)

    @property
    def split_sequence(self) -> bool:
        return self.sequence_parallel and self.layout.tp > 1


def _step(model: Model, hardware: Hardware, layout: Layout, m: int, v: int,
          global_batch: int, zero: int, recompute: bool | str, sequence_parallel: bool,
          mixed_precision: bool, fused_attention: bool = False,
          shard_group: int = 0, loss: str = "unfused") -> _Step:
    d, t, c = layout.dp, layout.tp, layout.cp
    spans = _spans(layout)
    # ring collectives (TP's all-reduces, the gradient sync over d x c) share a node's NICs
    sync_span = spans["dp"] if d > 1 else spans["cp"]
    return _Step(model, hardware, layout, m, v, global_batch, zero, recompute,
                 sequence_parallel, mixed_precision, b=global_batch // (d * m),
                 s_local=model.seq_len // c, act_bytes=2 if mixed_precision else 4,
                 per_stage=_stage_layers(model.n_layers, layout.pp, v), spans=spans,
                 links={k: hardware.link_for(span) for k, span in spans.items()},
                 rings={"tp": hardware.ring_link(spans["tp"], t),
                        "sync": hardware.ring_link(sync_span, d * c),
                        **_hsdp_rings(hardware, t, sync_span, d * c, shard_group)},
                 fused_attention=fused_attention, shard_group=shard_group, loss=loss)


def _hsdp_rings(hardware: Hardware, t: int, sync_span: int, sync: int, shard: int
                ) -> dict[str, Any]:
    """HSDP's two rings: a shard group, s sync ranks t apart (s x t consecutive ranks), and
    a replicate group, sync / s ranks strided over the whole sync span."""
    if not shard:
        return {}
    return {"shard": hardware.ring_link(shard * t, shard),
            "replicate": hardware.ring_link(sync_span, sync // shard)}


def _evaluate(model: Model, hardware: Hardware, layout: Layout, m: int, v: int,
              global_batch: int, zero: int, recompute: bool | str, sequence_parallel: bool,
              mixed_precision: bool, dp_overlap: bool = True,
              only_if_fits: bool = False, replicated_head: bool = False,
              extra_recompute_flops_per_token: float = 0.0,
              grad_reduce_bytes: int | None = None,
              fused_attention: bool = False, shard_group: int = 0,
              loss: str = "unfused", host_seconds_per_layer: float = 0.0
              ) -> Estimate | None:
    """The estimate, inputs already checked (the planner calls this directly, with
    ``only_if_fits``: None, before any time is worked out, when the memory does not fit).
    One helper per part, in the order of a step: memory, compute, memory-bound work and
    the optimizer step, then each axis' communication (tp, cp, ep, pp, dp)."""
    step = _step(model, hardware, layout, m, v, global_batch, zero, recompute,
                 sequence_parallel, mixed_precision, fused_attention, shard_group, loss)
    total, stage, params_per_device, experts_per_device, memory = _memory(step,
                                                                          replicated_head)
    if only_if_fits and total > hardware.memory_bytes:
        return None
    model_flops, hardware_flops = _flops(step, extra_recompute_flops_per_token)
    compute, stage_compute = _compute(step, hardware_flops, replicated_head)
    memory_bound = _memory_bound(step) + _gradient_cast(step, params_per_device
                                                        + experts_per_device,
                                                        grad_reduce_bytes)
    optimizer_step = _optimizer_step(step, memory)
    tp_comm, tp_bytes = _tensor_parallel(step)
    cp_total, cp_hidden, cp_bytes = _context_parallel(step)
    ep_comm, ep_bytes = _expert_parallel(step)
    busy = compute + memory_bound + tp_comm + (cp_total - cp_hidden) + ep_comm
    host = host_seconds_per_layer * step.m * step.slowest  # the busiest stage's passes
    pp_bubble, pp_send, pp_bytes = _pipeline(step, busy + host, compute, stage_compute)
    dp_total, dp_hidden, dp_bytes = _data_parallel(
        step, busy, (model_flops, hardware_flops), params_per_device, experts_per_device,
        grad_reduce_bytes)
    if not dp_overlap:
        dp_hidden = 0.0
    # the compute that runs beside a hidden collective runs slower: the hidden seconds cost
    # overlap_slowdown of themselves again (charged with the part they hide in)
    dp_slowdown = hardware.overlap_slowdown * dp_hidden
    cp_slowdown = hardware.overlap_slowdown * cp_hidden
    time = {"compute": compute, "memory_bound": memory_bound, "host": host,
            "tp_comm": tp_comm,
            "cp_comm": cp_total - cp_hidden + cp_slowdown, "ep_comm": ep_comm,
            "cp_comm_total": cp_total, "cp_comm_hidden": cp_hidden,
            "cp_overlap_cost": cp_slowdown, "pp_bubble": pp_bubble,
            "pp_send": pp_send, "dp_sync": dp_total - dp_hidden + dp_slowdown,
            "dp_sync_total": dp_total, "dp_sync_hidden": dp_hidden,
            "dp_overlap_cost": dp_slowdown, "optimizer": optimizer_step}
    sync_span = step.spans["dp"] if layout.dp > 1 else step.spans["cp"]
    return Estimate(model=model, hardware=hardware, layout=layout, m=m, v=v,
                    global_batch=global_batch, zero=zero, recompute=recompute,
                    micro_batch=step.b, memory=memory, time=time,
                    bytes_sent={"pp": pp_bytes, "dp": dp_bytes, "cp": cp_bytes, "tp": tp_bytes,
                                **({"ep": ep_bytes} if layout.ep > 1 else {})},
                    links=_links(hardware, layout, step.spans), stage=stage,
                    model_flops=model_flops, hardware_flops=hardware_flops,
                    stage_layers=list(step.per_stage),
                    crossing={"tp": hardware.ring_crossing_share(step.spans["tp"], layout.tp),
                              "dp": (_hsdp_crossing(step, params_per_device,
                                                    grad_reduce_bytes) if shard_group else
                                     hardware.ring_crossing_share(sync_span,
                                                                  layout.dp * layout.cp))},
                    shard_group=shard_group)


# ---- memory: of the first, the last and the fullest middle stages; the largest counts

def _layer_weights(step: _Step) -> tuple[float, float]:
    """A layer's weights on one ep rank: the dense part (attention, norms, router) whole,
    the experts split e ways (their copies d x c / e)."""
    model = step.model
    return (model.layer_params - model.layer_expert_params,
            model.layer_expert_params / step.layout.ep)


def _stages(step: _Step, replicated_head: bool) -> dict[str, tuple[float, float, float]]:
    """Per stage worth checking: (layers, layers' worth of activations held, parameters)."""
    model, t, p, v, m = step.model, step.layout.tp, step.layout.pp, step.v, step.m
    L, per_stage, slowest = model.n_layers, step.per_stage, step.slowest
    dense_layer = _layer_weights(step)[0]
    tied_copy = model.vocab_size * model.d_model if model.tied_embeddings and p > 1 else 0
    # the embedding and output layer's parameters: split t ways, or whole on every tp rank
    ends = t if replicated_head else 1
    if p == 1:
        return {"only": (L, L, L * dense_layer + ends * (model.embedding_params
                                                         + model.head_params))}
    # the first stage holds the most microbatches in flight, stage i of 1F1B min(m, p - i)
    first = per_stage[0]
    stages = {"first": (first, in_flight_microbatches(p, m, v) * first / v,
                        first * dense_layer + ends * model.embedding_params),
              "last": (per_stage[-1], per_stage[-1],
                       per_stage[-1] * dense_layer + ends * (model.head_params + tied_copy))}
    if L % (p * v):  # uneven: a middle stage may hold more layers than the first
        fullest = next((i for i in range(1, p - 1) if per_stage[i] == slowest), None)
        for i in {1, fullest} - {None}:
            if i < p - 1:
                # rank i of 1F1B holds min(m, p - i) microbatches; interleaved, Megatron's
                # warm-up leaves it min(v m, 2 (p - i - 1) + (v - 1) p + 1) chunks
                held = (min(m, p - i) if v == 1 else
                        min(v * m, 2 * (p - i - 1) + (v - 1) * p + 1) / v)
                stages[f"stage {i + 1} of {p}"] = (
                    per_stage[i], held * per_stage[i], per_stage[i] * dense_layer)
    return stages


def _activations(step: _Step) -> tuple[float, float, float]:
    """Bytes of one layer's stored activations, of the layer being recomputed (full
    recomputation) and of the logits, for one microbatch on one device."""
    model, t, c = step.model, step.layout.tp, step.layout.cp
    mode = {False: "none", "selective": "selective", True: "full",
            OP_POLICY: OP_POLICY}[step.recompute]
    if not step.scores_stored and mode == "none":
        mode = "selective"  # fused or blockwise attention stores no scores
    shape = dict(t=t, sequence_parallel=step.split_sequence, dtype_bytes=step.act_bytes,
                 dropout=model.dropout, ffn_dim=model.activation_ffn_dim,
                 kv_dim=model.kv_dim, gated_mlp=model.gated_mlp)
    args = (step.s_local, step.b, model.d_model, model.n_heads)
    per_layer = activation_bytes_per_layer(*args, recompute=mode, **shape)
    if c > 1 and not step.full and step.recompute != OP_POLICY:  # "op" counts its own
        per_layer += model.n_heads / t * step.s_local * step.b * LSE_BYTES
    working = 0.0
    whole = activation_bytes_per_layer(
        *args, **shape, **({} if step.scores_stored else {"recompute": "selective"}))
    if step.full:  # the layer being recomputed holds its whole activations during backward
        working = whole
    elif step.recompute == OP_POLICY:  # ... and under "op" what it reruns beside what it kept
        working = max(0.0, whole - per_layer)
    # the loss's backward peak, held beside every layer's activations as the backward starts
    logits = loss_peak_bytes(step.s_local, step.b, model.vocab_size, t=t,
                             dtype_bytes=step.act_bytes, loss=step.loss)
    return per_layer, working, logits


def _memory(step: _Step, replicated_head: bool
            ) -> tuple[float, str, float, float, dict[str, float]]:
    """(total bytes, stage, its parameters and expert parameters per device, its memory by
    part) of the stage that needs the most memory."""
    d, t, c, e = step.layout.dp, step.layout.tp, step.layout.cp, step.layout.ep
    expert_layer = _layer_weights(step)[1]
    per_layer, working, logits = _activations(step)
    candidates = []
    for stage, (layers, held, params) in _stages(step, replicated_head).items():
        states = model_state_bytes_by_kind(params / t, step.shard_group or d * c, step.zero,
                                           step.mixed_precision)
        if expert_layer:
            experts = model_state_bytes_by_kind(layers * expert_layer / t, d * c // e,
                                                step.zero, step.mixed_precision)
            states = {k: states[k] + experts[k] for k in states}
        states["activations"] = layers * per_layer + working + (
            logits if stage in ("only", "last") else 0.0)
        states["pipeline_in_flight"] = (held - layers) * per_layer
        candidates.append((sum(states.values()), stage, params / t,
                           layers * expert_layer / t, {k: states[k] for k in MEMORY_PARTS}))
    return max(candidates, key=lambda row: row[0])


# ---- compute, memory-bound work and the optimizer step

def _flops(step: _Step, extra_recompute_flops_per_token: float) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a step: the latter with recomputation and the
    experts' padded buffers."""
    model, tokens = step.model, step.global_batch * step.model.seq_len
    model_flops = model.flops_per_token * tokens
    extra = {False: 0, "selective": model.attention_flops_per_token,
             True: model.layers_forward_flops_per_token}.get(step.recompute, 0)
    if step.recompute == OP_POLICY:
        extra = model.op_policy_flops_per_token
    hardware_flops = model_flops + (extra + extra_recompute_flops_per_token) * tokens
    capacity = model.capacity_factor if model.is_moe and model.capacity_factor else 1.0
    if capacity != 1.0:  # experts compute their padded buffers (or skip the dropped tokens)
        expert_forward = model.n_layers * 2 * model.top_k * model.expert_matmul_params * tokens
        hardware_flops += (capacity - 1) * expert_forward * (
            1 + BACKWARD_PER_FORWARD + (1 if step.full else 0))
    return model_flops, hardware_flops


def _compute(step: _Step, hardware_flops: float, replicated_head: bool
             ) -> tuple[float, list[float]]:
    """Seconds of compute of the busiest device, and per stage where the stages differ
    (``replicated_head``)."""
    model, hardware, layout = step.model, step.hardware, step.layout
    n, t, c, e, p, L = (hardware.n_devices, layout.tp, layout.cp, layout.ep, layout.pp,
                        model.n_layers)
    tokens = step.global_batch * model.seq_len
    # the layers' FLOPs wait for the slowest stage; the output layer's stay spread evenly
    head_flops = (1 + BACKWARD_PER_FORWARD) * 2 * model.vocab_size * model.d_model * tokens
    rows = step.b * step.s_local
    layer_rate, head_rate = _matmul_rates(model, rows, t, c, e, hardware.multiprocessors)
    if not replicated_head:
        imbalance = step.slowest * p / L
        return ((hardware_flops - head_flops) * imbalance / layer_rate
                + head_flops / head_rate) / n / hardware.achievable_flops, []
    # the last stage's t ranks each compute the whole output layer
    head_rate = _matmul_rates(model, rows, 1, c, e, hardware.multiprocessors)[1]
    layers_flops = (hardware_flops - head_flops) / L / (n / p)  # per layer, per device
    stage_compute = [(layers * layers_flops / layer_rate
                      + (head_flops * t * p / n / head_rate if i == p - 1 else 0.0))
                     / hardware.achievable_flops for i, layers in enumerate(step.per_stage)]
    return max(stage_compute), stage_compute


def _memory_bound(step: _Step) -> float:
    """Seconds of memory-bound work: bytes over memory bandwidth, every layer, every
    microbatch, and the loss over the logits (spread evenly as the output layer's FLOPs)."""
    model = step.model
    moved = memory_bound_bytes_per_layer(
        step.s_local, step.b, model.d_model, model.n_heads, t=step.layout.tp,
        sequence_parallel=step.split_sequence, dtype_bytes=step.act_bytes,
        ffn_dim=model.activation_ffn_dim, gated_mlp=model.gated_mlp, dropout=model.dropout,
        scores_stored=step.scores_stored)
    # full recomputation and the per-operation policy rerun every memory-bound op
    forwards = 1 + (1 if step.full or step.recompute == OP_POLICY else 0)
    tokens = step.global_batch * model.seq_len
    loss = (tokens * loss_bytes_per_token(model.vocab_size, dtype_bytes=step.act_bytes)
            / step.hardware.n_devices)
    return ((step.m * step.slowest * moved * (forwards + MEMORY_BOUND_BACKWARD_PER_FORWARD)
             + loss) / step.hardware.achievable_memory_bandwidth)


def _gradient_cast(step: _Step, unsharded_params: float, grad_reduce_bytes: int | None
                   ) -> float:
    """Seconds of casting the gradients to a wider dtype before they are reduced
    (:func:`~parlib.cost.memory.gradient_cast_bytes_per_param`): every gradient element the
    rank computes (its stage's weights, unsharded), before each reduction: every microbatch
    with ZeRO-2 and ZeRO-3 (each reduce-scatters per microbatch), once a step otherwise."""
    grad_bytes = step.act_bytes
    if grad_reduce_bytes is None or grad_reduce_bytes <= grad_bytes:
        return 0.0
    reductions = step.m if step.zero >= 2 else 1
    moved = reductions * unsharded_params * gradient_cast_bytes_per_param(grad_bytes,
                                                                         grad_reduce_bytes)
    return moved / step.hardware.achievable_streaming_bandwidth


def _optimizer_step(step: _Step, memory: dict[str, float]) -> float:
    """Seconds of Adam's pass over the state this rank updates (its optimizer shard), once a
    step after the sync: outside every microbatch, so no bubble scales it."""
    per_param = model_state_bytes_per_param(step.mixed_precision)["optimizer"]
    updated = memory["optimizer"] / per_param
    return (updated * optimizer_step_bytes_per_param(step.mixed_precision)
            / step.hardware.achievable_streaming_bandwidth)


# ---- communication, one helper per axis: seconds (and hidden seconds) and bytes sent

def _tensor_parallel(step: _Step) -> tuple[float, float]:
    """All-reduces of (b, s, h) per layer, every microbatch, on the critical path."""
    t = step.layout.tp
    if t == 1:
        return 0.0, 0.0
    h, ring = step.model.d_model, step.rings["tp"]
    per_layer_count = sum(ALL_REDUCES_PER_LAYER[x] for x in step.passes)
    one_all_reduce = collective_time("all_reduce",
                                     tp_message_bytes(step.b, step.s_local, h, step.act_bytes),
                                     t, ring.alpha, ring.beta,
                                     half_bytes=step.hardware.collective_half_bytes,
                                     algorithm="nccl")
    layers = step.m * step.slowest
    return (layers * per_layer_count * one_all_reduce,
            layers * tp_sent_bytes_per_layer(step.b, step.s_local, h, t, step.act_bytes,
                                             step.passes))


def _context_parallel(step: _Step) -> tuple[float, float, float]:
    """Ring attention's K/V blocks: (seconds, of them hidden, bytes); each step's transfer
    behind that step's block of attention compute (1/c of the layer's attention)."""
    model, t, c = step.model, step.layout.tp, step.layout.cp
    if c == 1:
        return 0.0, 0.0, 0.0
    kv_per_rank = model.kv_dim / t  # tensor parallelism splits the K/V heads too
    block = kv_block_bytes(step.b, model.seq_len, kv_per_rank, c, step.act_bytes)
    attn_step = (model.layer_attention_flops_per_token * step.b * step.s_local / t / c
                 / step.hardware.achievable_flops)
    link = step.links["cp"]
    fwd = message_time(block, link.alpha, link.beta)  # one K/V block per step
    bwd = message_time(2 * block, link.alpha, link.beta)  # the block and its gradient
    n_fwd = step.passes.count("forward")
    layers = step.m * step.slowest
    total = layers * ((c - 1) * (n_fwd * fwd + bwd))
    hidden = layers * ((c - 1) * (n_fwd * min(fwd, attn_step)
                                  + min(bwd, BACKWARD_PER_FORWARD * attn_step)))
    sent = layers * ring_attention_sent_bytes_per_layer(
        step.b, model.seq_len, kv_per_rank, c, step.act_bytes, step.passes)
    return total, hidden, sent


def _expert_parallel(step: _Step) -> tuple[float, float]:
    """Per MoE layer per microbatch a dispatch and a combine all-to-all in forward, their
    gradients in backward, on the critical path."""
    model, e = step.model, step.layout.ep
    if e == 1:
        return 0.0, 0.0
    capacity = model.capacity_factor if model.is_moe and model.capacity_factor else 1.0
    tokens_here = step.b * step.s_local / step.layout.tp  # tp ranks dispatch a share each
    per_layer_bytes = capacity * ep_all_to_all_bytes_per_layer(
        tokens_here, model.d_model, model.top_k, step.act_bytes, step.passes)
    count = 2 * len(step.passes)  # dispatch and combine, each pass
    link = step.links["ep"]
    one = collective_time("all_to_all", per_layer_bytes / count, e, link.alpha, link.beta,
                          half_bytes=step.hardware.collective_half_bytes)
    layers = step.m * step.slowest
    return layers * count * one, layers * per_layer_bytes * (e - 1) / e  # the share leaving


def _pipeline(step: _Step, busy: float, compute: float, stage_compute: list[float]
              ) -> tuple[float, float, float]:
    """(bubble, boundary sends, bytes sent): the bubble a share of the busy time; the fill
    and drain pass through the other, lighter stages where the stages differ."""
    p, v, m = step.layout.pp, step.v, step.m
    if p == 1:
        return 0.0, 0.0, 0.0
    f = bubble_fraction(p, m, v)
    bubble = busy * f / (1 - f)
    if stage_compute:
        others = sorted(stage_compute)[:-1]
        bubble = (busy - compute + sum(others) / len(others)) * f / (1 - f)
    boundary = boundary_bytes(step.b, step.s_local, step.model.d_model,
                              step.act_bytes) / step.layout.tp
    link = step.links["pp"]
    slots = v * m + p - 1
    return (bubble, 2 * slots * message_time(boundary, link.alpha, link.beta),
            2 * v * m * boundary)


def _data_parallel(step: _Step, busy: float, flops: tuple[float, float],
                   params_per_device: float, experts_per_device: float,
                   grad_reduce_bytes: int | None) -> tuple[float, float, float]:
    """The gradient sync over d x c (cp ranks hold the same weights; the experts' gradients
    over their d x c / e copies): (seconds, of them hidden behind backward, bytes).
    ``flops``: the step's (model, hardware) FLOPs, whose ratio is the share of ``busy``
    that makes gradients."""
    if step.shard_group:
        return _hsdp_data_parallel(step, busy, flops, params_per_device, grad_reduce_bytes)
    model_flops, hardware_flops = flops
    ops_seconds, forward_gathers, exposed_floor, sent = _sync_collectives_timed(
        step, params_per_device, experts_per_device, grad_reduce_bytes)
    total = ops_seconds
    backward_share = busy * (model_flops / hardware_flops) * (2 / 3)  # all microbatches'
    if step.zero == 3:
        # by phase: the forwards' gathers behind forward compute (1/3 of the model FLOPs),
        # the backwards' gathers and reduce-scatters behind the rest, recomputation included;
        # the first gather of each forward and of each backward and the last reduce-scatter
        # wait for nothing to hide behind
        forward = busy * model_flops / (1 + BACKWARD_PER_FORWARD) / hardware_flops
        hidden = min(forward_gathers, forward) + min(total - forward_gathers, busy - forward)
        hidden = max(0.0, min(hidden, total - exposed_floor))
    elif step.zero == 2:
        # every microbatch's gradients are reduce-scattered during its own backward
        hidden = min(total, backward_share)
    else:
        # Gradients of the last microbatch appear during its backward: 2/3 of its model
        # FLOPs (recomputed forwards produce no gradients, so they widen no window).
        hidden = min(total, backward_share / step.m)
    return total, hidden, sent


def _sync_collectives_timed(step: _Step, params_per_device: float, experts_per_device: float,
                            grad_reduce_bytes: int | None
                            ) -> tuple[float, float, float, float]:
    """The sync's collectives timed: (seconds, ZeRO-3's forward gathers among them, the
    part no compute can hide (one unit's each, ZeRO-3), bytes sent)."""
    d, c, e, t = step.layout.dp, step.layout.cp, step.layout.ep, step.layout.tp
    dense_layer, expert_layer = _layer_weights(step)
    group_all, link, half = d * c, step.rings["sync"], step.hardware.collective_half_bytes
    total = forward_gathers = exposed_floor = sent = 0.0
    for group, weights, unit_weights in ((group_all, params_per_device, dense_layer / t),
                                         (group_all // e, experts_per_device,
                                          expert_layer / t)):
        if group == 1 or not weights:
            continue
        root = max(0.0, weights - step.slowest * unit_weights)  # embedding, output layer
        per = model_state_bytes_by_kind(weights, 1, 0, step.mixed_precision)
        grad_bytes = per["grads"] / weights if grad_reduce_bytes is None else grad_reduce_bytes
        param_bytes = per["params"] / weights
        ops = sync_collectives(step.slowest, unit_weights, root, group, step.zero, step.m,
                               grad_bytes, param_bytes)
        seconds = [k * collective_time(op, nbytes, group, link.alpha, link.beta,
                                       half_bytes=half, algorithm="nccl")
                   for k, op, nbytes in ops]
        if step.zero == 3:  # ops: the forwards' gathers, the backwards' gathers, the scatters
            forward_gathers += seconds[0] + seconds[1]
            exposed_floor += sum(collective_time(op, unit_weights * nb, group, link.alpha,
                                                 link.beta, half_bytes=half)
                                 for op, nb in (("all_gather", param_bytes),
                                                ("all_gather", param_bytes),
                                                ("reduce_scatter", grad_bytes))) * step.m
        total += sum(seconds)
        sent += sum(k * predicted_sent_bytes(op, nbytes, group) for k, op, nbytes in ops)
    return total, forward_gathers, exposed_floor, sent


def _hsdp_data_parallel(step: _Step, busy: float, flops: tuple[float, float],
                        weights: float, grad_reduce_bytes: int | None
                        ) -> tuple[float, float, float]:
    """:func:`_data_parallel` for HSDP (a dense model): (seconds, hidden, bytes). ZeRO-3's
    collectives in the shard group hide as ZeRO-3's do; the all-reduces across the copies
    run on other links (the NICs) during the last microbatch's backward (the pieces
    accumulate before it), so they hide behind that backward alone."""
    seconds, forward_gathers, exposed, sent = _hsdp_collectives_timed(step, weights,
                                                                      grad_reduce_bytes)
    model_flops, hardware_flops = flops
    forward = busy * model_flops / (1 + BACKWARD_PER_FORWARD) / hardware_flops
    last_backward = busy * (model_flops / hardware_flops) * (2 / 3) / step.m
    hidden = (min(forward_gathers, forward)
              + min(seconds["shard"] - forward_gathers, busy - forward)
              + min(seconds["replicate"], last_backward))
    total = seconds["shard"] + seconds["replicate"]
    return total, max(0.0, min(hidden, total - exposed)), sum(sent.values())


def _hsdp_collectives_timed(step: _Step, weights: float, grad_reduce_bytes: int | None
                            ) -> tuple[dict[str, float], float, float, dict[str, float]]:
    """HSDP's collectives (:func:`hsdp_collectives`) timed, each on its group's ring: (seconds
    by axis, the forwards' gathers among them, the part no compute can hide, bytes sent by
    axis; the axes "shard" and "replicate")."""
    s, t = step.shard_group, step.layout.tp
    copies, unit = step.layout.dp * step.layout.cp // s, _layer_weights(step)[0] / t
    root = max(0.0, weights - step.slowest * unit)
    per = model_state_bytes_by_kind(weights, 1, 0, step.mixed_precision)
    grad_bytes = per["grads"] / weights if grad_reduce_bytes is None else grad_reduce_bytes
    param_bytes = per["params"] / weights
    size = {"shard": s, "replicate": copies}

    def time(op: str, nbytes: float, axis: str) -> float:
        ring = step.rings[axis]
        return collective_time(op, nbytes, size[axis], ring.alpha, ring.beta,
                               half_bytes=step.hardware.collective_half_bytes,
                               algorithm="nccl")

    seconds, sent = {"shard": 0.0, "replicate": 0.0}, {"shard": 0.0, "replicate": 0.0}
    ops = hsdp_collectives(step.slowest, unit, root, s, step.m, grad_bytes, param_bytes)
    for k, op, nbytes, axis in ops:
        seconds[axis] += k * time(op, nbytes, axis)
        sent[axis] += k * predicted_sent_bytes(op, nbytes, size[axis])
    forward_gathers = sum(k * time(op, nbytes, axis) for k, op, nbytes, axis in ops[:2])
    # the first gather of each forward and backward, the last reduce-scatter and all-reduce
    exposed = step.m * sum(time(op, unit * nb, "shard") for op, nb in (
        ("all_gather", param_bytes), ("all_gather", param_bytes),
        ("reduce_scatter", grad_bytes))) + time("all_reduce", unit / s * grad_bytes,
                                                "replicate")
    return seconds, forward_gathers, exposed, sent


def _hsdp_crossing(step: _Step, weights: float, grad_reduce_bytes: int | None) -> float:
    """The share of HSDP's sync bytes that leave the node: each group's ring share
    (:meth:`Hardware.ring_crossing_share`), weighted by the bytes it sends."""
    sent = _hsdp_collectives_timed(step, weights, grad_reduce_bytes)[3]
    t, s, sync = step.layout.tp, step.shard_group, step.layout.dp * step.layout.cp
    sync_span = sync * t
    share = {"shard": step.hardware.ring_crossing_share(s * t, s),
             "replicate": step.hardware.ring_crossing_share(sync_span, sync // s)}
    total = sum(sent.values())
    return sum(sent[a] * share[a] for a in sent) / total if total else 0.0


def hsdp_collectives(layers: int, unit_weights: float, root_weights: float, shard: int,
                     m: int, grad_bytes: float, param_bytes: float
                     ) -> list[tuple[int, str, float, str]]:
    """HSDP's sync of one step as (count, op, bytes of one collective, axis): ZeRO-3's six
    entries (:func:`sync_collectives`) on the ``"shard"`` group of ``shard`` ranks, then one
    all-reduce per unit of its 1/s gradient piece on the ``"replicate"`` group, once a step
    (the pieces accumulate over the m microbatches, as FSDP2's
    ``set_requires_all_reduce(False)`` on all but the last). For m = 1 its bytes are
    :func:`parlib.cost.sharded.hsdp_sent_bytes_per_step`'s."""
    zero3 = sync_collectives(layers, unit_weights, root_weights, shard, 3, m, grad_bytes,
                             param_bytes)
    units = ((layers, unit_weights), (int(bool(root_weights)), root_weights))
    return ([(k, op, nbytes, "shard") for k, op, nbytes in zero3]
            + [(k, "all_reduce", w / shard * grad_bytes, "replicate") for k, w in units])


# Megatron-LM's gradient buckets: max(40M, 1M x data-parallel size) elements per bucket
# (megatron/core/distributed/distributed_data_parallel.py, bucket_size); every stage-0-2
# sync is charged in buckets of that size, each a collective of its own.
BUCKET_ELEMENTS = 40_000_000
BUCKET_ELEMENTS_PER_RANK = 1_000_000


def bucket_elements(group: int) -> int:
    """Elements per gradient bucket for a sync over ``group`` ranks: max(40M, 1M x group)."""
    return max(BUCKET_ELEMENTS, BUCKET_ELEMENTS_PER_RANK * group)


def sync_collectives(layers: int, unit_weights: float, root_weights: float, group: int,
                     zero: int, m: int, grad_bytes: float,
                     param_bytes: float) -> list[tuple[int, str, float]]:
    """The data-parallel sync of one step as (count, op, bytes of one collective): one
    collective per unit or bucket, never one for the whole model.

    A rank holds ``layers`` layers of ``unit_weights`` elements each plus ``root_weights``
    (embedding, output layer), synced over ``group`` ranks, ``m`` microbatches a step,
    gradients sent at ``grad_bytes`` per element and weights at ``param_bytes``.
    ZeRO-0: one all-reduce per bucket (:func:`bucket_elements`); ZeRO-1: one reduce-scatter
    and one all-gather per bucket; ZeRO-2 as ZeRO-1 but the gradients reduce-scattered every
    microbatch (sharded gradients cannot accumulate whole: m reduce-scatters a step);
    ZeRO-3 (FSDP) per unit (each layer, and the root's weights as one more unit), every
    microbatch: an all-gather before the forward, another before the backward, a
    reduce-scatter after it. ZeRO-3's list is always six entries: the forwards' gathers
    (layers, root), the backwards' (layers, root), the reduce-scatters (layers, root)."""
    if zero == 3:
        units = ((m * layers, unit_weights), (m * bool(root_weights), root_weights))
        gathers = [(k, "all_gather", w * param_bytes) for k, w in units]
        return gathers + gathers + [(k, "reduce_scatter", w * grad_bytes) for k, w in units]
    weights = layers * unit_weights + root_weights
    size = bucket_elements(group)
    full, rest = divmod(weights, size)
    buckets = [(int(full), size)] * bool(full) + [(1, rest)] * bool(rest > 0)
    if zero == 0:
        return [(k, "all_reduce", w * grad_bytes) for k, w in buckets]
    scatters = m if zero == 2 else 1
    return ([(scatters * k, "reduce_scatter", w * grad_bytes) for k, w in buckets]
            + [(k, "all_gather", w * param_bytes) for k, w in buckets])


@lru_cache(maxsize=16384)
def _matmul_rates(model: Model, rows: int, t: int, c: int, e: int,
                  multiprocessors: int) -> tuple[float, float]:
    """The fractions of the best matmul rate a layer's and the output layer's per-device
    matmuls reach (FLOP-weighted over the layer's shapes): 1 without multiprocessors."""
    if not multiprocessors:
        return 1.0, 1.0
    h, hd, s_local = model.d_model, model.head_dim, model.seq_len // c
    heads = model.n_heads // t
    b = max(1, rows // s_local)
    shapes = [(rows, h, (h + 2 * model.kv_dim) // t, 1), (rows, h // t, h, 1),
              (s_local, hd, s_local, b * heads * c), (s_local, s_local, hd, b * heads * c)]
    gate = 2 if model.gated_mlp else 1
    if model.is_moe:
        per_expert = max(1, round(rows * e * model.top_k / model.n_experts
                                  * (model.capacity_factor or 1.0)))
        local = model.n_experts // e
        f = model.expert_ffn_dim
        shapes += [(per_expert, h, gate * f // t, local), (per_expert, f // t, h, local)]
    else:
        f = model.ffn_dim
        shapes += [(rows, h, gate * f // t, 1), (rows, f // t, h, 1)]
    flops = [2 * m * k * n * batch for m, k, n, batch in shapes]
    seconds = [fl / shape_efficiency(m, k, n, batch=batch, multiprocessors=multiprocessors)
               for fl, (m, k, n, batch) in zip(flops, shapes)]
    head = shape_efficiency(rows, h, max(1, model.vocab_size // t),
                            multiprocessors=multiprocessors)
    return sum(flops) / sum(seconds), head


@lru_cache(maxsize=4096)
def _spans(layout: Layout) -> dict[str, int]:
    """Consecutive ranks a group of each axis spans (ep's only where it splits)."""
    spans = {k: layout.span(k) for k in layout}
    if layout.ep > 1:
        spans["ep"] = layout.span("ep")
    return spans


@lru_cache(maxsize=1024)
def _stage_layers(n_layers: int, p: int, v: int = 1) -> tuple[int, ...]:
    return tuple(rank_layers(n_layers, p, v))


def _links(hardware: Hardware, layout: Layout, spans: dict[str, int]) -> dict[str, str]:
    where = {k: _where(hardware, span, layout[k]) for k, span in spans.items()}
    if layout.dp == 1 and layout.cp > 1:  # the gradient sync ("dp") runs over the cp group
        where["dp"] = where["cp"]
    return where


def _where(hardware: Hardware, span: int, degree: int) -> str:
    if degree == 1:
        return "none"
    return "intra-node" if hardware.in_one_node(span) else "inter-node"


__all__ = ["BUCKET_ELEMENTS", "BUCKET_ELEMENTS_PER_RANK", "MEMORY_PARTS", "OP_POLICY",
           "RECOMPUTE", "STEP_PARTS", "ZERO3_WITH_PIPELINE", "Estimate", "bucket_elements",
           "check_layout", "check_hsdp", "estimate", "hsdp_collectives", "sync_collectives"]
