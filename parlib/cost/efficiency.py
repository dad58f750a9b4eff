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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Achievable:
    """What one device ``generation`` ("A100", "H100", ...) reaches of its datasheet:
    ``matmul_fraction`` of peak matmul FLOP/s (best shape, BF16, no sparsity),
    ``memory_bandwidth`` the fraction of its datasheet memory bandwidth streaming kernels
    reach, and ``source`` where the numbers come from (or what was assumed)."""

    generation: str
    matmul_fraction: float
    memory_bandwidth: float
    source: str

    def __post_init__(self) -> None:
        for name in ("matmul_fraction", "memory_bandwidth"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{self.generation}: {name} must be a fraction in (0, 1], "
                                 f"got {value!r}")


# No vendor or paper publishes a table of achieved HBM bandwidth the way the MAMF table does
# for matmuls; we assume 90% of the datasheet for every generation (a stream copy of large
# tensors typically measures 85-93% of it). It is an assumption, stated as one.
_ASSUMED_MEMORY = 0.90
_MEMORY_NOTE = "memory bandwidth: no published table, assumed 90% of the datasheet"

ACHIEVABLE: dict[str, Achievable] = {
    # Stas Bekman, "Machine Learning Engineering", compute/accelerator, the "Maximum
    # Achievable Matmul FLOPS comparison table" (BF16, no sparsity): A100 SXM 267.9 of 312
    # TFLOPS, 85.9% (CUDA 12.1, best shape 6912x16384x2048).
    "A100": Achievable("A100", 267.9 / 312, _ASSUMED_MEMORY,
                       "MAMF table, ML Engineering (Bekman): 267.9 of 312 TFLOPS; "
                       + _MEMORY_NOTE),
    # Same table: H100 SXM 792.1 of 989 TFLOPS, 80.1% (CUDA 12.1, 6144x17920x2816).
    "H100": Achievable("H100", 792.1 / 989, _ASSUMED_MEMORY,
                       "MAMF table, ML Engineering (Bekman): 792.1 of 989 TFLOPS; "
                       + _MEMORY_NOTE),
    # The book's later table lists "H100/H200 SXM" together at 794.5 of 989 TFLOPS (80.3%):
    # the same chip with more and faster memory.
    "H200": Achievable("H200", 794.5 / 989, _ASSUMED_MEMORY,
                       "MAMF table, ML Engineering (Bekman): H100/H200 SXM 794.5 of 989 "
                       "TFLOPS; " + _MEMORY_NOTE),
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


__all__ = ["ACHIEVABLE", "Achievable", "achievable", "achievable_fraction"]
