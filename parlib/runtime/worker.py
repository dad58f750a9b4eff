"""What runs inside each rank process started by :mod:`parlib.runtime.group`.

The forkserver preloads this module, so torch is already imported when a rank is forked
and a launch costs a fork plus the process-group handshake. Nothing here is public.
"""

from __future__ import annotations

import ast
import faulthandler
import io
import os
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


def _watch_parent(parent_pid: int) -> None:
    """End this rank if the notebook kernel that launched it disappears (e.g. SIGKILL)."""
    while True:
        time.sleep(0.25)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)
        except PermissionError:  # pid reused by another user's process: ours is gone
            os.kill(os.getpid(), signal.SIGKILL)


def _redirect_output(out_fd: int, err_fd: int) -> None:
    """Send fd 1 and 2 (Python and C++ output alike) to the launcher, a whole line at a time."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="replace",
            line_buffering=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def error_report(exc: BaseException, rank: int) -> dict[str, Any]:
    """A picklable description of an exception: type name, message and frames (no source)."""
    frames = [
        (f.filename, f.lineno, f.name, f.line or "")
        for f in traceback.extract_tb(exc.__traceback__)
    ]
    message = str(exc)
    text = f"{type(exc).__name__}: {message}"
    echo = isinstance(exc, getattr(dist, "DistNetworkError", ())) or any(
        marker in text for marker in ECHO_MARKERS
    )
    return {
        "rank": rank,
        "exc_type": type(exc).__name__,
        "message": message,
        "frames": frames,
        "time": time.time(),
        "echo": echo,
    }


def rank_main(spec: dict[str, Any], ctrl: Any, out_w: Any, err_w: Any) -> None:
    """Entry point of one rank: set up, join the process group, then serve tasks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends ranks; no echo tracebacks
    rank, world_size = spec["rank"], spec["world_size"]
    _redirect_output(out_w.fileno(), err_w.fileno())
    os.environ.clear()  # the forkserver froze its environment at start: use the launcher's
    os.environ.update(spec["env"])
    try:
        os.chdir(spec["cwd"])
    except OSError:
        pass
    sys.path[:] = spec["sys_path"]
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    stack_file = open(spec["stack_path"], "w")  # noqa: SIM115 - lives as long as the rank
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
        _run_task(message[1], rank, ctrl)
    _finish()


def _run_task(payload: bytes, rank: int, ctrl: Any) -> None:
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the notebook
        sys.stdout.flush()
        sys.stderr.flush()
        ctrl.send(("error", error_report(exc, rank)))
        return
    try:
        data = cloudpickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001
        report = error_report(exc, rank)
        report["message"] = (
            f"the return value (a {type(result).__name__}) cannot be pickled to send it back "
            f"to the notebook: {exc}. Return plain numbers, lists, dicts or tensors."
        )
        report["exc_type"] = "PicklingError"
        sys.stdout.flush()
        sys.stderr.flush()
        ctrl.send(("error", report))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    ctrl.send(("ok", data))


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
