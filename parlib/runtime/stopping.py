"""How a call that went wrong is stopped: a rank that died while idle, a rank failing
while others run, a kernel interrupt, a timeout. Ranks still running Python code get
``KeyboardInterrupt`` (SIGUSR2) and the group is kept; ranks that do not stop (stuck in C++
code such as a collective) or that stopped inside torch.distributed (the group may be half-way
through a collective) are killed, and the error says what was lost.

:class:`Stopping` is a part of :class:`parlib.runtime.group.RankGroup`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from parlib.runtime import procs
from parlib.runtime.errors import (
    RankError,
    RanksInterrupted,
    annotate_stack,
    format_ranks,
    where_text,
)

SETTLE_S = 0.5  # after a rank fails, how long the others get to finish or fail too
INTERRUPT_GRACE_S = 0.6  # how long an interrupted rank gets to stop in Python code
STACK_DUMP_S = 0.2  # the most a rank's stack dump (faulthandler) may take before the interrupt
# A rank that finished will never join another collective: ranks left blocked in one after
# it (no CPU used, stack inside torch.distributed) for this long are called deadlocked, so
# a rank that skipped a collective costs seconds instead of the whole call's timeout.
DEADLOCK_S = 8.0
IDLE_CPU_S = 0.05  # the CPU a blocked rank may use meanwhile (ticks are 10 ms)
SAMPLE_S = 0.5  # how often the ranks' CPU times are read


class DeadlockWatch:
    """Watches a call for ranks left waiting on ranks that already returned.

    :meth:`stuck` is cheap (it reads each running rank's CPU time from /proc at most every
    SAMPLE_S) and says True once, for DEADLOCK_S, some rank has finished while every other
    running rank used no CPU and its stack is inside torch.distributed. A rank sleeping or
    computing is never called stuck: a sleep is not a collective, a computation uses CPU."""

    def __init__(self, group: Stopping) -> None:
        self.group = group
        self.base: dict[int, float] = {}
        self.since = 0.0
        self.next_sample = 0.0

    def stuck(self, replies: dict, dead: set) -> bool:
        now = time.monotonic()
        if now < self.next_sample:
            return False
        self.next_sample = now + SAMPLE_S
        running = [r for r in range(self.group.world_size) if r not in replies and r not in dead]
        cpu = {r: procs.cpu_seconds(self.group.ids[r][0]) for r in running}
        if not replies or not running or any(c is None for c in cpu.values()):
            self.base = {}
            return False
        if set(cpu) != set(self.base) or any(cpu[r] - self.base[r] > IDLE_CPU_S for r in cpu):
            self.base, self.since = cpu, now  # someone moved: start the window again
            return False
        if now - self.since < DEADLOCK_S:
            return False
        self.group._request_stacks(running)
        if all(_in_collective(self.group._read_stacks([r])) for r in running):
            return True
        self.base, self.since = cpu, now  # idle, but not in a collective: a sleep, say
        return False


def _in_collective(stack: str) -> bool:
    """Is the innermost frame of a faulthandler dump inside torch.distributed?"""
    for line in stack.splitlines():
        if line.strip().startswith("File "):
            return f"torch{os.sep}distributed{os.sep}" in line
    return False


class Stopping:
    """Stopping ranks after a failure or an interrupt (needs RankGroup's state)."""

    def _raise_dead_idle(self, dead: list[int]) -> None:
        __tracebackhide__ = True
        reports = [self._death_report(r) for r in sorted(set(dead))]
        self.kill()
        message = reports[0]["message"] + " while it was idle"
        raise RankError(message + "\n" + self._lost_note("a rank process ended"),
                        rank=reports[0]["rank"], exc_type="Exited")

    def _lost_note(self, why: str) -> str:
        if self.warm:
            return (f"({why}: every rank was stopped; the ranks restart on the next call and "
                    "variables defined on them are lost)")
        return f"({why}: every rank was stopped)"

    def _interrupt(self, ranks: list[int], kind: str, replies: dict, errors: list, dead: set,
                   grace: float) -> list[int]:
        """Send each rank KeyboardInterrupt (SIGUSR2); return those that stopped in time."""
        for r in ranks:
            try:
                os.kill(self.ids[r][0], signal.SIGUSR2)
            except OSError:
                pass

        def answered(r: int) -> bool:
            return r in replies or r in dead or any(e["rank"] == r for e in errors)

        self._pump(kind, replies, errors, dead, time.monotonic() + grace,
                   lambda: all(answered(r) for r in ranks))
        return [r for r in ranks if answered(r) and r not in dead]

    def _interrupted(self, kind: str, replies: dict, errors: list, dead: set) -> None:
        """The kernel was interrupted: stop each rank's code, keep the ranks if they can."""
        __tracebackhide__ = True
        running = [r for r in range(self.world_size) if r not in replies and r not in dead
                   and not any(e["rank"] == r for e in errors)]
        stopped: list[int] = []
        try:
            if kind == "ok":
                # Stacks first (they come at once), then the grace: the interrupt stays
                # within a second even when ranks must be killed.
                self._request_stacks(running)
                stopped = self._interrupt(running, kind, replies, errors, dead,
                                          INTERRUPT_GRACE_S)
        except KeyboardInterrupt:  # a second interrupt: no more waiting
            pass
        stuck = [r for r in running if r not in stopped]
        mid = self._left_mid_collective(stopped, errors)
        stacks = self._read_stacks(stuck) if stuck and kind == "ok" else ""
        lines = []
        for e in sorted(errors, key=lambda e: e["rank"]):
            if e["rank"] in stopped:
                lines.append(f"  rank {e['rank']} was at "
                             f"{where_text(e['frames'], self._code_index)}")
        self.output.drain()
        self.output.flush_partials(0.0)
        if stuck or mid or dead or kind != "ok":
            self.kill()
            why = (f"rank(s) {format_ranks(stuck)} did not stop (stuck in C++ code, e.g. "
                   "waiting in a collective)" if stuck else
                   f"rank(s) {format_ranks(mid)} stopped inside a collective" if mid else
                   "start-up was cut short")
            head = (f"interrupted: ranks {format_ranks(list(range(self.world_size)))} "
                    f"stopped\n{self._lost_note(why)}")
        else:
            head = f"interrupted: ranks {format_ranks(running or [])} stopped"
            if self.warm:
                head += "; the ranks and their variables are kept"
        raise RanksInterrupted("\n".join([head, *lines]), stacks) from None

    @staticmethod
    def _left_mid_collective(ranks: list[int], errors: list) -> list[int]:
        """Ranks among ``ranks`` whose error came from inside torch.distributed: their
        process group may be half-way through a collective, so it cannot be kept."""
        return sorted({e["rank"] for e in errors if e["rank"] in ranks
                       and (e.get("in_collective") or e.get("echo"))})

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

    def _raise_timeout(self, kind: str, replies: dict, errors: list, dead: set,
                       deadline: float, deadlocked: bool = False) -> None:
        """Stop the ranks that did not reply and raise: a Timeout at the deadline, or a
        Deadlock when :class:`DeadlockWatch` found them blocked on finished ranks."""
        __tracebackhide__ = True
        stuck = [r for r in range(self.world_size) if r not in replies]
        self._request_stacks(stuck)
        done = sorted(replies)
        hint = ""
        if deadlocked:
            hint = (
                f" Rank(s) {format_ranks(done)} had returned, and a rank that returned joins "
                "no more collectives: did every rank call the same collectives, in the same "
                "order, and does every recv have a matching send?"
            )
        elif done:
            hint = (
                f" Rank(s) {format_ranks(done)} finished while rank(s) "
                f"{format_ranks(stuck)} were still waiting: did every rank call the same "
                "collectives, and does every recv have a matching send?"
            )
        stopped = self._interrupt(stuck, kind, replies, errors, dead, SETTLE_S) \
            if kind == "ok" else []
        stacks = self._read_stacks(stuck)
        kept = len(stopped) == len(stuck) and not self._left_mid_collective(stopped, errors)
        if not kept:
            self.kill()
        note = ("(every rank was stopped in Python code; the ranks and their variables are "
                "kept)" if kept and self.warm else "" if kept else self._lost_note(
                    "timeout: a rank was left inside a collective or C++ code"))
        what = (f"waited inside a collective for {DEADLOCK_S:g} s without using the CPU"
                if deadlocked else f"did not finish within {self._limit_s:.3g} s")
        raise RankError(
            f"rank(s) {format_ranks(stuck)} {what}; they were stopped.{hint}\n{note}".rstrip(),
            rank=stuck[0], exc_type="Deadlock" if deadlocked else "Timeout",
            remote_traceback=stacks, kept=kept,
        )

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmp, f"stack{rank}.txt")

    def _request_stacks(self, ranks: list[int]) -> None:
        """Ask ranks where they are (faulthandler on SIGUSR1; it answers even in C++) and
        wait until they wrote it down: an interrupt (SIGUSR2) arriving while the dump is
        being written can hang a rank, so the two signals are never sent together."""
        for r in ranks:
            with contextlib.suppress(OSError):
                os.truncate(self._stack_path(r), 0)  # the rank appends: start empty
            with contextlib.suppress(OSError):
                os.kill(self.ids[r][0], signal.SIGUSR1)
        deadline = time.monotonic() + STACK_DUMP_S
        while time.monotonic() < deadline and not all(self._dumped(r) for r in ranks):
            time.sleep(0.005)
        time.sleep(0.01)  # the rest of a dump already begun

    def _dumped(self, rank: int) -> bool:
        try:
            return os.path.getsize(self._stack_path(rank)) > 0
        except OSError:
            return True  # no file to wait for

    def _read_stacks(self, ranks: list[int]) -> str:
        """The dumps asked for by :meth:`_request_stacks`."""
        parts = []
        for r in ranks:
            try:
                with open(self._stack_path(r)) as fh:
                    text = fh.read().strip()
            except OSError:
                text = ""
            if text:
                parts.append(f"rank {r} was here when stopped:\n" + annotate_stack(text))
        return "\n\n".join(parts)


__all__ = ["DEADLOCK_S", "INTERRUPT_GRACE_S", "SETTLE_S", "STACK_DUMP_S", "DeadlockWatch",
           "Stopping"]
