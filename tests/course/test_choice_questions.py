"""Every registered multiple-choice question, all chapters: the right option does not give
itself away by its length, the question does not print the formula it asks about, and the
authoring notebook shows the options the grader checks."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import pytest

from parlib.course.question_types import Choice
from parlib.course.registry import questions

ROOT = Path(__file__).parents[2]
CHOICES = {qid: q for qid, q in questions().items() if isinstance(q, Choice)}
# The right option may be the longest in at most this share of a chapter's choice
# questions, and never by more than this factor over the next longest.
LONGEST_SHARE = 1 / 3
LONGEST_RATIO = 1.25


def _lengths(q: Choice) -> tuple[int, int]:
    """(length of the right option, length of the longest wrong one)."""
    return (len(q.options[q.answer]),
            max(len(v) for k, v in q.options.items() if k != q.answer))


def test_there_are_choice_questions_in_several_chapters():
    assert len({q.chapter for q in CHOICES.values()}) >= 4


@pytest.mark.parametrize("qid", sorted(CHOICES))
def test_right_option_never_much_longer_than_the_next(qid):
    right, longest_wrong = _lengths(CHOICES[qid])
    assert right <= LONGEST_RATIO * longest_wrong, (
        f"{qid}: the right option is {right} characters, the longest wrong one "
        f"{longest_wrong}: length gives it away")


def test_right_option_is_not_systematically_the_longest():
    by_chapter = defaultdict(list)
    for qid, q in CHOICES.items():
        right, longest_wrong = _lengths(q)
        by_chapter[q.chapter].append((qid, right > longest_wrong))
    for chapter, flags in by_chapter.items():
        longest = [qid for qid, is_longest in flags if is_longest]
        allowed = math.floor(LONGEST_SHARE * len(flags))
        assert len(longest) <= allowed, (
            f"chapter {chapter}: the right option is the longest in {longest} "
            f"({len(longest)} of {len(flags)}; at most {allowed})")


def test_the_rule_catches_a_give_away():
    # the check above can fail: a question whose right option is the long, careful one
    q = Choice("99.demo", "C", options={"A": "fewer bytes", "B": "no sync",
                                        "C": "it overlaps the last layers' all-reduce with "
                                             "the backward of the earlier layers",
                                        "D": "exact sums"},
               prompt="Why?", working="C.")
    right, longest_wrong = _lengths(q)
    assert right > LONGEST_RATIO * longest_wrong


_FORMULA = re.compile(r"\(p\s*-\s*1\)\s*/\s*\(")  # the bubble's (p - 1) / (...)


@pytest.mark.parametrize("qid", sorted(CHOICES))
def test_question_does_not_print_the_formula_it_asks_about(qid):
    assert not _FORMULA.search(CHOICES[qid].prompt), CHOICES[qid].prompt


def _authoring_markdown(chapter: str) -> str:
    path = next((ROOT / "authoring").glob(f"{chapter}_*.ipynb"))
    nb = json.loads(path.read_text())
    return " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


@pytest.mark.parametrize("qid", sorted(CHOICES))
def test_authoring_notebook_shows_the_graded_options(qid):
    q = CHOICES[qid]
    text = " ".join(_authoring_markdown(q.chapter).split())
    for letter, option in q.options.items():
        assert " ".join(option.split()) in text, (
            f"{qid}: option {letter} as graded is not in authoring/{q.chapter}_*.ipynb: "
            f"{option!r}")
