"""Composition root: builds the ports from ``Settings`` and owns the task tree.

One anyio task group holds the reaper, the notify listener, the signal listener, the intent
consumer, the systemd notifier and one runner per worker. Signals (and, later, the API) become
``Intent`` values on one stream; only the intent consumer changes the set of runners.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import resource
import signal
import stat
import threading
import time
from collections import deque
from collections.abc import (
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import anyio
import anyio.abc
import psutil
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from supervisor import procfs
from supervisor._version import __version__
from supervisor.alerts import Alerter
from supervisor.backends.base import PLACEHOLDER, NoBackend
from supervisor.backends.factory import make_backend
from supervisor.cgroups import CgroupSupport, WorkerCgroups, with_memory
from supervisor.cgroups import probe as probe_cgroups
from supervisor.clock import AnyioClock, Clock
from supervisor.config import Settings, WorkerGroup, load_settings, read_config
from supervisor.errors import ConfigError, PlacementError, SpawnError, StateDirBusy
from supervisor.files import make_dir
from supervisor.healing import Healer
from supervisor.journal import Journal
from supervisor.logs import install_loop_exception_handler
from supervisor.model import (
    Account,
    DeviceSample,
    ExitReason,
    LaunchSpec,
    Sample,
    WorkerState,
    XidEvent,
)
from supervisor.notify import (
    PRIVATE_DIR_MODE,
    SHARED_DIR_MODE,
    SHARED_SOCKET_MODE,
    NotifyListener,
    NotifyMessage,
    answers,
    others_may_replace,
    private_socket_path,
    remove_leftover_private_dirs,
    shared_socket_path,
    socket_path_for,
)
from supervisor.output import WorkerOutput, this_run
from supervisor.plan import (
    CORDONED,
    INSTANCE_VAR,
    SUSPECT,
    WORKER_VAR,
    GpuSlot,
    Plan,
    Room,
    build_plan,
    covering,
    cpus_of,
    gpu_assignment,
    launch_spec,
    may_restart_in_place,
    more_room,
    place,
    resolve_explicit,
    slot_for,
    worker_cpus,
)
from supervisor.policy import lifecycle as lc
from supervisor.policy.attribution import alias_owner, listed_for_suspects, still_held
from supervisor.policy.classify import CUDA_OOM_FRESH_S, classify, may_be_oom_kill
from supervisor.policy.detect import ThermalTrack
from supervisor.policy.lifecycle import may_start
from supervisor.policy.ratelimit import RateLimit
from supervisor.policy.reload import (
    ReloadDiff,
    applied_by_reload,
    diff_groups,
    port_waits,
    start_only_changes,
)
from supervisor.policy.retention import budget as logs_budget
from supervisor.processes import (
    Reaped,
    Reaper,
    allowed_cpus,
    descendants,
    open_files_needed,
    pass_on_ignored_signals,
    probe_spawn_helper,
    reporters_unreadable,
    resolve_accounts,
    set_child_subreaper,
    unblock_inherited_signals,
    unreachable_for,
    unrunnable,
)
from supervisor.reclaim import KILL_WAIT_S as RECLAIM_KILL_WAIT_S
from supervisor.reclaim import TERM_WAIT_S, reclaim
from supervisor.records import (
    CORDONS_FILE,
    INSTANCE_FILE,
    LOCK_FILE,
    POSTMORTEM_DIR,
    QUARANTINE_FILE,
    STATE_FILE,
    Recorder,
    ThreadUnavailable,
    WriteHealth,
    in_thread,
    instance_id,
    lock_state_dir,
    read_cordons,
    read_json,
    read_quarantine,
    remove_temp_files,
    retain_worker_logs,
    unreadable_why,
    write_cordons,
    write_lock_pid,
    write_quarantine,
)
from supervisor.sampler import LOST_UNLISTED, Sampler, WorkerRef, host_interval, stuck_text
from supervisor.sdnotify import SystemdNotifier
from supervisor.sigmask import HELD_SIGNALS, release_held_signals
from supervisor.views import (
    STATE_SCHEMA_VERSION,
    SamplePoint,
    StateWorker,
    WorkerFacts,
    device_object,
    postmortem_doc,
    postmortem_id,
    redact_url,
    state_doc,
)
from supervisor.worker import HttpProbes, WorkerRunner, is_idle


def _claimed_ports(changed: Collection[str], plan: Plan) -> dict[int, str]:
    """Port -> the changed group whose new worker (in ``plan``) takes it."""
    return {
        spec.port: planned.group.name
        for planned in plan.groups
        if planned.group.name in changed
        for spec in planned.workers
        if spec.port is not None
    }


#: What ``state_dir/quarantine`` holds: GPU UUID -> why it is quarantined, and GPU UUID -> the
#: flags on when an operator lifted its quarantine (``HealState.lifted``).
QuarantineDoc = tuple[dict[str, str], dict[str, dict[str, int]]]


#: After SIGKILL, how long to wait for the kernel to hand back the last children.
KILL_WAIT_S = 5.0
#: How long past a port holder's drain and stop timeouts a start waits for the port.
PORT_WAIT_SLACK_S = 1.0
#: The states whose deadline a roll-out's (or a removal's) wait follows where the worker asked
#: for more time (EXTEND_TIMEOUT_USEC): a start, a drain, a stop
_EXTENDABLE = frozenset({WorkerState.STARTING, WorkerState.DRAINING, WorkerState.STOPPING})
#: A message the service manager must get that found its queue full is sent again after this,
#: doubling up to ``NOTIFY_RETRY_MAX_S``.
NOTIFY_RETRY_MIN_S = 0.05
NOTIFY_RETRY_MAX_S = 1.0
#: How long a restart waits for the previous process's cgroup to empty (seconds).
CGROUP_EMPTY_WAIT_S = 2.0
#: How long a stop during start-up waits for the reclaim of a predecessor's orphans.
RECLAIM_WAIT_S = TERM_WAIT_S + RECLAIM_KILL_WAIT_S + 1.0
#: How many times an exited worker's leftovers are looked for among our children (a dying
#: member hands its children to us as it dies: one more read finds them).
LEFTOVER_ROUNDS = 4
#: How often the shared notify socket's file is looked for (seconds; bound again if gone).
SHARED_CHECK_EVERY_S = 10.0
#: Datagrams read at most from the notify socket before a worker's deadline is judged.
NOTIFY_BEFORE_DEADLINE = 4096
#: At most one ``supervisor.reaped_orphan`` line at info this often (seconds): a worker that
#: leaves orphans for as long as it runs would otherwise say so all day (regression: once a
#: second).
ORPHAN_LOG_EVERY_S = 60.0
#: At most one ``output.log_trimmed`` line at warning per worker this often (seconds): on a
#: disk that stays full, a chatty worker's log gives up its space at each full-disk write.
LOG_TRIM_SAID_EVERY_S = 60.0
#: How long a reload waits for the removal of the logs of workers no longer configured (a disk
#: that hangs rather than fails must not hold the reload: the next one removes them).
LOGS_RETAIN_WAIT_S = 10.0
#: How often the GPU-release barrier looks again while the old tree still holds memory.
RELEASE_POLL_S = 0.25
#: How often the GPU/worker summary is logged.
SUMMARY_EVERY_S = 15.0
#: Samples kept per worker for its post-mortem (60 s at the default 0.5 s interval).
SAMPLES_KEPT = 120
#: Journal events copied into a post-mortem.
POSTMORTEM_EVENTS = 50


# --- intents -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop every worker gracefully, then exit; a second one forces (SIGKILL)."""

    signal_name: str = ""


@dataclass(frozen=True, slots=True)
class Reload:
    """Re-read the config file and apply the difference.

    ``request``: the number :meth:`Runtime.request_reload` gave it (0: a signal's); the
    journal's ``reload.done`` / ``reload.rejected`` say up to which request a reload covers.
    """

    request: int = 0


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """An operator command for a worker (``gpen-1``) or a whole group (``gpen``)."""

    target: str
    event: lc.Start | lc.Stop | lc.Restart | lc.Drain


@dataclass(frozen=True, slots=True)
class RollingRestart:
    """Restart a group one worker at a time, each waiting for readiness."""

    group: str
    #: the number :meth:`Runtime.request_rolling_restart` gave it: its ``rollout.done`` /
    #: ``rollout.halted`` in the journal carry it (0: none)
    request: int = 0


@dataclass(frozen=True, slots=True)
class Cordon:
    """Stop (``cordon``) or allow again placing workers on a GPU (by UUID)."""

    uuid: str
    cordon: bool = True
    #: with an uncordon: lift a quarantine too (the GPU was reset or repaired)
    lift_quarantine: bool = False


Intent = Shutdown | Reload | WorkerCommand | RollingRestart | Cordon

#: A task started with the runtime (the HTTP API): ``service(runtime, task_status=...)``.
Service = Callable[..., Coroutine[Any, Any, None]]


#: Services start once every worker has been spawned, or after this long at most.
SERVICES_WAIT_S = 2.0


def _end_of_startup() -> None:
    """Turn on the garbage collector if the entry point held it off during start-up.

    ``python -m supervisor`` / ``gpu-supervisor`` disable it before importing anything: the
    imports and the config allocate hundreds of thousands of objects, and the collections they
    set off cost ~70 ms of start-up. What exists now is moved to the permanent generation
    (``gc.freeze``), so later full collections do not walk it again.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


#: The same stop signal again within this long is the same request, not a second one that
#: forces the stop: GNU ``timeout`` (and a script that signals a process and then its process
#: group) sends SIGTERM twice in the same instant, which made a graceful stop a SIGKILL of
#: every worker. A person's second Ctrl-C comes later than this.
SIGNAL_REPEAT_S = 0.3


def signal_intent(
    signum: int, shutting_down: bool, since_same_s: float = math.inf
) -> Intent | None:
    """Map a received signal to an intent (pure, so tests can call it directly).

    ``since_same_s``: how long since the same signal was last received.
    """
    if signum in (signal.SIGTERM, signal.SIGINT):
        if since_same_s < SIGNAL_REPEAT_S:
            return None  # the first one again (the same sender, twice)
        return Shutdown(signal.Signals(signum).name)
    if signum == signal.SIGHUP and not shutting_down:
        return Reload()
    return None


class Runtime:
    """The running supervisor."""

    def __init__(
        self,
        settings: Settings,
        config_path: Path | None = None,
        *,
        environ: MutableMapping[str, str] | None = None,
        clock: Clock | None = None,
        subreaper: bool = True,
        trace_samples: bool = False,
        services: Sequence[Service] = (),
    ) -> None:
        self.settings = settings
        self.config_path = config_path
        self.environ = os.environ if environ is None else environ
        self.clock: Clock = clock or AnyioClock()
        self.log = structlog.get_logger()
        self.runners: dict[str, WorkerRunner] = {}
        self.groups: dict[str, list[str]] = {}
        self._halted: set[str] = set()  # groups whose last rollout halted part-way
        #: group -> the definitions that roll-outs which halted (or were superseded) part-way
        #: rolled onto some of its workers, while it is dirty (in ``_halted``)
        self._halted_defs: dict[str, list[WorkerGroup]] = {}
        #: worker -> the definition its spec was planned from (a reload's roll-out sets it
        #: worker by worker): a worker planned again on other GPUs keeps it
        self._defs: dict[str, WorkerGroup] = {}
        self._state_lock: int | None = None  # the fd holding state_dir's lock (records)
        self._lock_lost: str | None = None  # why state_dir could not be locked again
        #: held while the lock fd is written to (writer thread) or replaced (the loop)
        self._state_lock_guard = threading.Lock()
        self._instance: str | None = None  # state_dir's id, in the workers' environment
        self._instance_unsaved = False  # made in memory: state_dir/instance not written yet
        self._lock_pid_unsaved = False  # the lock file does not name us yet
        #: the operator's cordons that state_dir/cordons could not take (a full disk): saved
        #: after the next state write that works; held with ``_cordons_guard``
        self._cordons_unsaved: frozenset[str] | None = None
        self._cordons_guard = threading.Lock()  # one writer of state_dir/cordons at a time
        #: the quarantines state_dir/quarantine holds (None: not known to hold the ones now,
        #: a write failed or the directory was recreated): written again when they differ
        self._quarantine_saved: QuarantineDoc | None = ({}, {})
        #: the quarantines state_dir/quarantine could not take (a full disk): written after
        #: the next state write that works, as the cordons are; held with the guard
        self._quarantine_unsaved: QuarantineDoc | None = None
        self._quarantine_guard = threading.Lock()
        #: the file on disk holds only an earlier boot's entries (the next start drops them)
        self._quarantine_stale_only = False
        self._reclaim_done = anyio.Event()  # the start-up reclaim of a predecessor's orphans
        self.reaper = Reaper(on_orphan=self._on_orphan)
        self.systemd = SystemdNotifier(self.environ)
        self._subreaper = subreaper
        self._pids: dict[int, WorkerRunner] = {}
        #: notify senders of no worker, not walked up /proc again for a second
        self._unknown_senders = procfs.UnknownPids()
        self._changed = anyio.Event()
        self._intent_send: MemoryObjectSendStream[Intent]
        self._intent_recv: MemoryObjectReceiveStream[Intent]
        self._intent_send, self._intent_recv = anyio.create_memory_object_stream[Intent](math.inf)
        self._tg: anyio.abc.TaskGroup | None = None
        self._shutting_down = False
        #: workers a reload is stopping for good (their group or replica is gone)
        self.removing: set[str] = set()
        self._forced = False
        self._hurry = threading.Event()  # a forced stop: the start-up reclaim kills at once
        self._done = anyio.Event()
        self._reloading = False
        self._reload_again = False
        self._covered = 0  # the last reload request the reload running now covers
        #: the last reload request whose file, read while a roll-out ran, would be accepted:
        #: only such a file supersedes the roll-out (a rejected one must change nothing)
        self._vetted = 0
        #: the file such a request was checked with, ``(request, its TOML)``: the reload that
        #: follows the superseded roll-out applies exactly that (the file may have changed
        #: since: a file made bad meanwhile left the group part-way, rejected)
        self._vetted_data: tuple[int, dict[str, Any]] | None = None
        #: reload requests numbered so far (signals and the API)
        self.reload_requests = 0
        #: rolling restart requests numbered so far (the API)
        self.rolling_requests = 0
        self._ready_sent = False
        self._notify_kept = anyio.Event()  # a message for the service manager waits to go
        self._all_added = False
        self.notify_path = socket_path_for(settings.supervisor.state_dir)
        #: in a private directory of /tmp (``state_dir/notify.sock`` is too long a socket
        #: path), the socket's directory is its own: made again where a cleaner removed it
        in_tmp = self.notify_path.parent != settings.supervisor.state_dir.absolute()
        self.listener = NotifyListener(
            self.notify_path, self._on_notify, dir_mode=PRIVATE_DIR_MODE if in_tmp else None
        )
        self._notify_error: str | None = None  # why the notify socket cannot be bound again
        #: the socket workers running as another user (``user``) get: opened when first needed
        self.shared_listener: NotifyListener | None = None
        self.shared_path: Path | str = shared_socket_path(settings.supervisor.state_dir)
        self.shared_error: str | None = None  # why it could not be opened
        #: ``[[workers]] user`` values as last resolved (``_accounts``)
        self._account_cache: dict[str, Account | str] = {}
        #: ``max_starting``: workers waiting for their turn to start, first come first; and
        #: those whose turn came, until they leave ``starting`` (their process loads meanwhile)
        self._start_queue: list[str] = []
        self._let_go: set[str] = set()
        self._shared_checked_at = 0.0
        self.started_wall = self.clock.wall()
        #: the monotonic start (set in ``run``, on the loop's clock): uptime is not moved by
        #: a step of the wall clock
        self.started_mono = 0.0
        self.exit_code = 0
        self.sampler = Sampler(
            lambda: make_backend(self.settings.gpu),
            settings.supervisor.sample_interval_s,
            self._worker_refs,
            self._on_sample,
            self._on_xid,
        )
        self._set_host_interval()
        self.suspect: dict[str, frozenset[int]] = {}  # GPU UUID -> old pids still holding memory
        #: GPU UUID -> each old pid there still holding memory -> the worker it was of
        self._suspect_of: dict[str, dict[int, str]] = {}
        #: workers that could not be placed at start (a GPU lost or missing, none fitting):
        #: placed at each start until they are; why not
        self._unplaced: dict[str, str] = {}
        #: worker -> its process a placement roll-out was started for (GPU telemetry came up
        #: after it started unplaced): not again for that process while telemetry stays up
        self._placing: dict[str, int] = {}
        #: workers a placement roll-out left serving unplaced for want of room: tried again
        #: once one of them fits (``_no_room_fits``)
        self._no_room: set[str] = set()
        #: worker -> the GPUs its start was placed on (prepared, not spawned yet): where it
        #: counts for the placements made meanwhile (``_assignments``)
        self._prepared_gpus: dict[str, tuple[str, ...] | None] = {}
        self.cordoned: set[str] = set()
        self._replaced_seen = 0  # the sampler's GPU replacements acted on (_forget_replaced)
        self.xid_counts: dict[tuple[str, int], int] = {}
        self._trees: dict[str, frozenset[int]] = {}
        self._sampled = anyio.Event()
        self._recorded: object = None  # what the last sample showed that state.json records
        #: what placement had to go by at the last sample (usable GPUs, workers on each)
        self._room: Room | None = None
        self._summary_at = 0.0
        self._trace_samples = trace_samples
        self.services = tuple(services)
        # read model: journal, records, counters
        self.journal = Journal()
        self.write_health = WriteHealth()
        self.recorder = Recorder(
            settings.supervisor.state_dir,
            settings.supervisor.postmortem_keep,
            self.write_health,
            self._state_snapshot,
            on_dir_recreated=self._on_state_dir_recreated,
            create_time=self.sampler.member_create_time,
            after_state_written=self._save_unsaved_ids,
            now=self.clock.now,
        )
        self.postmortems = self.recorder.store
        self.reclaimed: list[dict[str, Any]] = []
        self.stopped = False
        self.loop_alive_at = 0.0  # monotonic time of the last sample or worker change
        self.samples_of: dict[str, deque[SamplePoint]] = {}
        self.restarts_total: dict[tuple[str, str], int] = {}
        self._orphans_unlogged = 0
        #: the last reload's result and when a load last succeeded (the start counts), as
        #: Prometheus reports its own: config_last_reload_successful / ..._timestamp_seconds
        self.last_reload: tuple[bool, float] = (True, self.clock.wall())
        self._orphan_logged_at = -math.inf
        #: output.log_trimmed at warning once a minute per worker (``LOG_TRIM_SAID_EVERY_S``)
        self._trims_said = RateLimit(LOG_TRIM_SAID_EVERY_S)
        self.postmortems_total: dict[str, int] = {}
        self.actions_total: dict[tuple[str, str], int] = {}
        self.sample_listeners: list[Callable[[Sample], None]] = []
        #: group -> what is rolling it out now ("rolling restart", "reload", PLACEMENT): one
        #: at a time
        self.rolling: dict[str, str] = {}
        #: the HTTP clients of the workers' readiness and liveness probes (one per worker)
        self.http_probes = HttpProbes()
        #: groups whose operator rolling restart a reload's roll-out waits for, which restarts
        #: every worker on a new definition anyway: the rolling restart stops there
        self._roll_waiting: set[str] = set()
        self._halted_at: dict[str, dict[str, Any]] = {}  # group -> where its roll-out halted
        self._fingerprints: dict[str, tuple[object, ...]] = {}
        # self-healing: detectors and actions; webhook alerts
        url = settings.alerts.webhook_url
        self.alerter = Alerter(url) if url else None
        self.healer = Healer(self, self.alerter)
        self.cgroups = WorkerCgroups(CgroupSupport(None, False, "not probed yet"))
        self.healer.oom_events_of = self.cgroups.events_file

    # --- public -------------------------------------------------------------------------

    @property
    def shutting_down(self) -> bool:
        """True once a stop of the supervisor has begun."""
        return self._shutting_down

    def _next_reload_request(self) -> int:
        self.reload_requests += 1
        return self.reload_requests

    def request_reload(self) -> int:
        """Queue a reload of the config file (as SIGHUP does); return its request number: the
        first ``reload.done`` / ``reload.rejected`` in the journal whose ``request`` is at
        least this one read the file after this call."""
        n = self._next_reload_request()
        self.submit(Reload(n))
        return n

    def request_rolling_restart(self, group: str) -> int:
        """Queue a rolling restart of ``group``; return its request number, which its
        ``rollout.done`` / ``rollout.halted`` in the journal carry as ``request``.
        Regression: nothing told one roll-out's verdict from another's, so ``restart --rolling
        --wait`` could report another operator's roll-out (or the refusal of a second request
        made at the same time) as its own."""
        self.rolling_requests += 1
        self.submit(RollingRestart(group, self.rolling_requests))
        return self.rolling_requests

    def submit(self, intent: Intent) -> None:
        """Queue an intent for the single writer."""
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._intent_send.send_nowait(intent)

    def workers(self) -> list[WorkerRunner]:
        """Every runner, in config order."""
        return [self.runners[n] for names in self.groups.values() for n in names]

    def group_ready(self, group: str) -> bool:
        """True when the group has at least one ready worker (or no replicas at all)."""
        names = self.groups.get(group, [])
        return not names or any(self.runners[n].state is WorkerState.READY for n in names)

    def all_groups_ready(self) -> bool:
        """Every group has a ready worker."""
        return all(self.group_ready(g) for g in self.groups)

    def status_line(self) -> str:
        """``6/6 ready, 0 fatal, 2 GPUs`` (DESIGN.md section 5; ``no GPU telemetry`` without)."""
        runners = self.workers()
        ready = sum(r.state is WorkerState.READY for r in runners)
        fatal = sum(r.state is WorkerState.FATAL for r in runners)
        # the GPUs once seen are not counted while NVML does not answer (down, or a call that
        # hangs): as nvml_up and the API say (regression: "2 GPUs" for as long as it was down)
        sample = self.sampler.last
        up = sample is not None and sample.nvml_available and self.sampler.stuck() is None
        gpus = len(self.sampler.identities) if up else 0
        tail = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU telemetry"
        return f"{ready}/{len(runners)} ready, {fatal} fatal, {tail}"

    def _in_line(self, names: Iterable[str]) -> bool:
        """One of ``names`` waits its turn to start (``max_starting``)."""
        return any(name in self._start_queue for name in names)

    async def _wait_started(
        self,
        queued: Callable[[], bool],
        predicate: Callable[[], bool],
        budget: float,
        watched: Callable[[], Iterable[WorkerRunner]] = tuple,
    ) -> bool:
        """:meth:`wait_until`, but the ``budget`` (a start timeout in it) does not run while
        ``queued()``: a worker waits its turn to start (``max_starting``), and its
        ``start_timeout_s`` runs from its spawn (regression: a roll-out halted on a worker that
        had not been spawned yet). Nor does it end while one of ``watched()`` has time its
        own EXTEND_TIMEOUT_USEC asked for (regression: a roll-out halted on a worker loading
        as long as it said, a removed worker finishing its stop was killed)."""
        deadline = self.clock.now() + budget
        following = False  # an extension was seen: the lifecycle's deadlines are waited for

        def seen() -> bool:
            # looked at on each change, not only once the budget has run out: the state it
            # was asked in may be over by then (regression: a stop it extended delayed the
            # next start past the budget, and the roll-out gave up on that start)
            nonlocal following
            following = following or any(
                r.record.extended_until is not None and r.state in _EXTENDABLE for r in watched()
            )
            return predicate() or queued()

        while True:
            left = max(0.0, deadline - self.clock.now())
            if not await self.wait_until(seen, left):
                granted = self._granted_until(watched(), following)
                if granted is not None and granted > self.clock.now():
                    deadline, following = granted, True
                    continue
                return predicate()
            if predicate():
                return True
            since = self.clock.now()
            await self.wait_until(lambda: predicate() or not queued(), math.inf)
            deadline += self.clock.now() - since

    def _granted_until(self, runners: Iterable[WorkerRunner], following: bool) -> float | None:
        """When the lifecycle of ``runners`` acts on its own next, plus what a stop after it
        takes: the deadline of a start, drain or stop a worker asked more time for with
        EXTEND_TIMEOUT_USEC (with ``following``, of any: the stop it extended is followed by
        its start). None: none."""
        until: float | None = None
        for runner in runners:
            rec = runner.record
            if (
                rec.deadline is None
                or rec.killed
                or rec.pid is None
                or rec.state not in _EXTENDABLE
                or (rec.extended_until is None and not following)
            ):
                continue
            later = rec.deadline + self._stop_budget(runner)
            until = later if until is None else max(until, later)
        return until

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (re-checked on every worker change) or time runs out."""
        with anyio.move_on_after(timeout):
            while not predicate():
                await self._changed.wait()
            return True
        return predicate()

    async def run(self) -> int:
        """Run until shut down; return the exit code.

        Signal handling and the reaper come first, so a SIGTERM during start-up (while NVML
        initialises, say) is a graceful stop, not a kill.
        """
        install_loop_exception_handler()  # the loop's errors as rate-limited JSON lines
        self.started_mono = self.clock.now()
        sup = self.settings.supervisor
        if self._subreaper and os.getpid() != 1:
            set_child_subreaper()
        probe_spawn_helper()  # before the reaper exists: the probe is a short-lived child
        unblocked = unblock_inherited_signals(HELD_SIGNALS)  # before any worker, and the reaper
        if unblocked:
            self.log.info(
                "supervisor.signals_unblocked",
                signals=unblocked,
                reason="started with them blocked: unblocked, here and in the workers",
            )
        passed = pass_on_ignored_signals()  # before any worker: they get the default back
        if passed:
            held = {s.name for s in HELD_SIGNALS}
            self.log.info(
                "supervisor.signals_ignored",
                signals=passed,
                handled=[s for s in passed if s in held],
                reason="started with them ignored: at their default in the workers; still "
                "ignored here, but for those handled (SIGTERM and SIGINT stop, SIGHUP reloads)",
            )
        self._open_state_dir()
        self._probe_cgroups()
        self._summary_at = anyio.current_time() - SUMMARY_EVERY_S + 3.0
        startup_error: PlacementError | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await tg.start(self._serve_signals)
                await tg.start(self.reaper.serve)
                tg.start_soon(self._serve_intents)
                tg.start_soon(self._retain_logs)  # of workers no longer configured
                try:
                    await self._reclaim_orphans()
                finally:
                    self._reclaim_done.set()
                self._kill_stale_cgroups()
                await tg.start(self.recorder.serve)
                if self.alerter is not None:
                    await tg.start(self.alerter.serve)
                await self._open_gpus()
                self._suspect_unended_orphans()
                try:
                    # A worker that cannot be placed (its GPU lost or missing, none fitting)
                    # does not keep the others from starting: it is placed at its start.
                    plan = self._build_plan(self.settings, unplaced=self._unplaced)
                except PlacementError as exc:
                    startup_error = exc
                    tg.cancel_scope.cancel()
                    plan = Plan((), ())
                self._open_shared_for(w for g in plan.groups for w in g.workers)
                self._warn_unreadable_reporters(plan, [g.group.name for g in plan.groups])
                for warning in plan.warnings:
                    self.log.warning("plan.warning", message=warning)
                for name, why in self._unplaced.items():
                    self.log.error(
                        "worker.unplaced",
                        worker=name,
                        error=why,
                        reason="placed when it starts; the other workers start now",
                    )
                self.log.info(
                    "supervisor.start",
                    pid=os.getpid(),
                    version=__version__,
                    workers=sum(len(g.workers) for g in plan.groups),
                    notify_socket=os.fspath(self.notify_path),
                    pid1=os.getpid() == 1,
                )
                self._check_open_files(sum(len(g.workers) for g in plan.groups))
                await tg.start(self.listener.serve)
                await tg.start(self.sampler.serve)
                tg.start_soon(self._serve_systemd)
                for group_plan in plan.groups:
                    if self._shutting_down:
                        break
                    await self._add_group(group_plan.group, plan)
                self._all_added = True
                self._changed_now()
                _end_of_startup()
                # Services (the API) come after the first spawns: importing FastAPI takes
                # ~0.2 s that the workers need not wait for (its socket is bound already).
                await self.wait_until(self._first_spawns_done, SERVICES_WAIT_S)
                self.sampler.request()  # the first full reading with every worker: now, not in 2 s
                for service in self.services:
                    await tg.start(service, self)
                if sup.systemd_ready == "start" and not self._shutting_down:
                    self._send_ready()  # (never after STOPPING=1: a stop during start-up)
                await self._done.wait()
                tg.cancel_scope.cancel()
        finally:
            self.listener.close()
            if self.shared_listener is not None:
                self.shared_listener.close()
                with contextlib.suppress(OSError):  # state_dir keeps its pass-through bit
                    self.shared_listener.path.parent.rmdir()
            if self.notify_path.parent != self.settings.supervisor.state_dir.absolute():
                with contextlib.suppress(OSError):  # the private temp dir the socket went to
                    self.notify_path.parent.rmdir()
            self.systemd.close()
            if startup_error is not None:
                with anyio.CancelScope(shield=True):
                    await self._close_gpus()
        if startup_error is not None:
            raise startup_error
        self.log.info("supervisor.exit", code=self.exit_code, reason="shutdown")
        return self.exit_code

    def _set_host_interval(self) -> None:
        windows = (g.health.leak_window_s for g in self.settings.workers)
        self.sampler.host_every_s = host_interval(windows)

    def _first_spawns_done(self) -> bool:
        return (
            all(
                r.record.pid is not None or r.state is not WorkerState.STOPPED
                for r in self.workers()
            )
            or self._shutting_down
        )

    async def _reload_alerts(self) -> None:
        """``[alerts] webhook_url`` as reloaded: the next alert goes to the new URL; set for
        the first time, the sender starts now; removed, nothing more is sent."""
        url = self.settings.alerts.webhook_url
        if self.alerter is not None and url:
            self.alerter.url = url
        elif self.alerter is not None:
            self.alerter.forget()  # what is queued was for the URL that is gone
        elif url and self._tg is not None:
            self.alerter = Alerter(url)
            await self._tg.start(self.alerter.serve)
        self.healer.alerter = self.alerter if url else None

    def _sweep_cgroups(self) -> None:
        """Remove the cgroups of workers that are gone which could not be removed then (a
        killed process still exiting). Regression: they were kept until shutdown, one more
        for each reload that removed a worker while a straggler was in its cgroup."""
        waiting = self.cgroups.leftover - self.runners.keys()
        if not waiting:
            return
        left = self.cgroups.sweep(keep=self.runners)
        for name in sorted(waiting.difference(left)):
            self.log.info("cgroup.removed", worker=name, reason="empty now")

    def _kill_stale_cgroups(self) -> None:
        for worker, pids in self.cgroups.stale().items():
            self.log.warning(
                "cgroup.stale",
                worker=worker,
                pids=pids,
                reason="left by an earlier run: its processes killed; the directory is "
                "reused, or removed once empty",
            )

    def _probe_cgroups(self) -> None:
        budgets = any(g.health.host_memory_limit_mb > 0 for g in self.settings.workers)
        support = probe_cgroups(memory=budgets)
        self.cgroups.support = support
        self.log.info(
            "cgroup.mode",
            containment=support.containment,
            mode=support.mode if budgets else None,
            cgroup=None if support.root is None else os.fspath(support.root),
            reason="; ".join(
                [support.contain_why or "a cgroup of its own per worker, ended with cgroup.kill"]
                + ([support.why or "memory.max per worker with a budget"] if budgets else [])
            ),
        )

    # --- GPUs ---------------------------------------------------------------------------

    async def _open_gpus(self) -> None:
        gpu = self.settings.gpu
        # auto runs without GPU telemetry for good only where the NVML library itself is
        # absent (a machine without GPUs). A library that is there but fails to initialise (a
        # driver loaded late, being upgraded: DRIVER_NOT_LOADED, RM version mismatch, no
        # permission) or an open still in flight (a slow or hung driver) is a GPU machine:
        # auto keeps NVML, down meanwhile and opened again with backoff, as nvml does.
        # Regression: it fell back for good on any failure (workers unplaced, XIDs unwatched,
        # no GPUs shown until a restart) though NVML answered seconds later.
        opened = await self.sampler.open(fallback=gpu.backend == "auto")
        if not opened and gpu.backend == "auto" and self.sampler.library_absent:
            self.log.warning(
                "gpu.no_telemetry",
                reason="backend auto: no NVML library on this machine; running without GPU "
                "telemetry (not retried)",
                error=self.sampler.error,
            )
            self.sampler.use(NoBackend())
        with contextlib.suppress(OSError):  # no thread now (a full pids cgroup): the next tick
            await self.sampler.tick()

    async def _close_gpus(self) -> None:
        backend = self.sampler.backend
        if backend is not None:
            await in_thread(backend.close, inline=True)

    def slots(self) -> list[GpuSlot]:
        """The devices as placement sees them now (empty without GPU telemetry)."""
        sample = self.sampler.last
        if sample is None or not self.sampler.identities:
            return []
        out = []
        for d in sample.devices:
            why = ""
            if not d.healthy:
                why = f"is unhealthy ({d.error})"
            elif d.uuid in self.healer.state.quarantined:
                why = f"is quarantined ({self.healer.state.quarantined[d.uuid]})"
            elif d.uuid in self.suspect:
                why = SUSPECT
            elif d.uuid in self.cordoned:
                why = CORDONED
            out.append(slot_for(d, why, self._others_mb(sample, d)))
        return out

    def _others_mb(self, sample: Sample, d: DeviceSample) -> float | None:
        """The memory held on ``d`` that no budget of ours accounts for: processes that are no
        worker of ours (another supervisor's workers, the driver) and our workers without a
        ``gpu_memory_limit_mb`` (regression: what those held was left out, so a budget was
        placed on a GPU they had filled): its used memory less what our budgeted workers hold
        there; None where that is not known (its use, or that of one of those workers)."""
        if d.memory_used_mb is None:
            return None
        ours = 0.0
        for name, usage in sample.workers.items():
            runner = self.runners.get(name)
            group = None if runner is None else self.settings.group(runner.spec.group)
            if group is not None and not group.health.gpu_memory_limit_mb:
                continue  # its use is as much in the way of a budget as another's
            if usage.gpu_memory_mb is None:
                if runner is not None and d.uuid in (runner.spec.gpus or ()):
                    return None
                continue
            ours += usage.gpu_memory_by_gpu.get(d.uuid, 0.0)
        return max(d.memory_used_mb - ours, 0.0)

    def _failed_gpus(self) -> dict[str, GpuSlot]:
        """The slots of the GPUs that failed: unhealthy (lost, not answering) or quarantined."""
        sample = self.sampler.last
        bad = set(self.healer.state.quarantined)
        if sample is not None:
            bad.update(d.uuid for d in sample.devices if not d.healthy)
        return {s.uuid: s for s in self.slots() if s.uuid in bad}

    def _place_unplaced(self, sample: Sample) -> None:
        """GPU telemetry is up (the first open after a degraded start, or NVML back): each
        ``gpus = "auto"`` group with workers running unplaced (started while it was down:
        ``CUDA_VISIBLE_DEVICES`` unset, every GPU seen, all on ``cuda:0``) has them restarted
        onto their GPUs, one at a time, each waiting for readiness, as an operator's rolling
        restart does (journaled as a roll-out of kind ``placement``). A group being rolled out
        already is tried again at a later sample. Once per process while telemetry stays up
        (a roll-out that halts is not started over and over). Never without telemetry for
        good (``backend = "none"``, ``auto`` without NVML: no identities), nor for explicit
        lists or ``"none"``. Regression: they stayed unplaced until they happened to restart."""
        if not sample.nvml_available or not self.slots():
            self._placing.clear()  # down (again): placed once it is back
            self._no_room.clear()
            return
        if self._shutting_down or self._tg is None:
            return
        for group in self.settings.workers:
            if group.gpus != "auto" or group.name in self.rolling:
                continue
            due = [
                r
                for r in self._targets(group.name)
                if _runs_unplaced(r) and self._placing.get(r.name) != r.record.pid
            ]
            if not due:
                continue
            names = [r.name for r in due]
            for r in due:
                self._placing[r.name] = r.record.pid or 0
            self.rolling[group.name] = PLACEMENT
            self.log.info(
                "supervisor.placing_unplaced",
                group=group.name,
                workers=names,
                reason=PLACING_WHY,
            )
            self.journal.append(
                self.clock.wall(),
                "supervisor.placing_unplaced",
                None,
                group=group.name,
                workers=names,
                reason=PLACING_WHY,
            )
            self._tg.start_soon(self._rolling_restart, group.name, 0, frozenset(names))

    def _wake_gpu_waiters(self) -> None:
        """Workers waiting for a GPU try again as soon as there may be room: a GPU became
        usable (back, healthy, released, uncordoned, out of quarantine) or one holds fewer
        worker processes than at the last sample. Nothing is computed while none waits.
        Workers a placement roll-out left unplaced for want of room: once one of them fits."""
        waiting = [r for r in self.workers() if r.record.waiting_for_gpu]
        if self._no_room and self._no_room_fits():
            # placed by a roll-out at this sample (regression: left unplaced, every GPU
            # seen, until they happened to restart)
            for name in self._no_room:
                self._placing.pop(name, None)
            self._no_room.clear()
        if not waiting:
            self._room = None
            return
        before, self._room = self._room, self._room_now()
        # the first sample of a wait is what it is measured against
        if before is not None and more_room(before, self._room):
            for r in waiting:
                r.post(lc.GpuFreed())

    def _no_room_fits(self) -> bool:
        """One of the workers a placement roll-out left unplaced for want of room would be
        placed now, as its roll-out places it (``_has_room``). Regression: only a GPU turning
        usable or a worker process gone counted, not memory that processes which are no
        workers of ours let go of (another supervisor's, moved off the GPU): left unplaced."""
        # one placed since (a start of its own) or gone is waited on no more
        self._no_room = {
            n for n, r in self.runners.items() if n in self._no_room and _runs_unplaced(r)
        }
        slots = self.slots()
        if not slots:  # no telemetry now: ``place`` gives an ``auto`` worker nothing
            return False
        tried: set[str] = set()  # one worker a group: its others need the same
        for runner in self.workers():
            if runner.name not in self._no_room or runner.spec.group in tried:
                continue
            tried.add(runner.spec.group)
            try:
                self._place_one(runner, slots)
            except PlacementError:
                continue
            return True
        return False

    def _room_now(self) -> Room:
        """The usable GPUs and how many worker processes each holds (``more_room``)."""
        usable = frozenset(s.uuid for s in self.slots() if s.usable)
        held: dict[str, int] = {}
        for r in self.workers():
            if r.record.pid is not None:  # a process that holds its place
                for uuid in r.spec.gpus or ():
                    held[uuid] = held.get(uuid, 0) + 1
        return usable, held

    def _assignments(self) -> dict[str, tuple[str, ...] | None]:
        """Each worker's GPUs: those its start was just placed on while it is spawned."""
        out = {}
        for r in self.workers():
            out[r.name] = r.spec.gpus
            if r.name in self._prepared_gpus:
                if r.state is WorkerState.STARTING and r.record.pid is None:
                    out[r.name] = self._prepared_gpus[r.name]
                else:  # spawned (its spec says so now), or that start is over
                    del self._prepared_gpus[r.name]
        return out

    def _build_plan(
        self,
        settings: Settings,
        keep: tuple[str, ...] = (),
        unplaced: dict[str, str] | None = None,
    ) -> Plan:
        """Plan ``settings``; workers of the groups in ``keep`` stay on their GPUs;
        ``unplaced``: see ``plan.place`` (None: a worker that cannot be placed raises)."""
        slots = self.slots()
        # where each is, or was just placed to start (``_assignments``)
        now = self._assignments()
        fixed = {r.name: now[r.name] for r in self.workers() if r.spec.group in keep}
        return build_plan(
            settings,
            self._worker_environ(),
            os.fspath(self.notify_path),
            slots or None,
            fixed,
            unplaced=unplaced,
            accounts=self._accounts(settings.workers),
            shared_notify_socket=self._shared_socket(),
            allowed_cpus=allowed_cpus(),
        )

    def _read_notify(self) -> None:
        """Read what waits in the notify sockets (before a worker's deadline is judged)."""
        self.listener.drain(NOTIFY_BEFORE_DEADLINE)
        if self.shared_listener is not None:
            self.shared_listener.drain(NOTIFY_BEFORE_DEADLINE)

    def _accounts(
        self, groups: Iterable[WorkerGroup], *, cached: bool = False
    ) -> dict[str, Account | str]:
        """The groups' ``user`` values resolved (now, or as last resolved where ``cached``:
        a lookup may go to a directory service, so only plans at start and at reloads make
        one, not each move of a worker)."""
        users = {g.user for g in groups if g.user}
        missing = users - self._account_cache.keys() if cached else users
        self._account_cache.update(resolve_accounts(missing))
        return {u: self._account_cache[u] for u in users}

    def _shared_socket(self) -> str | None:
        return None if isinstance(self.shared_path, str) else os.fspath(self.shared_path)

    def _shared_sender(self, uid: int) -> bool:
        """Whose datagrams the shared socket reads: the users workers run as (and ours)."""
        return uid in (0, os.geteuid()) or any(
            isinstance(a, Account) and a.uid == uid for a in self._account_cache.values()
        )

    def _open_shared_for(self, specs: Iterable[LaunchSpec]) -> None:
        """Open (once) the notify socket for workers that run as another user, when one of
        ``specs`` does (the private one, ``state_dir``'s 0600 socket, is out of their reach);
        ``state_dir`` gets the pass-through bit for others. A failure is logged, and such
        workers that need the socket fail to start with it (``_shared_problem``)."""
        if self.shared_listener is not None or isinstance(self.shared_path, str):
            return
        if not any(_needs_shared(s) for s in specs):
            return
        state_dir = self.settings.supervisor.state_dir
        listener = NotifyListener(
            self.shared_path,
            self._on_notify,
            mode=SHARED_SOCKET_MODE,
            dir_mode=SHARED_DIR_MODE,
            accepts=self._shared_sender,
        )
        error = (
            _unsafe(state_dir)
            or _attempt(functools.partial(_pass_through, state_dir))
            or _attempt(listener.open)
        )
        if error is not None:
            self.shared_error = error
            self.log.error("notify.shared_failed", path=os.fspath(listener.path), error=error)
            return
        self.shared_listener = listener
        self.log.info(
            "notify.shared", path=os.fspath(listener.path), reason="workers run as another user"
        )
        if self._tg is not None:
            self._tg.start_soon(listener.serve)

    def _warn_unreadable_reporters(self, plan: Plan, groups: Collection[str]) -> None:
        """``plan.warning`` for each of ``groups`` whose workers cannot read the in-use
        reporter (they run as another user)."""
        firsts = [(g.group.name, g.workers[0]) for g in plan.groups if g.workers]
        for line in reporters_unreadable((n, s) for n, s in firsts if n in groups):
            self.log.warning("plan.warning", message=line)

    def _shared_problem(self, spec: LaunchSpec) -> str | None:
        """Why ``spec``'s worker, of another user, cannot reach the shared notify socket it
        needs (readiness, watchdog or in-use reports); None when it can or needs none."""
        account = spec.account
        if not isinstance(account, Account) or not _needs_shared(spec):
            return None
        if isinstance(self.shared_path, str):
            return self.shared_path
        if self.shared_listener is None or not self.shared_listener.bound():
            return self.shared_error or "it is not open"
        return unreachable_for(self.shared_path, account.uid, account.groups)

    def _forget_replaced(self) -> None:
        """The GPUs replaced since the last sample (``gpu.replaced``) are gone: their marks
        keyed by UUID go (quarantine, heat, suspect, XID counts). An operator's cordon of the
        old UUID is left, in ``state_dir`` too: it applies to no GPU listed, and ``uncordon``
        by its UUID removes it."""
        replaced = self.sampler.replaced
        if len(replaced) == self._replaced_seen:
            return
        for old, _new in replaced[self._replaced_seen :]:
            self.healer.forget_gpu(old)
            self.suspect.pop(old, None)
            self._suspect_of.pop(old, None)
            # its XID counts leave /metrics with its other series (regression: kept for
            # ever, relabelled gpu="<old UUID>", one phantom series per GPU ever replaced)
            for key in [k for k in self.xid_counts if k[0] == old]:
                del self.xid_counts[key]
        self._replaced_seen = len(replaced)
        self._changed_now()

    def _check_notify_socket(self) -> None:
        """Bind the workers' notify socket again where its file alone went (removed by hand,
        by a clean-up script): else no worker becomes ready again, and each one with a watchdog
        is taken for hung. (A removed ``state_dir`` is bound again once it is made anew:
        ``_on_state_dir_recreated``.) An ``lstat`` a sample."""
        # (or its private directory in /tmp with it, or a rebind there failed: regression,
        # never bound again, so no worker became ready again)
        if not self.listener.lost():
            return
        error = _attempt(self.listener.rebind)
        if error is not None:
            if error != self._notify_error:  # said once, not at each sample
                self.log.error(
                    "notify.rebind_failed", path=os.fspath(self.notify_path), error=error
                )
            self._notify_error = error
            return
        self._notify_error = None
        self.log.warning("notify.rebound", path=os.fspath(self.notify_path))

    def _check_shared_socket(self, now: float) -> None:
        """Bind the shared socket again where its file went (a temporary-file cleaner)."""
        listener = self.shared_listener
        if listener is None or now - self._shared_checked_at < SHARED_CHECK_EVERY_S:
            return
        self._shared_checked_at = now
        if not listener.bound():
            state_dir = self.settings.supervisor.state_dir
            error = (
                _unsafe(state_dir)
                or _attempt(functools.partial(_pass_through, state_dir))
                or _attempt(listener.rebind)
            )
            self.shared_error = error
            if error is not None:
                self.log.error("notify.shared_failed", path=os.fspath(listener.path), error=error)
            else:
                self.log.warning("notify.rebound", path=os.fspath(listener.path))

    def _worker_refs(self) -> dict[str, WorkerRef]:
        budgets = {g.name: g.health.host_memory_limit_mb for g in self.settings.workers}
        return {
            r.name: WorkerRef(r.record.pid, r.spec.gpus, budgets.get(r.spec.group, 0.0))
            for r in self.workers()
        }

    def _on_sample(self, sample: Sample) -> None:
        self.loop_alive_at = self.clock.now()
        self._check_notify_socket()
        self._check_lock_file()
        self._check_shared_socket(self.loop_alive_at)
        self._retry_failed_logs()
        wall = self.clock.wall() - (self.clock.now() - sample.t)
        for name, usage in sample.workers.items():
            runner = self.runners.get(name)
            if runner is not None and runner.record.pid is not None and usage.pids:
                self._trees[name] = frozenset(usage.pids)
                ring = self.samples_of.get(name)
                if ring is None:
                    ring = self.samples_of[name] = deque(maxlen=SAMPLES_KEPT)
                ring.append(
                    SamplePoint(wall, usage.gpu_memory_mb, usage.host_rss_mb, usage.cpu_percent)
                )
        self._forget_replaced()
        self.healer.on_sample(sample)
        self._save_quarantine()  # (a lift that ends with its flag changes no action)
        self._sweep_cgroups()
        for listener in self.sample_listeners:
            listener(sample)
        if self.suspect and sample.nvml_available:  # without telemetry nothing is seen gone
            # (one in a PID namespace of its own is listed under its pid there, as at the
            # barrier: regression, said released at the next sample, its memory still held)
            listed = listed_for_suspects(sample.devices, self.suspect, _running_inner_pids)
            held_now = still_held(self.suspect, listed)
            for uuid, pids in list(self.suspect.items()):
                if uuid not in held_now:
                    del self.suspect[uuid]
                    self._suspect_of.pop(uuid, None)
                    self.log.info("gpu.released", gpu=uuid, reason="old pids no longer listed")
                elif held_now[uuid] != pids:  # some of them let go: suspect for the others
                    self.suspect[uuid] = held_now[uuid]
                    held = self._suspect_of.get(uuid, {})
                    self._suspect_of[uuid] = {p: w for p, w in held.items() if p in held_now[uuid]}
        self._wake_gpu_waiters()
        self._place_unplaced(sample)
        if self.systemd.enabled:  # the GPUs it counts change without a worker changing
            self.systemd.status(self.status_line())
        # state.json shows the devices (with their flags) and each worker's tree (for orphan
        # reclaim): only a sample that changes one of them needs a new snapshot.
        recorded = (
            sample.devices,
            tuple((n, u.pids) for n, u in sample.workers.items()),
            frozenset(self.suspect),
            frozenset(self.cordoned),
            tuple(self.healer.state.quarantined),
            tuple(u for u, t in self.healer.state.thermal.items() if t.hot),
        )
        if recorded != self._recorded:
            self._recorded = recorded
            self.recorder.mark()
        self._sampled.set()
        self._sampled = anyio.Event()
        if self._trace_samples:
            self.log.debug(
                "gpu.sample",
                duration_ms=round(sample.duration_s * 1000, 3),
                nvml_available=sample.nvml_available,
                devices={
                    d.uuid: {
                        "used_mb": d.memory_used_mb,
                        "healthy": d.healthy,
                        "processes": None if d.processes is None else len(d.processes),
                    }
                    for d in sample.devices
                },
                workers={
                    n: {
                        "gpu_mb": u.gpu_memory_mb,
                        "by_gpu": dict(u.gpu_memory_by_gpu),
                        "attribution": u.attribution,
                        "pids": list(u.pids),
                    }
                    for n, u in sample.workers.items()
                },
            )
        if sample.t - self._summary_at >= SUMMARY_EVERY_S and sample.devices:
            self._summary_at = sample.t
            self.log.info(
                "gpu.summary",
                devices=[
                    {
                        "gpu": d.index,
                        "used_mb": d.memory_used_mb,
                        "total_mb": d.memory_total_mb,
                        "temperature_c": d.temperature_c,
                        "healthy": d.healthy,
                    }
                    for d in sample.devices
                ],
                workers={
                    n: {
                        "gpus": list(self.runners[n].spec.gpus or ()),
                        "gpu_mb": u.gpu_memory_mb,
                        "rss_mb": None if u.host_rss_mb is None else round(u.host_rss_mb, 1),
                    }
                    for n, u in sample.workers.items()
                    if n in self.runners
                },
            )

    def _on_xid(self, event: XidEvent) -> None:
        key = (event.uuid or str(event.gpu_index), event.xid)
        self.xid_counts[key] = self.xid_counts.get(key, 0) + 1
        self.log.warning("gpu.xid", gpu=event.gpu_index, uuid=event.uuid, xid=event.xid)
        self.healer.on_xid(event)

    async def _fresh_sample(self, after: float, timeout: float) -> Sample | None:
        """The first sample taken after monotonic time ``after``, or None on timeout (asks the
        sampler for one at once when the last one is older)."""
        with anyio.move_on_after(timeout):
            last = self.sampler.last
            if last is not None and last.t > after:
                return last
            self.sampler.request()
            while True:
                await self._sampled.wait()
                last = self.sampler.last
                if last is not None and last.t > after:
                    return last
        return None

    async def _await_release(
        self, old: frozenset[int], gpus: tuple[str, ...], timeout: float
    ) -> dict[str, frozenset[int]]:
        """Wait until no pid of ``old`` holds memory on ``gpus``; return what still holds it."""
        deadline = anyio.current_time() + timeout
        after = anyio.current_time()
        held: dict[str, frozenset[int]] = {}
        # A process of the old tree in a PID namespace of its own is listed by NVML under its
        # pid there (regression: not waited for, as attribution already knew to map it).
        inner = procfs.inner_pids(old)
        while True:
            left = max(deadline - anyio.current_time(), 0.0)
            sample = await self._fresh_sample(after, left)
            if sample is None:
                return held
            held = {}
            for uuid in gpus:
                d = sample.device(uuid)
                if d is None or d.processes is None:
                    continue  # cannot tell: do not block on it
                listed = {p.pid for p in d.processes}
                # (only while our process lives: gone, a pid 1 listed is another namespace's)
                mapped = {inner[p] for p in listed if p in inner and procfs.running(inner[p])}
                pids = frozenset(listed | mapped) & old
                if pids:
                    held[uuid] = pids
            if not held or anyio.current_time() >= deadline:
                return held
            after = sample.t
            # look again soon, not back to back (nor only at the regular ticks: they may be a
            # minute apart)
            await anyio.sleep(min(RELEASE_POLL_S, max(deadline - anyio.current_time(), 0.0)))

    async def _await_cgroup_empty(self, runner: WorkerRunner) -> None:
        """What ``cgroup.kill`` ended is gone before the replacement joins the cgroup (its
        memory no longer charged to ``memory.max`` there); bounded: a process stuck in the
        kernel does not hold the restart up for more than ``CGROUP_EMPTY_WAIT_S``."""
        if not await self._cgroups_empty([runner.name], CGROUP_EMPTY_WAIT_S):
            self.log.warning(
                "cgroup.still_populated",
                worker=runner.name,
                waited_s=CGROUP_EMPTY_WAIT_S,
                reason="processes killed with the last one are not gone: starting anyway",
            )

    async def _cgroups_empty(self, names: Sequence[str], timeout: float) -> bool:
        """Wait until the cgroups of ``names`` hold no process; False when ``timeout`` ran out."""
        deadline = anyio.current_time() + timeout
        while any(self.cgroups.populated(n) for n in names):
            if anyio.current_time() >= deadline:
                return False
            await anyio.sleep(0.005)  # a killed process is usually gone within milliseconds
        return True

    def _needs_prepare(self, runner: WorkerRunner) -> bool:
        """Whether ``runner``'s spawn goes through :meth:`_prepare` (else it is made at once, in
        the same step): with GPU telemetry (a GPU backend without GPUs yet may get them: NVML
        is retried), cgroups to empty, starts to take turns at (``max_starting``, which a
        reload may set), or its port still held by a worker on its way out."""
        return (
            self.sampler.backend_name != "none"
            or self.cgroups.support.contain
            or self.settings.supervisor.max_starting > 0
            or self._port_holder(runner) is not None
        )

    def _port_holder(self, runner: WorkerRunner) -> WorkerRunner | None:
        """Another worker whose process still holds the port ``runner`` starts on while a
        reload takes it away (its group removed, or scaled below it): its port is handed on
        once that process is gone. Regression: the new worker was started at once, its
        readiness probe answered by the old one's server (routed to another group's server)
        or its bind refused (a crash)."""
        port = runner.spec.port
        if port is None:
            return None
        for other in self.runners.values():
            if other is runner or other.held_port() != port:
                continue
            group = self.settings.group(other.spec.group)
            if group is None or other.spec.index >= group.replicas or other.name in self.removing:
                return other
        return None

    async def _port_free(self, runner: WorkerRunner) -> None:
        """Wait while :meth:`_port_holder` names a worker, or until ``runner`` is no longer
        starting; at most the holder's drain and stop timeouts (and a second): by then a
        holder the reload stops is gone. One whose stop waits for this start (the roll-out of
        a group whose ports moved removes its extra workers at its end) is not waited for
        longer: the start goes on, as before the hand-over was waited for (regression: it
        waited for good)."""
        said = False
        deadline: float | None = None
        while runner.state is WorkerState.STARTING:
            holder = self._port_holder(runner)
            if holder is None:
                return
            now = self.clock.now()
            if deadline is None:
                t = holder.timing
                deadline = now + t.drain_timeout_s + t.stop_timeout_s + PORT_WAIT_SLACK_S
            stopping = holder.state in (WorkerState.DRAINING, WorkerState.STOPPING)
            granted = self._granted_until((holder,), following=False) if stopping else None
            if now >= deadline and granted is not None and granted > now:
                # it finishes a stop it asked more time for (EXTEND_TIMEOUT_USEC; regression:
                # started beside it once its drain and stop timeouts were over)
                deadline = granted
            if now >= deadline:
                self.log.warning(
                    "worker.port_still_held",
                    worker=runner.name,
                    port=runner.spec.port,
                    held_by=holder.name,
                    reason="started all the same: the worker holding the port is not gone "
                    "within its drain and stop timeouts",
                )
                return
            if not said:
                said = True
                self.log.info(
                    "worker.waiting_port",
                    worker=runner.name,
                    port=runner.spec.port,
                    held_by=holder.name,
                    reason="a worker a reload removes still holds the port",
                )
                runner.output.mark(f"waiting for port {runner.spec.port}: {holder.name} holds it")
            with anyio.move_on_after(deadline - now):
                await self._changed.wait()

    async def _prepare(self, runner: WorkerRunner) -> LaunchSpec | str:
        """Before a (re)start: the port handed on by a worker on its way out, the previous
        process's cgroup empties, the GPU-release barrier, its turn to start
        (``max_starting``), then re-place off unusable GPUs. A string: why there is no GPU to
        start on now (the worker waits for one)."""
        self._prepared_gpus.pop(runner.name, None)
        await self._port_free(runner)
        prepared = await self._prepare_gpus(runner)
        if isinstance(prepared, str) or runner.state is not WorkerState.STARTING:
            return prepared  # (stopped meanwhile: not used, nothing to pin or say)
        # counted on its new GPUs at once, not once its spawn is made (regression: two
        # workers placed at the same sample both took the one GPU with room for one)
        self._prepared_gpus[runner.name] = prepared.gpus
        return self._pinned_now(prepared, pinned=runner.spec.cpus is not None)

    def _loading(self) -> set[str]:
        """Workers that take a ``max_starting`` slot: starting with a process, or let go to
        spawn one (their pre-start hook under way)."""
        out = set()
        for r in self.workers():
            if r.state is WorkerState.STARTING and (r.record.pid or r.name in self._let_go):
                out.add(r.name)
        return out

    async def _start_slot(self, runner: WorkerRunner) -> bool:
        """``[supervisor] max_starting``: wait (first come, first served) until fewer workers
        than that are starting (spawned, not yet ready): loading N models at once can take
        the host's memory or disks; the worker is spawned after its turn, so its
        ``start_timeout_s`` runs from then. False: it is no longer starting (stopped while
        it waited: what it prepares is not used)."""
        name = runner.name
        if runner.state is not WorkerState.STARTING:
            return False
        if name in self._let_go:
            return True  # prepared again (a reload's new plan) after its turn came: it keeps it
        if not self.settings.supervisor.max_starting:
            return True
        self._start_queue.append(name)
        said = False
        try:
            while True:
                if runner.state is not WorkerState.STARTING:
                    return False
                limit = self.settings.supervisor.max_starting  # a reload may change it
                loading = self._loading()
                if may_start(name, self._start_queue, loading, limit):
                    self._let_go.add(name)
                    return True
                if not said:
                    said = True
                    self.log.info(
                        "worker.waiting_start",
                        worker=name,
                        max_starting=limit,
                        starting=sorted(loading),
                        ahead=self._start_queue.index(name),
                    )
                    runner.output.mark(
                        f"waiting to start: {len(loading)} workers starting "
                        f"(max_starting = {limit})"
                    )
                await self._changed.wait()
        finally:
            self._start_queue.remove(name)
            self._changed_now()  # the next in line may go (or this one was stopped)

    def _pinned_now(self, spec: LaunchSpec, pinned: bool) -> LaunchSpec:
        """``spec`` with its ``cpu_affinity = "gpu"`` CPUs as of now: those close to its GPUs
        among the ones the supervisor may use now (its own affinity can shrink while it runs:
        a cpuset changed, a CPU taken offline; a start on the CPUs planned then would fail at
        every restart). ``pinned``: its last start was pinned (a move that unpins it is said).
        """
        group = self.settings.group(spec.group)
        if group is None or group.cpu_affinity != "gpu":
            return spec
        allowed = allowed_cpus()
        slots = self.slots()
        if slots:
            cpus, why = worker_cpus("gpu", spec.gpus, cpus_of(slots, allowed))
            if cpus is None and pinned:
                # pinned until now (moved to a GPU whose CPUs the backend cannot tell):
                # said here, where it changes (the plan's warnings are said at start)
                self.log.warning(
                    "worker.unpinned",
                    worker=spec.name,
                    gpus=list(spec.gpus or ()),
                    reason=f'cpu_affinity = "gpu" pins nothing: {why}',
                )
        else:  # no telemetry now: what it had, within what may be used now
            cpus = tuple(sorted(set(spec.cpus or ()) & allowed)) or None
        return spec if cpus == spec.cpus else dataclasses.replace(spec, cpus=cpus)

    async def _prepare_gpus(self, runner: WorkerRunner) -> LaunchSpec | str:
        """:meth:`_prepare` but for the CPUs. The turn to start is taken after the barrier
        (waiting up to ``release_timeout_s`` for the previous process to let its GPU go is
        not loading a model: it does not hold up the others' starts) and before placement
        (which goes by the GPUs as they are when the worker's turn comes)."""
        await self._await_cgroup_empty(runner)
        spec = runner.spec
        gpus = spec.gpus or ()
        if spec.gpus is None and self.sampler.identities:
            if not await self._start_slot(runner):
                return spec  # stopped while it waited: not placed (nothing starts)
            return self._place_late(runner)
        if not gpus or not self.sampler.identities:
            await self._start_slot(runner)
            return spec
        group = self.settings.group(spec.group)
        if (
            group is not None
            and isinstance(group.gpus, tuple)
            and (
                spec.gpus == gpu_assignment(group)
                or runner.name in self._unplaced
                or any(u.startswith(PLACEHOLDER) for u in gpus)
                # on a GPU since replaced (regression: started on the old UUID, a GPU no
                # longer there: "starting there anyway", a crash loop on real hardware)
                or any(u in self.sampler.retired for u in gpus)
            )
        ):
            # an explicit list as written (planned without telemetry, or naming a GPU missing
            # at start), or resolved onto a GPU whose UUID could not be read then (named
            # since: regression, CUDA_VISIBLE_DEVICES=unknown-1): resolved to UUIDs now (what
            # XIDs, the barrier and quarantines go by); a worker already on UUIDs keeps them
            # (a GPU gone from the enumeration does not move it onto whatever GPU has its
            # index now)
            resolved = self._resolve_late(runner, group)
            if isinstance(resolved, str):
                return resolved
            spec, gpus = resolved, resolved.gpus or ()
        # taken once the barrier is over, not before: a start made while this one waits (an
        # operator's stop and start) waits for the same tree (regression: it had none to wait
        # for, and started at once on the GPU still held)
        old = self._trees.get(runner.name, frozenset())
        if old and runner.last_exit_at is not None:
            try:
                held = await self._await_release(old, gpus, self.settings.gpu.release_timeout_s)
            finally:
                if self._trees.get(runner.name) is old:
                    del self._trees[runner.name]
            for uuid, pids in held.items():
                self._suspect(uuid, dict.fromkeys(pids, runner.name))
                self.log.warning(
                    "gpu.suspect",
                    worker=runner.name,
                    gpu=uuid,
                    pids=sorted(pids),
                    reason="memory of the previous process tree still held after release_timeout_s",
                )
        else:
            self._trees.pop(runner.name, None)
        if not await self._start_slot(runner):
            return spec  # stopped while it waited: not placed, nor moved (nothing starts)
        # the group as in force now: a reload may have changed or removed it while this waited
        # for the GPU's release or its turn (regression: a removed group's worker was placed by
        # the definition read before, which the plan no longer had: KeyError, and the
        # supervisor crashed)
        group = self.settings.group(spec.group)
        if group is None:
            return spec  # its group is gone: the reload that removed it stops it, where it is
        if not self.slots():  # NVML down just now: nothing to place by, it stays where it is,
            if runner.record.gpu_waits:  # unless it waits for a GPU: it waits on
                stuck = self.sampler.stuck_for_s()
                why = stuck_text(stuck) if stuck is not None else self.sampler.error
                return f"no GPU telemetry ({why or 'NVML down'})"
            return spec
        avoid = self.healer.avoid.get(runner.name, set())
        # a group that moves its workers off hot GPUs (on_thermal = "migrate") is not placed
        # onto one either, where another has room (regression: a worker scaled up or
        # restarted went onto the hot GPU, and nothing moved it); nor onto one reading hot
        # already, before thermal_sustain_s (regression: after a restart of the supervisor,
        # which keeps no heat, a worker started there, to be moved as soon as it was sustained)
        hot = self.healer.heating_gpus() & set(gpus)
        moving = group is not None and group.moves_off_heat
        cooler = bool(avoid) or (moving and bool(hot))
        # a migration: not back onto the GPU it leaves, nor any hot one, nor one too full
        slots = self.healer.migration_slots(runner.name, self.slots()) if cooler else self.slots()
        self.healer.avoid.pop(runner.name, None)
        usable = {s.uuid for s in slots if s.usable}
        if all(u in usable for u in gpus):
            return spec
        if group is None or group.gpus != "auto":
            broken = [
                f"GPU {s.index} {s.why_not}"
                for s in slots
                if s.uuid in gpus and s.why_not.startswith(("is unhealthy", "is quarantined"))
            ]
            if broken:  # nothing would run there: it waits for the GPU (regression: a crash
                return "; ".join(broken)  # loop on a quarantined GPU, then fatal)
            self.log.warning(
                "worker.gpu_unusable",
                worker=runner.name,
                gpus=list(gpus),
                reason="explicit GPU list: starting there anyway",
            )
            return spec
        unplaced: str | None = None  # why no GPU fits it
        chosen: tuple[str, ...] | None = None
        try:
            chosen = self._place_one(runner, slots)
        except PlacementError as exc:
            unplaced = str(exc)
            if cooler:
                # no cooler GPU has room (any more: a migration's target filled up while it
                # drained): placed as any worker is, a hot GPU will do, and healing moves it
                # once a cooler one has room
                slots = self.slots()
                if all(u in {s.uuid for s in slots if s.usable} for u in gpus):
                    self.log.warning(
                        "worker.gpu_hot",
                        worker=runner.name,
                        gpus=list(gpus),
                        reason=f"no cooler GPU has room ({unplaced}): starting on its hot GPU",
                    )
                    if avoid:  # a migration that could not move it: said, not only logged
                        self.healer.on_migration_stayed(runner, gpus, unplaced)
                    return spec
                with contextlib.suppress(PlacementError):
                    chosen = self._place_one(runner, slots)
                    unplaced = None
        if unplaced is not None:
            own = {u for u in gpus if runner.name in self._suspect_of.get(u, {}).values()}
            # rather than fail (a migration too, once no cooler GPU is to be had: regression,
            # a hot and cordoned GPU made its worker wait for a GPU)
            if may_restart_in_place(gpus, slots, own):
                stuck_on = sorted(s.uuid for s in slots if s.uuid in own and s.why_not == SUSPECT)
                if stuck_on:
                    self.log.warning(
                        "worker.gpu_suspect_own",
                        worker=runner.name,
                        gpus=stuck_on,
                        reason="no other GPU fits: restarting on its GPU, where its previous "
                        "process still holds memory",
                    )
                else:
                    self.log.info(
                        "worker.gpu_cordoned",
                        worker=runner.name,
                        gpus=list(gpus),
                        reason="no other GPU fits: restarting on its cordoned GPU",
                    )
                return spec
            return unplaced
        new = self._spec_on(self._defs.get(runner.name, group), spec.index, chosen)
        self.log.info(
            "worker.moved",
            worker=runner.name,
            old_gpus=list(gpus),
            new_gpus=list(chosen or ()),
            reason="migrated off a hot GPU" if avoid & set(gpus) else "previous GPU unusable",
        )
        return new

    def _resolve_late(self, runner: WorkerRunner, group: WorkerGroup) -> LaunchSpec | str:
        """``runner``'s explicit GPU list resolved on the GPUs known now (a spec), or why not."""
        gi = next(i for i, g in enumerate(self.settings.workers) if g.name == group.name)
        slots = self.slots() or [
            GpuSlot(i.index, i.uuid, i.memory_total_mb, None, None) for i in self.sampler.identities
        ]
        try:
            chosen = resolve_explicit(group, gi, slots)
        except PlacementError as exc:
            return str(exc)
        return self._placed(
            runner,
            group,
            chosen,
            "worker.gpus_resolved",
            gpus=list(runner.spec.gpus or ()),
            uuids=list(chosen),
        )

    def _place_late(self, runner: WorkerRunner) -> LaunchSpec | str:
        """A ``gpus = "auto"`` worker that started without GPU telemetry (nothing placed,
        ``CUDA_VISIBLE_DEVICES`` unset) is placed at its next start once GPUs are known."""
        spec = runner.spec
        group = self.settings.group(spec.group)
        if group is None or group.gpus != "auto":
            return spec
        slots = self.slots()
        if not slots:  # NVML down just now
            if runner.name in self._unplaced:  # never onto every GPU (nothing set)
                return f"no GPU telemetry ({self._unplaced[runner.name]})"
            return spec
        try:
            chosen = self._place_one(runner, slots)
        except PlacementError as exc:
            return str(exc)
        return self._placed(
            runner,
            group,
            chosen,
            "worker.moved",
            old_gpus=None,
            new_gpus=list(chosen or ()),
            reason="placed now that GPU telemetry is up",
        )

    def _placed(
        self,
        runner: WorkerRunner,
        group: WorkerGroup,
        chosen: tuple[str, ...] | None,
        event: str,
        **fields: Any,
    ) -> LaunchSpec:
        """``runner`` planned again on ``chosen`` (placed at last: no longer unplaced), said
        with ``event`` and ``fields``."""
        self._unplaced.pop(runner.name, None)
        self.log.info(event, worker=runner.name, **fields)
        return self._spec_on(self._defs.get(runner.name, group), runner.spec.index, chosen)

    def _place_one(self, runner: WorkerRunner, slots: list[GpuSlot]) -> tuple[str, ...] | None:
        """GPUs for ``runner`` alone on ``slots``, the others where they are (PlacementError).
        A worker a reload is removing (past its group's new ``replicas``) is placed too."""
        running = ((r.spec.group, r.spec.index) for r in self.workers())
        placed = place(
            covering(self.settings.workers, running),
            slots,
            self.settings.gpu.reserve_mb,
            fixed=self._assignments(),
            only={runner.name},
        )
        if runner.name not in placed:  # its group is gone (a reload removes it): no plan
            raise PlacementError(f"{runner.name}: its group is no longer in the config")
        return placed[runner.name]

    def _has_room(self, runner: WorkerRunner) -> bool:
        """A placement roll-out restarts ``runner`` (running unplaced) only where the GPUs
        have room for it now; else it is left serving where it runs, and that is said (and
        it is tried again once it fits: a GPU frees, a worker there stops, memory is let go).
        Regression: it was restarted all the same, then waited for a GPU without end. So too
        while GPU telemetry is down again (no devices: ``place`` gives an ``auto`` worker
        nothing, not an error): the roll-out when it is back places it."""
        slots = self.slots()
        try:
            if not slots:
                raise PlacementError("no GPU telemetry now")
            self._place_one(runner, slots)
        except PlacementError as exc:
            if slots:  # tried again once it fits (_wake_gpu_waiters)
                self._no_room.add(runner.name)
            self.log.warning(
                "supervisor.placement_skipped",
                worker=runner.name,
                reason=f"left running unplaced: {exc}",
            )
            return False
        return True

    def _spec_on(self, group: WorkerGroup, index: int, gpus: tuple[str, ...] | None) -> LaunchSpec:
        """Worker ``index`` of ``group`` planned again on ``gpus``."""
        return launch_spec(
            group,
            index,
            self._worker_environ(),
            os.fspath(self.notify_path),
            gpus,
            accounts=self._accounts([group], cached=True),
            shared_notify_socket=self._shared_socket(),
            cpus=cpus_of(self.slots(), allowed_cpus()) if group.cpu_affinity == "gpu" else None,
        )

    # --- wiring -------------------------------------------------------------------------

    def _worker_environ(self) -> dict[str, str]:
        env = dict(self.environ)
        if self._instance is not None:
            env[INSTANCE_VAR] = self._instance
        else:  # never one it inherited (started as another supervisor's worker: regression,
            # that one took its workers for its own leftovers)
            env.pop(INSTANCE_VAR, None)
        if self.settings.gpu.backend == "sim":
            env["GPU_SUPERVISOR_SIM_DIR"] = os.fspath(self.settings.gpu.sim_dir.absolute())
        return env

    def _changed_now(self, runner: WorkerRunner | None = None) -> None:
        self._changed.set()
        self._changed = anyio.Event()
        self.loop_alive_at = self.clock.now()
        if runner is not None:
            rec = runner.record
            fingerprint = (rec.state, rec.pid, rec.restarts, runner.spec.gpus)
            if self._fingerprints.get(runner.name) != fingerprint:
                self._fingerprints[runner.name] = fingerprint
                self.recorder.mark(urgent=True)
        if (
            self.settings.supervisor.systemd_ready == "groups"
            and self._all_added
            and not self._ready_sent
            and not self._shutting_down
            and self._groups_settled()
        ):
            self._send_ready()
        self.systemd.status(self.status_line())

    def _send_ready(self) -> None:
        self._ready_sent = True
        self._notify(f"READY=1\nSTATUS={self.status_line()}\nMAINPID={os.getpid()}")
        degraded = [g for g in self.groups if not self.group_ready(g)]
        self.log.info("supervisor.ready", status=self.status_line(), degraded=degraded)
        if degraded:
            self.log.warning(
                "supervisor.ready_degraded",
                groups=degraded,
                reason=(
                    "every worker of these groups is fatal, has failed since the start (it is "
                    "retried) or waits for a GPU: the others serve"
                ),
            )

    def _groups_settled(self) -> bool:
        """Every group has a ready worker, or every worker of it is ``fatal``, waits for a GPU
        (none becomes ready without an operator or a change of the GPUs) or has failed since
        the start (a crash loop that never goes fatal, ``burst = 0``, or starts that time out
        one after another: each retry takes another start_timeout_s): what start-up waits for
        before ``READY=1``. Waiting for a group that may never get there would end in the
        service manager's start timeout, and a restart of the groups that serve. (Not
        ``stopped``: a worker not started yet is.)"""
        return all(
            self.group_ready(g) or all(self._not_waited_for(self.runners[n]) for n in names)
            for g, names in self.groups.items()
        )

    @staticmethod
    def _not_waited_for(runner: WorkerRunner) -> bool:
        """Fatal, waiting for a GPU, or retried after failed starts (a restart for a reload
        is no failure: that one is waited for)."""
        rec = runner.record
        return (
            rec.state is WorkerState.FATAL
            or rec.waiting_for_gpu
            or (rec.history.consecutive > 0 and rec.state is not WorkerState.STOPPED)
        )

    def _register_pid(self, pid: int, runner: WorkerRunner | None) -> None:
        if runner is None:
            self._pids.pop(pid, None)
        else:
            self._pids[pid] = runner
            self._unknown_senders.clear()  # no sender said nobody's may be this one's

    def _on_notify(self, msg: NotifyMessage) -> None:
        runner = self._sender(msg.pid)
        if runner is None:
            self.log.debug("notify.unknown_sender", pid=msg.pid)
            return
        runner.on_notify(msg)
        self.healer.on_notify(runner, msg.pid, msg.fields)

    def _sender(self, pid: int) -> WorkerRunner | None:
        """The worker ``pid`` is part of: its main process or a descendant of it, or a process
        re-parented to the supervisor (a daemon that double-forked) its worker owns.

        Reads nothing from ``/proc`` when ``pid`` is a worker's main process; one ``stat``
        when it was found no worker's within a second (regression: a flood of datagrams from
        another program of the same user walked /proc up its ancestry for each)."""
        main_runner = self._pids.get(pid)
        if main_runner is not None:
            return main_runner
        first = procfs.read_stat(pid)
        if first is None:
            return None  # gone already
        now = self.clock.now()
        if self._unknown_senders.known(pid, first.start_ticks, now):
            return None
        unread = [first]

        def read(p: int) -> procfs.ProcStat | None:
            # the sender's first read is the one made above; any later one is read afresh
            # (a walk started again after an ancestor exited sees its new parent)
            return unread.pop() if p == pid and unread else procfs.read_stat(p)

        def adopt(orphan: int, start_ticks: int) -> WorkerRunner | None:
            main = {p: r.name for p, r in self._pids.items()}
            name = procfs.adopted_by(orphan, start_ticks, main, WORKER_VAR)
            return None if name is None else self.runners.get(name)

        owner = procfs.owner_of(pid, self._pids, os.getpid(), adopt, read)
        if owner is None:
            self._unknown_senders.add(pid, first.start_ticks, now)
        return owner

    def _on_orphan(self, reaped: Reaped) -> None:
        # A worker whose children double-fork in a loop makes thousands a second: one line a
        # minute at most (``reaped``: how many since the last line), the rest at debug.
        self._orphans_unlogged += 1
        now = self.clock.now()
        loud = now - self._orphan_logged_at >= ORPHAN_LOG_EVERY_S
        self.log.log(
            20 if loud else 10,
            "supervisor.reaped_orphan",
            pid=reaped.pid,
            code=reaped.status.code,
            signal=reaped.status.signal_name,
            reason="orphan",
            reaped=self._orphans_unlogged,
        )
        if loud:
            self._orphan_logged_at = now
            self._orphans_unlogged = 0

    def _make_runner(self, group: WorkerGroup, index: int, plan: Plan) -> WorkerRunner:
        spec = next(g for g in plan.groups if g.group.name == group.name).workers[index]
        self._defs[spec.name] = group
        sup = self.settings.supervisor
        output = WorkerOutput(
            spec.name,
            sup.state_dir / "logs" / f"{spec.name}.log",
            sup.log_max_bytes,
            sup.log_backups,
            passthrough=group.log_passthrough,
            now=self.clock.now,
        )
        output.file.on_health = self._on_log_health
        output.file.on_trim = functools.partial(self._on_log_trim, spec.name)
        runner = WorkerRunner(
            spec,
            lc.timing_for(group),
            reaper=self.reaper,
            clock=self.clock,
            output=output,
            on_change=self._changed_now,
            register_pid=self._register_pid,
            prepare=self._prepare,
            needs_prepare=self._needs_prepare,
            on_event=self._on_worker_event,
            on_exit=self._on_worker_exit,
            before_spawn=self._before_spawn,
            read_notify=self._read_notify,
            probes=self.http_probes,
        )
        output.on_line = functools.partial(self.healer.on_line, runner)
        return runner

    async def _start_runner(self, runner: WorkerRunner, start: bool = True) -> None:
        """Register ``runner`` (in ``runners`` first, then in its group's list) and run it.

        Whatever reads ``groups`` while this awaits (a state snapshot, the API) only ever
        sees names that ``runners`` has.
        """
        assert self._tg is not None
        self.runners[runner.name] = runner
        names = self.groups.setdefault(runner.spec.group, [])
        if runner.name not in names:
            names.append(runner.name)
        await self._tg.start(runner.run)
        # A shutdown that began while this awaited has already told the workers it knew to
        # stop, and waits for every registered one: this one must not start.
        if start and not self._shutting_down:
            runner.post(lc.Start())

    async def _add_group(self, group: WorkerGroup, plan: Plan) -> None:
        self.groups[group.name] = []
        for i in range(group.replicas):
            if self._shutting_down:
                break
            await self._start_runner(self._make_runner(group, i, plan))

    async def _remove_runner(self, runner: WorkerRunner, reason: ExitReason) -> None:
        """Stop ``runner`` and forget it: out of its group's list first, then out of ``runners``.

        Named in ``removing`` meanwhile: operators' commands to it are refused (a start or a
        restart of a worker a reload removes brought it back, routed to, until the removal's
        stop budget ran out and it was killed)."""
        self.removing.add(runner.name)
        try:
            await self._stop_and_forget(runner, reason)
        finally:
            self.removing.discard(runner.name)

    async def _stop_and_forget(self, runner: WorkerRunner, reason: ExitReason) -> None:
        runner.post(lc.Stop(reason))
        await self._wait_started(
            lambda: False, lambda: is_idle(runner), self._stop_budget(runner), lambda: (runner,)
        )
        if not is_idle(runner):
            runner.post(lc.Kill("not stopped in time"))
            await self.wait_until(lambda: is_idle(runner), KILL_WAIT_S)
        runner.cancel()
        if not self.cgroups.remove(runner.name):
            self.log.warning(
                "cgroup.not_removed",
                workers=[runner.name],
                reason="still populated: removed at a later sample, once empty",
            )
        names = self.groups.get(runner.spec.group)
        if names is not None and runner.name in names:
            names.remove(runner.name)
        self.runners.pop(runner.name, None)
        self._defs.pop(runner.name, None)
        self._prepared_gpus.pop(runner.name, None)
        # its series leave /metrics; one of the same name added later starts from 0, as the
        # worker object's `restarts` does
        for key in [k for k in self.restarts_total if k[0] == runner.name]:
            del self.restarts_total[key]
        # nor is anything else kept about it (reloads that add and remove groups for months
        # grew these without bound; a worker of the same name added later inherited them)
        self.healer.forget(runner.name)
        for per_worker in (
            self._trees,
            self.samples_of,
            self._fingerprints,
            self._unplaced,
            self._placing,
        ):
            per_worker.pop(runner.name, None)
        self._no_room.discard(runner.name)
        with anyio.move_on_after(KILL_WAIT_S):  # its health probes' client (connections)
            await self.http_probes.forget(runner.name)

    def _logs_kept(self, name: str) -> bool:
        """Whether the log files of worker ``name`` are never removed: it is configured, or
        still runs (one a reload removes writes until it is forgotten). Asked from the log
        retention's thread too (membership tests of the loop's containers)."""
        return name in self.runners or name in self.removing or name in _configured(self.settings)

    async def _retain_logs(self) -> None:
        """Remove the oldest logs of workers no longer configured past what the configured
        workers' logs may hold together (``policy.retention``), in a worker thread: at start
        and after each applied reload. Not in a ``state_dir`` this supervisor could not lock:
        another one may be writing those logs."""
        if self._state_lock is None:
            return
        sup = self.settings.supervisor
        configured = _configured(self.settings)
        limit = logs_budget(len(configured), sup.log_max_bytes, sup.log_backups)
        if limit is None:
            return
        retain = functools.partial(
            retain_worker_logs, sup.state_dir / "logs", limit, configured, self._logs_kept
        )
        done = None
        with anyio.move_on_after(LOGS_RETAIN_WAIT_S):
            try:
                done = await in_thread(retain, abandon_on_cancel=True)
            except ThreadUnavailable:  # tried again at the next reload or start
                return
            except Exception:  # a bug here must not take the supervisor down
                self.log.exception("records.logs_not_removed", reason="internal error")
                return
        if done is None:
            return
        if done.workers:
            self.log.info(
                "records.logs_removed",
                workers=done.workers,
                bytes=done.bytes,
                budget=limit,
                reason="logs of workers no longer configured past what the configured "
                "workers' logs may hold: the least recently written removed",
            )
        for path, error in done.failed.items():
            self.log.warning(
                "records.logs_not_removed",
                path=path,
                error=error,
                reason="cannot delete it: remove it by hand",
            )

    def _stop_budget(self, runner: WorkerRunner) -> float:
        t = runner.timing
        return t.drain_timeout_s + t.stop_timeout_s + KILL_WAIT_S

    # --- records ------------------------------------------------------------------------

    def _open_state_dir(self) -> None:
        """Create ``state_dir`` and bind the notify socket; a broken disk only degrades records.

        When the socket cannot be bound there (read-only or full ``state_dir``), it goes to a
        private temporary directory instead, so readiness and watchdogs keep working.
        """
        state_dir = self.settings.supervisor.state_dir
        try:
            # Not for everyone to read: post-mortems hold command lines, logs what the workers
            # print. (0750/0640: the service's group may read; systemd's StateDirectoryMode
            # says the same for the directory it makes.)
            make_dir(state_dir, 0o750)
            for sub in ("logs", POSTMORTEM_DIR):
                make_dir(state_dir / sub, 0o750)
        except OSError as exc:
            self.write_health.failed("state", exc)
        # before anything in state_dir is touched: a second supervisor there stops here
        self._state_lock = lock_state_dir(state_dir)
        if self._state_lock is not None:
            self._instance = instance_id(state_dir)
            self._lock_pid_unsaved = not write_lock_pid(self._state_lock)
            if self._instance is None:
                # A full state_dir: the workers still get a marker (their leftovers are found
                # by it after a SIGKILL), saved once the disk takes writes again.
                self._instance, self._instance_unsaved = uuid4().hex, True
                self.log.warning(
                    "records.instance_unsaved",
                    path=os.fspath(state_dir / INSTANCE_FILE),
                    reason="cannot write state_dir's id yet: retried after each state write",
                )
        # the operator's, before a restart; read without the lock too (regression: on a
        # filesystem without locks they were forgotten at every start, though written)
        kept, unreadable = read_cordons(state_dir)
        self.cordoned |= kept
        if unreadable is not None:
            self.log.warning(
                "records.cordons_unreadable",
                path=os.fspath(state_dir / CORDONS_FILE),
                error=unreadable,
                reason="the GPUs cordoned before this start are not known: cordon them "
                "again (the file is written anew at the next cordon or uncordon)",
            )
        if self.cordoned:
            self.log.info("gpu.cordons_kept", gpus=sorted(self.cordoned), reason="operator")
        if self._state_lock is None:
            self.log.warning(
                "records.not_locked",
                path=os.fspath(state_dir),
                reason="cannot lock state_dir: a second supervisor with it would not be refused, "
                "and leftovers are found only from state.json",
            )
        if answers(self.notify_path):
            # Locked though another supervisor runs here (its lock file was removed under
            # it, no locks on this filesystem): its socket answers. Stop before its socket
            # is bound anew and its workers are reclaimed as a killed predecessor's.
            raise StateDirBusy(
                f"supervisor.state_dir {state_dir} is in use by another gpu-supervisor (its "
                f"notify socket {self.notify_path} answers): give each supervisor a state_dir "
                "of its own"
            )
        self._restore_quarantine(state_dir)  # (not rewritten under another supervisor)
        # what supervisors killed with SIGKILL left in /tmp (regression: one more a run)
        leftovers = remove_leftover_private_dirs()
        if leftovers:
            self.log.info(
                "notify.leftovers_removed",
                paths=[os.fspath(p) for p in leftovers],
                reason="private directories of the notify socket whose supervisor is gone",
            )
        try:
            self.listener.open()
        except OSError as exc:
            self.write_health.failed("state", exc)
            self.notify_path = private_socket_path()
            # made again where a cleaner removes it, as for a long state_dir (regression: not)
            self.listener = NotifyListener(
                self.notify_path, self._on_notify, dir_mode=PRIVATE_DIR_MODE
            )
            self.listener.open()
            self.log.warning(
                "notify.moved",
                path=os.fspath(self.notify_path),
                reason="cannot bind the notify socket in state_dir",
            )

    async def _reclaim_orphans(self) -> None:
        """End what a killed predecessor left running (from its ``state.json``)."""
        state_dir = self.settings.supervisor.state_dir
        for d in (state_dir, state_dir / "postmortems"):
            remove_temp_files(d)
        previous = read_json(state_dir / STATE_FILE)
        try:
            link = previous is None and (state_dir / STATE_FILE).is_symlink()
            there = previous is None and not link and (state_dir / STATE_FILE).exists()
        except OSError:  # cannot be looked at (EACCES: a state_dir we may not search; EIO)
            link, there = False, True  # regression: this crashed the start-up; said so now
        if link:
            # Regression: it was followed, so a link planted there chose which processes
            # were ended as a predecessor's orphans.
            self.log.warning(
                "records.previous_state_link",
                path=os.fspath(state_dir / STATE_FILE),
                reason="a symbolic link: not followed; no previous state (leftovers are "
                "found by their environment only)",
            )
        if there:
            self.log.warning(
                "records.previous_state_unreadable",
                path=os.fspath(state_dir / STATE_FILE),
                # (regression: a file this user may not read was said not to be JSON)
                reason=f"{unreadable_why(state_dir / STATE_FILE)}: leftovers are found by "
                "their environment only",
            )
        version = None if previous is None else previous.get("schema_version", 0)
        if version is not None and not (
            isinstance(version, int)
            and not isinstance(version, bool)
            and version <= STATE_SCHEMA_VERSION
        ):
            # A rolled-back upgrade: the file of a newer version. Its fields may mean other
            # things now: a process is ended only if it is the very one recorded (its pid and
            # start time) or carries this state_dir's marker, never on the file's word alone.
            self.log.warning(
                "records.previous_state_newer",
                path=os.fspath(state_dir / STATE_FILE),
                schema_version=version,
                understood=STATE_SCHEMA_VERSION,
                reason="written by a newer gpu-supervisor (rolled back?): only its processes "
                "whose pid and start time match, or that carry this state_dir's id in their "
                "environment, are ended",
            )
        # by the environment marker only while we hold state_dir's lock (else another
        # supervisor may run with the same state_dir, and its workers carry the same id)
        results = await in_thread(
            functools.partial(reclaim, previous or {}, self._instance, hurry=self._hurry),
            inline=True,
        )
        self.reclaimed = results
        for r in results:
            if r["verdict"] == "end":
                self.log.warning(
                    "supervisor.reclaimed_orphan",
                    worker=r["worker"],
                    pid=r["pid"],
                    signal=r.get("signal"),
                    ended=r.get("ended"),
                    **({"error": r["error"]} if r.get("error") else {}),
                    reason=(
                        "left running by a previous supervisor (same pid and create time)"
                        if r.get("found") != "environment"
                        else "left running by a previous supervisor (its environment names "
                        "this state_dir)"
                    ),
                )
            elif r["verdict"] == "reused":
                self.log.info(
                    "supervisor.orphan_pid_reused",
                    worker=r["worker"],
                    pid=r["pid"],
                    reason="pid now belongs to another process (create time differs): not touched",
                )
            if r["verdict"] in ("end", "reused"):
                self.journal.append(
                    self.clock.wall(),
                    "supervisor.reclaim",
                    r["worker"],
                    pid=r["pid"],
                    verdict=r["verdict"],
                    signal=r.get("signal"),
                )

    def _suspect(self, uuid: str, of: Mapping[int, str]) -> None:
        """GPU ``uuid`` suspect for the old pids in ``of`` (pid -> the worker it was of) as well
        as for those it is suspect for already (regression: another worker's stuck pids there
        replaced the first one's, and the GPU was said released while its memory was held)."""
        self._suspect_of[uuid] = {**self._suspect_of.get(uuid, {}), **of}
        self.suspect[uuid] = frozenset(self._suspect_of[uuid])

    def _suspect_unended_orphans(self) -> None:
        """A predecessor's orphan that the start-up reclaim could not end (stuck in the
        kernel after an XID: SIGKILL stays pending) and that holds GPU memory makes its GPU
        suspect, as at the GPU-release barrier: not placed on while NVML lists it (a worker
        of its own goes back there only when no other GPU fits). Regression: new workers were
        placed onto that GPU, next to the memory it still held."""
        left = {
            r["pid"]: str(r["worker"])
            for r in self.reclaimed
            if r["verdict"] == "end" and r.get("ended") is False
        }
        sample = self.sampler.last
        if not left or sample is None or not sample.nvml_available:
            return
        for d in sample.devices:
            pids = frozenset(p.pid for p in d.processes or () if p.pid in left)
            if not pids:
                continue
            worker = left[min(pids)]
            self._suspect(d.uuid, {p: left[p] for p in pids})
            self.log.warning(
                "gpu.suspect",
                worker=worker,
                gpu=d.uuid,
                pids=sorted(pids),
                reason="memory of a previous supervisor's orphan that could not be ended",
            )

    def _state_snapshot(self) -> dict[str, Any]:
        sample = self.sampler.last
        workers = []
        for r in self.workers():
            rec = r.record
            workers.append(
                StateWorker(
                    name=r.name,
                    group=r.spec.group,
                    state=rec.state.value,
                    pid=rec.pid,
                    pid_create_time=r.pid_create_time if rec.pid is not None else None,
                    gpus=r.spec.gpus,
                    restarts=rec.restarts,
                    port=r.spec.port,
                )
            )
        doc = state_doc(
            written_at=self.clock.wall(),
            supervisor_pid=os.getpid(),
            version=__version__,
            started_at=self.started_wall,
            workers=workers,
            devices=self.device_objects(),
            nvml_available=bool(sample and sample.nvml_available) and bool(self.sampler.identities),
            reclaimed=self.reclaimed,
            stopped=self.stopped,
            boot_time=procfs.boot_time(),
            boot_id=procfs.boot_id(),
        )
        for w, r in zip(doc["workers"], self.workers(), strict=True):
            usage = sample.workers.get(r.name) if sample is not None else None
            w["_tree_pids"] = list(usage.pids) if usage is not None and r.record.pid else []
        return doc

    def device_objects(self) -> list[dict[str, Any]]:
        """The API's device objects from the last sample."""
        sample = self.sampler.last
        if sample is None:
            return []
        worker_of = {pid: n for n, u in sample.workers.items() for pid in u.pids}
        assigned = {r.name: r.spec.gpus for r in self.workers()}

        def owners(d: DeviceSample) -> Mapping[int, str]:
            # a worker in a PID namespace of its own is listed under its pids there
            extra = {}
            for p in d.processes or ():
                name = alias_owner(p.pid, d.uuid, self.sampler.aliases, worker_of, assigned)
                if name is not None:
                    extra[p.pid] = name
            return {**worker_of, **extra} if extra else worker_of

        return [
            device_object(
                d,
                cordoned=d.uuid in self.cordoned,
                suspect=d.uuid in self.suspect,
                quarantined=self.healer.state.quarantined.get(d.uuid),
                hot=self.healer.state.thermal.get(d.uuid, ThermalTrack()).hot,
                worker_of=owners(d),
                xids_watched=d.uuid not in self.sampler.xids_unwatched,
            )
            for d in sample.devices
        ]

    def worker_object(self, runner: WorkerRunner) -> dict[str, Any]:
        """The API's worker object."""
        sample = self.sampler.last
        usage = sample.workers.get(runner.name) if sample is not None else None
        obj = self.healer.annotate(runner.name, runner.view(usage))
        group = self.settings.group(runner.spec.group)
        limited = group is not None and group.health.host_memory_limit_mb > 0
        obj["host_memory_enforcement"] = self.cgroups.support.mode if limited else None
        live = runner.spec.liveness
        failed, last = runner.liveness_failing
        obj["liveness"] = (
            None
            if live is None
            else {
                "url": redact_url(live.url),  # served to whoever may read: no token in it
                "failed": failed,
                "of": live.failures,
                "last": last or None,
            }
        )
        if runner.name in self._start_queue:  # not to be told from a start under way else
            ahead = self._start_queue.index(runner.name)
            obj["reason"] = (
                f"waiting its turn to start (max_starting = "
                f"{self.settings.supervisor.max_starting}, {ahead} ahead)"
            )
        return obj

    def changed(self) -> None:
        """Something the read model shows changed (wake waiters, mark the state file)."""
        self._changed_now()
        self.recorder.mark(urgent=True)
        self._save_quarantine()

    def _restore_quarantine(self, state_dir: Path) -> None:
        """Quarantine again the GPUs an earlier supervisor quarantined in this boot
        (regression: a restart of the supervisor, an upgrade say, lifted every quarantine,
        and workers were placed on a GPU that had failed with a device-fatal XID)."""
        kept = read_quarantine(state_dir, procfs.boot_id())
        if kept.unreadable is not None:
            self.log.warning(
                "records.quarantine_unreadable",
                path=os.fspath(state_dir / QUARANTINE_FILE),
                error=kept.unreadable,
                reason="the GPUs quarantined before this start are not known: cordon any "
                "that failed and has not been reset",
            )
        if kept.dropped:
            self.log.info(
                "gpu.quarantines_dropped",
                gpus=kept.dropped,
                reason="the machine rebooted since they were quarantined (their GPUs reset)",
            )
        self.healer.keep_lifts(kept.lifted)  # (an operator's lift, while a flag stays on)
        # (an earlier boot's file, lifts alone included, is rewritten without what it held:
        # regression, one with lifts alone was kept as it was)
        self._quarantine_saved = None if kept.earlier_boot else (dict(kept.gpus), kept.lifted)
        self._quarantine_stale_only = kept.earlier_boot
        self._quarantine_unsaved = None
        if kept.gpus:
            self.healer.state.quarantined.update(kept.gpus)
            self.log.warning(
                "gpu.quarantines_kept",
                gpus=kept.gpus,
                reason="quarantined before this start, in this boot: lifted by "
                "`uncordon --lift-quarantine` once reset",
            )
        self._save_quarantine()

    def _save_quarantine(self, *, again: bool = False) -> None:
        """Write ``state_dir/quarantine`` when the quarantines differ from what it holds (at
        a quarantine or a lift, and the lifts that hold while a GPU's flag stays on). One the
        disk did not take is written after the next state write that works
        (``_save_unsaved_ids``), not tried again at each change (regression: a file that could
        not be written while state.json could said write_failed and write_recovered in turn at
        every sample); ``again``: tried all the same (the last try at the stop)."""
        state = self.healer.state
        snapshot = (dict(state.quarantined), {g: dict(f) for g, f in state.lifted.items()})
        if snapshot == self._quarantine_saved or (
            snapshot == self._quarantine_unsaved and not again
        ):
            return
        with self._quarantine_guard:
            try:
                write_quarantine(self.settings.supervisor.state_dir, procfs.boot_id(), *snapshot)
            except OSError as exc:
                self._quarantine_saved, self._quarantine_unsaved = None, snapshot
                self.write_health.failed("state", exc)
            else:
                self._quarantine_saved, self._quarantine_unsaved = snapshot, None
                self._quarantine_stale_only = False

    def _on_state_dir_recreated(self) -> None:
        """``state_dir`` was removed: lock it again (the lock file went with it), bind the
        notify socket again, reopen the log files, write the operator's cordons again (the
        next supervisor keeps them: they went with the directory)."""
        self._relock_state_dir()
        operator = self.cordoned - self.healer.state.thermal_cordoned
        if operator:
            self._save_cordons(operator)
        self._quarantine_saved = self._quarantine_unsaved = None  # it went with the directory
        self._save_quarantine()
        with contextlib.suppress(OSError):
            if not self.listener.bound():
                self.listener.rebind()
                self.log.warning("notify.rebound", path=os.fspath(self.notify_path))
        self._shared_checked_at = -math.inf
        self._check_shared_socket(self.clock.now())
        for runner in self.workers():
            runner.output.file.close()

    def _save_cordons(self, operator: Iterable[str]) -> None:
        """Write the operator's cordons to ``state_dir/cordons``; when the disk does not take
        them, they are written after the next state write that works (``_save_unsaved_ids``).
        Regression: they were not tried again, and a cordon made while state_dir was full was
        forgotten by the next supervisor."""
        uuids = frozenset(operator)
        with self._cordons_guard:
            try:
                write_cordons(self.settings.supervisor.state_dir, uuids)
            except OSError as exc:
                self._cordons_unsaved = uuids
                self.write_health.failed("state", exc)
            else:
                self._cordons_unsaved = None

    def _save_unsaved_ids(self) -> None:
        """After a state write (in the writer thread): save what a full disk kept from being
        written, ``state_dir/instance`` and our pid in the lock file at start, the operator's
        cordons since."""
        state_dir = self.settings.supervisor.state_dir
        with self._cordons_guard:
            cordons = self._cordons_unsaved
            if cordons is not None:
                with contextlib.suppress(OSError):  # still failing: after the next state write
                    write_cordons(state_dir, cordons)
                    self._cordons_unsaved = None
                    self.log.info("records.cordons_saved", path=os.fspath(state_dir / CORDONS_FILE))
        with self._quarantine_guard:
            quarantine = self._quarantine_unsaved
            if quarantine is not None:
                with contextlib.suppress(OSError):  # still failing: after the next state write
                    write_quarantine(state_dir, procfs.boot_id(), *quarantine)
                    self._quarantine_saved, self._quarantine_unsaved = quarantine, None
                    self._quarantine_stale_only = False
                    self.log.info(
                        "records.quarantine_saved", path=os.fspath(state_dir / QUARANTINE_FILE)
                    )
        with self._state_lock_guard:  # the loop may be replacing the fd (state_dir recreated)
            lock = self._state_lock
            if self._lock_pid_unsaved and lock is not None and write_lock_pid(lock):
                self._lock_pid_unsaved = False
        keep = self._instance
        if self._instance_unsaved and keep and instance_id(state_dir, keep=keep) is not None:
            self._instance_unsaved = False
            self.log.info("records.instance_saved", path=os.fspath(state_dir / INSTANCE_FILE))

    def _lock_in_place(self) -> bool:
        """True while ``state_dir/lock`` is the file we hold locked (a ``stat``)."""
        if self._state_lock is None:
            return False
        with contextlib.suppress(OSError):
            here = os.stat(self.settings.supervisor.state_dir / LOCK_FILE)
            held = os.fstat(self._state_lock)
            return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)
        return False

    def _check_lock_file(self) -> None:
        """Lock ``state_dir`` again where its lock file alone went (a temporary-file cleaner
        ages it out: it is written once, at start). Regression: it was not made again, and a
        second supervisor started there killed our workers as orphans. A ``stat`` a sample;
        nothing where ``state_dir`` could not be locked at start."""
        if self._state_lock is None or self._lock_in_place():
            return
        if self._relock_state_dir():
            self.log.warning(
                "records.relocked",
                path=os.fspath(self.settings.supervisor.state_dir / LOCK_FILE),
                reason="the lock file was removed: made and locked again",
            )

    def _relock_state_dir(self) -> bool:
        """Lock ``state_dir`` again (its lock file is gone); False where nothing changed."""
        state_dir = self.settings.supervisor.state_dir
        if self._lock_in_place():
            return False  # our lock file is still there (only a subdirectory went)
        try:
            fd = lock_state_dir(state_dir)
        except StateDirBusy as exc:  # another supervisor started there meanwhile
            if str(exc) != self._lock_lost:  # said once, not at each sample
                self.log.error(  # noqa: TRY400 - one line, no traceback
                    "records.lock_lost", path=os.fspath(state_dir), error=str(exc)
                )
            self._lock_lost = str(exc)
            fd = None
        if fd is not None:
            with self._state_lock_guard:
                old, self._state_lock = self._state_lock, fd
                self._lock_pid_unsaved = not write_lock_pid(fd)  # a full disk: later
                if old is not None:
                    os.close(old)  # the lock of the removed file: held by no one else's name
            if self._instance is not None:
                instance_id(state_dir, keep=self._instance)  # what our workers carry
            self._lock_lost = None
        return fd is not None

    def _retry_failed_logs(self) -> None:
        """While log writes fail, try each failing log again (once a sample): a quiet worker's
        log, or one of a worker a reload removed, would otherwise stay failing for ever."""
        if "log" not in self.write_health.failing:
            return
        failing = [r.output.file for r in self.workers() if r.output.file.failing]
        for file in failing:
            file.retry()  # (the last one that gets through says the logs are writable)
        if not failing:
            self.write_health.ok("log")
        else:
            self.write_health.lasting("log")  # (said again if only said at debug)

    def _on_log_health(self, exc: OSError | None) -> None:
        if exc is None:
            if not any(r.output.file.failing for r in self.workers()):
                self.write_health.ok("log")
        else:
            self.write_health.failed("log", exc)

    def _on_log_trim(self, name: str, freed: int, capped: int) -> None:
        # Once a minute per worker, the rest at debug: on a disk that something else keeps
        # full, the log grows into what it freed and gives it up again (regression: a
        # warning several times a second for as long as the disk stayed full).
        loud = self._trims_said.allow((name,), self.clock.now())
        self.log.log(
            30 if loud else 10,
            "output.log_trimmed",
            worker=name,
            freed_bytes=freed,
            rotates_at_bytes=capped,
            reason="state_dir is full: the worker's log gave up its space (state.json and "
            "post-mortems come first); its last lines are still in memory",
        )

    def _on_worker_event(self, runner: WorkerRunner, kind: str, fields: dict[str, Any]) -> None:
        self.journal.append(self.clock.wall(), kind, runner.name, **fields)
        if kind == "worker.state" and fields.get("old") == WorkerState.STARTING.value:
            self._let_go.discard(runner.name)  # a turn is for one start (stopped, failed...)
        if kind == "worker.spawned":
            self.cgroups.place(runner.name, fields["pid"])
            self.healer.on_spawned(runner, fields["pid"])
        elif kind == "worker.state" and fields.get("new") == WorkerState.FATAL.value:
            self.healer.on_stopped(runner)
            self.healer.on_fatal(runner, str(fields.get("reason", "")))
        elif kind == "worker.state" and fields.get("new") == WorkerState.STOPPED.value:
            self.healer.on_stopped(runner)
        elif kind == "worker.waiting_gpu":
            self.healer.on_waiting_gpu(runner, str(fields.get("error", "")))

    def _before_spawn(self, runner: WorkerRunner) -> Path | None:
        """Right before each spawn: SpawnError where the worker, of another user, could not
        reach the notify socket it needs; else the cgroup its process joins (None: none)."""
        spec = runner.spec
        problem = self._shared_problem(spec)
        if problem is not None and isinstance(spec.account, Account):
            raise SpawnError(
                f"cannot start {spec.argv[0]!r} as user {spec.account.user!r}: the notify "
                f"socket for workers of other users cannot be had: {problem}"
            )
        return self._cgroup_for(runner)

    def _cgroup_for(self, runner: WorkerRunner) -> Path | None:
        """The cgroup ``runner``'s next process joins before exec (None: none)."""
        group = self.settings.group(runner.spec.group)
        limit = group.health.host_memory_limit_mb if group is not None else 0.0
        return self.cgroups.prepare(runner.name, limit)

    def _check_open_files(self, workers: int) -> None:
        """Warn when the open-files limit is too low for ``workers`` workers (spawns would
        fail with "Too many open files")."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        needed = open_files_needed(workers)
        if soft != resource.RLIM_INFINITY and soft < needed:
            self.log.warning(
                "supervisor.open_files_low",
                limit=soft,
                needed=needed,
                workers=workers,
                hint="raise LimitNOFILE= (systemd) or --ulimit nofile= (docker)",
            )

    def _end_leftovers(self, runner: WorkerRunner, pid: int) -> None:
        """What is left of an exited worker's tree goes with it (DESIGN.md section 2).

        The worker already killed its process group and the tree it saw when it signalled it;
        descendants that left the group (``setsid``) were re-parented when the main process
        exited, so nothing names it as parent any more. ``cgroup.kill`` ends them where the
        worker has a cgroup. Elsewhere: the tree the sampler last read (a full scan at most 5 s
        old), each process only while it is the one seen (its start time), and the processes
        re-parented to the supervisor (daemons that double-forked) that carry this worker's
        ``GPU_SUPERVISOR_WORKER`` in their environment.
        """
        if self.cgroups.kill(runner.name):
            return
        victims: list[int] = []
        for member in sorted(self._trees.get(runner.name, frozenset())):
            if member == pid or member in self._pids:
                continue
            seen = self.sampler.started_ticks(member)
            st = procfs.read_stat(member)
            if seen is not None and st is not None and not st.zombie and st.start_ticks == seen:
                victims.append(member)
        killed = []
        for member in victims:
            with contextlib.suppress(OSError):
                os.kill(member, signal.SIGKILL)
                killed.append(member)
        if killed:
            # what such a member forked since that read (a setsid() grandchild) is its child
            # until it has died, and ours only then: after the reads of our children below
            # (regression: it was re-parented to us a moment later, and lived on)
            try:
                now = procfs.scan()
            except OSError:  # out of file descriptors: the cgroup or the next reclaim ends them
                now = {}
            below_tree = procfs.children_map(now)
            for member in list(killed):
                st = now.get(member)
                if st is None or st.start_ticks != self.sampler.started_ticks(member):
                    continue  # gone (its children are ours: read below), or a reused pid
                for descendant in descendants(member, below_tree):
                    if descendant.pid not in killed:
                        with contextlib.suppress(psutil.Error):
                            descendant.kill()
                            killed.append(descendant.pid)
        # A member of the group killed with it may be dying right now: alive, what it forked
        # (a setsid() grandchild) is still its child; dead, that was re-parented to us just
        # before. So its children are taken with it, and our children are read again until
        # no new one of this worker turns up.
        looked: set[int] = {pid, *killed}
        pipes = runner.output.pipe_inodes()
        for _ in range(LEFTOVER_ROUNDS):
            try:
                orphans = procfs.own_children() - self._pids.keys() - looked
            except OSError:  # out of file descriptors: the cgroup or the next reclaim ends them
                break
            looked |= orphans
            dying = False
            # one read of /proc a round for what is below them (psutil's recursive children()
            # reads all of it for each: hundreds of leftovers held the event loop for seconds)
            table: dict[int, list[int]] | None = None
            for child in sorted(orphans):
                with contextlib.suppress(psutil.Error, OSError):
                    proc = psutil.Process(child)
                    if not _left_by(proc, pid, runner.name, pipes):
                        continue
                    dying = True
                    if proc.status() == "zombie":
                        continue
                    if table is None:
                        try:
                            table = procfs.children_map(procfs.scan())
                        except OSError:  # out of file descriptors: the leftover still goes
                            table = {}
                    below = descendants(child, table)
                    proc.kill()  # psutil checks the create time: never a reused pid
                    killed.append(child)
                    for descendant in below:
                        with contextlib.suppress(psutil.Error):
                            descendant.kill()
                            killed.append(descendant.pid)
            if not dying:
                break
        if killed:
            self.log.warning(
                "worker.killed_leftovers",
                worker=runner.name,
                pid=pid,
                pids=killed,
                reason="outside the process group after the main process exited",
            )

    def _on_worker_exit(
        self, runner: WorkerRunner, action: lc.Exit, before: lc.WorkerRecord
    ) -> None:
        """Count the death now; classify it and write its post-mortem after the step.

        What the post-mortem needs is taken now (the replacement's spawn, later in the same
        step, moves the start time, the log tail, the samples, the OOM baseline and the
        journal on); the rest (~0.3 ms: /proc/vmstat, the document) waits until the
        replacement has been spawned.
        """
        if runner.last_exit_pid is not None:
            self._end_leftovers(runner, runner.last_exit_pid)
        outcome = action.outcome
        rec = runner.record
        restarted = rec.restarts > before.restarts or rec.state in (WorkerState.BACKOFF,)
        restarting = rec.state in (WorkerState.BACKOFF, WorkerState.STARTING)
        if outcome.reason.value in ("hang", "start_timeout") and restarting:
            # the lifecycle's own restarts go the healing actions' way: log, count, webhook
            if outcome.reason.value == "start_timeout":
                why = "not ready within start_timeout_s"
                if WorkerState.STARTING in runner.extended_in:  # (EXTEND_TIMEOUT_USEC)
                    why = "not ready within the time its EXTEND_TIMEOUT_USEC asked for"
            elif runner.watchdog_triggered:
                why = "the worker sent WATCHDOG=trigger"
            elif runner.liveness_failed is not None:
                why = runner.liveness_failed
            elif before.watchdog_s is not None:  # the worker set its own (WATCHDOG_USEC)
                why = f"no WATCHDOG=1 within the {before.watchdog_s:g}s its WATCHDOG_USEC set"
            else:
                why = "no WATCHDOG=1 within watchdog_s"
            extended = WorkerState.READY in runner.extended_in
            if extended and outcome.reason.value == "hang" and why.startswith("no WATCHDOG=1"):
                why += " (or the time its EXTEND_TIMEOUT_USEC asked for)"
            detail = f"{why}; {outcome.detail}" if outcome.detail else why
            self.healer.on_restarted(runner, outcome.reason.value, detail)
        dead = _Death(
            runner=runner,
            action=action,
            before=before,
            spec=runner.spec,
            pid=runner.last_exit_pid,
            started_wall=runner.started_wall,
            ended_wall=runner.last_exit_wall or self.clock.wall(),
            uptime_s=None
            if before.started_at is None or runner.last_exit_at is None
            else max(0.0, runner.last_exit_at - before.started_at),
            lines=runner.output.lines(),
            # what the death is judged by: this process's lines of the last moments (a CUDA
            # OOM it caught long ago and went on after is not why it ended)
            judged=this_run(
                runner.output.lines_since(
                    (self.clock.now() if runner.last_exit_at is None else runner.last_exit_at)
                    - CUDA_OOM_FRESH_S
                )
            ),
            samples=list(self.samples_of.pop(runner.name, ())),
            healing=self.healer.exit_evidence(runner.name),
            # Only a SIGKILL (or a wrapper's exit 137 passing one on) can be the kernel's OOM
            # killer: /proc/vmstat is not read otherwise.
            oom_baseline=self.healer.oom_baseline(runner.name)
            if may_be_oom_kill(outcome.status)
            else None,
            journal_seq=self.journal.last_seq,
            restarted=restarted,
            last_probe=runner.last_probe,
            watchdog_triggered=runner.watchdog_triggered,
            liveness_failed=runner.liveness_failed,
        )
        runner.after_step(functools.partial(self._write_postmortem, dead))

    def _write_postmortem(self, dead: _Death) -> None:
        runner, outcome, before = dead.runner, dead.action.outcome, dead.before
        timing = runner.timing
        silent = None
        if before.heartbeat_at is not None:
            silent = outcome.at - before.heartbeat_at
        found = classify(
            outcome.reason,
            outcome.status,
            dead.judged,
            failure=dead.action.failure,
            detail=outcome.detail,
            timing={
                # the worker's own, where it set one (WATCHDOG_USEC)
                "watchdog_s": timing.watchdog_s if before.watchdog_s is None else before.watchdog_s,
                "start_timeout_s": timing.start_timeout_s,
                "drain_timeout_s": timing.drain_timeout_s,
            },
            silent_for_s=silent,
            healing=dead.healing,
            oom_kills=self.healer.oom_kills_since(runner.name, dead.oom_baseline),
            oom_scope=self.healer.oom_scope(runner.name),
            # the drain's time ran out: it was being stopped (stop_signal) when it exited
            drain_timed_out=before.state is WorkerState.STOPPING,
            drain_signal=timing.drain_signal,
            last_probe=dead.last_probe,
            watchdog_triggered=dead.watchdog_triggered,
            liveness_failed=dead.liveness_failed,
        )
        # The restart is counted under what the death was found to be (a CUDA OOM, not
        # "exit"), as the post-mortem and the worker object's last_exit say.
        reason = outcome.reason.value if found is None else found.reason
        if dead.restarted:
            key = (runner.name, reason)
            self.restarts_total[key] = self.restarts_total.get(key, 0) + 1
        runner.classified_exit(reason)
        if found is None:
            return
        spec = dead.spec
        devices = [
            d for d in self.device_objects() if spec.gpus is not None and d["uuid"] in spec.gpus
        ]
        doc = postmortem_doc(
            id_=postmortem_id(dead.ended_wall, runner.name, found.reason),
            worker=WorkerFacts(
                name=runner.name,
                group=spec.group,
                index=spec.index,
                pid=dead.pid,
                command=spec.argv,
                gpus=spec.gpus,
                port=spec.port,
                started_at=dead.started_wall,
                ended_at=dead.ended_wall,
                restarts=before.restarts,
                uptime_s=dead.uptime_s,
            ),
            status=outcome.status,
            reason=found.reason,
            # the death after which the worker is given up on says so
            evidence={**found.evidence, "fatal": True}
            if runner.record.state is WorkerState.FATAL
            else found.evidence,
            samples=dead.samples,
            devices=devices,
            log_tail=dead.lines,
            events=self.journal.for_worker(runner.name, POSTMORTEM_EVENTS, until=dead.journal_seq),
        )
        self.postmortems_total[found.reason] = self.postmortems_total.get(found.reason, 0) + 1
        self.journal.append(
            self.clock.wall(), "postmortem", runner.name, id=doc["id"], reason=found.reason
        )
        self.recorder.postmortem(doc)

    # --- tasks --------------------------------------------------------------------------

    async def _serve_signals(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            try:
                await self._receive_signals(task_status)
            finally:
                # Closing the receiver put their default actions back, while the supervisor
                # still ends (tasks cancelled, files closed): one now is the stop already
                # made, ignored. Regression: a Ctrl-C more exited 130 ("interrupted", or a
                # traceback), a SIGTERM or SIGHUP killed it, with no supervisor.exit.
                _ignore_held_signals()
        except KeyboardInterrupt:
            # a Ctrl-C in the instant between the receiver's close (Python's default handler
            # back: KeyboardInterrupt) and the line above (regression: exit 130 in 1 of ~100
            # stops under a stream of Ctrl-C)
            _ignore_held_signals()

    async def _receive_signals(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(*HELD_SIGNALS) as signals:
            release_held_signals()  # one that came while we started is delivered now
            task_status.started()
            last: dict[int, float] = {}  # signal -> when it was last received
            async for signum in signals:
                now = self.clock.now()
                since = now - last.get(signum, -math.inf)
                last[signum] = now
                intent = signal_intent(signum, self._shutting_down, since)
                if isinstance(intent, Reload):
                    intent = Reload(self._next_reload_request())
                said = {"repeat": True} if since < SIGNAL_REPEAT_S else {}
                self.log.info("supervisor.signal", signal=signal.Signals(signum).name, **said)
                if intent is not None:
                    self.submit(intent)

    async def _serve_intents(self) -> None:
        assert self._tg is not None
        async for intent in self._intent_recv:
            if isinstance(intent, Shutdown):
                if not self._shutting_down:
                    self._shutting_down = True
                    self._tg.start_soon(self._shutdown, intent.signal_name)
                elif not self._forced:
                    self._forced = True
                    self.log.warning("supervisor.force_stop", reason="second signal")
                    self._hurry.set()
                    for runner in self.workers():
                        runner.post(lc.Kill("second signal"))
            elif isinstance(intent, Reload):
                if self._reloading:
                    self._reload_again = True
                    self._tg.start_soon(self._vet_reload, intent.request)
                else:
                    self._reloading = True
                    self._tg.start_soon(self._reload_loop)
            elif self._shutting_down:
                continue
            elif isinstance(intent, RollingRestart):
                if intent.group not in self.groups:  # a reload removed it meanwhile
                    self._journal_rollout(
                        intent.group,
                        "rolling_restart",
                        False,
                        request=intent.request,
                        reason="refused: the group was removed by a reload",
                    )
                    continue
                if intent.group in self.rolling:  # asked for while the API said it was free
                    self.log.warning(
                        "supervisor.rolling_restart_refused",
                        group=intent.group,
                        reason=f"a {self.rolling[intent.group]} of the group is running",
                    )
                    self._journal_rollout(
                        intent.group,
                        "rolling_restart",
                        False,
                        request=intent.request,
                        reason=f"refused: a {self.rolling[intent.group]} of the group is running",
                    )
                    continue
                self.rolling[intent.group] = "rolling restart"
                self._tg.start_soon(self._rolling_restart, intent.group, intent.request)
            elif isinstance(intent, Cordon):
                self._cordon(intent)
            else:
                self._command(intent)

    def _targets(self, target: str) -> list[WorkerRunner]:
        if target in self.runners:
            return [self.runners[target]]
        return [self.runners[n] for n in self.groups.get(target, [])]

    def _command(self, cmd: WorkerCommand) -> None:
        action = type(cmd.event).__name__.lower()
        key = (action, "operator")
        self.actions_total[key] = self.actions_total.get(key, 0) + 1
        self.journal.append(self.clock.wall(), "operator." + action, None, target=cmd.target)
        for runner in self._targets(cmd.target):
            if runner.name not in self.removing:  # a reload's stop of it stays in force
                runner.post(cmd.event)

    def _cordon(self, cmd: Cordon) -> None:
        was = cmd.uuid in self.cordoned
        operator_before = self.cordoned - self.healer.state.thermal_cordoned
        # the operator's word wins over a cordon for heat: cooling no longer lifts it
        self.healer.state.thermal_cordoned.discard(cmd.uuid)
        if cmd.cordon:
            self.cordoned.add(cmd.uuid)
        else:
            self.cordoned.discard(cmd.uuid)
        why = None
        if cmd.lift_quarantine and cmd.uuid in self.healer.state.quarantined:
            if self.gpu_answers(cmd.uuid):
                why = self.healer.lift_quarantine(cmd.uuid)
            else:  # the API refuses it (409); one that raced a loss is kept here
                self.log.warning(
                    "gpu.quarantine_kept", gpu=cmd.uuid, reason="it does not answer: reset it first"
                )
        if why is not None:
            self.log.warning("gpu.quarantine_lifted", gpu=cmd.uuid, reason="operator", was=why)
            self.journal.append(
                self.clock.wall(), "gpu.quarantine_lifted", None, gpu=cmd.uuid, was=why
            )
            key = ("lift_quarantine", "operator")
            self.actions_total[key] = self.actions_total.get(key, 0) + 1
            self.recorder.mark(urgent=True)
        # a cordon of a GPU cordoned for heat makes it the operator's: said and counted as a
        # cordon (regression: nothing said, the GPU being cordoned already)
        if was != cmd.cordon or (cmd.cordon and cmd.uuid not in operator_before):
            kind = "gpu.cordon" if cmd.cordon else "gpu.uncordon"
            self.log.info(kind, gpu=cmd.uuid, reason="operator")
            self.journal.append(self.clock.wall(), kind, None, gpu=cmd.uuid, reason="operator")
            key = ("cordon" if cmd.cordon else "uncordon", "operator")
            self.actions_total[key] = self.actions_total.get(key, 0) + 1
            self.recorder.mark(urgent=True)
        operator = self.cordoned - self.healer.state.thermal_cordoned
        if operator != operator_before:  # a heat cordon the operator makes theirs counts too
            self._save_cordons(operator)  # a cordon outlives a restart of the supervisor
        self._save_quarantine()  # a lift, too
        self._changed_now()

    def gpu_answers(self, uuid: str) -> bool:
        """GPU ``uuid`` was healthy at the last sample (not lost, NVML answered for it)."""
        last = self.sampler.last
        if last is None or not last.nvml_available:
            return False
        return any(d.uuid == uuid and d.healthy for d in last.devices)

    def gpu_ids(self) -> dict[str, int]:
        """Every GPU known, UUID -> index: those the last sample lists first (the world or
        the driver as it is now: a GPU added since the backend opened, one renumbered), then
        those listed when it opened, then those no longer listed (lost)."""
        sample = self.sampler.last
        devices = sample.devices if sample is not None else ()
        listed = [(d.uuid, d.index) for d in devices if d.error != LOST_UNLISTED]
        opened = [(i.uuid, i.index) for i in self.sampler.identities]
        out: dict[str, int] = {}
        for uuid, index in (*listed, *opened, *((d.uuid, d.index) for d in devices)):
            out.setdefault(uuid, index)
        return out

    def resolve_gpu(self, ident: str) -> str | None:
        """The UUID of the GPU with this index or UUID (None when there is none); an index
        is the GPU's at the last sample where one lists it (:meth:`gpu_ids`)."""
        ids = self.gpu_ids()
        if ident in ids:
            return ident
        return next((uuid for uuid, index in ids.items() if ident == str(index)), None)

    async def _rolling_restart(
        self, group: str, request: int = 0, unplaced: frozenset[str] | None = None
    ) -> None:
        """An operator's rolling restart of ``group``; or, with ``unplaced``, the placement
        roll-out of those of its workers (:meth:`_place_unplaced`)."""
        done = False
        try:
            done = await self._roll_restart(group, unplaced)
        finally:
            self.rolling.pop(group, None)
            self._changed_now()  # a reload's roll-out of the group may wait for this one
            if not self._shutting_down:
                if unplaced is None:
                    self._journal_rollout(group, "rolling_restart", done, request=request)
                else:
                    self._journal_rollout(group, "placement", done)

    def _serving(self, name: str) -> bool:
        """Sort key of a roll-out: the workers that serve nothing now (in backoff, loading,
        stopped) are replaced first, the ready ones last. Regression: in index order, a
        group with one ready worker and one in backoff lost the ready one first and served
        nothing until its replacement had loaded."""
        runner = self.runners.get(name)
        return runner is not None and runner.state is WorkerState.READY

    async def _others_back(
        self, group: str, runner: WorkerRunner, keep: Collection[str] | None = None
    ) -> bool:
        """Before a roll-out takes ready ``runner`` down: wait until no other worker of the
        group is on its way down or back up (a healing drain, a restart, a start, a backoff
        after a crash); False
        (halted, logged) when one is not back in time. Regression: a roll-out took the last
        ready worker down while healing drained the other one (the group served nothing)."""
        if runner.state is not WorkerState.READY:
            return True  # serves nothing now: replacing it costs nothing

        def busy() -> list[WorkerRunner]:
            return [
                r
                for r in self._targets(group)
                if r is not runner
                and (keep is None or r.name in keep)  # not one the new plan removes
                and (
                    r.state in (WorkerState.DRAINING, WorkerState.STOPPING)
                    # one a drain, restart or stop was posted to that its task has not taken
                    # yet (a healing action of this step of the loop): it still says ready
                    # (regression: the roll-out took its sibling down too)
                    or (r.state is WorkerState.READY and r.queued_down() is not None)
                    # with no process yet too: at the GPU-release barrier (bounded by
                    # release_timeout_s; regression: taken for not coming back)
                    or r.state is WorkerState.STARTING
                    # after a crash; not one waiting for a GPU (that can be for good)
                    or (r.state is WorkerState.BACKOFF and not r.record.gpu_waits)
                )
            ]

        if not busy():
            return True
        t = runner.timing
        budget = t.drain_timeout_s + self._stop_budget(runner) + t.start_timeout_s
        # one in backoff after a crash that fails again meanwhile will not be back: no use
        # waiting out the budget for it (minutes, with the default timeouts)
        # (one starting after a crash that fails is one too: it is in backoff again)
        # (so is one whose start failed meanwhile and that started again at once, with no
        # backoff delay: regression, never seen in backoff, it was waited for to the end)
        looping = {r.name: (r.spawn_attempts, r.state, r.failed_attempt) for r in busy()}

        def failed_again() -> list[WorkerRunner]:
            return [
                r
                for r in self._targets(group)
                if r.name in looping
                and not r.record.waiting_for_gpu
                and (
                    (
                        r.state in (WorkerState.BACKOFF, WorkerState.FATAL)
                        and (
                            r.spawn_attempts > looping[r.name][0]
                            or looping[r.name][1] is not WorkerState.BACKOFF
                        )
                    )
                    or r.failed_attempt > looping[r.name][2]
                )
            ]

        if (
            await self._wait_started(
                lambda: self._in_line(r.name for r in busy()),
                lambda: (
                    not busy()
                    or bool(failed_again())
                    or self._shutting_down
                    or self._superseded(group)
                ),
                budget,
                busy,
            )
            and not failed_again()
        ):
            if self._superseded(group):
                return self._roll_superseded(group)
            return not self._shutting_down
        again = failed_again()
        if again:
            why = f"{', '.join(r.name for r in again)} failed again"
        else:
            why = f"{', '.join(r.name for r in busy())} not back in time"
        self._rollout_halted(group, runner, f"{why}: not taking {runner.name} down too")
        return False

    def _superseded(self, group: str) -> bool:
        """A reload's roll-out of ``group`` runs and a reload was asked for after it read its
        file: the roll-out stops before the next worker goes (or while it waits on one), and
        the newer file is rolled out from there (each superseded file was rolled onto the
        whole group before, minutes per worker with a model to load). So too an operator's
        rolling restart of ``group`` once a reload that restarts the group on a new
        definition waits for it (its restarts of the old one were waited out before)."""
        if self._shutting_down:
            return False
        if self.rolling.get(group) in ("rolling restart", PLACEMENT):
            return group in self._roll_waiting
        return self.rolling.get(group) == "reload" and self._reload_superseded()

    def _reload_superseded(self) -> bool:
        """A reload was asked for after the running one read its file, and its file would be
        taken: it rolls out from where this one stops."""
        return self._reload_again and self._vetted > self._covered

    def _roll_superseded(self, group: str, kind: str | None = None) -> bool:
        """Stop ``group``'s roll-out (``kind``: "reload", "rolling restart"; by default the
        one that runs) for a newer reload (logged); False, as a halted one."""
        reason = "a later reload rolls the group out from here"
        halted = "superseded by a later reload"
        if (kind or self.rolling.get(group)) in ("rolling restart", PLACEMENT):
            if self.settings.group(group) is None:
                reason = halted = "superseded by a reload that removes the group"
            else:
                reason = "a reload restarts the group on a new definition: it rolls it from here"
                halted = "superseded by a reload that restarts the group on a new definition"
        self.log.info("supervisor.rollout_superseded", group=group, reason=reason)
        self._halted_at[group] = {"reason": halted, "superseded": True}
        return False

    def _rollout_passes_over(
        self,
        group: str,
        runner: WorkerRunner,
        reason: str = "it went down before the roll-out reached it and waits for a GPU",
    ) -> None:
        """A worker that was on its way down when the roll-out reached it (a healing drain,
        a stop after a crash) came back waiting for a GPU (its own quarantined, lost, full):
        passed over, as one already waiting is (regression: the roll-out halted there,
        "did not become ready", with every other worker of the group not rolled). So too one
        an operator stopped (or drained) while the roll-out replaced it: it stays stopped."""
        self.log.info(
            "supervisor.rollout_passed_over", group=group, worker=runner.name, reason=reason
        )

    def _rollout_halted(self, group: str, runner: WorkerRunner, why: str) -> None:
        """Log a roll-out of ``group`` halted at ``runner``; the journal's ``rollout.halted``
        names it too."""
        self.log.error(
            "supervisor.rollout_halted",
            group=group,
            worker=runner.name,
            state=runner.state.value,
            reason=why,
        )
        self._halted_at[group] = {
            "worker": runner.name,
            "state": runner.state.value,
            "reason": f"{why} (worker {runner.state.value}: {runner.record.reason})",
        }

    def _journal_rollout(self, group: str, kind: str, done: bool, **fields: Any) -> None:
        """``rollout.done`` or ``rollout.halted`` in the journal (``/api/v1/events``): what
        ``restart --rolling --wait`` and deploy scripts wait for. A halted one says where and
        why (``worker``, ``state``, ``reason``)."""
        request = fields.pop("request", None)
        where = {**self._halted_at.pop(group, {}), **fields}
        worker = where.pop("worker", None)
        self.journal.append(
            self.clock.wall(),
            "rollout.done" if done else "rollout.halted",
            None if done else worker,
            group=group,
            kind=kind,
            **({} if request is None else {"request": request}),
            **({} if done else where),
        )

    async def _roll_restart(self, group: str, unplaced: frozenset[str] | None = None) -> bool:
        """Restart ``group`` one worker at a time; True when every worker was restarted.
        ``unplaced``: only those workers, and only while they still run unplaced (a placement
        roll-out, said by :meth:`_place_unplaced`; one restarted meanwhile was placed then)."""
        if unplaced is None:
            self.log.info("supervisor.rolling_restart", group=group, reason="operator")
            self.journal.append(self.clock.wall(), "operator.rolling_restart", None, target=group)
        key = ("rolling_restart", "operator" if unplaced is None else "placement")
        self.actions_total[key] = self.actions_total.get(key, 0) + 1
        replaced: list[WorkerRunner] = []
        superseded = functools.partial(self._superseded, group)
        for name in sorted(self.groups.get(group, []), key=self._serving):
            if superseded():
                return self._roll_superseded(group)
            runner = self.runners.get(name)
            if runner is None or runner.state in (WorkerState.STOPPED, WorkerState.FATAL):
                continue
            if passed_over(runner):
                continue
            if unplaced is not None and (name not in unplaced or not _runs_unplaced(runner)):
                continue
            if not await self._others_back(group, runner):
                return False
            # looked at again after that wait: placed by a restart of its own, or stopped by
            # an operator, meanwhile (regression: restarted all the same)
            if (
                runner.state in (WorkerState.STOPPED, WorkerState.FATAL)
                or passed_over(runner)
                or (unplaced is not None and not _runs_unplaced(runner))
            ):
                continue
            if unplaced is not None and not self._has_room(runner):
                continue  # left serving where it runs (said)
            attempts = runner.spawn_attempts
            going_down = _going_down(runner)
            runner.post(lc.Restart())
            settled = await self._wait_started(
                functools.partial(self._in_line, (runner.name,)),
                _settled_after(runner, attempts, unless=superseded),
                self._stop_budget(runner) + runner.timing.start_timeout_s,
                functools.partial(tuple, (runner,)),
            )
            if settled and self._moved_off(runner, runner.spec.gpus or ()):
                await self._back_after_move(group, runner)
                going_down = True  # what it comes back as is not the roll-out's doing
            elif settled and self._xid_maybe_not_own(runner):
                await self._back_after_move(group, runner)  # as in _roll_each: once
            if self._shutting_down:
                return False
            if superseded():  # it goes on loading; the reload's roll-out waits for it first
                return self._roll_superseded(group)
            if settled and runner.record.state is WorkerState.STOPPED:
                self._rollout_passes_over(group, runner, _STOPPED_MEANWHILE)
                continue
            if settled and going_down and runner.record.waiting_for_gpu:
                self._rollout_passes_over(group, runner)
                continue
            if not settled or runner.state is not WorkerState.READY:
                self._rollout_halted(
                    group,
                    runner,
                    "restarted worker did not become ready; the rest keep running",
                )
                return False
            replaced.append(runner)
            if not await self._rollout_holds(
                group, replaced, runner.timing.restart.stable_s, "the rest keep running"
            ):
                return False
        self.log.info(
            "supervisor.rolling_restart_done",
            group=group,
            **({} if unplaced is None else {"kind": "placement"}),
        )
        return True

    async def _proven(self, group: str, runner: WorkerRunner, stable_s: float) -> bool:
        """``runner``, ready, has been ready for ``stable_s`` (waited for what is left of it);
        False (halted, logged) when it stops being ready first."""
        ready_at = runner.record.ready_at
        left = stable_s if ready_at is None else stable_s - (self.clock.now() - ready_at)
        if left <= 0:
            return True
        return await self._rollout_holds(
            group, [runner], left, "the rest keep the old config", stable_s=stable_s
        )

    async def _rollout_holds(
        self,
        group: str,
        replaced: list[WorkerRunner],
        wait_s: float,
        rest: str,
        stable_s: float | None = None,
    ) -> bool:
        """A roll-out goes on only once the worker it just replaced has been ready for
        ``stable_s`` (a worker that exits sooner is a failed start: a version that crashes
        just after its READY=1 must not be rolled onto the whole group), and while every
        worker it replaced before is still ready. False (halted, logged) if one is not."""

        def broken() -> WorkerRunner | None:
            for r in list(replaced):
                if r.state is WorkerState.READY:
                    continue
                if _stopped_for_good(r) and not self._shutting_down:
                    # an operator's stop or drain: it stays stopped, no fault of the new
                    # process; passed over (regression: halted, "did not stay ready")
                    replaced.remove(r)
                    self._rollout_passes_over(group, r, _STOPPED_MEANWHILE)
                    continue
                return r
            return None

        on = {r.name: frozenset(r.spec.gpus or ()) for r in replaced}
        proved_again: set[str] = set()  # after a worker-fatal XID that may be another's
        if wait_s > 0:
            await self.wait_until(lambda: broken() is not None or self._superseded(group), wait_s)
        failed = broken()
        # one that healing moves off its GPU (failed, lost, hot) is not the definition's
        # fault: waited for on its new GPU and proven there, or passed over if none has room
        # (regression: the roll-out halted, blaming the definition for its GPU)
        # nor is an operator's restart of it: waited for and proven the same way
        # (regression: the roll-out halted, blaming the definition for the restart)
        # nor, once, a restart for a worker-fatal XID on a GPU it shared: NVML does not say
        # whose it was (regression: the roll-out halted, blaming the definition for another
        # process's XID); a second one, or one on a GPU it had alone, is the definition's
        while (
            failed is not None
            and not self._shutting_down
            and (
                self._moved_off(failed, on.get(failed.name, frozenset()))
                or _restarted_by_operator(failed)
                or (failed.name not in proved_again and self._xid_maybe_not_own(failed))
            )
        ):
            if self._xid_maybe_not_own(failed):
                proved_again.add(failed.name)
            if not await self._back_after_move(group, failed):
                if self._superseded(group):  # a later reload takes over while it loads: no
                    return self._roll_superseded(group)  # halt (regression: "did not stay")
                break
            on[failed.name] = frozenset(failed.spec.gpus or ())
            if failed.record.waiting_for_gpu:
                replaced.remove(failed)
                self._rollout_passes_over(group, failed)
            else:
                stable = wait_s if stable_s is None else stable_s
                await self.wait_until(
                    lambda: broken() is not None or self._superseded(group), stable
                )
            failed = broken()
        if failed is None and self._superseded(group):
            return self._roll_superseded(group)
        if failed is None or self._shutting_down:
            return failed is None
        stable = wait_s if stable_s is None else stable_s
        self._rollout_halted(
            group,
            failed,
            f"replaced worker did not stay ready for stable_s ({stable:g} s); {rest}",
        )
        return False

    def _moved_off(self, runner: WorkerRunner, gpus: Collection[str]) -> bool:
        """``runner``, on ``gpus`` a moment ago, is down because healing moves it off
        one of them that failed (quarantined, lost) or is hot."""
        if _down_for(runner) not in lc.GPU_FAULTS:
            return False
        bad = set(self._failed_gpus())
        return bool((bad | self.healer.hot_gpus()) & set(gpus))

    def _xid_maybe_not_own(self, runner: WorkerRunner) -> bool:
        """``runner`` is down for a worker-fatal XID on a GPU other workers shared."""
        return _down_for(runner) == ExitReason.XID and runner.name in self.healer.xid_maybe_not_own

    async def _back_after_move(self, group: str, runner: WorkerRunner) -> bool:
        """Wait for ``runner``, moved off its GPU by healing, to be ready on another one (or
        to wait for one); False when it is not in time or failed to start there."""
        attempts = runner.spawn_attempts
        started = runner.state is WorkerState.STARTING and runner.record.pid is not None

        def settled() -> bool:
            rec = runner.record
            return (
                rec.state in (WorkerState.READY, WorkerState.FATAL, WorkerState.STOPPED)
                or rec.waiting_for_gpu
                # a start there that failed, its backoff over before it was seen (none)
                or runner.failed_attempt >= attempts + (0 if started else 1)
                or (
                    rec.state is WorkerState.BACKOFF
                    and (started or runner.spawn_attempts > attempts)
                )
            )

        t = runner.timing
        budget = (
            self._stop_budget(runner)
            + t.restart.backoff_max_s  # its stop may count as a failed start
            + self.settings.gpu.release_timeout_s
            + t.start_timeout_s
        )
        await self._wait_started(
            functools.partial(self._in_line, (runner.name,)),
            lambda: settled() or self._shutting_down or self._superseded(group),
            budget,
            lambda: (runner,),
        )
        return runner.state is WorkerState.READY or runner.record.waiting_for_gpu

    async def _shutdown(self, signal_name: str) -> None:
        self._notify("STOPPING=1")
        runners = self.workers()
        self.log.info(
            "supervisor.stopping", reason="shutdown", signal=signal_name, workers=len(runners)
        )
        for runner in runners:
            if runner.state is not WorkerState.FATAL:  # nothing runs; the last state says fatal
                runner.post(lc.Stop(ExitReason.SHUTDOWN))
        timeout = self.settings.supervisor.shutdown_timeout_s
        if not await self.wait_until(lambda: all(is_idle(r) for r in self.workers()), timeout):
            self.log.warning("supervisor.shutdown_timeout", reason="shutdown_timeout_s passed")
            for runner in self.workers():
                runner.post(lc.Kill("shutdown timeout"))
            await self.wait_until(lambda: all(is_idle(r) for r in self.workers()), KILL_WAIT_S)
        await self._kill_leftover_children()
        await self._remove_cgroups()
        # a stop during start-up: the reclaim's verdicts go into the last state.json too (the
        # reclaim ends its orphans within its own TERM and KILL waits)
        with anyio.move_on_after(RECLAIM_WAIT_S):
            await self._reclaim_done.wait()
        self.stopped = True
        with anyio.move_on_after(KILL_WAIT_S):
            await self.recorder.flush()
        self.recorder.report_unwritten()
        self._save_quarantine(again=True)  # a last try
        if self._quarantine_unsaved is not None and not (
            self._quarantine_stale_only and self._quarantine_unsaved == ({}, {})
        ):  # regression: lost without a word (but an earlier boot's file: dropped anyway)
            self.log.error(
                "records.quarantine_unsaved",
                path=os.fspath(self.settings.supervisor.state_dir / QUARANTINE_FILE),
                gpus=dict(self.healer.state.quarantined),
                reason="state_dir did not take the quarantines as they are now: the next "
                "supervisor of this boot goes by what the file held before (cordon these GPUs, "
                "or lift a quarantine, by hand then)",
            )
        with anyio.move_on_after(KILL_WAIT_S):
            await self.http_probes.aclose()
        self._done.set()

    async def _remove_cgroups(self) -> None:
        """Remove the workers' cgroups once their killed processes are gone (bounded wait)."""
        names = [r.name for r in self.workers()]
        await self._cgroups_empty(names, KILL_WAIT_S)  # processes killed a moment ago
        for name in names:
            self.cgroups.remove(name)
        left = self.cgroups.sweep()
        if left:
            self.log.warning("cgroup.not_removed", workers=left, reason="still populated")

    async def _kill_leftover_children(self) -> None:
        """Adopted orphans (as PID 1 or child subreaper) must not outlive the supervisor, nor
        what they forked: killed, their children are re-parented to us, and killed in turn.
        Regression: those were never killed, the stop waited ``KILL_WAIT_S`` for them (and
        as a child subreaper they outlived it)."""
        killed: dict[int, None] = {}  # (in the order killed)
        with anyio.move_on_after(KILL_WAIT_S):
            while True:
                self.reaper.reap_now()
                children = _children()
                if not children:
                    break
                for proc in children:
                    if proc.pid not in killed:
                        with contextlib.suppress(psutil.Error):
                            proc.kill()
                        killed[proc.pid] = None
                await anyio.sleep(0.01)
        if killed:
            self.log.info("supervisor.killed_leftovers", pids=list(killed))

    async def _serve_systemd(self) -> None:
        """``WATCHDOG=1`` every half of the manager's timeout; and what the manager must get
        (READY, RELOADING, STOPPING) that found its queue full, again until it takes it."""
        if not self.systemd.enabled:
            return
        interval = self.systemd.watchdog_interval_s
        next_ping = anyio.current_time()
        retry = NOTIFY_RETRY_MIN_S
        while True:
            now = anyio.current_time()
            wait = math.inf
            if interval is not None:
                if now >= next_ping:
                    self.systemd.send("WATCHDOG=1")
                    next_ping = now + interval
                wait = next_ping - now
            if self.systemd.pending and not self.systemd.flush():
                wait = min(wait, retry)
                retry = min(retry * 2, NOTIFY_RETRY_MAX_S)
            else:
                retry = NOTIFY_RETRY_MIN_S
            with anyio.move_on_after(wait):
                await self._notify_kept.wait()
            self._notify_kept = anyio.Event()

    def _reload_over(self) -> None:
        """The reload is over for the service manager (its file accepted, the roll-outs going
        on, or rejected): ``READY=1`` again, but only where start-up had sent it (a reload
        during start-up must not say ready before the workers are)."""
        if self._ready_sent and not self._shutting_down:  # never READY=1 after STOPPING=1
            self._notify(f"READY=1\nSTATUS={self.status_line()}")

    def _notify(self, message: str) -> None:
        """Send ``message`` to the service manager, again later if its queue is full."""
        if not self.systemd.send(message, keep=True) and self.systemd.pending:
            self._notify_kept.set()

    async def _reload_loop(self) -> None:
        try:
            # a reload asked for during start-up runs once every group has its workers
            # (regression: it made runners the start-up then replaced: untracked processes)
            await self.wait_until(lambda: self._all_added or self._shutting_down, math.inf)
            if self._shutting_down:
                return
            while True:
                vetted, self._vetted_data = self._vetted_data, None
                data: dict[str, Any] | None = None
                if vetted is not None and vetted[0] > self._covered:
                    # the file that superseded the roll-out, as it was checked; requests made
                    # after it are read by the next round
                    covered, data = vetted
                    later = self.reload_requests > covered
                else:
                    covered, later = self.reload_requests, False
                self._covered = covered
                # requests made after that file are still to come: one whose check (maybe
                # under way) finds a file it would take supersedes this roll-out too
                self._reload_again = later
                ok = await self._reload(covered, data)
                if ok is not None:  # a superseded one: the next says how it went
                    self.last_reload = (ok, self.clock.wall() if ok else self.last_reload[1])
                # again only for a request made after this reload read the file
                if not self._reload_again or self._shutting_down:
                    return
                if self.reload_requests == covered:
                    return
        finally:
            self._reloading = False

    async def _vet_reload(self, request: int) -> None:
        """A reload asked for while one runs: read its file now and, if the reload would take
        it (it parses and validates, it can be placed, its programs can be executed), let it
        supersede the roll-out in progress. A file that would be rejected supersedes nothing:
        the roll-out goes on, and the reload after it rejects the file, "nothing changed"
        (regression: a typo stopped a good roll-out half-way, for good)."""
        if self.config_path is None:
            return
        why, new, data = await self._would_reject()
        if why is not None:
            self.log.warning(
                "supervisor.reload_queued",
                request=request,
                supersedes=False,
                reason="its file would be rejected: the roll-out in progress goes on",
                error=why,
            )
            return
        target = diff_groups(self.settings.workers, new.workers if new else ())
        if new is not None and not (target.changed or target.added or target.removed):
            # the file being rolled out (a second SIGHUP, config management re-applying it):
            # superseding would only stop and resume the roll-out, and fail its --wait
            self.log.info(
                "supervisor.reload_queued",
                request=request,
                supersedes=False,
                reason="its groups are those being rolled out",
            )
            return
        self.log.info("supervisor.reload_queued", request=request, supersedes=True)
        if request > self._vetted:
            self._vetted = request
            self._vetted_data = (request, data)
            self._changed_now()  # a roll-out waiting on a worker stops for it

    def _ports_in_use(self) -> tuple[dict[str, range], dict[str, list[range]]]:
        """The port range of each group in force (groups with automatic ports keep theirs on a
        reload where they still fit) and the ports workers hold outside it (a roll-out that
        halted or was superseded part-way moved them): neither is given to another group."""
        running = {
            g.name: range(g.port_base, g.port_base + g.replicas)
            for g in self.settings.workers
            if g.port_base is not None
        }
        held: dict[str, list[range]] = {}
        for r in self.runners.values():
            ours = running.get(r.spec.group, range(0))
            for port in sorted(r.ports()):
                if port not in ours:
                    held.setdefault(r.spec.group, []).append(range(port, port + 1))
        return running, held

    async def _would_reject(
        self,
    ) -> tuple[str | None, Settings | None, dict[str, Any]]:
        """Why a reload would reject the config file as it is now (None: it would take it),
        the settings it holds (None where it cannot be read) and its TOML as read."""
        assert self.config_path is not None
        path = self.config_path
        try:
            data = await in_thread(read_config, path)
            new = await in_thread(
                functools.partial(
                    load_settings, path, *self._ports_in_use(), data=data, refuse_empty=True
                )
            )
        except (ThreadUnavailable, ConfigError) as exc:
            return str(exc), None, {}
        diff = diff_groups(self.settings.workers, new.workers, self._halted, self._halted_defs)
        try:
            plan = self._reload_plan(applied_by_reload(self.settings, new), diff)
        except Exception as exc:  # placement (or a bug): the reload says it again
            return str(exc), new, data
        return "; ".join(_unrunnable_in(plan, diff)) or None, new, data

    def _reload_plan(self, settings: Settings, diff: ReloadDiff) -> Plan:
        """A reload's plan: workers of groups whose placement settings did not change stay on
        their GPUs; only the added ones are placed."""
        return self._build_plan(
            settings, keep=(*diff.unchanged, *diff.scaled, *diff.same_placement)
        )

    def _onto_broken(self, plan: Plan, diff: ReloadDiff) -> list[str]:
        """One line per worker of a changed or added group that ``plan`` puts on a GPU that
        failed (quarantined, unhealthy) where it does not run now (an explicit GPU list)."""
        broken = {u: f"GPU {s.index} {s.why_not}" for u, s in self._failed_gpus().items()}
        touched = {*diff.changed, *diff.added}
        out = []
        for g in plan.groups:
            if g.group.name not in touched:
                continue
            for spec in g.workers:
                runner = self.runners.get(spec.name)
                if runner is not None and runner.spec.gpus == spec.gpus:
                    continue  # where it is (waiting for the GPU already, say)
                bad = [broken[u] for u in spec.gpus or () if u in broken]
                if bad:
                    out.append(f"cannot place {spec.name}: {'; '.join(bad)}")
        return out

    def _journal_reload(self, request: int, done: bool, **fields: Any) -> None:
        """``reload.done`` (the end of its roll-outs: ``halted`` lists groups whose roll-out
        halted) or ``reload.rejected`` (nothing changed: ``reason``, ``error``) in the journal,
        after ``reload.accepted`` (the new file is in force, its roll-outs begin): what
        ``gpu-supervisor reload`` waits for. ``request``: the last reload request this reload
        covers (it read the file after that request was made)."""
        kind = "reload.done" if done else "reload.rejected"
        self.journal.append(self.clock.wall(), kind, None, request=request, **fields)

    async def _reload(self, request: int = 0, data: dict[str, Any] | None = None) -> bool | None:
        """Apply the config file again; True when all of it is in force (not rejected, no
        roll-out halted), None when a later reload superseded a roll-out (and none halted).
        ``request``: the last reload request this covers (the journal); ``data``: the file's
        TOML as checked for it (None: read the file now)."""
        if self.config_path is None:
            self.log.error("supervisor.reload_failed", reason="no config file to reload")
            self._journal_reload(request, False, reason="no config file", error="")
            return False
        path = self.config_path
        try:
            # groups with automatic ports keep theirs where they still fit
            ports = self._ports_in_use()
            new = await in_thread(
                functools.partial(load_settings, path, *ports, data=data, refuse_empty=True)
            )
        except ThreadUnavailable as exc:
            self.log.error("supervisor.reload_rejected", reason="no thread", error=str(exc))  # noqa: TRY400
            self._journal_reload(request, False, reason="no thread", error=str(exc))
            return False
        except ConfigError as exc:
            self.log.error(  # noqa: TRY400 - a bad config is reported in one line, no traceback
                "supervisor.reload_rejected", reason="bad config", error=str(exc)
            )
            self._journal_reload(request, False, reason="bad config", error=str(exc))
            return False
        if self._shutting_down:
            # a stop came while the file was read (a slow disk): nothing is applied, and the
            # service manager hears no RELOADING=1 or READY=1 after STOPPING=1 (regression)
            error = "the supervisor is stopping"
            self.log.warning("supervisor.reload_rejected", reason="stopping", error=error)
            self._journal_reload(request, False, reason="stopping", error=error)
            return False
        # MONOTONIC_USEC: what Type=notify-reload (systemd 253) needs to match it to its signal
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")
        old = self.settings
        diff = diff_groups(old.workers, new.workers, self._halted, self._halted_defs)
        self.log.info(
            "supervisor.reload",
            unchanged=list(diff.unchanged),
            changed=list(diff.changed),
            scaled=list(diff.scaled),
            same_placement=list(diff.same_placement),
            removed=list(diff.removed),
            added=list(diff.added),
        )
        kept = start_only_changes(old, new)
        if kept:
            self.log.warning(
                "supervisor.reload_partial",
                reason="these keys are read at start only: restart to apply them",
                keys=list(kept),
            )
        self.settings = applied_by_reload(old, new)
        try:
            plan = self._reload_plan(self.settings, diff)
        except PlacementError as exc:
            self.settings = old
            self.log.error(  # noqa: TRY400 - one line, no traceback
                "supervisor.reload_rejected", reason="placement", error=str(exc)
            )
            self._journal_reload(request, False, reason="placement", error=str(exc))
            self._reload_over()
            return False
        except Exception as exc:  # a bug must not take the running workers down with us
            self.settings = old
            self.log.exception("supervisor.reload_rejected", reason="internal error")
            self._journal_reload(request, False, reason="internal error", error=repr(exc))
            self._reload_over()
            return False
        # The supervisor runs where the workers do: a program a changed or added group cannot
        # execute here is a mistake in the file, not something to roll onto running workers
        # (which would halt with a worker in backoff, "spawn_failed").
        missing = _unrunnable_in(plan, diff)
        if missing:
            self.settings = old
            error = "; ".join(missing)
            self.log.error("supervisor.reload_rejected", reason="command", error=error)
            self._journal_reload(request, False, reason="command", error=error)
            self._reload_over()
            return False
        # nor is a GPU that failed (quarantined, lost): an explicit list naming one took the
        # workers down to wait for it (automatic placement is rejected above)
        broken = self._onto_broken(plan, diff)
        if broken:
            self.settings = old
            error = "; ".join(broken)
            self.log.error("supervisor.reload_rejected", reason="placement", error=error)
            self._journal_reload(request, False, reason="placement", error=error)
            self._reload_over()
            return False
        touched = {*diff.changed, *diff.added}
        for warning in plan.warnings:  # as at start, for the groups this reload rolls out
            if any(warning.startswith(f"group {name}:") for name in touched):
                self.log.warning("plan.warning", message=warning)
        self.journal.append(
            self.clock.wall(),
            "reload.accepted",
            None,
            request=request,
            changed=list(diff.changed),
            scaled=list(diff.scaled),
            added=list(diff.added),
            removed=list(diff.removed),
            start_only_keys=list(kept),
        )
        self._open_shared_for(w for g in plan.groups for w in g.workers)
        self._warn_unreadable_reporters(plan, [*diff.changed, *diff.added])
        self._changed_now()  # workers waiting their turn (max_starting may have changed)
        # READY=1 now: the file is in force. Held until the roll-outs end (minutes: a model
        # load and stable_s a worker), systemd showed the unit "reloading" all along, held a
        # second `systemctl reload` back until then, and timed a long roll-out out.
        self._reload_over()
        self._set_host_interval()
        await self._reload_alerts()
        if any(g.health.host_memory_limit_mb > 0 for g in self.settings.workers):
            support = with_memory(self.cgroups.support)
            if support is not self.cgroups.support:  # the first budget: probed now
                self.cgroups.support = support
                self.log.info("cgroup.mode", mode=support.mode, reason=support.why or "reload")
        for name in diff.unchanged:  # a reload clears fatal (first: removals, roll-outs take long)
            for runner in self._targets(name):
                if runner.state is WorkerState.FATAL and not self._shutting_down:
                    runner.post(lc.Start())
        async with anyio.create_task_group() as tg:  # together, as a group's workers
            for name in diff.removed:
                tg.start_soon(self._stop_group, name)
        for name in diff.added:
            group = self.settings.group(name)
            assert group is not None
            await self._add_group(group, plan)
        # the old definition of each group not rolled out, and the groups left part-way or
        # not begun for a later reload; read in config order once every roll-out ended
        not_rolled: dict[str, WorkerGroup] = {}
        left: set[str] = set()
        resumed = self._halted.intersection(diff.changed)
        self._halted.difference_update(diff.removed)
        for name in diff.removed:
            self._halted_defs.pop(name, None)
        if diff.changed and self._shutting_down:
            self._journal_reload(request, True, halted=[], interrupted="stopping")
            return False
        if self._reload_again and self._vetted > self._covered:
            # not begun: the later reload compares its files with what runs (the old
            # definitions), as if this one had never changed the groups
            for name in diff.changed:
                before = old.group(name)
                assert before is not None
                not_rolled[name] = before
                left.add(name)
        else:
            await self._hand_ports_on(diff.changed, plan)
            # each group rolls out on its own, all at once, each one worker at a time (as
            # several Deployments do): 4 changed groups of 16 workers took minutes one group
            # after another, the last waiting for all the others; but for a group whose new
            # ports another changed group's workers move off: it waits for that roll-out
            after = self._port_order(diff.changed, plan)
            ended = {name: anyio.Event() for name in diff.changed}
            async with anyio.create_task_group() as tg:
                for name in diff.changed:
                    tg.start_soon(
                        self._reload_group,
                        name,
                        old,
                        plan,
                        diff,
                        resumed,
                        not_rolled,
                        left,
                        {n: ended[n] for n in after.get(name, ())},
                        ended[name],
                    )
        halted = [not_rolled[n] for n in diff.changed if n in not_rolled]
        superseded = [n for n in diff.changed if n in left]
        if halted:
            # Keep the old definition of a halted group, so the next reload tries it again
            # (with either file: the group stays dirty until a rollout of it completes).
            by_name = {g.name: g for g in halted}
            self.settings = self.settings.model_copy(
                update={"workers": tuple(by_name.get(g.name, g) for g in self.settings.workers)}
            )
        self._changed_now()
        if not self._shutting_down:  # the removed workers are forgotten now
            await self._retain_logs()
        # the end of the reload's roll-outs (supervisor.reload said what it would do)
        # (a roll-out the stop cut short did not halt: none is said, as in the journal)
        stopped = [g.name for g in halted if g.name not in superseded]
        if self._shutting_down:
            stopped = []
        self.log.info("supervisor.reload_done", halted=stopped, superseded=superseded)
        if self._shutting_down:  # a roll-out cut short by the stop did not halt
            self._journal_reload(request, True, halted=[], interrupted="stopping")
        else:
            self._journal_reload(request, True, halted=stopped, superseded=superseded)
        if superseded and not stopped:
            return None
        return not halted

    async def _hand_ports_on(self, changed: Sequence[str], plan: Plan) -> None:
        """Remove first the workers this reload drops (past their group's new ``replicas``)
        whose port another changed group's new workers take. A group's roll-out removes its
        dropped workers at its end; the groups roll out at the same time, so the other
        group's start would wait for the port only the holder's drain and stop timeouts,
        then start beside the server still on it (regression: a bind refused, or the old
        server answering the new worker's readiness probe)."""
        claimed = _claimed_ports(changed, plan)
        handed: list[WorkerRunner] = []
        for name in changed:
            group = self.settings.group(name)
            for runner in self._targets(name):
                # one without a process (in backoff, waiting for a GPU) starts on its port
                # again when its wait ends (regression: in the middle of the roll-outs)
                port = runner.held_port() or runner.spec.port
                if (
                    group is not None
                    and runner.spec.index >= group.replicas
                    and port in claimed
                    and claimed[port] != name
                ):
                    handed.append(runner)
        if handed:
            async with anyio.create_task_group() as tg:
                for runner in handed:
                    tg.start_soon(self._remove_runner, runner, ExitReason.RELOAD)

    def _port_order(self, changed: Sequence[str], plan: Plan) -> dict[str, list[str]]:
        """Changed group -> the other changed groups whose roll-out it waits for: one of their
        workers that stays (its port moved) still holds a port this group's new workers
        take, and leaves it only when its own roll-out reaches it. Regression: rolled out at
        the same time, the new worker started beside the server still on its port (a bind
        refused, or the old server answering its readiness probe), and the roll-out halted
        (one after another, in config order, the port was left first). Never both ways (a
        swap of ports waits for neither, as before)."""
        claimed = _claimed_ports(changed, plan)
        holders: dict[str, set[str]] = {}  # taker -> the groups whose kept workers hold
        for name in changed:
            group = self.settings.group(name)
            for runner in self._targets(name):
                taker = claimed.get(runner.held_port() or -1)
                if (
                    group is None
                    or runner.spec.index >= group.replicas  # removed first: _hand_ports_on
                    or taker is None
                    or taker == name
                ):
                    continue
                holders.setdefault(taker, set()).add(name)
        return port_waits(holders, changed)

    async def _reload_group(
        self,
        name: str,
        old: Settings,
        plan: Plan,
        diff: ReloadDiff,
        resumed: set[str],
        not_rolled: dict[str, WorkerGroup],
        left: set[str],
        first: Mapping[str, anyio.Event],
        ended: anyio.Event,
    ) -> None:
        """One changed group's roll-out of a reload (the reload's others run at the same
        time, but for those in ``first``: it begins once they have ended); its
        ``rollout.done`` / ``rollout.halted`` is journaled as it ends, and ``ended`` set. A
        group not rolled out is put in ``not_rolled`` (its old definition), and in ``left``
        too where a later reload superseded it."""
        try:
            if first:
                self.log.info(
                    "supervisor.rollout_waits",
                    group=name,
                    reason=f"the roll-out of {', '.join(first)} moves workers off ports "
                    "this group's new workers take",
                )
                for event in first.values():
                    await event.wait()
            group = self.settings.group(name)
            assert group is not None
            before = old.group(name)
            assert before is not None
            # memory.max is written at a spawn: a new host budget needs new processes, where
            # memory.max is used (rss_watch: the budget is judged on the running processes)
            in_place = (
                before.health.host_memory_limit_mb == group.health.host_memory_limit_mb
                or not self.cgroups.support.memory
            )
            held = self._ports_left_held(name, plan, first)
            if held and not self._reload_superseded():
                self._halt_on_held_ports(name, plan, held, first)
                rolled = False
            else:
                rolled = await self._roll_group(
                    group,
                    plan,
                    resume=name in resumed,
                    scaled=name in diff.scaled,
                    in_place=in_place,
                )
            if not rolled and self._halted_at.get(name, {}).get("superseded"):
                left.add(name)
            if not self._shutting_down:
                self._journal_rollout(name, "reload", rolled)
            if rolled:
                self._halted.discard(name)
                self._halted_defs.pop(name, None)
            else:
                not_rolled[name] = before
                # dirty: the next reload rolls it out even where its file is this one's
                self._halted.add(name)
                # and the workers this one reached run this definition (its placement), which
                # the next reload cannot tell from the files
                self._halted_defs.setdefault(name, []).append(group)
        finally:
            ended.set()

    def _ports_left_held(
        self, name: str, plan: Plan, others: Collection[str]
    ) -> list[tuple[int, WorkerRunner]]:
        """Ports ``name``'s new workers take that a worker of ``others`` (changed groups whose
        roll-out ``name`` waited for) still holds, or starts on next: that roll-out halted
        before it moved the worker off (each such port with its holder)."""
        specs = next(g for g in plan.groups if g.group.name == name).workers
        taken = {s.port for s in specs if s.port is not None}
        held = []
        for other in others:
            for runner in self._targets(other):
                port = runner.held_port() or runner.spec.port
                if port in taken:
                    held.append((port, runner))
        return sorted(held, key=lambda item: item[0])

    def _halt_on_held_ports(
        self,
        name: str,
        plan: Plan,
        held: Sequence[tuple[int, WorkerRunner]],
        others: Collection[str],
    ) -> None:
        """Halt ``name``'s roll-out before it begins: its new workers would start beside the
        servers still on their ports (a bind refused, or the old server answering the new
        worker's readiness probe). Regression: they did, and the good definition of ``name``
        halted, blamed for it, with its replaced worker crash-looping."""
        ports = ", ".join(f"{port} ({runner.name})" for port, runner in held)
        why = (
            f"the roll-out of {', '.join(others)} halted with its workers still on ports this "
            f"group's new workers take: {ports}; not starting beside them"
        )
        specs = next(g for g in plan.groups if g.group.name == name).workers
        on_port = next((self.runners.get(s.name) for s in specs if s.port == held[0][0]), None)
        mine = on_port or next(iter(self._targets(name)), None)
        if mine is not None:
            self._rollout_halted(name, mine, why)
        else:
            self.log.error("supervisor.rollout_halted", group=name, reason=why)
            self._halted_at[name] = {"reason": why}

    async def _stop_group(self, name: str) -> None:
        runners = self._targets(name)
        # an operator's rolling restart of it stops before its next worker (and does not wait
        # out the start timeout of one this removes)
        with self._superseding(name):
            async with anyio.create_task_group() as tg:
                for runner in runners:
                    tg.start_soon(self._remove_runner, runner, ExitReason.RELOAD)
        self.groups.pop(name, None)

    @contextlib.contextmanager
    def _superseding(self, group: str, supersede: bool = True) -> Iterator[None]:
        """While this runs, an operator's rolling restart of ``group`` is superseded (it stops
        before its next worker: :meth:`_superseded`); ``supersede`` False: it is not."""
        if supersede:
            self._roll_waiting.add(group)
            self._changed_now()
        try:
            yield
        finally:
            self._roll_waiting.discard(group)

    async def _roll_group(
        self,
        group: WorkerGroup,
        plan: Plan,
        *,
        resume: bool = False,
        scaled: bool = False,
        in_place: bool = False,
    ) -> bool:
        """Restart a changed group one worker at a time, each waiting for readiness.

        ``resume``: the group's last rollout halted part-way; a worker that already runs, ready,
        exactly what this one rolls out is left alone (rolling back restarts only those the
        halted rollout reached). ``scaled``: only ``replicas`` changed; a worker planned as
        before is left alone in whatever state it is (loading, in backoff): only the workers
        added are started and those removed stopped.

        A rolling restart of the group that is running is waited for (two roll-outs at once
        took the whole group down), and one asked for meanwhile is refused (409)."""
        if group.name in self.rolling:
            self.log.info(
                "supervisor.rollout_waits",
                group=group.name,
                reason=f"a {self.rolling[group.name]} of the group is running",
            )
            # an operator's rolling restart stops before its next worker (its workers are all
            # restarted on the new definition); one that a scale or a new threshold left
            # running as they are is waited out
            specs = next(g for g in plan.groups if g.group.name == group.name).workers
            replaces = not scaled and any(
                not in_place or not r.launches(spec)
                for spec in specs
                if (r := self.runners.get(spec.name)) is not None
            )
            with self._superseding(group.name, replaces):
                # a later reload asked for meanwhile takes the group over: waited for here,
                # it could not cut the rolling restart short if it restarts the group
                await self.wait_until(
                    lambda: group.name not in self.rolling or self._reload_superseded(),
                    math.inf,
                )
            if group.name in self.rolling and not self._shutting_down:
                # not begun: the later reload compares its file with what runs
                return self._roll_superseded(group.name, "reload")
        if self._shutting_down:
            return False
        self.rolling[group.name] = "reload"
        try:
            return await self._roll_group_now(
                group, plan, resume=resume, scaled=scaled, in_place=in_place
            )
        finally:
            self.rolling.pop(group.name, None)

    async def _roll_group_now(
        self, group: WorkerGroup, plan: Plan, *, resume: bool, scaled: bool, in_place: bool
    ) -> bool:
        """``_roll_group``'s work. Workers set to the new definition in place (nothing new to
        launch) go back to the old one if the roll-out halts: "the rest keep the old config"
        (regression: they kept the new timing while the supervisor said the old one ran)."""
        kept: list[tuple[WorkerRunner, LaunchSpec, lc.Timing, bool]] = []
        defs = {n: d for n, d in self._defs.items() if d.name == group.name}
        rolled = await self._roll_each(group, plan, resume, scaled, in_place, kept)
        if not rolled:
            for runner, spec, timing, passthrough in kept:
                runner.reconfigure(spec, timing, passthrough)
                if runner.name in defs:
                    self._defs[runner.name] = defs[runner.name]
                if runner.state in (WorkerState.STARTING, WorkerState.BACKOFF):
                    runner.post(lc.Retime())
        return rolled

    async def _roll_each(
        self,
        group: WorkerGroup,
        plan: Plan,
        resume: bool,
        scaled: bool,
        in_place: bool,
        kept: list[tuple[WorkerRunner, LaunchSpec, lc.Timing, bool]],
    ) -> bool:
        old_names = list(self.groups.get(group.name, []))
        timing = lc.timing_for(group)
        specs = next(g for g in plan.groups if g.group.name == group.name).workers
        new_names = [s.name for s in specs]

        def same(runner: WorkerRunner, spec: LaunchSpec) -> bool:
            """Nothing new to launch for it: replicas changed only, only what the supervisor
            uses changed, or (a halted roll-out reached it) it runs this definition. Never
            one whose process runs under another budget's memory.max (regression: reloading
            the old file after a halted budget change left the new memory.max in force)."""
            limit = group.health.host_memory_limit_mb
            if runner.record.pid is not None and self.cgroups.budget_differs(runner.name, limit):
                return False
            return (
                (scaled and runner.planned(spec, timing))
                or (in_place and runner.launches(spec))
                or (resume and runner.runs(spec, timing))
            )

        if resume:
            # a halted roll-out's workers on this definition are proven (ready for stable_s)
            # before any worker still on the old one goes (regression: one ready a moment was
            # taken for proven, and the last worker on the old version went next)
            for spec in specs:
                r = self.runners.get(spec.name)
                if (
                    r is not None
                    and r.state is WorkerState.READY
                    and same(r, spec)
                    and not await self._proven(group.name, r, timing.restart.stable_s)
                ):
                    return False
        replaced: list[WorkerRunner] = []
        superseded = functools.partial(self._superseded, group.name)

        def order(item: tuple[int, LaunchSpec]) -> tuple[bool, int]:
            """Workers that serve nothing first; then those a later roll-out set (one that was
            superseded or halted: the file it rolled may be the broken one being fixed)."""
            runner = self.runners.get(item[1].name)
            return self._serving(item[1].name), -(runner.rolled_by if runner else 0)

        for index, spec in sorted(enumerate(specs), key=order):
            if superseded():
                return self._roll_superseded(group.name)
            runner = self.runners.get(spec.name)
            going_down = False
            if runner is None:
                runner = self._make_runner(group, index, plan)
                runner.rolled_by = self._covered
                attempts = 0
                await self._start_runner(runner)
                if not scaled:  # a new replica of a new definition proves it, as a
                    replaced.append(runner)  # replaced one does, before an old one goes
            else:
                if same(runner, spec):
                    # as it runs: a new threshold is no reason to load a model again, nor to
                    # cut a load short (a worker still loading is held to the new
                    # start_timeout_s); one in backoff starts on it at its next start
                    kept.append((runner, runner.spec, runner.timing, runner.output.passthrough))
                    runner.reconfigure(spec, timing, group.log_passthrough)
                    self._defs[runner.name] = group
                    runner.rolled_by = self._covered
                    if runner.state in (WorkerState.STARTING, WorkerState.BACKOFF):
                        # held to the new start_timeout_s, or backoff (regression: a worker
                        # in backoff waited out the old delay)
                        runner.post(lc.Retime())
                    if runner.state is WorkerState.FATAL and not self._shutting_down:
                        runner.post(lc.Start())  # a reload clears fatal
                    if resume and not await self._comes_up(group.name, runner, timing):
                        return False
                    continue
                if runner.state is WorkerState.STOPPED or passed_over(runner):
                    kept.append((runner, runner.spec, runner.timing, runner.output.passthrough))
                    runner.reconfigure(spec, timing, group.log_passthrough)
                    self._defs[runner.name] = group
                    runner.rolled_by = self._covered
                    if runner.record.waiting_for_gpu:  # the new plan may have one for it now
                        runner.post(lc.GpuFreed())
                    continue  # it starts on the new plan next
                if not await self._others_back(group.name, runner, keep=new_names):
                    return False  # (not set to the new plan: it keeps the old config)
                runner.reconfigure(spec, timing, group.log_passthrough)
                self._defs[runner.name] = group
                runner.rolled_by = self._covered
                attempts = runner.spawn_attempts
                going_down = _going_down(runner)
                runner.post(lc.Restart(ExitReason.RELOAD))
                replaced.append(runner)
            settled = await self._wait_started(
                functools.partial(self._in_line, (runner.name,)),
                _settled_after(runner, attempts, unless=superseded),
                self._stop_budget(runner) + timing.start_timeout_s,
                functools.partial(tuple, (runner,)),
            )
            if settled and self._moved_off(runner, runner.spec.gpus or ()):
                await self._back_after_move(group.name, runner)
                going_down = True  # what it comes back as is not the roll-out's doing
            elif settled and self._xid_maybe_not_own(runner):
                # restarted while it loaded for a worker-fatal XID on a GPU it shared, maybe
                # another process's: waited for once more (regression: the roll-out halted,
                # "did not become ready"); a second one, or its own, halts it
                await self._back_after_move(group.name, runner)
            if superseded():
                # the worker goes on loading this file; the next roll-out replaces it first
                return self._roll_superseded(group.name)
            if self._shutting_down:  # cut short by the stop: no halt (regression: logged as
                return False  # one, "replaced worker did not become ready")
            if settled and runner.state is WorkerState.STOPPED:
                if runner in replaced:  # it starts on the new definition when started
                    replaced.remove(runner)
                self._rollout_passes_over(group.name, runner, _STOPPED_MEANWHILE)
                continue
            if settled and going_down and runner.record.waiting_for_gpu:
                if runner in replaced:  # (a new replica of a scale-up is not)
                    replaced.remove(runner)  # it starts on the new definition once a GPU fits
                self._rollout_passes_over(group.name, runner)
                continue
            if not settled or runner.state is not WorkerState.READY:
                self._rollout_halted(
                    group.name,
                    runner,
                    "replaced worker did not become ready; the rest keep the old config",
                )
                return False
            if (
                replaced
                and replaced[-1] is runner
                and not await self._rollout_holds(
                    group.name, replaced, timing.restart.stable_s, "the rest keep the old config"
                )
            ):
                return False
        dropped = [self.runners[n] for n in old_names if n not in new_names and n in self.runners]
        if not await self._kept_serve(group.name, new_names, dropped, timing):
            return False
        # together, as a removed group's (one after another, a scale-down from 16 to 4 held
        # the reload 12 stop timeouts)
        async with anyio.create_task_group() as tg:
            for runner in dropped:
                tg.start_soon(self._remove_runner, runner, ExitReason.RELOAD)
        self.groups[group.name] = [n for n in new_names if n in self.runners]
        return True

    async def _comes_up(self, group: str, runner: WorkerRunner, timing: lc.Timing) -> bool:
        """A halted roll-out's worker on the new definition that is starting or in backoff
        (not waiting for a GPU, not stopped): it must come up and stay up for stable_s before
        the roll-out takes a worker still on the old one down (regression: the last old
        worker went as soon as it was ready, or while it was still loading); False (halted,
        logged) when it does not."""
        if runner.state not in (WorkerState.STARTING, WorkerState.BACKOFF):
            return True
        if runner.record.waiting_for_gpu:
            return True
        starting = runner.state is WorkerState.STARTING
        attempts = runner.spawn_attempts
        failed = runner.failed_attempt

        def settled() -> bool:
            if runner.state in (WorkerState.READY, WorkerState.FATAL, WorkerState.STOPPED):
                return True
            # a start that failed since, even one whose backoff ended before it was seen
            # (backoff_initial_s = 0; regression: the whole budget was waited out)
            return runner.failed_attempt > failed or (
                runner.state is WorkerState.BACKOFF
                and (starting or runner.spawn_attempts > attempts)
            )

        budget = timing.restart.backoff_max_s + self._stop_budget(runner) + timing.start_timeout_s
        await self._wait_started(
            functools.partial(self._in_line, (runner.name,)),
            lambda: settled() or self._shutting_down or self._superseded(group),
            budget,
            lambda: (runner,),
        )
        if self._superseded(group):
            return self._roll_superseded(group)
        if runner.record.state is not WorkerState.READY:
            if not self._shutting_down:
                self._rollout_halted(
                    group,
                    runner,
                    "a worker on the new definition did not become ready; the rest keep the "
                    "old config",
                )
            return False
        return await self._proven(group, runner, timing.restart.stable_s)

    async def _kept_serve(
        self,
        group: str,
        kept: Sequence[str],
        dropped: Sequence[WorkerRunner],
        timing: lc.Timing,
    ) -> bool:
        """Before a scale-down removes ``dropped``: while one of them serves and none of the
        workers ``kept`` does (crash-looping, loading, stopped by an operator), wait for one
        of those (up to its start timeout); False (halted, logged) if none comes, rather than
        leave the group serving nothing (regression: the only ready replica was removed and
        the reload said it was done)."""
        serving = [r for r in dropped if r.state is WorkerState.READY]
        if not serving:
            return True

        def kept_ready() -> bool:
            return any(
                (r := self.runners.get(n)) is not None and r.state is WorkerState.READY
                for n in kept
            )

        if not kept:
            return True  # scaled to 0: the operator asked for nothing to serve
        if kept_ready():
            return True
        await self.wait_until(
            lambda: kept_ready() or self._shutting_down or self._superseded(group),
            timing.start_timeout_s,
        )
        if not kept_ready() and self._superseded(group):
            return self._roll_superseded(group)
        if kept_ready() or self._shutting_down:
            return not self._shutting_down
        self._rollout_halted(
            group,
            serving[0],
            "no worker the group keeps is ready: not removing its last ready one",
        )
        return False


def _ignore_held_signals() -> None:
    """``HELD_SIGNALS`` do nothing from now on (the supervisor ends, no worker is spawned
    any more), even when one arrives while this is done: a KeyboardInterrupt in between, and
    it is done again. Ignored by the kernel, not by a Python handler: Python's C handler
    writes each one to the event loop's wakeup socket, which may be closed by then
    (regression: "Exception ignored when trying to write to the signal wakeup fd:
    BrokenPipeError" on stderr under a stream of Ctrl-C at the exit)."""
    while True:
        try:
            for sig in HELD_SIGNALS:
                with contextlib.suppress(ValueError, OSError):  # (not the main thread)
                    signal.signal(sig, signal.SIG_IGN)
        except KeyboardInterrupt:
            continue
        else:
            return


def _running_inner_pids(pids: frozenset[int]) -> dict[int, set[int]]:
    """Inner pid -> the pids here, for those of ``pids`` in a PID namespace of their own that
    still run; several where they share it (``listed_for_suspects``)."""
    out: dict[int, set[int]] = {}
    for pid in pids:
        ns = procfs.nspids(pid)
        if len(ns) >= 2 and ns[0] == pid and procfs.running(pid):
            out.setdefault(ns[-1], set()).add(pid)
    return out


def _configured(settings: Settings) -> frozenset[str]:
    """The names of the workers ``settings`` configures."""
    return frozenset(f"{g.name}-{i}" for g in settings.workers for i in range(g.replicas))


def _runs_unplaced(runner: WorkerRunner) -> bool:
    """``runner`` has a process, started without GPUs (``CUDA_VISIBLE_DEVICES`` unset), that
    is loading or serving: restarted by a placement roll-out once telemetry is up."""
    rec = runner.record
    return (
        runner.spec.gpus is None
        and rec.pid is not None
        and rec.state in (WorkerState.STARTING, WorkerState.READY)
    )


def _stopping_for_good(runner: WorkerRunner) -> bool:
    """``runner`` is draining or stopping toward ``stopped`` (an operator's drain or stop
    stays in force)."""
    return runner.record.after_exit is lc.AfterExit.STOP and runner.state in (
        WorkerState.DRAINING,
        WorkerState.STOPPING,
    )


def _stopped_for_good(runner: WorkerRunner) -> bool:
    """``runner`` is stopped, or on its way there (:func:`_stopping_for_good`)."""
    return runner.state is WorkerState.STOPPED or _stopping_for_good(runner)


def _down_for(runner: WorkerRunner) -> str | None:
    """Why ``runner`` is down, or on its way down (None while it is ready)."""
    rec = runner.record
    if rec.state is WorkerState.READY:
        return None
    if rec.state in (WorkerState.DRAINING, WorkerState.STOPPING):
        return rec.stop_reason
    return None if rec.last_exit is None else rec.last_exit.reason


def _restarted_by_operator(runner: WorkerRunner) -> bool:
    """``runner`` is on its way back from an operator's restart (``POST .../restart``,
    ``gpu-supervisor restart``): down, but not its definition's doing."""
    rec = runner.record
    if rec.state in (WorkerState.DRAINING, WorkerState.STOPPING):
        return rec.after_exit is lc.AfterExit.RESTART and rec.stop_reason is ExitReason.RESTART
    return (
        rec.state is WorkerState.STARTING
        and rec.last_exit is not None
        and rec.last_exit.reason is ExitReason.RESTART
    )


def passed_over(runner: WorkerRunner) -> bool:
    """A roll-out leaves it alone: draining or stopping toward ``stopped`` (an operator's drain
    or stop stays in force), or waiting for a GPU (no process to replace)."""
    return _stopping_for_good(runner) or runner.record.waiting_for_gpu


def _needs_shared(spec: LaunchSpec) -> bool:
    """True for a worker of another user that sends to the notify socket (readiness,
    watchdog or in-use reports)."""
    account = spec.account
    return (
        isinstance(account, Account)
        and account.switch
        and ("NOTIFY_SOCKET" in spec.env or "GPU_SUPERVISOR_IN_USE_SOCKET" in spec.env)
    )


def _unsafe(state_dir: Path) -> str | None:
    """Why the shared notify socket must not be put in ``state_dir`` (None: it may)."""
    why = others_may_replace(state_dir.absolute())
    return None if why is None else f"{why}: the socket there could be replaced"


def _pass_through(directory: Path) -> None:
    """Let others pass through ``directory`` (not list it: its files keep their modes)."""
    mode = stat.S_IMODE(os.stat(directory).st_mode)
    if not mode & 0o001:
        os.chmod(directory, mode | 0o001)


def _attempt(call: Callable[[], object]) -> str | None:
    """Call ``call``; None, or what the ``OSError`` it raised says."""
    try:
        call()
    except OSError as exc:
        return str(exc)
    return None


def _unrunnable_in(plan: Plan, diff: ReloadDiff) -> list[str]:
    """One line per changed or added group of ``diff`` whose program cannot be executed here."""
    touched = {*diff.changed, *diff.added}
    return unrunnable(
        (g.group.name, g.workers[0]) for g in plan.groups if g.group.name in touched and g.workers
    )


def _going_down(runner: WorkerRunner) -> bool:
    """Not serving when the roll-out reached it: draining or stopping already (healing, a
    crash's stop, a stop timeout), in backoff after a crash (a device-fatal XID usually kills
    the process before its healing drain does), or starting: what it comes back as is not the
    roll-out's doing (regression: only draining and stopping were; a crashed worker whose GPU
    was quarantined meanwhile halted the roll-out as before)."""
    return runner.state is not WorkerState.READY


#: ``Runtime.rolling``'s value while a placement roll-out runs (GPU telemetry came up after
#: workers of a ``gpus = "auto"`` group started unplaced)
PLACEMENT = "placement roll-out"
PLACING_WHY = (
    "GPU telemetry came up after these workers started: restarting them one at a time onto "
    "their GPUs"
)
#: Why a roll-out passes over a worker it found stopped after it restarted it.
_STOPPED_MEANWHILE = "stopped (an operator's stop or drain) while the roll-out replaced it"


def _settled_after(
    runner: WorkerRunner, attempts: int, unless: Callable[[], bool] | None = None
) -> Callable[[], bool]:
    """True once ``runner`` made a new start attempt and it became ready or failed, or once
    it is stopped with nothing left in its inbox to start it again (an operator stopped it
    while it was replaced: regression, its start_timeout_s was waited out for a start that
    never came) (or once ``unless()`` holds: the wait is no longer wanted). A failed start
    is one even when its backoff is over before it is seen (``backoff_initial_s = 0``:
    regression, the roll-out waited out the start timeout while the worker crash-looped)."""
    settled = (WorkerState.READY, WorkerState.FATAL, WorkerState.BACKOFF)
    return lambda: (
        (runner.spawn_attempts > attempts and runner.state in settled)
        or runner.failed_attempt > attempts
        or (runner.state is WorkerState.STOPPED and runner.inbox_empty())
        or bool(unless and unless())
    )


def _children() -> list[psutil.Process]:
    try:
        return psutil.Process().children()
    except psutil.Error:
        return []


def _left_by(proc: psutil.Process, leader: int, worker: str, pipes: frozenset[int]) -> bool:
    """``proc``, re-parented to us, was part of ``worker`` whose main process was ``leader``:
    in its process group (a member killed with the group but not dead yet has no environment
    left to read), carrying its name in its environment (a daemon that left the group), or
    holding the worker's output pipe (one that left both: ``setsid`` and an empty
    environment, still writing to the worker's log)."""
    with contextlib.suppress(OSError):
        if os.getpgid(proc.pid) == leader:
            return True
    with contextlib.suppress(psutil.Error, OSError):
        if proc.environ().get(WORKER_VAR) == worker:
            return True
    if pipes:
        wanted = {f"pipe:[{inode}]" for inode in pipes}
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{proc.pid}/fd/{fd}") in wanted:
                        return True
    return False


@dataclass(frozen=True, slots=True)
class _Death:
    """What a worker's death leaves for its post-mortem, taken at the moment of the exit."""

    runner: WorkerRunner
    action: lc.Exit
    before: lc.WorkerRecord
    spec: LaunchSpec
    pid: int | None
    started_wall: float | None
    ended_wall: float
    uptime_s: float | None  # monotonic
    lines: list[str]
    judged: list[str]  # the lines the death is judged by
    samples: list[SamplePoint]
    healing: dict[str, Any] | None
    oom_baseline: int | None
    journal_seq: int
    restarted: bool  # the lifecycle restarts it (or backs off to): counted in restarts_total
    last_probe: str | None = None  # what its last readiness probe got (HTTP readiness)
    watchdog_triggered: bool = False  # it sent WATCHDOG=trigger
    liveness_failed: str | None = None  # its liveness URL failed (health.liveness_url)
