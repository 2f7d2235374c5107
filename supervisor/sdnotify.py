"""sd_notify to the supervisor's own service manager (systemd ``Type=notify``).

The socket is non-blocking: the event loop never waits on the manager. A datagram the manager's
queue has no room for (``EAGAIN``: a busy manager, or a host whose ``net.unix.max_dgram_qlen``
is the kernel's 10 and a start-up's ``STATUS=`` lines filled it) is lost, which is fine for
``STATUS=`` and ``WATCHDOG=1`` (the next one says the same) but not for ``READY=1``,
``RELOADING=1`` or ``STOPPING=1``: systemd would time the start out, or a reload. Those are sent
with ``keep=True``: one that does not get through is kept and sent again by ``flush()``, in
order (the runtime retries while any is kept).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import MutableMapping

#: Send errors that may clear up (the manager's queue is full), as opposed to a manager gone.
RETRY_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR})


class SystemdNotifier:
    """Sends ``READY=1``, ``WATCHDOG=1`` and ``STATUS=`` to ``NOTIFY_SOCKET`` when it is set."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        address = environ.get("NOTIFY_SOCKET", "")
        self.watchdog_usec = 0
        usec = environ.get("WATCHDOG_USEC", "")
        watchdog_pid = environ.get("WATCHDOG_PID", "")
        if (
            usec.isascii()
            and usec.isdigit()
            and (not watchdog_pid or watchdog_pid == str(os.getpid()))
        ):
            self.watchdog_usec = int(usec)
        self._address: str | None = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        self._last_status = ""
        #: Messages the manager must get that found its queue full, oldest first.
        self.pending: list[str] = []

    @property
    def enabled(self) -> bool:
        """True when a service manager listens."""
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1 (half the manager's timeout), or None."""
        return self.watchdog_usec / 2_000_000 if self.watchdog_usec else None

    def send(self, message: str, *, keep: bool = False) -> bool:
        """Send one datagram; errors are swallowed (the manager may be gone) and return False.
        ``keep``: where the manager's queue is full, keep it for ``flush()`` (and anything
        kept before it goes first: the manager gets them in order)."""
        if self._address is None:
            return False
        if keep and self.pending:
            self.pending.append(message)
            return self.flush()
        error = self._send(message)
        if error in RETRY_ERRNOS and keep:
            self.pending.append(message)
        return error is None

    def flush(self) -> bool:
        """Send the kept messages, in order, as far as the manager takes them; True when none
        is left. One the manager cannot get at all (it is gone) is dropped."""
        while self.pending:
            error = self._send(self.pending[0])
            if error in RETRY_ERRNOS:
                return False
            del self.pending[0]
        return True

    def _send(self, message: str) -> int | None:
        """Send ``message``: None, or the errno of the failure."""
        assert self._address is not None
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(message.encode(), self._address)
        except OSError as exc:
            return exc.errno if exc.errno is not None else errno.EIO
        return None

    def status(self, text: str) -> None:
        """Send ``STATUS=text`` when it changed."""
        text = text.replace("\n", " ")
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def close(self) -> None:
        """Close the socket (after one last try at what is kept)."""
        if self._address is not None:
            self.flush()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
