"""What runs inside each rank process started by :mod:`parlib.runtime.group`.

The forkserver preloads this module (and torch._dynamo, which every optimizer imports), so
torch is already imported when a rank is forked and a launch costs a fork plus the
process-group handshake. Nothing here is public.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import faulthandler
import io
import os
import select
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from parlib.comm import quiet_renames
from parlib.runtime.procs import live_parents
from parlib.runtime.replies import plain_dumps

# Messages in a rank's error report that are echoes of another rank's failure: a peer that
# vanished or broke off. The launcher prefers any other failure as the root cause.
ECHO_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "ECONNRESET",
    "EPIPE",
    "Connection refused",
    "SIGABRT",
)

# Per-process namespace for %%ranks cells: variables a cell defines stay for the next cell.
CELL_NAMESPACE: dict[str, Any] = {"__name__": "__ranks__"}


def _watch_lifeline(fd: int) -> None:
    """End this rank (and its children) when the launcher closes its end of the lifeline:
    on ``kill()``, an interrupt during start-up, or the kernel's death (zombie or not)."""
    # The launcher's SIGUSR1 (stack dump) and SIGUSR2 (interrupt) are for the main thread,
    # which runs the learner's code: a signal the kernel hands to this thread would dump
    # this thread's stack instead.
    with contextlib.suppress(AttributeError, OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    _kill_own_group()


def _bind_to_lifeline(fd: int) -> None:
    """End this rank's process group when the launcher's end of the lifeline closes.

    On Linux the kernel does it first: with O_ASYNC set, closing a pipe's last write end sends
    SIGIO to the read end's owner, and SIGIO's default action there ends a process without
    running any Python. So a rank whose main thread holds the GIL in C++ code ends too, e.g.
    one building its FileStore in a temp folder the launcher has just removed (torch retries
    the open every 10 ms for minutes, the GIL held). The thread below is the fallback (macOS
    discards SIGIO by default). A lifeline closed before the signal was armed is seen by the
    check after it."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        import fcntl

        own_group = os.getpgid(0) == os.getpid()  # never the kernel's group: only our own
        signal.signal(signal.SIGIO, signal.SIG_DFL)
        fcntl.fcntl(fd, fcntl.F_SETOWN, -os.getpid() if own_group else os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([fd], [], [], 0)[0]:  # readable with nothing ever written: closed
        _kill_own_group()
    threading.Thread(target=_watch_lifeline, args=(fd,), daemon=True).start()


def _kill_own_group() -> None:
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _bind_to_parent() -> None:
    """Lead a process group (so the launcher can end our children with us) and die with the
    forkserver (the OS sends SIGKILL even while C code holds the GIL)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the call
                _kill_own_group()
    # The forkserver hands every child its "kernel alive" pipe; holding it would keep the
    # forkserver (and so us) alive after the kernel dies.
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver

        fd = forkserver._forkserver._forkserver_alive_fd  # noqa: SLF001
        if fd is not None:
            os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None  # noqa: SLF001


def _in_forkserver() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            return b"multiprocessing.forkserver" in fh.read()
    except OSError:
        return False


def _end_ranks_with_forkserver(me: int, kernel: int) -> None:
    """At the forkserver's exit (its kernel is gone): kill every rank it forked, with their
    children, and remove the kernel's parlib temp folders."""
    if os.getpid() != me:
        return
    for pid in [p for p, parent in live_parents().items() if parent == me]:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    import shutil
    import tempfile

    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if name.startswith(f"parlib-{kernel}-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


if _in_forkserver():
    atexit.register(_end_ranks_with_forkserver, os.getpid(), os.getppid())


class _Interrupt:
    """SIGUSR2 from the launcher raises KeyboardInterrupt in the learner's code, only while
    a task runs (an idle rank ignores it), like Jupyter's interrupt in a normal cell."""

    running = False

    @classmethod
    def handler(cls, signum: int, frame: Any) -> None:
        if cls.running:
            cls.running = False
            raise KeyboardInterrupt


def _redirect_output(out_fd: int, err_fd: int) -> None:
    """Send fd 1 and 2 (Python and C++ output alike) to the launcher as it is written."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="replace",
            write_through=True,  # partial lines and \r progress bars reach the cell live
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in naming what went wrong when the exception's own
    ``__str__`` raises."""
    try:
        return str(exc)
    except BaseException as inner:  # noqa: BLE001
        try:
            args = repr(exc.args)[:500]
        except BaseException:  # noqa: BLE001
            args = "?"
        return f"(its __str__ raised {type(inner).__name__}; args={args})"


def error_report(exc: BaseException, rank: int) -> dict[str, Any]:
    """A picklable description of an exception: type name, message and frames (no source)."""
    frames = [
        (f.filename, f.lineno, f.name, f.line or "")
        for f in traceback.extract_tb(exc.__traceback__)
    ]
    message = safe_str(exc)
    text = f"{type(exc).__name__}: {message}"
    echo = isinstance(exc, getattr(dist, "DistNetworkError", ())) or any(
        marker in text for marker in ECHO_MARKERS
    )
    in_collective = isinstance(exc, getattr(dist, "DistError", ())) or any(
        f"torch{os.sep}distributed" in f[0] for f in frames[-3:]
    )
    return {
        "rank": rank,
        "in_collective": in_collective,
        "exc_type": type(exc).__name__,
        "message": message,
        "frames": frames,
        "time": time.time(),
        "echo": echo,
    }


def rank_main(spec: dict[str, Any], ctrl: Any, out_w: Any, err_w: Any,
              lifeline: Any) -> None:
    """Entry point of one rank: set up, join the process group, then serve tasks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends ranks; no echo tracebacks
    signal.signal(signal.SIGUSR2, _Interrupt.handler)
    _bind_to_parent()
    rank, world_size = spec["rank"], spec["world_size"]
    _redirect_output(out_w.fileno(), err_w.fileno())
    os.environ.clear()  # the forkserver froze its environment at start: use the launcher's
    os.environ.update(spec["env"])
    try:
        os.chdir(spec["cwd"])
    except OSError:
        pass
    sys.path[:] = spec["sys_path"]
    _bind_to_lifeline(lifeline.fileno())
    # Append mode: the launcher empties the file after reading a dump, and the next dump
    # must start at its beginning again.
    stack_file = open(spec["stack_path"], "a")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    torch.set_num_threads(spec["threads"])
    # The course calls collectives under names every torch knows (parlib.comm); torch's own
    # code still warns about the renamed ones, which would drown the lesson's output.
    quiet_renames()
    torch.manual_seed(spec.get("seed", 0))

    try:
        if spec["backend"] == "nccl":
            torch.cuda.set_device(spec["local_rank"])
        store = dist.FileStore(spec["store_path"], world_size)
        dist.init_process_group(
            spec["backend"], store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=spec["pg_timeout"]),
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        ctrl.send(("error", error_report(exc, rank)))
        _finish()
    ctrl.send(("ready", None))

    while True:
        try:
            message = ctrl.recv()
        except (EOFError, OSError):
            break
        if message[0] == "exit":
            break
        try:
            _run_task(message[1], rank, ctrl, spec.get("plain_replies", False))
        except KeyboardInterrupt:  # landed between the learner's code and the report
            ctrl.send(("error", error_report(KeyboardInterrupt(), rank)))
    _finish()


def _run_task(payload: bytes, rank: int, ctrl: Any, plain: bool = False) -> None:
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        _Interrupt.running = True
        result = fn(*args, **kwargs)
        _Interrupt.running = False
        data = _dump_result(result, plain)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the notebook
        _Interrupt.running = False
        report = getattr(exc, "parlib_report", None) or error_report(exc, rank)
        report["rank"] = rank
        _flush_output()
        ctrl.send(("error", report))
        return
    _flush_output()
    ctrl.send(("ok", data))


def _dump_result(result: Any, plain: bool = False) -> bytes:
    try:
        return plain_dumps(result) if plain else cloudpickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001
        report = error_report(exc, -1)
        what = "as plain data" if plain else "to send it back to the notebook"
        report["message"] = (
            f"the return value (a {type(result).__name__}) cannot be pickled {what}: "
            f"{safe_str(exc)}. Return plain numbers, lists, dicts or tensors."
        )
        report["exc_type"] = "PicklingError"
        wrapped = RuntimeError(report["message"])
        wrapped.parlib_report = report
        raise wrapped from None


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _finish() -> None:
    """Leave at once: no destructors that could wait on peers that are already gone."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


def exec_cell(source: str, filename: str, output_names: tuple[str, ...]) -> Any:
    """Run a %%ranks cell in this rank's persistent namespace.

    Returns ``(last_expression_value, {name: value for name in output_names})``.
    """
    tree = ast.parse(source, filename=filename, mode="exec")
    last_expr = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last_expr = ast.Expression(tree.body.pop().value)
    CELL_NAMESPACE.setdefault("dist", dist)
    CELL_NAMESPACE.setdefault("torch", torch)
    exec(compile(tree, filename, "exec"), CELL_NAMESPACE)  # noqa: S102 - the learner's own cell
    value = None
    if last_expr is not None:
        value = eval(compile(last_expr, filename, "eval"), CELL_NAMESPACE)  # noqa: S307
    missing = [name for name in output_names if name not in CELL_NAMESPACE]
    if missing:
        raise NameError(f"-o asked for {', '.join(missing)}, which this cell did not define")
    return value, {name: CELL_NAMESPACE[name] for name in output_names}
