"""Questions of the tensor-parallel chapter: tensor parallelism (notebook 03_tensor_parallel).

``numbers`` (bytes and memory per layer, choices), ``f_g`` (Megatron's f and g) and
``row_parallel`` (a row-parallel linear layer), the last two
:class:`~parlib.course.on_ranks.RankExercise` questions.
"""

from __future__ import annotations

from parlib.course.questions.ch03 import f_g, numbers, row_parallel
from parlib.course.questions.ch03.f_g import F_SOLUTION, G_SOLUTION
from parlib.course.questions.ch03.row_parallel import ROW_PARALLEL_SOLUTION

__all__ = ["F_SOLUTION", "G_SOLUTION", "ROW_PARALLEL_SOLUTION", "f_g", "numbers",
           "row_parallel"]
