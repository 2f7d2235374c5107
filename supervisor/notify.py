"""The workers' notify socket: the sd_notify datagram protocol on a unix socket.

Workers get its path in ``NOTIFY_SOCKET`` and send ``READY=1``, ``WATCHDOG=1``, ``STATUS=...``
or ``STOPPING=1`` datagrams, exactly as to systemd. The sender is identified by the kernel
(``SO_PASSCRED``), and a message from any descendant of a worker counts for that worker.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import psutil

_UCRED = struct.Struct("iII")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }
MAX_DATAGRAM = 4096
#: sun_path holds 108 bytes including the NUL.
MAX_SOCKET_PATH = 107


@dataclass(frozen=True, slots=True)
class NotifyMessage:
    """One datagram: the sender's pid and its ``KEY=value`` assignments."""

    pid: int
    fields: Mapping[str, str]


def parse_datagram(data: bytes) -> dict[str, str]:
    """Parse newline-separated ``KEY=value`` lines; lines without ``=`` are ignored."""
    out: dict[str, str] = {}
    for line in data.decode("utf-8", errors="replace").split("\n"):
        key, sep, value = line.partition("=")
        if sep and key:
            out[key] = value
    return out


def socket_path_for(state_dir: Path) -> Path:
    """``state_dir/notify.sock`` when that fits in ``sun_path``, else a fresh private temp dir."""
    candidate = (state_dir / "notify.sock").absolute()
    if len(os.fsencode(candidate)) <= MAX_SOCKET_PATH:
        return candidate
    return Path(tempfile.mkdtemp(prefix="gpu-supervisor-")) / "notify.sock"


def ancestors_of(pid: int, limit: int = 64) -> list[int]:
    """``pid`` and its ancestors, nearest first (stops at pid 1 or an unreadable process)."""
    chain = [pid]
    current = pid
    for _ in range(limit):
        try:
            parent = psutil.Process(current).ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            break
        if parent <= 1 or parent in chain:
            break
        chain.append(parent)
        current = parent
    return chain


class NotifyListener:
    """Owns the socket; ``serve()`` delivers messages to ``on_message`` until cancelled."""

    def __init__(self, path: Path, on_message: Callable[[NotifyMessage], None]) -> None:
        self.path = path
        self._on_message = on_message
        self._sock: socket.socket | None = None

    def open(self) -> None:
        """Bind the socket (removing a stale one) with SO_PASSCRED on."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(os.fspath(self.path))
        os.chmod(self.path, 0o600)
        sock.setblocking(False)
        self._sock = sock

    def rebind(self) -> None:
        """Bind a fresh socket at the same path (its file was removed, e.g. with state_dir).

        Workers keep their ``NOTIFY_SOCKET``; the serving loop moves to the new socket.
        """
        old = self._sock
        self._sock = None
        self.open()
        if old is not None:
            anyio.notify_closing(old)
            old.close()

    def bound(self) -> bool:
        """True while the socket file still exists at ``path``."""
        return self._sock is not None and self.path.is_socket()

    def close(self) -> None:
        """Close and remove the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def drain(self) -> int:
        """Read every queued datagram without blocking; return how many were read."""
        sock = self._sock
        if sock is None:
            return 0
        count = 0
        while True:
            try:
                data, ancdata, _, _ = sock.recvmsg(MAX_DATAGRAM, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return count
            count += 1
            pid = 0
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack(payload[: _UCRED.size])[0]
            if pid > 0:
                self._on_message(NotifyMessage(pid, parse_datagram(data)))

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver messages as they arrive."""
        if self._sock is None:
            self.open()
        assert self._sock is not None
        task_status.started()
        try:
            while True:
                sock = self._sock
                if sock is None:
                    return
                try:
                    await anyio.wait_readable(sock)
                except anyio.ClosedResourceError:
                    continue  # rebound: wait on the new socket
                self.drain()
        finally:
            self.close()
