"""Notebooks written on the fly for the grader's tests, and the sandbox they need."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import nbformat
import pytest


def notebook(folder: Path, name: str, *cells: str) -> Path:
    """``folder/name``: a notebook of code cells, each dedented."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c).strip()) for c in cells]
    path = folder / name
    nbformat.write(nb, path)
    return path


def need_bwrap() -> None:
    """Skip a sandboxed grading test where bwrap cannot run; in CI, fail it instead."""
    from parlib.course import sandbox

    if sandbox.bwrap() is None:
        message = "bwrap (bubblewrap) is missing or cannot make namespaces here"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the sandboxed grader (.ci/run installs it)")
        pytest.skip(message)
