"""The course's auto-graded questions, one module or package per chapter (``chNN``, NN from
:data:`parlib.chapters.CHAPTERS`; a package holds one module per exercise or small group).

Each module registers its questions with :func:`parlib.course.registry.register` when imported.
Importing this package imports every chapter's module; one that fails to import is reported
with a warning and does not hide the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

from parlib.chapters import CHAPTERS as _ALL

CHAPTERS: list[str] = []

for _chapter in _ALL:
    _name = f"{__name__}.ch{_chapter.number}"
    if importlib.util.find_spec(_name) is None:
        continue  # a chapter without exercises
    try:
        importlib.import_module(_name)
    except Exception as _exc:  # noqa: BLE001 - one broken chapter must not hide the rest
        warnings.warn(f"{_name} failed to import: {_exc!r}")
    else:
        CHAPTERS.append(_chapter.number)
