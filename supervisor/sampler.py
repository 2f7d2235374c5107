"""The sampler: one immutable ``Sample`` per tick, and the XID event loop.

Per tick, in one call on a dedicated worker thread (so the event loop never blocks on NVML or
``/proc``): the backend's device readings, then each worker's process tree (leader plus every
descendant), its RSS and CPU through psutil, and its GPU memory through ``policy.attribution``.
XID events are read by a bounded wait in a second thread. An unavailable backend is retried with
backoff; the supervisor never stops for NVML.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
import anyio.abc
import anyio.to_thread
import psutil
import structlog

from supervisor.backends.base import GpuBackend
from supervisor.errors import BackendError, BackendUnavailable
from supervisor.model import DeviceIdentity, DeviceSample, Sample, WorkerUsage, XidEvent
from supervisor.policy.attribution import attribute

MIB = 1024 * 1024
XID_WAIT_S = 0.5
REOPEN_INITIAL_S = 1.0
REOPEN_MAX_S = 60.0


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """What the sampler needs to know about a worker: its main pid and its GPUs."""

    pid: int | None
    gpus: tuple[str, ...] | None


class HostSampler:
    """Process trees, RSS and CPU through psutil (blocking; runs in the sampler thread)."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def _proc(self, pid: int) -> psutil.Process | None:
        known = self._procs.get(pid)
        if known is not None:
            return known
        try:
            proc = psutil.Process(pid)
            proc.cpu_percent(None)  # prime the CPU counter
        except psutil.Error:
            return None
        self._procs[pid] = proc
        return proc

    def sample(
        self, leaders: Mapping[str, int | None]
    ) -> tuple[
        dict[str, frozenset[int]], dict[str, tuple[float | None, float | None]], frozenset[int]
    ]:
        """Trees, (rss_mb, cpu_percent) per worker, and every visible pid."""
        children: dict[int, list[int]] = {}
        visible: set[int] = set()
        for proc in psutil.process_iter(["ppid"]):
            visible.add(proc.pid)
            ppid = proc.info.get("ppid")
            if isinstance(ppid, int):
                children.setdefault(ppid, []).append(proc.pid)
        trees: dict[str, frozenset[int]] = {}
        usage: dict[str, tuple[float | None, float | None]] = {}
        live: set[int] = set()
        for name, leader in leaders.items():
            if leader is None or leader not in visible:
                trees[name] = frozenset()
                usage[name] = (None, None)
                continue
            tree: set[int] = set()
            stack = [leader]
            while stack:
                pid = stack.pop()
                if pid in tree:
                    continue
                tree.add(pid)
                stack.extend(children.get(pid, ()))
            trees[name] = frozenset(tree)
            rss = cpu = 0.0
            seen = False
            for pid in tree:
                member = self._proc(pid)
                if member is None:
                    continue
                try:
                    with member.oneshot():
                        rss += member.memory_info().rss / MIB
                        cpu += member.cpu_percent(None)
                    seen = True
                    live.add(pid)
                except psutil.Error:
                    continue
            usage[name] = (rss, cpu) if seen else (None, None)
        for pid in list(self._procs):
            if pid not in live:
                del self._procs[pid]
        return trees, usage, frozenset(visible)


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
        self.error: str | None = None
        self.available = False
        self._host = HostSampler()
        self._limiter = anyio.CapacityLimiter(1)
        self._xid_limiter = anyio.CapacityLimiter(1)
        self._reopen_delay = REOPEN_INITIAL_S
        self._reopen_at = 0.0
        self._wake = anyio.Event()
        self.last: Sample | None = None
        self._log = structlog.get_logger()

    @property
    def backend_name(self) -> str:
        """``nvml``, ``sim`` or ``none``."""
        return self.backend.name if self.backend is not None else "none"

    async def open(self) -> bool:
        """Open the backend (in the NVML thread); False (degraded) if it is unavailable."""
        backend = self._factory()
        try:
            self.identities = await anyio.to_thread.run_sync(backend.open, limiter=self._limiter)
        except BackendUnavailable as exc:
            self.available = False
            self.error = str(exc)
            self.backend = backend
            self._reopen_at = time.monotonic() + self._reopen_delay
            self._log.warning(
                "gpu.unavailable",
                backend=backend.name,
                error=str(exc),
                retry_in_s=self._reopen_delay,
            )
            self._reopen_delay = min(self._reopen_delay * 2, REOPEN_MAX_S)
            return False
        self.backend = backend
        self.available = True
        self.error = None
        self._reopen_delay = REOPEN_INITIAL_S
        self._log.info(
            "gpu.backend",
            backend=backend.name,
            devices=len(self.identities),
            uuids=[i.uuid for i in self.identities],
        )
        return True

    def _tick_blocking(self, refs: Mapping[str, WorkerRef], available: bool) -> Sample:
        t0 = time.monotonic()
        devices: tuple[DeviceSample, ...] = ()
        error = self.error
        ok = available
        if available and self.backend is not None:
            try:
                devices = self.backend.sample()
            except BackendUnavailable as exc:
                ok, error = False, str(exc)
            except BackendError as exc:
                error = str(exc)
        trees, host, visible = self._host.sample({n: r.pid for n, r in refs.items()})
        gpu = attribute(devices, trees, {n: r.gpus for n, r in refs.items()}, visible)
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
            )
        t1 = time.monotonic()
        return Sample(
            t=t1,
            devices=devices,
            workers=workers,
            nvml_available=ok,
            error=error,
            duration_s=t1 - t0,
        )

    async def tick(self) -> Sample:
        """Take one sample now."""
        if not self.available and self.backend is not None and time.monotonic() >= self._reopen_at:
            with contextlib.suppress(BackendError):
                await anyio.to_thread.run_sync(self.backend.close, limiter=self._limiter)
            await self.open()
        sample = await anyio.to_thread.run_sync(
            self._tick_blocking, self._workers(), self.available, limiter=self._limiter
        )
        if self.available and not sample.nvml_available:
            self.available = False
            self.error = sample.error
            self._reopen_at = time.monotonic() + self._reopen_delay
            self._log.warning("gpu.unavailable", backend=self.backend_name, error=sample.error)
        self.last = sample
        self._on_sample(sample)
        return sample

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sample every ``interval_s`` and watch XIDs until cancelled; then close the backend."""
        try:
            async with anyio.create_task_group() as tg:
                if self.identities:
                    tg.start_soon(self._xid_loop)
                task_status.started()
                next_at = anyio.current_time()
                while True:
                    self._wake = anyio.Event()
                    await self.tick()
                    next_at += self.interval_s
                    now = anyio.current_time()
                    if next_at < now:  # overran: start the schedule again from now
                        next_at = now
                    with anyio.move_on_after(max(0.0, next_at - now)):
                        await self._wake.wait()  # or sooner, when someone needs a fresh sample
        finally:
            if self.backend is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(BackendError):
                    await anyio.to_thread.run_sync(self.backend.close, limiter=self._limiter)

    def request(self) -> None:
        """Take the next sample now instead of at the next tick."""
        self._wake.set()

    def use(self, backend: GpuBackend, identities: tuple[DeviceIdentity, ...] = ()) -> None:
        """Replace the backend (``auto`` falling back to ``none``)."""
        self.backend = backend
        self.identities = identities
        self.available = True
        self.error = None

    async def _xid_loop(self) -> None:
        while True:
            backend = self.backend
            if backend is None or not self.available:
                await anyio.sleep(XID_WAIT_S)
                continue
            try:
                events = await anyio.to_thread.run_sync(
                    backend.wait_xid, XID_WAIT_S, limiter=self._xid_limiter, abandon_on_cancel=True
                )
            except BackendError as exc:
                self._log.warning("gpu.xid_wait_failed", error=str(exc))
                await anyio.sleep(XID_WAIT_S)
                continue
            for event in events:
                self._on_xid(event)
