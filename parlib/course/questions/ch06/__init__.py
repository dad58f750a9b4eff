"""Questions of the expert-parallel chapter: expert parallelism (notebook
06_expert_parallel).

``dispatch`` (one rank's side of an expert-parallel MoE layer: the capacity cut, the send
counts, the permutation that groups tokens by destination and its inverse, judged against
an emulated exchange), ``ep_layer`` (the same layer on ranks: the counts swapped, the
tokens sent and returned by a differentiable all-to-all, output and gradients against the
single-device layer) and ``numbers`` (parameters per rank, all-to-all bytes per layer,
tokens dropped at capacity, why a large MoE model can skip tensor parallelism).
"""

from __future__ import annotations

from parlib.course.questions.ch06 import dispatch, ep_layer, numbers
from parlib.course.questions.ch06.dispatch import DISPATCH_SOLUTION
from parlib.course.questions.ch06.ep_layer import EP_LAYER_SOLUTION

__all__ = ["DISPATCH_SOLUTION", "EP_LAYER_SOLUTION", "dispatch", "ep_layer", "numbers"]
