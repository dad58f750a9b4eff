"""Rank processes: start N of them in one process group, run functions on them, collect
their results, and turn any failure into one :class:`RankError`.

``launch(fn, world_size=4)`` forks ranks from a forkserver that has torch preloaded, ships
``fn`` to them with cloudpickle (so functions defined in a cell work), joins them in a
process group over a file store on this machine, prints each rank's output in the running
cell (:mod:`parlib.runtime.output`), and returns what each rank returned.

What a failure leaves behind, as in a normal notebook cell where possible:

- a Python exception on a rank, when every other rank finished or raised too: the ranks
  (and a warm cluster's variables) stay as they were;
- a rank that died, or ranks still waiting (in a collective) after another failed, or not
  answering an interrupt: every rank is killed (a warm cluster restarts on its next call);
- a kernel interrupt: each running rank gets ``KeyboardInterrupt`` in its own code; ranks
  stuck in C++ (a collective) are killed.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import cloudpickle

from parlib.runtime import procs
from parlib.runtime.errors import (
    RankError,
    RanksInterrupted,
    code_index,
    dumps_for_ranks,
    failure_error,
    install_short_tracebacks,
)
from parlib.runtime.output import RankOutput
from parlib.runtime.policy import (
    loopback_ifname,
    plan,
    start_context,
    threads_per_rank,
    validate_sizes,
)
from parlib.runtime.stopping import SETTLE_S, DeadlockWatch, Stopping

# The process group's own timeout, far beyond any call's: the launcher's deadline and the
# kernel's interrupt are what end a stuck collective. A gloo timeout equal to the call's fired
# inside the grace window and closed the group's connections, leaving ranks that looked
# "stopped in Python" over a broken group.
PG_TIMEOUT_S = 365 * 24 * 3600.0

_announced = False
_stale_cleaned = False
_live_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()


def announcement(world_size: int, device_type: str, backend: str, reason: str,
                 start_method: str, width: int = 100) -> str:
    """What the first ``launch`` of a kernel prints: where the ranks run, why, and how they
    start. Lines are at most ``width`` characters when the words allow (a notebook's output
    area breaks longer lines mid-word): the start method goes on a line of its own if need be."""
    where = f"parlib: {world_size} rank(s) on {device_type.upper()} with {backend} ({reason})"
    how = f"start method {start_method}"
    if len(where) + 2 + len(how) <= width:
        return f"{where}; {how}"
    return f"{where};\n  {how}"


class RankGroup(Stopping):
    """``world_size`` rank processes in one process group, serving tasks until closed."""

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        plain_replies: bool = False,
    ) -> None:
        validate_sizes(world_size, timeout)
        self.world_size = world_size
        # read every reply as plain data (parlib.runtime.replies), never running anything a
        # rank sends: for ranks that run code nobody vouches for (the course's checks)
        self.plain_replies = bool(plain_replies)
        self.plan = plan(world_size, backend)
        self.timeout = float(timeout)
        self.env = dict(env or {})
        if any(not isinstance(k, str) or not isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("env must map str to str")
        self.procs: list[Any] = []
        self.ids: list[tuple[int, int | None]] = []  # (pid, start time) of every rank
        self.ctrls: list[Any] = []
        self.output = RankOutput()
        self.warm = False  # a Cluster's group: errors say what happened to the variables
        self._tmp = ""
        # one pipe a rank: closing our end ends the rank (SIGIO goes to one owner per open
        # pipe end, so ranks sharing a read end could not all be signalled)
        self._lifelines: list[Any] = []
        self._loose: list[Any] = []  # pipe ends not yet owned by a rank
        self.closed = True
        self._code_index: dict[str, list[tuple[str, int, int]]] = {}
        self._limit_s = self.timeout

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> RankGroup:
        global _announced, _stale_cleaned
        __tracebackhide__ = True
        install_short_tracebacks()
        ctx = start_context()
        if not _announced:
            print(announcement(self.world_size, self.plan.device_type, self.plan.backend,
                               self.plan.reason, ctx.get_start_method()), flush=True)
            _announced = True
        self.closed = False
        _live_groups.add(self)
        try:
            if not _stale_cleaned:
                _stale_cleaned = True
                procs.remove_stale_temp_dirs()
            procs.start_temp_dir_reaper()
            procs.own_multiprocessing_temp_dir()
            self._tmp = procs.make_temp_dir("group")
            env = dict(os.environ)
            env.update(self.env)
            loop = loopback_ifname()
            env.setdefault("GLOO_SOCKET_IFNAME", loop)
            env.setdefault("NCCL_SOCKET_IFNAME", loop)
            threads = threads_per_rank(self.world_size)
            from parlib.runtime import worker  # torch loads in the forkserver, not here

            if ctx.get_start_method() == "forkserver":
                from multiprocessing import forkserver

                with procs.main_module_hidden():
                    forkserver.ensure_running()  # slow the first time: interruptible

            for rank in range(self.world_size):
                lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
                self._lifelines.append(lifeline_w)
                self._loose.append(lifeline_r)
                parent_ctrl, child_ctrl = ctx.Pipe(duplex=True)
                self._loose += [parent_ctrl, child_ctrl]
                out_r, out_w = ctx.Pipe(duplex=False)
                self._loose += [out_r, out_w]
                err_r, err_w = ctx.Pipe(duplex=False)
                self._loose += [err_r, err_w]
                proc = ctx.Process(
                    target=worker.rank_main,
                    args=(self._spec(rank, env, threads), child_ctrl, out_w, err_w, lifeline_r),
                    name=f"parlib-rank-{rank}",
                )
                # An interrupt inside start() could leave a rank nobody tracks, or kill the
                # forkserver mid-handshake: hold it back until the rank is on our list.
                with procs.interrupts_deferred(), procs.main_module_hidden():
                    proc.start()
                    self.procs.append(proc)
                    self.ids.append((proc.pid, procs.start_time(proc.pid)))
                self.ctrls.append(parent_ctrl)
                self.output.add(rank, out_r, False)
                self.output.add(rank, err_r, True)
                for conn in (child_ctrl, out_w, err_w, lifeline_r):
                    conn.close()
                self._loose = []
            limit = self.timeout if math.isfinite(self.timeout) else 600.0
            self._collect(kind="ready", deadline=time.monotonic() + max(limit, 30.0))
        except BaseException:
            self.kill()
            raise
        return self

    def _spec(self, rank: int, env: dict[str, str], threads: int) -> dict[str, Any]:
        rank_env = dict(env)
        # the caller's PARLIB_DEVICE wins (e.g. "cuda": gloo over GPU tensors, as bench/gpu.py
        # runs two ranks on one GPU, which NCCL refuses)
        device = env.get("PARLIB_DEVICE") or (
            f"cuda:{rank}" if self.plan.device_type == "cuda" else "cpu")
        rank_env.update(
            RANK=str(rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.world_size), PARLIB_DEVICE=device,
            PARLIB_BACKEND=self.plan.backend,
        )
        rank_env.setdefault("OMP_NUM_THREADS", str(threads))
        return {
            "rank": rank, "world_size": self.world_size, "local_rank": rank,
            "backend": self.plan.backend, "store_path": os.path.join(self._tmp, "store"),
            "stack_path": os.path.join(self._tmp, f"stack{rank}.txt"),
            "pg_timeout": PG_TIMEOUT_S, "env": rank_env, "cwd": os.getcwd(),
            "sys_path": list(sys.path), "threads": threads,
            "plain_replies": self.plain_replies,
        }

    def close(self) -> None:
        """Ask every rank to leave, then make sure it has (kill what lingers, even when an
        interrupt arrives meanwhile)."""
        if self.closed:
            return
        try:
            for conn in self.ctrls:
                try:
                    conn.send(("exit", None))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 2.0
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            self.output.drain()
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL every rank and its children (a rank inside gloo's C++ code never runs
        Python handlers); ranks not yet tracked end when their lifeline closes."""
        with procs.interrupts_deferred():
            for lifeline in self._lifelines:
                lifeline.close()
            self._lifelines = []
            for pid, started in self.ids:
                procs.kill_tree(pid, started)
            for proc in self.procs:
                try:
                    proc.join(5.0)
                    proc.close()
                except (ValueError, AssertionError):
                    pass
            for conn in self.ctrls + self._loose:
                conn.close()
            self.output.close()
            self.procs, self.ids, self.ctrls, self._loose = [], [], [], []
            if self._tmp:
                import shutil

                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = ""
            self.closed = True
            _live_groups.discard(self)

    # -- running tasks -------------------------------------------------------------
    def dead_ranks(self) -> list[int]:
        """Ranks whose process has ended (an idle rank can be killed from outside)."""
        if self.closed:
            return []
        ready = set(wait([p.sentinel for p in self.procs], timeout=0))
        return [r for r, p in enumerate(self.procs) if p.sentinel in ready]

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
            timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results ordered by rank."""
        __tracebackhide__ = True
        if self.closed:
            raise RuntimeError("this rank group is closed")
        try:
            payload = dumps_for_ranks((fn, tuple(args), dict(kwargs or {})))
        except Exception as exc:
            raise ValueError(
                f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        self._code_index = code_index((fn, *args, *(kwargs or {}).values()))
        dead = self.dead_ranks()
        for rank, conn in enumerate(self.ctrls):
            if rank in dead:
                continue
            try:
                conn.send(("run", payload))
            except (OSError, ValueError):
                dead.append(rank)
        if dead:
            self._raise_dead_idle(dead)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit if math.isfinite(limit) else math.inf
        results = self._collect(kind="ok", deadline=deadline)
        if self.plain_replies:
            return [self._plain_value(rank, data) for rank, data in enumerate(results)]
        values = []
        for rank, data in enumerate(results):
            try:
                values.append(cloudpickle.loads(data))
            except Exception as exc:  # noqa: BLE001 - e.g. a class only the rank can import
                raise RankError(
                    f"rank {rank} returned a value the notebook cannot unpickle: "
                    f"{type(exc).__name__}: {exc}. Return plain numbers, lists, dicts or "
                    "tensors.", rank=rank, exc_type="UnpicklingError", kept=True,
                ) from None
        return values

    def _pump(self, kind: str, replies: dict, errors: list, dead: set, until: float,
              stop: Callable[[], bool]) -> None:
        """Handle replies, deaths and output until ``stop()`` or ``until``."""
        sentinel_rank = {proc.sentinel: r for r, proc in enumerate(self.procs)}
        ctrl_rank = {conn: r for r, conn in enumerate(self.ctrls)}
        while not stop():
            now = time.monotonic()
            if now >= until:
                return
            answered = set(replies) | {e["rank"] for e in errors}
            waitables = [c for c, r in ctrl_rank.items() if r not in answered and r not in dead]
            waitables += [s for s, r in sentinel_rank.items() if r not in dead]
            waitables += self.output.connections()
            tick = 0.05 if self.output.pending() else 0.5
            for obj in wait(waitables, timeout=max(0.0, min(until - now, tick))):
                if obj in sentinel_rank:
                    rank = sentinel_rank[obj]
                    dead.add(rank)
                    # A reply may already sit in the pipe: read it before calling it a death.
                    if rank not in replies and self.ctrls[rank].poll():
                        self._read_reply(rank, kind, replies, errors)
                elif obj in ctrl_rank:
                    self._read_reply(ctrl_rank[obj], kind, replies, errors)
                else:
                    self.output.read(obj)
            self.output.flush_partials()

    def _collect(self, kind: str, deadline: float) -> list[Any]:
        """Wait for every rank's reply, printing output meanwhile; raise on any failure."""
        __tracebackhide__ = True
        replies: dict[int, Any] = {}
        errors: list[dict[str, Any]] = []
        dead: set[int] = set()
        n = self.world_size
        self._limit_s = deadline - time.monotonic()

        def settled() -> bool:
            return len(replies) + len({e["rank"] for e in errors} | dead - set(replies)) >= n

        watch = DeadlockWatch(self)
        deadlocked = False

        def stop() -> bool:
            nonlocal deadlocked
            if settled() or errors or dead - set(replies):
                return True
            deadlocked = kind == "ok" and watch.stuck(replies, dead)
            return deadlocked

        try:
            self._pump(kind, replies, errors, dead, deadline, stop)
            if (errors or dead - set(replies)) and not settled():
                self._pump(kind, replies, errors, dead, time.monotonic() + SETTLE_S, settled)
        except KeyboardInterrupt:
            self._interrupted(kind, replies, errors, dead)
        self.output.drain()
        self.output.flush_partials(0.0)
        if not (errors or dead - set(replies)):
            if len(replies) < n:
                self._raise_timeout(kind, replies, errors, dead, deadline, deadlocked)
            return [replies[r] for r in range(n)]
        running = [r for r in range(n) if r not in replies and r not in dead
                   and not any(e["rank"] == r for e in errors)]
        deaths = sorted(dead - set(replies) - {e["rank"] for e in errors})
        errors += [self._death_report(r) for r in deaths]
        broken = kind != "ok" or bool(deaths) or any(
            e.get("in_collective") or e.get("echo") for e in errors)
        stopped: list[int] = []
        if running and not broken:
            stopped = self._interrupt(running, kind, replies, errors, dead, SETTLE_S)
            broken = len(stopped) < len(running)
        still = [r for r in running if r not in stopped]
        if broken:
            self.kill()
        raise failure_error(errors, self._code_index, still, stopped, broken, self.warm)

    def _plain_value(self, rank: int, data: Any) -> Any:
        from parlib.runtime.replies import NotPlainData, plain_loads

        try:
            return plain_loads(data)
        except NotPlainData as exc:
            raise RankError(f"rank {rank} failed: UnreadableReply: {unreadable(rank, exc)}",
                            rank=rank, exc_type="UnreadableReply", kept=True) from None

    def _read_reply(self, rank: int, kind: str, replies: dict, errors: list) -> None:
        if self.plain_replies:
            self._read_plain_reply(rank, kind, replies, errors)
            return
        try:
            status, data = self.ctrls[rank].recv()
        except (EOFError, OSError):
            return  # the sentinel reports the death
        if status == "error":
            errors.append(data)
        elif status == kind:
            replies[rank] = data

    def _read_plain_reply(self, rank: int, kind: str, replies: dict, errors: list) -> None:
        """:meth:`_read_reply` of a plain group: the message itself is read as plain data, an
        error report rebuilt from its plain fields; an unreadable one is that rank's error
        (its channel is out of step: the group cannot be kept)."""
        from parlib.runtime.replies import MAX_REPLY_BYTES, NotPlainData, plain_loads

        try:
            raw = self.ctrls[rank].recv_bytes(MAX_REPLY_BYTES)
        except EOFError:
            return  # the sentinel reports the death
        except OSError as exc:
            raw, why = None, f"its reply could not be read ({exc}; over {MAX_REPLY_BYTES} B?)"
        try:
            if raw is not None:
                status, data = plain_loads(raw)
                if status == kind == "ok" and type(data) is not bytes:
                    raise NotPlainData(f"its result is a {type(data).__name__}, not a pickle")
                if status == "error":
                    errors.append(plain_report(data, rank))
                elif status == kind:
                    replies[rank] = data
                return
        except (NotPlainData, TypeError, ValueError) as exc:
            why = unreadable(rank, exc)
        errors.append({"rank": rank, "exc_type": "UnreadableReply", "message": why,
                       "frames": [], "time": time.time(), "echo": False,
                       "in_collective": True})

    def __enter__(self) -> RankGroup:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def unreadable(rank: int, exc: Exception) -> str:
    """What a rank whose reply is not plain data is told."""
    return (f"what rank {rank} sent back is not plain data ({exc}): only numbers, strings, "
            f"bytes, lists, tuples, dicts, sets and tensors are read back from these ranks, "
            f"and nothing a rank sends is run")


def plain_report(data: Any, rank: int) -> dict[str, Any]:
    """A rank's error report rebuilt from its plain fields, each of the type the launcher
    reads (the rank is the one it came from, whatever it says), long texts cut."""
    data = data if type(data) is dict else {}

    def text(key: str, cap: int) -> str:
        value = data.get(key)
        return value[:cap] if type(value) is str else ""

    frames = [tuple(f) for f in (data.get("frames") if type(data.get("frames")) is list
                                 else [])[-200:]
              if type(f) in (tuple, list) and len(f) == 4
              and [type(x) for x in f] == [str, int, str, str]]
    when = data.get("time")
    return {"rank": rank, "exc_type": text("exc_type", 200) or "Exception",
            "message": text("message", 20_000), "frames": frames,
            "time": when if type(when) is float and math.isfinite(when) else time.time(),
            "echo": data.get("echo") is True, "in_collective": data.get("in_collective") is True}


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    backend: str | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    plain_replies: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results by rank.

    Raises ``RankError`` naming the root-cause rank when any rank fails, dies or does not
    finish within ``timeout`` seconds (``float("inf")``: no limit); every rank process is
    gone by then. ``plain_replies``: read what the ranks send back as plain data only
    (numbers, strings, bytes, lists, tuples, dicts, sets, tensors; anything else is the
    rank's ``RankError``), never running anything a rank sends, as the course's checks do
    (their ranks run the learner's code); otherwise results travel by cloudpickle and may
    be any object.
    """
    __tracebackhide__ = True
    if not callable(fn):
        raise ValueError(f"fn must be callable (a function to run on every rank), got {fn!r}")
    validate_sizes(world_size, timeout)
    group = RankGroup(world_size, backend=backend, timeout=timeout, env=env,
                      plain_replies=plain_replies)
    try:
        group.start()
        return group.run(fn, args, kwargs)
    except (RankError, RanksInterrupted) as err:
        raise err.with_traceback(None) from None  # the learner's frames, not parlib's
    finally:
        group.close()


@atexit.register
def _kill_leftovers() -> None:
    for group in list(_live_groups):
        group.kill()


__all__ = ["RankGroup", "launch"]
