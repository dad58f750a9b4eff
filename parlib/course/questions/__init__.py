"""The course's auto-graded questions, one module per chapter (``chNN.py``).

Each module registers its questions with :func:`parlib.course.registry.register` when imported.
Importing this package imports every chapter module; one that fails to import is reported
with a warning and does not hide the others.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import warnings

CHAPTERS: list[str] = []

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if re.fullmatch(r"ch\d\d", _info.name):
        try:
            importlib.import_module(f"{__name__}.{_info.name}")
        except Exception as _exc:  # noqa: BLE001 - one broken chapter must not hide the rest
            warnings.warn(f"parlib.course.questions.{_info.name} failed to import: {_exc!r}")
        else:
            CHAPTERS.append(_info.name[2:])
