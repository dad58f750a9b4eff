"""The course's chapters, in their final order: the one place a chapter's number lives.

File names (``notebooks/NN_stem.ipynb`` and its twins in ``authoring/``, ``exercises/``,
``solutions/``), question ids (``"NN.name"``, declared in ``parlib/course/questions/chNN``)
and the README's table are checked against this list (``tests/test_chapters.py``). Prose
names a chapter by :attr:`Chapter.name` ("the pipeline chapter"), never by its number, so
that a chapter added later cannot make a sentence point at the wrong one.

A chapter is listed once it exists; every chapter of the final order, 00 to 09, now does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chapter:
    number: str  # "03": file prefix and question-id prefix
    slug: str  # "tensor": a short handle for code
    stem: str  # "tensor_parallel": the notebook's file name after the number
    title: str  # "Tensor parallelism"
    name: str  # "the tensor-parallel chapter": how prose refers to it

    @property
    def notebook(self) -> str:
        return f"{self.number}_{self.stem}.ipynb"


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00", "launching", "launching_ranks", "Launching ranks", "the launching chapter"),
    Chapter("01", "data", "data_parallel", "Data parallelism", "the data-parallel chapter"),
    Chapter("02", "sharded", "sharded_data_parallel", "Sharded data parallelism",
            "the sharded-data-parallel chapter"),
    Chapter("03", "tensor", "tensor_parallel", "Tensor parallelism",
            "the tensor-parallel chapter"),
    Chapter("04", "pipeline", "pipeline_parallel", "Pipeline parallelism",
            "the pipeline chapter"),
    Chapter("05", "context", "context_parallel", "Context parallelism",
            "the context-parallel chapter"),
    Chapter("06", "experts", "expert_parallel", "Expert parallelism",
            "the expert-parallel chapter"),
    Chapter("07", "combining", "combining", "Combining the axes", "the combining chapter"),
    Chapter("08", "choosing", "choosing", "Choosing a layout", "the choosing chapter"),
    Chapter("09", "long_runs", "long_runs", "Long runs", "the long-runs chapter"),
)


def chapter(key: str) -> Chapter:
    """The chapter with this number ("03") or slug ("tensor")."""
    for c in CHAPTERS:
        if key in (c.number, c.slug):
            return c
    known = ", ".join(f"{c.number} ({c.slug})" for c in CHAPTERS)
    raise KeyError(f"no chapter {key!r}; the chapters are {known}")


__all__ = ["CHAPTERS", "Chapter", "chapter"]
