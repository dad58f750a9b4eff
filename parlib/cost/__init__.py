"""Every formula the course uses, in pure Python (no torch): importable anywhere, instant.

- :mod:`parlib.cost.collectives`: bytes a collective sends, the alpha-beta time model.
- :mod:`parlib.cost.pipeline`: the bubble, the ideal step time, stage-boundary bytes.
- :mod:`parlib.cost.memory`: model-state bytes per parameter and per ZeRO stage.
- :mod:`parlib.cost.tensor`: bytes a tensor-parallel layer all-reduces.

Notebooks, checks and benchmarks import these; nothing retypes a formula.
"""

from parlib.cost.collectives import (
    bus_bandwidth,
    collective_time,
    fit_alpha_beta,
    message_time,
    predicted_sent_bytes,
)
from parlib.cost.memory import adam_bytes_per_param, model_state_bytes, model_state_bytes_per_param
from parlib.cost.pipeline import (
    boundary_bytes,
    bubble_fraction,
    bubble_ratio,
    ideal_step_time,
    min_microbatches,
)
from parlib.cost.tensor import tp_message_bytes, tp_sent_bytes_per_layer

__all__ = [
    "adam_bytes_per_param",
    "boundary_bytes",
    "bubble_fraction",
    "bubble_ratio",
    "bus_bandwidth",
    "collective_time",
    "fit_alpha_beta",
    "ideal_step_time",
    "message_time",
    "min_microbatches",
    "model_state_bytes",
    "model_state_bytes_per_param",
    "predicted_sent_bytes",
    "tp_message_bytes",
    "tp_sent_bytes_per_layer",
]
