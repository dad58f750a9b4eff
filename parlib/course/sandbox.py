"""Where ``parlib grade`` runs each notebook: a bubblewrap sandbox, or a watched process tree.

With ``bwrap`` (Debian's ``bubblewrap``) each notebook's grader process runs with a
read-only view of the whole file system (the course, the grader, ``--json``'s folder), its
own ``/tmp``, no network (only its own loopback), its own PID namespace (it cannot see or
signal the batch grader, and every process it started dies with it) and one writable
folder of its own. Without it (``--no-sandbox``, or no working ``bwrap``) the batch grader
becomes a child subreaper, so a process a notebook detaches still reparents to it, and
kills every process under it after each notebook's row.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from parlib.course.registry import questions

SANDBOX_ENV = "PARLIB_GRADE_SANDBOXED"
COURSE = Path(__file__).resolve().parents[1]  # the parlib package: the code that grades


@functools.lru_cache(maxsize=1)
def bwrap() -> str | None:
    """The path of a ``bwrap`` that works here (it needs user namespaces), else None."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        ok = subprocess.run([path, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net",
                             "--die-with-parent", "true"], stdin=subprocess.DEVNULL,
                            capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return path if ok else None


def sandboxed(cmd: list[str], writable: Path, readable: tuple[Path, ...] = ()) -> list[str]:
    """``cmd`` wrapped in bwrap: everything read-only but ``writable``, own /tmp (with
    ``readable``, the notebook's folder, the course and Python, seen read-only where they
    lie under /tmp), no network, own PID namespace; it dies with the grader."""
    exe = bwrap()
    if exe is None:
        raise RuntimeError("bwrap is not available: install bubblewrap, or pass --no-sandbox")
    w = str(Path(writable).resolve())
    views: list[str] = []
    for r in {str(Path(p).resolve()) for p in (*readable, COURSE.parent, sys.prefix)}:
        if r.startswith("/tmp/") and not w.startswith(r):
            views += ["--ro-bind", r, r]
    return [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--tmpfs", "/dev/shm",
            "--proc", "/proc", "--tmpfs", "/tmp", *views, "--bind", w, w,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--die-with-parent", "--new-session", "--chdir", w,
            "--setenv", SANDBOX_ENV, "1", "--setenv", "HOME", w,
            "--setenv", "PARLIB_CACHE_DIR", os.path.join(w, "cache"),
            "--setenv", "MPLCONFIGDIR", os.path.join(w, "mpl"), "--", *cmd]


def become_subreaper() -> bool:
    """Make orphaned descendants reparent to this process (Linux); False where unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def descendants() -> set[int]:
    """The pids of every process under this one."""
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def kill_descendants(spare: set[int] = frozenset()) -> int:
    """SIGKILL every process under this one but ``spare`` (those that were there before
    the notebook started: the caller's own); return how many."""
    import psutil

    try:
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in spare]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
    return len(procs)


def kill_others_in_namespace() -> None:
    """Inside the sandbox, between the notebook and the re-check: every process but this
    one and the namespace's init (the kernel's leftovers) is killed."""
    if os.environ.get(SANDBOX_ENV) != "1":
        return
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, me):
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def course_digest(root: Path = COURSE) -> str:
    """sha256 over the grader's own Python files (the question modules among them)."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        try:
            h.update(f.read_bytes())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()


@dataclass
class Limits:
    """Time limits, enforced by the batch grader from outside the notebook's processes."""

    cell: float = 600.0  # per cell, by nbclient in the notebook's grader process
    notebook: float = 1800.0  # the notebook and all its re-checks, wall clock
    question: float | None = None  # one re-check; None: 30 s plus twice the question's own


def question_limit(qid: str, limits: Limits) -> float:
    if limits.question is not None:
        return limits.question
    q = questions().get(qid)
    return 30.0 + 2 * float(getattr(q, "timeout", None) or 0)


def lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []


def _json(line: str) -> dict:
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):  # a line being written
        return {}
    return item if isinstance(item, dict) else {}


def rows_done(progress: Path) -> list[dict]:
    """The rows a notebook's grader process finished before it was stopped."""
    return [r["row"] for r in map(_json, lines(progress)) if isinstance(r.get("row"), dict)]


def watch(proc: subprocess.Popen, progress: Path, limits: Limits,
           t0: float) -> tuple[str, str | None] | None:
    """Wait for the child; None when it ended by itself, else (why it was stopped, the
    question whose re-check was running)."""
    current, since = None, 0.0
    while proc.poll() is None:
        time.sleep(0.1)
        seen = lines(progress)
        last = _json(seen[-1]) if seen else {}
        if "start" in last and str(last["start"]) != current:
            current, since = str(last["start"]), time.monotonic()
        elif "start" not in last:
            current = None
        if current is not None and time.monotonic() - since > question_limit(current, limits):
            return (f"the re-check of {current} ran longer than "
                    f"{question_limit(current, limits):g} s and was stopped", current)
        if time.monotonic() - t0 > limits.notebook:
            return (f"the notebook and its re-checks ran longer than {limits.notebook:g} s "
                    f"in all and were stopped", current)
    return None


def stop(proc: subprocess.Popen, gently: bool = False) -> None:
    """Stop the child's whole process group (SIGTERM first when ``gently``)."""
    for sig in ((signal.SIGTERM, signal.SIGKILL) if gently else (signal.SIGKILL,)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


__all__ = ["SANDBOX_ENV", "Limits", "become_subreaper", "bwrap", "course_digest",
           "descendants", "kill_descendants", "kill_others_in_namespace", "lines",
           "question_limit", "rows_done", "sandboxed", "stop", "watch"]
