"""Learners only ever meet parlib's public names.

Every ``parlib`` name the notebooks, exercise sources, exercises and solutions use must be
listed in its module's ``__all__`` (or be a public submodule): notebooks never reach into
private helpers, and a helper that notebooks use is documented as public.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "authoring", "exercises", "solutions")

_FROM = re.compile(r"^\s*from\s+(parlib(?:\.\w+)*)\s+import\s+\(?([^)#\n]+)", re.M)
_IMPORT = re.compile(r"^\s*import\s+(parlib(?:\.\w+)*)(?:\s+as\s+(\w+))?", re.M)
_ATTR = re.compile(r"\b(parlib(?:\.\w+)+)")


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _public(module: str, name: str) -> str | None:
    """None when ``module.name`` is public, else why not."""
    if name.startswith("_"):
        return f"{module}.{name} is private (leading underscore)"
    if _is_module(f"{module}.{name}"):
        return None
    mod = importlib.import_module(module)
    exported = getattr(mod, "__all__", None)
    if exported is None:
        return f"{module} has no __all__, so {name} is not declared public"
    if name not in exported:
        return f"{module}.{name} is not in {module}.__all__"
    return None


def uses(source: str) -> set[tuple[str, str]]:
    """(module, name) pairs a cell's source uses, aliases of parlib modules followed."""
    found: set[tuple[str, str]] = set()
    aliases: dict[str, str] = {}
    for module, names in _FROM.findall(source):
        for item in names.split(","):
            parts = item.split()
            if not parts:
                continue
            name = parts[0]
            found.add((module, name))
            if _is_module(f"{module}.{name}"):
                aliases[parts[-1]] = f"{module}.{name}"
    for module, alias in _IMPORT.findall(source):
        if alias:
            aliases[alias] = module
    for chain in _ATTR.findall(source):
        parts = chain.split(".")
        for i in range(1, len(parts)):
            module = ".".join(parts[:i])
            if not _is_module(".".join(parts[: i + 1])):
                found.add((module, parts[i]))
                break
    for alias, module in aliases.items():
        for name in re.findall(rf"(?<![\w.]){re.escape(alias)}\.(\w+)", source):
            found.add((module, name))
    return found


def notebook_sources() -> list[tuple[str, str]]:
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text())["cells"]
            code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
            out.append((f"{folder}/{path.name}", code))
    return out


@pytest.mark.parametrize("where,source", notebook_sources(), ids=lambda x: str(x)[:40])
def test_notebooks_use_only_public_names(where, source):
    problems = sorted({p for m, n in uses(source) if (p := _public(m, n))})
    assert not problems, f"{where}:\n" + "\n".join(problems)


def test_the_scanner_sees_private_and_undeclared_names():
    source = ("from parlib.runtime.policy import start_context\n"
              "from parlib.strategies import data as dp\nx = dp._params\ny = parlib.runtime._x\n")
    found = uses(source)
    assert ("parlib.runtime.policy", "start_context") in found
    assert ("parlib.strategies.data", "_params") in found
    assert _public("parlib.runtime.policy", "start_context") is not None
    assert _public("parlib.strategies.data", "_params") is not None
    assert _public("parlib.strategies.data", "Zero1") is None
