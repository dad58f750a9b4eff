"""Every registered multiple-choice question, all chapters: the right option does not give
itself away by its length, the question does not print the formula it asks about, and the
authoring notebook shows the options the grader checks."""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
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


# Over the whole course: no letter is the right one in more than this share of the choice
# questions, every letter of the four-option questions is right somewhere, and the right
# option is the shortest in at most this share (a learner who guesses the shortest, or B,
# must not do better than chance by much).
LETTER_SHARE = 0.4
SHORTEST_SHARE = 1 / 3


def _spread_problems(choices: dict[str, Choice]) -> list[str]:
    """What gives the right letters away over a set of choice questions (empty: nothing)."""
    n = len(choices)
    letters = Counter(q.answer for q in choices.values())
    problems = [f"the right option is {letter} in {count} of {n} questions"
                for letter, count in sorted(letters.items()) if count > LETTER_SHARE * n]
    four = {letter for q in choices.values() if len(q.options) >= 4 for letter in q.options}
    problems += [f"{letter} is never the right option" for letter in sorted(four - set(letters))]
    shortest = [qid for qid, q in choices.items()
                if len(q.options[q.answer]) <= min(len(v) for v in q.options.values())]
    if len(shortest) > SHORTEST_SHARE * n:
        problems.append(f"the right option is the shortest in {len(shortest)} of {n}: "
                        f"{shortest}")
    return problems


def test_right_letters_are_spread_over_the_course():
    assert len(CHOICES) >= 12
    assert _spread_problems(CHOICES) == []


def test_the_spread_rule_catches_the_old_course():
    # the course as it was: B right in 11 of 18 questions, D in none, the right option the
    # shortest in 10
    def question(i: int, answer: str, shortest: bool) -> Choice:
        options = {k: "a wrong option, longer" for k in "ABCD"}
        options[answer] = "right" if shortest else "the right option, longest of all"
        return Choice(f"99.q{i}", answer, options=options, prompt="?", working=answer)

    answers = "B" * 11 + "C" * 5 + "A" * 2
    old = {f"99.q{i}": question(i, a, i < 10) for i, a in enumerate(answers)}
    problems = _spread_problems(old)
    assert any("B in 11 of 18" in p for p in problems)
    assert "D is never the right option" in problems
    assert any("shortest in 10 of 18" in p for p in problems)


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
