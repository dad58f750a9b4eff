"""Every option of every registered multiple-choice question is a whole phrase: none stops
on a word that needs another after it (08.memory_bound's option C once ended "to keep the
step's", cut off mid-sentence)."""

from __future__ import annotations

import re

import pytest

from parlib.course.question_types import Choice
from parlib.course.registry import questions

CHOICES = {qid: q for qid, q in questions().items() if isinstance(q, Choice)}
# words a phrase cannot end on: articles, conjunctions, possessives ("ends with" can end one)
_DANGLING = {"a", "an", "the", "of", "and", "or", "but", "than", "its", "their", "each",
             "every", "this", "these"}


def dangling_end(option: str) -> str | None:
    """The last word of ``option`` if the phrase cannot end on it, else None."""
    words = re.findall(r"[\w']+", option.lower())
    if not words:
        return "(empty)"
    last = words[-1]
    return last if last in _DANGLING or last.endswith("'s") else None


@pytest.mark.parametrize("qid", sorted(CHOICES))
def test_every_option_is_a_whole_phrase(qid):
    cut = {letter: text for letter, text in CHOICES[qid].options.items()
           if dangling_end(text.rstrip(" .:;,"))}
    assert not cut, f"{qid}: options cut off mid-sentence: {cut}"


def test_the_rule_catches_a_cut_off_option():
    assert dangling_end("with gradient accumulation to keep the step's") == "step's"
    assert dangling_end("it sends the activations of the") == "the"
    assert dangling_end("the bytes of the all-reduce the MLP ends with") is None
    assert dangling_end("with gradient accumulation to keep the step's batch") is None
    assert dangling_end("2 x 4P x (N-1)/N") is None
