"""Questions of the context-parallel chapter: context parallelism (notebook
05_context_parallel).

``merge`` (merging two partial attention results with the online softmax), ``ring`` (the
forward of ring attention, a :class:`~parlib.course.on_ranks.RankExercise`) and ``numbers``
(ring attention's bytes, a rank's activation memory, the zig-zag chunk pair, cp or t).
"""

from __future__ import annotations

from parlib.course.questions.ch05 import merge, numbers, ring
from parlib.course.questions.ch05.merge import MERGE_SOLUTION
from parlib.course.questions.ch05.ring import RING_SOLUTION

__all__ = ["MERGE_SOLUTION", "RING_SOLUTION", "merge", "numbers", "ring"]
