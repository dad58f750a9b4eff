"""Committed notebooks are in the form JupyterLab writes, so opening one changes nothing
(issue 15, item 9). tests/ui/ checks the same in a real browser."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parlib.course import nbform

from ..test_packaging import ROOT

NOTEBOOKS = nbform.course_notebooks(ROOT)


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_notebook_is_in_jupyterlab_form(path):
    found = nbform.problems(path)
    assert not found, (f"{path.relative_to(ROOT)}: {'; '.join(found)}. "
                       "Run `python -m parlib.course.nbform` and commit the result.")


def _sample() -> dict:
    return {
        "cells": [
            {"cell_type": "markdown", "id": "intro", "metadata": {}, "source": "# Title\ntext"},
            {"cell_type": "code", "id": "c1", "metadata": {"tags": ["keep"]},
             "execution_count": None, "outputs": [], "source": "x = 1\nx"},
        ],
        "metadata": {"kernelspec": dict(nbform.KERNELSPEC),
                     "language_info": dict(nbform.LANGUAGE_INFO)},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _write(tmp_path, nb, name="nb.ipynb"):
    path = tmp_path / name
    path.write_text(nbform.dumps(nbform.normal_form(nb)) if nb is not None else "")
    return path


def test_normal_form_passes_and_is_stable(tmp_path):
    path = _write(tmp_path, _sample())
    assert nbform.problems(path) == []
    text = path.read_text()
    assert nbform.dumps(nbform.normal_form(json.loads(text))) == text
    nb = json.loads(text)
    assert [c["id"] for c in nb["cells"]] == ["intro", "c1"]
    assert nb["cells"][1]["metadata"] == {"tags": ["keep"]}


# Realistic ways a notebook reaches a commit in another form, each one rejected.
MUTANTS = {
    "display name of a hand-made kernelspec":
        lambda nb: nb["metadata"]["kernelspec"].update(display_name="Python 3"),
    "bare language_info": lambda nb: nb["metadata"].update(language_info={"name": "python"}),
    "outputs left in": lambda nb: nb["cells"][1].update(
        execution_count=3, outputs=[{"output_type": "stream", "name": "stdout", "text": "1\n"}]),
    "cell without id (nbformat 4.4)": lambda nb: (nb["cells"][0].pop("id"),
                                                 nb.update(nbformat_minor=4)),
    "per-run metadata": lambda nb: nb["cells"][1]["metadata"].update(scrolled=True),
    "written by json.dump without Jupyter's layout": None,
}


@pytest.mark.parametrize("name", MUTANTS)
def test_other_forms_are_rejected_and_repaired(tmp_path, name):
    nb = _sample()
    path = tmp_path / "nb.ipynb"
    if MUTANTS[name] is None:
        path.write_text(json.dumps(nbform.normal_form(nb)))  # one line, no final newline
    else:
        MUTANTS[name](nb)
        path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    assert nbform.problems(path), f"{name} was accepted"
    assert nbform.main([str(path)]) == 0
    assert nbform.problems(path) == []
    fixed = json.loads(path.read_text())
    assert ["".join(c["source"]) for c in fixed["cells"]] == ["# Title\ntext", "x = 1\nx"]
    assert fixed["cells"][0]["id"], "a missing id is filled in"


def test_check_mode_reports_and_changes_nothing(tmp_path, capsys):
    nb = _sample()
    nb["metadata"]["kernelspec"]["display_name"] = "Python 3"
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb, indent=1))
    before = path.read_text()
    assert nbform.main(["--check", str(path)]) == 1
    assert "kernelspec" in capsys.readouterr().out
    assert path.read_text() == before


def test_nbstripout_keep_id_leaves_the_form_unchanged(tmp_path):
    """The README's stripping command and the form agree: `nbstripout --keep-id` is a no-op on
    a normalised notebook, while plain `nbstripout` renumbers the ids (which is why the README
    says --keep-id)."""
    pytest.importorskip("nbstripout")
    path = _write(tmp_path, _sample())
    text = path.read_text()
    strip = [sys.executable, "-m", "nbstripout"]
    subprocess.run([*strip, "--keep-id", str(path)], check=True)
    assert path.read_text() == text
    subprocess.run([*strip, str(path)], check=True)
    assert [c["id"] for c in json.loads(path.read_text())["cells"]] == ["0", "1"]
