"""Worker output: a size-rotated log file per worker, the last lines in memory, passthrough.

The worker's stdout and stderr share one pipe; ``pump()`` reads it without blocking the loop.

A line longer than :data:`MAX_LINE` bytes is never held whole: the log file gets every byte as
it comes, passthrough gets it in pieces of at most ``MAX_LINE`` bytes (each its own prefixed
line, so that output from several workers never mixes within a line), and ``on_line`` gets its
first ``MAX_LINE`` bytes, where the timestamp, level and error text are, then its middle in
windows of ``MAX_LINE`` bytes overlapping by :data:`MATCH_OVERLAP`, as it comes, and, when it
ends, its last :data:`END_PIECE` bytes (a traceback's exception message, in a log record that
holds the whole traceback); the in-memory tail gets the start and the end.

The tail reads a carriage return inside a line (a progress bar redrawing itself) as a terminal
shows it: back to the line's start, the text after it overwriting what was there; ``on_line``
gets every stretch between carriage returns. So a progress bar of thousands of updates without a
newline, then the error that ended the run, is kept as the error (over the last update), not as
one line cut to the bar's first 16 KiB. The log file and passthrough keep every byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import secrets
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import anyio
import anyio.lowlevel
import structlog

from supervisor.files import make_dir
from supervisor.streams import STALL_WAIT_S, UnblockedWriter

TAIL_LINES = 200
#: The tail also holds at most this many characters (the newest lines that fit, and always the
#: newest one): 200 lines cut at 16 KiB are 3.2 M characters, and undecodable bytes (a worker
#: writing binary data) each become a U+FFFD, which costs 2 bytes held and 3 in a post-mortem.
TAIL_CHARS = 256 * 1024
_READ_SIZE = 65536
#: A line longer than this (in bytes, without its newline) is passed through in pieces of at most
#: this size and kept cut to its start for the tail and ``on_line``; it bounds the bytes held.
#: 16 KiB is also where Docker and containerd split a long line into partial log records.
MAX_LINE = 16384
#: Appended to the start of a line that was cut for the tail (the log file has the whole line).
CUT_MARK = " [... line cut: {total} bytes]"
#: A line cut for the tail keeps this many of its last bytes too, after ``CUT_MARK`` and
#: ``" ..."``: where a record that holds a whole traceback (a JSON log line) has the
#: exception's message, which the death is judged by.
END_PIECE = 4096
#: The middle of a long line (past its first ``MAX_LINE`` bytes, before its last ``END_PIECE``)
#: goes to ``on_line`` in windows of ``MAX_LINE`` bytes, each overlapping the last by this many:
#: a sticky-error text up to this long is found wherever the windows cut the line.
MATCH_OVERLAP = 1024
#: What a log emptied on a full disk starts with (``RotatingFile.write``).
TRIMMED_MARK = b"--- gpu-supervisor: disk full: the earlier content of this log was removed ---\n"
#: What a log says where output could not be written (a full or read-only disk): the bytes lost.
LOST_MARK = b"--- gpu-supervisor: %d bytes of output were lost: the log could not be written ---\n"
#: A log capped after a full disk still rotates at this size at least.
TRIMMED_MIN_BYTES = 64 * 1024
#: How often a log being written is checked for having been removed, renamed (logrotate's
#: ``create``) or emptied (``copytruncate``) under the writer (``RotatingFile._append``).
MOVED_CHECK_S = 1.0
#: ``drain()`` takes at most this much from each pipe (a process that exited left at most a
#: pipe's capacity; more is its children writing on).
DRAIN_LIMIT = 1024 * 1024


#: Each log file made gets a random tag in this extended attribute: the next run of the
#: supervisor tells a follower's file from another that took its inode (ext4 hands a removed
#: file's inode to the next file made). Where the filesystem keeps no user attributes, the
#: inode alone.
TAG_XATTR = "user.gpu_supervisor.log"


def _tag(fd: int, new: bool = False) -> str:
    """The tag of the log file open as ``fd`` ("" where it has none); ``new``: give it one."""
    with contextlib.suppress(OSError):
        if new:
            os.setxattr(fd, TAG_XATTR, secrets.token_hex(4).encode())
        return os.getxattr(fd, TAG_XATTR).decode("ascii", "replace")
    return ""


def _private(path: str, flags: int) -> int:
    """Open as ``open()`` does, a new file readable by its user and group only (a log holds
    whatever the worker prints).

    A link at ``path`` is followed only when it is the supervisor's own or root's (an
    operator's, to a log on another disk): one that another user who could write the directory
    put there would have a root supervisor write the worker's output into the file it names.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        owner = os.lstat(path).st_uid
        if owner not in (0, os.geteuid()):
            raise OSError(
                errno.EPERM, f"a link made by uid {owner}: not followed", os.fspath(path)
            ) from None
    return os.open(path, flags, 0o640)


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
        #: Bytes of output not written in the current run of failures: the first write that
        #: gets through says so in the log (``LOST_MARK``).
        self.lost = 0
        #: Called with the error on the first failed write of a run of failures, and with None
        #: on the first good write after it (write-failure reporting).
        self.on_health: Callable[[OSError | None], None] | None = None
        #: Bytes given up on a full disk (see ``write``), and who is told (with the bytes).
        self.trimmed = 0
        self.on_trim: Callable[[int, int], None] | None = None
        #: Reading back (``read``, from another thread): each file of this log on disk, by
        #: (device, inode), has a number no other file of it gets in this run (an inode is
        #: reused once its file is removed); the lock keeps a rotation from moving files while
        #: a reader opens them.
        self._run = secrets.token_hex(4)
        self._serial = 0
        self._serials: dict[tuple[int, int], int] = {}
        self._files_lock = threading.Lock()
        #: The file last removed, by a rotation (``backups = 0``) or under the writer (removed
        #: by hand, renamed: ``_check_moved``), its number and size, and the number of the one
        #: made after it (None until then): a follower of it goes on in that one
        self._removed: tuple[int, int, int | None] | None = None
        #: when the open file was last checked against ``path`` (``_check_moved``)
        self.check_every_s = MOVED_CHECK_S
        self._checked_at = -math.inf
        #: the rotated files above ``backups`` are removed at the first open, then at rotations
        self._stale_removed = False

    def _open(self) -> BinaryIO:
        if self._fh is None:
            created = False

            def opener(path: str, flags: int) -> int:
                nonlocal created
                try:
                    fd = _private(path, flags | os.O_EXCL)
                except FileExistsError:
                    return _private(path, flags)
                created = True
                return fd

            # Made and numbered under the lock: a reader that saw the new file before it was
            # numbered would number it itself, then ``new=True`` renumbers it and the reader's
            # answer names a file that no longer exists (X-Log-Lost, the backups read again).
            with self._files_lock:
                try:
                    self._fh = open(self.path, "ab", opener=opener)  # noqa: SIM115 - kept open
                except FileNotFoundError:  # first use, or the directory was removed
                    # state_dir (its parent) too, not left at the default 0755 of made parents
                    make_dir(self.path.parent.parent, 0o750)
                    make_dir(self.path.parent, 0o750)
                    self._fh = open(self.path, "ab", opener=opener)  # noqa: SIM115
                if created:
                    _tag(self._fh.fileno(), new=True)
                if not self._stale_removed:
                    self._stale_removed = True
                    self._remove_stale()
                with contextlib.suppress(OSError):
                    serial = self._number(os.fstat(self._fh.fileno()), new=created)
                    # the next file (made by us, or by logrotate's `create` in its place)
                    if self._removed is not None and self._removed[2] is None:
                        self._removed = (*self._removed[:2], serial)
            self._size = self._fh.tell()
        return self._fh

    def _remove_stale(self) -> None:
        """Remove the rotated files numbered above ``backups`` (``x.log.5`` with 3: left when
        ``log_backups`` was lowered; before, they stayed forever), this log's only: never
        another's whose name starts alike (``w-01`` for ``w-0``). Hold the lock."""
        prefix = f"{self.path.name}."
        with contextlib.suppress(OSError), os.scandir(self.path.parent) as entries:
            for entry in entries:
                number = entry.name[len(prefix) :]
                if (
                    entry.name.startswith(prefix)
                    and number.isascii()
                    and number.isdigit()
                    and not number.startswith("0")
                    and int(number) > self.backups
                ):
                    path = Path(entry.path)
                    self._forget(path)
                    with contextlib.suppress(OSError):
                        path.unlink()

    def _backup(self, i: int) -> Path:
        return self.path if i == 0 else self.path.with_name(f"{self.path.name}.{i}")

    def _number(self, st: os.stat_result, new: bool = False) -> int:
        """The number of the file ``st`` (a new one for a file just made). Hold the lock."""
        key = (st.st_dev, st.st_ino)
        if new or key not in self._serials:
            self._serial += 1
            self._serials[key] = self._serial
        return self._serials[key]

    def _forget(self, path: Path) -> None:
        """``path`` is about to be removed or replaced: its inode may be reused. Hold the lock."""
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            self._serials.pop((st.st_dev, st.st_ino), None)

    def _rotate(self) -> None:
        self.close()
        with self._files_lock:
            if self.backups <= 0:
                with contextlib.suppress(OSError):
                    st = os.stat(self.path, follow_symlinks=False)
                    serial = self._serials.get((st.st_dev, st.st_ino))
                    self._removed = None if serial is None else (serial, st.st_size, None)
                self._forget(self.path)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                self._remove_stale()
                return
            for i in range(self.backups - 1, -1, -1):
                src = self._backup(i)
                if src.exists():
                    self._forget(self._backup(i + 1))
                    os.replace(src, self._backup(i + 1))
            self._remove_stale()

    def write(self, data: bytes) -> None:
        """Append ``data``, rotating first when it would pass ``max_bytes``.

        On a full disk (ENOSPC, EDQUOT) the log gives up its own space first, once per run of
        failures: its rotated files, then what the current one holds (``trimmed`` says how
        much), and from then on it rotates at a size that keeps it and its rotated files to
        half of that. A worker's log is what fills ``state_dir`` in practice, and before, it
        never rotated again (it could not grow to ``max_bytes``), so ``state.json`` and the
        post-mortems, which matter more, got no space until someone deleted it by hand.
        """
        payload = LOST_MARK % self.lost + data if self.lost else data
        try:
            try:
                self._append(payload)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or self.failing:
                    raise
                if not self._trim():
                    raise
                self._append(payload)
        except OSError as exc:
            # A full or read-only disk must not stop supervision; the tail stays in memory.
            self.write_errors += 1
            self.lost += len(data)
            self.close()
            if not self.failing:
                self.failing = True
                if self.on_health is not None:
                    self.on_health(exc)
        else:
            self.lost = 0
            if self.failing:
                self.failing = False
                if self.on_health is not None:
                    self.on_health(None)

    def retry(self) -> None:
        """While writes fail, try again (with the line that says what was lost): a worker
        quiet since its last failed write would otherwise leave its log failing, and the
        records reported not writable, until it printed again (regression)."""
        if self.failing:
            self.write(b"")

    def _append(self, data: bytes) -> None:
        if self._fh is not None:
            now = time.monotonic()
            if now - self._checked_at >= self.check_every_s:
                self._checked_at = now
                self._check_moved(self._fh)
        if self.max_bytes and self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        fh = self._open()
        try:
            fh.write(data)
            fh.flush()
        except OSError:
            self.close()  # what the buffer held is dropped with it: not written twice
            raise
        self._size += len(data)

    def _check_moved(self, fh: BinaryIO) -> None:
        """The file open for writing is no longer at ``path`` (removed by hand to free space,
        renamed by logrotate's ``create``): it is closed, and the next write makes the log
        anew (before, the output went on into the file that was gone until the next rotation,
        its space never freed and ``logs`` showing nothing). One emptied under the writer
        (``copytruncate``): its size is read again, so that it rotates at ``max_bytes``."""
        try:
            held = os.fstat(fh.fileno())
            here: os.stat_result | None = os.stat(self.path)  # what an open would open
        except FileNotFoundError:
            here = None
        except OSError:  # cannot tell: left as it is
            return
        if here is not None and not stat.S_ISREG(here.st_mode):
            return  # not a log (a FIFO would block the open): left as it is
        if here is None or (here.st_dev, here.st_ino) != (held.st_dev, held.st_ino):
            with self._files_lock:  # a follower of it goes on in the one made next
                serial = self._serials.get((held.st_dev, held.st_ino))
                if serial is not None:
                    self._removed = (serial, held.st_size, None)
            self.close()
        else:
            self._size = held.st_size

    def _trim(self) -> bool:
        """Free this log's space: its rotated files, then the current file's content (a
        marker says so). True if anything was freed."""
        freed = 0
        self.close()
        with self._files_lock:
            for i in range(self.backups, 0, -1):
                old = self._backup(i)
                with contextlib.suppress(OSError):
                    size = old.stat().st_size
                    self._forget(old)
                    old.unlink()
                    freed += size
            with contextlib.suppress(OSError):
                size = self.path.stat().st_size
                if size:
                    # truncated (the tail is still in memory), not through another's link
                    with open(self.path, "wb", opener=_private) as fh:
                        fh.write(TRIMMED_MARK)
                        # another file to a reader: one that was further on in it lost that
                        self._number(os.fstat(fh.fileno()), new=True)
                        _tag(fh.fileno(), new=True)  # (and to the next run's)
                    freed += size
        self._size = 0
        self.trimmed += freed
        if freed:
            # From now on this log and its rotated files take at most half of what it held:
            # grown back into all of it, the next post-mortem would find the disk full again.
            cap = max(TRIMMED_MIN_BYTES, freed // (2 * (self.backups + 1)))
            self.max_bytes = min(self.max_bytes, cap) if self.max_bytes else cap
            if self.on_trim is not None:
                self.on_trim(freed, self.max_bytes)
        return freed > 0

    def read(self, limit: int, file: str | None = None, offset: int = 0) -> LogChunk:
        """Read this log back (from any thread).

        Without ``file``: its last ``limit`` bytes (from the rotated files too when the newest
        holds fewer); the place returned is the newest file's. With ``file`` and
        ``offset`` from an earlier chunk: up to ``limit`` bytes from there, in that file even if
        it was rotated since (``x.log.1``, ...), then on in the newer ones, so that a follower
        sees every byte once. ``file=""`` (no log at the earlier read): from the oldest byte.
        """
        fds: list[tuple[int, os.stat_result, str]] = []  # newest first: x.log, x.log.1, ...
        try:
            with self._files_lock:
                for i in range(self.backups + 1):
                    try:
                        # O_NONBLOCK: a FIFO in its place would block the open (with the lock
                        # held, and the event loop's next rotation waiting for it)
                        fd = os.open(
                            self._backup(i),
                            os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                        )
                    except FileNotFoundError:  # no output yet, or fewer backups
                        continue
                    except OSError as exc:
                        if exc.errno == errno.ELOOP:  # a link in its place: not this log
                            continue
                        raise
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):  # a FIFO, a device, a directory: not a log
                        os.close(fd)
                        continue
                    # the run and number tell files apart; the inode lets another run of
                    # the supervisor (a restart) find a follower's file again
                    name = f"{self._run}.{self._number(st)}.{st.st_dev:x}-{st.st_ino:x}"
                    if tag := _tag(fd):
                        name += f".{tag}"
                    fds.append((fd, st, name))
                if file and file not in (n for _, _, n in fds) and self._writing(file):
                    # removed under the writer, which has not noticed yet (``_check_moved``,
                    # at its next write): nothing newer to read yet, the place is kept
                    return LogChunk(b"", file, offset)
                skipped = False
                if file and self._removed is not None:
                    moved = self._after_removed(file, offset, [n for _, _, n in fds])
                    if moved is None:  # the next file is not made yet: nothing to read,
                        return LogChunk(b"", file, offset)  # nothing lost, its place kept
                    file, offset, skipped = moved
            chunk = _read_from(fds, limit, file, offset, self._run)
            return dataclasses.replace(chunk, lost=True) if skipped else chunk
        finally:
            for fd, _, _ in fds:
                os.close(fd)

    def _writing(self, file: str) -> bool:
        """``file`` is the file open for writing (from the reader's thread: the writer may be
        closing it; a descriptor number taken by another file since is not it). Hold the lock."""
        fh = self._fh
        if fh is None:
            return False
        try:
            st = os.fstat(fh.fileno())
        except (OSError, ValueError):  # closed meanwhile
            return False
        serial = self._serials.get((st.st_dev, st.st_ino))
        return serial is not None and file.startswith(f"{self._run}.{serial}.")

    def _after_removed(
        self, file: str, offset: int, ids: Sequence[str]
    ) -> tuple[str, int, bool] | None:
        """Where a follower at ``file``/``offset`` goes on when that file is the one removed
        last (``_removed``): the start of the next file (True: it had not read all of the
        removed one, that is lost), or None while that is not made yet and it had read all of
        it (a reader between the removal and the writer's next open, or an open that failed:
        it stays where it is). Anywhere else: where it was. Hold the lock."""
        assert self._removed is not None
        serial, size, after = self._removed
        if not file.startswith(f"{self._run}.{serial}."):
            return file, offset, False
        if after is None:
            return None if offset == size else (file, offset, False)
        for name in ids:
            if name.startswith(f"{self._run}.{after}."):
                return name, 0, offset != size
        return file, offset, False

    def close(self) -> None:
        """Close the file (it is reopened on the next write)."""
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None


class Tail:
    """The last lines: at most ``lines`` of them and ``chars`` characters (the newest line is
    always kept)."""

    def __init__(self, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> None:
        self._lines: deque[str] = deque()
        self._times: deque[float] = deque()  # when each line came in
        self._chars = 0
        self.max_lines = lines
        self.max_chars = chars
        #: When the lines appended now came in (set once per chunk of output).
        self.at = 0.0

    def append(self, text: str) -> None:
        """Keep ``text`` as the newest line, dropping the oldest ones that no longer fit."""
        lines = self._lines
        lines.append(text)
        self._times.append(self.at)
        self._chars += len(text)
        while len(lines) > self.max_lines or (self._chars > self.max_chars and len(lines) > 1):
            self._chars -= len(lines.popleft())
            self._times.popleft()

    def since(self, t: float) -> list[str]:
        """The lines that came in at ``t`` or later, oldest first."""
        n = 0
        for at in reversed(self._times):
            if at < t:
                break
            n += 1
        return list(self._lines)[len(self._lines) - n :]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lines)

    def __len__(self) -> int:
        return len(self._lines)


class _Shown:
    """The line a terminal shows while it is written, from its pieces.

    A carriage return sends the terminal back to the line's start: the text after it
    overwrites what was there, as far as it goes (``abcdef``, a carriage return and ``xy`` show
    ``xycdef``; a progress bar's updates, each as long as the last, show the last). Each
    stretch between carriage returns is a *segment*; ``on_line`` gets every segment (the
    sticky-error patterns see text a later segment overwrote), the tail gets what the terminal
    shows. A carriage
    return that ends a piece is held back: it may be a CRLF line end, whose newline comes next.
    Only the first bytes of each (a little over ``MAX_LINE``) and its last ``END_PIECE`` bytes
    are held.
    """

    __slots__ = (
        "cr",
        "cur",
        "cur_end",
        "cur_len",
        "mid",
        "told",
        "under",
        "under_end",
        "under_len",
    )

    def __init__(self) -> None:
        self.under = b""  # the line as the segments before the current one left it
        self.under_len = 0
        self.under_end = b""  # its last bytes (where it is longer than what is held of it)
        self.cur = b""  # the current segment
        self.cur_len = 0
        self.cur_end = b""  # its last END_PIECE bytes, once it is longer than what is held
        self.cr = False  # a carriage return held back
        self.told = False  # on_line has had the current segment (it grew too long)
        self.mid = b""  # the current segment's bytes past those held, not yet told in full

    def empty(self) -> bool:
        return not self.cur_len and not self.under_len and not self.cr

    def size(self) -> int:
        """The length of the line shown."""
        return max(self.under_len, self.cur_len)

    def add(self, piece: bytes, on_line: Callable[[str], None] | None) -> None:
        """Add bytes of the current line (no newline)."""
        if not piece:
            return
        if self.cr:  # not a CRLF after all: a carriage return
            self.carriage(on_line)
        held_back = piece.endswith(b"\r")
        if held_back:
            piece = piece[:-1]
        for i, part in enumerate(piece.split(b"\r") if b"\r" in piece else (piece,)):
            if i:
                self.carriage(on_line)
            if self.cur_len + len(part) > _HELD:  # the end, beyond the start held
                before = self.cur if self.cur_len <= _HELD else self.cur_end
                self.cur_end = (before[-END_PIECE:] + part[-END_PIECE:])[-END_PIECE:]
            room = _HELD - len(self.cur)
            if room > 0:
                self.cur += part[:room]
            self.cur_len += len(part)
            if self.cur_len > MAX_LINE and not self.told:  # its start is where the error is
                self.told = True
                if on_line is not None:
                    on_line(_text(self.cur))
            if on_line is not None and self.cur_len > _HELD:
                self._tell_middle(part[max(room, 0) :], on_line)
        self.cr = held_back

    def _tell_middle(self, spill: bytes, on_line: Callable[[str], None]) -> None:
        """Bytes of the current segment past those held: ``on_line`` gets the middle of a long
        line in windows of ``MAX_LINE`` bytes that overlap by ``MATCH_OVERLAP`` (regression: a
        sticky error past the first 16 KiB of a record and more than 4 KiB before its end was
        never matched); at most a window is held."""
        if not self.mid:  # from the end of the start told, overlapping it
            self.mid = self.cur[MAX_LINE - MATCH_OVERLAP :]
        self.mid += spill
        while len(self.mid) >= MAX_LINE:
            on_line(self.mid[:MAX_LINE].decode("utf-8", errors="replace"))
            self.mid = self.mid[MAX_LINE - MATCH_OVERLAP :]

    def carriage(self, on_line: Callable[[str], None] | None) -> None:
        """The current segment ends (a carriage return): told, then overwritten in part."""
        self.cr = False
        self._tell(on_line)
        if max(self.cur_len, self.under_len) > _HELD:  # its end is not all in what is held
            self.under_end = self._line_end()
        self.under = (self.cur + self.under[len(self.cur) :])[:_HELD]
        self.under_len = max(self.under_len, self.cur_len)
        self.cur, self.cur_len, self.cur_end, self.told = b"", 0, b"", False
        self.mid = b""

    def end(self, on_line: Callable[[str], None] | None) -> str:
        """The line ends: its last segment told; what the terminal shows, cut when too long."""
        self.cr = False  # a CRLF line end
        self._tell(on_line)
        size = self.size()
        shown = _text(self.cur + self.under[len(self.cur) :])
        if size > MAX_LINE:
            end = _end_text(self._line_end(), size - MAX_LINE)
            shown += CUT_MARK.format(total=size) + " ..." + end
        self.reset()
        return shown

    def _tell(self, on_line: Callable[[str], None] | None) -> None:
        """The current segment ends: ``on_line`` gets it (its start, if not had yet), then, where
        it was too long, its last ``END_PIECE`` bytes (a sticky error at the end of a long
        record; before, only its first ``MAX_LINE`` bytes were matched)."""
        if on_line is None or not self.cur_len:
            return
        if not self.told:
            on_line(_text(self.cur))
        # the middle not told yet (a window's first MATCH_OVERLAP bytes were), but for the end
        # piece's part: whenever the end piece starts past the middle's start, told up to
        # MATCH_OVERLAP into it (regression: not where it started less than MATCH_OVERLAP
        # after what was told, and an error across that place was missed)
        if len(self.mid) > END_PIECE:
            on_line(self.mid[: len(self.mid) - END_PIECE + MATCH_OVERLAP].decode(errors="replace"))
        if self.cur_len > MAX_LINE:
            on_line(_end_text(self.cur if self.cur_len <= _HELD else self.cur_end, self.cur_len))

    def _line_end(self) -> bytes:
        """The last bytes of the line shown (``END_PIECE`` at least, or all of it): the
        current segment's where it is the longest, else the earlier segments' end with as much
        of it as the current segment overwrote."""
        cur = self.cur if self.cur_len <= _HELD else self.cur_end
        if self.cur_len >= self.under_len:
            return cur
        if self.under_len <= _HELD:
            return self.cur + self.under[len(self.cur) :]
        over = self.cur_len - (self.under_len - len(self.under_end))
        return cur[-over:] + self.under_end[over:] if over > 0 else self.under_end

    def reset(self) -> None:
        self.under, self.under_len, self.cur, self.cur_len = b"", 0, b"", 0
        self.under_end = self.cur_end = self.mid = b""
        self.cr = self.told = False


#: The bytes of a line held for the tail: a little over ``MAX_LINE``, to cut between characters.
_HELD = MAX_LINE + 3


def _text(held: bytes) -> str:
    """The first ``MAX_LINE`` bytes of ``held`` as text (cut between UTF-8 characters)."""
    return held[: _cut_at(held, 0, MAX_LINE)].decode("utf-8", errors="replace")


def _end_text(last: bytes, beyond: int) -> str:
    """The line's end from ``last`` (its last bytes): those past its first ``MAX_LINE`` bytes,
    ``END_PIECE`` at most, from a character's start."""
    piece = last[-min(beyond, END_PIECE) :]
    start = 0
    while start < min(3, len(piece)) and piece[start] & 0xC0 == 0x80:
        start += 1  # a UTF-8 character's continuation bytes: its start is in the part cut
    return piece[start:].decode("utf-8", errors="replace")


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
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        #: The clock the tail's lines are timed by (``lines_since``).
        self._now = now
        self.file = RotatingFile(log_path, max_bytes, backups)
        self.tail = Tail()
        self._passthrough = passthrough
        #: Passthrough: the current line's bytes not passed on yet (at most ``MAX_LINE``).
        self._partial = b""
        #: Passthrough: the current line is too long (passed on in pieces).
        self._long = False
        #: The current line as the tail and ``on_line`` see it.
        self._shown = _Shown()
        self._stdout = stdout or _write_stdout
        self._prefix = f"[{name}] ".encode()
        #: Called once with every line of output, a too long one cut to its first ``MAX_LINE``
        #: bytes as soon as they are in, then again with its last ``END_PIECE`` bytes when it
        #: ends (the sticky-error patterns watch it).
        self.on_line: Callable[[str], None] | None = None
        #: The pipes being pumped (a process's, and an exited one's still held by its children).
        self._fds: set[int] = set()

    @property
    def passthrough(self) -> bool:
        """Worker output is copied to the supervisor's stdout (``log_passthrough``)."""
        return self._passthrough

    @passthrough.setter
    def passthrough(self, on: bool) -> None:
        # Turned off (a reload): what was held of the line in progress is not passed on, at
        # the next marker or in front of the next line if it is turned on again.
        if not on:
            self._partial = b""
            self._long = False
        self._passthrough = on

    def feed(self, data: bytes) -> None:
        """Take a chunk of output."""
        self.file.write(data)
        self.tail.at = self._now()
        pieces = data.split(b"\n")
        last = pieces.pop()
        shown, on_line, append = self._shown, self.on_line, self.tail.append
        if pieces and not shown.empty():  # the line in progress ends here
            shown.add(pieces[0], on_line)
            append(shown.end(on_line))
            del pieces[0]
        plain = b"\r" not in data  # one look for the whole chunk: most output has none
        for piece in pieces:
            if not plain:
                cr = piece.find(b"\r")
                if cr == len(piece) - 1:
                    piece = piece[:-1]  # a CRLF line end
                elif cr >= 0:
                    shown.add(piece, on_line)
                    append(shown.end(on_line))
                    continue
            if len(piece) > MAX_LINE:
                shown.add(piece, on_line)
                append(shown.end(on_line))
                continue
            text = piece.decode("utf-8", errors="replace")
            append(text)
            if on_line is not None:
                on_line(text)
        shown.add(last, on_line)
        if self.passthrough:
            self._pass(data)

    def _pass(self, data: bytes) -> None:
        """Passthrough: every byte, in lines of at most ``MAX_LINE`` bytes."""
        lines = (self._partial + data).split(b"\n")
        rest = lines.pop()
        out: list[bytes] = []  # one write for the whole chunk
        if lines and self._long:  # the end of a too long line
            self._end_long(self._pass_pieces(lines[0], out), out)
            del lines[0]
        prefix = self._prefix
        for line in lines:
            if len(line) > MAX_LINE:
                self._end_long(self._pass_pieces(line, out), out)
            else:
                out += (prefix, line, b"\n")
        self._partial = self._pass_pieces(rest, out) if len(rest) > MAX_LINE else rest
        if out:
            self._stdout(b"".join(out))

    def _pass_pieces(self, buf: bytes, out: list[bytes]) -> bytes:
        """Add the bytes of a too long line to ``out`` in pieces of at most ``MAX_LINE`` bytes,
        each a line of its own (cut between characters where the bytes are UTF-8); return what
        is left, ``MAX_LINE`` bytes at most."""
        self._long = True
        start = 0
        while len(buf) - start > MAX_LINE:
            cut = _cut_at(buf, start, MAX_LINE)
            out += (self._prefix, buf[start:cut], b"\n")
            start = cut
        return buf[start:]

    def _end_long(self, last: bytes, out: list[bytes]) -> None:
        """The too long line ends with ``last`` (at most ``MAX_LINE`` bytes)."""
        if last:
            out += (self._prefix, last, b"\n")
        self._long = False

    def flush_partial(self) -> None:
        """The pipe closed: keep an unterminated last line too."""
        if self._shown.size():  # an unterminated line that shows something
            self.tail.at = self._now()
            self.tail.append(self._shown.end(self.on_line))
        else:
            self._shown.reset()
        if self._long or self._partial:
            out: list[bytes] = []
            self._end_long(self._partial, out)
            if out:
                self._stdout(b"".join(out))
        self._partial = b""

    def mark(self, text: str) -> None:
        """Write a supervisor line (start/exit markers) into the log file and the tail."""
        self.flush_partial()
        line = f"--- gpu-supervisor: {text} ---"
        self.file.write(line.encode() + b"\n")
        self.tail.at = self._now()
        self.tail.append(line)

    def lines(self) -> list[str]:
        """The last lines, oldest first."""
        return list(self.tail)

    def lines_since(self, t: float) -> list[str]:
        """The last lines that came in at ``t`` or later (the clock given as ``now``)."""
        return self.tail.since(t)

    def close(self) -> None:
        """Close the log file."""
        self.file.close()

    async def pump(self, fd: int) -> None:
        """Copy the pipe ``fd`` into this sink until EOF; closes ``fd``."""
        self._fds.add(fd)
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
                # A pipe that is never empty (a worker writing flat out) would otherwise keep
                # the loop here: crash detection, the API and every other worker would wait.
                await anyio.lowlevel.checkpoint()
        finally:
            self._fds.discard(fd)
            self.flush_partial()
            os.close(fd)

    def pipe_inodes(self) -> frozenset[int]:
        """The inodes of the pipes being pumped: a process that holds one writes to this log
        (a worker's leftover that left its process group and its environment behind)."""
        out = set()
        for fd in list(self._fds):
            with contextlib.suppress(OSError):
                out.add(os.fstat(fd).st_ino)
        return frozenset(out)

    def drain(self, limit: int = DRAIN_LIMIT) -> None:
        """Take what the pipes hold now, without waiting: a process that has just exited may
        have written its last lines (the traceback that says why it died) after the last read,
        and its death is judged by the tail."""
        for fd in list(self._fds):
            taken = 0
            while taken < limit:
                try:
                    data = os.read(fd, _READ_SIZE)
                except OSError:  # BlockingIOError: nothing more for now
                    break
                if not data:
                    break
                taken += len(data)
                self.feed(data)


#: How a process's first line in the tail starts (``WorkerOutput.mark("started pid N")``).
RUN_START = "--- gpu-supervisor: started pid "


def this_run(lines: Sequence[str]) -> list[str]:
    """The lines of ``lines`` (a tail) since the last process of the worker started: what an
    exit may be judged by (an earlier process's "CUDA out of memory" is not this one's)."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(RUN_START):
            return list(lines[i:])
    return list(lines)


class Passthrough:
    """Passthrough lines to the supervisor's stdout, never waiting long on its reader.

    A reader that stopped reading (a paused terminal, a stopped pipe, a hung log shim) would
    block the write and the event loop with it. Each write waits for room at most
    ``STALL_WAIT_S``, and not at all while the stream is stalled; what does not fit is
    dropped and counted, and said in the supervisor's log (``output.passthrough_stalled``,
    then ``output.passthrough_recovered`` with the bytes lost). A reader that is gone (EPIPE)
    or a closed stdout: the output is dropped, as before.
    """

    def __init__(self, fd: int | None = None) -> None:
        self.fd = fd
        self.stalled = False
        self.dropped_bytes = 0  # in all
        self._lost = 0  # in the current stall
        self._cut = False  # a line was cut short: the next write ends it first
        self._writer: UnblockedWriter | None = None

    def __call__(self, data: bytes) -> None:
        fd = self.fd if self.fd is not None else _stdout_fd()
        if fd is None:
            return
        if self._cut:
            data = b"\n" + data
        if self._writer is None or self._writer.fd != fd:
            self._writer = UnblockedWriter(fd)
        try:
            written = self._writer.write(data, 0.0 if self.stalled else STALL_WAIT_S)
        except OSError:
            return  # gone (EPIPE, EBADF) or failing (ENOSPC): nothing to do but drop it
        if written < len(data):
            if written:  # (else a cut line stays cut, its newline still to come)
                self._cut = data[written - 1 : written] != b"\n"
            self.dropped_bytes += len(data) - written
            self._lost += len(data) - written
            if not self.stalled:
                self.stalled = True
                structlog.get_logger().warning(
                    "output.passthrough_stalled",
                    reason="stdout's reader stopped reading: passthrough output is dropped",
                )
            return
        self._cut = False
        if self.stalled:
            self.stalled = False
            structlog.get_logger().info("output.passthrough_recovered", dropped_bytes=self._lost)
            self._lost = 0


def _stdout_fd() -> int | None:
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # closed, or no descriptor (captured)
        return None


_write_stdout = Passthrough()


def _cut_at(buf: bytes, start: int, size: int) -> int:
    """The end of a piece of ``buf`` from ``start``, ``size`` bytes at most: not inside a UTF-8
    character, unless the bytes there are not UTF-8."""
    cut = start + size
    if cut >= len(buf):
        return len(buf)
    for back in range(4):  # a UTF-8 character has at most 3 continuation bytes
        if buf[cut - back] & 0xC0 != 0x80 and cut - back > start:
            return cut - back
    return cut


# --- reading a worker's log back (the API's /workers/{name}/log, ``gpu-supervisor logs``) ---

#: The most a single read of a log returns.
MAX_LOG_READ = 1024 * 1024


@dataclass(frozen=True, slots=True)
class LogChunk:
    """A piece of a worker's log (``RotatingFile.read``)."""

    data: bytes
    #: the file ``data`` came from ("": no log yet), and where in it the next read starts: a
    #: reader that follows the log passes both back, and never misses what a rotation moved
    file: str
    offset: int
    #: the place asked for is gone (rotated past the last backup, the log emptied on a full
    #: disk, or a file of another run of the supervisor): ``data`` starts at the oldest byte
    #: still there
    lost: bool = False


def _read_at(fd: int, offset: int, limit: int) -> bytes:
    parts, left = [], limit
    while left > 0:
        piece = os.pread(fd, min(left, _READ_SIZE), offset)
        if not piece:
            break
        parts.append(piece)
        offset += len(piece)
        left -= len(piece)
    return b"".join(parts)


def _same_file(file: str, ids: Sequence[str], run: str) -> int | None:
    """Where ``file``, an id an earlier run of the supervisor gave, is among ``ids`` (by its
    inode and its tag: a file that run rotated is still the same file; another that took
    its inode since has another tag), or None."""
    theirs, _, rest = file.partition(".")
    inode = rest.partition(".")[2]  # "dev-ino" or "dev-ino.tag"
    if theirs == run or not inode:
        return None
    for i, name in enumerate(ids):
        if name.split(".", 2)[2:] == [inode]:
            return i
    return None


def _read_from(
    fds: Sequence[tuple[int, os.stat_result, str]],
    limit: int,
    file: str | None,
    offset: int,
    run: str = "",
) -> LogChunk:
    """``RotatingFile.read`` on the files open as ``fds`` (newest first, with their ids)."""
    if not fds:
        return LogChunk(b"", "", 0, lost=bool(file))
    ids = [name for _, _, name in fds]
    if file is None:  # the last `limit` bytes, from the rotated files too (just rotated: the
        fd, st, _ = fds[0]  # newest file holds a line or two); the place is the newest file's
        start = max(0, st.st_size - limit)
        newest = _read_at(fd, start, limit)
        parts, left = [newest], limit - len(newest)
        for fd, st, _ in fds[1:]:
            if left <= 0:
                break
            begin = max(0, st.st_size - left)
            parts.append(_read_at(fd, begin, st.st_size - begin))
            left -= len(parts[-1])
        return LogChunk(b"".join(reversed(parts)), ids[0], start + len(newest))
    lost = False
    found = ids.index(file) if file in ids else _same_file(file, ids, run)
    if found is not None:
        at = found
    else:  # gone (or never seen): from the oldest byte there is
        at, offset, lost = len(fds) - 1, 0, file != ""
    if offset > fds[at][1].st_size:  # not so far in it (a client's mistake): from its start
        offset, lost = 0, True
    while True:
        data = _read_at(fds[at][0], offset, limit)
        if data or at == 0:
            return LogChunk(data, ids[at], offset + len(data), lost)
        at, offset = at - 1, 0  # that file is done: on to the next newer one
