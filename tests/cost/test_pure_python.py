"""parlib.cost stays pure Python: importing it loads neither torch nor numpy."""

import pathlib
import subprocess
import sys

import parlib.cost


def test_import_in_a_fresh_interpreter_loads_no_torch():
    code = ("import sys, parlib.cost, parlib.cost.published; "
            "from parlib.cost import Model, Hardware, Layout, Link, estimate, best_layouts; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_no_module_imports_torch_or_numpy():
    folder = pathlib.Path(parlib.cost.__file__).parent
    for path in folder.glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]):
                assert words[1].split(".")[0] not in ("torch", "numpy"), f"{path.name}: {line}"
