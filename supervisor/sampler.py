"""The sampler: one immutable ``Sample`` per tick, and the XID event loop.

Per tick, in one call on a dedicated worker thread (so the event loop never blocks on NVML or
``/proc``): the backend's device readings, then each worker's process tree (leader plus every
descendant), its RSS and CPU through psutil, and its GPU memory through ``policy.attribution``.
XID events are read by a bounded wait in a second thread. An unavailable backend is retried with
backoff; the supervisor never stops for NVML.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import ParamSpec, TypeVar

import anyio
import anyio.abc
import structlog

from supervisor import procfs
from supervisor.backends.base import PLACEHOLDER, GpuBackend
from supervisor.errors import BackendError, BackendUnavailable
from supervisor.model import DeviceIdentity, DeviceSample, Sample, WorkerUsage, XidEvent
from supervisor.plan import WORKER_VAR
from supervisor.policy.attribution import attribute
from supervisor.records import ThreadUnavailable, in_thread

T = TypeVar("T")
P = ParamSpec("P")

XID_WAIT_S = 1.0
#: The error of a GPU seen before that the driver no longer lists.
LOST_UNLISTED = "GPU is lost: the driver no longer lists it"
REOPEN_INITIAL_S = 1.0
REOPEN_MAX_S = 60.0
#: The longest wait between re-opens while the backend lists some GPUs but not every one seen
#: before: each re-open is a short gap in the other GPUs' telemetry and XID events.
PARTIAL_REOPEN_MAX_S = 300.0
#: Without GPU telemetry only the host is sampled, and less often (nothing urgent to catch).
HOST_ONLY_INTERVAL_S = 2.0
#: ``/proc`` is read at most this often for host RSS and CPU, however often the GPU is sampled
#: (a shorter ``leak_window_s`` reads it more often: see ``host_interval``).
HOST_EVERY_S = 2.0
#: The whole process table is scanned (to find new descendants) at least this often.
FULL_SCAN_EVERY_S = 5.0
#: The next full scan after one that found a new main process comes this soon (seconds).
YOUNG_RESCAN_S = 1.0
#: A tick or XID wait that keeps failing (no file descriptor, no thread) is logged this often.
FAILURE_LOG_EVERY_S = 60.0
#: A backend call in flight for longer than this (seconds, or this many sampling intervals if
#: that is longer) is stuck: said in the log (``gpu.call_stuck``), and telemetry counts as down
#: (the last sample only grows older).
STUCK_AFTER_S = 5.0
STUCK_AFTER_INTERVALS = 10
#: At the stop, the backend is closed once the call in flight returns, waiting this long at
#: most (seconds): a hung driver's call is left behind, and NVML is not shut down.
CLOSE_WAIT_S = 2.0


def host_interval(leak_windows_s: Iterable[float]) -> float:
    """How often to read ``/proc``: ``HOST_EVERY_S``, or more often for short leak windows.

    The host RSS leak detector wants about a hundred readings per window.
    """
    return min([HOST_EVERY_S, *(w / 100 for w in leak_windows_s)])


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """What the sampler needs to know about a worker: its main pid, its GPUs and its host
    memory budget (0: none; over it by RSS, the tree's PSS is read too)."""

    pid: int | None
    gpus: tuple[str, ...] | None
    host_budget_mb: float = 0.0


class HostSampler:
    """Process trees, RSS and CPU of every worker from ``/proc`` (blocking).

    A full scan of the process table happens every ``full_every_s`` seconds, when a worker has a
    new main pid, or when NVML lists a pid we do not know; in between only the ``stat`` lines of
    known tree members are read, so a tick costs one small read per worker process.
    """

    def __init__(self, full_every_s: float = FULL_SCAN_EVERY_S, every_s: float = 0.0) -> None:
        self.full_every_s = full_every_s
        self.every_s = every_s
        self._usage: dict[str, tuple[float | None, float | None]] = {}
        self._result: dict[str, frozenset[int]] = {}
        self._pids: frozenset[int] = frozenset()  # the pids the last read found alive
        self._visible: frozenset[int] = frozenset()
        self._aliases: dict[int, int] = {}
        self._cpu: dict[tuple[int, int], float] = {}  # (pid, start ticks) -> CPU seconds
        self._at: float | None = None
        self._next_full = 0.0
        self._trees: dict[str, frozenset[int]] = {}
        self._leaders: dict[str, int | None] = {}
        self._foreign: frozenset[int] = frozenset()  # GPU pids that are not any worker's
        #: Start time (clock ticks) of every tree member when a full scan found it, kept while
        #: it lives: a pid read again between scans counts only while it is that process, and
        #: what is left of a tree after its leader exits is killed only if it still is.
        self.starts: dict[int, int] = {}
        self.full_scans = 0
        #: worker -> the PSS of its tree (MiB), read with the last reading where the RSS of a
        #: tree of several processes was over the worker's budget: pages its forked processes
        #: share count once there, once per process in the RSS
        self.pss: dict[str, float] = {}

    def _full(self, leaders: Mapping[str, int | None]) -> dict[int, procfs.ProcStat]:
        self.full_scans += 1
        table = procfs.scan()
        children = procfs.children_map(table)
        trees: dict[str, frozenset[int]] = {}
        for name, leader in leaders.items():
            st = None if leader is None else table.get(leader)
            if leader is None or st is None:
                continue
            before = self._trees.get(name, frozenset())
            if st.zombie and leader in before:
                # The leader exited and is not reaped yet: its children were re-parented, so
                # the walk would lose them; the tree seen before still names them (each
                # while it is the process seen then: a pid reused since is not the worker's).
                trees[name] = frozenset(
                    p for p in before if p in table and self.starts.get(p) == table[p].start_ticks
                )
            else:
                trees[name] = frozenset(procfs.tree(leader, children))
        self._adopt(table, children, trees, leaders)
        self._trees = trees
        # Start times: kept for pids that live on (a leftover outside every tree included),
        # refreshed for members the walk found, dropped for pids that are gone.
        starts = {pid: t for pid, t in self.starts.items() if pid in table}
        for members in trees.values():
            for pid in members:
                starts[pid] = table[pid].start_ticks
        self.starts = starts
        return table

    def _adopt(
        self,
        table: Mapping[int, procfs.ProcStat],
        children: Mapping[int, Iterable[int]],
        trees: dict[str, frozenset[int]],
        leaders: Mapping[str, int | None],
    ) -> None:
        """Add to ``trees`` the processes re-parented to the supervisor (child subreaper or PID
        1) whose worker still runs, with what is below them: a daemon that double-forked is no
        descendant of its worker's main process any more, but its GPU and host memory, its
        CPU, and its stop are still the worker's."""
        main = {leader: name for name, leader in leaders.items() if leader is not None}
        me = os.getpid()
        for pid, st in table.items():
            if st.ppid != me or pid in main or st.zombie:
                continue
            name = procfs.adopted_by(pid, st.start_ticks, main, WORKER_VAR)
            if name is not None and name in trees:
                trees[name] = trees[name] | procfs.tree(pid, children)

    def member_create_time(self, pid: int) -> float | None:
        """The create time of tree member ``pid`` (psutil's), only while ``pid`` still is the
        process a read of the trees found; None for a pid that exited, or was reused since, or
        was never a member. ``state.json`` records trees with it: the trees may be seconds
        old, and a reused pid recorded with its new process's create time would be killed as
        an orphan by a supervisor started after a SIGKILL of this one."""
        st = procfs.read_stat(pid)
        if st is None or self.starts.get(pid) != st.start_ticks:
            return None
        return procfs.ticks_to_time(st.start_ticks)

    def sample(
        self,
        leaders: Mapping[str, int | None],
        gpu_pids: frozenset[int] = frozenset(),
        budgets: Mapping[str, float] | None = None,
    ) -> tuple[
        dict[str, frozenset[int]], dict[str, tuple[float | None, float | None]], frozenset[int]
    ]:
        """Trees, (rss_mb, cpu_percent) per worker, and which of ``gpu_pids`` exist here.

        ``/proc`` is read at most every ``every_s`` (the GPU may be sampled more often): in
        between, the last reading is returned, unless a worker has a new main pid or NVML lists
        a pid we cannot place, which are read at once. ``budgets``: worker -> host memory
        budget (MiB): where a tree of several processes is over it by RSS, its PSS is read
        (``pss``).
        """
        now = time.monotonic()
        known = frozenset().union(*self._trees.values()) if self._trees else frozenset()
        moved = any(self._leaders.get(n) != pid for n, pid in leaders.items() if pid is not None)
        unplaced = bool(gpu_pids - known - self._foreign - self._aliases.keys())
        if (
            not unplaced
            and self._at is not None
            and now - self._at < self.every_s
            and dict(leaders) == self._leaders
        ):
            visible = gpu_pids & (self._pids | self._visible)
            return dict(self._result), dict(self._usage), visible
        stale = now >= self._next_full or moved or unplaced
        if stale:
            # A new main process forks its helpers (ranks, loaders, daemons) in its first
            # moments, after the scan that found it: look again soon, then at the usual pace.
            every = min(YOUNG_RESCAN_S, self.full_every_s) if moved else self.full_every_s
            self._next_full = now + every
        self._leaders = dict(leaders)
        table: dict[int, procfs.ProcStat]
        if stale:
            table = self._full(leaders)
            ours = frozenset().union(*self._trees.values()) if self._trees else frozenset()
            unexplained = gpu_pids - ours
            # A worker in a PID namespace of its own may be listed by NVML under its pid there.
            self._aliases = procfs.inner_pids(ours) if unexplained else {}
            self._foreign = unexplained - self._aliases.keys()
        else:
            table = {}
            for pid in known:
                st = procfs.read_stat(pid)
                # a pid that now names another process (reused) is no member any more
                if st is not None and self.starts.get(pid, st.start_ticks) == st.start_ticks:
                    table[pid] = st
            self._trees = {n: frozenset(t & table.keys()) for n, t in self._trees.items()}
        # a pid NVML lists that exists here; not a thread's id: in a container without the
        # host PID namespace NVML lists host pids, and one equal to a thread id of ours is no
        # process of ours (regression: taken for one, the worker alone on that GPU read 0 MiB
        # instead of the GPU's processes, attributed by device)
        visible = frozenset(p for p in gpu_pids if p in table or procfs.is_process(p))
        elapsed = None if self._at is None else now - self._at
        cpu_now: dict[tuple[int, int], float] = {}
        trees: dict[str, frozenset[int]] = {}
        usage: dict[str, tuple[float | None, float | None]] = {}
        for name, leader in leaders.items():
            members = self._trees.get(name, frozenset()) if leader is not None else frozenset()
            trees[name] = members
            if not members:
                usage[name] = (None, None)
                continue
            rss = 0.0
            cpu: float | None = 0.0
            for pid in members:
                st = table.get(pid)
                if st is None or st.zombie:
                    continue
                rss += st.rss_mb
                key = (pid, st.start_ticks)
                cpu_now[key] = st.cpu_s
                before = self._cpu.get(key)
                if cpu is not None and elapsed and before is not None:
                    cpu += max(0.0, st.cpu_s - before) / elapsed * 100
                elif not elapsed:
                    cpu = None  # first tick: no interval to measure over
            usage[name] = (rss, cpu)
        self.pss = {}
        for name, budget in (budgets or {}).items():
            members = trees.get(name, frozenset())
            used = usage.get(name, (None, None))[0]
            if budget <= 0 or used is None or used <= budget or len(members) < 2:
                continue
            live = [p for p in members if (st := table.get(p)) is not None and not st.zombie]
            figures = [procfs.pss_mb(p) for p in live]
            if live and None not in figures:  # one unreadable: the RSS stands
                self.pss[name] = sum(f for f in figures if f is not None)
        self._cpu = cpu_now
        self._at = now
        self._usage = dict(usage)
        self._result = dict(trees)
        self._pids = frozenset(table)
        self._visible = visible
        return trees, usage, visible

    @property
    def read_at(self) -> float | None:
        """When ``/proc`` was last read (monotonic): the time of the figures returned."""
        return self._at

    @property
    def aliases(self) -> Mapping[int, int]:
        """Pid in a worker's own PID namespace -> its pid here (from ``NSpid``, unique only)."""
        return self._aliases


def replaced_gpus(
    seen: Mapping[str, DeviceIdentity], listed: Iterable[DeviceIdentity]
) -> list[tuple[DeviceIdentity, DeviceIdentity]]:
    """The GPUs replaced (hot-swapped, or another GPU in the slot after a driver reload):
    ``(old, new)`` for each GPU ``listed`` whose UUID was never ``seen``, at the index where
    exactly one GPU seen before was last, that is not listed now. Not a placeholder (a GPU
    whose UUID cannot be read: maybe the old one itself, ``Sampler._known``), nor a slot whose
    GPU is listed at another index now (renumbered by a removal: left lost, not guessed)."""
    listed = tuple(listed)
    uuids = {i.uuid for i in listed}
    out = []
    for new in listed:
        if new.uuid in seen or new.uuid.startswith(PLACEHOLDER):
            continue
        gone = [i for i in seen.values() if i.index == new.index and i.uuid not in uuids]
        if len(gone) == 1:
            out.append((gone[0], new))
    return out


def stuck_text(seconds: float) -> str:
    """The error while a backend call has not returned for ``seconds``."""
    return f"an NVML call has not returned for {seconds:.0f} s (the driver may be hung)"


class Sampler:
    """Owns the backend; produces samples and XID events until cancelled."""

    def __init__(
        self,
        backend_factory: Callable[[], GpuBackend],
        interval_s: float,
        workers: Callable[[], Mapping[str, WorkerRef]],
        on_sample: Callable[[Sample], None],
        on_xid: Callable[[XidEvent], None],
    ) -> None:
        self._factory = backend_factory
        self.interval_s = interval_s
        self._workers = workers
        self._on_sample = on_sample
        self._on_xid = on_xid
        self.backend: GpuBackend | None = None
        self.identities: tuple[DeviceIdentity, ...] = ()
        self._seen: dict[str, DeviceIdentity] = {}  # every GPU listed since the backend opened
        #: every GPU replaced (``replaced_gpus``), in order: (old UUID, new UUID); the old one
        #: is retired (no longer seen, so not lost), the runtime forgets its marks
        self.replaced: list[tuple[str, str]] = []
        #: old UUID -> new UUID of the replaced GPUs not listed again since
        self._retired: dict[str, str] = {}
        self.error: str | None = None
        self.available = False
        #: the last open failed because the GPU library itself is not there (no NVML on this
        #: machine), not because a library that is there did not answer
        self.library_absent = False
        #: ``auto`` kept this backend on a library that did not initialise at start: its
        #: same failure again at a retry is not said again
        self._auto_kept = False
        self._host = HostSampler(every_s=HOST_EVERY_S)
        self._limiter = anyio.CapacityLimiter(1)
        self._host_limiter = anyio.CapacityLimiter(1)  # host reads go on while a GPU call hangs
        self._host_lock = threading.Lock()
        self._tick_token = 0  # a tick given up on (its GPU call hung) has an old one
        self._said_stuck = False  # gpu.call_stuck said, gpu.call_returned not yet
        self._opening: GpuBackend | None = None  # the backend whose open() is in flight
        self._gpus_opened = anyio.Event()  # set when a backend with GPUs is opened (XID loop)
        self._xid_limiter = anyio.CapacityLimiter(1)
        #: when the backend call now in flight began (None: none is): a hung driver
        self._call_since: float | None = None
        self._no_call = threading.Event()  # set while no backend call is in flight
        self._no_call.set()
        self._reopen_delay = REOPEN_INITIAL_S
        self._reopen_at = 0.0
        self._wake = anyio.Event()
        self.last: Sample | None = None
        self._log = structlog.get_logger()
        #: ticks lost to an OSError: out of file descriptors, or no thread to be had
        #: (``ThreadUnavailable``: the pids cgroup, systemd's ``TasksMax``, is full)
        self.tick_errors = 0
        self.xid_wait_errors = 0  # XID waits that found no thread (the events wait in NVML)
        #: GPU UUID -> why its XIDs are not watched now (GPU object, metrics, log)
        self.xids_unwatched: dict[str, str] = {}
        #: GPU UUID -> why: GPUs kept healthy at the last sample without a handle (a passing
        #: error after a re-init), so not registered for XID events (``_with_missing``)
        self._unopened: dict[str, str] = {}
        self._logged_at: dict[str, float] = {}

    @property
    def host_every_s(self) -> float:
        """How often ``/proc`` is read for host RSS and CPU (see ``HostSampler``)."""
        return self._host.every_s

    @host_every_s.setter
    def host_every_s(self, value: float) -> None:
        self._host.every_s = value

    def started_ticks(self, pid: int) -> int | None:
        """When tree member ``pid`` started (clock ticks), as the last read of ``/proc`` saw it."""
        return self._host.starts.get(pid)

    def member_create_time(self, pid: int) -> float | None:
        """``HostSampler.member_create_time``."""
        return self._host.member_create_time(pid)

    @property
    def aliases(self) -> Mapping[int, int]:
        """``HostSampler.aliases``: pid in a worker's own PID namespace -> its pid here."""
        return self._host.aliases

    @property
    def backend_name(self) -> str:
        """``nvml``, ``sim`` or ``none``."""
        return self.backend.name if self.backend is not None else "none"

    async def open(self, fallback: bool = False) -> bool:
        """Open the backend (in the NVML thread); False (degraded) if it is unavailable.
        ``fallback``: the caller runs without telemetry when the open fails because the
        library is absent (``auto`` on a machine without NVML: ``library_absent``), so such a
        failure is not announced as one retried (``gpu.unavailable``); any other failure (a
        driver not loaded yet, a call that hangs) is, with why ``auto`` keeps the backend.
        Regression: ``auto`` fell back for good on any failure, though a GPU machine whose
        driver loads late answers seconds later."""
        backend = self._opening = self._factory()
        try:
            opened = await self._bounded(self._guarded(backend.open))
            self.identities = self._named_all(opened)
            self._retire(self.identities)
        except BackendUnavailable as exc:
            before, self.error = self.error, str(exc)
            self.available = False
            self.library_absent = exc.library_absent and self.stuck_for_s() is None
            self.backend, self._opening = backend, None
            retry_in_s = self._schedule_reopen(REOPEN_MAX_S)
            # auto kept on a library that does not initialise (a late driver, or a machine
            # without GPUs that has the library): the same failure is said once, not at
            # every retry (regression: a warning a minute for ever on CPU nodes)
            self._auto_kept = self._auto_kept or (fallback and not self.library_absent)
            repeated = self._auto_kept and not fallback and before == self.error
            if not (fallback and self.library_absent) and not repeated:
                kept = {}
                if fallback:  # auto at the start: say why it is kept
                    why = (
                        "its open has not returned (a slow driver)"
                        if self.stuck_for_s() is not None
                        else "its library is there but did not initialise (driver not loaded yet?)"
                    )
                    kept["reason"] = (
                        f"backend auto: {why}; keeping {backend.name}, retrying with backoff"
                    )
                self._log.warning(
                    "gpu.unavailable",
                    backend=backend.name,
                    error=str(exc),
                    retry_in_s=retry_in_s,
                    **kept,
                )
            return False
        self.backend, self._opening = backend, None
        self.available = True
        self.error = None
        self.library_absent = False
        if self.identities:
            self._gpus_opened.set()
        if self._misses_seen():
            # it does not list every GPU seen before (re-initialised while the driver was
            # still bringing some up): opened again with backoff until it does. Regression: it
            # was never opened again, and the GPUs stayed lost (their quarantine not liftable)
            # until the supervisor was restarted
            self._schedule_reopen(PARTIAL_REOPEN_MAX_S if self.identities else REOPEN_MAX_S)
        # the backoff starts over after a good sample, not here: a backend that opens but
        # fails every sample (UNINITIALIZED on every call) would otherwise reopen every 2 s
        self._remember(self.identities)
        self._log.info(
            "gpu.backend",
            backend=backend.name,
            devices=len(self.identities),
            uuids=[i.uuid for i in self.identities],
        )
        return True

    def _schedule_reopen(self, cap_s: float) -> float:
        """Open the backend again after the current backoff, at most ``cap_s`` (no telemetry
        at all is retried within ``REOPEN_MAX_S``, though a GPU missing had grown the wait to
        ``PARTIAL_REOPEN_MAX_S``: regression, every GPU unwatched for 5 minutes), the next
        wait doubled up to ``cap_s``; return this wait."""
        wait_s = min(self._reopen_delay, cap_s)
        self._reopen_at = time.monotonic() + wait_s
        self._reopen_delay = min(wait_s * 2, cap_s)
        return wait_s

    def _misses_seen(self) -> bool:
        """The backend opened but does not list every GPU seen before: opened again."""
        listed = {i.uuid for i in self.identities}
        return self.available and any(uuid not in listed for uuid in self._seen)

    def _remember(self, identities: Iterable[DeviceIdentity]) -> None:
        for ident in identities:
            if not ident.uuid.startswith(PLACEHOLDER):
                self._seen[ident.uuid] = ident
                if self._retired:
                    self._retired.pop(ident.uuid, None)  # put back: seen again

    def _retire(self, listed: Iterable[DeviceIdentity]) -> None:
        """Retire each GPU seen before that a GPU ``listed`` replaced (``replaced_gpus``),
        said once: it is no longer lost, nor a reason to open the backend again. Regression:
        it stayed lost until the supervisor restarted, and NVML was opened again every
        ``PARTIAL_REOPEN_MAX_S`` for it (a gap in the other GPUs' telemetry each time)."""
        for old, new in replaced_gpus(self._seen, listed):
            del self._seen[old.uuid]
            self._retired[old.uuid] = new.uuid
            self.replaced.append((old.uuid, new.uuid))
            self._log.warning(
                "gpu.replaced",
                index=new.index,
                old_uuid=old.uuid,
                new_uuid=new.uuid,
                reason="a GPU never seen is listed where this one was: the old GPU is "
                "retired, the new one is a fresh device",
            )

    @property
    def retired(self) -> Mapping[str, str]:
        """Old UUID -> new UUID of the GPUs replaced and not listed again since."""
        return self._retired

    def _swap_retired(self, devices: Iterable[DeviceSample]) -> None:
        """Placement, metrics and the API go by ``identities``: a GPU replaced while the
        backend stayed open (a backend that lists its devices at every sample) gives its
        place there to the GPU that replaced it."""
        if not any(i.uuid in self._retired for i in self.identities):
            return
        listed = {d.uuid: d for d in devices}
        out = []
        for ident in self.identities:
            d = listed.get(self._retired.get(ident.uuid, ""))
            if d is not None:
                ident = DeviceIdentity(d.index, d.uuid, d.name, d.memory_total_mb, d.cpus)
            out.append(ident)
        self.identities = tuple(out)

    def _known(self, index: int, uuid: str, listed: set[str]) -> DeviceIdentity | None:
        """The GPU seen before at ``index`` when ``uuid`` is the placeholder of one whose UUID
        cannot be read now (lost at a re-init): the same GPU, not a second one. Only a GPU not
        ``listed`` in this enumeration, and only when exactly one such was last seen at that
        index (GPUs renumbered by a removal: left a placeholder rather than named wrongly)."""
        if not uuid.startswith(PLACEHOLDER):
            return None
        found = [i for i in self._seen.values() if i.index == index and i.uuid not in listed]
        return found[0] if len(found) == 1 else None

    def _named_all(self, identities: Iterable[DeviceIdentity]) -> tuple[DeviceIdentity, ...]:
        idents = tuple(identities)
        listed = {i.uuid for i in idents}
        out = []
        for ident in idents:
            known = self._known(ident.index, ident.uuid, listed)
            out.append(ident if known is None else replace(ident, uuid=known.uuid, name=known.name))
        return tuple(out)

    def _identified(self, devices: Iterable[DeviceSample]) -> None:
        """Name a GPU that had only a placeholder identity (its handle or UUID could not be
        read when the backend opened) once a sample names it: placement, metrics and the API
        go by ``identities``."""
        if not any(i.uuid.startswith(PLACEHOLDER) for i in self.identities):
            return
        named = {d.index: d for d in devices if not d.uuid.startswith(PLACEHOLDER)}
        out = []
        for ident in self.identities:
            d = named.get(ident.index)
            if ident.uuid.startswith(PLACEHOLDER) and d is not None:
                self._log.info("gpu.identified", gpu=d.index, uuid=d.uuid, name=d.name)
                ident = DeviceIdentity(ident.index, d.uuid, d.name, d.memory_total_mb)
            out.append(ident)
        self.identities = tuple(out)

    def _with_missing(self, devices: tuple[DeviceSample, ...]) -> tuple[DeviceSample, ...]:
        """``devices`` plus every GPU seen before that the driver no longer lists, as lost (a
        GPU that fell off the bus vanishes from the enumeration after a re-init: forgotten, its
        workers would have stayed ready and no alert would have fired)."""
        listed_now = {d.uuid for d in devices}
        named = []
        for d in devices:
            known = self._known(d.index, d.uuid, listed_now)
            # a GPU seen before whose handle or UUID answers a passing error after a re-init
            # is not lost: its readings are unknown, as for a GPU open all along. Regression:
            # quarantined (until an operator lifted it) and its workers drained
            named.append(
                d
                if known is None
                else replace(
                    d, uuid=known.uuid, name=known.name, healthy=d.healthy or d.unidentified
                )
            )
        devices = tuple(named)
        self._retire(DeviceIdentity(d.index, d.uuid, d.name) for d in devices)
        # nor are its XIDs watched (no handle to register): said as for any unwatched GPU
        # (regression: its GPU object and gpu_xids_watched said they were)
        self._unopened = {
            d.uuid: f"its handle cannot be read ({d.error}): no XID events registered"
            for d in devices
            if d.unidentified and d.healthy
        }
        self._remember(DeviceIdentity(d.index, d.uuid, d.name) for d in devices)
        listed = {d.uuid for d in devices}
        lost = tuple(
            DeviceSample(ident.index, uuid, ident.name, healthy=False, error=LOST_UNLISTED)
            for uuid, ident in self._seen.items()
            if uuid not in listed
        )
        return devices + lost

    def _gpus_blocking(self) -> tuple[tuple[DeviceSample, ...], bool, str | None]:
        """The GPUs now: ``(devices, available, error)``."""
        assert self.backend is not None
        try:
            sample = self._guarded(self.backend.sample)
            return self._with_missing(self._tracked(sample)()), True, self.error
        except BackendUnavailable as exc:
            return (), False, str(exc)
        except BackendError as exc:
            return (), True, str(exc)

    def _guarded(self, fn: Callable[P, T]) -> Callable[P, T]:
        """``fn`` (a backend call) with any error other than a ``BackendError`` turned into
        ``BackendUnavailable``, its traceback logged (at most once a minute): a bug reading the
        GPUs (a driver's odd answer, a sim world's odd file) makes telemetry unavailable, with
        the reason, and the backend is opened again later; it does not end supervision."""

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return fn(*args, **kwargs)
            except BackendError:
                raise
            except Exception as exc:
                text = f"{getattr(fn, '__name__', 'a call')} failed: {exc!r}"
                now = time.monotonic()
                at = self._logged_at.get("gpu.backend_failed")
                if at is None or now - at >= FAILURE_LOG_EVERY_S:
                    self._logged_at["gpu.backend_failed"] = now
                    self._log.error("gpu.backend_failed", error=text, exc_info=True)
                raise BackendUnavailable(text) from exc

        return call

    async def _bounded(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a backend call) in the NVML thread, waited for up to the stuck limit:
        ``BackendUnavailable`` when it has not returned by then (left to itself, tracked:
        no other call is made while it is in flight) or one is in flight already."""
        in_flight = self.stuck_for_s()
        if in_flight is None:
            with anyio.move_on_after(self._stuck_limit()):
                return await in_thread(
                    self._tracked(fn), limiter=self._limiter, abandon_on_cancel=True
                )
            in_flight = self.stuck_for_s() or self._stuck_limit()
            self._say_stuck()
        raise BackendUnavailable(stuck_text(in_flight))

    def _tick_blocking(self, refs: Mapping[str, WorkerRef], t0: float, token: int) -> Sample | None:
        """GPUs, then the host, in one thread hop; None when the tick was given up on while
        the GPU call hung (a host-only tick has been taken meanwhile)."""
        gpus = self._gpus_blocking()
        if token != self._tick_token:
            return None
        return self._host_blocking(refs, gpus, t0)

    def _host_blocking(
        self,
        refs: Mapping[str, WorkerRef],
        gpus: tuple[tuple[DeviceSample, ...], bool, str | None],
        t0: float,
    ) -> Sample:
        with self._host_lock:  # never two at once: an abandoned tick may still get here
            return self._host_sample(refs, gpus, t0)

    def _host_sample(
        self,
        refs: Mapping[str, WorkerRef],
        gpus: tuple[tuple[DeviceSample, ...], bool, str | None],
        t0: float,
    ) -> Sample:
        devices, ok, error = gpus
        gpu_pids = frozenset(p.pid for d in devices for p in d.processes or ())
        trees, host, visible = self._host.sample(
            {n: r.pid for n, r in refs.items()},
            gpu_pids,
            {n: r.host_budget_mb for n, r in refs.items() if r.host_budget_mb > 0},
        )
        gpu = attribute(
            devices, trees, {n: r.gpus for n, r in refs.items()}, visible, self._host.aliases
        )
        workers = {}
        for name, tree in trees.items():
            usage = gpu.get(name)
            rss, cpu = host.get(name, (None, None))
            workers[name] = WorkerUsage(
                name=name,
                pids=tuple(sorted(tree)),
                gpu_memory_mb=usage.total_mb if usage and ok else None,
                gpu_memory_by_gpu=dict(usage.by_gpu) if usage and ok else {},
                attribution=(usage.attribution if usage else "none") if ok else "unavailable",
                host_rss_mb=rss,
                cpu_percent=cpu,
                host_pss_mb=self._host.pss.get(name),
            )
        t1 = time.monotonic()
        return Sample(
            t=t1,
            devices=devices,
            workers=workers,
            nvml_available=ok,
            error=error,
            duration_s=t1 - t0,
            host_at=self._host.read_at,
        )

    async def tick(self) -> Sample:
        """Take one sample now."""
        self._said_returned()
        if (
            (not self.available or self._misses_seen())
            and self.backend is not None
            and time.monotonic() >= self._reopen_at
            and self.stuck_for_s() is None  # never a second call under one that hangs
        ):
            with contextlib.suppress(BackendError):
                await self._bounded(self.backend.close)
            await self.open()
        refs = self._workers()
        t0 = time.monotonic()
        sample: Sample | None = None
        stuck = False
        gpus: tuple[tuple[DeviceSample, ...], bool, str | None] = ((), self.available, self.error)
        if self.available and self.backend is not None:
            in_flight = self.stuck_for_s()
            if in_flight is None:
                # One thread hop for GPUs and host (each hop wakes a thread: ~80 us of CPU
                # here), waited for up to the stuck limit; then left to itself (a hung driver),
                # and the host is sampled alone meanwhile, so that it does not stop with it
                # (tree RSS, budgets, trees for orphan reclaim). Abandoned on cancel too: a
                # call that hangs must not hold up the stop.
                self._tick_token += 1
                with anyio.move_on_after(self._stuck_limit()):
                    sample = await in_thread(
                        self._tick_blocking,
                        refs,
                        t0,
                        self._tick_token,
                        limiter=self._limiter,
                        abandon_on_cancel=True,
                    )
                if sample is None:
                    self._tick_token += 1  # given up on: it must not sample the host now
                    in_flight = self.stuck_for_s() or self._stuck_limit()
                    self._say_stuck()
            if sample is None:
                stuck = True
                gpus = ((), False, stuck_text(in_flight or self._stuck_limit()))
        if sample is None:  # the host alone (no backend with GPUs, or a call hangs)
            sample = await in_thread(
                self._host_blocking,
                refs,
                gpus,
                t0,
                limiter=self._host_limiter,
                abandon_on_cancel=True,
            )
        if stuck:
            pass  # telemetry is down for as long as the call hangs; no re-open under it
        elif self.available and not sample.nvml_available:
            self.available = False
            self.error = sample.error
            retry_in_s = self._schedule_reopen(REOPEN_MAX_S)
            self._log.warning(
                "gpu.unavailable",
                backend=self.backend_name,
                error=sample.error,
                retry_in_s=retry_in_s,
            )
        elif sample.nvml_available:
            if not self._misses_seen():
                self._reopen_delay = REOPEN_INITIAL_S
            self._identified(sample.devices)
            self._swap_retired(sample.devices)
        self.last = sample
        self._on_sample(sample)
        return sample

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sample every ``interval_s`` and watch XIDs until cancelled; then close the backend."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._xid_loop)  # idle until a backend with GPUs is open
                task_status.started()
                next_at = anyio.current_time()
                while True:
                    self._wake = anyio.Event()
                    try:
                        await self.tick()
                    except OSError as exc:
                        # out of file descriptors (EMFILE), /proc unreadable, no thread to
                        # be had (ThreadUnavailable: the pids cgroup is full): this tick is
                        # lost, supervision goes on (crashes are seen by the reaper)
                        self._tick_failed(exc)
                    gpu = self.available and bool(self.identities)
                    now = anyio.current_time()
                    # A tick that request() asked for early leaves the schedule alone (moving
                    # it on for every early tick starved the regular ones while a caller kept
                    # asking).
                    if now >= next_at:
                        next_at += (
                            self.interval_s if gpu else max(self.interval_s, HOST_ONLY_INTERVAL_S)
                        )
                        if next_at < now:  # overran: start the schedule again from now
                            next_at = now
                    with anyio.move_on_after(max(0.0, next_at - now)):
                        await self._wake.wait()  # or sooner, when someone needs a fresh sample
        finally:
            if self.backend is not None:
                with anyio.CancelScope(shield=True):
                    await self._close_at_stop(self.backend)

    async def _close_at_stop(self, backend: GpuBackend) -> None:
        """Close ``backend`` once the call in flight (abandoned by the stop) has returned,
        waiting ``CLOSE_WAIT_S`` at most: one that does not return (a hung driver; NVML's
        shutdown under it would hang or worse) is left behind, and the process exits without
        closing. Inline where no thread can be started: clean-up must finish regardless."""
        returned = self._no_call.is_set()
        if not returned:
            with contextlib.suppress(ThreadUnavailable):
                returned = await in_thread(self._no_call.wait, CLOSE_WAIT_S, abandon_on_cancel=True)
        if not returned:
            stuck = self.stuck_for_s()
            self._log.warning(
                "gpu.close_skipped",
                backend=self.backend_name,
                stuck_for_s=None if stuck is None else round(stuck, 3),
                reason="an NVML call has not returned: the driver may be hung",
            )
            return
        with anyio.move_on_after(CLOSE_WAIT_S), contextlib.suppress(BackendError):
            await in_thread(
                self._tracked(backend.close),
                limiter=self._limiter,
                inline=True,
                abandon_on_cancel=True,
            )

    def _tracked(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` that marks a backend call in flight while it runs (``stuck_for_s``)."""

        def call() -> T:
            self._no_call.clear()
            self._call_since = time.monotonic()
            try:
                return fn()
            finally:
                self._call_since = None
                self._no_call.set()

        return call

    def stuck(self) -> float | None:
        """How long the call in flight has taken, once it counts as stuck (else None)."""
        took = self.stuck_for_s()
        return took if took is not None and took >= self._stuck_limit() else None

    def _stuck_limit(self) -> float:
        return max(STUCK_AFTER_S, STUCK_AFTER_INTERVALS * self.interval_s)

    def _say_stuck(self) -> None:
        """Say (once a hang) that a backend call has not returned within the stuck limit: the
        sampler has just given up waiting for it. Said here, where it is seen, rather than by
        a task polling every second (a wake-up a second, for ever, for a rare event)."""
        if self._said_stuck:
            return
        self._said_stuck = True
        took = self.stuck_for_s()
        self._log.warning(
            "gpu.call_stuck",
            # an open that hangs: the backend being opened (not yet self.backend)
            backend=self._opening.name if self._opening is not None else self.backend_name,
            stuck_for_s=None if took is None else round(took, 3),
            reason="an NVML call has not returned: the driver may be hung; GPU "
            "telemetry counts as down until it does",
        )

    def _said_returned(self) -> None:
        """Say that the call said stuck has returned (seen at the next tick)."""
        if self._said_stuck and self.stuck_for_s() is None:
            self._said_stuck = False
            self._log.info("gpu.call_returned", backend=self.backend_name)

    def stuck_for_s(self) -> float | None:
        """How long the backend call now in flight has taken (None: none is in flight)."""
        since = self._call_since
        return None if since is None else time.monotonic() - since

    def _tick_failed(self, exc: OSError) -> None:
        self.tick_errors += 1
        self._warn_now_and_then("sampler.tick_failed", error=str(exc), errors=self.tick_errors)

    def _warn_now_and_then(self, event: str, **fields: object) -> None:
        """Log ``event`` at most every ``FAILURE_LOG_EVERY_S`` (a failure that lasts would
        log at every tick)."""
        now = time.monotonic()
        at = self._logged_at.get(event)
        if at is None or now - at >= FAILURE_LOG_EVERY_S:
            self._logged_at[event] = now
            self._log.warning(event, **fields)

    def request(self) -> None:
        """Take the next sample now instead of at the next tick."""
        self._wake.set()

    def use(self, backend: GpuBackend, identities: tuple[DeviceIdentity, ...] = ()) -> None:
        """Replace the backend (``auto`` falling back to ``none``)."""
        self.backend = backend
        self.identities = identities
        self._seen = {i.uuid: i for i in identities}
        self.available = True
        self.error = None
        if identities:
            self._gpus_opened.set()

    def _xids_watched(self, backend: GpuBackend, failed: str | None = None) -> None:
        """After an XID wait: which GPUs' XIDs are not watched (every one while the waits
        fail: ``failed`` says why), said when it changes. Regression: a GPU whose XID events
        NVML does not deliver (not supported, a registration that failed) had XIDs nothing
        acted on, without a word: it is in its GPU object, a metric and the log now."""
        if backend is not self.backend:
            return  # closed (reopened) while the wait ran: the next wait says
        if failed is not None:
            now = {i.uuid: failed for i in self.identities if not i.uuid.startswith(PLACEHOLDER)}
        else:
            listed = {**self._unopened, **backend.xids_unwatched()}
            now = {i.uuid: listed[i.uuid] for i in self.identities if i.uuid in listed}
        if now == self.xids_unwatched:
            return
        self.xids_unwatched = now
        if now:
            self._log.warning(
                "gpu.xids_unwatched",
                gpus=now,
                reason="XID errors on these GPUs are not seen: nothing restarts, drains or "
                "quarantines for them",
            )
        else:
            self._log.info("gpu.xids_watched", gpus=[i.uuid for i in self.identities])

    async def _xid_loop(self) -> None:
        while True:
            backend = self.backend
            if backend is None or not self.available or not self.identities:
                # none yet (NVML may come up later: retried) or none at all (backend none):
                # woken when a backend with GPUs opens, not every second for nothing
                await self._gpus_opened.wait()
                self._gpus_opened = anyio.Event()
                continue
            try:
                events = await in_thread(
                    self._guarded(backend.wait_xid),
                    backend.xid_wait_s,
                    limiter=self._xid_limiter,
                    abandon_on_cancel=True,
                )
            except ThreadUnavailable as exc:
                # the events wait in NVML's event set: they are read at the next wait
                self.xid_wait_errors += 1
                self._warn_now_and_then(
                    "gpu.xid_wait_failed", error=str(exc), errors=self.xid_wait_errors
                )
                await anyio.sleep(XID_WAIT_S)
                continue
            except BackendError as exc:
                self._xids_watched(backend, failed=str(exc))
                # a wait that keeps failing is said once a minute, not every second
                self.xid_wait_errors += 1
                self._warn_now_and_then(
                    "gpu.xid_wait_failed",
                    error=str(exc),
                    errors=self.xid_wait_errors,
                    reason="XIDs are not watched while this lasts",
                )
                await anyio.sleep(XID_WAIT_S)
                continue
            self._xids_watched(backend)
            for event in events:
                self._on_xid(event)
