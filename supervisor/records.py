"""Files in ``state_dir``: atomic writes, the post-mortem store, and write-failure tracking.

Every file is written to a temporary file in the same directory, fsynced, renamed over the old
one and the directory fsynced, so a reader (or a supervisor restarted after SIGKILL) sees the old
or the new content, never a torn one. A failed write (full disk, read-only or deleted
``state_dir``) is logged once per kind, counted and reported, and never stops supervision; the
next write tries again, so the records recover when the disk does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import structlog

from supervisor.errors import StateDirBusy
from supervisor.files import make_dir
from supervisor.model import finite
from supervisor.policy.ratelimit import RateLimit
from supervisor.policy.retention import WorkerLogs, to_remove, worker_of

#: Temporary files start with this and end in ``.tmp``; listings skip them, start-up removes them.
TMP_PREFIX = ".tmp-"
POSTMORTEM_DIR = "postmortems"
STATE_FILE = "state.json"
#: What the records are made with (less the umask): the service's user and group read them.
FILE_MODE = 0o640
LOCK_FILE = "lock"  # held by the running supervisor (flock), with its pid inside
INSTANCE_FILE = "instance"  # the state_dir's random id, in its workers' environment
CORDONS_FILE = "cordons"  # the GPUs an operator cordoned, one UUID a line
QUARANTINE_FILE = "quarantine"  # the GPUs quarantined in this boot, and why (JSON)
_INSTANCE = re.compile(r"^[0-9a-f]{32}$")

_ID = re.compile(r"^[0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[A-Za-z0-9._-]+$")

#: errno -> the kind of write failure it is.
_KINDS = {
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "disk_full",
    errno.EROFS: "read_only",
    errno.ENOENT: "missing",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
}

WRITE_FAILURE_KINDS = ("disk_full", "read_only", "missing", "permission", "no_thread", "other")

T = TypeVar("T")


class ThreadUnavailable(OSError):
    """No thread could be started for a blocking call: the pids cgroup (systemd ``TasksMax``)
    is full. An ``OSError`` (``EAGAIN``, what ``clone()`` failed with), so that it is handled
    like the other resource shortages: the call is skipped or retried, supervision goes on."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(errno.EAGAIN, f"cannot start a thread: {cause}")


async def in_thread(
    fn: Callable[..., T],
    *args: Any,
    limiter: anyio.CapacityLimiter | None = None,
    abandon_on_cancel: bool = False,
    inline: bool = False,
) -> T:
    """``anyio.to_thread.run_sync(fn, *args)``, but a thread that cannot be started raises
    ``ThreadUnavailable`` instead of ``RuntimeError: can't start new thread``, or, with
    ``inline``, ``fn`` runs right here on the event loop (for clean-up that must not need a
    new thread to finish). anyio's idle threads exit after 10 s, so a call may need a new
    thread at any time; a ``RuntimeError`` that ``fn`` itself raises passes through as it is.
    """
    started = False

    def call() -> T:
        nonlocal started
        started = True
        return fn(*args)

    try:
        return await anyio.to_thread.run_sync(
            call, limiter=limiter, abandon_on_cancel=abandon_on_cancel
        )
    except RuntimeError as exc:
        if started or "thread" not in str(exc):
            raise
        if inline:
            return fn(*args)
        raise ThreadUnavailable(exc) from exc


def failure_kind(exc: OSError) -> str:
    """``disk_full``, ``read_only``, ``missing``, ``permission``, ``no_thread`` or ``other``."""
    if isinstance(exc, ThreadUnavailable):
        return "no_thread"
    return _KINDS.get(exc.errno or 0, "other")


#: The most a record read back at start is allowed to be (``state.json`` of thousands of
#: workers is a few MiB): a file bigger than this was not written by the supervisor.
READ_LIMIT = 64 << 20


#: Why a record that is a symbolic link (``read_file(..., follow=False)``) was not read.
LINK_REFUSED = "a symbolic link: not followed"


def read_file(path: Path, limit: int = READ_LIMIT, *, follow: bool = True) -> bytes:
    """The bytes of the regular file ``path``; OSError for anything else.

    Opened without blocking and never through a FIFO, a device or a directory put in a record's
    place (``open()`` of a FIFO waits for a writer: the supervisor would hang at start), nor a
    file larger than ``limit`` (EFBIG); with ``follow`` False, not through a symbolic link
    either (ELOOP).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > limit:  # grew while read
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


#: What fsync of a directory answers on filesystems that cannot sync one (some network, FUSE
#: and shared-folder filesystems): the rename stands, as durable as that filesystem makes it.
DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it is durable (where its filesystem can)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # regression: counted as a failed write though the file was in place; a post-mortem
        # was then written again every 5 s under a new name, pruning the real ones
        if exc.errno not in DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync dir.

    On failure the temporary file is removed and the old content stays.
    """
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.tmp")
    try:
        # Made anew, never opened through a link someone put at this predictable name (a root
        # supervisor would truncate and overwrite the file it names): a leftover is removed,
        # and O_EXCL refuses whatever is put back in its place meanwhile.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def dump_json(doc: Any) -> bytes:
    """Pretty, stable JSON with a trailing newline, in UTF-8 (not ``\\uXXXX`` escapes: a log
    line of undecodable bytes would take 6 bytes for each)."""
    try:
        text = json.dumps(doc, indent=2, allow_nan=False, ensure_ascii=False) + "\n"
    except ValueError:  # a NaN or an infinity read somewhere: null, not a file never written
        text = json.dumps(finite(doc), indent=2, allow_nan=False, ensure_ascii=False) + "\n"
    return text.encode("utf-8", "replace")  # a lone surrogate (never from a log line) -> "?"


def lock_state_dir(state_dir: Path) -> int | None:
    """Hold an exclusive lock on ``state_dir/lock`` for the life of this process.

    Two supervisors on one ``state_dir`` would take each other's live workers for orphans of
    a killed predecessor and kill them, steal each other's notify socket and overwrite each
    other's records. Returns the lock's file descriptor (kept open: the lock ends with the
    process, however it ends), or None when the file cannot be opened (a missing ``state_dir``,
    or a read-only one without the file: records are degraded anyway; a read-only one with the
    file is locked through a read-only descriptor). Raises ``StateDirBusy`` naming the holder.
    """
    # never through a link: the pid would be written into whatever file it names
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(state_dir / LOCK_FILE, flags | os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        # A state_dir that went read-only (an error remount) while a supervisor runs there:
        # its lock file can still be locked read-only (regression: a second supervisor was
        # not refused, took the first one's live workers for orphans and killed them).
        try:
            fd = os.open(state_dir / LOCK_FILE, flags | os.O_RDONLY)
        except OSError:
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        busy = _busy(state_dir, fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None  # no locks on this filesystem
        raise busy from None
    write_lock_pid(fd)
    return fd


def _busy(state_dir: Path, fd: int) -> StateDirBusy:
    """The error for ``state_dir`` locked by another supervisor (``fd``: its lock file)."""
    # the first line only, as it is when a pid (regression: a lock file of several lines,
    # edited by hand or another tool's, made this error span several lines)
    lines = os.pread(fd, 32, 0).decode(errors="replace").strip().splitlines()
    first = lines[0].strip() if lines else ""
    holder = first if first.isascii() and first.isdigit() else repr(first) if first else None
    return StateDirBusy(
        f"supervisor.state_dir {state_dir} is in use by another gpu-supervisor "
        f"(pid {holder or 'unknown'}): give each supervisor a state_dir of its own"
    )


def check_state_dir_free(state_dir: Path) -> None:
    """Raise ``StateDirBusy`` when another supervisor holds ``state_dir``'s lock (nothing is
    locked, made or written: a look before reporting another error that it would cause)."""
    try:
        # (O_NONBLOCK: a FIFO in its place would block the open)
        fd = os.open(
            state_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        )
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise _busy(state_dir, fd) from None
    finally:
        os.close(fd)


def write_lock_pid(fd: int) -> bool:
    """Write our pid into the held lock file (what a refused second supervisor names); False
    when it could not be written (a full disk: try again later)."""
    try:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            # locked read-only (state_dir was read-only at start): written through a
            # writable description of the same file, once the disk takes writes again
            writable = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                return write_lock_pid(writable)
            finally:
                os.close(writable)
        os.ftruncate(fd, 0)
        data = f"{os.getpid()}\n".encode()
        return os.pwrite(fd, data, 0) == len(data)
    except OSError:
        return False


def instance_id(state_dir: Path, keep: str | None = None) -> str | None:
    """The random id of ``state_dir`` (``state_dir/instance``), made on first use; with
    ``keep``, that id is written back (``state_dir`` was removed and recreated). None when the
    file can be neither read nor written. A UUID spelled otherwise (dashes, upper case) is the
    same id; anything else in the file is replaced by a new id, with a warning."""
    path = state_dir / INSTANCE_FILE
    if keep is None:
        found: str | None = None
        try:
            found = read_file(path, 4096, follow=False).decode(errors="replace").strip()
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                # Regression: followed, so a link planted there gave this supervisor another
                # one's id, and it ended that one's workers as its own leftovers.
                structlog.get_logger().warning(
                    "records.instance_link",
                    path=os.fspath(path),
                    reason="a symbolic link: not followed; a new id is made in its place",
                )
        if found is not None and _INSTANCE.fullmatch(found):
            return found
        try:
            # A UUID in another spelling (dashes, upper case: by hand or another tool) is the
            # same id: written back as workers carry it (their marker is compared as it is),
            # so that a supervisor of any version reads the same id.
            same = uuid.UUID(found or "").hex
        except ValueError:
            if found is not None:  # regression: replaced without a word
                structlog.get_logger().warning(
                    "records.instance_replaced",
                    path=os.fspath(path),
                    found=repr(found[:64]),
                    reason="not an id: a new one is made, and processes left with another id "
                    "by an earlier supervisor of this state_dir are not found by it",
                )
        else:
            with contextlib.suppress(OSError):  # not written: still the id the file holds
                atomic_write(path, f"{same}\n".encode())
            return same
    value = keep or uuid.uuid4().hex
    try:
        atomic_write(path, f"{value}\n".encode())
    except OSError:
        return None
    return value


def read_cordons(state_dir: Path) -> tuple[set[str], str | None]:
    """The GPUs an operator cordoned (``state_dir/cordons``: one UUID a line), so that a
    cordon outlives a restart of the supervisor: (the UUIDs, None); none when there is no
    such file; (none, why) when there is one that cannot be read (the caller says so: an
    operator's maintenance cordon must not be lost without a word)."""
    try:
        text = read_file(state_dir / CORDONS_FILE, follow=False).decode()
    except (FileNotFoundError, NotADirectoryError):  # no such file, or no state_dir at all
        return set(), None
    except UnicodeDecodeError:
        return set(), "not text (UTF-8)"
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # regression: followed, a planted link cordoned GPUs
            return set(), LINK_REFUSED
        return set(), exc.strerror or str(exc)
    return {line.strip() for line in text.splitlines() if line.strip()}, None


def write_cordons(state_dir: Path, uuids: Iterable[str]) -> None:
    """Record the operator's cordons (``read_cordons``); raises OSError."""
    atomic_write(state_dir / CORDONS_FILE, "".join(f"{u}\n" for u in sorted(uuids)).encode())


@dataclass(frozen=True, slots=True)
class KeptQuarantine:
    """What ``state_dir/quarantine`` says (``read_quarantine``)."""

    #: GPU UUID -> why it was quarantined: the quarantines a new supervisor keeps
    gpus: dict[str, str]
    #: the quarantines of an earlier boot, dropped (a reboot reset the GPUs)
    dropped: dict[str, str]
    #: why the file could not be read (None: read, or no such file)
    unreadable: str | None = None
    #: GPU UUID -> the flags on when an operator lifted its quarantine in this boot
    #: (``HealState.lifted``): the lift holds across the restart while they stay on
    lifted: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the file is an earlier boot's: nothing in it holds (it is written anew, or removed)
    earlier_boot: bool = False


def read_quarantine(state_dir: Path, boot: str) -> KeptQuarantine:
    """The GPUs quarantined before this start (a device-fatal XID, a GPU lost, a failed row
    remap), kept while the machine has not rebooted since: ``boot`` is this boot's id. A
    quarantined GPU stays unusable until it is reset, which a restart of the supervisor is
    not; a reboot is. Where either boot id is unknown, the quarantines are kept."""
    try:
        doc = json.loads(read_file(state_dir / QUARANTINE_FILE, follow=False))
    except (FileNotFoundError, NotADirectoryError):
        return KeptQuarantine({}, {})
    except ValueError:
        return KeptQuarantine({}, {}, "not JSON")
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a planted link must not choose the GPUs quarantined
            return KeptQuarantine({}, {}, LINK_REFUSED)
        return KeptQuarantine({}, {}, exc.strerror or str(exc))
    gpus = doc.get("gpus") if isinstance(doc, dict) else None
    saved_boot = doc.get("boot_id") if isinstance(doc, dict) else None
    if not isinstance(gpus, dict) or not isinstance(saved_boot, str):
        return KeptQuarantine({}, {}, 'not {"boot_id": ..., "gpus": {...}}')
    kept = {str(gpu): str(why) for gpu, why in gpus.items()}
    if saved_boot and boot and saved_boot != boot:
        return KeptQuarantine({}, kept, earlier_boot=True)
    lifted: dict[str, dict[str, int]] = {}
    found = doc.get("lifted")
    for gpu, flags in (found if isinstance(found, dict) else {}).items():
        if isinstance(flags, dict):  # (what is not understood is not taken for a lift)
            ok = {
                str(k): v
                for k, v in flags.items()
                if isinstance(v, int) and not isinstance(v, bool)
            }
            if ok:
                lifted[str(gpu)] = ok
    return KeptQuarantine(kept, {}, lifted=lifted)


def write_quarantine(
    state_dir: Path,
    boot: str,
    gpus: Mapping[str, str],
    lifted: Mapping[str, Mapping[str, int]] | None = None,
) -> None:
    """Record the GPUs quarantined now, and the lifts that hold while a flag stays on
    (``read_quarantine``); neither: the file is removed. Raises OSError."""
    path = state_dir / QUARANTINE_FILE
    if not gpus and not lifted:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    doc: dict[str, Any] = {"boot_id": boot, "gpus": dict(sorted(gpus.items()))}
    if lifted:
        doc["lifted"] = {gpu: dict(sorted(f.items())) for gpu, f in sorted(lifted.items())}
    atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode())


def remove_temp_files(directory: Path) -> int:
    """Remove temporary files a killed writer left behind; return how many."""
    count = 0
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(TMP_PREFIX) and entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    count += 1
    return count


@dataclass(frozen=True, slots=True)
class LogsRemoved:
    """What ``retain_worker_logs`` removed: the workers (least recently written first), the
    bytes their files held, and the files it could not remove (path -> why)."""

    workers: list[str] = field(default_factory=list)
    bytes: int = 0
    failed: dict[str, str] = field(default_factory=dict)


def retain_worker_logs(
    directory: Path, budget: int | None, configured: Collection[str], kept: Callable[[str], bool]
) -> LogsRemoved:
    """Remove the log files of workers no longer configured past ``budget`` bytes
    (``policy.retention.to_remove`` decides which). Never a file of a worker in ``configured``
    or for which ``kept(name)`` holds (asked again right before its files go: a reload may
    have brought it back meanwhile); only regular files named as this layout names a worker's
    (``<worker>.log``, ``<worker>.log.<N>``), and never through a symbolic link (``directory``
    itself one: nothing is done). Blocking: call it from a worker thread."""
    if budget is None:
        return LogsRemoved()
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # no logs/ (yet), or a link: nothing to do
        return LogsRemoved()
    try:
        files: dict[str, list[tuple[str, int, int]]] = {}  # name -> [(file, inode, size)]
        newest: dict[str, float] = {}
        with contextlib.suppress(OSError), os.scandir(dir_fd) as entries:
            for entry in entries:
                name = worker_of(entry.name)
                if name is None or name in configured or kept(name):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        files.setdefault(name, []).append((entry.name, st.st_ino, st.st_size))
                        newest[name] = max(newest.get(name, -math.inf), st.st_mtime)
        logs = [
            WorkerLogs(name, newest[name], sum(size for _, _, size in of))
            for name, of in files.items()
        ]
        workers: list[str] = []
        total = 0
        failed: dict[str, str] = {}
        for name in to_remove(logs, budget, configured):
            if kept(name):
                continue
            unlinked = False
            for file, inode, _ in files[name]:
                try:
                    st = os.stat(file, dir_fd=dir_fd, follow_symlinks=False)
                    # the file scanned, still (not one made in its place since)
                    if stat.S_ISREG(st.st_mode) and st.st_ino == inode:
                        os.unlink(file, dir_fd=dir_fd)
                        total += st.st_size
                        unlinked = True
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    failed[os.fspath(directory / file)] = exc.strerror or str(exc)
            if unlinked:
                workers.append(name)
        return LogsRemoved(workers, total, failed)
    finally:
        os.close(dir_fd)


#: A write failure of the same file and kind that comes back within this many seconds of the
#: last one said (a full disk whose space something keeps taking back: the writes fail and work
#: in turn) is said at debug, its recovery too; one that lasts is said again after it.
FLAP_LOG_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Failure:
    """An ongoing write failure of one file kind."""

    kind: str
    error: str
    since: float  # wall clock
    started: float  # monotonic: how long it lasts, whatever steps the wall clock takes
    quiet: bool = False  # said at debug (the same failure was said less than a minute ago)


class WriteHealth:
    """Write failures per file (``state``, ``postmortem``, ``log``): logged once per kind, and
    at most once a minute (``FLAP_LOG_EVERY_S``) for one that comes and goes."""

    def __init__(self) -> None:
        self.failing: dict[str, Failure] = {}
        self.errors_total: dict[tuple[str, str], int] = {}
        #: (file, kind) -> when such a failure was last said (monotonic): failures that come
        #: and go, of one kind or taking turns between kinds, are said once a minute each
        self._said: dict[tuple[str, str], float] = {}
        self._log = structlog.get_logger()

    def failed(self, file: str, exc: OSError) -> None:
        """A write of ``file`` failed."""
        kind = failure_kind(exc)
        key = (file, kind)
        self.errors_total[key] = self.errors_total.get(key, 0) + 1
        now = time.monotonic()
        recent = now - self._said.get(key, -math.inf) < FLAP_LOG_EVERY_S
        current = self.failing.get(file)
        if current is not None and current.kind == kind:
            self.lasting(file)
            return
        error = f"{exc.strerror or exc}"
        self.failing[file] = Failure(kind, error, time.time(), now, quiet=recent)
        self._say_failed(file, kind, error, exc.filename, now, 10 if recent else 40)

    def lasting(self, file: str) -> None:
        """``file``'s writes still fail: one said at debug (it came back within a minute of
        the last said) is said at error once that minute is over, as it lasts."""
        current = self.failing.get(file)
        now = time.monotonic()
        if current is None or not current.quiet:
            return
        if now - self._said.get((file, current.kind), -math.inf) >= FLAP_LOG_EVERY_S:
            self.failing[file] = replace(current, quiet=False)
            self._say_failed(file, current.kind, current.error, None, now, 40)

    def _say_failed(
        self, file: str, kind: str, error: str, path: object, now: float, level: int
    ) -> None:
        if level > 10:
            self._said[(file, kind)] = now
        self._log.log(
            level,
            "records.write_failed",
            file=file,
            kind=kind,
            error=error,
            path=path,
            reason="supervision continues; writes are retried",
        )

    def ok(self, file: str) -> None:
        """A write of ``file`` succeeded."""
        failure = self.failing.pop(file, None)
        if failure is not None:
            self._log.log(
                10 if failure.quiet else 20,
                "records.write_recovered",
                file=file,
                kind=failure.kind,
                failed_for_s=round(time.monotonic() - failure.started, 3),
            )

    def problems(self) -> dict[str, dict[str, Any]]:
        """``{file: {kind, error, since}}`` for every file whose last write failed."""
        return {
            f: {"kind": v.kind, "error": v.error, "since": v.since} for f, v in self.failing.items()
        }


class PostmortemStore:
    """``state_dir/postmortems/<id>.json``: written atomically, the newest ``keep`` kept.

    "Newest" is in the order the files were written, not by the wall-clock time in their ids:
    the clock can be stepped (NTP, ``date -s``), and a post-mortem written after a step back
    would sort before older ones and be the first to be pruned. The files this store wrote
    rank in the order it wrote them; files it found (written by an earlier supervisor) rank
    below all of those, by their ids among themselves. Safe to use from several threads.
    """

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = directory
        self.keep = keep
        self._order: dict[str, int] = {}  # id -> write sequence, for the files written here
        self._seq = 0
        self._order_lock = threading.Lock()
        self._unprunable: set[str] = set()  # ids pruning could not delete (said once)

    def path_of(self, id_: str) -> Path:
        """The file of post-mortem ``id_`` (raises ValueError for a malformed id)."""
        if not _ID.fullmatch(id_):
            raise ValueError(f"not a post-mortem id: {id_!r}")
        return self.directory / f"{id_}.json"

    def write(self, doc: dict[str, Any]) -> str:
        """Write ``doc`` (its ``id`` gets a ``-2``... suffix if taken); return the id used.

        The directory is not created here: a missing one means ``state_dir`` was removed, and
        the ``FileNotFoundError`` lets the recorder recreate it and say so (the notify socket
        must be bound again too).
        """
        base = str(doc["id"])
        id_, n = base, 1
        while (self.directory / f"{id_}.json").exists():
            n += 1
            id_ = f"{base}-{n}"
        doc = {**doc, "id": id_}
        atomic_write(self.path_of(id_), dump_json(doc))
        with self._order_lock:
            self._seq += 1
            self._order[id_] = self._seq
        self.prune()
        return id_

    def ids(self) -> list[str]:
        """Every post-mortem id, newest first (in write order: see the class)."""
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        ids = [n[: -len(".json")] for n in names if n.endswith(".json") and _ID.fullmatch(n[:-5])]
        with self._order_lock:
            order = dict(self._order)
        ours = sorted((i for i in ids if i in order), key=order.__getitem__, reverse=True)
        found = sorted((i for i in ids if i not in order), reverse=True)
        return ours + found

    def prune(self) -> int:
        """Delete all but the newest ``keep`` (``ids``: a file is never deleted while one
        written after it is kept); return how many were deleted. Called by the writer after
        each write (not at the same time as ``write``)."""
        removed = 0
        try:
            ids = self.ids()
        except OSError:  # the directory cannot be listed now: pruned after the next write
            return 0
        for id_ in ids[max(self.keep, 1) :]:
            path = self.directory / f"{id_}.json"
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                # A directory by that name, an immutable file: left, said once. Regression:
                # the write was taken for a failed one, the post-mortem written again every
                # 5 s under a new name, and the ones queued after it never written.
                if id_ not in self._unprunable:
                    self._unprunable.add(id_)
                    structlog.get_logger().warning(
                        "records.postmortem_not_pruned",
                        path=os.fspath(path),
                        error=exc.strerror or str(exc),
                        reason="cannot delete it: remove it by hand",
                    )
                continue
            removed += 1
        with self._order_lock:  # forget the pruned, and files removed by hand
            for id_ in self._order.keys() - set(ids[: max(self.keep, 1)]):
                del self._order[id_]
        return removed

    def read(self, id_: str) -> dict[str, Any]:
        """One post-mortem's content (FileNotFoundError if there is none, ValueError if bad)."""
        path = self.path_of(id_)
        try:
            # not through a link: one planted here would have the API show any JSON file
            doc = json.loads(read_file(path, follow=False))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, LINK_REFUSED, os.fspath(path)) from None
            raise
        except json.JSONDecodeError as exc:  # torn by hand or by a disk: say which file
            raise ValueError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not JSON (not UTF-8 text)") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{id_}: not a JSON object")
        return doc

    def summaries(self, limit: int | None = None) -> list[dict[str, Any]]:
        """``{id, worker, reason, ended_at, exit}`` per post-mortem, newest first.

        Files that vanish or do not parse while being listed are skipped.
        """
        out: list[dict[str, Any]] = []
        for id_ in self.ids():
            if limit is not None and len(out) >= limit:
                break
            try:
                doc = self.read(id_)
            except (OSError, ValueError):
                continue
            worker = doc.get("worker")
            if not isinstance(worker, dict):  # written by hand or by something else
                worker = {}
            # a field of another type is left out (null), not taken on trust: the API's list
            # answered 500 for every file because of one such
            exit_ = doc.get("exit")
            out.append(
                {
                    "id": id_,
                    "worker": _text(worker.get("name")),
                    "group": _text(worker.get("group")),
                    "reason": _text(doc.get("reason")),
                    "ended_at": _text(worker.get("ended_at")),
                    "exit": exit_ if isinstance(exit_, dict) else None,
                }
            )
        return out


def _text(value: object) -> str | None:
    """``value`` if it is a string, else None (a post-mortem field of another type)."""
    return value if isinstance(value, str) else None


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, a symbolic link (not followed:
    one planted in ``state_dir`` must not choose what is read) or does not parse."""
    try:
        doc = json.loads(read_file(path, follow=False))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def unreadable_why(path: Path) -> str:
    """Why ``read_json`` found nothing in ``path``, a file that is there: the read's own error
    (a state_dir left by a supervisor run as root, read by one run as the service user), else
    that it holds no JSON object."""
    try:
        read_file(path, follow=False)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return "not a JSON object in a regular file"


#: ``state.json`` is rewritten at most this often (``URGENT_MIN_INTERVAL_S`` after a transition).
STATE_MIN_INTERVAL_S = 1.0
#: A transition is on disk within this long: the transitions of a burst (32 workers starting,
#: a group stopping) share one write instead of one fsynced write each.
URGENT_MIN_INTERVAL_S = 0.1
#: How often the recorder checks that ``state_dir`` (and the notify socket) still exist.
CHECK_EVERY_S = 5.0
#: Post-mortems waiting for a writable disk; beyond this the oldest are dropped (and logged).
MAX_PENDING_POSTMORTEMS = 100
#: The most that wait on a disk that takes them (a burst of deaths), whatever
#: ``postmortem_keep`` says: a disk that hangs rather than fails (a stuck NFS mount) is never
#: "failing", and documents of up to a few hundred KiB each must not pile up without bound.
MAX_PENDING_BURST = 1000
#: At most one ``records.postmortem_dropped`` line at error per worker this often (seconds).
DROPS_SAID_EVERY_S = 60.0


class Recorder:
    """The snapshot writer task: ``state.json`` and the post-mortem queue, written off the loop.

    ``snapshot()`` (called on the event loop) returns the current ``state.json`` document; a
    worker's ``"_tree_pids"`` entry is turned into ``tree`` (pid + create time) in the writer
    thread. A document equal to the last one written (apart from ``written_at``) is not rewritten.
    """

    def __init__(
        self,
        state_dir: Path,
        keep: int,
        health: WriteHealth,
        snapshot: Callable[[], dict[str, Any]],
        on_dir_recreated: Callable[[], None] = lambda: None,
        create_time: Callable[[int], float | None] | None = None,
        after_state_written: Callable[[], None] = lambda: None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state_dir = state_dir
        self._now = now
        #: ``records.postmortem_dropped`` at error once a minute per worker
        self._drops_said = RateLimit(DROPS_SAID_EVERY_S)
        self._drops_unsaid: dict[str, int] = {}  # worker -> dropped at debug since
        #: called in the writer thread after each ``state.json`` written (the disk takes
        #: writes again: what could not be saved at start is saved then)
        self._after_state_written = after_state_written
        self.state_path = state_dir / STATE_FILE
        self.store = PostmortemStore(state_dir / POSTMORTEM_DIR, keep)
        self.health = health
        self._snapshot = snapshot
        self._on_dir_recreated = on_dir_recreated
        self._create_time = create_time or (lambda _pid: None)
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        self._lock = anyio.Lock()  # the serving loop and flush() never write at the same time
        self._dirty = False
        self._urgent = False
        self._last_at = -1e18
        self._last_body: str | None = None
        self._pending: list[dict[str, Any]] = []
        self._writing: dict[str, Any] | None = None  # the one the writer thread has now
        self._next_check = 0.0
        self._recreated = False
        self._intact_seen = False  # state_dir with its post-mortem directory seen once
        self.state_writes = 0
        self.postmortems_written = 0
        self._log = structlog.get_logger()

    def mark(self, urgent: bool = False) -> None:
        """The state changed (``urgent``: a transition, written at once)."""
        self._dirty = True
        self._urgent = self._urgent or urgent
        self._wake.set()

    def postmortem(self, doc: dict[str, Any]) -> None:
        """Queue a post-mortem document for writing. While post-mortem writes fail, at most
        ``MAX_PENDING_POSTMORTEMS`` wait; on a disk that takes them, a burst (many workers
        dying at once) waits whole for the writer, up to ``postmortem_keep`` (the oldest
        beyond it would be pruned as soon as the newer ones are written) and
        ``MAX_PENDING_BURST``."""
        failing = "postmortem" in self.health.failing
        limit = (
            MAX_PENDING_POSTMORTEMS
            if failing
            else max(MAX_PENDING_POSTMORTEMS, min(self.store.keep, MAX_PENDING_BURST))
        )
        # never the one being written (regression: said dropped, written all the same, and
        # the next one taken off the queue as written: lost without a word)
        first = 1 if self._pending and self._pending[0] is self._writing else 0
        while len(self._pending) >= limit and len(self._pending) > first:
            dropped = self._pending.pop(first)
            # Once a minute per worker, the rest at debug (``dropped``: how many since the
            # last said): a crash loop on a disk that stays full drops one at each crash
            # (regression: a line at error each).
            worker = str((dropped.get("worker") or {}).get("name", ""))
            count = self._drops_unsaid.pop(worker, 0) + 1
            loud = self._drops_said.allow((worker,), self._now())
            if not loud:
                self._drops_unsaid[worker] = count
            self._log.log(
                40 if loud else 10,
                "records.postmortem_dropped",
                id=dropped.get("id"),
                worker=worker,
                dropped=count if loud else 1,
                reason="too many post-mortems waiting for a writable state_dir"
                if failing
                else "more post-mortems waiting than postmortem_keep",
            )
        self._pending.append(doc)
        self._wake.set()

    async def serve(self, *, task_status: Any = None) -> None:
        """Write until cancelled."""
        if task_status is not None:
            task_status.started()
        while True:
            now = anyio.current_time()
            postmortems_due = bool(self._pending) and "postmortem" not in self.health.failing
            if postmortems_due:
                timeout = 0.0
            elif self._dirty and self._urgent:
                timeout = max(0.0, self._last_at + URGENT_MIN_INTERVAL_S - now)
            elif self._dirty:
                timeout = max(0.0, self._last_at + STATE_MIN_INTERVAL_S - now)
            else:
                timeout = CHECK_EVERY_S
            timeout = min(timeout, max(0.0, self._next_check - now))
            with anyio.move_on_after(timeout):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self._step()

    async def _step(self) -> None:
        now = anyio.current_time()
        checked = False
        if now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            checked = True
            with contextlib.suppress(ThreadUnavailable):  # checked again in CHECK_EVERY_S
                if await in_thread(self._check_dir, limiter=self._limiter):
                    self._dirty = self._urgent = True
                    self._last_body = None  # the same document, but not on disk
        if self._pending and ("postmortem" not in self.health.failing or checked):
            await self._write_postmortems()
        since = now - self._last_at
        if self._dirty and since >= (
            URGENT_MIN_INTERVAL_S if self._urgent else STATE_MIN_INTERVAL_S
        ):
            await self.write_state()
        self._after_thread()

    def _after_thread(self) -> None:
        """Loop-side follow-up of what the writer thread found (the directory was recreated)."""
        if self._recreated:
            self._recreated = False
            self._on_dir_recreated()

    def report_unwritten(self) -> int:
        """Log the post-mortems still waiting to be written (at exit: a full or read-only
        ``state_dir``, or the flush cut short); return how many."""
        for worker, count in sorted(self._drops_unsaid.items()):
            self._log.error(
                "records.postmortem_dropped",
                id=None,
                worker=worker,
                dropped=count,
                reason="dropped while state_dir did not take them, said at debug as they went",
            )
        self._drops_unsaid.clear()
        if self._pending:
            self._log.error(
                "records.postmortems_unwritten",
                count=len(self._pending),
                ids=[d.get("id") for d in self._pending],
                reason="state_dir did not take them before the supervisor exited",
            )
        return len(self._pending)

    async def flush(self) -> None:
        """Write every queued post-mortem and the current state now (at shutdown: where no
        thread can be started, the writes are made on the event loop)."""
        await self._write_postmortems(inline=True)
        self._dirty = True
        await self.write_state(inline=True)
        self._after_thread()

    async def write_state(self, inline: bool = False) -> None:
        """Write ``state.json`` now (if it differs from the last written)."""
        async with self._lock:
            await self._write_state_locked(inline)

    async def _in_thread(
        self, file: str, write: Callable[[dict[str, Any]], bool], doc: dict[str, Any], inline: bool
    ) -> bool:
        """``write(doc)`` in the writer thread; a thread that cannot be started is a failed
        write of ``file`` (logged, counted, retried like one)."""
        try:
            return await in_thread(write, doc, limiter=self._limiter, inline=inline)
        except ThreadUnavailable as exc:
            self.health.failed(file, exc)
            return False

    async def _write_state_locked(self, inline: bool) -> None:
        self._dirty = self._urgent = False
        doc = self._snapshot()
        # Compared, not written: compact JSON goes through the C encoder (indent= does not), so
        # the check after every sample costs ~0.1 ms instead of ~1 ms for 32 workers.
        try:
            body = json.dumps({k: v for k, v in doc.items() if k != "written_at"}, allow_nan=False)
        except ValueError:  # a NaN or an infinity read somewhere: written as null
            doc = finite(doc)
            body = json.dumps({k: v for k, v in doc.items() if k != "written_at"}, allow_nan=False)
        if body == self._last_body and "state" not in self.health.failing:
            return
        self._last_at = anyio.current_time()
        ok = await self._in_thread("state", self._write_state, doc, inline)
        if ok:
            self._last_body = body
        else:
            self._dirty = True  # retried after STATE_MIN_INTERVAL_S

    async def _write_postmortems(self, inline: bool = False) -> None:
        async with self._lock:
            while self._pending:
                doc = self._writing = self._pending[0]
                try:
                    ok = await self._in_thread("postmortem", self._write_postmortem, doc, inline)
                finally:
                    self._writing = None
                if not ok:
                    return
                self._pending.pop(0)

    # --- in the writer thread -------------------------------------------------------------

    def _retrying(self, file: str, write: Callable[[], None]) -> bool:
        """Run ``write``; on ENOENT recreate the directories once and retry."""
        try:
            try:
                write()
            except FileNotFoundError:
                self._recreate()
                write()
        except OSError as exc:
            self.health.failed(file, exc)
            return False
        self.health.ok(file)
        return True

    def _write_state(self, doc: dict[str, Any]) -> bool:
        for w in doc.get("workers", []):
            pids = w.pop("_tree_pids", ())
            tree = []
            for pid in pids:
                ct = self._create_time(pid)
                if ct is not None:
                    tree.append({"pid": pid, "create_time": ct})
            w["tree"] = tree
        data = dump_json(doc)
        ok = self._retrying("state", lambda: atomic_write(self.state_path, data))
        if ok:
            self._after_state_written()
            self.state_writes += 1
            self._log.debug(
                "records.state_written",
                writes=self.state_writes,
                pids=sorted({t["pid"] for w in doc.get("workers", []) for t in w["tree"]}),
                ready=sum(1 for w in doc.get("workers", []) if w.get("state") == "ready"),
            )
        return ok

    def _write_postmortem(self, doc: dict[str, Any]) -> bool:
        written: list[str] = []
        ok = self._retrying("postmortem", lambda: written.append(self.store.write(doc)))
        if ok:
            self.postmortems_written += 1
            self._log.info(
                "records.postmortem",
                id=written[0],
                worker=(doc.get("worker") or {}).get("name"),
                reason=doc.get("reason"),
            )
        return ok

    def _dir_intact(self) -> bool:
        """``state_dir`` and its post-mortem directory both exist (both are made at start)."""
        return self.state_dir.is_dir() and self.store.directory.is_dir()

    def _recreate(self) -> bool:
        """Make the directories again; True if ``state_dir`` had been removed."""
        lost = not self.state_dir.is_dir() or (
            self._intact_seen and not self.store.directory.is_dir()
        )
        # state_dir itself first: made as a parent of the post-mortems it would get 0755
        make_dir(self.state_dir, 0o750)
        make_dir(self.store.directory, 0o750)
        self._intact_seen = True
        if lost:
            self._log.warning(
                "records.state_dir_recreated",
                path=os.fspath(self.state_dir),
                reason="state_dir was removed while running",
            )
            self._recreated = True
        return lost

    def _check_dir(self) -> bool:
        """Recreate a removed ``state_dir``; True if it was recreated, or if ``state.json``
        was written and is gone (removed by hand, by a cleaner): it is written again then, not
        only at the next change, which on a quiet fleet may never come.

        A ``state_dir`` that lost its post-mortem directory after it had one was removed and
        made again (by a worker's log file, which creates its directory, or by hand): it holds
        no notify socket either, so it counts as recreated too. (Its inode cannot tell: a
        directory made right after one was removed often gets the same inode number.)
        """
        # stat's other errors (EACCES: state_dir's mode or owner changed under a supervisor
        # not running as root; EIO) are failed writes too. Regression: they ended the writer
        # task, and the supervisor with it.
        try:
            if self._dir_intact():
                self._intact_seen = True
                return self._last_body is not None and not self.state_path.exists()
            return self._recreate()
        except OSError as exc:
            self.health.failed("state", exc)
            return False
