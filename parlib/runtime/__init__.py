"""Getting code onto ranks, and nothing else.

- :mod:`~parlib.runtime.policy`: which backend and device a launch uses; :func:`device`.
- :mod:`~parlib.runtime.group`: rank processes in one process group; :func:`launch`.
- :mod:`~parlib.runtime.output`: rank output as ``[rank r]`` lines in the cell.
- :mod:`~parlib.runtime.errors`: :class:`RankError` and tracebacks mapped to cells.
- :mod:`~parlib.runtime.worker`: what runs inside each rank process.
- :mod:`~parlib.runtime.cluster`: warm ranks (:class:`Cluster`).
- :mod:`~parlib.runtime.magic`: ``%%ranks`` (loaded by ``%load_ext parlib``).
- :mod:`~parlib.runtime.doctor`: ``python -m parlib doctor``.
- :mod:`~parlib.runtime.torchrun`: ``torchrun -m parlib.run``.

This layer imports nothing from the rest of parlib except :mod:`parlib.comm` (inside the
ranks), so ``torchrun -m parlib.run`` on a cluster never loads IPython or the grader.
"""

from parlib.runtime.cluster import Cluster
from parlib.runtime.errors import RankError
from parlib.runtime.group import launch
from parlib.runtime.policy import Plan, device, plan, threads_per_rank

__all__ = ["Cluster", "Plan", "RankError", "device", "launch", "plan", "threads_per_rank"]
