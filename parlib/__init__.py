"""parlib: run, measure and check multi-rank torch code from a notebook.

The pieces a learner uses:

- ``launch(fn, world_size=N)``: run ``fn`` on N ranks, get their results back.
- ``Cluster(N)`` and ``%%ranks``: ranks kept warm for many small cells.
- ``device()``: inside a rank, the torch.device that rank computes on.
- ``RankError``: what a failing rank raises in the notebook.
- ``check(question_id, answer)`` / ``explain(question_id)``: the exercises' auto-checks.
"""

from parlib.checking import check, explain
from parlib.cluster import Cluster
from parlib.launcher import RankError, device, launch
from parlib.magic import load_ipython_extension, unload_ipython_extension

__version__ = "0.1.0"

__all__ = [
    "Cluster",
    "check",
    "explain",
    "RankError",
    "device",
    "launch",
    "load_ipython_extension",
    "unload_ipython_extension",
]
