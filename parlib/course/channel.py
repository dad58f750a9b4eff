"""The pipes between the batch grader and one notebook's grader process.

The grader process reports on a pipe the batch made and handed it as an inherited file
descriptor (never a file in the notebook's folder, which the notebook can write): one JSON
object a line, ``{"start": qid}`` before a re-check, ``{"row": row}`` after it and
``{"report": report}`` at the end. The batch reads it without ever blocking, a line at
most :data:`LINE_LIMIT` bytes (a longer one is dropped whole), invalid UTF-8 replaced, and
keeps only JSON objects: data, never code. The grader process's own stdout and stderr (the
kernel's among them) go to a second pipe, of which the batch keeps the last
:data:`OUTPUT_KEPT` bytes for the row, so nothing a notebook prints reaches the terminal.
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any, TypeVar

_Reader = TypeVar("_Reader", bound="PipeReader")

LINE_LIMIT = 1 << 20  # bytes in one line of the channel; the rows the grader sends are capped
OUTPUT_KEPT = 64 << 10  # bytes of the grader process's output kept for its row


class PipeReader:
    """The read end of a pipe (or a regular file), read without blocking."""

    def __init__(self, fd: int) -> None:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
            os.close(fd)
            raise ValueError("a grader's channel must be a pipe or a regular file")
        os.set_blocking(fd, False)
        self.fd: int | None = fd
        self.write_fd: int | None = None  # the child's end, while we hold it

    @classmethod
    def pipe(cls: type[_Reader]) -> _Reader:
        """A new pipe: this reader on its read end, :attr:`write_fd` its write end (for the
        child; :meth:`close_write` once the child has it, so the pipe ends with it)."""
        read, write = os.pipe()
        reader = cls(read)
        reader.write_fd = write
        return reader

    def close_write(self) -> None:
        if self.write_fd is not None:
            os.close(self.write_fd)
            self.write_fd = None

    def __enter__(self: _Reader) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_write()
        self.close()

    def read(self) -> bytes:
        """What has arrived since the last call (b"" when nothing); at the end of the
        stream the pipe is closed and :attr:`ended` is True."""
        chunks = []
        while self.fd is not None:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                break
            chunks.append(chunk)
        return b"".join(chunks)

    @property
    def ended(self) -> bool:
        return self.fd is None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def drain(self, within: float = 2.0) -> None:
        """Read until the writers have all gone (or ``within`` seconds)."""
        deadline = time.monotonic() + within
        while not self.ended and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.01)
        self.poll()
        self.close()

    def poll(self) -> None:
        raise NotImplementedError


class Channel(PipeReader):
    """The JSON lines a notebook's grader process sends; :attr:`items` the objects so far."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.items: list[dict[str, Any]] = []
        self.dropped = 0  # lines refused: too long, or not a JSON object
        self._partial = bytearray()
        self._skipping = False  # inside a line past the limit: dropped up to its newline

    def poll(self) -> None:
        data = self.read()
        while data:
            head, newline, data = data.partition(b"\n")
            if not self._skipping:
                self._partial += head
            if len(self._partial) > LINE_LIMIT:
                self._partial.clear()
                self._skipping = True
            if newline:
                if not self._skipping:
                    self._take(bytes(self._partial))
                else:
                    self.dropped += 1
                self._partial.clear()
                self._skipping = False

    def _take(self, line: bytes) -> None:
        try:
            item = json.loads(line.decode("utf-8", errors="replace"))
        except (ValueError, RecursionError):
            item = None
        if isinstance(item, dict):
            self.items.append(item)
        elif line.strip():
            self.dropped += 1

    def rows(self) -> list[dict[str, Any]]:
        """The rows the grader process finished, in order."""
        return [i["row"] for i in self.items if isinstance(i.get("row"), dict)]

    def current(self) -> str | None:
        """The question whose re-check runs now, if one does."""
        last = self.items[-1] if self.items else {}
        return str(last["start"]) if "start" in last else None

    def report(self) -> dict[str, Any] | None:
        """The report the grader process sent at its end, if it did."""
        for item in reversed(self.items):
            if isinstance(item.get("report"), dict):
                return item["report"]
        return None


class Output(PipeReader):
    """The grader process's stdout and stderr: the last :data:`OUTPUT_KEPT` bytes kept."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.kept = bytearray()
        self.total = 0

    def poll(self) -> None:
        data = self.read()
        self.total += len(data)
        self.kept += data
        del self.kept[:-OUTPUT_KEPT]

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


__all__ = ["LINE_LIMIT", "OUTPUT_KEPT", "Channel", "Output", "PipeReader"]
