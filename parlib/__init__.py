"""parlib: run, measure and check multi-rank torch code from a notebook.

The pieces a learner uses:

- ``launch(fn, world_size=N)``: run ``fn`` on N ranks, get their results back.
- ``Cluster(N)`` and ``%%ranks``: ranks kept warm for many small cells.
- ``device()``: inside a rank, the torch.device that rank computes on.
- ``RankError``: what a failing rank raises in the notebook.
- ``check(question_id, answer)`` / ``explain(question_id)``: the exercises' auto-checks.

The package, in layers (each imports only what is listed before it):

- :mod:`parlib.cost`: every formula, pure Python.
- :mod:`parlib.comm`: collectives under names every torch version knows.
- :mod:`parlib.runtime`: getting code onto ranks (launcher, warm ranks, ``%%ranks``).
- :mod:`parlib.measure`: time, bytes, memory, timelines, emulated costs.
- :mod:`parlib.model`: the shared tiny transformer, its data and training step.
- :mod:`parlib.strategies`: data, pipeline (and later tensor) parallelism.
- :mod:`parlib.verify`: the single-device reference and the one comparison rule.
- :mod:`parlib.plots`: the palette and every drawing.
- :mod:`parlib.course`: questions, checks, grading, notebook building.

``check`` and ``explain`` load :mod:`parlib.course` on first use, so that ranks started
by ``torchrun -m parlib.run`` never load the grader or IPython.
"""

from __future__ import annotations

from typing import Any

from parlib.runtime import Cluster, RankError, device, launch

__version__ = "0.1.0"

__all__ = [
    "Cluster",
    "Mesh",
    "RankError",
    "check",
    "device",
    "explain",
    "launch",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def __getattr__(name: str) -> Any:
    if name == "Mesh":  # lazily: the front door stays light for ranks that never use it
        from parlib.strategies.mesh import Mesh

        return Mesh
    if name in ("check", "explain"):
        from parlib.course import check as checks

        return getattr(checks, name)
    raise AttributeError(f"module 'parlib' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext parlib``: register the ``%%ranks`` magic."""
    from parlib.runtime.magic import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from parlib.runtime.magic import unload_ipython_extension as unload

    unload(ipython)
