"""sd_notify to the supervisor's own service manager (systemd ``Type=notify``)."""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping


class SystemdNotifier:
    """Sends ``READY=1``, ``WATCHDOG=1`` and ``STATUS=`` to ``NOTIFY_SOCKET`` when it is set."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        address = environ.get("NOTIFY_SOCKET", "")
        self.watchdog_usec = 0
        usec = environ.get("WATCHDOG_USEC", "")
        watchdog_pid = environ.get("WATCHDOG_PID", "")
        if usec.isdigit() and (not watchdog_pid or watchdog_pid == str(os.getpid())):
            self.watchdog_usec = int(usec)
        self._address: str | None = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        self._last_status = ""

    @property
    def enabled(self) -> bool:
        """True when a service manager listens."""
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1 (half the manager's timeout), or None."""
        return self.watchdog_usec / 2_000_000 if self.watchdog_usec else None

    def send(self, message: str) -> bool:
        """Send one datagram; errors are swallowed (the manager may be gone) and return False."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(message.encode(), self._address)
        except OSError:
            return False
        return True

    def status(self, text: str) -> None:
        """Send ``STATUS=text`` when it changed."""
        text = text.replace("\n", " ")
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def close(self) -> None:
        """Close the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
