"""Rank output in the notebook: each rank's stdout and stderr arrive through pipes and are
printed in the running cell as whole ``[rank r] ...`` lines."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import wait
from typing import Any


class RankOutput:
    """The read ends of every rank's stdout and stderr pipes, multiplexed into this
    process's ``sys.stdout`` / ``sys.stderr`` with a ``[rank r]`` prefix per line."""

    def __init__(self) -> None:
        self._pipes: dict[int, tuple[int, Any, bool]] = {}  # fd -> (rank, connection, is stderr)
        self._partial: dict[int, bytes] = {}

    def add(self, rank: int, conn: Any, is_err: bool) -> None:
        self._pipes[conn.fileno()] = (rank, conn, is_err)

    def connections(self) -> list[Any]:
        """What to wait on (alongside the ranks' control pipes)."""
        return [conn for (_rank, conn, _err) in self._pipes.values()]

    def owns(self, conn: Any) -> bool:
        try:
            return conn.fileno() in self._pipes and self._pipes[conn.fileno()][1] is conn
        except (OSError, ValueError):
            return False

    def read(self, conn: Any) -> bool:
        """Read what is ready on ``conn`` and print its complete lines; False at EOF."""
        fd = conn.fileno()
        rank, _conn, is_err = self._pipes[fd]
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._flush(fd)
            self._pipes.pop(fd, None)
            conn.close()
            return False
        data = self._partial.pop(fd, b"") + chunk
        *lines, rest = data.split(b"\n")
        if rest:
            self._partial[fd] = rest
        if lines:
            self._emit(rank, is_err, lines)
        return True

    def drain(self) -> None:
        """Read whatever output is already in the pipes (ranks flush before replying)."""
        while True:
            ready = wait(self.connections(), timeout=0)
            if not ready:
                return
            for conn in ready:
                self.read(conn)

    def close(self) -> None:
        """Print any unfinished lines and close every pipe."""
        self._flush()
        for _rank, conn, _err in self._pipes.values():
            conn.close()
        self._pipes, self._partial = {}, {}

    def _emit(self, rank: int, is_err: bool, lines: list[bytes]) -> None:
        prefix = f"[rank {rank}] "
        text = "".join(prefix + line.decode("utf-8", "replace") + "\n" for line in lines)
        stream = sys.stderr if is_err else sys.stdout
        stream.write(text)
        stream.flush()

    def _flush(self, fd: int | None = None) -> None:
        for key in [fd] if fd is not None else list(self._partial):
            rest = self._partial.pop(key, b"")
            if rest and key in self._pipes:
                rank, _conn, is_err = self._pipes[key]
                self._emit(rank, is_err, [rest])


__all__ = ["RankOutput"]
