"""Run a function on N torch.distributed ranks from a notebook cell.

``launch(fn, world_size=4)`` forks ranks from a forkserver that has torch preloaded, ships
``fn`` to them with cloudpickle (so functions defined in a cell work), joins them in a
process group over a file store on this machine, prints each rank's output in the running
cell as ``[rank r] ...`` lines, and returns what each rank returned. Any failure ends every
rank and raises :class:`RankError` in the cell; so does a timeout and a kernel interrupt
(which raises ``KeyboardInterrupt``). ``RankGroup`` is the piece both ``launch`` and
:class:`parlib.Cluster` stand on.
"""

from __future__ import annotations

import atexit
import linecache
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

import cloudpickle

BACKENDS = ("gloo", "nccl")
_announced = False
_live_groups: "weakref.WeakSet[RankGroup]" = weakref.WeakSet()


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


@dataclass(frozen=True)
class Plan:
    """Which backend and device a launch uses, and why."""

    backend: str
    device_type: str  # "cpu" or "cuda"
    reason: str


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(world_size: int, backend: str | None = None) -> Plan:
    """The device policy: NCCL with one GPU per rank when there are enough GPUs, else gloo."""
    gpus = cuda_count()
    if backend is None:
        if gpus >= world_size:
            why = f"{gpus} CUDA GPU(s) >= {world_size} ranks: one GPU per rank"
            return Plan("nccl", "cuda", why)
        why = "no CUDA GPU found" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"
        return Plan("gloo", "cpu", f"{why}: ranks run on the CPU")
    if backend == "nccl":
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: {world_size} ranks, {gpus} GPU(s) "
                "found. Use backend='gloo' (or leave backend=None) to run on the CPU."
            )
        return Plan("nccl", "cuda", "backend='nccl' asked for")
    if backend == "gloo":
        return Plan("gloo", "cpu", "backend='gloo' asked for: ranks run on the CPU")
    raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)} or None")


def threads_per_rank(world_size: int) -> int:
    """max(1, cores // world_size): more threads than cores makes every rank slower."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _validate(fn: Any, world_size: Any, timeout: Any) -> None:
    if not callable(fn):
        raise ValueError(f"fn must be callable (a function to run on every rank), got {fn!r}")
    validate_sizes(world_size, timeout)


def validate_sizes(world_size: Any, timeout: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _context() -> Any:
    methods = mp.get_all_start_methods()
    if "forkserver" not in methods:  # Windows: slower, but safe
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["parlib._rank"])
    return ctx


def _loopback_ifname() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


class RankGroup:
    """``world_size`` rank processes in one process group, serving tasks until closed."""

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        validate_sizes(world_size, timeout)
        self.world_size = world_size
        self.plan = plan(world_size, backend)
        self.timeout = float(timeout)
        self.env = dict(env or {})
        if any(not isinstance(k, str) or not isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("env must map str to str")
        self.procs: list[Any] = []
        self.ctrls: list[Any] = []
        self._out: dict[int, tuple[int, Any, bool]] = {}  # fd -> (rank, connection, is stderr)
        self._partial: dict[int, bytes] = {}
        self._tmp = ""
        self.closed = True
        self._code_index: dict[str, list[tuple[str, int, int]]] = {}

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> RankGroup:
        global _announced
        if not _announced:
            print(
                f"parlib: {self.world_size} rank(s) on {self.plan.device_type.upper()} with "
                f"{self.plan.backend} ({self.plan.reason}); start method "
                f"{_context().get_start_method()}",
                flush=True,
            )
            _announced = True
        ctx = _context()
        self._tmp = tempfile.mkdtemp(prefix="parlib-")
        env = dict(os.environ)
        env.update(self.env)
        loop = _loopback_ifname()
        env.setdefault("GLOO_SOCKET_IFNAME", loop)
        env.setdefault("NCCL_SOCKET_IFNAME", loop)
        threads = threads_per_rank(self.world_size)
        self.closed = False
        _live_groups.add(self)
        try:
            for rank in range(self.world_size):
                parent_ctrl, child_ctrl = ctx.Pipe(duplex=True)
                out_r, out_w = ctx.Pipe(duplex=False)
                err_r, err_w = ctx.Pipe(duplex=False)
                rank_env = dict(env)
                device = f"cuda:{rank}" if self.plan.device_type == "cuda" else "cpu"
                rank_env.update(
                    RANK=str(rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(self.world_size), PARLIB_DEVICE=device,
                    PARLIB_BACKEND=self.plan.backend,
                )
                rank_env.setdefault("OMP_NUM_THREADS", str(threads))
                spec = {
                    "rank": rank, "world_size": self.world_size, "local_rank": rank,
                    "backend": self.plan.backend, "store_path": os.path.join(self._tmp, "store"),
                    "stack_path": os.path.join(self._tmp, f"stack{rank}.txt"),
                    "pg_timeout": max(self.timeout, 1.0), "env": rank_env, "cwd": os.getcwd(),
                    "sys_path": list(sys.path), "parent_pid": os.getpid(), "threads": threads,
                }
                from parlib import _rank

                proc = ctx.Process(
                    target=_rank.rank_main, args=(spec, child_ctrl, out_w, err_w),
                    name=f"parlib-rank-{rank}",
                )
                proc.start()
                for conn in (child_ctrl, out_w, err_w):
                    conn.close()
                self.procs.append(proc)
                self.ctrls.append(parent_ctrl)
                self._out[out_r.fileno()] = (rank, out_r, False)
                self._out[err_r.fileno()] = (rank, err_r, True)
            self._collect(kind="ready", deadline=time.monotonic() + max(self.timeout, 30.0))
        except BaseException:
            self.kill()
            raise
        return self

    def close(self) -> None:
        """Ask every rank to leave, then make sure it has (kill what lingers)."""
        if self.closed:
            return
        for conn in self.ctrls:
            try:
                conn.send(("exit", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._drain_output()
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank (a rank inside gloo's C++ code never runs Python handlers)."""
        for proc in self.procs:
            if proc.exitcode is None:
                try:
                    proc.kill()
                except (OSError, ValueError, AttributeError):
                    pass
        for proc in self.procs:
            try:
                proc.join(5.0)
                proc.close()
            except (ValueError, AssertionError):
                pass
        self._flush_partial()
        for conn in self.ctrls:
            conn.close()
        for _fd, (_rank, conn, _err) in list(self._out.items()):
            conn.close()
        self.procs, self.ctrls, self._out, self._partial = [], [], {}, {}
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = ""
        self.closed = True
        _live_groups.discard(self)

    # -- running tasks -------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
            timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results ordered by rank."""
        if self.closed:
            raise RuntimeError("this rank group is closed")
        try:
            payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except Exception as exc:
            raise ValueError(
                f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        self._code_index = _code_index((fn, *args, *(kwargs or {}).values()))
        for conn in self.ctrls:
            conn.send(("run", payload))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        results = self._collect(kind="ok", deadline=deadline)
        return [cloudpickle.loads(data) for data in results]

    def _collect(self, kind: str, deadline: float) -> list[Any]:
        """Wait for every rank's reply, printing output meanwhile; raise on any failure."""
        limit_s = deadline - time.monotonic()
        replies: dict[int, Any] = {}
        errors: list[dict[str, Any]] = []
        fail_deadline: float | None = None
        sentinel_rank = {proc.sentinel: r for r, proc in enumerate(self.procs)}
        ctrl_rank = {conn: r for r, conn in enumerate(self.ctrls)}
        dead: set[int] = set()
        try:
            while len(replies) < self.world_size:
                now = time.monotonic()
                if fail_deadline is not None and now >= fail_deadline:
                    break
                if now >= deadline:
                    self._raise_timeout(replies, limit_s)
                limit = min(deadline, fail_deadline or deadline) - now
                waitables = [c for c, r in ctrl_rank.items() if r not in replies and r not in dead]
                waitables += [s for s, r in sentinel_rank.items() if r not in dead]
                waitables += [conn for (_r, conn, _e) in self._out.values()]
                for obj in wait(waitables, timeout=max(0.0, min(limit, 0.5))):
                    if obj in sentinel_rank:
                        rank = sentinel_rank[obj]
                        dead.add(rank)
                        if rank in replies:
                            continue
                        # A reply may already sit in the pipe: read it before calling it a death.
                        if self.ctrls[rank].poll():
                            self._read_reply(rank, kind, replies, errors)
                        if rank not in replies and not any(e["rank"] == rank for e in errors):
                            errors.append(self._death_report(rank))
                    elif obj in ctrl_rank:
                        self._read_reply(ctrl_rank[obj], kind, replies, errors)
                    else:
                        self._read_output(obj)
                if errors and fail_deadline is None:
                    # Give the other ranks a moment to report, so the root cause can be told
                    # apart from peers failing because of it.
                    fail_deadline = time.monotonic() + 0.5
        except KeyboardInterrupt:
            self.kill()
            raise
        if errors:
            self._drain_output()
            self.kill()
            raise self._rank_error(errors)
        self._drain_output()
        return [replies[r] for r in range(self.world_size)]

    def _read_reply(self, rank: int, kind: str, replies: dict, errors: list) -> None:
        try:
            status, data = self.ctrls[rank].recv()
        except (EOFError, OSError):
            return  # the sentinel reports the death
        if status == "error":
            errors.append(data)
        elif status == kind:
            replies[rank] = data

    def _death_report(self, rank: int) -> dict[str, Any]:
        code = self.procs[rank].exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            message = f"rank {rank} was killed by {name}"
        else:
            message = f"rank {rank} exited with code {code} before it returned"
        return {"rank": rank, "exc_type": "Exited", "message": message, "frames": [],
                "time": time.time(), "echo": False}

    def _raise_timeout(self, replies: dict[int, Any], limit_s: float) -> None:
        stuck = [r for r in range(self.world_size) if r not in replies]
        stacks = self._stacks(stuck)
        done = sorted(replies)
        self._drain_output()
        self.kill()
        hint = ""
        if done:
            hint = (
                f" Rank(s) {_ranks(done)} finished while rank(s) {_ranks(stuck)} were still "
                "waiting: did every rank call the same collectives, and does every recv have "
                "a matching send?"
            )
        raise RankError(
            f"rank(s) {_ranks(stuck)} did not finish within {limit_s:.3g} s; every rank was "
            f"stopped.{hint}",
            rank=stuck[0], exc_type="Timeout", remote_traceback=stacks,
        )

    def _stacks(self, ranks: list[int]) -> str:
        """Ask hung ranks where they are (faulthandler on SIGUSR1) before killing them."""
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except (OSError, TypeError):
                pass
        time.sleep(0.2)
        parts = []
        for r in ranks:
            try:
                with open(os.path.join(self._tmp, f"stack{r}.txt")) as fh:
                    text = fh.read().strip()
            except OSError:
                text = ""
            if text:
                parts.append(f"rank {r} was here when stopped:\n" + _annotate_stack(text))
        return "\n\n".join(parts)

    # -- output --------------------------------------------------------------------
    def _read_output(self, conn: Any) -> bool:
        fd = conn.fileno()
        rank, _conn, is_err = self._out[fd]
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._flush_partial(fd)
            self._out.pop(fd, None)
            conn.close()
            return False
        data = self._partial.pop(fd, b"") + chunk
        *lines, rest = data.split(b"\n")
        if rest:
            self._partial[fd] = rest
        if lines:
            self._emit(rank, is_err, lines)
        return True

    def _emit(self, rank: int, is_err: bool, lines: list[bytes]) -> None:
        prefix = f"[rank {rank}] "
        text = "".join(prefix + line.decode("utf-8", "replace") + "\n" for line in lines)
        stream = sys.stderr if is_err else sys.stdout
        stream.write(text)
        stream.flush()

    def _flush_partial(self, fd: int | None = None) -> None:
        for key in [fd] if fd is not None else list(self._partial):
            rest = self._partial.pop(key, b"")
            if rest and key in self._out:
                rank, _conn, is_err = self._out[key]
                self._emit(rank, is_err, [rest])

    def _drain_output(self) -> None:
        """Read whatever output is already in the pipes (ranks flush before replying)."""
        while True:
            ready = wait([conn for (_r, conn, _e) in self._out.values()], timeout=0)
            if not ready:
                return
            for conn in ready:
                self._read_output(conn)

    # -- errors --------------------------------------------------------------------
    def _rank_error(self, errors: list[dict[str, Any]]) -> RankError:
        genuine = [e for e in errors if not e["echo"]] or errors
        root = min(genuine, key=lambda e: e["time"])
        others = sorted({e["rank"] for e in errors} - {root["rank"]})
        tb = _format_frames(root["frames"], self._code_index)
        message = f"rank {root['rank']} failed: {root['exc_type']}: {root['message']}"
        if others:
            message += f"\n(rank(s) {_ranks(others)} failed after it; all ranks were stopped)"
        return RankError(message, rank=root["rank"], exc_type=root["exc_type"],
                         remote_traceback=tb)

    def __enter__(self) -> RankGroup:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


_INTERNAL = (os.sep + "parlib" + os.sep + "_rank.py", os.sep + "parlib" + os.sep + "launcher.py")


def _code_index(objects: tuple) -> dict[str, list[tuple[str, int, int]]]:
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


def _format_frames(frames: list[tuple[str, int, str, str]],
                   index: dict[str, list[tuple[str, int, int]]] | None = None) -> str:
    """Traceback text with the rank's frames; source lines of notebook cells come from the
    kernel's linecache (the ranks cannot see cell source)."""
    lines = ["Traceback on the rank (most recent call last):"]
    shown = [f for f in frames if not f[0].endswith(_INTERNAL)] or frames
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


def _annotate_stack(text: str) -> str:
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


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    backend: str | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results by rank.

    Raises ``RankError`` naming the root-cause rank when any rank fails, dies or does not
    finish within ``timeout`` seconds; every rank process is gone by then.
    """
    _validate(fn, world_size, timeout)
    group = RankGroup(world_size, backend=backend, timeout=timeout, env=env)
    group.start()
    try:
        return group.run(fn, args, kwargs)
    finally:
        group.close()


def device():
    """This rank's torch.device: its GPU under NCCL, else the CPU.

    Outside a launched rank (or under torchrun), it follows the process group's backend,
    or picks ``cuda`` when a GPU is present.
    """
    import torch
    import torch.distributed as dist

    name = os.environ.get("PARLIB_DEVICE")
    if name:
        return torch.device(name)
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@atexit.register
def _kill_leftovers() -> None:
    for group in list(_live_groups):
        group.kill()
