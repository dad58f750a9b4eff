"""Printed lines fit a notebook's output area (issue: long printed lines broke mid-word).

JupyterLab's output area breaks a line longer than it holds at any character, mid-word
included (``word-break: break-all``); at 1366 px with the file browser open it holds about 118
characters of its monospace font, at 1280 px about 107. The course keeps every line it prints
to :data:`parlib.measure.tables.LINE_WIDTH` (100) characters: the shared printers are held to it
here, and every ``print`` in the notebooks is checked without running them, by the text it
prints at least (its literal text, each formatted field counted at its format's width).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from parlib import verify
from parlib.measure.tables import LINE_WIDTH, print_wrapped
from parlib.runtime.group import announcement

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "authoring", "solutions", "exercises")
                   for p in (ROOT / d).glob("[0-9][0-9]_*.ipynb"))
_WIDTH = re.compile(r"^(?:.?[<>=^])?[+\- ]?z?#?0?(\d+)")


def test_print_wrapped_breaks_at_word_boundaries(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    words = [f"word{i}" for i in range(60)] + ["blocks.3.mlp.down.weight,"]
    print_wrapped(" ".join(words), "  a short indented line", "")
    out = capsys.readouterr().out.split("\n")[:-1]
    assert max(len(line) for line in out) <= LINE_WIDTH
    assert " ".join(" ".join(out[:-2]).split()) == " ".join(words)  # every word whole, in order
    assert all(line.startswith("  ") for line in out[1:-2]) and not out[0].startswith(" ")
    assert out[-2:] == ["  a short indented line", ""]


def test_print_wrapped_on_a_rank_leaves_room_for_the_rank_prefix(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "7")
    print_wrapped("word " * 40)
    out = capsys.readouterr().out.split("\n")[:-1]
    assert len(out) > 1 and max(len("[rank 7] " + line) for line in out) <= LINE_WIDTH


def test_a_comparison_fits_after_a_short_label():
    """`verify.compare`'s verdict, printed after a label such as the sharded chapter's (longer
    labels print it with `print_wrapped`)."""
    for ok, label in ((True, "N = 2, ZeRO-1: "), (False, "")):
        cmp = verify.Comparison(ok, 2.98e-08, "blocks.3.mlp.down.weight", ())
        line = f"{label}{cmp}"
        assert len(line) <= LINE_WIDTH, line
        assert ("equal" if ok else "DIFFERENT") in line and "blocks.3.mlp.down.weight" in line


@pytest.mark.parametrize("reason", ["no CUDA GPU found: ranks run on the CPU",
                                    "only 1 GPU(s) for 16 ranks: ranks run on the CPU",
                                    "backend='gloo' asked for: ranks run on the CPU"])
def test_the_launch_announcement_fits(reason):
    text = announcement(16, "cpu", "gloo", reason, "forkserver")
    assert max(len(line) for line in text.split("\n")) <= LINE_WIDTH, text
    assert "start method forkserver" in text and reason in text


def _least_text(node: ast.expr) -> str:
    """What an argument of ``print`` shows at least: literal text as written, a formatted
    field as many characters as its format's width (none if it has none)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                spec = "".join(v.value for v in getattr(value.format_spec, "values", [])
                               if isinstance(v, ast.Constant))
                width = _WIDTH.match(spec)
                parts.append("x" * int(width.group(1)) if width else "")
            else:
                parts.append(_least_text(value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _least_text(node.left) + _least_text(node.right)
    return ""


def printed_lines(source: str) -> list[str]:
    """The least text of every line each ``print(...)`` call in ``source`` prints."""
    tree = ast.parse("\n".join(line for line in source.split("\n")
                               if not line.lstrip().startswith(("%", "!"))))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "print":
            sep = next((_least_text(k.value) for k in node.keywords if k.arg == "sep"), " ")
            lines += sep.join(_least_text(a) for a in node.args).split("\n")
    return lines


def test_the_check_sees_a_long_print():
    long = 'print(f"{n:6d} ranks: " + "' + "word " * 20 + '")\nprint("a\\nb", f"{x}")'
    assert printed_lines(long) == ["xxxxxx ranks: " + "word " * 20, "a", "b "]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_notebook_prints_a_line_too_long_for_the_output_area(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    too_long = [f"cell {i}: {len(line)} characters at least: {line!r}"
                for i, cell in enumerate(cells) if cell["cell_type"] == "code"
                for line in printed_lines("".join(cell["source"]))
                if len(line) > LINE_WIDTH]
    assert not too_long, "\n".join(too_long)
