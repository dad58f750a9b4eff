"""The course's pieces line up: every chapter's questions import, every exercise source has
its question module, every notebook is listed in the README and stored without outputs."""

import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIRS = ("notebooks", "authoring", "solutions", "exercises")


def chapters_with_exercises():
    return sorted({p.name[:2] for p in (ROOT / "authoring").glob("[0-9][0-9]_*.ipynb")})


@pytest.mark.parametrize("chapter", chapters_with_exercises())
def test_question_module_imports_and_declares_questions(chapter):
    # raises, unlike the package loop
    importlib.import_module(f"parlib.course.questions.ch{chapter}")
    from parlib.course.registry import questions

    declared = questions(chapter)
    assert len(declared) >= 4, f"chapter {chapter} declares only {sorted(declared)}"
    for qid, question in declared.items():
        assert question.working.strip(), f"{qid} has no worked answer"


@pytest.mark.parametrize("chapter", chapters_with_exercises())
def test_every_declared_question_is_checked_in_its_notebook(chapter):
    from parlib.course.registry import questions

    (source,) = (ROOT / "authoring").glob(f"{chapter}_*.ipynb")
    text = "".join("".join(c["source"]) for c in json.loads(source.read_text())["cells"])
    for qid in questions(chapter):
        assert re.search(rf"parlib\.check\(\s*['\"]{re.escape(qid)}['\"]", text), (
            f"{source.name} never calls parlib.check({qid!r})"
        )


def test_readme_lists_every_lesson():
    readme = (ROOT / "README.md").read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{nb.name}" in readme, f"README does not list {nb.name}"


def test_notebooks_are_stored_without_outputs():
    for folder in NOTEBOOK_DIRS:
        for nb in (ROOT / folder).glob("*.ipynb"):
            for cell in json.loads(nb.read_text())["cells"]:
                if cell["cell_type"] == "code":
                    assert not cell.get("outputs"), f"{folder}/{nb.name} has outputs"
                    assert cell.get("execution_count") is None, f"{folder}/{nb.name}"
