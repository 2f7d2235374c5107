"""A fast read of every process's parent, CPU time and RSS from ``/proc/<pid>/stat``.

The sampler and the tree kill need the whole process table several times a second. psutil's
per-process objects cost ~10 ms per tick for 32 workers on this class of machine (budget: 2.5 ms,
docs/benchmarks.md), and psutil has no public "whole table in one pass" call, so this module reads
one ``stat`` line per process. psutil is still used for everything else (signals with create-time
checks, the rare lookups).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """One process: parent pid, CPU seconds (user + system), resident MiB, start time (ticks)."""

    pid: int
    ppid: int
    cpu_s: float
    rss_mb: float
    start_ticks: int
    zombie: bool  # exited, not reaped (not one whose main thread alone exited)


def read_stat(pid: int) -> ProcStat | None:
    """Parse ``/proc/<pid>/stat`` (None if the process is gone)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name is in parentheses and may contain anything: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    if len(rest) < 22:
        return None
    zombie = rest[0] == b"Z"
    rss = int(rest[21])
    if zombie and int(rest[17]) > 1:
        # Its main thread exited (pthread_exit) and other threads run on: the process lives
        # (its memory held, its children its own), and its memory is theirs (the leader's
        # own line says 0).
        zombie = False
        rss = _threads_rss(pid)
    return ProcStat(
        pid=pid,
        ppid=int(rest[1]),
        cpu_s=(int(rest[11]) + int(rest[12])) / _TICKS,
        rss_mb=rss * _PAGE_MB,
        start_ticks=int(rest[19]),
        zombie=zombie,
    )


def _threads_rss(pid: int) -> int:
    """The resident pages of ``pid`` as a live thread of it sees them (0 if none is left)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        if tid == str(pid):
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                rest = fh.read(4096).rpartition(b")")[2].split()
        except OSError:
            continue
        if len(rest) >= 22 and rest[0] != b"Z":
            return int(rest[21])
    return 0


_boot_time: float | None = None


def boot_time() -> float:
    """Seconds since the epoch at boot (``btime`` of ``/proc/stat``, as psutil reads it)."""
    global _boot_time
    if _boot_time is None:
        with open("/proc/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime"):
                    _boot_time = float(line.split()[1])
                    break
            else:
                _boot_time = 0.0
    return _boot_time


def ticks_per_second() -> int:
    """Clock ticks per second of ``/proc/<pid>/stat`` times (``SC_CLK_TCK``)."""
    return int(_TICKS)


_boot_id: str | None = None


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``; "" where unreadable)."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
                _boot_id = fh.read().strip()
        except OSError:
            _boot_id = ""
    return _boot_id


def create_time(pid: int) -> float | None:
    """The process's create time as psutil reports it (None if it is gone)."""
    st = read_stat(pid)
    if st is None:
        return None
    return ticks_to_time(st.start_ticks)


def ticks_to_time(start_ticks: int) -> float:
    """A start time in clock ticks since boot (``/proc/<pid>/stat``) as psutil's create time."""
    return start_ticks / _TICKS + boot_time()


def scan() -> dict[int, ProcStat]:
    """Every visible process."""
    out: dict[int, ProcStat] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                st = read_stat(int(entry.name))
                if st is not None:
                    out[st.pid] = st
    return out


def pss_mb(pid: int) -> float | None:
    """The proportional set size of ``pid`` (``smaps_rollup``: each page shared with N
    processes counts 1/N), or None when it cannot be read (gone, no permission, a kernel before
    4.14). Costs a walk of the process's page tables: read only where RSS says too much."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            data = fh.read(8192)
    except OSError:
        return None
    for line in data.splitlines():
        if line.startswith(b"Pss:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) / 1024
    return None


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited process holds no memory)."""
    st = read_stat(pid)
    return st is not None and not st.zombie


def is_process(pid: int) -> bool:
    """``pid`` names a process here (a thread group), not one of its threads: ``/proc/<tid>``
    answers for a thread's id too, though ``/proc`` does not list it. False when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Tgid:"):
                    return line.split()[1:2] == [str(pid).encode()]
    except OSError:
        pass
    return False


def nspids(pid: int) -> tuple[int, ...]:
    """``NSpid`` of ``/proc/<pid>/status``: the pid here, then in each nested PID namespace.

    One entry for a process in our own namespace; empty if it is gone or the kernel (< 4.1)
    does not say.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"NSpid:"):
                    return tuple(int(v) for v in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def inner_pids(pids: Iterable[int]) -> dict[int, int]:
    """Innermost-namespace pid -> pid here, for those of ``pids`` in a nested PID namespace.

    A worker started in a PID namespace of its own (``unshare --pid``, a nested container) may be
    listed by NVML under its pid there. A pid that two processes share (two namespaces each
    have their pid 1) is left out: it cannot be told apart.
    """
    out: dict[int, int] = {}
    shared: set[int] = set()
    for pid in pids:
        ns = nspids(pid)
        if len(ns) < 2 or ns[0] != pid:
            continue
        inner = ns[-1]
        if inner in out and out[inner] != pid:
            shared.add(inner)
        out[inner] = pid
    for inner in shared:
        del out[inner]
    return out


def children_map(table: Mapping[int, ProcStat]) -> dict[int, list[int]]:
    """Parent pid -> child pids."""
    out: dict[int, list[int]] = {}
    for st in table.values():
        out.setdefault(st.ppid, []).append(st.pid)
    return out


def tree(root: int, children: Mapping[int, Iterable[int]]) -> set[int]:
    """``root`` and every descendant."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stack.extend(children.get(pid, ()))
    return seen


class CachedTable:
    """The process table, re-read at most every ``ttl_s`` (workers stopping together share it)."""

    def __init__(self, ttl_s: float = 0.02) -> None:
        self.ttl_s = ttl_s
        self._at = -1e9
        self._children: dict[int, list[int]] = {}

    def children(self) -> dict[int, list[int]]:
        """Parent -> children, at most ``ttl_s`` old."""
        now = time.monotonic()
        if now - self._at > self.ttl_s:
            self._children = children_map(scan())
            self._at = now
        return self._children


TABLE = CachedTable()


def carrying(name: str, value: str) -> dict[int, dict[str, str]]:
    """Every readable process whose initial environment has ``name=value``: pid -> that
    environment (one read of ``/proc/<pid>/environ`` each; unreadable ones are skipped)."""
    needle = f"{name}={value}".encode()
    out: dict[int, dict[str, str]] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            items = data.split(b"\0")
            if needle in items:
                env = (i.decode(errors="replace").partition("=") for i in items if b"=" in i)
                out[int(entry.name)] = {k: v for k, _, v in env}
    return out


def environ_value(pid: int, name: str) -> str | None:
    """``name`` in ``pid``'s initial environment (None: not there, or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def adopted_by(pid: int, start_ticks: int, leaders: Mapping[int, str], var: str) -> str | None:
    """The worker a process re-parented to the supervisor belongs to, while that worker's main
    process lives (a daemon that double-forked: the process between them exited), or None.

    ``leaders``: main pid -> worker name. Its worker is the one whose main process leads its
    process group, else (it left the group with ``setsid``) the one named by ``var`` in its
    environment, if it started after that worker's main process (not what an earlier run of
    the worker left).
    """
    with contextlib.suppress(OSError):
        pgid = os.getpgid(pid)
        if pgid in leaders:
            return leaders[pgid]
    name = environ_value(pid, var)
    if name is None:
        return None
    for leader, worker in leaders.items():
        if worker == name:
            st = read_stat(leader)
            if st is not None and not st.zombie and st.start_ticks <= start_ticks:
                return worker
    return None


#: How far up from a sender the owner walk goes (a deeper tree is nobody's).
ANCESTORS_MAX = 64
#: How many times the walk starts again from the sender when an ancestor it was about to read
#: exited (and was reaped) under it: its children were re-parented, so a fresh walk sees them.
WALK_RESTARTS = 3


def owner_of(
    pid: int,
    mains: Mapping[int, T],
    me: int,
    adopt: Callable[[int, int], T | None],
    read: Callable[[int], ProcStat | None] = read_stat,
) -> T | None:
    """Whose process ``pid`` is: the owner of ``mains`` (main pid -> owner) it is, or descends
    from, or, once the walk up reaches a process re-parented to ``me`` (a daemon that
    double-forked, ``me`` its subreaper or PID 1), ``adopt(pid, start_ticks)`` of that process.

    Reads nothing when ``pid`` is a main process. An ancestor that exits while the walk reads
    the chain (the process between a double-forked daemon and its launcher exits the moment it
    forked) breaks the chain for this walk only: the walk starts again from ``pid``, whose
    parent is by then the process that adopted it.
    """
    current = pid
    restarts = 0
    for _ in range(ANCESTORS_MAX + WALK_RESTARTS):
        owner = mains.get(current)
        if owner is not None:
            return owner
        st = read(current)
        if st is None:
            if current == pid or restarts >= WALK_RESTARTS:
                return None  # the sender itself is gone (or /proc is unreadable)
            restarts += 1
            current = pid
            continue
        if st.ppid <= 0 or st.ppid == current:
            return None
        if st.ppid == me:
            return adopt(current, st.start_ticks)
        current = st.ppid
    return None


class UnknownPids:
    """Senders found to be no worker's, remembered for ``ttl_s`` each by pid and start time
    (a pid another process took since is looked up), at most ``size`` (the oldest go first):
    a flood of datagrams from another program costs one ``stat`` read each, not a walk."""

    def __init__(self, ttl_s: float = 1.0, size: int = 1024) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._until: dict[int, tuple[float, int]] = {}  # pid -> (until, start_ticks), by age

    def known(self, pid: int, start_ticks: int, now: float) -> bool:
        """Whether ``pid``, started at ``start_ticks``, was found no worker's within ``ttl_s``."""
        entry = self._until.get(pid)
        return entry is not None and now < entry[0] and entry[1] == start_ticks

    def add(self, pid: int, start_ticks: int, now: float) -> None:
        """``pid`` (started at ``start_ticks``) is no worker's, as of ``now``."""
        self._until.pop(pid, None)  # re-inserted last: the dict stays ordered by time
        while self._until and (
            len(self._until) >= self.size or next(iter(self._until.values()))[0] <= now
        ):
            del self._until[next(iter(self._until))]
        self._until[pid] = (now + self.ttl_s, start_ticks)

    def clear(self) -> None:
        """Forget them all (a worker's main process was registered)."""
        self._until.clear()


def tasks_of_user(uid: int) -> int | None:
    """The processes and threads whose real user is ``uid`` (as RLIMIT_NPROC counts them)."""
    count = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                real = threads = None
                for line in f:
                    if line.startswith("Uid:"):
                        real = int(line.split()[1])
                    elif line.startswith("Threads:"):
                        threads = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue
        if real == uid and threads is not None:
            count += threads
    return count


def own_children() -> set[int]:
    """This process's children that orphans become: ``/proc/self/task/<pid>/children``.

    The kernel hands an orphan to a subreaper's first live thread (the main one), and workers
    are spawned from the main thread too; children a helper thread started are not listed.
    One small read, where a scan of all of ``/proc`` would cost milliseconds; the scan where
    the kernel lacks the file (``CONFIG_PROC_CHILDREN``).
    """
    pid = os.getpid()
    try:
        with open(f"/proc/self/task/{pid}/children", "rb") as fh:
            return {int(p) for p in fh.read().split()}
    except (OSError, ValueError):
        return set(TABLE.children().get(pid, ()))


def oom_kills(cgroup_events: Path | None = None) -> int | None:
    """The kernel's count of OOM kills: a cgroup's ``memory.events`` when given and readable,
    else ``/proc/vmstat``'s ``oom_kill`` (Linux 4.13+); None when neither can be read."""
    for path, key in ((cgroup_events, "oom_kill"), (Path("/proc/vmstat"), "oom_kill")):
        if path is None:
            continue
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    return None
