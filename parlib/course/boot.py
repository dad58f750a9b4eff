"""How ``parlib grade`` starts a notebook's grader process: trusting only what it read at
the start of the batch.

The batch grader reads this file once, when it starts, and runs each notebook's grader as
``python -I -B -S -c <this text> PATH COURSE DIGEST --one ...``: no user site, no ``.pth``
file, no ``sitecustomize``, no ``PYTHON*`` variable, no bytecode written. :func:`boot`
makes the process non-dumpable (:func:`refuse_tracing`), reads every source file of the
``parlib`` package at ``COURSE`` into memory, refuses to go on (exit status
:data:`CHANGED`) unless their :func:`snapshot` digest is the one the batch computed when
it started, and imports ``parlib`` from that copy only: a ``.pyc`` in a
``__pycache__`` (even one stamped with its source's time and size) is never read, and a
file changed afterwards (by the notebook the process goes on to run) is never imported.
Without the sandbox a notebook runs with the instructor's rights and could still change the
Python environment itself (torch, the standard library): see the README.

Standard library only: this runs before any of ``parlib`` may be imported.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import pathlib
import runpy
import sys
from typing import Any

CHANGED = 3  # the exit status of a grader process that found the course changed


def snapshot(root: pathlib.Path) -> tuple[str, dict[str, bytes]]:
    """sha256 over the package's Python sources (each file's path under ``root``, then its
    bytes), and those sources by absolute path."""
    h = hashlib.sha256()
    files: dict[str, bytes] = {}
    for f in sorted(pathlib.Path(root).rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        try:
            data = f.read_bytes()
        except OSError:
            h.update(b"<unreadable>")
            continue
        h.update(data)
        files[str(f)] = data
    return h.hexdigest(), files


class _SnapshotLoader(importlib.machinery.SourceFileLoader):
    """A module's source from the snapshot; no bytecode read or written."""

    files: dict[str, bytes] = {}

    def get_data(self, path: str) -> bytes:
        if path in self.files:
            return self.files[path]
        raise OSError(f"{path} is not in the grader's snapshot")

    def path_stats(self, path: str) -> dict[str, Any]:
        raise OSError("no bytecode for the grader's own modules")  # so none is read


class SnapshotFinder(importlib.abc.MetaPathFinder):
    """Finds ``package`` and its modules in the snapshot, and nowhere else."""

    def __init__(self, root: pathlib.Path, files: dict[str, bytes]) -> None:
        self.root, self.package = pathlib.Path(root), pathlib.Path(root).name
        _SnapshotLoader.files = files

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        parts = fullname.split(".")
        if parts[0] != self.package:
            return None
        base = self.root.joinpath(*parts[1:])
        for file, package in ((base / "__init__.py", True), (base.with_suffix(".py"), False)):
            if str(file) in _SnapshotLoader.files:
                return importlib.util.spec_from_file_location(
                    fullname, str(file), loader=_SnapshotLoader(fullname, str(file)),
                    submodule_search_locations=[str(base)] if package else None)
        raise ModuleNotFoundError(f"{fullname} is not in the grader's snapshot of the course",
                                  name=fullname)


def refuse_tracing() -> bool:
    """Make this process non-dumpable (Linux): a process of the same user without
    ``CAP_SYS_PTRACE`` (a rank running the learner's code, once the sandbox has dropped
    every capability) can then neither attach to it nor write its memory through
    ``/proc/PID/mem``. What it runs with ``exec`` (the kernel, the ranks) is dumpable again.
    False where unsupported."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        return False


def boot(argv: list[str]) -> None:
    """``argv``: ``[-c, PATH (JSON list), COURSE, DIGEST, *grading arguments]``."""
    refuse_tracing()
    path, root, digest = json.loads(argv[1]), pathlib.Path(argv[2]), argv[3]
    sys.path[:] = [str(p) for p in path]
    found, files = snapshot(root)
    if found != digest:
        sys.stderr.write("the grader's files changed on disk since the batch started\n")
        raise SystemExit(CHANGED)
    sys.meta_path.insert(0, SnapshotFinder(root, files))
    sys.argv = [argv[0], *argv[4:]]
    runpy.run_module(f"{root.name}.course.grading", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    boot(sys.argv)
