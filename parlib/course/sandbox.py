"""Where ``parlib grade`` runs each notebook: a bubblewrap sandbox, or a watched process tree.

With ``bwrap`` (Debian's ``bubblewrap``) each notebook's grader process runs with every
capability dropped (root included), a read-only view of the whole file system (the course,
the grader, ``--json``'s folder), its own empty ``/tmp``, ``/run`` and ``TMPDIR`` (no host
socket file to connect to), no network (only its own loopback), its own PID namespace (it
cannot see or signal the batch grader, and every process it started dies with it), only
the environment names of :data:`ENV_ALLOWED` and one writable folder of its own. Without
it (``--no-sandbox``, or no working ``bwrap``) the batch grader becomes a child subreaper,
so a process a notebook detaches still reparents to it, and kills every process under it
after each notebook's row.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from parlib.course import boot
from parlib.course.boot import snapshot
from parlib.course.channel import Channel, Output
from parlib.course.registry import questions

SANDBOX_ENV = "PARLIB_GRADE_SANDBOXED"
COURSE = Path(__file__).resolve().parents[1]  # the parlib package: the code that grades


# What a notebook's grader process is given of the batch's environment: the names it needs
# to find Python, its modules and the locale, and the thread and device settings the
# project reads; nothing else (no tokens, no agent sockets, no session bus).
ENV_ALLOWED = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_MESSAGES",
               "TZ", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUTF8",
               "PYTHONIOENCODING", "VIRTUAL_ENV", "JUPYTER_PATH", "OMP_NUM_THREADS",
               "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "CUDA_VISIBLE_DEVICES", "PARLIB_DEVICE", "PARLIB_BACKEND", "PARLIB_MAX_RANKS",
               "MPLBACKEND", "TQDM_DISABLE")
# what the sandbox sets itself (HOME, TMPDIR and the caches in its own folders)
ENV_SET = (SANDBOX_ENV, "HOME", "TMPDIR", "PARLIB_CACHE_DIR", "MPLCONFIGDIR")
# never hidden under a tmpfs, whatever TMPDIR says: the system the sandbox runs on
_SYSTEM = {"/", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/opt", "/var",
           "/home", "/root", "/dev", "/proc", "/sys", "/srv", "/mnt", "/media", "/boot"}


# kernel settings that root writes without a capability (core_pattern runs a program as
# the host's root): read-only, whether or not this bwrap covers them itself
_PROC_READ_ONLY = ("--ro-bind", "/proc/sys", "/proc/sys",
                   "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger")


@functools.lru_cache(maxsize=1)
def bwrap() -> str | None:
    """The path of a ``bwrap`` that works here (it needs user namespaces, or root) and
    knows every option :func:`sandboxed` gives it, else None."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        ok = subprocess.run([path, "--ro-bind", "/", "/", "--proc", "/proc", *_PROC_READ_ONLY,
                             "--unshare-pid", "--unshare-net", "--cap-drop", "ALL",
                             "--clearenv", "--die-with-parent", "true"],
                            stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return path if ok else None


def hidden_folders(env: Mapping[str, str] = os.environ) -> list[str]:
    """The folders the sandbox covers with an empty tmpfs besides /tmp: /run (sockets of
    system daemons and sessions; /var/run where it is not a link to it), and the batch's
    ``XDG_RUNTIME_DIR`` and ``TMPDIR`` where they exist outside /tmp (a forkserver's or an
    agent's socket file there would otherwise connect)."""
    found = []
    for folder in ("/run", "/var/run", env.get("XDG_RUNTIME_DIR"), env.get("TMPDIR")):
        if not folder or not os.path.isdir(folder):
            continue
        real = os.path.realpath(folder)
        inside = any(real == h or real.startswith(h + "/") for h in ["/tmp", *found])
        if not inside and real not in _SYSTEM:
            found.append(real)
    return found


def sandboxed(cmd: list[str], writable: Path, readable: tuple[Path, ...] = (),
              env: Mapping[str, str] = os.environ) -> list[str]:
    """``cmd`` wrapped in bwrap: every capability dropped (root inside cannot remount a
    read-only view), only the names of :data:`ENV_ALLOWED` kept from ``env``, everything
    read-only but ``writable``, its own empty /tmp and :func:`hidden_folders` (with
    ``readable``, the notebook's folder, the course and Python seen read-only where they
    lie under one), no network, own PID namespace; it dies with the grader."""
    exe = bwrap()
    if exe is None:
        raise RuntimeError("bwrap is not available: install bubblewrap, or pass --no-sandbox")
    w = str(Path(writable).resolve())
    hidden = ["/tmp", *hidden_folders(env)]
    needed = {str(Path(p).resolve()) for p in (*readable, COURSE.parent, sys.prefix,
                                               sys.base_prefix)}
    views: list[str] = []
    for r in sorted(needed, key=len):  # a folder before what lies in it
        if any(r.startswith(h + "/") for h in hidden) and not w.startswith(r):
            views += ["--ro-bind", r, r]
    kept = [arg for name in ENV_ALLOWED if name in env for arg in ("--setenv", name, env[name])]
    return [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--tmpfs", "/dev/shm",
            "--proc", "/proc", *_PROC_READ_ONLY, *(arg for h in hidden for arg in ("--tmpfs", h)),
            *views,
            "--bind", w, w, "--cap-drop", "ALL", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
            "--chdir", w, "--clearenv", *kept, "--setenv", SANDBOX_ENV, "1",
            "--setenv", "HOME", w, "--setenv", "TMPDIR", "/tmp",
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


def kill_descendants(spare: set[int] = frozenset(), *, passes: int = 50,
                     within: float = 5.0) -> int:
    """SIGKILL every process under this one but ``spare`` (those that were there before
    the notebook started: the caller's own), and the process groups of those in sessions
    they started, pass after pass until a pass finds none left: at most ``passes`` passes
    and ``within`` seconds, then what survived is named on stderr. Returns how many
    processes were found.

    One pass is not enough: a process that forks and exits in a loop is gone by the time
    its pid, listed a moment before, is signalled, and its child was not listed. Its exited
    generations linger as zombies of ours (this process is a subreaper) that still name
    their process group, and a signal to the group reaches the live one."""
    spare, mine = set(spare), os.getsid(0)
    theirs = {_group(pid) for pid in spare}  # a group a spared process is in is spared too
    deadline = time.monotonic() + within
    found: set[int] = set()
    for _ in range(max(1, passes)):
        tree = {pid: row for pid, row in _tree().items() if pid not in spare}
        live = {pid for pid, row in tree.items() if row.state != "Z"}
        # only groups of sessions the notebook started: never one of our own session's
        groups = {row.group for row in tree.values() if row.session != mine} - theirs
        found |= tree.keys()
        _kill(live, groups)
        # a zombie of ours is a process that ran a moment ago: its child may still run,
        # unlisted, so a pass that only reaps zombies does not count as finding none
        reaped = _reap(pid for pid, row in tree.items() if row.parent == os.getpid())
        left = {g for g in groups if _group_alive(g)}
        if not live and not reaped and not left:
            return len(found)
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)  # let the signals land and the orphans reparent to us
    print(f"parlib grade: processes the notebook left survived {passes} kill passes: "
          f"pid(s) {sorted(live)[:10]}, process group(s) {sorted(left)[:10]}",
          file=sys.stderr)
    return len(found)


class _Proc(NamedTuple):
    parent: int
    group: int
    session: int
    state: str


def _tree() -> dict[int, _Proc]:
    """Every process under this one, zombies included, from one read of /proc (each row
    read at once, so a zombie still names its group)."""
    if not os.path.isdir("/proc"):
        return _tree_psutil()
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            state, parent, group, session = stat[stat.rfind(b")") + 2:].split()[:4]
            table[int(entry)] = _Proc(int(parent), int(group), int(session), state.decode())
    under: dict[int, _Proc] = {}
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, row in table.items() if row.parent in frontier} - under.keys()
        under.update((pid, table[pid]) for pid in frontier)
    return under


def _tree_psutil() -> dict[int, _Proc]:
    """:func:`_tree` where there is no /proc (macOS): the same rows, read one by one."""
    import psutil

    under = {}
    for p in psutil.Process().children(recursive=True):
        try:
            state = "Z" if p.status() == psutil.STATUS_ZOMBIE else "R"
            under[p.pid] = _Proc(p.ppid(), os.getpgid(p.pid), os.getsid(p.pid), state)
        except (psutil.Error, OSError):
            continue
    return under


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except OSError:
        return False


def _kill(pids: set[int], groups: set[int]) -> None:
    for group in groups:  # a group signal reaches every member at once, forks included
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    for pid in pids:  # those that left their group for one we must not signal
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _reap(children: Iterable[int]) -> int:
    """Collect the exit status of those of our ``children`` that have exited (only those:
    a spared child's is its owner's); return how many."""
    reaped = 0
    for pid in children:
        try:
            reaped += os.waitpid(pid, os.WNOHANG)[0] == pid
        except ChildProcessError:
            pass
    return reaped


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
    """sha256 over the grader's own Python files (the question modules among them): what
    a grader process started by :func:`grader_command` imports, and all it imports of them."""
    return snapshot(root)[0]


# The text of the grader process's bootstrap, read once, when the batch grader starts: a
# notebook graded without the sandbox may change the file afterwards.
BOOT_SOURCE = Path(boot.__file__).read_text(encoding="utf-8")


def grader_command(digest: str, args: list[str]) -> list[str]:
    """The command of a notebook's grader process: ``python -I -B -S`` (no user site, no
    ``.pth``, no ``sitecustomize``, no bytecode written) running :mod:`parlib.course.boot`,
    which imports the grader only from the sources whose digest is ``digest``, never their
    bytecode; ``args`` are the grading module's."""
    import site

    user_site = site.getusersitepackages()  # -I: no user site
    path = [str(COURSE.parent)] + [os.path.abspath(p) for p in sys.path
                                   if p and p not in (str(COURSE.parent), user_site)]
    return [sys.executable, "-I", "-B", "-S", "-c", BOOT_SOURCE, json.dumps(path),
            str(COURSE), digest, *args]


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


def watch(proc: subprocess.Popen, channel: Channel, limits: Limits, t0: float,
          output: Output | None = None) -> tuple[str, str | None] | None:
    """Wait for the child, reading its ``channel`` (and its ``output``) as they come; None
    when it ended by itself, else (why it was stopped, the question whose re-check was
    running)."""
    current, since = None, 0.0
    while proc.poll() is None:
        time.sleep(0.1)
        channel.poll()
        if output is not None:
            output.poll()
        if channel.current() != current:
            current, since = channel.current(), time.monotonic()
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


__all__ = ["BOOT_SOURCE", "ENV_ALLOWED", "ENV_SET", "SANDBOX_ENV", "Limits",
           "become_subreaper", "bwrap", "course_digest", "descendants", "grader_command",
           "hidden_folders", "kill_descendants", "kill_others_in_namespace",
           "question_limit", "sandboxed", "stop", "watch"]
