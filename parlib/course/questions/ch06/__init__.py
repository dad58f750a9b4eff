"""Questions of the expert-parallel chapter: expert parallelism (notebook
06_expert_parallel).

``dispatch`` (one rank's side of an expert-parallel MoE layer: the capacity cut, the send
counts, the permutation that groups tokens by destination and its inverse) and ``numbers``
(parameters per rank, all-to-all bytes per layer, tokens dropped at capacity, why a large
MoE model can skip tensor parallelism).
"""

from __future__ import annotations

from parlib.course.questions.ch06 import dispatch, numbers
from parlib.course.questions.ch06.dispatch import DISPATCH_SOLUTION

__all__ = ["DISPATCH_SOLUTION", "dispatch", "numbers"]
