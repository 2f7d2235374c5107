"""Writing to a stream whose reader may stop reading, without waiting on it for long.

The supervisor's stderr (its log) and stdout (worker output passed through) lead to readers it
does not control: a terminal paused with Ctrl-S or an ssh session whose network stalled, a
``| grep`` that was stopped, a container log shim or a journald stream that hangs. A blocking
``write()`` to a full pipe or terminal waits until the reader reads again, and the event loop
with it: no crash handled, no API answer, no restart.

The descriptor itself is not made non-blocking: ``O_NONBLOCK`` belongs to the open file, shared
with the shell or the service manager that handed it over, and would change under them. So:

* a pipe, a FIFO or a terminal is opened a second time through ``/proc/self/fd/N`` with
  ``O_NONBLOCK``: a file description of our own on the same pipe or terminal, whose writes
  answer ``EAGAIN`` instead of waiting (``poll()`` alone does not do: a terminal polls
  writable with a few bytes of room, and a write of more then blocks until it has them all);
* a socket (journald's stream) is written with ``send(MSG_DONTWAIT)``;
* a regular file or another device is written as it is (a full disk is an error, not a wait);
* where the second open is refused, each piece of at most ``PIPE_BUF`` waits for ``poll()``.

A write waits for room at most the time it is given; what does not fit then is left to the
caller, which drops it, counts it and says so once the stream takes bytes again. A stream that
cut a write short or made one wait ``CONGESTED_AFTER_S`` or more is *congested*: the writes
after it do not wait at all until one goes through at once, so a reader that is only slow (a
page now and then) costs dropped lines, not an event loop held most of the time.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import stat
import time

#: The most a write waits for a stream that takes nothing (see the module's docstring): long
#: enough for a burst of lines or a busy journald, short enough not to be noticed elsewhere.
STALL_WAIT_S = 0.25
#: A write that waited this long for room marks the stream congested (see the docstring).
CONGESTED_AFTER_S = 0.05
#: The piece written at once where only ``poll()`` can tell: a pipe that polls writable has
#: room for at least this much.
PIECE = select.PIPE_BUF


class UnblockedWriter:
    """Writes to descriptor ``fd`` that wait at most as long as they are told."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.congested = False
        self._how: str | None = None  # "plain", "own", "socket", "poll": chosen at first use
        self._own: int | None = None  # our non-blocking description of the same pipe/tty
        self._sock: socket.socket | None = None

    def write(self, data: bytes, wait_s: float) -> int:
        """Write ``data`` as far as the reader takes it within ``wait_s`` (0 while congested);
        return the bytes written. An error (``EPIPE`` where the reader is gone, ``ENOSPC``) is
        raised when nothing was written; after a part, the part's length is returned (the
        next write meets the error again)."""
        if self._how is None:
            self._choose()
        if self._how == "plain":
            return _write_all(self.fd, data)
        start = time.monotonic()
        deadline = start + (0.0 if self.congested else wait_s)
        full = False  # the stream was found full at least once
        written = 0
        with memoryview(data) as view:
            while written < len(view):
                try:
                    written += self._put(view[written:])
                    continue
                except BlockingIOError:
                    pass
                except OSError:
                    if written:
                        break
                    raise
                full = True
                left = deadline - time.monotonic()
                if left <= 0 or not self._wait(left):
                    break
        # congested: the write had to be cut, or waited long (a reader that is only slow); a
        # pipe that was full for a moment (a burst, a reader thread that was not scheduled)
        # is not, and the next write may wait for it again
        self.congested = full and (
            written < len(data) or time.monotonic() - start >= CONGESTED_AFTER_S
        )
        return written

    def close(self) -> None:
        """Release what was opened for the writes (the descriptor itself is the caller's)."""
        if self._own is not None:
            with contextlib.suppress(OSError):
                os.close(self._own)
            self._own = None
        if self._sock is not None:
            self._sock.close()  # a duplicate of the descriptor, not the descriptor
            self._sock = None
        self._how = None

    # --- internals ----------------------------------------------------------------------

    def _choose(self) -> None:
        mode = os.fstat(self.fd).st_mode
        if stat.S_ISSOCK(mode):
            try:
                self._sock = socket.socket(fileno=os.dup(self.fd))
                self._how = "socket"
            except OSError:
                self._how = "poll"
        elif stat.S_ISFIFO(mode) or os.isatty(self.fd):
            flags = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
            try:
                self._own = os.open(f"/proc/self/fd/{self.fd}", flags)
                self._how = "own"
            except OSError:  # no /proc, or a pipe with no reader (ENXIO): the write says so
                self._how = "poll"
        else:
            self._how = "plain"

    def _put(self, view: memoryview) -> int:
        """One write without waiting (BlockingIOError: no room now)."""
        if self._how == "own":
            assert self._own is not None
            return os.write(self._own, view)
        if self._how == "socket":
            assert self._sock is not None
            return self._sock.send(view, socket.MSG_DONTWAIT)
        if not _poll(self.fd, 0):  # "poll": a piece that fits, once there is room
            raise BlockingIOError(errno.EAGAIN, "no room")
        return os.write(self.fd, view[:PIECE])

    def _wait(self, seconds: float) -> bool:
        fd = self._own if self._own is not None else self.fd
        return _poll(fd, seconds)


def _poll(fd: int, seconds: float) -> bool:
    """``fd`` has room for a write (or an error to report) within ``seconds``."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(int(seconds * 1000)))


def _write_all(fd: int, data: bytes) -> int:
    """A regular file or a device: written as it is (errors after a part: that part)."""
    written = 0
    with memoryview(data) as view:
        while written < len(view):
            try:
                more = os.write(fd, view[written:])
            except OSError:
                if written:
                    break
                raise
            if more <= 0:
                break
            written += more
    return written
