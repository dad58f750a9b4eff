"""parlib stays in layers: each layer imports only the layers beneath it.

The layers, bottom up: cost (pure Python), chapters (data), comm, runtime, measure, model,
verify, strategies (importing only cost, comm, model and chapters: code to copy into a
training script), experiments, plots, examples (whole training scripts), course. Every
``import`` statement in a module counts, including those inside functions: a lazy import is
still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARLIB = ROOT / "parlib"

# layer -> the parlib modules it may import (besides itself); "*" is anything.
ALLOWED = {
    "parlib.cost": set(),
    "parlib.comm": set(),
    "parlib.runtime": {"parlib.comm"},
    "parlib.measure": {"parlib.cost", "parlib.comm"},
    "parlib.model": {"parlib.cost"},
    "parlib.chapters": set(),
    "parlib.strategies": {"parlib.cost", "parlib.comm", "parlib.model", "parlib.chapters"},
    "parlib.verify": {"parlib.model"},
    "parlib.experiments": {"parlib.cost", "parlib.comm", "parlib.runtime", "parlib.measure",
                           "parlib.model", "parlib.strategies", "parlib.verify"},
    "parlib.plots": {"parlib.cost", "parlib.measure"},
    "parlib.examples": {"parlib.cost", "parlib.comm", "parlib.runtime", "parlib.model",
                        "parlib.strategies"},
    "parlib.course": {"*"},
    # the front door and the command line
    "parlib": {"*"},
    "parlib.__main__": {"*"},
    "parlib.run": {"parlib.runtime"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> str:
    best = ""
    for layer in ALLOWED:
        if (name == layer or name.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    return best


MODULES = {module_name(p) for p in PARLIB.rglob("*.py")}


def parlib_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported parlib module) for every import in the file, lazy ones included;
    ``from package import submodule`` counts as importing the submodule."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "parlib"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] == "parlib":
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
                found += [(node.lineno, m) for m in subs] or [(node.lineno, base)]
    return found


def violations() -> list[str]:
    out = []
    for path in sorted(PARLIB.rglob("*.py")):
        me = module_name(path)
        mine = layer_of(me)
        allowed = ALLOWED[mine]
        for line, target in parlib_imports(path):
            theirs = layer_of(target)
            if "*" in allowed or theirs == mine or theirs in allowed:
                continue
            if target == "parlib" and mine != "parlib":
                out.append(f"{path.relative_to(ROOT)}:{line} imports the front door `parlib`")
                continue
            out.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    return out


def test_every_module_belongs_to_a_layer():
    for path in PARLIB.rglob("*.py"):
        assert layer_of(module_name(path)), f"{path} is in no layer: add it to ALLOWED"


def test_layers_import_only_what_lies_beneath():
    found = violations()
    assert not found, "layering broken:\n" + "\n".join(found)


def test_import_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for path in PARLIB.rglob("*.py"):
        graph[module_name(path)] = {t for _l, t in parlib_imports(path)}
    seen: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                nxt = nxt.rpartition(".")[0]  # `from parlib.x import name`
            if seen.get(nxt) == 1 and nxt != node:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt in graph and nxt not in seen:
                visit(nxt, stack + [nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])


def _loaded_after(code: str) -> set[str]:
    script = code + "\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize("code", [
    "import parlib",
    "import parlib.run",
    "import parlib.runtime, parlib.runtime.worker",
    "import parlib.strategies.data, parlib.strategies.pipeline, parlib.strategies.schedules",
    "import parlib.experiments.pipeline, parlib.experiments.combined",
    "import parlib.experiments.layouts, parlib.experiments.data, parlib.experiments.simulate",
    "import parlib.experiments.torch_pipelining",
])
def test_runtime_and_strategies_never_load_the_course_or_ipython(code):
    loaded = _loaded_after(code)
    assert not {m for m in loaded if m.startswith("parlib.course")}, code
    assert "IPython" not in loaded, code


def test_cost_and_schedules_import_without_torch():
    loaded = _loaded_after("import parlib.cost, parlib.strategies.schedules")
    assert "torch" not in loaded and "numpy" not in loaded
