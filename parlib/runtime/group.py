"""Rank processes: start N of them in one process group, run functions on them, collect
their results, and turn any failure into one :class:`RankError`.

``launch(fn, world_size=4)`` forks ranks from a forkserver that has torch preloaded, ships
``fn`` to them with cloudpickle (so functions defined in a cell work), joins them in a
process group over a file store on this machine, prints each rank's output in the running
cell (:mod:`parlib.runtime.output`), and returns what each rank returned. Any failure
ends every rank and raises :class:`RankError` in the cell; so does a timeout, and a kernel
interrupt raises ``KeyboardInterrupt``. :class:`RankGroup` is the piece both ``launch`` and
:class:`parlib.Cluster` stand on.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import cloudpickle

from parlib.runtime.errors import (
    RankError,
    annotate_stack,
    code_index,
    format_frames,
    format_ranks,
)
from parlib.runtime.output import RankOutput
from parlib.runtime.policy import (
    loopback_ifname,
    plan,
    start_context,
    threads_per_rank,
    validate_sizes,
)

_announced = False
_live_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()


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
        self.output = RankOutput()
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
                f"{start_context().get_start_method()}",
                flush=True,
            )
            _announced = True
        ctx = start_context()
        self._tmp = tempfile.mkdtemp(prefix="parlib-")
        env = dict(os.environ)
        env.update(self.env)
        loop = loopback_ifname()
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
                from parlib.runtime import worker  # torch loads in the forkserver, not here

                proc = ctx.Process(
                    target=worker.rank_main, args=(spec, child_ctrl, out_w, err_w),
                    name=f"parlib-rank-{rank}",
                )
                proc.start()
                for conn in (child_ctrl, out_w, err_w):
                    conn.close()
                self.procs.append(proc)
                self.ctrls.append(parent_ctrl)
                self.output.add(rank, out_r, False)
                self.output.add(rank, err_r, True)
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
        self.output.drain()
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
        for conn in self.ctrls:
            conn.close()
        self.output.close()
        self.procs, self.ctrls = [], []
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
        self._code_index = code_index((fn, *args, *(kwargs or {}).values()))
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
                waitables += self.output.connections()
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
                        self.output.read(obj)
                if errors and fail_deadline is None:
                    # Give the other ranks a moment to report, so the root cause can be told
                    # apart from peers failing because of it.
                    fail_deadline = time.monotonic() + 0.5
        except KeyboardInterrupt:
            self.kill()
            raise
        if errors:
            self.output.drain()
            self.kill()
            raise self._rank_error(errors)
        self.output.drain()
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
        self.output.drain()
        self.kill()
        hint = ""
        if done:
            hint = (
                f" Rank(s) {format_ranks(done)} finished while rank(s) "
                f"{format_ranks(stuck)} were still waiting: did every rank call the same "
                "collectives, and does every recv have a matching send?"
            )
        raise RankError(
            f"rank(s) {format_ranks(stuck)} did not finish within {limit_s:.3g} s; every rank was "
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
                parts.append(f"rank {r} was here when stopped:\n" + annotate_stack(text))
        return "\n\n".join(parts)

    # -- errors --------------------------------------------------------------------
    def _rank_error(self, errors: list[dict[str, Any]]) -> RankError:
        genuine = [e for e in errors if not e["echo"]] or errors
        root = min(genuine, key=lambda e: e["time"])
        others = sorted({e["rank"] for e in errors} - {root["rank"]})
        tb = format_frames(root["frames"], self._code_index)
        message = f"rank {root['rank']} failed: {root['exc_type']}: {root['message']}"
        if others:
            message += f"\n(rank(s) {format_ranks(others)} failed after it; all ranks were stopped)"
        return RankError(message, rank=root["rank"], exc_type=root["exc_type"],
                         remote_traceback=tb)

    def __enter__(self) -> RankGroup:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
    if not callable(fn):
        raise ValueError(f"fn must be callable (a function to run on every rank), got {fn!r}")
    validate_sizes(world_size, timeout)
    group = RankGroup(world_size, backend=backend, timeout=timeout, env=env)
    group.start()
    try:
        return group.run(fn, args, kwargs)
    finally:
        group.close()


@atexit.register
def _kill_leftovers() -> None:
    for group in list(_live_groups):
        group.kill()


__all__ = ["RankGroup", "launch"]
