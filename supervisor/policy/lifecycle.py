"""The worker lifecycle as a pure function: ``step(record, event, now, timing)``.

The runtime feeds every event of one worker (operator intents, process exits, readiness,
heartbeats, deadlines) through ``step`` and carries out the returned actions. Every state change
goes through ``model.transition``, so the table in ``model.ALLOWED`` is enforced here.

Time is ``now``: monotonic seconds supplied by the caller. ``record.deadline`` is the next moment
at which the caller must send ``Timer()`` (start timeout, watchdog, backoff, drain or stop timeout).
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from supervisor.config import MAX_SECONDS, WorkerGroup
from supervisor.model import (
    HEALER_REASONS,
    HEALING_REASONS,
    ExitReason,
    ExitStatus,
    WorkerState,
    transition,
)
from supervisor.policy.backoff import (
    FailureHistory,
    RestartPolicy,
    backoff_delay,
    is_stable_run,
    record_failure,
    record_stable_exit,
)

S = WorkerState


class AfterExit(enum.Enum):
    """What to do once the process we asked to end has exited."""

    STOP = "stop"  # stay stopped
    RESTART = "restart"  # start again now (operator restart, reload, drain-and-restart)
    RECOVER = "recover"  # healing restart: judged like a crash (stable run or failure)


@dataclass(frozen=True, slots=True)
class Timing:
    """The per-group values the lifecycle needs."""

    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    watchdog_s: float = 0.0
    ready_at_spawn: bool = False  # ready = "none"
    stop_signal: int = signal.SIGTERM
    drain_signal: int | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)


def timing_for(group: WorkerGroup) -> Timing:
    """The lifecycle values of a configured group."""
    r = group.restart
    return Timing(
        start_timeout_s=group.start_timeout_s,
        stop_timeout_s=group.stop_timeout_s,
        drain_timeout_s=group.drain_timeout_s,
        watchdog_s=group.health.watchdog_s,
        ready_at_spawn=group.ready_mode == "none",
        stop_signal=signal.Signals[group.stop_signal].value,
        drain_signal=signal.Signals[group.drain_signal].value if group.drain_signal else None,
        restart=RestartPolicy(
            delay_s=r.delay_s,
            stable_s=r.stable_s,
            backoff_initial_s=r.backoff_initial_s,
            backoff_max_s=r.backoff_max_s,
            burst=r.burst,
            interval_s=r.interval_s,
        ),
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the previous process ended: decoded status, reason, monotonic time."""

    status: ExitStatus | None  # None when the process could not be spawned
    reason: ExitReason
    at: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """Everything the lifecycle knows about one worker."""

    state: WorkerState = S.STOPPED
    pid: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    heartbeat_at: float | None = None
    deadline: float | None = None
    after_exit: AfterExit | None = None
    stop_reason: ExitReason | None = None
    killed: bool = False
    restarts: int = 0
    history: FailureHistory = field(default_factory=FailureHistory)
    last_exit: Outcome | None = None
    reason: str = ""  # why the worker is in its current state
    gpu_waits: int = 0  # consecutive starts that found no GPU to place on (BACKOFF: waiting)
    gpu_wait_reason: str = ""  # why the last of those found none (while ``gpu_waits``)
    #: the latest deadline EXTEND_TIMEOUT_USEC asked for in the current state, whether or not
    #: it moved ``deadline`` (None: none)
    extended_until: float | None = None
    #: this process's own watchdog (WATCHDOG_USEC it sent; 0: off), None: ``watchdog_s``
    watchdog_s: float | None = None

    @property
    def waiting_for_gpu(self) -> bool:
        """In BACKOFF because no GPU could be had, not because of a failure."""
        return self.state is S.BACKOFF and self.gpu_waits > 0


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """Operator start (also clears ``fatal``)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop and stay stopped."""

    reason: ExitReason = ExitReason.STOP


@dataclass(frozen=True, slots=True)
class Restart:
    """Stop, then start again at once (not counted as a failure)."""

    reason: ExitReason = ExitReason.RESTART


@dataclass(frozen=True, slots=True)
class Drain:
    """Take out of routing, let it finish, then restart or stay stopped."""

    restart: bool = True
    reason: ExitReason = ExitReason.DRAIN


@dataclass(frozen=True, slots=True)
class Kill:
    """SIGKILL the whole tree now (second shutdown signal, shutdown timeout)."""

    reason: str  # what the log's worker.kill says: second signal, shutdown timeout...


@dataclass(frozen=True, slots=True)
class Spawned:
    """The process was started."""

    pid: int


@dataclass(frozen=True, slots=True)
class SpawnFailed:
    """The process could not be started."""

    message: str


@dataclass(frozen=True, slots=True)
class NoGpu:
    """No GPU to place the process on now (all unusable, full, or gone): the worker waits
    for one, in BACKOFF, without counting a failure (the machine's state, not the worker's)."""

    message: str


@dataclass(frozen=True, slots=True)
class GpuFreed:
    """A GPU became usable: a worker waiting for one tries again now."""


@dataclass(frozen=True, slots=True)
class Retime:
    """The timing changed under a running worker (a reload applied in place): the start
    deadline already set follows the new ``start_timeout_s``."""


@dataclass(frozen=True, slots=True)
class Exited:
    """The worker's main process was reaped."""

    pid: int
    status: ExitStatus
    #: it had already ended when the stop signal was to be sent (a death of its own)
    unasked: bool = False


@dataclass(frozen=True, slots=True)
class Ready:
    """READY=1 or the first 2xx from the health URL."""

    pid: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """WATCHDOG=1; ``trigger``: WATCHDOG=trigger, the worker says it is hung (systemd's
    meaning: handled as a missed watchdog, whether ``watchdog_s`` is set or not)."""

    pid: int
    trigger: bool = False


@dataclass(frozen=True, slots=True)
class ExtendTimeout:
    """EXTEND_TIMEOUT_USEC: systemd's meaning: the deadline of the current state (the start
    timeout, the drain or stop timeout, a pending watchdog) is at least ``seconds`` from now
    (at most ``EXTEND_TIMEOUT_MAX_S``); it never moves earlier."""

    pid: int
    seconds: float


@dataclass(frozen=True, slots=True)
class WatchdogTimeout:
    """WATCHDOG_USEC: this process's watchdog is ``seconds`` from now on (0: off) instead of
    ``watchdog_s``; while ready it is re-armed from now (systemd's meaning)."""

    pid: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Timer:
    """``record.deadline`` has passed."""


Event = (
    Start
    | Stop
    | Restart
    | Drain
    | Kill
    | Spawned
    | SpawnFailed
    | NoGpu
    | GpuFreed
    | Retime
    | Exited
    | Ready
    | Heartbeat
    | ExtendTimeout
    | WatchdogTimeout
    | Timer
)

# --- actions ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spawn:
    """Start the process; answer with ``Spawned`` or ``SpawnFailed``."""


@dataclass(frozen=True, slots=True)
class SendSignal:
    """Send ``signal`` to the worker's whole process group."""

    signal: int


@dataclass(frozen=True, slots=True)
class KillTree:
    """SIGKILL the worker's process group and every known descendant."""

    reason: str = "stop timeout"


@dataclass(frozen=True, slots=True)
class Transitioned:
    """A state change, for logs and events; ``repeat``: one more look of a wait for a GPU
    that found none for the same reason (logged at debug: it can last for days)."""

    old: WorkerState
    new: WorkerState
    reason: str
    repeat: bool = False


@dataclass(frozen=True, slots=True)
class Exit:
    """The worker's process ended (for logs, records and post-mortems)."""

    outcome: Outcome
    failure: bool


@dataclass(frozen=True, slots=True)
class Extended:
    """EXTEND_TIMEOUT_USEC moved the deadline of ``state`` to ``deadline`` (for logs);
    ``first``: the first time in this state."""

    state: WorkerState
    seconds: float
    deadline: float
    first: bool


Action = Spawn | SendSignal | KillTree | Transitioned | Exit | Extended


def _move(
    rec: WorkerRecord, new: WorkerState, reason: str, **changes: object
) -> tuple[WorkerRecord, list[Action]]:
    old = rec.state
    transition(old, new)
    # an extension (EXTEND_TIMEOUT_USEC) is of the state it was asked in
    changes = {"extended_until": None, **changes}
    rec = replace(rec, state=new, reason=reason, **changes)  # type: ignore[arg-type]
    return rec, [Transitioned(old, new, reason)]


def _repeated(
    moved: tuple[WorkerRecord, list[Action]], repeat: bool
) -> tuple[WorkerRecord, list[Action]]:
    """``moved``, its transition marked ``repeat`` if it is one."""
    if not repeat:
        return moved
    rec, acts = moved
    return rec, [replace(a, repeat=True) if isinstance(a, Transitioned) else a for a in acts]


def _start(
    rec: WorkerRecord, reason: str, *, repeat: bool = False
) -> tuple[WorkerRecord, list[Action]]:
    rec, acts = _repeated(
        _move(
            rec,
            S.STARTING,
            reason,
            pid=None,
            started_at=None,
            ready_at=None,
            heartbeat_at=None,
            deadline=None,
            after_exit=None,
            stop_reason=None,
            killed=False,
            watchdog_s=None,
        ),
        repeat,
    )
    return rec, [*acts, Spawn()]


def _begin_stop(
    rec: WorkerRecord, now: float, t: Timing, after: AfterExit, reason: ExitReason
) -> tuple[WorkerRecord, list[Action]]:
    """Send the stop signal and arm the stop timeout (or update an ongoing stop)."""
    if rec.state is S.STOPPING:
        # Already stopping: only the plan for afterwards changes (a STOP wins over a restart).
        merged = AfterExit.STOP if AfterExit.STOP in (after, rec.after_exit) else after
        return replace(rec, after_exit=merged), []
    rec, acts = _move(
        rec,
        S.STOPPING,
        reason.value,
        after_exit=after,
        stop_reason=reason,
        deadline=now + t.stop_timeout_s,
    )
    return rec, [*acts, SendSignal(t.stop_signal)]


def _ready_deadline(now: float, t: Timing, rec: WorkerRecord) -> float | None:
    watchdog_s = t.watchdog_s if rec.watchdog_s is None else rec.watchdog_s
    return now + watchdog_s if watchdog_s > 0 else None


#: The most one EXTEND_TIMEOUT_USEC moves a deadline, from its arrival: a worker that needs
#: longer sends it again before then, as under systemd (where it must keep coming too). A
#: value past it (a typo, UINT64_MAX) must not keep a hung start or stop alive for years.
EXTEND_TIMEOUT_MAX_S = 3600.0


def _extend(rec: WorkerRecord, ev: ExtendTimeout, now: float) -> tuple[WorkerRecord, list[Action]]:
    """EXTEND_TIMEOUT_USEC of the worker's own process: the current deadline is at least
    ``ev.seconds`` from now; never earlier, and not once its tree is being killed."""
    if rec.deadline is None or rec.killed or ev.seconds <= 0:
        return rec, []  # (0: no time asked for; a roll-out's wait need not follow it)
    until = now + min(ev.seconds, EXTEND_TIMEOUT_MAX_S)
    granted = until if rec.extended_until is None else max(rec.extended_until, until)
    if until <= rec.deadline:
        # granted all the same: a reload that shortens the start timeout keeps it (regression:
        # one within the deadline as it was was forgotten, and the reload's cut it short)
        return replace(rec, extended_until=granted), []
    # (the first to move it in this state: one before it that did not left it no later)
    first = rec.extended_until is None or rec.extended_until < rec.deadline
    rec = replace(rec, deadline=until, extended_until=granted)
    return rec, [Extended(rec.state, until - now, until, first)]


def _rewatch(
    rec: WorkerRecord, ev: WatchdogTimeout, now: float, t: Timing
) -> tuple[WorkerRecord, list[Action]]:
    """WATCHDOG_USEC: this process's watchdog from now on; re-armed at once while ready."""
    rec = replace(rec, watchdog_s=min(max(ev.seconds, 0.0), MAX_SECONDS))
    if rec.state is S.READY:
        rec = replace(rec, deadline=_ready_deadline(now, t, rec))
    return rec, []


#: The shortest wait before a start that failed to spawn (the program is gone, its working
#: directory too) is tried again, whatever ``backoff_initial_s`` says: a spawn is answered at
#: once, so with no delay the retries would loop without ever yielding (a frozen supervisor).
SPAWN_RETRY_MIN_S = 1.0


def _after_failure_or_stable(
    rec: WorkerRecord, now: float, t: Timing, outcome: Outcome, base: list[Action]
) -> tuple[WorkerRecord, list[Action]]:
    """A process ended on its own (or by a healing stop): restart, back off, or give up."""
    policy = t.restart
    restarts = rec.restarts + 1
    # a failure (or a run) ends any wait for a GPU: GpuFreed must not cut a failure's backoff
    common = {
        "pid": None,
        "last_exit": outcome,
        "killed": False,
        "after_exit": None,
        "gpu_waits": 0,
    }
    if is_stable_run(rec.ready_at, now, policy):
        history = record_stable_exit(rec.history)
        rec, acts = _backoff(
            rec, now, policy.delay_s, outcome, history=history, restarts=restarts, **common
        )
        return rec, [*base, Exit(outcome, failure=False), *acts]
    verdict = record_failure(rec.history, now, policy)
    if verdict.fatal:
        last = outcome.detail or outcome.reason.value
        if outcome.reason not in (ExitReason.EXIT, ExitReason.SIGNAL) and outcome.detail:
            last = f"{outcome.reason.value} ({outcome.detail})"  # a healing or timeout stop
        why = (
            f"{len(verdict.history.times)} failed starts within {policy.interval_s:g}s "
            f"(burst {policy.burst}); last: {last}"
        )
        rec, acts = _move(rec, S.FATAL, why, history=verdict.history, deadline=None, **common)
        return rec, [*base, Exit(outcome, failure=True), *acts]
    delay_s = verdict.delay_s
    if outcome.reason is ExitReason.SPAWN_FAILED:
        # the retry's answer would come in this same step: never without a Timer in between
        delay_s = max(delay_s, SPAWN_RETRY_MIN_S)
    rec, acts = _backoff(
        rec, now, delay_s, outcome, history=verdict.history, restarts=restarts, **common
    )
    return rec, [*base, Exit(outcome, failure=True), *acts]


def _retry_delay(rec: WorkerRecord, t: Timing) -> float:
    """The wait in BACKOFF after ``rec.last_exit`` under ``t``'s restart policy: ``delay_s``
    after a stable run (the streak reset), else the backoff of the failures in a row."""
    policy = t.restart
    if rec.history.consecutive == 0:
        return policy.delay_s
    delay_s = backoff_delay(rec.history.consecutive, policy)
    if rec.last_exit is not None and rec.last_exit.reason is ExitReason.SPAWN_FAILED:
        delay_s = max(delay_s, SPAWN_RETRY_MIN_S)
    return delay_s


def _backoff(
    rec: WorkerRecord, now: float, delay_s: float, outcome: Outcome, **changes: object
) -> tuple[WorkerRecord, list[Action]]:
    """Into BACKOFF for ``delay_s``; with no delay, out of it again at once (same step).

    A zero delay does not wait for a ``Timer`` (an event-loop turn): the replacement is
    spawned by the actions of the exit itself.
    """
    rec, acts = _move(rec, S.BACKOFF, outcome.reason.value, deadline=now + delay_s, **changes)
    if delay_s > 0:
        return rec, acts
    rec, more = _start(rec, "backoff elapsed")
    return rec, [*acts, *more]


def _exit_reason(status: ExitStatus) -> ExitReason:
    return ExitReason.SIGNAL if status.signal is not None else ExitReason.EXIT


def _on_exit(
    rec: WorkerRecord, ev: Exited, now: float, t: Timing
) -> tuple[WorkerRecord, list[Action]]:
    expected = rec.after_exit
    if expected is None:
        reason = _exit_reason(ev.status)
        outcome = Outcome(ev.status, reason, now, ev.status.describe())
        return _after_failure_or_stable(rec, now, t, outcome, [])
    reason = rec.stop_reason or ExitReason.STOP
    if ev.unasked and reason in _OPERATOR_STOPS and ev.status.code != 0:
        # it died on its own before the operator's stop signal: its death, not the stop (the
        # operator's restart or stop still happens); a clean exit then is no death to record
        reason = _exit_reason(ev.status)
    outcome = Outcome(ev.status, reason, now, ev.status.describe())
    if expected is AfterExit.RECOVER:
        return _after_failure_or_stable(rec, now, t, outcome, [])
    done: dict[str, object] = {"pid": None, "last_exit": outcome, "killed": False, "deadline": None}
    if expected is AfterExit.STOP:
        rec, acts = _move(rec, S.STOPPED, reason.value, after_exit=None, **done)
        return rec, [Exit(outcome, failure=False), *acts]
    if rec.stop_reason in (ExitReason.RESTART, ExitReason.RELOAD):
        # an operator's restart (a rolling one, a reload's) is a new beginning, as from
        # backoff, fatal or while stopping (regression: a crash-looping worker restarted while
        # it loaded kept its failures, and went fatal at the first failed start after it)
        done["history"] = FailureHistory()
    elif is_stable_run(rec.ready_at, now, t.restart):
        # ready for stable_s: the failures before it were no streak the next start continues
        done["history"] = record_stable_exit(rec.history)
    rec = replace(rec, restarts=rec.restarts + 1, **done)  # type: ignore[arg-type]
    rec, acts = _start(rec, reason.value)
    return rec, [Exit(outcome, failure=False), *acts]


def step(rec: WorkerRecord, ev: Event, now: float, t: Timing) -> tuple[WorkerRecord, list[Action]]:
    """Apply one event; return the new record and the actions to carry out, in order."""
    state = rec.state
    # Events about a process that is not (or no longer) ours are stale: ignore them.
    if (
        isinstance(ev, Exited | Ready | Heartbeat | ExtendTimeout | WatchdogTimeout)
        and ev.pid != rec.pid
    ):
        return rec, []
    if isinstance(ev, ExtendTimeout):  # (its process is live: STARTING to STOPPING)
        return _extend(rec, ev, now)
    if isinstance(ev, WatchdogTimeout):
        return _rewatch(rec, ev, now, t)

    if isinstance(ev, Retime):
        # a worker still loading keeps loading, against the new start_timeout_s (regression:
        # a raised one was applied only at the next start, after the old one had failed it)
        if state is S.STARTING and rec.pid is not None and rec.started_at is not None:
            # ... never before what the worker was granted (EXTEND_TIMEOUT_USEC)
            deadline = rec.started_at + t.start_timeout_s
            if rec.extended_until is not None:
                deadline = max(deadline, rec.extended_until)
            return replace(rec, deadline=deadline), []
        if state is S.BACKOFF and not rec.gpu_waits and rec.last_exit is not None:
            # so does a backoff, counted from the exit (regression: a worker backed off to
            # the old backoff_max_s waited that long after the operator had lowered it)
            return replace(rec, deadline=rec.last_exit.at + _retry_delay(rec, t)), []
        return rec, []

    if isinstance(ev, Kill):
        if rec.pid is not None and state in (S.STARTING, S.READY, S.DRAINING, S.STOPPING):
            if state is not S.STOPPING:
                rec, acts = _begin_stop(rec, now, t, AfterExit.STOP, ExitReason.SHUTDOWN)
            else:
                rec, acts = replace(rec, after_exit=AfterExit.STOP), []
            return replace(rec, killed=True, deadline=None), [*acts, KillTree(ev.reason)]
        if state is S.BACKOFF or (state is S.STARTING and rec.pid is None):
            return _move(rec, S.STOPPED, ExitReason.SHUTDOWN.value, deadline=None, gpu_waits=0)
        return rec, []

    if isinstance(ev, Restart) and ev.reason in HEALER_REASONS and state in _AT_REST:
        return rec, []  # a healing restart queued behind a stop (or a crash): nothing to heal

    if state in (S.STOPPED, S.FATAL):
        if isinstance(ev, Start | Restart):
            # an operator's start (or a reload's) is a new beginning: the failures counted
            # toward `burst` and the backoff were those of what ran before
            rec = replace(rec, history=FailureHistory())
            return _start(rec, "start")
        if isinstance(ev, Stop) and state is S.FATAL:
            return _move(rec, S.STOPPED, ev.reason.value, history=FailureHistory())
        return rec, []

    if state is S.BACKOFF:
        if isinstance(ev, Timer) and rec.deadline is not None and now >= rec.deadline:
            # one more look for a GPU is quiet (what it finds is said if it is news)
            return _start(rec, "backoff elapsed", repeat=rec.gpu_waits > 0)
        if isinstance(ev, GpuFreed) and rec.gpu_waits:
            return _start(rec, "a GPU became usable")
        if isinstance(ev, Start | Restart):
            # as from stopped: a reload's new definition or an operator's start gets a full
            # `burst` (it kept the old one's failures: fatal after one or two tries)
            return _start(replace(rec, history=FailureHistory()), "start")
        if isinstance(ev, Stop) or _operator_drain(ev):
            return _move(rec, S.STOPPED, _stop_reason(ev), deadline=None, gpu_waits=0)
        return rec, []

    if state is S.STARTING and rec.pid is None:
        # Waiting for the answer to Spawn.
        if isinstance(ev, Spawned):
            rec = replace(
                rec, pid=ev.pid, started_at=now, deadline=now + t.start_timeout_s, gpu_waits=0
            )
            if t.ready_at_spawn:
                return _move(
                    rec,
                    S.READY,
                    "started (ready = none)",
                    ready_at=now,
                    heartbeat_at=now,
                    deadline=_ready_deadline(now, t, rec),
                )
            return rec, []
        if isinstance(ev, SpawnFailed):
            outcome = Outcome(None, ExitReason.SPAWN_FAILED, now, ev.message)
            return _after_failure_or_stable(rec, now, t, outcome, [])
        if isinstance(ev, NoGpu):
            waits = rec.gpu_waits + 1
            # the same wait, looked at again: quiet (regression: two lines at info a look,
            # up to one a minute, for as long as the GPU stayed gone)
            return _repeated(
                _move(
                    rec,
                    S.BACKOFF,
                    f"waiting for a GPU: {ev.message}",
                    deadline=now + gpu_wait_s(t.restart, waits),
                    gpu_waits=waits,
                    gpu_wait_reason=ev.message,
                ),
                rec.gpu_waits > 0 and ev.message == rec.gpu_wait_reason,
            )
        if isinstance(ev, Stop) or _operator_drain(ev):
            # Still preparing (GPU-release barrier): nothing runs yet, so just stay stopped.
            return _move(
                rec, S.STOPPED, _stop_reason(ev), deadline=None, after_exit=None, gpu_waits=0
            )
        return rec, []

    # From here on there is a live process (pid is set).
    if isinstance(ev, Exited):
        return _on_exit(rec, ev, now, t)

    if state is S.STARTING:
        if isinstance(ev, Ready):
            return _move(
                rec,
                S.READY,
                "ready",
                ready_at=now,
                heartbeat_at=now,
                deadline=_ready_deadline(now, t, rec),
            )
        if isinstance(ev, Heartbeat) and ev.trigger:
            return _begin_stop(rec, now, t, AfterExit.RECOVER, ExitReason.HANG)
        if isinstance(ev, Heartbeat):
            return replace(rec, heartbeat_at=now), []
        if isinstance(ev, Timer) and rec.deadline is not None and now >= rec.deadline:
            return _begin_stop(rec, now, t, AfterExit.RECOVER, ExitReason.START_TIMEOUT)
        if isinstance(ev, Stop):
            return _begin_stop(rec, now, t, AfterExit.STOP, ev.reason)
        if isinstance(ev, Restart):
            return _begin_stop(rec, now, t, _restart_after(ev.reason), ev.reason)
        if isinstance(ev, Drain) and ev.reason is ExitReason.MAX_AGE:
            # a recycle is asked for a ready process: this one started since (the one it was
            # for died meanwhile), and is not due (regression: stopped while it loaded)
            return rec, []
        if isinstance(ev, Drain):
            # Not ready yet, so not routed to: nothing to drain, stop straight away.
            after = _restart_after(ev.reason, drain=True) if ev.restart else AfterExit.STOP
            return _begin_stop(rec, now, t, after, ev.reason)
        return rec, []

    if state is S.READY:
        if isinstance(ev, Heartbeat) and not ev.trigger:
            return replace(rec, heartbeat_at=now, deadline=_ready_deadline(now, t, rec)), []
        if isinstance(ev, Heartbeat) or (
            isinstance(ev, Timer) and rec.deadline is not None and now >= rec.deadline
        ):
            return _begin_stop(rec, now, t, AfterExit.RECOVER, ExitReason.HANG)
        if isinstance(ev, Stop):
            return _begin_stop(rec, now, t, AfterExit.STOP, ev.reason)
        if isinstance(ev, Restart):
            return _begin_stop(rec, now, t, _restart_after(ev.reason), ev.reason)
        if isinstance(ev, Drain):
            after = _restart_after(ev.reason, drain=True) if ev.restart else AfterExit.STOP
            rec, acts = _move(
                rec,
                S.DRAINING,
                ev.reason.value,
                after_exit=after,
                stop_reason=ev.reason,
                deadline=now + t.drain_timeout_s,
            )
            if t.drain_signal is not None:
                acts.append(SendSignal(t.drain_signal))
            return rec, acts
        return rec, []

    if state is S.DRAINING:
        if isinstance(ev, Timer) and rec.deadline is not None and now >= rec.deadline:
            after = rec.after_exit or AfterExit.STOP
            reason = rec.stop_reason or ExitReason.DRAIN
            rec, acts = _move(
                rec,
                S.STOPPING,
                f"{reason.value}: drain timeout",
                deadline=now + t.stop_timeout_s,
                after_exit=after,
            )
            return rec, [*acts, SendSignal(t.stop_signal)]
        if isinstance(ev, Restart) and _healing_over_stop(rec, ev):
            # draining toward a stop, and now broken (an XID, a sticky error): stop it now,
            # keep it stopped, and say why (its post-mortem is the healing action's, not a
            # drain that ran out of time)
            return _begin_stop(rec, now, t, AfterExit.STOP, ev.reason)
        if isinstance(ev, Stop):  # drained for a fault: its death keeps it (see STOPPING)
            return _begin_stop(rec, now, t, AfterExit.STOP, _kept_reason(rec, ev))
        if isinstance(ev, Restart):
            return _begin_stop(rec, now, t, _restart_after(ev.reason), ev.reason)
        if isinstance(ev, Drain) and not ev.restart and rec.after_exit is not AfterExit.STOP:
            # an operator's drain of a worker that healing drains already: the drain goes on,
            # and it stays stopped after it (as a stop would); what it was drained for stays
            # its reason (regression: the drain was ignored, the worker restarted after it);
            # but not a scheduled recycle's, which is no fault: stopped for the operator's
            # drain, as a stop says (regression: stopped for "max_age")
            return replace(rec, after_exit=AfterExit.STOP, stop_reason=_kept_reason(rec, ev)), []
        if isinstance(ev, Heartbeat) and not ev.trigger:  # going anyway: no hang restart
            return replace(rec, heartbeat_at=now), []
        return rec, []

    if state is S.STOPPING:
        if isinstance(ev, Timer) and rec.deadline is not None and now >= rec.deadline:
            if not rec.killed:
                return replace(rec, killed=True, deadline=None), [KillTree()]
            return replace(rec, deadline=None), []
        if isinstance(ev, Stop) or (isinstance(ev, Drain) and not ev.restart):
            # stopped for a fault (a hang, a start timeout, a healing action): the stop
            # wins, but the death keeps its reason and post-mortem (regression: a shutdown
            # while a hung worker ignored its SIGTERM made it a plain "shutdown"); an
            # operator's drain (of its group) too: nothing left to drain, it stays stopped
            # (regression: ignored, the worker started again once its process was gone)
            return replace(rec, after_exit=AfterExit.STOP, stop_reason=_kept_reason(rec, ev)), []
        if isinstance(ev, Restart) and _healing_over_stop(rec, ev):
            return rec, []
        if isinstance(ev, Start | Restart) and rec.after_exit is AfterExit.STOP:
            # an operator's start (or a reload's restart) of a worker being stopped is a new
            # beginning, as from stopped (regression: the failures before the stop were kept,
            # and one crash-looping before it went fatal at its next failed start)
            return replace(rec, after_exit=AfterExit.RESTART, history=FailureHistory()), []
        if isinstance(ev, Start | Restart) and rec.after_exit is AfterExit.RECOVER:
            # stopped for a fault (a hang, a start timeout, healing): it starts again after its
            # exit, which is still judged (post-mortem, backoff); an operator's start (or
            # restart, a reload's) gives it a full `burst` as from backoff or fatal (regression:
            # accepted, then ignored, and the exit could make it fatal); a healing restart
            # (queued behind the fault's stop) is no new beginning
            if isinstance(ev, Restart) and ev.reason in HEALER_REASONS:
                return rec, []
            return replace(rec, history=FailureHistory()), []
        return rec, []

    return rec, []


def may_start(name: str, queue: Sequence[str], loading: Collection[str], limit: int) -> bool:
    """``[supervisor] max_starting``: whether worker ``name``, waiting in ``queue`` (first come,
    first served) while ``loading`` are starting (spawned or let go, not ready yet), may be
    spawned now. ``limit`` 0: always."""
    if not limit:
        return True
    room = limit - len(set(loading) - {name})
    return room > 0 and name in queue[:room]


#: The longest a worker waiting for a GPU goes without looking again (a GPU that comes back
#: also wakes it at once: ``GpuFreed``).
GPU_WAIT_MAX_S = 60.0


def gpu_wait_s(policy: RestartPolicy, waits: int) -> float:
    """How long to wait after the ``waits``-th start in a row found no GPU: the backoff's
    doubling from ``backoff_initial_s`` (at least 1 s: never a busy loop), capped at
    ``backoff_max_s`` and at ``GPU_WAIT_MAX_S``."""
    first = max(policy.backoff_initial_s, 1.0)
    cap = max(min(policy.backoff_max_s, GPU_WAIT_MAX_S), first)
    return min(cap, first * 2.0 ** min(waits - 1, 30))


#: Drains off a GPU that failed (quarantined): the GPU's doing, never the worker's.
#: Healing reasons that move a worker off its GPU for the GPU's fault (failed, lost, hot):
#: never the worker's (its restart is not judged; a roll-out holding for it waits for it on
#: another GPU). An ``xid`` is one only as a drain (a device-fatal XID: the GPU quarantined); a
#: worker-fatal XID restarts the worker where it is.
GPU_FAULTS = frozenset(
    {
        ExitReason.XID,
        ExitReason.GPU_LOST,
        ExitReason.ROW_REMAP_FAILURE,
        ExitReason.RECOVERY_ACTION,
        ExitReason.THERMAL,
    }
)


def _restart_after(reason: ExitReason, drain: bool = False) -> AfterExit:
    """A healing restart is judged like a crash once the process is gone: after a stable run it
    starts again at once (``delay_s``), else it counts as a failure (backoff, then ``fatal``),
    so a worker that is over its budget from the start cannot restart in a tight loop. An
    operator's or a reload's restart is not judged, nor a migration off a hot GPU (the GPU's
    doing, not the worker's: a GPU that turned hot soon after the start made it a failed start,
    toward ``fatal``), nor a drain off a failed GPU (``drain``: an XID drain is a device-fatal
    one; a worker-fatal XID restarts, and is judged). Regression: a GPU that failed while its
    worker loaded made the move a failed start (a backoff first; ``fatal`` after failures)."""
    if reason in GPU_FAULTS and (drain or reason is not ExitReason.XID):
        return AfterExit.RESTART
    return AfterExit.RECOVER if reason in HEALING_REASONS else AfterExit.RESTART


#: Stops the operator (or a reload, a shutdown) asked for: no death of the worker's.
_OPERATOR_STOPS = frozenset(
    {ExitReason.STOP, ExitReason.RESTART, ExitReason.RELOAD, ExitReason.SHUTDOWN}
)
#: Reasons a worker is stopped for that are its death (a post-mortem): a stop asked for
#: while it stops for one of them does not take their place.
_FAULT_STOPS = frozenset({ExitReason.HANG, ExitReason.START_TIMEOUT, *HEALING_REASONS})


def _kept_reason(rec: WorkerRecord, ev: Stop | Drain) -> ExitReason:
    """The reason of a stop asked for while the worker is drained or stopped already: the
    fault it is drained or stopped for, if any (its death, with its post-mortem)."""
    if rec.stop_reason is not None and rec.stop_reason in _FAULT_STOPS:
        return rec.stop_reason
    return ev.reason


#: States without a process: a healing restart finds nothing to restart there (no start in
#: STOPPED or FATAL, no cut to BACKOFF's delay).
_AT_REST = frozenset({S.STOPPED, S.FATAL, S.BACKOFF})


def _healing_over_stop(rec: WorkerRecord, ev: Restart) -> bool:
    """A healing restart of a worker that is being stopped for good: the stop wins (a healing
    action must not start what an operator, a reload or the shutdown is stopping)."""
    return rec.after_exit is AfterExit.STOP and ev.reason in HEALER_REASONS


def _operator_drain(ev: Event) -> bool:
    """A drain that ends in a stop (an operator's ``drain``, of a group too): a worker with
    no process up (in backoff, about to spawn) just stays stopped, as a stop would leave it
    (regression: it ignored the drain and started afterwards: the drained group came back)."""
    return isinstance(ev, Drain) and not ev.restart


def _stop_reason(ev: Event) -> str:
    return ev.reason.value if isinstance(ev, Stop | Drain) else ExitReason.STOP.value
