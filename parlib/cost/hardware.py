"""Hardware described by the numbers the cost model needs: memory, compute rate, two links.

:class:`Hardware` is the machines a layout would run on (not to be confused with
:class:`parlib.Cluster`, which keeps ranks warm here).

Devices sit in nodes of ``devices_per_node``; a fast link joins devices inside a node
(NVLink), a slower one joins nodes (InfiniBand, one NIC per GPU). A :class:`Link` is the
alpha-beta model of the launching chapter: ``alpha`` seconds per message, ``bandwidth`` bytes/s that
one device can push in one direction.

A ring collective over ranks in several nodes does not push every byte through one NIC:
NCCL runs several rings at once, each leaving a node through a different NIC, so a group
with g ranks in each node sends 1/g of each rank's bytes over the network and the rest over
NVLink (:meth:`Hardware.ring_link`). The node's NICs are shared by all the groups that run
at once: g ranks of a group in a node share g NICs' worth.

Preset figures are from the vendors' datasheets named next to them. Latency (alpha) is
not on any datasheet: the presets assume a few microseconds per ring step, which only
matters for messages under about a megabyte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from parlib.cost.collectives import bus_bandwidth, collective_time, per_link_alpha_beta
from parlib.cost.efficiency import INTRA_NODE_ALPHA, achievable

GB = 10**9  # datasheets' GB (decimal)


@dataclass(frozen=True)
class Link:
    """One device's link: ``alpha`` seconds per message, ``bandwidth`` bytes/s one way."""

    alpha: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not self.alpha >= 0:
            raise ValueError(f"Link alpha must be >= 0 seconds, got {self.alpha!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")

    @property
    def beta(self) -> float:
        """Seconds per byte: 1 / bandwidth."""
        return 1.0 / self.bandwidth

    def slowed_by(self, alpha: float, beta: float) -> Link:
        """This link with ``alpha`` seconds per message and ``beta`` seconds per byte added
        (what an emulated delay on top of it makes: the times add)."""
        if alpha < 0 or beta < 0:
            raise ValueError(f"an added delay must be >= 0, got alpha={alpha!r}, beta={beta!r}")
        return Link(alpha=self.alpha + alpha, bandwidth=1.0 / (self.beta + beta))


def _achievable(generation: str) -> dict[str, Any]:
    """A preset's fields from its generation's row of the efficiency table."""
    row = achievable(generation)
    return {"generation": generation,
            "compute_efficiency": row.matmul_fraction * row.training_matmul,
            "memory_efficiency": row.memory_bandwidth, "multiprocessors": row.multiprocessors,
            "streaming_efficiency": row.streaming_bandwidth,
            "intra_node_efficiency": row.nvlink_bandwidth,
            "collective_half_bytes": row.collective_half_bytes,
            "overlap_slowdown": row.overlap_slowdown}


@dataclass(frozen=True)
class Hardware:
    """``n_devices`` devices in nodes of ``devices_per_node``.

    ``memory_bytes`` and ``peak_flops`` are per device (peak at the training dtype).
    ``compute_efficiency`` is the fraction of peak the matmuls really run at: 1.0 means "at
    peak"; the presets take their generation's achievable fraction
    (:data:`parlib.cost.efficiency.ACHIEVABLE`, the best measured matmul over the datasheet,
    times the share of it published training runs reached); ``measured_here`` folds the measured
    rate into ``peak_flops`` instead. ``memory_bandwidth`` is the device memory's bytes/s
    (datasheet), of which ``memory_efficiency`` is reached by the layers' memory-bound
    operations (norms, softmax, elementwise; the presets: the share published runs reached per
    byte the model counts), charged bytes over that rate, and ``streaming_efficiency`` by large
    streaming kernels (the optimizer step, a cast of all the gradients). The default bandwidth,
    infinite, charges them nothing (the model before they were counted). ``generation`` names
    the device's row of the efficiency table ("A100", "H100", ...; "" when none applies).
    ``multiprocessors`` (the presets: their generation's SM count) makes the matmul rate depend
    on shape: a matmul's output tiles run in waves over the SMs and small matmuls lose a larger
    share to the last, partly empty wave (:func:`parlib.cost.efficiency.matmul_time`); 0 runs
    every shape at ``achievable_flops``. ``intra_node_efficiency`` is the fraction of
    ``intra_node``'s (datasheet) bandwidth collectives reach inside a node (the presets: their
    generation's measured NVLink fraction); :meth:`link_for` returns the node's link at that
    rate. ``collective_half_bytes`` (the presets: 1.8 MiB, fitted to a measured all-reduce curve
    under this model's latency) charges each collective at the bus bandwidth of its message's
    size, half the link's at that size (:func:`parlib.cost.collectives.size_efficiency`); 0
    charges every size at the link's rate. ``overlap_slowdown`` (the presets: 0.189, a published
    measurement) is how much longer compute takes while a collective runs beside it: every
    second of communication hidden behind compute costs that much compute time.
    """

    n_devices: int
    devices_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node: Link
    inter_node: Link
    compute_efficiency: float = 1.0
    name: str = ""
    memory_bandwidth: float = math.inf
    memory_efficiency: float = 1.0
    generation: str = ""
    multiprocessors: int = 0
    intra_node_efficiency: float = 1.0
    collective_half_bytes: float = 0.0
    overlap_slowdown: float = 0.0
    streaming_efficiency: float = 1.0

    def __post_init__(self) -> None:
        for field in ("n_devices", "devices_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.n_devices > self.devices_per_node and self.n_devices % self.devices_per_node:
            raise ValueError(f"n_devices={self.n_devices} is not a whole number of nodes of "
                             f"{self.devices_per_node}")
        if not self.memory_bytes > 0:
            raise ValueError(f"memory_bytes must be > 0, got {self.memory_bytes!r}")
        if not self.peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0, got {self.peak_flops!r}")
        for field in ("compute_efficiency", "memory_efficiency", "intra_node_efficiency",
                      "streaming_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"{field} must be in (0, 1], got {value!r}")
        if isinstance(self.multiprocessors, bool) or not isinstance(
                self.multiprocessors, int) or self.multiprocessors < 0:
            raise ValueError(f"multiprocessors must be an integer >= 0 (0: the matmul rate "
                             f"does not depend on shape), got {self.multiprocessors!r}")
        if not 0 <= self.overlap_slowdown < 1:
            raise ValueError(f"overlap_slowdown must be in [0, 1), got {self.overlap_slowdown!r}")
        if not self.collective_half_bytes >= 0:
            raise ValueError(f"collective_half_bytes must be >= 0, got "
                             f"{self.collective_half_bytes!r}")
        if not self.memory_bandwidth > 0:
            raise ValueError(f"memory_bandwidth must be > 0 bytes/s, got "
                             f"{self.memory_bandwidth!r}")
        for field in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, field), Link):
                raise ValueError(f"{field} must be a Link(alpha, bandwidth)")

    @property
    def achievable_flops(self) -> float:
        """FLOP/s the matmuls run at: ``peak_flops x compute_efficiency``."""
        return self.peak_flops * self.compute_efficiency

    @property
    def achievable_memory_bandwidth(self) -> float:
        """Bytes/s memory-bound operations stream at: ``memory_bandwidth x
        memory_efficiency`` (infinite when the bandwidth is not given)."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def achievable_streaming_bandwidth(self) -> float:
        """Bytes/s large streaming kernels (the optimizer step, a cast of all the gradients)
        reach: ``memory_bandwidth x streaming_efficiency``."""
        return self.memory_bandwidth * self.streaming_efficiency

    @property
    def at_peak(self) -> Hardware:
        """This hardware at its datasheet: compute, memory and NVLink efficiency 1 and
        every matmul shape at that rate (an upper bound, as the cost model was before it
        counted achievable rates)."""
        return replace(self, compute_efficiency=1.0, memory_efficiency=1.0,
                       streaming_efficiency=1.0, multiprocessors=0,
                       intra_node_efficiency=1.0, collective_half_bytes=0.0,
                       overlap_slowdown=0.0)

    @property
    def n_nodes(self) -> int:
        return max(1, self.n_devices // self.devices_per_node)

    def in_one_node(self, span: int) -> bool:
        """Whether a block of ``span`` consecutive ranks, starting at a multiple of ``span``,
        lies inside one node."""
        return span <= self.devices_per_node and self.devices_per_node % span == 0

    @property
    def achievable_intra_node(self) -> Link:
        """The node's link at ``intra_node_efficiency`` of its bandwidth (itself at 1)."""
        if self.intra_node_efficiency == 1:
            return self.intra_node
        return Link(alpha=self.intra_node.alpha,
                    bandwidth=self.intra_node.bandwidth * self.intra_node_efficiency)

    def link_for(self, span: int) -> Link:
        """The slowest link inside such a block: the node's own (at its achievable rate)
        when it is in one node."""
        return self.achievable_intra_node if self.in_one_node(span) else self.inter_node

    def ring_link(self, span: int, degree: int) -> Link:
        """The link a ring collective (all-reduce, reduce-scatter, all-gather) over a group
        of ``degree`` ranks, evenly strided over a block of ``span`` consecutive ranks, runs
        at: the node's own (achievable) link inside one node; across nodes, the inter-node
        link when the group has one rank per node; with g > 1 ranks per node, time per byte
        max(1 / (g x inter), (g - 1) / (g x NVLink)): of each rank's bytes, 1/g leave through
        a NIC (the rings take turns), (g - 1)/g stay on NVLink. The message latency stays
        the inter-node link's. Measured: two HGX A100 nodes with four 200 Gb/s NICs each
        (12.5 GB/s a GPU) reach 91 GB/s of all-reduce bus bandwidth, where one GPU's share
        of a NIC would give 12.5 and this rule 100 (NVIDIA/nccl-tests issue 100)."""
        if self.in_one_node(span):
            return self.achievable_intra_node
        per_node = self._ranks_per_node(span, degree)
        if per_node == 1:
            return self.inter_node
        seconds_per_byte = max(1 / (per_node * self.inter_node.bandwidth),
                               (per_node - 1) / (per_node * self.achievable_intra_node.bandwidth))
        return Link(alpha=self.inter_node.alpha, bandwidth=1 / seconds_per_byte)

    def ring_crossing_share(self, span: int, degree: int) -> float:
        """The share of a rank's ring-collective bytes that leave its node (1/g for g ranks of
        the group per node; 0 inside one node)."""
        if self.in_one_node(span):
            return 0.0
        return 1.0 / self._ranks_per_node(span, degree)

    def _ranks_per_node(self, span: int, degree: int) -> int:
        """Ranks of such a group in one node: its ranks are span / degree apart."""
        return min(degree, max(1, self.devices_per_node // max(1, span // degree)))

    def slowed_by(self, alpha: float, beta: float) -> Hardware:
        """A copy whose links both have ``alpha`` s per message and ``beta`` s per byte
        added (an emulated slower network, as :class:`parlib.measure.SlowLink` makes)."""
        return replace(self, intra_node=self.intra_node.slowed_by(alpha, beta),
                       inter_node=self.inter_node.slowed_by(alpha, beta))

    def with_(self, **changes: Any) -> Hardware:
        """A copy with some fields changed, e.g. ``hardware.with_(n_devices=64)``."""
        return replace(self, **changes)

    # ---- presets: one node of 8 GPUs, NVLink inside, one InfiniBand NIC per GPU between.
    @classmethod
    def dgx_a100(cls, n_devices: int = 8, **changes: Any) -> Hardware:
        """NVIDIA DGX A100 (80 GB) nodes."""
        return cls(
            n_devices=n_devices,
            devices_per_node=8,  # NVIDIA DGX A100 datasheet: 8x A100 80 GB
            memory_bytes=80 * GB,  # NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e
            peak_flops=312e12,  # A100 datasheet: BF16 Tensor Core 312 TFLOPS (dense)
            # A100 datasheet: NVLink 600 GB/s per GPU, both directions together: 300 one way.
            intra_node=Link(alpha=INTRA_NODE_ALPHA, bandwidth=300 * GB),
            # DGX A100 datasheet: 8x ConnectX-6 200 Gb/s HDR InfiniBand for compute: 25 GB/s.
            inter_node=Link(alpha=10e-6, bandwidth=25 * GB),
            name="DGX A100 80GB",
            # A100 datasheet (80 GB SXM): GPU memory bandwidth 2,039 GB/s.
            memory_bandwidth=2039 * GB,
            **_achievable("A100"),
        ).with_(**changes)

    @classmethod
    def jean_zay_a100(cls, n_devices: int = 384, **changes: Any) -> Hardware:
        """Jean Zay's A100 partition, where BigScience trained BLOOM: nodes of 8 A100 80 GB
        (NVLink as a DGX's), 4 x 100 Gb/s Omni-Path per node, its network as NCCL used it.

        BigScience measured it (bigscience-workshop/bigscience experiments/bandwidth/
        all_reduce_bench-a100-n4.txt, January 2022): an fp32 all-reduce of 4 GB over 4
        nodes, 32 ranks, took 1.5312 s, 40.49 Gb/s = 5.06 GB/s of bus bandwidth. The
        datasheet's 4 x 100 Gb/s would be 50 GB/s a node; NCCL reached a tenth of it on
        Omni-Path (BigScience's bandwidth notes: "we have an issue with nccl that doesn't
        fully utilize Intel OPA full bandwidth"). A ring with 8 ranks a node shares the
        node's links (:meth:`ring_link`), so the measured 5.06 GB/s is the node's: the
        inter-node link is 5.06 / 8 = 0.633 GB/s for each of its GPUs, which reproduces the
        measured time.
        """
        alpha, ranks = 10e-6, 32
        latency = collective_time("all_reduce", 0.0, ranks, alpha, 0.0)  # 2(n-1) alphas
        node = bus_bandwidth(4e9, 1.5312 - latency, ranks)
        return cls.dgx_a100(n_devices, inter_node=Link(alpha=alpha, bandwidth=node / 8),
                            name="Jean Zay A100 80GB").with_(**changes)

    @classmethod
    def dgx_h100(cls, n_devices: int = 8, **changes: Any) -> Hardware:
        """NVIDIA DGX H100 nodes (H100 SXM5 80 GB)."""
        return cls(
            n_devices=n_devices,
            devices_per_node=8,  # NVIDIA DGX H100 datasheet: 8x H100 SXM5
            memory_bytes=80 * GB,  # NVIDIA H100 Tensor Core GPU datasheet (SXM): 80 GB HBM3
            # H100 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS "with sparsity"; dense is half.
            peak_flops=989.5e12,
            # H100 datasheet (SXM): NVLink 900 GB/s, both directions together: 450 one way.
            intra_node=Link(alpha=INTRA_NODE_ALPHA, bandwidth=450 * GB),
            # DGX H100 datasheet: 8x ConnectX-7 400 Gb/s InfiniBand/Ethernet: 50 GB/s per GPU.
            inter_node=Link(alpha=10e-6, bandwidth=50 * GB),
            name="DGX H100",
            # H100 datasheet (SXM): GPU memory bandwidth 3.35 TB/s.
            memory_bandwidth=3350 * GB,
            **_achievable("H100"),
        ).with_(**changes)

    @classmethod
    def dgx_h200(cls, n_devices: int = 8, **changes: Any) -> Hardware:
        """NVIDIA DGX H200 nodes (H200 SXM 141 GB)."""
        return cls(
            n_devices=n_devices,
            devices_per_node=8,  # NVIDIA DGX H200 datasheet: 8x H200 141 GB
            memory_bytes=141 * GB,  # NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e
            # H200 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS "with sparsity"; dense is half.
            peak_flops=989.5e12,
            # H200 datasheet (SXM): NVLink 900 GB/s, both directions together: 450 one way.
            intra_node=Link(alpha=INTRA_NODE_ALPHA, bandwidth=450 * GB),
            # DGX H200 datasheet: 8x ConnectX-7 400 Gb/s: 50 GB/s per GPU.
            inter_node=Link(alpha=10e-6, bandwidth=50 * GB),
            name="DGX H200",
            # H200 datasheet (SXM): GPU memory bandwidth 4.8 TB/s.
            memory_bandwidth=4800 * GB,
            **_achievable("H200"),
        ).with_(**changes)

    @classmethod
    def measured_here(cls, n_devices: int, *, allreduce_fit: tuple[float, float],
                      fit_ranks: int, flops_per_second: float,
                      memory_bytes: float = math.inf,
                      devices_per_node: int | None = None,
                      memory_bandwidth: float = math.inf) -> Hardware:
        """This machine, from the launching chapter's measurements.

        ``allreduce_fit`` is ``fit_alpha_beta(sizes, seconds)`` of all-reduce times on
        ``fit_ranks`` ranks (the line 2(N-1) alpha + 2(N-1)/N beta x bytes); both links are
        that one measured link. ``flops_per_second`` is the rate one rank measured running
        the model's step; it becomes ``peak_flops``, so MFU here is relative to it.
        ``memory_bytes`` per device defaults to unlimited (not the constraint on a laptop).
        ``memory_bandwidth`` (bytes/s measured streaming, if known) charges the memory-bound
        operations; unknown, they cost nothing beyond the measured rate. Both rates are
        measured, so both efficiencies are 1 (generation "measured").
        """
        a, b = allreduce_fit
        if not b > 0:
            raise ValueError(f"the all-reduce fit's slope must be > 0 seconds per byte, got "
                             f"{b!r}: measure larger messages")
        alpha, beta = per_link_alpha_beta(max(a, 0.0), b, fit_ranks)  # a < 0 is fit noise
        link = Link(alpha=alpha, bandwidth=1.0 / beta)
        return cls(n_devices=n_devices, devices_per_node=devices_per_node or n_devices,
                   memory_bytes=memory_bytes, peak_flops=flops_per_second,
                   intra_node=link, inter_node=link, name="measured here",
                   memory_bandwidth=memory_bandwidth, generation="measured")

    def __str__(self) -> str:
        return (f"{self.name or 'hardware'}: {self.n_devices} devices, {self.devices_per_node} "
                f"per node, {self.memory_bytes / GB:.3g} GB, "
                f"{self.peak_flops / 1e12:.3g} TFLOP/s peak"
                + (f" ({self.compute_efficiency:.0%} achievable)"
                   if self.compute_efficiency < 1 else "")
                + (f", memory {self.memory_bandwidth / 1e12:.3g} TB/s"
                   if math.isfinite(self.memory_bandwidth) else "")
                + ", links "
                f"{self.intra_node.bandwidth / GB:.3g} / {self.inter_node.bandwidth / GB:.3g} GB/s")


__all__ = ["GB", "Hardware", "Link"]
