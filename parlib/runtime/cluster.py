"""Warm ranks: start N ranks once, then run many small functions on them in milliseconds.

``Cluster`` keeps a :class:`~parlib.runtime.group.RankGroup` alive between calls, and with it
the variables ``%%ranks`` cells define. A Python exception on a rank, or an interrupt that
stops every rank in Python code, leaves the ranks and their variables as they were. When a
rank died, or ranks were left waiting in a collective (so the process group may be half-way
through one), every rank is killed; the next call rebuilds the cluster and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from parlib.runtime.errors import RankError, RanksInterrupted, install_short_tracebacks
from parlib.runtime.group import RankGroup
from parlib.runtime.policy import validate_sizes


class Cluster:
    """``world_size`` ranks kept alive with their process group initialised.

    >>> with Cluster(2) as cluster:                      # doctest: +SKIP
    ...     cluster.run(lambda: dist.get_rank())
    [0, 1]
    """

    def __init__(
        self,
        world_size: int = 4,
        backend: str | None = None,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        validate_sizes(world_size, timeout)
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self._group: RankGroup | None = None
        self._closed = False
        self._faults = 0
        self._start()

    def _start(self) -> None:
        group = RankGroup(self.world_size, self.backend, self.timeout, self.env)
        group.warm = True
        group.start()
        self._group = group

    @property
    def plan(self):
        return (self._group or RankGroup(self.world_size, self.backend)).plan

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; per-rank results ordered by rank."""
        return self.run_with_timeout(fn, args, kwargs, timeout=None)

    def run_with_timeout(self, fn: Callable[..., Any], args: tuple = (),
                         kwargs: dict | None = None, timeout: float | None = None) -> list[Any]:
        """``run`` with this call's own time limit (the cluster's timeout when None)."""
        __tracebackhide__ = True
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        if self._closed:
            raise RuntimeError("this Cluster is closed: call restart() or make a new one")
        install_short_tracebacks()
        if self._group is None or self._group.closed:
            print(
                f"parlib: rebuilding the cluster ({self.world_size} ranks) after the last "
                "error; variables defined on the ranks are gone",
                flush=True,
            )
            self._start()
        assert self._group is not None
        try:
            return self._group.run(fn, args, kwargs, timeout=timeout)
        except (RankError, RanksInterrupted) as err:
            self._faults += 1
            if self._group.closed:
                self._group = None  # the group killed its ranks; rebuild on the next call
            raise err.with_traceback(None) from None  # the learner's frames, not parlib's

    def restart(self) -> Cluster:
        """End every rank and start fresh ones (a clean process group, empty namespaces)."""
        if self._group is not None:
            self._group.close()
        self._closed = False
        self._start()
        return self

    def close(self) -> None:
        """End every rank. Safe to call twice."""
        if self._group is not None:
            self._group.close()
            self._group = None
        self._closed = True

    @property
    def state(self) -> str:
        if self._closed:
            return "closed"
        if self._group is None or self._group.closed:
            return "will rebuild on next call"
        dead = self._group.dead_ranks()
        if dead:
            return f"rank(s) {', '.join(map(str, dead))} died: will rebuild on next call"
        return "running"

    def pids(self) -> list[int]:
        """The rank processes' ids (for the curious, and for tests)."""
        return [p.pid for p in self._group.procs] if self._group else []

    def __repr__(self) -> str:
        p = self.plan
        return (
            f"Cluster(world_size={self.world_size}, backend={p.backend!r}, "
            f"device={p.device_type!r}, state={self.state!r})"
        )

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


__all__ = ["Cluster"]
