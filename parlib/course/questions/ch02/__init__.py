"""Questions of the sharded-data-parallel chapter (notebook 02_sharded_data_parallel).

``numbers`` (memory per rank under ZeRO-1/2/3, bytes per step, recomputation, fast links
and large units) and ``zero3`` (one ZeRO-3 unit, a
:class:`~parlib.course.on_ranks.RankExercise`).
"""

from __future__ import annotations

from parlib.course.questions.ch02 import numbers, zero3
from parlib.course.questions.ch02.zero3 import ZERO3_SOLUTION

__all__ = ["ZERO3_SOLUTION", "numbers", "zero3"]
