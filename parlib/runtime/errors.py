"""What a failing rank looks like in the notebook: :class:`RankError`, and the rank's
traceback mapped back to the learner's cells."""

from __future__ import annotations

import linecache
import os
import re
import traceback
from typing import Any


class RankError(RuntimeError):
    """A rank failed, hung past the timeout, or died. Raised in the notebook cell.

    Attributes: ``rank`` (the root-cause rank, or None), ``exc_type`` (the exception's type
    name, ``"Timeout"`` or ``"Exited"``), ``remote_traceback`` (text, with frames from
    notebook cells shown with their source lines).
    """

    def __init__(self, message: str, rank: int | None, exc_type: str, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\n" + self.remote_traceback
        return text


_INTERNAL_PATTERNS = (
    os.sep + "torch" + os.sep,
    os.sep + "cloudpickle" + os.sep,
    os.sep + "multiprocessing" + os.sep,
    os.sep + "concurrent" + os.sep,
    os.sep + "IPython" + os.sep,
    os.sep + "ipykernel" + os.sep,
    os.sep + "threading.py",
    os.sep + "runpy.py",
    "<frozen ",
)
_PARLIB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_parlib_frame(filename: str) -> bool:
    """A frame of parlib's own code (seen from the kernel or from a rank)."""
    return (filename.startswith(_PARLIB_DIR + os.sep)
            or re.search(r"[\\/]parlib[\\/](\w+[\\/])*\w+\.py$", filename) is not None)


def is_library_frame(filename: str) -> bool:
    """A frame the learner did not write: parlib, torch, cloudpickle, the standard
    library's process and thread machinery, IPython."""
    return is_parlib_frame(filename) or any(p in filename for p in _INTERNAL_PATTERNS)


_FRAME_RE = re.compile(r'^  File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<name>.*)$')


def trim_traceback(tb: str | BaseException) -> str:
    """Keep only the learner's frames of a traceback (text or exception).

    Frames from parlib, torch, cloudpickle, multiprocessing and IPython are dropped; the
    final ``Type: message`` lines are kept. If no learner frame is left the last frame is
    kept so the message still says where it came from.
    """
    if isinstance(tb, BaseException):
        tb = "".join(traceback.format_exception(type(tb), tb, tb.__traceback__))
    lines = tb.rstrip("\n").splitlines()
    # only the last chained traceback matters for the learner
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if starts:
        lines = lines[starts[-1]:]
    header: list[str] = []
    frames: list[tuple[str, list[str]]] = []
    tail: list[str] = []
    i = 0
    if lines and lines[0].startswith("Traceback"):
        header = [lines[0]]
        i = 1
    while i < len(lines):
        m = _FRAME_RE.match(lines[i])
        if m:
            block = [lines[i]]
            i += 1
            while i < len(lines) and lines[i].startswith("    "):
                block.append(lines[i])
                i += 1
            frames.append((m.group("file"), block))
        else:
            tail = lines[i:]
            break
    kept = [b for f, b in frames if not is_library_frame(f)]
    if not kept and frames:
        kept = [frames[-1][1]]
    out = header + [ln for b in kept for ln in b] + tail
    return "\n".join(out)


def format_ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)




def code_index(objects: tuple) -> dict[str, list[tuple[str, int, int]]]:
    """Where the code shipped to the ranks came from: function name -> (file, first, last line).

    cloudpickle ships cell-defined code by value and rank tracebacks then name its frames
    ``<dynamic-code>``; this index maps them back to the cell, whose source the kernel has.
    """
    index: dict[str, list[tuple[str, int, int]]] = {}
    seen: set[int] = set()

    def visit_code(code: Any) -> None:
        if id(code) in seen:
            return
        seen.add(id(code))
        lines = [ln for _s, _e, ln in code.co_lines() if ln is not None] or [code.co_firstlineno]
        index.setdefault(code.co_name, []).append(
            (code.co_filename, code.co_firstlineno, max(lines)))
        for const in code.co_consts:
            if hasattr(const, "co_lines"):
                visit_code(const)

    def visit(obj: Any, depth: int = 0) -> None:
        if depth > 2 or id(obj) in seen:
            return
        if hasattr(obj, "__code__"):
            visit_code(obj.__code__)
        elif hasattr(obj, "__func__"):
            visit(obj.__func__, depth + 1)
        elif hasattr(obj, "func") and callable(obj):  # functools.partial
            visit(obj.func, depth + 1)
            for arg in getattr(obj, "args", ()):
                visit(arg, depth + 1)
        elif isinstance(obj, type) or hasattr(obj, "__dict__"):
            seen.add(id(obj))
            cls = obj if isinstance(obj, type) else type(obj)
            for value in vars(cls).values():
                if hasattr(value, "__code__") or hasattr(value, "__func__"):
                    visit(value, depth + 1)

    for obj in objects:
        visit(obj)
    return index


def _source_file(filename: str, lineno: int, name: str,
                 index: dict[str, list[tuple[str, int, int]]]) -> str:
    if not filename.startswith("<") or filename.startswith("<%%ranks"):
        return filename
    for candidate, first, last in index.get(name, []):
        if first <= lineno <= last:
            return candidate
    return filename


def format_frames(frames: list[tuple[str, int, str, str]],
                   index: dict[str, list[tuple[str, int, int]]] | None = None) -> str:
    """Traceback text with the rank's frames; source lines of notebook cells come from the
    kernel's linecache (the ranks cannot see cell source)."""
    lines = ["Traceback on the rank (most recent call last):"]
    shown = [f for f in frames if not is_parlib_frame(f[0])] or frames
    for filename, lineno, name, line in shown:
        filename = _source_file(filename, lineno, name, index or {})
        source = line or linecache.getline(filename, lineno).strip()
        lines.append(f'  File "{_cell_name(filename)}", line {lineno}, in {name}')
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines) if shown else ""


def _cell_name(filename: str) -> str:
    """Show an IPython cell file as the cell it came from, as IPython does."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None and hasattr(shell, "compile"):
            cache = getattr(shell.compile, "_filename_map", {})
            if filename in cache:
                return f"Cell In[{cache[filename]}]"
    except Exception:  # noqa: BLE001 - a prettier name is optional
        pass
    return filename


def annotate_stack(text: str) -> str:
    """Add source lines to faulthandler's 'File "...", line N in f' entries."""
    out = []
    for line in text.splitlines():
        out.append(line)
        stripped = line.strip()
        if stripped.startswith('File "') and ", line " in stripped:
            try:
                filename = stripped.split('"')[1]
                lineno = int(stripped.split(", line ")[1].split()[0])
            except (IndexError, ValueError):
                continue
            source = linecache.getline(filename, lineno).strip()
            if source:
                out.append(f"      {source}")
    return "\n".join(out)


__all__ = ["RankError", "is_library_frame", "is_parlib_frame", "trim_traceback"]
