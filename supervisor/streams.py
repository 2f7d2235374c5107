"""Writing to a stream whose reader may stop reading, without waiting on it for long.

The supervisor's stderr (its log) and stdout (worker output passed through) lead to readers it
does not control: a terminal paused with Ctrl-S, a ``| grep`` that was stopped, a container log
shim or a journald stream that hangs. A blocking ``write()`` to a full pipe waits until the
reader reads again, and the event loop with it: no crash handled, no API answer, no restart.

The descriptor is not made non-blocking: ``O_NONBLOCK`` belongs to the open file, shared with
the shell or the service manager that handed it over, and would change under them. Instead the
bytes go out in pieces of at most ``PIPE_BUF`` (4 KiB), each once ``poll()`` says there is room:
a pipe with room for one page takes such a piece whole, without blocking. When no room comes
within the wait, what is left is not written; the caller counts it and says so once the stream
takes bytes again. Regular files always poll writable (a full disk is an error, not a wait).
"""

from __future__ import annotations

import os
import select
import time

#: The most a write waits for a stream that takes nothing; after that the caller treats the
#: stream as stalled (and waits 0 until it takes bytes again). Long enough for a reader that is
#: only slow (a burst of lines, a busy journald), short enough not to be noticed elsewhere.
STALL_WAIT_S = 0.25
#: The piece written at once: a pipe that polls writable has room for at least this much.
PIECE = select.PIPE_BUF


def write_unblocked(fd: int, data: bytes, wait_s: float) -> int:
    """Write ``data`` to ``fd`` as far as the reader takes it within ``wait_s`` (in all);
    return the bytes written (all of them, or fewer when the stream stayed full). An error
    (``EPIPE`` where the reader is gone, ``ENOSPC``...) is raised as by ``os.write`` when
    nothing was written; after a part, the part's length is returned (the next write meets
    the error again)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    deadline = time.monotonic() + wait_s
    written = 0
    with memoryview(data) as view:
        while written < len(view):
            events = poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000))
            if not events:
                break  # full for the whole wait
            # only an error or hang-up: the write raises what is wrong (EPIPE, EBADF)
            size = 1 if not events[0][1] & select.POLLOUT else PIECE
            try:
                written += os.write(fd, view[written : written + size])
            except OSError:
                if written:
                    break
                raise
    return written
