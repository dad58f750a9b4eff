"""Questions of the pipeline chapter: pipeline parallelism (notebook 04_pipeline_parallel).

``numbers`` (bubbles, microbatches, in-flight activations, bytes, choices) and ``gpipe``
(one GPipe step on ranks, a :class:`~parlib.course.on_ranks.RankExercise`).
"""

from __future__ import annotations

from parlib.course.questions.ch04 import gpipe, numbers
from parlib.course.questions.ch04.gpipe import GPIPE_SOLUTION, reference_gpipe

__all__ = ["GPIPE_SOLUTION", "gpipe", "numbers", "reference_gpipe"]
