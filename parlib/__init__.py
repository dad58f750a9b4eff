"""parlib: run, measure and check multi-rank torch code from a notebook.

The pieces a learner uses:

- ``launch(fn, world_size=N)``: run ``fn`` on N ranks, get their results back.
- ``Cluster(N)`` and ``%%ranks``: ranks kept warm for many small cells.
- ``device()``: inside a rank, the torch.device that rank computes on.
- ``RankError``: what a failing rank raises in the notebook.
- ``check(question_id, answer)`` / ``explain(question_id)``: the exercises' auto-checks.
- ``DataParallel(model)`` / ``Zero1(params, torch.optim.AdamW, lr=...)``: the chapter's data
  parallelism and ZeRO-1 as drop-ins for DistributedDataParallel and a sharded optimizer.
- ``FSDP(model, compute_dtype=None)`` / ``Zero2(model, torch.optim.AdamW, units=..., lr=...)``:
  sharded data parallelism (ZeRO-3 and ZeRO-2) as drop-ins.

The package, in layers (each imports only what is listed before it):

- :mod:`parlib.cost`: every formula, pure Python.
- :mod:`parlib.comm`: collectives under names every torch version knows.
- :mod:`parlib.runtime`: getting code onto ranks (launcher, warm ranks, ``%%ranks``).
- :mod:`parlib.measure`: time, bytes, memory, timelines, emulated costs.
- :mod:`parlib.model`: the shared tiny transformer, its data and training step.
- :mod:`parlib.verify`: the single-device reference run and the one comparison rule.
- :mod:`parlib.strategies`: data (plain and sharded), tensor, pipeline, context and expert
  parallelism and their combination, as code one could copy into a training script (torch,
  ``parlib.comm``, the cost formulas and the model only).
- :mod:`parlib.experiments`: the chapters' harnesses around the strategies: launch, time,
  pad with emulated costs, compare with the reference, tabulate.
- :mod:`parlib.plots`: the palette and every drawing.
- :mod:`parlib.course`: questions, checks, grading, notebook building.

``check`` and ``explain`` load :mod:`parlib.course` on first use, so that ranks started
by ``torchrun -m parlib.run`` never load the grader or IPython; the drop-ins load
:mod:`parlib.strategies` on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from parlib.runtime import Cluster, RankError, device, launch

__version__ = "0.1.0"

__all__ = [
    "Cluster",
    "ColumnParallelLinear",
    "DataParallel",
    "FSDP",
    "Mesh",
    "RankError",
    "RowParallelLinear",
    "Zero1",
    "Zero2",
    "check",
    "device",
    "explain",
    "launch",
    "load_ipython_extension",
    "unload_ipython_extension",
]


# Names loaded on first use: `import parlib` stays light, and ranks started by torchrun
# never load the grader or IPython.
_LAZY = {
    "check": "parlib.course.check",
    "explain": "parlib.course.check",
    "ColumnParallelLinear": "parlib.strategies.tensor",
    "DataParallel": "parlib.strategies.data_parallel",
    "FSDP": "parlib.strategies.fsdp",
    "Mesh": "parlib.strategies.mesh",
    "RowParallelLinear": "parlib.strategies.tensor",
    "Zero1": "parlib.strategies.zero",
    "Zero2": "parlib.strategies.sharded",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parlib' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext parlib``: register the ``%%ranks`` magic."""
    from parlib.runtime.magic import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from parlib.runtime.magic import unload_ipython_extension as unload

    unload(ipython)
