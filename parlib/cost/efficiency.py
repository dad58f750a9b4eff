"""How much of the datasheet a device really delivers: achievable fractions per generation.

A datasheet's peak FLOP/s is what the tensor cores could do at full clock on perfectly
shaped work; no matmul reaches it. The largest *measured* matmul rate (the "maximum
achievable matmul FLOPS", MAMF, found by sweeping shapes and keeping the best) is the
honest ceiling of the compute a training step is made of. Memory bandwidth is the same
story: streaming kernels (norms, softmax, elementwise ops) reach a fraction of the
datasheet's HBM figure.

:data:`ACHIEVABLE` holds one :class:`Achievable` per device generation with the source of
each number; :func:`achievable_fraction` reads the matmul fraction. The hardware presets
use them (``compute_efficiency``, ``memory_efficiency``), so their predictions are of what
the devices can do, not of the datasheet. On this machine measure it instead:
``parlib.measure.matmul_rate``.

The best rate is a large matmul's; a smaller one runs below it. A GPU computes a matmul's
(rows x cols) output in tiles, one tile per multiprocessor (SM) at a time, so the tiles run
in *waves* of ``multiprocessors`` tiles, and the last wave is usually partly empty (NVIDIA,
"Matrix Multiplication Background User's Guide", Sec. 3.2 "Wave Quantization"; Sec. 2.3:
256 x 128 is cuBLAS's most efficient tile). :func:`matmul_time` charges that tail:

    waves = ceil(rows / 256) x ceil(cols / 128) x batch / multiprocessors
    time  = max(1, waves + WAVE_TAIL) x (one wave's FLOPs) / best rate

with the tail at half a wave (:data:`WAVE_TAIL`: cuBLAS picks among tile shapes to shrink
the last wave, so we charge its average, not the worst case). A matmul of many waves runs
near the best rate; one of 3 waves at 3.5/3 of its time. :func:`shape_efficiency` is the
fraction of the best rate a shape reaches; the cost model charges each layer's per-device
matmuls at it. With a sweep of shapes from ``parlib.measure.matmul_rate`` a learner can
compare the curve with their own device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parlib.cost.collectives import bus_bandwidth as bus_bandwidth_of
from parlib.cost.collectives import collective_time

# Half a wave: the mean empty share of the last wave when the tile count falls anywhere
# between two whole waves (an assumption: cuBLAS's choice of tiles shrinks the worst case).
WAVE_TAIL = 0.5
# cuBLAS's most efficient tile (rows x cols of the output), NVIDIA's Matrix Multiplication
# Background User's Guide, Sec. 2.3; assumed for every generation.
TILE = (256, 128)


@dataclass(frozen=True)
class Achievable:
    """What one device ``generation`` ("A100", "H100", ...) reaches of its datasheet:
    ``matmul_fraction`` of peak matmul FLOP/s (best shape, BF16, no sparsity),
    ``memory_bandwidth`` the fraction of its datasheet memory bandwidth streaming kernels
    reach, ``multiprocessors`` the SMs a matmul's tiles spread over (0: a rate that does
    not depend on shape, as one measured here), ``nvlink_bandwidth`` the fraction of the
    datasheet's one-way NVLink bandwidth a ring all-reduce's bus bandwidth reaches inside a
    node, ``collective_half_bytes`` the message size at which a collective reaches half
    its large-message bus bandwidth (:func:`half_bandwidth_bytes`; 0: every size at the
    peak), ``overlap_slowdown`` how much longer compute takes while a collective runs
    beside it (0.189: 18.9% longer), ``training_matmul`` the fraction of ``matmul_fraction``
    a training step's matmuls reach, and ``source`` where the numbers come from (or what was
    assumed). For the A100 and the H100, ``training_matmul`` and ``memory_bandwidth`` are
    fitted to every published run of the generation (:mod:`parlib.cost.calibration`): the
    ceilings alone made every published run look slower than the model said; the H200, with
    no published run, takes the H100's. ``streaming_bandwidth``
    is the fraction of the datasheet's memory bandwidth large streaming kernels reach (the
    optimizer step, a cast of all the gradients): not fitted, assumed."""

    generation: str
    matmul_fraction: float
    memory_bandwidth: float
    source: str
    multiprocessors: int = 0
    nvlink_bandwidth: float = 1.0
    collective_half_bytes: float = 0.0
    overlap_slowdown: float = 0.0
    training_matmul: float = 1.0
    streaming_bandwidth: float = 1.0

    def __post_init__(self) -> None:
        for name in ("matmul_fraction", "memory_bandwidth", "nvlink_bandwidth",
                     "training_matmul", "streaming_bandwidth"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{self.generation}: {name} must be a fraction in (0, 1], "
                                 f"got {value!r}")
        if not 0 <= self.overlap_slowdown < 1:
            raise ValueError(f"{self.generation}: overlap_slowdown must be in [0, 1), got "
                             f"{self.overlap_slowdown!r}")
        if isinstance(self.multiprocessors, bool) or not isinstance(
                self.multiprocessors, int) or self.multiprocessors < 0:
            raise ValueError(f"{self.generation}: multiprocessors must be an integer >= 0, "
                             f"got {self.multiprocessors!r}")


# No vendor or paper publishes a table of achieved HBM bandwidth the way the MAMF table does
# for matmuls; a stream copy of large tensors typically measures 85-93% of the datasheet, so
# large streaming kernels (the optimizer step, casting all the gradients) are assumed at 90%
# for every generation: an assumption, stated as one. The memory fractions below are another
# thing: what a training step's per-layer memory-bound work reaches per byte the model counts,
# fitted (A100_TRAINING, H100_TRAINING).
_ASSUMED_STREAMING = 0.90
_STREAMING_NOTE = "large streaming kernels (optimizer, gradient casts) assumed at 90% of it"
# The same book's network chapter (network/README.md, "the ~80% rule of thumb"): an 8-GPU
# node's all-reduce bus bandwidth at a 16 GiB payload, against the one-way NVLink spec:
# A100 (NVLink 3) 234.89 of 300 GB/s, 78%; H200 (NVLink 4) with NCCL's ring 367.61 of 450,
# 82% (SHARP's NVLS algorithm reports 482, past the wire: fewer bytes cross it). The H100
# has the H200's NVLink 4 and NVSwitch, so it takes the H200's ring figure. InfiniBand
# between nodes has no such table there and stays at its datasheet rate.
_NVLINK_NOTE = "NVLink: all-reduce bus bandwidth at 16 GiB, ML Engineering network chapter"

MiB = 2**20
# All-reduce bus bandwidth by payload on one 8 x H200 node (NVLink 4, NVSwitch), GB/s:
# stas00/ml-engineering, network/benchmarks/results/all-reduce-8xH200.md (nccl 2.27.7,
# all_reduce_bench.py). Small messages reach a small share of the link: 40 GB/s at 1 MiB,
# 220 at 16 MiB, 482 at 16 GiB.
H200_ALLREDUCE_BUSBW = (
    (32 * 2**10, 1.44), (64 * 2**10, 2.93), (128 * 2**10, 5.73), (256 * 2**10, 11.74),
    (512 * 2**10, 23.94), (1 * MiB, 39.93), (2 * MiB, 64.53), (4 * MiB, 107.16),
    (8 * MiB, 155.53), (16 * MiB, 219.89), (32 * MiB, 275.84), (64 * MiB, 346.51),
    (128 * MiB, 401.93), (256 * MiB, 436.15), (512 * MiB, 450.29), (1024 * MiB, 463.58),
    (2048 * MiB, 469.17), (4096 * MiB, 473.10), (8192 * MiB, 477.45), (16384 * MiB, 482.26))


def half_bandwidth_bytes(curve: tuple[tuple[float, float], ...]) -> float:
    """The payload (bytes) at which a measured bus-bandwidth ``curve`` ((bytes, GB/s) rows,
    increasing) reaches half its largest payload's bandwidth, interpolated in log size
    between the two rows around it. The H200 curve: half of 482.26 is 241.13 GB/s, between
    16 MiB (219.89) and 32 MiB (275.84): 16 MiB x 2^0.380 = 20.8 MiB.

    Read off this way the half size holds the curve's latency too: a small message is slow
    there because of the per-step startup as much as the bandwidth. A model that charges
    latency on its own (alpha per step) must not take this figure, or it pays for the
    latency twice: :func:`fitted_half_bandwidth_bytes` is the one it takes."""
    top = curve[-1][1] / 2
    for (n0, b0), (n1, b1) in zip(curve, curve[1:]):
        if b0 <= top <= b1:
            share = (top - b0) / (b1 - b0)
            return n0 * (n1 / n0) ** share
    raise ValueError("the curve never crosses half its largest bandwidth")


def modelled_over_measured(curve: tuple[tuple[float, float], ...], ranks: int, alpha: float,
                           bus_bandwidth: float, half_bytes: float) -> list[float]:
    """Per row of a measured all-reduce ``curve`` ((bytes, GB/s) of bus bandwidth on
    ``ranks`` ranks): the bus bandwidth the cost model predicts (latency ``alpha`` per step,
    NCCL's ring or tree, large messages at ``bus_bandwidth`` bytes/s, :func:`size_efficiency
    <parlib.cost.collectives.size_efficiency>` at ``half_bytes``) over the measured one."""
    ratios = []
    for nbytes, measured_gb in curve:
        seconds = collective_time("all_reduce", nbytes, ranks, alpha, 1 / bus_bandwidth,
                                  half_bytes=half_bytes, algorithm="nccl")
        ratios.append(bus_bandwidth_of(nbytes, seconds, ranks) / (measured_gb * 1e9))
    return ratios


def fitted_half_bandwidth_bytes(curve: tuple[tuple[float, float], ...], ranks: int,
                                alpha: float, bus_bandwidth: float) -> float:
    """The half size (bytes) under which the cost model's all-reduce time best reproduces a
    measured bus-bandwidth ``curve``: the latency is charged as the model charges it
    (``alpha`` a step), so the half size holds only what latency does not explain. Least
    squares in log bandwidth over every row, searched on a grid of 1/64 octave from 1 KiB
    to the largest payload."""
    def error(half: float) -> float:
        ratios = modelled_over_measured(curve, ranks, alpha, bus_bandwidth, half)
        return sum(math.log(r) ** 2 for r in ratios)
    steps = int(64 * math.log2(curve[-1][0] / 1024))
    return min((1024 * 2 ** (k / 64) for k in range(steps + 1)), key=error)


# Latency of one ring step inside a node: not on any datasheet; NVLink steps take a few
# microseconds (the presets' assumption, used for every generation's NVLink).
INTRA_NODE_ALPHA = 5e-6
# NCCL's ring all-reduce on an 8 x H200 node at 16 GiB (ML Engineering's network chapter):
# 367.61 GB/s of bus bandwidth. The curve above reports 482 at its top: NVLS, SHARP in the
# switch, which the presets do not model.
H200_RING_BUSBW = 367.61e9
# One half-size for every generation and both links, fitted to the only published curve by
# size (the H200's) under the model's own latency: about 1.8 MiB. The A100's NVLink 3 and
# the InfiniBand between nodes are assumed to follow it (an assumption, stated as one).
_HALF = fitted_half_bandwidth_bytes(H200_ALLREDUCE_BUSBW, 8, INTRA_NODE_ALPHA,
                                    H200_RING_BUSBW)
# Compute beside NCCL kernels runs slower (they take SMs, memory bandwidth and power): Lee et
# al. 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning" (arXiv 2507.03114), GPT and Llama training on 4 A100s, H100s, MI250s and MI210s:
# overlapped, compute took 18.9% longer on average (up to 40%). One figure for every
# generation: the paper's mean over them.
OVERLAP_SLOWDOWN = 0.189
_OVERLAP_NOTE = ("compute beside collectives 18.9% slower: Lee et al. 2025 (arXiv "
                 "2507.03114), mean over A100, H100, MI250, MI210")
# What a training step reaches of the ceilings above, fitted by parlib.cost.calibration.fit to
# every published run of the generation (tests/cost/test_calibration.py re-runs the fit):
# (fraction of MAMF its matmuls reach, fraction of the datasheet memory bandwidth the bytes the
# model counts for its memory-bound work move at).
A100_TRAINING = (0.82, 0.67)
H100_TRAINING = (0.88, 0.23)
_TRAINING_NOTE = ("a training step's matmuls at {0:.0%} of MAMF and its memory-bound work at "
                  "{1:.0%} of the datasheet bandwidth: fitted to every published run on {2} "
                  "(parlib.cost.calibration); " + _STREAMING_NOTE)
_HALF_NOTE = (f"collectives by size: half the peak bus bandwidth at {_HALF / MiB:.1f} MiB, "
              "fitted under the model's latency to the H200 curve of ML Engineering's "
              "all-reduce-8xH200 results (assumed for every link)")

ACHIEVABLE: dict[str, Achievable] = {
    # Stas Bekman, "Machine Learning Engineering", compute/accelerator, the "Maximum
    # Achievable Matmul FLOPS comparison table" (BF16, no sparsity): A100 SXM 267.9 of 312
    # TFLOPS, 85.9% (CUDA 12.1, best shape 6912x16384x2048).
    "A100": Achievable("A100", 267.9 / 312, A100_TRAINING[1],
                       "MAMF table, ML Engineering (Bekman): 267.9 of 312 TFLOPS; "
                       + _TRAINING_NOTE.format(*A100_TRAINING, "A100")
                       + "; 108 SMs (NVIDIA A100 datasheet); " + _NVLINK_NOTE
                       + ": 234.89 of 300 GB/s; " + _HALF_NOTE + "; " + _OVERLAP_NOTE,
                       multiprocessors=108, nvlink_bandwidth=234.89 / 300,
                       collective_half_bytes=_HALF, overlap_slowdown=OVERLAP_SLOWDOWN,
                       training_matmul=A100_TRAINING[0], streaming_bandwidth=_ASSUMED_STREAMING),
    # Same table: H100 SXM 792.1 of 989 TFLOPS, 80.1% (CUDA 12.1, 6144x17920x2816).
    "H100": Achievable("H100", 792.1 / 989, H100_TRAINING[1],
                       "MAMF table, ML Engineering (Bekman): 792.1 of 989 TFLOPS; "
                       + _TRAINING_NOTE.format(*H100_TRAINING, "H100")
                       + "; 132 SMs (H100 SXM5, NVIDIA Hopper whitepaper); "
                       + _NVLINK_NOTE + ": the H200's NVLink 4 ring, 367.61 of 450 GB/s; "
                       + _HALF_NOTE + "; " + _OVERLAP_NOTE,
                       multiprocessors=132, nvlink_bandwidth=H200_RING_BUSBW / 450e9,
                       collective_half_bytes=_HALF, overlap_slowdown=OVERLAP_SLOWDOWN,
                       training_matmul=H100_TRAINING[0], streaming_bandwidth=_ASSUMED_STREAMING),
    # The book's later table lists "H100/H200 SXM" together at 794.5 of 989 TFLOPS (80.3%):
    # the same chip with more and faster memory. No published H200 run to fit: it takes the
    # H100's training fractions (its memory-bound work at the H100's absolute rate, since
    # those costs did not follow the datasheet from A100 to H100 either).
    "H200": Achievable("H200", 794.5 / 989, H100_TRAINING[1] * 3.35 / 4.8,
                       "MAMF table, ML Engineering (Bekman): H100/H200 SXM 794.5 of 989 "
                       "TFLOPS; the H100's training fractions (no published H200 run to fit), "
                       "its memory-bound work at the H100's bytes/s; " + _STREAMING_NOTE
                       + "; 132 SMs (the H100's chip); "
                       + _NVLINK_NOTE + ": NVLink 4 ring, 367.61 of 450 GB/s; " + _HALF_NOTE
                       + "; " + _OVERLAP_NOTE,
                       multiprocessors=132, nvlink_bandwidth=H200_RING_BUSBW / 450e9,
                       collective_half_bytes=_HALF, overlap_slowdown=OVERLAP_SLOWDOWN,
                       training_matmul=H100_TRAINING[0], streaming_bandwidth=_ASSUMED_STREAMING),
    # A rate measured here (parlib.measure.matmul_rate) is already what this machine
    # achieves: nothing left to discount.
    "measured": Achievable("measured", 1.0, 1.0,
                           "measured on this machine: the rate is already the achievable one"),
}


def achievable(generation: str) -> Achievable:
    """The :class:`Achievable` row of ``generation``; a ValueError listing the known ones."""
    try:
        return ACHIEVABLE[generation]
    except (KeyError, TypeError):
        raise ValueError(f"no achievable-fraction row for generation {generation!r}; known: "
                         f"{', '.join(sorted(ACHIEVABLE))}") from None


def achievable_fraction(generation: str) -> float:
    """The fraction of datasheet peak matmul FLOP/s a ``generation`` reaches at best."""
    return achievable(generation).matmul_fraction


def matmul_time(rows: int, inner: int, cols: int, *, flops_per_second: float,
                multiprocessors: int, batch: int = 1) -> float:
    """Seconds for ``batch`` matmuls of (rows, inner) x (inner, cols) at ``flops_per_second``
    (the device's best matmul rate), the output's tiles (:data:`TILE`) in waves over
    ``multiprocessors`` SMs plus the average tail of :data:`WAVE_TAIL` waves, at least one
    wave. ``multiprocessors`` 0: no waves, every shape at the best rate."""
    for name, value in (("rows", rows), ("inner", inner), ("cols", cols), ("batch", batch)):
        if not value > 0:
            raise ValueError(f"matmul_time: {name} must be > 0, got {value!r}")
    if not flops_per_second > 0:
        raise ValueError(f"matmul_time: flops_per_second must be > 0, got {flops_per_second!r}")
    flops = 2 * rows * inner * cols * batch
    if not multiprocessors:
        return flops / flops_per_second
    tile_rows, tile_cols = TILE
    tiles = math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols) * batch
    one_wave = 2 * tile_rows * tile_cols * inner * multiprocessors / flops_per_second
    return max(1.0, tiles / multiprocessors + WAVE_TAIL) * one_wave


def shape_efficiency(rows: int, inner: int, cols: int, *, multiprocessors: int,
                     batch: int = 1) -> float:
    """The fraction of the best matmul rate a (rows, inner, cols) matmul (``batch`` of them)
    reaches: its FLOPs at the best rate over :func:`matmul_time` (1 without multiprocessors).
    """
    return (2 * rows * inner * cols * batch) / matmul_time(
        rows, inner, cols, flops_per_second=1.0, multiprocessors=multiprocessors, batch=batch)


def matmul_fraction(generation: str, rows: int, inner: int, cols: int, batch: int = 1) -> float:
    """The fraction of datasheet peak a (rows, inner, cols) matmul reaches on ``generation``:
    its best fraction (:func:`achievable_fraction`) times :func:`shape_efficiency`."""
    row = achievable(generation)
    return row.matmul_fraction * shape_efficiency(rows, inner, cols, batch=batch,
                                                  multiprocessors=row.multiprocessors)


__all__ = ["ACHIEVABLE", "H200_ALLREDUCE_BUSBW", "OVERLAP_SLOWDOWN", "TILE", "WAVE_TAIL",
           "Achievable", "achievable", "achievable_fraction", "half_bandwidth_bytes",
           "matmul_fraction", "matmul_time", "shape_efficiency"]
