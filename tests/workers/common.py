"""Helpers shared by the tiny test workers: sd_notify and line-buffered announcements."""

from __future__ import annotations

import os
import signal
import socket
import sys


def notify(message: str) -> None:
    """Send one sd_notify datagram to NOTIFY_SOCKET (if set)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)


def say(text: str) -> None:
    """Print ``<worker> <pid> <text>`` on stdout, flushed."""
    name = os.environ.get("GPU_SUPERVISOR_WORKER", "?")
    sys.stdout.write(f"{name} {os.getpid()} {text}\n")
    sys.stdout.flush()


def forever() -> None:
    """Sleep until a signal ends the process."""
    while True:
        signal.pause()
