"""Rank processes as the operating system sees them: ending them for sure, and leaving no
temp folder behind.

- Each rank leads its own process group, so killing the group also ends the rank's children.
- A process is named by (pid, start time): a pid reused by a new process is never killed.
  On Linux the start time is read from /proc, in the kernel's own clock ticks since boot;
  elsewhere from psutil.
- Temp folders are named ``parlib-<pid>-<start time>-...`` after the kernel that made them.
  A small reaper process in its own session removes them when the kernel is gone, however it
  ended (Jupyter kills the kernel's whole process group, forkserver included); a folder left
  anyway (the reaper killed too) is recognised as stale and removed on the next start.
- Interrupts are held back while ranks are being killed, then re-raised.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Iterator

import psutil

PREFIX = "parlib-"
_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_LINUX = sys.platform.startswith("linux")


def _running(pid: int) -> psutil.Process | None:
    """The live process ``pid`` (zombies and dead ones left out), or None."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() in _GONE else proc
    except psutil.Error:
        return None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (fixed for the process's life, so
    (pid, start time) names one process even after its pid is reused; in ticks, as the kernel
    counts it, so every parlib on the machine, old or new, names a process the same way in its
    temp folders); None if gone or a zombie.

    On Linux it is read from /proc as the kernel keeps it. psutil's ``create_time`` adds the
    boot time, which it re-reads from the wall clock: a clock step (a VM's time sync) between
    two readings would make a live rank look like a reused pid, and a live kernel's folders
    look stale."""
    if _LINUX:
        return _proc_start_ticks(pid)
    proc = _running(pid)
    try:
        since_boot = None if proc is None else proc.create_time() - psutil.boot_time()
    except psutil.Error:
        return None
    return None if since_boot is None else round(since_boot * _TICKS_PER_SECOND)


def _proc_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (Linux's layout); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            # the command name (field 2) may hold spaces and parentheses: split after it
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    state, ticks = fields[0], fields[19]  # fields 3 and 22
    return None if state in (b"Z", b"X", b"x") else int(ticks)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process (all its threads) has used; None if gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def live_parents() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies left out)."""
    parents = {}
    for proc in psutil.process_iter(["ppid", "status"]):
        if proc.info["status"] not in _GONE and proc.info["ppid"] is not None:
            parents[proc.pid] = proc.info["ppid"]
    return parents


def is_alive(pid: int, started: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when given, started at ``started``."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def kill_tree(pid: int, started: int | None) -> None:
    """SIGKILL the rank's process group (the rank and its children), or the rank alone."""
    if not is_alive(pid, started) and started is not None:
        # The rank is gone; its children may live on in its group (pgid = its pid).
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return
    except OSError:
        pass
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _my_tag() -> str:
    return f"{PREFIX}{os.getpid()}-{start_time(os.getpid()) or 0}-"


def make_temp_dir(kind: str) -> str:
    """A private temp folder named after this process (see the module docstring)."""
    return tempfile.mkdtemp(prefix=f"{_my_tag()}{kind}-")


def remove_stale_temp_dirs(owner_pid: int | None = None) -> list[str]:
    """Remove ``parlib-<pid>-<start>-*`` folders whose process is gone (or, with
    ``owner_pid``, every folder of that pid). Returns what was removed."""
    root = tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if not name.startswith(PREFIX) or len(parts) < 4:
            continue
        try:
            pid, started = int(parts[1]), int(parts[2])
        except ValueError:
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if (owner_pid is not None and pid == owner_pid) or (
            owner_pid is None and not is_alive(pid, started or None)
        ):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# Runs in its own session: waits for EOF on stdin (every write end closed: the kernel is
# gone, however it ended), then removes the kernel's temp folders. No imports beyond os.
_REAPER_CODE = """
import os, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    while sys.stdin.buffer.read(65536):
        pass
except BaseException:
    pass
root, tag = sys.argv[1], sys.argv[2]
for name in os.listdir(root):
    if name.startswith(tag):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
"""
_reaper: tuple[int, subprocess.Popen] | None = None  # (owner pid, reaper)


def start_temp_dir_reaper() -> None:
    """Start (once per process) the reaper that removes this process's temp folders after
    it is gone. Outside the kernel's process group, so a group kill does not reach it."""
    global _reaper
    if os.name != "posix" or (_reaper is not None and _reaper[0] == os.getpid()):
        return
    with interrupts_deferred():  # a lost Popen would close the pipe: the reaper would act
        _reaper = (os.getpid(), subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER_CODE, tempfile.gettempdir(),
             _my_tag()],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True,
        ))


_mp_dir_done = False


def own_multiprocessing_temp_dir() -> None:
    """Make multiprocessing put its forkserver socket in a parlib folder named after this
    process (instead of an anonymous ``pymp-*`` that a killed kernel leaves behind)."""
    global _mp_dir_done
    if _mp_dir_done:
        return
    _mp_dir_done = True
    from multiprocessing import process

    config = process.current_process()._config  # noqa: SLF001 - documented in util.get_temp_dir
    if config.get("tempdir") is None:
        path = make_temp_dir("mp")
        config["tempdir"] = path
        atexit.register(shutil.rmtree, path, True)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back SIGINT inside the block (so a kill is never cut short); re-raise after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):
        yield
        return
    received: list[int] = []
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except (ValueError, OSError, TypeError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start processes without telling them the main module's path.

    multiprocessing makes each new process re-import the main script (as ``__mp_main__``)
    so that functions defined there can be unpickled; parlib ships functions by value, so a
    script that calls ``parlib.launch`` at module level without ``if __name__ ==
    "__main__":`` would otherwise run again inside every rank.
    """
    real = sys.modules.get("__main__")
    stand_in = types.ModuleType("__main__")
    stand_in.__spec__ = None
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        if real is not None:
            sys.modules["__main__"] = real


__all__ = [
    "interrupts_deferred", "is_alive", "kill_tree", "main_module_hidden", "make_temp_dir",
    "own_multiprocessing_temp_dir", "remove_stale_temp_dirs", "start_temp_dir_reaper",
    "start_time",
]
