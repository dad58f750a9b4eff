"""Questions of the choosing chapter: the practice set on choosing a mix (notebook 08_choosing).

Eight-plus questions across the three outcomes of the course, one module each: what each
strategy splits and communicates (``what_splits``); which strategy a memory-bound and a
bandwidth-bound run need (``memory_or_bandwidth``); what the pipeline bubble is and how to
shrink it (``bubble``). Every expected answer comes from :mod:`parlib.cost`, the same
formulas the chapters use.
"""

from __future__ import annotations

from parlib.course.questions.ch08 import bubble, memory_or_bandwidth, what_splits

__all__ = ["bubble", "memory_or_bandwidth", "what_splits"]
