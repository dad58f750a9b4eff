"""The registry of questions: each chapter's module registers its questions on import."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from parlib.course.question_types import Question

_REGISTRY: dict[str, Question] = {}
_LOADED = False


def register(question: Question) -> Question:
    """Add a question to the registry (keyed by id) and return it."""
    _REGISTRY[question.id] = question
    return question


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    importlib.import_module("parlib.course.questions")


def questions(chapter: str | None = None) -> dict[str, Question]:
    """All registered questions (of one chapter, e.g. ``"00"``), ordered by id."""
    _load_all()
    items = sorted(_REGISTRY.items())
    return {k: q for k, q in items if chapter is None or q.chapter == chapter}


def get_question(question_id: str) -> Question:
    _load_all()
    return _REGISTRY[question_id]


def unknown_id_message(question_id: Any) -> str:
    ids = list(questions())
    if not isinstance(question_id, str):
        return f"the question id must be a string like '00.ring_bytes', got {question_id!r}"
    near = difflib.get_close_matches(question_id, ids, n=5, cutoff=0.5)
    chapter = question_id.split(".", 1)[0]
    same = [i for i in ids if i.startswith(chapter + ".")]
    near += [i for i in same if i not in near]
    msg = f"there is no question {question_id!r}."
    if near:
        msg += " Did you mean: " + ", ".join(near[:8]) + "?"
    else:
        msg += " Known questions: " + ", ".join(ids[:12]) + ("..." if len(ids) > 12 else "")
    return msg


__all__ = ["get_question", "questions", "register"]
