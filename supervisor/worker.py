"""One worker's runner: feeds its events through ``policy.lifecycle.step`` and carries out actions.

A runner is an actor: everything that concerns the worker (operator intents, its exit from the
reaper, readiness and heartbeats from the notify socket or the health URL, deadlines) arrives as
an event in its inbox and is applied one at a time, so the record has a single writer.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import psutil
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from supervisor import procfs
from supervisor.clock import Clock
from supervisor.config import MAX_SECONDS
from supervisor.errors import SpawnError, connection_reason
from supervisor.journal import rfc3339
from supervisor.model import RUNNING_STATES, LaunchSpec, WorkerState, WorkerUsage
from supervisor.notify import NotifyMessage, parse_usec
from supervisor.output import WorkerOutput
from supervisor.policy import lifecycle as lc
from supervisor.policy.backoff import ready_poll_s
from supervisor.processes import Child, Reaped, Reaper, descendants, kill_tree, signal_group, spawn
from supervisor.views import redact_argv

#: One readiness probe may take this long (a model server's /health can be slow while it warms
#: up; a probe that gave up at 1 s never saw its 200); the probes go on until start_timeout_s.
HEALTH_TIMEOUT_S = 5.0
#: A deadline noticed this long after it passed means the supervisor was stalled (see
#: ``_next_event``), and the heartbeats of the stall get ``STALL_GRACE_S`` to come in.
LATE_S = 0.25
STALL_GRACE_S = 0.5
#: A health probe reads at most this much of an answer's body (as it came, not decompressed):
#: a URL that streams (server-sent events, a download) must not fill the supervisor's memory,
#: nor keep its 200 from counting.
PROBE_BODY_MAX = 64 * 1024
#: Events that take a ready worker down (a roll-out's or an operator's restart, stop or drain;
#: a healing action): posted, not yet taken, they are what ``queued_down`` says.
TAKES_DOWN = (lc.Stop, lc.Restart, lc.Drain, lc.Kill)


class HttpProbes:
    """The HTTP clients for the health probes of every worker of a runtime (readiness and
    liveness URLs): one per worker, made at its first probe, all with one TLS context (made
    at the first: importing httpx and loading the CA store take ~50 ms of CPU, once, not at
    every start of every worker; a client on it costs ~0.04 ms), closed with the runtime or
    when the worker is removed. One client shared by every worker kept all their connections
    in one pool, which each request searches: with 64 workers loading (probed every 0.2 s)
    a probe cost 2.3 ms of the loop's CPU instead of 0.7 ms. Never through ``http_proxy``
    (the workers are on this machine); redirects are followed (a framework's /health ->
    /health/); no cookie is kept (a cookie ignores ports: one worker's would go to every
    other, and to later processes); each request has its own timeout."""

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}
        self._tls: Any = None

    def client(self, worker: str = "") -> Any:
        """The ``httpx.AsyncClient`` of ``worker`` (made now if it has none)."""
        client = self._clients.get(worker)
        if client is None:
            import http.cookiejar

            import httpx  # only supervisors with an HTTP health URL pay for the import

            if self._tls is None:
                self._tls = httpx.create_ssl_context(trust_env=False)
            client = self._clients[worker] = httpx.AsyncClient(
                trust_env=False,
                verify=self._tls,
                follow_redirects=True,
                # keeps no cookie: one process's would go to the next on its port
                cookies=http.cookiejar.CookieJar(
                    http.cookiejar.DefaultCookiePolicy(allowed_domains=[])
                ),
                # one connection a URL at most at a time; kept between probes while the
                # worker keeps it open (HTTP/1.1)
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=8),
            )
        return client

    async def forget(self, worker: str) -> None:
        """Close ``worker``'s client (the worker is removed)."""
        client = self._clients.pop(worker, None)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        for worker in list(self._clients):
            await self.forget(worker)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What the pre-start hook found for spawn ``token``: a spec to start, or why no GPU can
    be had. Queued with the worker's events and handled in their order."""

    token: int
    result: LaunchSpec | str


class WorkerRunner:
    """Owns one worker's process, record and output across restarts."""

    def __init__(
        self,
        spec: LaunchSpec,
        timing: lc.Timing,
        *,
        reaper: Reaper,
        clock: Clock,
        output: WorkerOutput,
        on_change: Callable[[WorkerRunner], None],
        register_pid: Callable[[int, WorkerRunner | None], None],
        prepare: Callable[[WorkerRunner], Awaitable[LaunchSpec | str]] | None = None,
        needs_prepare: Callable[[WorkerRunner], bool] | None = None,
        on_event: Callable[[WorkerRunner, str, dict[str, Any]], None] | None = None,
        on_exit: Callable[[WorkerRunner, lc.Exit, lc.WorkerRecord], None] | None = None,
        before_spawn: Callable[[WorkerRunner], Path | None] | None = None,
        read_notify: Callable[[], object] | None = None,
        probes: HttpProbes | None = None,
    ) -> None:
        self.spec = spec
        self._probes = probes or HttpProbes()
        self.timing = timing
        self._configured = (spec, timing)  # as planned (``spec`` may be re-placed at a start)
        self._started_as: tuple[LaunchSpec, lc.Timing] | None = None
        self._spawned: LaunchSpec | None = None
        self.record = lc.WorkerRecord()
        self.output = output
        self.status_text = ""
        self.stopping_notified = False
        self.watchdog_triggered = False  # the process sent WATCHDOG=trigger
        #: why its liveness URL made it count as hung (``health.liveness_url``), or None
        self.liveness_failed: str | None = None
        self._liveness_pid: int | None = None  # the process a liveness task asks about
        self._liveness_wake: anyio.Event | None = None  # set by a reload: settings changed
        #: failed liveness probes in a row of the current process and the last answer (the
        #: worker object's ``liveness``)
        self.liveness_failing: tuple[int, str] = (0, "")
        self.started_wall: float | None = None
        self.spawn_attempts = 0
        #: the ``spawn_attempts`` of the last start that failed (0: none): with no backoff
        #: delay the next start comes in the same step, and ``backoff`` is never seen
        self.failed_attempt = 0
        #: the reload request whose roll-out last set this worker's definition (0: none)
        self.rolled_by = 0
        self._reaper = reaper
        self._clock = clock
        self._on_change = on_change
        self._register_pid = register_pid
        self._prepare = prepare
        #: whether a spawn needs ``prepare`` now (None: always when there is one)
        self._needs_prepare = needs_prepare
        self._on_event = on_event or (lambda _r, _t, _f: None)
        self._on_exit = on_exit
        #: called right before each spawn: the cgroup its process joins (None: none); a
        #: SpawnError it raises fails the spawn
        self._before_spawn = before_spawn
        self._read_notify = read_notify
        #: a Heartbeat / Ready is queued and not handled yet: more of the same add nothing
        self._queued: set[type[lc.Event]] = set()
        #: the value an ExtendTimeout / WatchdogTimeout queued is handled with: the latest
        #: (the longest extension) its process sent meanwhile
        self._notified: dict[type[lc.Event], float] = {}
        #: the states whose deadline the current process moved (EXTEND_TIMEOUT_USEC): a start
        #: timeout or a hang is then said to be past the time it asked for
        self.extended_in: set[WorkerState] = set()
        #: notify fields of the current process already said to be unreadable (once each)
        self._said_invalid: set[str] = set()
        #: the ERRNO= / BUSERROR= the current process last reported (said when it changes)
        self._said_error: tuple[str | None, str | None] = (None, None)
        #: the events that take it down (``TAKES_DOWN``) posted and not taken yet, in order
        self._downs: deque[lc.Event] = deque()
        self._before: lc.WorkerRecord = self.record
        self._create_time: float | None = None
        self._reaped = False  # the current process's status was collected: its pid is not ours
        #: the process that had ended on its own when a stop signal was to be sent to it
        self._ended_unasked: int | None = None
        #: the process the lifecycle's last signal (drain or stop) went to
        self._signalled: int | None = None
        self.last_exit_wall: float | None = None
        self.last_exit_pid: int | None = None
        self._exit_reason: str | None = None  # the last exit as classified (cuda_oom, ...)
        self._spawn_token = 0
        self._graced: float | None = None  # the deadline a stall's grace was given for
        #: What the last readiness probe got ("HTTP 503", "timed out after 5 s"...): said
        #: when the start times out, where it is the only clue.
        self.last_probe: str | None = None
        self._gpu_wait_reason = ""  # the last "no GPU to place on" said (said again on change)
        self._after_step: list[Callable[[], None]] = []
        self.last_exit_at: float | None = None
        self._child: Child | None = None
        self._tree: list[psutil.Process] = []
        self._last_pid: int | None = None
        self._send: MemoryObjectSendStream[lc.Event | _Prepared]
        self._recv: MemoryObjectReceiveStream[lc.Event | _Prepared]
        self._send, self._recv = anyio.create_memory_object_stream[lc.Event | _Prepared](math.inf)
        self._tg: anyio.abc.TaskGroup | None = None
        self._scope = anyio.CancelScope()
        self._log = structlog.get_logger().bind(worker=spec.name, group=spec.group)

    # --- public -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The worker's name (``gpen-0``)."""
        return self.spec.name

    @property
    def state(self) -> WorkerState:
        """The current lifecycle state."""
        return self.record.state

    @property
    def pid_create_time(self) -> float | None:
        """The current process's create time (as psutil reports it), None without a process.

        Read on first use, not at spawn: a spawn burst need not read ``/proc`` of children that
        are still exec'ing. It is only read while the pid is ours (spawned, not yet reaped),
        so a reused pid is never measured.
        """
        if self._create_time is None and self._child is not None and not self._reaped:
            self._create_time = procfs.create_time(self._child.pid)
        return self._create_time

    @property
    def has_process(self) -> bool:
        """True while a process of this worker is alive (or not yet reaped)."""
        return self.record.pid is not None

    def post(self, event: lc.Event | _Prepared) -> None:
        """Queue an event (never blocks)."""
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait(event)
            if isinstance(event, TAKES_DOWN):
                self._downs.append(event)

    def inbox_empty(self) -> bool:
        """No event waits to be applied (what the record says is all there is to it)."""
        return self._recv.statistics().current_buffer_used == 0

    def queued_down(self) -> lc.Event | None:
        """The first event posted to take the worker down (``TAKES_DOWN``) that its task has
        not taken yet (None: none). Until it is taken, a step of the event loop later, the
        worker still says ``ready``: whoever judges how many of a group are down
        (``max_unavailable``: the healer, a roll-out) counts it as on its way down."""
        return self._downs[0] if self._downs else None

    def reconfigure(self, spec: LaunchSpec, timing: lc.Timing, passthrough: bool) -> None:
        """Use a new spec from the next start on (reload)."""
        self.spec = spec
        self.timing = timing
        self._configured = (spec, timing)
        self.output.passthrough = passthrough
        self._log = structlog.get_logger().bind(worker=spec.name, group=spec.group)
        if self._liveness_wake is not None:  # the waiting liveness task reads them again
            self._liveness_wake.set()
        pid = self._current_pid()
        if pid is not None:  # a liveness URL a reload adds applies to the running process
            self._start_liveness(pid)

    def planned(self, spec: LaunchSpec, timing: lc.Timing) -> bool:
        """True when this worker is configured from exactly this plan (reload), or runs it
        (placed elsewhere at a restart since, as the new plan keeps it)."""
        return (spec, timing) in (self._configured, (self.spec, self.timing))

    def runs(self, spec: LaunchSpec, timing: lc.Timing) -> bool:
        """True when the current process was started from exactly this plan (reload)."""
        return self.record.pid is not None and self._started_as == (spec, timing)

    def ports(self) -> set[int]:
        """The ports this worker's process holds (the one it was spawned with) and the one its
        next start uses: a roll-out that moved it and stopped part-way leaves them apart."""
        specs = (self.spec, self._spawned if self.record.pid is not None else None)
        return {s.port for s in specs if s is not None and s.port is not None}

    def held_port(self) -> int | None:
        """The port its running process was spawned with (None without a process)."""
        spawned = self._spawned
        return spawned.port if self.record.pid is not None and spawned is not None else None

    def launches(self, spec: LaunchSpec) -> bool:
        """True when a restart would launch nothing new: the process runs ``spec`` (or, with
        none, the next start is of ``spec``). A reload that changes only what the supervisor
        uses (timeouts, restart policy, health thresholds) applies to such a worker in place."""
        if self.record.pid is not None:
            return self._spawned == spec
        return self.spec == spec

    def on_notify(self, msg: NotifyMessage) -> None:
        """A datagram from this worker or one of its descendants."""
        pid = self.record.pid
        if pid is None:
            return
        fields = msg.fields
        if "STATUS" in fields:
            self.status_text = fields["STATUS"][:512]
            self._on_change(self)
        if fields.get("STOPPING") == "1":
            self.stopping_notified = True
            self._log.info("worker.stopping_notified", pid=pid)
        # READY=1 is readiness only under ``ready = "notify"``: with a health URL it is the
        # URL's first 2xx (regression: a READY=1 sent before the server answered made it ready)
        spec = self._spawned or self.spec
        if fields.get("READY") == "1" and spec.notify:
            self._post_once(lc.Ready(pid))
        if fields.get("WATCHDOG") == "1":
            self._post_once(lc.Heartbeat(pid))
        elif fields.get("WATCHDOG") == "trigger" and not self.watchdog_triggered:
            # once a process: it is stopped for the first, and a flood of them must not grow
            # the queue (nor the log) without bound
            self.watchdog_triggered = True
            self._log.warning("worker.watchdog_trigger", pid=pid)
            self.post(lc.Heartbeat(pid, trigger=True))
        # systemd's own order: after READY=1 and WATCHDOG=1 of the same datagram
        if "WATCHDOG_USEC" in fields:
            self._notify_usec(pid, "WATCHDOG_USEC", fields["WATCHDOG_USEC"])
        if "EXTEND_TIMEOUT_USEC" in fields:
            self._notify_usec(pid, "EXTEND_TIMEOUT_USEC", fields["EXTEND_TIMEOUT_USEC"])
        if "ERRNO" in fields or "BUSERROR" in fields:
            self._reported_error(pid, fields.get("ERRNO"), fields.get("BUSERROR"))

    def _notify_usec(self, pid: int, key: str, value: str) -> None:
        """``WATCHDOG_USEC`` or ``EXTEND_TIMEOUT_USEC``: queued for the lifecycle (one at a
        time: a flood leaves the latest value, or the longest extension, to be handled)."""
        usec = parse_usec(value)
        if usec is None:
            if key not in self._said_invalid:  # (once a process and field)
                self._said_invalid.add(key)
                self._log.warning("worker.notify_invalid", pid=pid, field=key, value=value[:64])
            return
        seconds = usec / 1_000_000
        kind: type[lc.ExtendTimeout | lc.WatchdogTimeout]
        if key == "EXTEND_TIMEOUT_USEC":
            kind = lc.ExtendTimeout
            seconds = max(seconds, self._notified.get(kind, 0.0))
        else:
            kind = lc.WatchdogTimeout
            seconds = min(seconds, MAX_SECONDS)  # as the lifecycle takes it (said so, too)
            if seconds != self._notified.get(kind, self.record.watchdog_s):
                self._log.info("worker.watchdog_changed", pid=pid, watchdog_s=seconds)
        self._notified[kind] = seconds
        self._post_once(kind(pid, seconds))

    def _reported_error(self, pid: int, errno_text: str | None, buserror: str | None) -> None:
        """``ERRNO=`` / ``BUSERROR=``: the worker says why it fails (systemd shows them in
        ``systemctl status``): logged, once a value."""
        if (errno_text, buserror) == self._said_error or (
            errno_text in ("0", None) and not buserror
        ):
            return
        self._said_error = (errno_text, buserror)
        said: dict[str, Any] = {}
        if errno_text is not None:
            said["errno"] = errno_text[:64]
            if errno_text.isascii() and errno_text.isdigit() and len(errno_text) < 6:
                said["error"] = os.strerror(int(errno_text))
        if buserror:
            said["buserror"] = buserror[:256]
        self._log.warning("worker.reported_error", pid=pid, **said)

    def _post_once(
        self, event: lc.Ready | lc.Heartbeat | lc.ExtendTimeout | lc.WatchdogTimeout
    ) -> None:
        """Queue ``event`` unless one of its kind waits to be handled already: a worker that
        floods the socket with heartbeats cannot grow the queue (nor hold back a Stop behind
        it); the one queued is handled at the time it is, which is all it says."""
        if type(event) not in self._queued:
            self._queued.add(type(event))
            self.post(event)

    def cancel(self) -> None:
        """End the runner task (its process must already be gone)."""
        self._scope.cancel()

    def uptime_s(self) -> float | None:
        """Seconds since the current process started."""
        started = self.record.started_at
        if started is None or self.record.pid is None:
            return None
        return max(0.0, self._clock.now() - started)

    def view(self, usage: WorkerUsage | None = None) -> dict[str, Any]:
        """The worker object of DESIGN.md section 6 (``usage``: its resources at the last tick)."""
        rec = self.record
        last = rec.last_exit
        uptime = self.uptime_s()
        # the sample must have seen this process: one taken before a (re)spawn saw none, and
        # its 0 MiB would be a made-up figure for the new one until the next tick
        running = rec.pid is not None and usage is not None and rec.pid in usage.pids
        return {
            "name": self.spec.name,
            "group": self.spec.group,
            "index": self.spec.index,
            "state": rec.state.value,
            "pid": rec.pid,
            "gpus": list(self.spec.gpus) if self.spec.gpus is not None else None,
            "port": self.spec.port,
            "restarts": rec.restarts,
            "uptime_s": None if uptime is None else round(uptime, 3),
            "ready": rec.state is WorkerState.READY,
            "gpu_memory_mb": usage.gpu_memory_mb if running and usage else None,
            "gpu_memory_by_gpu": dict(usage.gpu_memory_by_gpu) if running and usage else {},
            "attribution": usage.attribution if running and usage else "none",
            "host_rss_mb": None
            if not running or usage is None or usage.host_rss_mb is None
            else round(usage.host_rss_mb, 3),
            "cpu_percent": None
            if not running or usage is None or usage.cpu_percent is None
            else round(usage.cpu_percent, 2),
            # Filled by the leak detector (self-healing); null until it has judged the worker.
            "leak": {"slope_mb_per_min": None, "suspected": False, "projected_oom_s": None},
            "reason": rec.reason,
            "status": self.status_text,
            "last_exit": None
            if last is None
            else {
                "code": last.status.code if last.status else None,
                "signal": last.status.signal_name if last.status else None,
                "reason": self._exit_reason or last.reason.value,
                "at": None if self.last_exit_wall is None else rfc3339(self.last_exit_wall),
                "detail": last.detail,
            },
        }

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Process events until cancelled."""
        with self._scope:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                try:
                    while True:
                        event = await self._next_event()
                        if isinstance(event, _Prepared):
                            spawned = self._prepared(event)
                            if spawned is None:
                                continue
                            event = spawned
                        self._apply(event)
                finally:
                    tg.cancel_scope.cancel()
        self.output.close()

    # --- event loop ---------------------------------------------------------------------

    async def _next_event(self) -> lc.Event | _Prepared:
        deadline = self.record.deadline
        if deadline is None:
            return await self._recv.receive()
        with anyio.move_on_after(max(0.0, deadline - self._clock.now())):
            return await self._recv.receive()
        # A deadline (watchdog, start) passed: what the workers sent meanwhile is read first,
        # so a supervisor that stalled (a paused VM, a starved CPU) does not take heartbeats
        # still waiting in its socket for a hang.
        if self._read_notify is not None:
            self._read_notify()
            with contextlib.suppress(anyio.WouldBlock):
                return self._recv.receive_nowait()
        late = self._clock.now() - deadline
        # (a deadline with no process, a backoff's end, has no heartbeats to wait for:
        # regression: its restart was held STALL_GRACE_S more after every stall)
        if (
            late > LATE_S
            and self._graced != deadline
            and self._read_notify is not None
            and self.record.pid is not None
        ):
            # Noticed long after it passed: the supervisor itself was stalled. The socket's
            # queue is small (net.unix.max_dgram_qlen: 10 in a container), so heartbeats sent
            # meanwhile may still wait in the workers' sendto(), to come in once it has room:
            # they get STALL_GRACE_S before the deadline is judged (once a deadline).
            self._graced = deadline
            with anyio.move_on_after(STALL_GRACE_S):
                while True:
                    self._read_notify()
                    with contextlib.suppress(anyio.WouldBlock):
                        return self._recv.receive_nowait()
                    await anyio.sleep(STALL_GRACE_S / 5)
        return lc.Timer()

    def _apply(self, first: lc.Event) -> None:
        pending: deque[lc.Event] = deque([first])
        # taking an event ``queued_down`` said is a change even when the record stays as it
        # was: what waits for the worker to be back looks again
        changed = bool(self._downs) and first is self._downs[0]
        if changed:
            self._downs.popleft()
        while pending:
            event = pending.popleft()
            self._queued.discard(type(event))
            if isinstance(event, lc.ExtendTimeout | lc.WatchdogTimeout):
                # the latest value its process sent while it waited in the queue
                seconds = self._notified.pop(type(event), None)
                if seconds is not None:
                    event = replace(event, seconds=seconds)
            if isinstance(event, lc.Exited) and event.pid == self._ended_unasked:
                # collected (its exit queued) before the stop signal was to go out: its death
                # is its own too (regression: queued as asked for, it was called the stop)
                self._ended_unasked = None
                event = replace(event, unasked=True)
            old = self.record
            self._before = old
            self.record, actions = lc.step(old, event, self._clock.now(), self.timing)
            changed = changed or self.record != old
            for action in actions:
                follow_up = self._do(action)
                if follow_up is not None:
                    pending.append(follow_up)
        if changed:
            self._on_change(self)
        while self._after_step:
            self._after_step.pop(0)()

    def classified_exit(self, reason: str) -> None:
        """What the last exit was found to be (``cuda_oom``, ``host_oom``: its post-mortem's
        reason), shown as ``last_exit.reason`` instead of the lifecycle's ``exit``/``signal``."""
        self._exit_reason = reason

    def after_step(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the current step's actions are done (after a replacement's spawn:
        what a death leaves to write must not delay the new process)."""
        self._after_step.append(work)

    def _do(self, action: lc.Action) -> lc.Event | None:
        if isinstance(action, lc.Spawn):
            if self._prepare is None or (
                self._needs_prepare is not None and not self._needs_prepare(self)
            ):
                return self._spawn()
            self._spawn_token += 1
            assert self._tg is not None
            self._tg.start_soon(self._prepare_and_spawn, self._spawn_token)
            return None
        if isinstance(action, lc.SendSignal):
            pid = self.record.pid
            # its death is its own, not our stop, when it had ended before we signalled it
            # at all (regression: one that ended by the drain signal, or exited once drained,
            # as the drain timeout's stop signal was due, was called a crash)
            if pid is not None and self._signalled != pid and self._has_ended(pid):
                self._ended_unasked = pid
            self._signalled = pid
            self._signal(action.signal)
            # a tree an operator stopped (``signal STOP``) gets its stop signal only once it
            # runs again: woken, as systemd does, rather than killed at stop_timeout_s
            self._signal(signal.SIGCONT, quiet=True)
        elif isinstance(action, lc.KillTree):
            if self.record.pid is not None:
                self._log.warning("worker.kill", pid=self.record.pid, reason=action.reason)
                kill_tree(self.record.pid, self._tree)
        elif isinstance(action, lc.Transitioned):
            self._log.log(
                # giving up on a worker is what an operator must hear of first; one more
                # look of a wait for a GPU that found none, as before, is not news
                40 if action.new is WorkerState.FATAL else 10 if action.repeat else 20,
                "worker.state",
                pid=self.record.pid
                if action.new is WorkerState.STARTING
                else self.record.pid or self._last_pid,
                old=action.old.value,
                new=action.new.value,
                reason=action.reason,
            )
            self._on_event(
                self,
                "worker.state",
                {"old": action.old.value, "new": action.new.value, "reason": action.reason},
            )
        elif isinstance(action, lc.Extended):
            self.extended_in.add(action.state)
            # the first in a state at info; more (a loader that sends it every few seconds)
            # at debug
            self._log.log(
                20 if action.first else 10,
                "worker.timeout_extended",
                pid=self.record.pid,
                state=action.state.value,
                left_s=round(action.seconds, 3),
            )
        elif isinstance(action, lc.Exit):
            self._exited(action)
        return None

    # --- actions ------------------------------------------------------------------------

    def _spawn(self) -> lc.Event:
        self.spawn_attempts += 1
        self._last_pid = None  # a failed spawn's state changes name no process
        try:
            cgroup = self._before_spawn(self) if self._before_spawn is not None else None
            child = spawn(self.spec, cgroup)
        except SpawnError as exc:
            self._log.error("worker.spawn_failed", reason="spawn_failed", error=str(exc))
            self.output.mark(f"spawn failed: {exc}")
            return lc.SpawnFailed(str(exc))
        self._child = child
        self._started_as = self._configured
        self._spawned = self.spec  # as run: placed where the pre-start hook said
        self._last_pid = child.pid
        self._tree = []
        self.stopping_notified = False
        self.watchdog_triggered = False
        self._notified.clear()
        self.extended_in.clear()
        self._said_invalid.clear()
        self._said_error = (None, None)
        self.liveness_failed = None
        self.liveness_failing = (0, "")
        self.status_text = ""
        self.started_wall = self._clock.wall()
        self._create_time = None
        self._reaped = False
        self._ended_unasked = self._signalled = None
        self._register_pid(child.pid, self)
        self._reaper.register(child.pid, self._on_reaped)
        assert self._tg is not None
        self._tg.start_soon(self.output.pump, child.output_fd)
        if self.spec.ready_url is not None:
            self._tg.start_soon(self._probe_health, child.pid, self.spec.ready_url)
        self._start_liveness(child.pid)
        self.output.mark(f"started pid {child.pid}")
        self._log.info(
            "worker.spawned", pid=child.pid, argv=redact_argv(self.spec.argv), reason="start"
        )
        self._on_event(self, "worker.spawned", {"pid": child.pid})
        return lc.Spawned(child.pid)

    async def _prepare_and_spawn(self, token: int) -> None:
        """Run the pre-start hook (GPU-release barrier, re-placement), then spawn; a string
        from the hook says why no GPU can be had now: the worker waits for one (``NoGpu``)."""
        assert self._prepare is not None
        while True:
            configured = self._configured
            result = await self._prepare(self)
            if self._configured is configured:
                break
            # a reload gave this worker a new plan while we waited (the GPU-release barrier):
            # prepare that one (regression: the old plan was started, and counted as the new)
        # Queued, not done here: what was posted while the hook ran (an operator's stop, a
        # restart) is applied first, and decides whether this spawn is still wanted. Spawned
        # here, a process could start behind a queued Stop that the lifecycle had already
        # applied to "starting, no process": stopped, and the process never tracked.
        self.post(_Prepared(token, result))

    def _prepared(self, prepared: _Prepared) -> lc.Event | None:
        """Spawn as the pre-start hook said, if the worker still waits for that start."""
        rec = self.record
        if prepared.token != self._spawn_token or rec.state is not WorkerState.STARTING or rec.pid:
            return None  # stopped (or restarted) while the hook ran
        if isinstance(prepared.result, str):
            self._last_pid = None
            self.spawn_attempts += 1  # an attempt all the same: a roll-out waiting on it ends
            self._waiting_for_gpu(prepared.result)
            return lc.NoGpu(prepared.result)
        self.spec = prepared.result
        return self._spawn()

    def _waiting_for_gpu(self, why: str) -> None:
        """Say (once a wait, and again when the reason changes) that no GPU can be had."""
        if self.record.gpu_waits and why == self._gpu_wait_reason:
            self._log.debug("worker.waiting_gpu", reason="no_gpu", error=why)
            return
        self._gpu_wait_reason = why
        self._log.warning(
            "worker.waiting_gpu",
            reason="no_gpu",
            error=why,
            hint="it starts once a GPU fits (not counted as a failed start)",
        )
        self.output.mark(f"waiting for a GPU: {why}")
        self._on_event(self, "worker.waiting_gpu", {"reason": "no_gpu", "error": why})

    def _on_reaped(self, reaped: Reaped) -> None:
        if self._child is not None and reaped.pid == self._child.pid:
            self._reaped = True
        unasked = reaped.pid == self._ended_unasked
        if unasked:
            self._ended_unasked = None  # (its pid may be a later process's)
        self.post(lc.Exited(reaped.pid, reaped.status, unasked=unasked))

    def _has_ended(self, pid: int) -> bool:
        """Whether the process ``pid`` has ended: collected already, or a zombie yet to be
        (``waitid`` with ``WNOWAIT`` leaves its status to the reaper)."""
        if self._reaped and self._child is not None and self._child.pid == pid:
            return True
        try:
            return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except OSError:  # not a child of ours (any more): nothing to tell
            return False

    def send_signal(self, sig: int, reason: str) -> int | None:
        """Send ``sig`` to the worker's whole process tree now (an operator's ``signal``);
        the leader's pid, or None when it has no process."""
        pid = self.record.pid
        if pid is None:
            return None
        self._signal(sig, reason)
        return pid

    def _signal(self, sig: int, reason: str | None = None, *, quiet: bool = False) -> None:
        pid = self.record.pid
        if pid is None:
            return
        # Remember the tree now: descendants that left the process group are found this way.
        if not quiet:
            self._tree = descendants(pid)
        signal_group(pid, sig)
        for proc in self._tree:
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(proc.pid) != pid:
                    proc.send_signal(sig)
        if quiet:
            return
        self._log.info(
            "worker.signal",
            pid=pid,
            signal=signal.Signals(sig).name,
            reason=reason or self.record.reason,
        )

    def _exited(self, action: lc.Exit) -> None:
        child = self._child
        outcome = action.outcome
        if child is not None and outcome.status is not None:
            child.mark_reaped(outcome.status)
            # The leader is gone: whatever is left of its tree goes with it.
            kill_tree(child.pid, self._tree, scan=False)
            self._register_pid(child.pid, None)
        self._child = None
        self._tree = []
        self.last_exit_at = self._clock.now()
        self.last_exit_wall = self._clock.wall()
        self.last_exit_pid = child.pid if child else None
        self._exit_reason = None
        self._create_time = None
        if action.failure:
            self.failed_attempt = self.spawn_attempts
        status = outcome.status
        detail = outcome.detail or outcome.reason.value
        # its last words may still be in the pipe: they come before the marker, and the death
        # is judged by them (a traceback written just before the exit)
        self.output.drain()
        self.output.mark(f"exited: {detail} (reason {outcome.reason.value})")
        self._log.log(
            30 if action.failure else 20,
            "worker.exited",
            pid=child.pid if child else None,
            code=status.code if status else None,
            signal=status.signal_name if status else None,
            core_dumped=status.core_dumped if status else False,
            reason=outcome.reason.value,
            failure=action.failure,
        )
        self._on_event(
            self,
            "worker.exited",
            {
                "pid": self.last_exit_pid,
                "code": status.code if status else None,
                "signal": status.signal_name if status else None,
                "core_dumped": status.core_dumped if status else False,
                "reason": outcome.reason.value,
                "failure": action.failure,
            },
        )
        if self._on_exit is not None:
            self._on_exit(self, action, self._before)

    def _current_pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    async def _probe_health(self, pid: int, url: str) -> None:
        import httpx  # only groups with an HTTP health URL pay for the import

        self.last_probe = None
        client = self._probes.client(self.name)  # (HttpProbes: no proxy, redirects followed: the
        # first 2xx at the end of them is ready)

        def probing() -> bool:
            # The process, not the record: a start after the pre-start hook queues its
            # ``Spawned`` and this task may run before the record has the pid.
            return self._current_pid() == pid and self.record.state is WorkerState.STARTING

        since = self._clock.now()
        while probing():
            try:
                status = await _get(client, url, HEALTH_TIMEOUT_S)
            except httpx.TimeoutException:
                said = f"timed out after {HEALTH_TIMEOUT_S:g} s"
            except httpx.HTTPError as exc:
                said = connection_reason(exc)[:200]
            except Exception as exc:  # a URL httpx cannot use: never the supervisor's end
                self._log.error("worker.health_probe_failed", pid=pid, url=url, error=repr(exc))
                self.last_probe = f"cannot be asked: {exc!r}"
                return
            else:
                if 200 <= status < 300:
                    self.post(lc.Ready(pid))
                    return
                said = f"HTTP {status}"
            if not probing():
                # cut short by its stop (a start timeout killed the server under the probe):
                # the worker's last answer stays what it said (regression: "Server
                # disconnected", which the kill caused, in the start_timeout post-mortem)
                return
            self.last_probe = said
            # less often the longer it loads (regression: every 0.2 s for minutes), often
            # again in the last seconds of start_timeout_s (regression: ready in its last
            # second, unseen: the next probe was due after the kill)
            now, deadline = self._clock.now(), self.record.deadline
            left = math.inf if deadline is None else deadline - now
            await anyio.sleep(ready_poll_s(now - since, left))

    def _start_liveness(self, pid: int) -> None:
        """Ask the liveness URL about process ``pid`` while it is ready (one task a process)."""
        if self.spec.liveness is not None and self._liveness_pid != pid and self._tg is not None:
            self._liveness_pid = pid
            self._tg.start_soon(self._probe_liveness, pid)

    async def _liveness_pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less when a reload changes the liveness settings."""
        wake = self._liveness_wake = anyio.Event()
        with anyio.move_on_after(seconds):
            await wake.wait()

    async def _probe_liveness(self, pid: int) -> None:
        """``health.liveness_url``: asked every ``liveness_interval_s`` while the worker is
        ready; ``liveness_failures`` answers in a row that are no 2xx (an error status, no
        answer within ``liveness_timeout_s``, a refused connection) make it hung: restarted
        as a missing heartbeat is (reason ``hang``). A server whose engine died behind a
        live HTTP front (its /health says 500) is caught so, without sd_notify."""
        failed, last = 0, ""
        asked_at: float | None = None  # when the last probe (or look at the state) began
        graced = False  # the last probe's timeout was noticed late: it was asked again
        try:
            client = self._probes.client(self.name)
            while self._current_pid() == pid:
                live = self.spec.liveness
                if live is None:
                    return  # a reload turned it off
                now = anyio.current_time()
                if asked_at is not None and now < asked_at + live.interval_s:
                    # due by the interval as it is now: a reload wakes the wait (and a
                    # shorter interval applies at once, not after the old one ran out)
                    await self._liveness_pause(asked_at + live.interval_s - now)
                    continue
                asked_at = now
                if self.record.state is not WorkerState.READY:
                    failed = 0  # (loading, draining: not asked, nor counted)
                    continue
                try:
                    ok, what = await _ask(client, live.url, live.timeout_s)
                except _Stalled as stalled:
                    ok, what = False, f"timed out after {live.timeout_s:g} s"
                    if not graced:
                        # its timeout noticed long after it passed: the supervisor was
                        # stalled (a paused VM or container, a starved CPU), and the worker
                        # with it maybe: not judged, asked again at once (once in a row, as
                        # a heartbeat deadline gets one grace)
                        graced, asked_at = True, None
                        self._log.info(
                            "worker.liveness_probe_late",
                            pid=pid,
                            url=live.url,
                            late_s=round(stalled.late_s, 3),
                        )
                        continue
                graced = False
                if ok is None:  # a URL that cannot be asked at all: never a restart
                    self._log.error(
                        "worker.liveness_probe_failed", pid=pid, url=live.url, error=what
                    )
                    return
                # judged by the settings as they are now: a reload while it was in
                # flight may have turned the probe off, loosened it or moved the URL
                now_live = self.spec.liveness
                if now_live is None:
                    return
                if (
                    self._current_pid() != pid
                    or self.record.state is not WorkerState.READY
                    or now_live.url != live.url
                ):
                    failed = 0  # not its answer to judge (it left ready, another URL)
                elif ok:
                    failed = 0
                else:
                    failed, last = failed + 1, what
                if self._current_pid() == pid and (
                    (failed, last if failed else "") != self.liveness_failing
                ):
                    self.liveness_failing = (failed, last if failed else "")
                    self._on_change(self)  # (the worker object says it)
                if failed:
                    self._log.info(
                        "worker.liveness_probe",
                        pid=pid,
                        url=live.url,
                        answer=what,
                        failed=failed,
                        of=now_live.failures,
                    )
                    if failed >= now_live.failures:
                        self.liveness_failed = (
                            f"{failed} liveness probes in a row failed ({live.url}; last: {last})"
                        )
                        self._log.warning(
                            "worker.liveness_failed",
                            pid=pid,
                            url=live.url,
                            failures=failed,
                            last=last,
                        )
                        self.post(lc.Heartbeat(pid, trigger=True))
                        return
        finally:
            if self._liveness_pid == pid:
                self._liveness_pid = None


async def _ask(client: Any, url: str, timeout: float) -> tuple[bool | None, str]:
    """One liveness probe: (a 2xx, what it got); (None, why) when the URL cannot be asked at
    all (httpx cannot use it; an https URL whose certificate is refused: a restart mends
    neither, and a healthy worker would be restarted for it again and again). ``_Stalled``
    when it timed out but that was noticed well after the timeout passed."""
    import ssl

    import httpx

    timed_out = False, f"timed out after {timeout:g} s"
    status = None
    began = anyio.current_time()
    try:
        # the timeout bounds the whole probe (redirects, a body that trickles in), not only
        # each connect and read as httpx's own does
        with anyio.move_on_after(timeout):
            status = await _get(client, url, timeout)
    except httpx.TimeoutException:
        _raise_if_late(began + timeout)
        return timed_out
    except httpx.HTTPError as exc:
        # an https URL asked of a plain HTTP server (WRONG_VERSION_NUMBER) is as much a
        # mistake of the URL's (regression: the worker restarted as hung, again and again)
        if _caused_by(exc, ssl.SSLCertVerificationError) or _plain_http(exc):
            return None, connection_reason(exc)[:200]
        return False, connection_reason(exc)[:200]
    except Exception as exc:  # a URL httpx cannot use: never the supervisor's end
        return None, repr(exc)[:200]
    if status is None:
        _raise_if_late(began + timeout)
        return timed_out
    return 200 <= status < 300, f"HTTP {status}"


class _Stalled(Exception):
    """A probe's timeout noticed ``late_s`` after it passed (more than ``LATE_S``): the
    supervisor was stalled, not the worker slow to answer (an answer that came counts)."""

    def __init__(self, late_s: float) -> None:
        super().__init__(f"timeout noticed {late_s:.3f} s late")
        self.late_s = late_s


def _raise_if_late(deadline: float) -> None:
    """``_Stalled`` when ``deadline`` (a probe's timeout) passed more than ``LATE_S`` ago."""
    late = anyio.current_time() - deadline
    if late > LATE_S:
        raise _Stalled(late)


async def _get(client: Any, url: str, timeout: float) -> int:
    """GET ``url``: the status, once the answer's body has ended or ``PROBE_BODY_MAX`` bytes of
    it came (the rest is not read: the connection is closed). Redirects are followed here (if
    the client follows them, as many as it does), each answer read so: httpx reads the
    whole body of a redirect before it follows it, and one that never ends held the probe."""
    import httpx

    request = client.build_request("GET", url, timeout=timeout)
    redirects = 0
    retried = False
    while True:
        try:
            response = await client.send(request, stream=True, follow_redirects=False)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            # a kept-alive connection the server closed as the request went out (its idle
            # timeout ran out just then: uvicorn's and Node's 5 s) is no answer of the
            # worker's: asked once more, on a new connection (regression: a failed probe,
            # and a healthy worker restarted as hung)
            if retried:
                raise
            retried = True
            continue
        try:
            read = 0
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read >= PROBE_BODY_MAX:
                    break
        finally:
            await response.aclose()
        status: int = response.status_code
        following = response.next_request
        if following is None or not client.follow_redirects:
            return status
        if redirects >= client.max_redirects:
            raise httpx.TooManyRedirects("Exceeded maximum allowed redirects.", request=following)
        redirects += 1
        request = following


def _plain_http(exc: BaseException) -> bool:
    """``exc`` says a TLS handshake got a plain HTTP answer (OpenSSL's WRONG_VERSION_NUMBER;
    RECORD_LAYER_FAILURE from OpenSSL 3.2 on: regression, not taken for one there)."""
    import ssl

    return any(
        isinstance(seen, ssl.SSLError)
        and (
            seen.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE")
            or "wrong version number" in str(seen)
            or "record layer failure" in str(seen)
        )
        for seen in _causes(exc)
    )


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """``exc`` is, or was raised from, a ``kind``."""
    return any(isinstance(seen, kind) for seen in _causes(exc))


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or during, ten deep at most."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def is_idle(runner: WorkerRunner) -> bool:
    """No process, and nothing will start one on its own (stopped or fatal)."""
    return runner.record.pid is None and runner.state not in RUNNING_STATES | {WorkerState.BACKOFF}
