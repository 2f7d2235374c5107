"""sd_notify for the example workers (stdlib only): the datagram protocol systemd uses."""

from __future__ import annotations

import os
import socket


def notify(message: str) -> None:
    """Send one datagram (``READY=1``, ``WATCHDOG=1``, ``STATUS=...``) if a supervisor listens."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)
