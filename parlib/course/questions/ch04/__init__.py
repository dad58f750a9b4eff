"""Questions of the pipeline chapter: pipeline parallelism (notebook 04_pipeline_parallel).

``numbers`` (bubbles, microbatches, in-flight activations, bytes, messages, choices),
``gpipe`` (one GPipe step on ranks, a :class:`~parlib.course.on_ranks.RankExercise`) and
``schedules`` (1F1B and ZB-H1 written as data, validated, simulated and run).
"""

from __future__ import annotations

from parlib.course.questions.ch04 import gpipe, numbers, schedules
from parlib.course.questions.ch04.gpipe import GPIPE_SOLUTION, reference_gpipe
from parlib.course.questions.ch04.schedules import ONE_F_ONE_B_SOLUTION, ZB_H1_SOLUTION

__all__ = ["GPIPE_SOLUTION", "ONE_F_ONE_B_SOLUTION", "ZB_H1_SOLUTION", "gpipe", "numbers",
           "reference_gpipe", "schedules"]
