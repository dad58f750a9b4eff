"""Result tables: print as aligned text, render as HTML in a notebook."""

from __future__ import annotations

import html
import os
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

MiB = 2**20
# The characters a printed line may hold: JupyterLab's output area breaks longer lines anywhere,
# mid-word included, and at 1366 px (the file browser open) it holds about 118 monospace
# characters, at 1280 px about 107.
LINE_WIDTH = 100


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units: '512 B', '3.31 MiB', '1.20 GiB'."""
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if value == 0:
            return "0"
        if abs(value) >= 1000 or abs(value) < 0.01:
            return f"{value:.3g}"
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.1f}"
    if value is None:
        return "-"
    return str(value)


def print_wrapped(*lines: str, width: int | None = None, indent: str = "  ",
                  flush: bool = False) -> None:
    """Print each of ``lines`` (and each line inside them), wrapped at word boundaries so
    that no printed line is longer than ``width`` characters (:data:`LINE_WIDTH`, less the
    ``[rank r]`` prefix the notebook adds when this runs on a rank); a line's continuations
    are indented by ``indent``. ``print`` for the course's result sentences."""
    if width is None:
        rank = os.environ.get("RANK")  # set on every rank parlib.launch starts
        width = LINE_WIDTH - (len(f"[rank {rank}] ") if rank is not None else 0)
    for text in lines:
        for line in str(text).split("\n"):
            lead = line[:len(line) - len(line.lstrip(" "))]
            print("\n".join(textwrap.wrap(line, width, subsequent_indent=lead + indent,
                                           break_long_words=False, break_on_hyphens=False))
                  or line, flush=flush)


class Table:
    """A small table: prints as aligned text, renders as HTML in a notebook.

    ``Table(["strategy", "steps/s"], [["naive", 12.3], ["ddp", 20.1]], title="...")``.
    Floats are shown with about three significant figures; strings are shown as given.
    Columns of numbers are right-aligned, columns holding any text left-aligned (in text and
    in HTML). As text, the widest text column wraps so that lines fit ``max_width``.
    """

    def __init__(self, columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str = "",
                 max_width: int = LINE_WIDTH):
        self.columns = list(columns)
        self.rows = [list(r) for r in rows]
        self.title = title
        self.max_width = max_width
        for r in self.rows:
            if len(r) != len(self.columns):
                raise ValueError(f"row {r!r} has {len(r)} cells, expected {len(self.columns)}")

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]

    def _cells(self) -> list[list[str]]:
        return [[_fmt(v) for v in r] for r in self.rows]

    def _numeric(self, i: int) -> bool:
        return bool(self.rows) and all(not isinstance(r[i], str) for r in self.rows)

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        total = sum(widths) + 2 * (len(widths) - 1)
        text_cols = [i for i in range(len(widths)) if not self._numeric(i)]
        rows = cells
        if total > self.max_width and text_cols:
            # Wrap the widest text column; its continuation lines leave the others blank.
            wide = max(text_cols, key=lambda i: widths[i])
            widths[wide] = max(len(self.columns[wide]), 12, widths[wide] - (total - self.max_width))
            rows = []
            for r in cells:
                parts = textwrap.wrap(r[wide], widths[wide]) or [""]
                rows.append(r[:wide] + [parts[0]] + r[wide + 1:])
                rows.extend([""] * wide + [p] + [""] * (len(r) - wide - 1) for p in parts[1:])

        def line(values: list[str]) -> str:
            return "  ".join(v.rjust(widths[i]) if self._numeric(i) else v.ljust(widths[i])
                             for i, v in enumerate(values)).rstrip()

        parts = [self.title] if self.title else []
        parts.append(line(self.columns))
        parts.append("  ".join("-" * w for w in widths))
        parts.extend(line(r) for r in rows)
        return "\n".join(parts)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        # Notebook front ends right-align table cells: text columns ask for the left.
        align = ["" if self._numeric(i) else ' style="text-align: left"'
                 for i in range(len(self.columns))]
        head = "".join(f"<th{a}>{html.escape(c)}</th>" for a, c in zip(align, self.columns))
        body = "".join(
            "<tr>" + "".join(f"<td{a}>{html.escape(c)}</td>" for a, c in zip(align, r)) + "</tr>"
            for r in self._cells()
        )
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


__all__ = ["LINE_WIDTH", "MiB", "Table", "fmt_bytes", "print_wrapped"]
