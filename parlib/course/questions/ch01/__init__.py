"""Questions of the data-parallel chapter: data parallelism (notebook 01_data_parallel).

One module per exercise or small group: ``numbers`` (ring bytes, model-state memory, the
memory wall, overlap), ``grad_accum`` (accumulation with one sync) and ``zero1`` (a ZeRO-1
step), the last two :class:`~parlib.course.on_ranks.RankExercise` questions.
"""

from __future__ import annotations

from parlib.course.questions.ch01 import grad_accum, numbers, zero1
from parlib.course.questions.ch01.grad_accum import ACCUM_SOLUTION
from parlib.course.questions.ch01.zero1 import ZERO1_SOLUTION

__all__ = ["ACCUM_SOLUTION", "ZERO1_SOLUTION", "grad_accum", "numbers", "zero1"]
