"""What a failing rank looks like in the notebook: :class:`RankError`, and the rank's
traceback mapped back to the learner's cells."""

from __future__ import annotations

import importlib
import io
import linecache
import os
import re
import sys
import traceback
import types
from collections import ChainMap
from typing import Any

import cloudpickle


class RankError(RuntimeError):
    """A rank failed, hung past the timeout, was left in a collective its peers never made,
    or died. Raised in the notebook cell.

    Attributes: ``rank`` (the root-cause rank, or None), ``exc_type`` (the exception's type
    name, ``"Timeout"``, ``"Deadlock"``, ``"Exited"`` or ``"UnpicklingError"``),
    ``remote_traceback`` (the rank's frames in the learner's code, cells shown with their
    source lines),
    ``full_traceback`` (every frame, parlib's included), ``kept`` (True when the ranks were
    left as they were: a warm cluster keeps its variables).
    """

    def __init__(self, message: str, rank: int | None, exc_type: str, remote_traceback: str = "",
                 kept: bool = False, full_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.kept = kept
        self.full_traceback = full_traceback or remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\n" + self.remote_traceback
        return text


class RanksInterrupted(KeyboardInterrupt):
    """The kernel was interrupted while ranks ran: says what was stopped and where each
    rank was (``stacks``: faulthandler dumps of ranks that had to be killed)."""

    def __init__(self, message: str, stacks: str = ""):
        super().__init__(message)
        self.stacks = stacks


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
    """``[0, 1, 2, 3, 5]`` -> ``"0-3, 5"``."""
    parts: list[str] = []
    for r in sorted(set(ranks)):
        if parts and int(parts[-1].split("-")[-1]) == r - 1:
            first = parts[-1].split("-")[0]
            parts[-1] = f"{first}-{r}"
        else:
            parts.append(str(r))
    return ", ".join(parts)




def _code_reduce_keeping_filename(code: types.CodeType) -> Any:
    make, args = cloudpickle.cloudpickle._code_reduce(code)  # noqa: SLF001
    return make, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_filename},
                              cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        # A function that names `dist` and reads `.config` makes cloudpickle ship the
        # imported submodule torch.distributed.config, an instance of a subclass of
        # ModuleType that pickle cannot copy: every rank imports such a module by name.
        if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                and sys.modules.get(obj.__name__) is obj):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps_for_ranks(obj: Any) -> bytes:
    """cloudpickle, but code keeps its file name (a notebook cell's), so a rank's traceback
    and stack dump name the learner's cell and line instead of ``<dynamic-code>``."""
    if not hasattr(cloudpickle, "cloudpickle") or not hasattr(
            cloudpickle.cloudpickle, "_code_reduce"):
        return cloudpickle.dumps(obj)
    with io.BytesIO() as buffer:
        _Pickler(buffer).dump(obj)
        return buffer.getvalue()


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
                  index: dict[str, list[tuple[str, int, int]]] | None = None,
                  everything: bool = False) -> str:
    """Traceback text with the rank's frames in the learner's code (``everything``: all of
    them); source lines of notebook cells come from the kernel's linecache (the ranks
    cannot see cell source)."""
    lines = ["Traceback on the rank (most recent call last):"]
    shown = frames if everything else (
        [f for f in frames if not is_library_frame(f[0])]
        or [f for f in frames if not is_parlib_frame(f[0])][-1:] or frames[-1:])
    for filename, lineno, name, line in shown:
        filename = _source_file(filename, lineno, name, index or {})
        source = line or linecache.getline(filename, lineno).strip()
        lines.append(f"  {_location(filename)}, line {lineno}, in {name}")
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines) if shown else ""


def where_text(frames: list[tuple[str, int, str, str]],
               index: dict[str, list[tuple[str, int, int]]] | None = None) -> str:
    """Where a rank was, in one line: its innermost frame in the learner's code."""
    mine = [f for f in frames if not is_library_frame(f[0])]
    if not mine:
        return "a function with no Python source of yours (a builtin or a library)"
    filename, lineno, name, line = mine[-1]
    filename = _source_file(filename, lineno, name, index or {})
    source = line or linecache.getline(filename, lineno).strip()
    return f"{_cell_name(filename)}, line {lineno}, in {name}" + (f": {source}" if source else "")


def failure_error(errors: list[dict[str, Any]], index: dict[str, list[tuple[str, int, int]]],
                  still: list[int], stopped: list[int], broken: bool, warm: bool) -> RankError:
    """One RankError for a failed call: the root cause first, then what happened to the
    other ranks (``still``: killed while still running; ``stopped``: interrupted) and to a
    warm cluster's variables."""
    reports = [e for e in errors if e["exc_type"] != "KeyboardInterrupt"] or errors
    genuine = [e for e in reports if not e.get("echo")] or reports
    root = min(genuine, key=lambda e: e["time"])
    others = sorted({e["rank"] for e in reports} - {root["rank"]})
    message = f"rank {root['rank']} failed: {root['exc_type']}: {root['message']}"
    notes = []
    if others:
        notes.append(f"rank(s) {format_ranks(others)} failed after it")
    if stopped:
        where = "; ".join(
            f"rank {e['rank']} at {where_text(e['frames'], index)}" for e in errors
            if e["rank"] in stopped and e["exc_type"] == "KeyboardInterrupt")
        notes.append(f"rank(s) {format_ranks(stopped)} were interrupted ({where})")
    if broken:
        if still:
            notes.append(f"rank(s) {format_ranks(still)} were still waiting (in a collective "
                         f"for rank {root['rank']}?)")
        notes.append("every rank was stopped" + (
            "; the ranks restart on the next call and variables defined on them are lost"
            if warm else ""))
    elif warm:
        notes.append("the ranks and their variables are as they were")
    if notes:
        message += "\n(" + "; ".join(notes) + ")"
    return RankError(
        message, rank=root["rank"], exc_type=root["exc_type"],
        remote_traceback=format_frames(root["frames"], index), kept=not broken,
        full_traceback=format_frames(root["frames"], index, everything=True)
        + f"\n{root['exc_type']}: {root['message']}",
    )


def _location(filename: str) -> str:
    """``Cell In[5]`` for a notebook cell, else ``File "path"`` (as IPython writes them)."""
    name = _cell_name(filename)
    return name if name.startswith("Cell In[") else f'File "{name}"'


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


def _learner_tb(tb: Any) -> Any:
    """The traceback with only the learner's frames (a %%ranks cell's own line dropped)."""
    kept = []
    while tb is not None:
        code = tb.tb_frame.f_code
        line = linecache.getline(code.co_filename, tb.tb_lineno)
        if not (is_library_frame(code.co_filename) or "run_cell_magic('ranks'" in line
                or "__tracebackhide__" in tb.tb_frame.f_locals):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for item in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, item.tb_frame, item.tb_lasti, item.tb_lineno)
    return rebuilt


def _short_traceback(shell: Any, etype: type, value: BaseException, tb: Any,
                     tb_offset: int | None = None) -> list[str]:
    """IPython's view of RankError and RanksInterrupted: the learner's frames and the
    rank's error, briefly (``full_traceback`` keeps everything)."""
    import sys

    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    if isinstance(value, RanksInterrupted):
        stb = [f"{etype.__name__}: {value}"]
    else:
        mine = _learner_tb(tb)
        if mine is None:
            stb = [f"{etype.__name__}: {value}"]
        else:
            stb = shell.InteractiveTB.structured_traceback(etype, value, mine, tb_offset=0)
        stb.append("(every frame, parlib's included: sys.last_value.full_traceback)")
    shell._showtraceback(etype, value, stb)  # noqa: SLF001 - how IPython shows a traceback
    return stb


_previous_handler: Any = None


def install_short_tracebacks() -> None:
    """In IPython, show RankError and RanksInterrupted briefly (once per shell; nothing
    outside IPython, which is never imported here)."""
    global _previous_handler
    import sys

    if "IPython" not in sys.modules:
        return
    shell = sys.modules["IPython"].get_ipython()
    if shell is None or getattr(shell, "_parlib_short_tb", False):
        return
    previous = tuple(getattr(shell, "custom_exceptions", ()) or ())
    previous_handler = getattr(shell, "CustomTB", None) if previous else None

    def handler(shell: Any, etype: type, value: BaseException, tb: Any,
                tb_offset: int | None = None) -> list[str]:
        if isinstance(value, (RankError, RanksInterrupted)):
            return _short_traceback(shell, etype, value, tb, tb_offset)
        return previous_handler(etype, value, tb, tb_offset=tb_offset)

    shell.set_custom_exc((RankError, RanksInterrupted, *previous), handler)
    shell._parlib_short_tb = True


__all__ = ["RankError", "RanksInterrupted", "install_short_tracebacks", "is_library_frame",
           "is_parlib_frame", "trim_traceback"]
