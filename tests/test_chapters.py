"""Chapters are data: file names, question ids and the README's table agree with
parlib.chapters, and prose names chapters by name, never by a number that could go stale."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from parlib.chapters import CHAPTERS, chapter
from parlib.course.registry import questions

ROOT = Path(__file__).resolve().parents[1]
NUMBERS = {c.number for c in CHAPTERS}


def test_numbers_and_slugs_are_unique_and_in_order():
    assert [c.number for c in CHAPTERS] == sorted(NUMBERS) and len(NUMBERS) == len(CHAPTERS)
    assert len({c.slug for c in CHAPTERS}) == len(CHAPTERS)
    assert chapter("tensor") is chapter("03")
    with pytest.raises(KeyError, match="no chapter '99'"):
        chapter("99")


@pytest.mark.parametrize("folder", ["notebooks", "authoring", "exercises", "solutions"])
def test_numbered_notebooks_are_the_registered_chapters(folder):
    found = {p.name for p in (ROOT / folder).glob("[0-9][0-9]_*.ipynb")}
    registered = {c.notebook for c in CHAPTERS}
    assert found <= registered, f"{folder}/ has notebooks no chapter declares: {found - registered}"
    if folder == "notebooks":
        assert found == registered, f"chapters without a notebook: {registered - found}"


def test_each_chapter_with_exercises_has_its_question_module():
    authored = {p.name[:2] for p in (ROOT / "authoring").glob("[0-9][0-9]_*.ipynb")}
    modules = {p.stem[2:] for p in (ROOT / "parlib/course/questions").glob("ch[0-9][0-9]*")
               if p.stem != "__init__"}
    assert modules == authored


def test_every_question_id_starts_with_its_chapters_number():
    for qid, q in questions().items():
        number = qid.split(".", 1)[0]
        assert number in NUMBERS, f"question {qid} names no registered chapter"
        assert q.chapter == number


def test_readme_table_lists_exactly_the_chapters():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d\d) \| `notebooks/([^`]+)` \|", readme, flags=re.M)
    assert rows == [(c.number, c.notebook) for c in CHAPTERS]


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = out.stdout.split() if out.returncode == 0 else []
    if not names:  # not a git checkout: every text file we ship
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]
    return [ROOT / n for n in names
            if n.endswith((".py", ".ipynb", ".md", ".cfg", ".toml", ".yml"))
            and (ROOT / n).exists()]


def test_prose_names_chapters_instead_of_numbering_them():
    pattern = re.compile(r"\b[Cc]hapters? \d")
    hits = []
    for path in _tracked_text_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, ("name chapters (parlib.chapters: Chapter.name), don't number them:\n"
                      + "\n".join(hits))


@pytest.mark.parametrize("folder", ["notebooks", "authoring", "exercises", "solutions"])
def test_each_notebooks_title_carries_its_chapters_number(folder):
    import json

    for c in CHAPTERS:
        path = ROOT / folder / c.notebook
        if not path.exists():
            continue
        cells = json.loads(path.read_text())["cells"]
        title = "".join(next(x for x in cells if x["cell_type"] == "markdown")["source"])
        assert title.startswith(f"# {c.number} ·"), f"{folder}/{c.notebook}: {title[:40]!r}"
