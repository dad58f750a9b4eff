"""Rank output in the notebook: each rank's stdout and stderr arrive through pipes and are
printed in the running cell with a ``[rank r]`` prefix per line.

Whole lines are printed as they come. A partial line (a prompt, a progress bar redrawn with
``\\r`` as tqdm does) is printed once no more of it has arrived for a moment, so it shows
live in the cell that printed it; a ``\\r`` keeps its meaning (the line is redrawn, prefix
included).
"""

from __future__ import annotations

import codecs
import os
import re
import sys
import time
from multiprocessing.connection import wait
from typing import Any

PARTIAL_DELAY_S = 0.05  # how long a partial line may wait for the rest of it
_PIECES = re.compile(r"(\r\n|\n|\r)")


class RankOutput:
    """The read ends of every rank's stdout and stderr pipes, multiplexed into this
    process's ``sys.stdout`` / ``sys.stderr`` with a ``[rank r]`` prefix per line."""

    def __init__(self) -> None:
        self._pipes: dict[int, tuple[int, Any, bool]] = {}  # fd -> (rank, connection, is stderr)
        self._decoders: dict[int, Any] = {}
        self._partial: dict[int, tuple[str, float]] = {}  # fd -> (text, when it arrived)
        self._open: int | None = None  # fd whose line was printed without its end yet

    def add(self, rank: int, conn: Any, is_err: bool) -> None:
        self._pipes[conn.fileno()] = (rank, conn, is_err)
        self._decoders[conn.fileno()] = codecs.getincrementaldecoder("utf-8")("replace")

    def connections(self) -> list[Any]:
        """What to wait on (alongside the ranks' control pipes)."""
        return [conn for (_rank, conn, _err) in self._pipes.values()]

    def pending(self) -> bool:
        """Is a partial line waiting to be shown?"""
        return bool(self._partial)

    def read(self, conn: Any) -> bool:
        """Read what is ready on ``conn`` and print its complete lines; False at EOF."""
        fd = conn.fileno()
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._show_partial(fd)
            self._pipes.pop(fd, None)
            self._decoders.pop(fd, None)
            conn.close()
            return False
        text = self._decoders[fd].decode(chunk)
        old, since = self._partial.pop(fd, ("", time.monotonic()))
        text = old + text
        cut = max(text.rfind("\n"), -1) + 1
        if cut:
            self._write(fd, text[:cut])
        if text[cut:]:
            self._partial[fd] = (text[cut:], since)
        return True

    def flush_partials(self, older_than: float = PARTIAL_DELAY_S) -> None:
        """Show partial lines that have waited ``older_than`` seconds for their end."""
        now = time.monotonic()
        for fd, (_text, since) in list(self._partial.items()):
            if now - since >= older_than:
                self._show_partial(fd)

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
        for fd in list(self._partial):
            self._show_partial(fd)
        self._end_open_line()
        for _rank, conn, _err in self._pipes.values():
            conn.close()
        self._pipes, self._partial, self._decoders = {}, {}, {}

    def _show_partial(self, fd: int) -> None:
        text, _since = self._partial.pop(fd, ("", 0.0))
        if text and fd in self._pipes:
            self._write(fd, text)

    def _end_open_line(self) -> None:
        if self._open is not None and self._open in self._pipes:
            stream = sys.stderr if self._pipes[self._open][2] else sys.stdout
            stream.write("\n")
            stream.flush()
        self._open = None

    def _write(self, fd: int, text: str) -> None:
        rank, _conn, is_err = self._pipes[fd]
        if self._open is not None and self._open != fd:
            self._end_open_line()  # another rank's unfinished line: end it, start ours
        prefix = f"[rank {rank}] "
        out = []
        at_start = self._open != fd
        for piece in _PIECES.split(text):
            if piece in ("\n", "\r\n"):
                out.append((prefix if at_start else "") + "\n")
                at_start = True
            elif piece == "\r":
                out.append("\r")
                at_start = True
            elif piece:
                out.append((prefix if at_start else "") + piece)
                at_start = False
        self._open = None if at_start else fd
        stream = sys.stderr if is_err else sys.stdout
        stream.write("".join(out))
        stream.flush()


__all__ = ["RankOutput"]
