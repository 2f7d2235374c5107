"""The workers' notify socket: the sd_notify datagram protocol on a unix socket.

Workers get its path in ``NOTIFY_SOCKET`` and send ``READY=1``, ``WATCHDOG=1``, ``STATUS=...``,
``STOPPING=1``, ``EXTEND_TIMEOUT_USEC=...`` or ``WATCHDOG_USEC=...`` datagrams, exactly as to
systemd (README.md, "Worker lifecycle", says what each field does here). The sender is
identified by the kernel (``SO_PASSCRED``), and a message from any descendant of a worker counts
for that worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import socket
import stat
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc

_UCRED = struct.Struct("iII")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }
MAX_DATAGRAM = 4096
#: Datagrams read at most each time the socket is found readable.
PER_WAKE = 64
#: sun_path holds 108 bytes including the NUL.
MAX_SOCKET_PATH = 107


@dataclass(frozen=True, slots=True)
class NotifyMessage:
    """One datagram: the sender's pid and its ``KEY=value`` assignments."""

    pid: int
    fields: Mapping[str, str]


def parse_datagram(data: bytes, *, cut: bool = False) -> dict[str, str]:
    """Parse newline-separated ``KEY=value`` lines; lines without ``=`` are ignored.

    ``cut``: ``data`` is the start of a longer datagram, so its last line is not whole (a
    number in it would be another number): it is ignored too.
    """
    out: dict[str, str] = {}
    lines = data.decode("utf-8", errors="replace").split("\n")
    for line in lines[:-1] if cut else lines:
        key, sep, value = line.partition("=")
        if sep and key:
            out[key] = value
    return out


def parse_usec(value: str) -> int | None:
    """A microseconds field (``EXTEND_TIMEOUT_USEC``, ``WATCHDOG_USEC``): an unsigned 64-bit
    decimal as systemd takes it, else None (signs, spaces, underscores, other digits)."""
    if not value or len(value) > 20 or not (value.isascii() and value.isdigit()):
        return None
    usec = int(value)
    return usec if usec < 2**64 else None


#: The mode of the private directory in /tmp that holds the socket where ``state_dir``'s path
#: is too long for one (as ``tempfile.mkdtemp`` makes it).
PRIVATE_DIR_MODE = 0o700


#: The private directory's name: the pid of the supervisor that made it, then
#: ``tempfile.mkdtemp``'s 8 characters (before 2026-12-07: ``gpu-supervisor-`` and those alone),
#: so that the directory a supervisor killed with SIGKILL left is known as such by the next.
PRIVATE_DIR_PREFIX = "gpu-supervisor-"
_PRIVATE_DIR_NAME = re.compile(r"gpu-supervisor-([1-9][0-9]{0,9})-[a-z0-9_]{8}")


def socket_path_for(state_dir: Path, *, create: bool = True) -> Path:
    """``state_dir/notify.sock`` when that fits in ``sun_path``, else a fresh private temp dir.

    ``create=False`` (a check, which binds nothing): that temp dir is not made, a path of
    that shape is returned (regression: ``check-config`` left one behind at every run)."""
    candidate = (state_dir / "notify.sock").absolute()
    if len(os.fsencode(candidate)) <= MAX_SOCKET_PATH:
        return candidate
    if not create:
        return Path(tempfile.gettempdir()) / "gpu-supervisor-PID-XXXXXXXX" / "notify.sock"
    return private_socket_path()


def private_socket_path() -> Path:
    """``notify.sock`` in a fresh private directory of the temporary directory (``TMPDIR``),
    or of ``/tmp`` where that path would be too long for a socket too (regression: the bind
    failed, and the supervisor ended with a traceback)."""
    prefix = f"{PRIVATE_DIR_PREFIX}{os.getpid()}-"
    path = Path(tempfile.mkdtemp(prefix=prefix)) / "notify.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    path.parent.rmdir()
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")) / "notify.sock"


def remove_leftover_private_dirs(roots: Iterable[str] | None = None) -> list[Path]:
    """Remove the private directories (:func:`private_socket_path`) that supervisors ended
    before they could remove their own (SIGKILL) left in the temporary directory and
    ``/tmp`` (``roots``); return those removed. Only a directory named as ours after a pid
    that no process has, this user's own (not a link: never followed), holding nothing but a
    socket ``notify.sock`` that nobody serves; anything else there is left as it is."""
    removed: list[Path] = []
    where = (tempfile.gettempdir(), "/tmp")  # noqa: S108 (where private_socket_path makes them)
    for root in dict.fromkeys(roots if roots is not None else where):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            found = _PRIVATE_DIR_NAME.fullmatch(name)
            if found is None or _alive(int(found[1])):
                continue
            with contextlib.suppress(OSError):  # gone meanwhile, not a directory, a link...
                if _remove_leftover(root, name):
                    removed.append(Path(root, name))
    return removed


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (this one, or another user's, included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def _remove_leftover(root: str, name: str) -> bool:
    """Remove ``root/name`` if it is a leftover private directory (see the caller)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
                return False
            entries = os.listdir(fd)
            if entries not in ([], ["notify.sock"]):
                return False
            if entries:
                sock = os.stat("notify.sock", dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISSOCK(sock.st_mode) or sock.st_uid != st.st_uid:
                    return False
                if answers(Path(root, name, "notify.sock")):
                    return False  # served (a supervisor in another pid namespace)
                os.unlink("notify.sock", dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=root_fd)  # (a link put in its place meanwhile: ENOTDIR)
    finally:
        os.close(root_fd)
    return True


#: The socket workers that run as another user (``[[workers]] user``) are given:
#: ``state_dir/shared/notify.sock``, in a directory of its own that anyone may pass through but
#: not list, writable by everyone (it takes messages only from workers' processes, told apart
#: by the sender's pid, as systemd's own notify socket does). ``state_dir`` gets the same
#: pass-through bit (its files keep their own modes). Not in ``/tmp``: a temporary-file cleaner
#: removes it there, and anyone may create the directory's name again before it is rebound.
SHARED_DIR = "shared"
SHARED_DIR_MODE = 0o711
SHARED_SOCKET_MODE = 0o666


def shared_socket_path(state_dir: Path) -> Path | str:
    """``state_dir/shared/notify.sock``, or why workers of another user cannot be given it."""
    path = state_dir.absolute() / SHARED_DIR / "notify.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        return f"the shared notify socket's path {os.fspath(path)!r} is too long for a socket"
    return path


def others_may_replace(directory: Path) -> str | None:
    """Why a user other than root and this process's could replace what is in ``directory``
    (it, or a directory above it, is theirs, or writable by group or others without the
    sticky bit: /tmp is safe, a state_dir owned by the workers' user is not); None: nobody."""
    euid = os.geteuid()
    for d in (directory, *directory.parents):
        try:
            st = os.lstat(d)
        except OSError as exc:
            return f"{d}: {exc.strerror or exc}"
        if stat.S_ISLNK(st.st_mode):
            d = Path(os.path.realpath(d))
            try:
                st = os.stat(d)
            except OSError as exc:
                return f"{d}: {exc.strerror or exc}"
        if st.st_uid not in (0, euid):
            return f"{d} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{d} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by others"
    return None


def _own_directory(path: Path, mode: int) -> None:
    """Give ``path`` ``mode`` if it is a directory of this user's own (not a link), else
    raise OSError: a directory someone else made at that name is never used."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{path} belongs to uid {st.st_uid}: not used")
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def answers(path: Path) -> bool:
    """True when a socket bound at ``path`` has a live listener (another supervisor serves
    it); False for a stale file (its supervisor was killed), none, or anything else there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(os.fspath(path))  # sends nothing
        except OSError:
            return False
    return True


class NotifyListener:
    """Owns the socket; ``serve()`` delivers messages to ``on_message`` until cancelled."""

    def __init__(
        self,
        path: Path,
        on_message: Callable[[NotifyMessage], None],
        *,
        mode: int = 0o600,
        dir_mode: int | None = None,
        accepts: Callable[[int], bool] | None = None,
    ) -> None:
        """``mode``: the socket file's (who may send); ``dir_mode``: given to its directory
        at every :meth:`open`, which must then be this user's own (None: left as it is);
        ``accepts``: which sender uids are read at all (None: any; the others are dropped
        before anything is looked up about their pid)."""
        self.path = path
        self.mode = mode
        self.dir_mode = dir_mode
        self.accepts = accepts
        self.dropped = 0  # datagrams of senders ``accepts`` refused
        self._inode: tuple[int, int] | None = None
        self._dir_inode: tuple[int, int] | None = None  # of the directory it was bound in
        self._on_message = on_message
        self._sock: socket.socket | None = None
        #: serving on asyncio: its loop, the fd its reader watches, and where errors go
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: int | None = None
        self._failed: asyncio.Future[None] | None = None
        self._serving = False

    def open(self) -> None:
        """Bind the socket (removing a stale one) with SO_PASSCRED on."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.dir_mode is not None:
            _own_directory(self.path.parent, self.dir_mode)
        with contextlib.suppress(OSError):  # gone, or a state_dir turned read-only
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(os.fspath(self.path))
        os.chmod(self.path, self.mode)
        st = os.lstat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        st = os.stat(self.path.parent)
        self._dir_inode = (st.st_dev, st.st_ino)
        sock.setblocking(False)
        self._sock = sock

    def rebind(self) -> None:
        """Bind a fresh socket at the same path (its file was removed, e.g. with state_dir).

        Workers keep their ``NOTIFY_SOCKET``; the serving loop moves to the new socket.
        """
        old = self._sock
        self._sock = None
        try:
            self.open()
        except BaseException:
            self._sock = old  # nothing changed (its file is gone: the caller says why)
            raise
        self._unwatch()
        if self._loop is not None and self._sock is not None:
            self._watch(self._sock)
        if old is not None:
            anyio.notify_closing(old)
            old.close()

    def bound(self) -> bool:
        """True while the socket file this listener bound is still at ``path``."""
        if self._sock is None:
            return False
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._inode

    def lost(self) -> bool:
        """True while this listener is open but its socket file alone is gone from ``path``
        (removed, or another in its place; the directory still the one it was bound in, not
        one made anew): :meth:`rebind` it. With a directory of its own (``dir_mode``: the
        private one in /tmp), whenever its socket is not bound there: the directory too may be
        gone (a temporary-file cleaner), or made again by a rebind that then failed, and the
        rebind makes it again as its own or refuses one someone else made."""
        if self._sock is None or self.bound():
            return False
        if self.dir_mode is not None:
            return True
        try:
            st = os.stat(self.path.parent)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._dir_inode

    def close(self) -> None:
        """Close and remove the socket (a ``serve()`` in progress returns)."""
        self._unwatch()
        if self._failed is not None and not self._failed.done():
            self._failed.set_result(None)
        if self._serving and self._loop is None and self._sock is not None:
            anyio.notify_closing(self._sock)  # wake the waiting loop (it then returns)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(OSError):  # gone, or a state_dir turned read-only
            self.path.unlink()

    def drain(self, limit: int | None = None) -> int:
        """Read the queued datagrams without blocking (``limit``: at most that many); return
        how many were read."""
        sock = self._sock
        if sock is None:
            return 0
        count = 0
        while limit is None or count < limit:
            try:
                data, ancdata, flags, _ = sock.recvmsg(MAX_DATAGRAM, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return count
            count += 1
            pid = uid = 0
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid, uid, _ = _UCRED.unpack(payload[: _UCRED.size])
            if self.accepts is not None and not self.accepts(uid):
                self.dropped += 1
                continue
            if pid > 0:
                fields = parse_datagram(data, cut=bool(flags & socket.MSG_TRUNC))
                self._on_message(NotifyMessage(pid, fields))
        return count

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver messages as they arrive (an error in ``on_message`` ends this task).

        Runs until cancelled or :meth:`close`; one at a time.
        """
        if self._serving:
            raise RuntimeError("this notify socket is already being served")
        if self._sock is None:
            self.open()
        assert self._sock is not None
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # another anyio backend
            loop = None
        self._serving = True
        task_status.started()
        try:
            if loop is not None:
                await self._serve_with_reader(loop)
            else:
                await self._serve_waiting()
        finally:
            self._serving = False
            self.close()

    async def _serve_with_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """On asyncio: one reader callback for as long as the socket lives.

        ``anyio.wait_readable`` adds the socket to the event loop's epoll set and removes it
        again for every wake-up: each datagram (a heartbeat, an in-use report) then costs about
        twice the CPU (``docs/benchmarks.md``).
        """
        self._loop = loop
        self._failed = loop.create_future()
        assert self._sock is not None
        self._watch(self._sock)
        try:
            await self._failed  # only an error in on_message ends it (or cancellation)
        finally:
            self._unwatch()
            self._loop = self._failed = None

    async def _serve_waiting(self) -> None:
        while True:
            sock = self._sock
            if sock is None:
                return
            try:
                await anyio.wait_readable(sock)
            except anyio.ClosedResourceError:
                continue  # rebound: wait on the new socket
            self.drain(PER_WAKE)

    def _on_readable(self) -> None:
        try:
            # at most a batch a wake-up: a worker that floods the socket must not keep the
            # event loop in this callback (the socket stays readable: the loop comes back)
            self.drain(PER_WAKE)
        except BaseException as exc:  # hand it to serve(), as the waiting loop would raise it
            self._unwatch()
            if self._failed is not None and not self._failed.done():
                self._failed.set_exception(exc)

    def _watch(self, sock: socket.socket) -> None:
        assert self._loop is not None
        self._watched = sock.fileno()
        self._loop.add_reader(self._watched, self._on_readable)

    def _unwatch(self) -> None:
        if self._loop is not None and self._watched is not None:
            self._loop.remove_reader(self._watched)
        self._watched = None
