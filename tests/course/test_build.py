"""python -m parlib build: markers, stubs, byte-identical rebuilds, drift and output checks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import nbformat
import pytest

from parlib.course import nbbuild


def code(src, **extra):
    return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": src, **extra}


def md(src):
    return {"cell_type": "markdown", "metadata": {}, "source": src}


SOURCE_CELLS = [
    md("# A made-up chapter\n<!-- BEGIN SOLUTION -->\nsecret note\n<!-- END SOLUTION -->\nend"),
    md("<!-- SOLUTION -->\nThe full working."),
    code("import math\nanswer = 6 * 2**20  # SOLUTION\nlr: float = 0.1  # SOLUTION\n"
         "print('ok')",
         execution_count=3,
         outputs=[{"output_type": "stream", "name": "stdout", "text": "ok\n"}]),
    code("def f(x):\n    \"\"\"Double x.\"\"\"\n    # BEGIN SOLUTION\n    y = x * 2\n"
         "    return y\n    # END SOLUTION\n\n\ndef g(x):\n    return x + 1  # SOLUTION"),
    code("# BEGIN SOLUTION\nz = 1\n# END SOLUTION\nprint('after')"),
    code("# SOLUTION CELL\nprint('only in solutions')"),
]


def write_source(root: Path, cells=None, name="99_demo.ipynb") -> Path:
    nb = {"cells": cells or SOURCE_CELLS,
          "metadata": {"kernelspec": {"name": "whatever", "display_name": "x",
                                      "language": "python"},
                       "widgets": {"junk": 1}, "language_info": {"version": "3.11.7"}},
          "nbformat": 4, "nbformat_minor": 4}
    (root / "authoring").mkdir(parents=True, exist_ok=True)
    p = root / "authoring" / name
    p.write_text(json.dumps(nb, indent=2))
    return p


def run(*argv) -> tuple[int, str]:
    out = io.StringIO()
    root = Path(argv[argv.index("--root") + 1])
    rc = nbbuild.build(root, check="--check" in argv, out=out)
    return rc, out.getvalue()


def sources_of(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return ["".join(c.source) for c in nb.cells]


def test_build_writes_solution_and_exercise(tmp_path):
    write_source(tmp_path)
    assert nbbuild.main(["--root", str(tmp_path)]) == 0
    sol = sources_of(tmp_path / "solutions" / "99_demo.ipynb")
    ex = sources_of(tmp_path / "exercises" / "99_demo.ipynb")

    assert sol[0] == "# A made-up chapter\nsecret note\nend"
    assert sol[1] == "The full working."
    assert sol[2] == "import math\nanswer = 6 * 2**20\nlr: float = 0.1\nprint('ok')"
    assert "    y = x * 2\n    return y\n" in sol[3] and "SOLUTION" not in sol[3]
    assert "return x + 1" in sol[3]
    assert sol[4] == "z = 1\nprint('after')"
    assert sol[5] == "print('only in solutions')"
    assert not any("SOLUTION" in s for s in sol)

    assert len(ex) == 4  # solution-only markdown and code cells dropped
    assert ex[0] == "# A made-up chapter\nend"
    assert ex[1] == ("import math\nanswer = ...  # your answer\nlr: float = ...  # your answer\n"
                     "print('ok')")
    assert ex[2] == ('def f(x):\n    """Double x."""\n    raise NotImplementedError("your code '
                     'here")\n\n\ndef g(x):\n    raise NotImplementedError("your code here")')
    assert ex[3] == "# your code here\nprint('after')"
    assert not any("secret" in s or "working" in s for s in ex)


def test_exercise_code_still_runs_and_stubs(tmp_path):
    write_source(tmp_path)
    nbbuild.main(["--root", str(tmp_path)])
    ex = sources_of(tmp_path / "exercises" / "99_demo.ipynb")
    ns: dict = {}
    for src in ex[1:]:
        exec(compile(src, "<cell>", "exec"), ns)  # noqa: S102
    assert ns["answer"] is Ellipsis and ns["lr"] is Ellipsis
    with pytest.raises(NotImplementedError):
        ns["f"](1)
    sol = sources_of(tmp_path / "solutions" / "99_demo.ipynb")
    ns = {}
    for src in sol[2:]:
        exec(compile(src, "<cell>", "exec"), ns)  # noqa: S102
    assert ns["f"](2) == 4 and ns["g"](2) == 3 and ns["answer"] == 6 * 2**20


def test_outputs_stripped_and_metadata_normalised(tmp_path):
    write_source(tmp_path)
    nbbuild.main(["--root", str(tmp_path)])
    for target in ("solutions", "exercises"):
        nb = json.loads((tmp_path / target / "99_demo.ipynb").read_text())
        assert nb["metadata"] == {"kernelspec": nbbuild.KERNELSPEC,
                                  "language_info": nbbuild.LANGUAGE_INFO}
        assert nb["nbformat"] == 4 and nb["nbformat_minor"] == 5
        for c in nb["cells"]:
            if c["cell_type"] == "code":
                assert c["outputs"] == [] and c["execution_count"] is None
            assert c["id"]


def test_rebuild_is_byte_identical_and_check_passes(tmp_path):
    write_source(tmp_path)
    nbbuild.main(["--root", str(tmp_path)])
    first = {p: p.read_bytes() for p in tmp_path.glob("*/99_demo.ipynb")}
    nbbuild.main(["--root", str(tmp_path)])
    assert {p: p.read_bytes() for p in tmp_path.glob("*/99_demo.ipynb")} == first
    # the source has outputs: --check must complain about exactly that
    rc, out = run("--check", "--root", str(tmp_path))
    assert rc == 1 and "authoring/99_demo.ipynb carries outputs" in out
    assert "differs" not in out


def test_check_detects_drift_and_outputs(tmp_path):
    cells = [c for c in SOURCE_CELLS]
    cells[2] = code("answer = 6 * 2**20  # SOLUTION")
    write_source(tmp_path, cells)
    assert nbbuild.main(["--root", str(tmp_path)]) == 0
    rc, out = run("--check", "--root", str(tmp_path))
    assert rc == 0, out

    # edit the source without rebuilding: both outputs drift
    cells[2] = code("answer = 7 * 2**20  # SOLUTION")
    write_source(tmp_path, cells)
    rc, out = run("--check", "--root", str(tmp_path))
    assert rc == 1
    assert "solutions/99_demo.ipynb differs" in out
    assert "exercises/99_demo.ipynb" not in out  # the exercise text did not change

    # a generated file deleted
    nbbuild.main(["--root", str(tmp_path)])
    (tmp_path / "exercises" / "99_demo.ipynb").unlink()
    rc, out = run("--check", "--root", str(tmp_path))
    assert rc == 1 and "exercises/99_demo.ipynb differs" in out and "missing" in out

    # an executed notebook under notebooks/
    nbbuild.main(["--root", str(tmp_path)])
    (tmp_path / "notebooks").mkdir()
    executed = {"cells": [code("1", execution_count=1, outputs=[])], "metadata": {},
                "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "notebooks" / "01_x.ipynb").write_text(json.dumps(executed))
    rc, out = run("--check", "--root", str(tmp_path))
    assert rc == 1 and "notebooks/01_x.ipynb carries outputs" in out


@pytest.mark.parametrize("src, words", [
    ("# BEGIN SOLUTION\nx = 1", "no '# END SOLUTION'"),
    ("x = 1\n# END SOLUTION", "no '# BEGIN SOLUTION'"),
    ("print(1)  # SOLUTION", "must be an assignment"),
])
def test_malformed_markers_are_reported(tmp_path, src, words):
    write_source(tmp_path, [code(src)])
    rc, out = run("--root", str(tmp_path))
    assert rc == 1 and words in out
    assert not (tmp_path / "solutions" / "99_demo.ipynb").exists()


def test_committed_chapter00_is_up_to_date():
    root = Path(__file__).resolve().parents[2]
    if not (root / "authoring" / "00_launching_ranks.ipynb").exists():
        pytest.skip("no launching-chapter source")
    out = io.StringIO()
    rc = nbbuild.build(root, check=True, only=["00_launching_ranks.ipynb"], out=out)
    assert rc == 0 or "00_launching_ranks" not in out.getvalue(), out.getvalue()


def test_nbval_sanitizer_config_is_valid_and_masks_volatile_text():
    import configparser
    import re

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "nbval_sanitize.cfg")
    assert cfg.sections()

    def sanitize(text):
        for s in cfg.sections():
            text = re.sub(cfg[s]["regex"], cfg[s]["replace"], text)
        return text

    a = "step took 12.5 ms (0.93 GB/s), 3.1x faster; <object at 0x7f3a2b1c4d50> pid 4242"
    b = "step took 9 ms (1.2 GB/s), 2.7x faster; <object at 0x7f00aa11bb22> pid 77"
    assert sanitize(a) == sanitize(b)
    assert sanitize("[rank 3] hello") == sanitize("[rank 1] hello")
    assert sanitize("answer: 6291456 bytes") == "answer: 6291456 bytes"
