"""Worker output: a size-rotated log file per worker, the last lines in memory, passthrough.

The worker's stdout and stderr share one pipe; ``pump()`` reads it without blocking the loop.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import anyio

TAIL_LINES = 200
_READ_SIZE = 65536
_MAX_LINE = 16384  # an unterminated line longer than this is cut for the in-memory tail


class RotatingFile:
    """Append-only file rotated by size: ``x.log`` -> ``x.log.1`` ... ``x.log.<backups>``."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fh: BinaryIO | None = None
        self._size = 0
        self.write_errors = 0
        self.failing = False
        #: Called with the error on the first failed write of a run of failures, and with None
        #: on the first good write after it (write-failure reporting).
        self.on_health: Callable[[OSError | None], None] | None = None

    def _open(self) -> BinaryIO:
        if self._fh is None:
            try:
                self._fh = open(self.path, "ab")  # noqa: SIM115 - kept open across writes
            except FileNotFoundError:  # first use, or the directory was removed
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "ab")  # noqa: SIM115
            self._size = self._fh.tell()
        return self._fh

    def _rotate(self) -> None:
        self.close()
        if self.backups <= 0:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.path.exists():
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def write(self, data: bytes) -> None:
        """Append ``data``, rotating first when it would pass ``max_bytes``."""
        try:
            if self.max_bytes and self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            fh = self._open()
            fh.write(data)
            fh.flush()
            self._size += len(data)
        except OSError as exc:
            # A full or read-only disk must not stop supervision; the tail stays in memory.
            self.write_errors += 1
            self.close()
            if not self.failing:
                self.failing = True
                if self.on_health is not None:
                    self.on_health(exc)
        else:
            if self.failing:
                self.failing = False
                if self.on_health is not None:
                    self.on_health(None)

    def close(self) -> None:
        """Close the file (it is reopened on the next write)."""
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None


class WorkerOutput:
    """One worker's output sink, kept across its restarts."""

    def __init__(
        self,
        name: str,
        log_path: Path,
        max_bytes: int,
        backups: int,
        passthrough: bool = False,
        stdout: Callable[[bytes], object] | None = None,
    ) -> None:
        self.name = name
        self.file = RotatingFile(log_path, max_bytes, backups)
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.passthrough = passthrough
        self._partial = b""
        self._stdout = stdout or _write_stdout
        self._prefix = f"[{name}] ".encode()
        #: Called with every complete line of output (the sticky-error patterns watch it).
        self.on_line: Callable[[str], None] | None = None

    def feed(self, data: bytes) -> None:
        """Take a chunk of output."""
        self.file.write(data)
        buf = self._partial + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            text = line.decode("utf-8", errors="replace")
            self.tail.append(text)
            if self.on_line is not None:
                self.on_line(text)
            if self.passthrough:
                self._stdout(self._prefix + line + b"\n")
        if len(rest) > _MAX_LINE:
            self.tail.append(rest[:_MAX_LINE].decode("utf-8", errors="replace"))
            rest = b""
        self._partial = rest

    def flush_partial(self) -> None:
        """The pipe closed: keep an unterminated last line too."""
        if self._partial:
            self.tail.append(self._partial.decode("utf-8", errors="replace"))
            if self.passthrough:
                self._stdout(self._prefix + self._partial + b"\n")
            self._partial = b""

    def mark(self, text: str) -> None:
        """Write a supervisor line (start/exit markers) into the log file and the tail."""
        self.flush_partial()
        line = f"--- gpu-supervisor: {text} ---"
        self.file.write(line.encode() + b"\n")
        self.tail.append(line)

    def lines(self) -> list[str]:
        """The last lines, oldest first."""
        return list(self.tail)

    def close(self) -> None:
        """Close the log file."""
        self.file.close()

    async def pump(self, fd: int) -> None:
        """Copy the pipe ``fd`` into this sink until EOF; closes ``fd``."""
        try:
            while True:
                try:
                    data = os.read(fd, _READ_SIZE)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not data:
                    break
                self.feed(data)
        finally:
            self.flush_partial()
            os.close(fd)


def _write_stdout(data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
