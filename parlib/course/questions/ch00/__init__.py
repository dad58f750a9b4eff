"""Questions of the launching chapter: launching ranks and collectives (notebook
00_launching_ranks).

``numbers`` (ring and all-gather bytes, the alpha-beta time, the ring formula, the collective
of data parallelism) and ``ring`` with ``ring_result`` (a ring all-reduce from send/recv, a
:class:`~parlib.course.on_ranks.RankExercise`).
"""

from __future__ import annotations

from parlib.course.questions.ch00 import numbers, ring, ring_result
from parlib.course.questions.ch00.ring import RING_SOLUTION

# the seeds the grader uses, here because the course ships them (a test shows a learner who
# recomputes the sum from them without a message still fails)
from parlib.course.questions.ch00.ring_result import _case_input as _case_input
from parlib.course.questions.ch00.ring_result import _lengths as _lengths

__all__ = ["RING_SOLUTION", "numbers", "ring", "ring_result"]
