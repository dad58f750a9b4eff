"""Notebooks written on the fly for the grader's tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat


def notebook(folder: Path, name: str, *cells: str) -> Path:
    """``folder/name``: a notebook of code cells, each dedented."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c).strip()) for c in cells]
    path = folder / name
    nbformat.write(nb, path)
    return path
