"""The lifecycle driven by random event sequences a real run can produce (hypothesis stateful).

A small model of the world around ``lifecycle.step``: processes that start, die on their own or
from a signal, are reaped later (their ``Exited`` may come after other events), stale readiness
and heartbeats of earlier processes, deadlines passing as time goes on, operator commands,
healing restarts and drains, reloads of the timing, spawn failures and waits for a GPU, and
the sd_notify fields ``EXTEND_TIMEOUT_USEC`` and ``WATCHDOG_USEC`` of current and earlier
processes. After every step it checks what a production user relies on.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from supervisor.model import HEALER_REASONS, ExitReason, ExitStatus, WorkerState
from supervisor.policy import lifecycle as lc
from supervisor.policy.backoff import FailureHistory, RestartPolicy

S = WorkerState

STATUSES = st.sampled_from(
    [
        ExitStatus(code=0, signal=None),
        ExitStatus(code=1, signal=None),
        ExitStatus(code=None, signal=signal.SIGKILL),
        ExitStatus(code=None, signal=signal.SIGTERM),
        ExitStatus(code=None, signal=signal.SIGSEGV, core_dumped=True),
    ]
)
HEALER = sorted(HEALER_REASONS, key=lambda r: r.value)
#: EXTEND_TIMEOUT_USEC / WATCHDOG_USEC values, in seconds: off, 1 us, short, long, UINT64_MAX
USEC_SECONDS = st.sampled_from([0.0, 1e-6, 0.5, 2.0, 45.0, 5000.0, (2**64 - 1) / 1e6])
#: the states a notify field of a process means nothing in (no process)
AT_REST = (S.STOPPED, S.FATAL, S.BACKOFF)


@st.composite
def timings(draw: st.DrawFn) -> lc.Timing:
    initial = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    return lc.Timing(
        start_timeout_s=draw(st.sampled_from([1.0, 5.0, 30.0])),
        stop_timeout_s=draw(st.sampled_from([0.5, 2.0, 10.0])),
        drain_timeout_s=draw(st.sampled_from([0.0, 1.0, 3.0])),
        watchdog_s=draw(st.sampled_from([0.0, 1.0, 4.0])),
        ready_at_spawn=draw(st.booleans()),
        drain_signal=draw(st.sampled_from([None, int(signal.SIGUSR1)])),
        restart=RestartPolicy(
            delay_s=draw(st.sampled_from([0.0, 0.5, 2.0])),
            stable_s=draw(st.sampled_from([0.0, 2.0, 10.0])),
            backoff_initial_s=initial,
            backoff_max_s=initial + draw(st.sampled_from([0.0, 1.0, 8.0])),
            burst=draw(st.sampled_from([0, 1, 3])),
            interval_s=draw(st.sampled_from([5.0, 120.0])),
        ),
    )


@dataclass
class World:
    """The processes of one worker, as the operating system sees them."""

    next_pid: int = 1000
    spawned: list[int] = field(default_factory=list)  # every pid ever started, in order
    live: set[int] = field(default_factory=set)  # running
    dead: dict[int, ExitStatus] = field(default_factory=dict)  # ended, exit not yet delivered
    doomed: set[int] = field(default_factory=set)  # SIGKILLed: dies for sure
    spawn_asked: bool = False  # a Spawn waits for its answer
    signalled: set[int] = field(default_factory=set)  # sent a stop (or drain) signal
    unasked: set[int] = field(default_factory=set)  # had ended before its first signal

    def unreaped(self) -> set[int]:
        return self.live | set(self.dead)


class LifecycleMachine(RuleBasedStateMachine):
    """Random runs of one worker through ``lifecycle.step``."""

    def __init__(self) -> None:
        super().__init__()
        self.t = lc.Timing()
        self.rec = lc.WorkerRecord()
        self.now = 100.0
        self.world = World()
        # the operator (or a shutdown) wants it stopped: nothing may start it but a start
        self.wants_stop = True
        self.sync_spawn = False
        # failed runs since an operator's start (or restart) gave the worker a full burst
        self.failures = 0
        # EXTEND_TIMEOUT_USEC: the deadline the current process was granted in its current
        # state ("at least that long from the message"), None: none
        self.granted: float | None = None

    # --- driving ------------------------------------------------------------------------

    def feed(self, ev: lc.Event) -> None:
        old = self.rec
        rec, actions = lc.step(old, ev, self.now, self.t)
        self.rec = rec
        assert rec.restarts >= old.restarts, "the restart counter went down"
        if isinstance(ev, lc.Exited | lc.Ready | lc.Heartbeat) and ev.pid != old.pid:
            assert (rec, actions) == (old, []), "an event of another process changed the worker"
        exits = [a for a in actions if isinstance(a, lc.Exit)]
        if exits:
            assert isinstance(ev, lc.Exited | lc.SpawnFailed), f"an exit without one: {ev!r}"
            assert len(exits) == 1
            if isinstance(ev, lc.Exited):
                assert ev.pid == old.pid
                assert exits[0].outcome.status == ev.status, "exit attributed the wrong status"
        elif isinstance(ev, lc.Exited) and ev.pid == old.pid:
            raise AssertionError("the exit of the worker's process was not recorded")
        if isinstance(ev, lc.Exited):
            self.world.dead.pop(ev.pid, None)
        self.check_history(old, ev, exits)
        self.check_notify_fields(old, ev, actions)
        if (
            isinstance(ev, lc.Start)
            or (isinstance(ev, lc.Restart) and ev.reason not in HEALER_REASONS)
        ) and (
            old.state in (S.STOPPED, S.FATAL, S.BACKOFF)
            or (old.state is S.STOPPING and old.after_exit is lc.AfterExit.RECOVER)
        ):
            # a new beginning: down, or going down for a fault (DESIGN.md 5: an operator's
            # start or a reload clears fatal; the restart API takes it as a start there)
            self.failures = 0
        self.failures += sum(1 for e in exits if e.failure)
        for act in actions:
            self.do(old, ev, act)
        self.check_backoff(old, ev)
        if self.sync_spawn and lc.Spawn() in actions:
            self.answer_spawn("spawned")

    def do(self, old: lc.WorkerRecord, ev: lc.Event, act: lc.Action) -> None:
        w = self.world
        if isinstance(act, lc.Spawn):
            assert not w.unreaped(), f"a second process while {w.unreaped()} still run"
            assert not self.wants_stop, f"started against a stop, on {ev!r}"
            w.spawn_asked = True
        elif isinstance(act, lc.SendSignal | lc.KillTree):
            assert self.rec.pid is not None and self.rec.pid in w.unreaped(), "signal to nobody"
            if self.rec.pid in w.dead and self.rec.pid not in w.signalled:
                w.unasked.add(self.rec.pid)  # what the runtime tells the lifecycle
            w.signalled.add(self.rec.pid)
            if isinstance(act, lc.KillTree):
                w.doomed.add(self.rec.pid)
        elif isinstance(act, lc.Transitioned):
            if act.old in (S.STOPPED, S.FATAL) and act.new is S.STARTING:
                assert isinstance(ev, lc.Start | lc.Restart), f"started without a command: {ev!r}"
                assert not (isinstance(ev, lc.Restart) and ev.reason in HEALER_REASONS)
            if act.new is S.FATAL:
                burst = self.t.restart.burst
                assert burst > 0 and len(self.rec.history.times) > burst, "fatal too early"
                assert self.failures > burst, "fatal on failures from before a new start"

    def check_history(self, old: lc.WorkerRecord, ev: lc.Event, exits: list[lc.Exit]) -> None:
        """Failures are counted by failed runs only; only a stable run resets the streak,
        only an operator's (or a reload's) start forgets them."""
        before, after = old.history, self.rec.history
        if after == before:
            return
        if after == FailureHistory() and (
            isinstance(ev, lc.Start)
            or (isinstance(ev, lc.Restart) and ev.reason not in HEALER_REASONS)
            or (isinstance(ev, lc.Stop) and old.state is S.FATAL)
        ):
            return
        (exit_,) = exits
        if exit_.failure:
            assert after.consecutive == before.consecutive + 1
            assert after.times[-1] == self.now and set(after.times[:-1]) <= set(before.times)
        else:
            assert after == replace(before, consecutive=0), "a stable run changed the failures"

    def check_notify_fields(
        self, old: lc.WorkerRecord, ev: lc.Event, actions: list[lc.Action]
    ) -> None:
        """EXTEND_TIMEOUT_USEC and WATCHDOG_USEC (README.md, "Worker lifecycle")."""
        rec = self.rec
        if isinstance(ev, lc.ExtendTimeout | lc.WatchdogTimeout):
            if ev.pid != old.pid or old.state in AT_REST:
                assert (rec, actions) == (old, []), f"{ev!r} of no live process changed it"
                return
            assert rec.state is old.state and rec.pid == old.pid, f"{ev!r} moved the worker"
            assert not any(isinstance(a, lc.Transitioned | lc.Spawn) for a in actions)
        if isinstance(ev, lc.ExtendTimeout):
            assert rec.watchdog_s == old.watchdog_s
            if old.killed or old.deadline is None:
                assert (rec, actions) == (old, []), "a killed tree (or no deadline) extended"
                return
            assert rec.deadline is not None and rec.deadline >= old.deadline, "moved earlier"
            wanted = self.now + min(ev.seconds, lc.EXTEND_TIMEOUT_MAX_S)
            assert rec.deadline >= wanted, "an extension not granted"
            assert rec.deadline <= max(old.deadline, self.now + lc.EXTEND_TIMEOUT_MAX_S)
            self.granted = max(self.granted or 0.0, wanted)
        elif isinstance(ev, lc.WatchdogTimeout):
            assert rec.watchdog_s is not None and rec.watchdog_s >= 0
            if old.state is not S.READY:
                assert rec.deadline == old.deadline, "WATCHDOG_USEC moved a non-watchdog deadline"
            else:
                self.granted = None  # re-armed from now (systemd's meaning)
        if rec.state is not old.state or rec.pid != old.pid or rec.killed:
            self.granted = None  # an extension is of its state and process
        elif rec.state is S.READY and isinstance(ev, lc.Heartbeat) and ev.pid == rec.pid:
            self.granted = None  # a WATCHDOG=1 re-arms the watchdog from now
        if self.granted is not None:
            assert rec.deadline is not None and rec.deadline >= self.granted, (
                f"an extension to {self.granted} cut short by {ev!r}: {rec}"
            )
        if rec.state is S.STARTING and rec.pid != old.pid:
            assert rec.watchdog_s is None, "a watchdog a process set carried to the next one"
        if rec.state is S.STARTING:
            assert rec.extended_until is None or rec.pid is not None

    def check_backoff(self, old: lc.WorkerRecord, ev: lc.Event) -> None:
        rec = self.rec
        if rec.state is not S.BACKOFF or old.state is S.BACKOFF:
            return
        assert rec.deadline is not None
        delay = rec.deadline - self.now
        p = self.t.restart
        if rec.gpu_waits:
            assert delay == lc.gpu_wait_s(p, rec.gpu_waits)
            assert 1.0 <= delay <= lc.GPU_WAIT_MAX_S
            return
        last = rec.last_exit
        assert last is not None and last.at == self.now
        if rec.history.consecutive == 0:  # after a stable run
            assert delay == p.delay_s
        elif last.reason is ExitReason.SPAWN_FAILED:
            assert lc.SPAWN_RETRY_MIN_S <= delay <= max(p.backoff_max_s, lc.SPAWN_RETRY_MIN_S)
        else:
            assert min(p.backoff_initial_s, p.backoff_max_s) <= delay <= p.backoff_max_s

    # --- the world ----------------------------------------------------------------------

    @rule(kind=st.sampled_from(["spawned", "failed", "no_gpu"]))
    def answer_spawn(self, kind: str) -> None:
        w = self.world
        if not (w.spawn_asked and self.rec.state is S.STARTING and self.rec.pid is None):
            # the runtime drops the answer to a spawn no longer wanted (stopped meanwhile)
            w.spawn_asked = False
            return
        w.spawn_asked = False
        if kind == "spawned":
            pid = w.next_pid
            w.next_pid += 1
            w.spawned.append(pid)
            w.live.add(pid)
            self.feed(lc.Spawned(pid))
        elif kind == "failed":
            self.feed(lc.SpawnFailed("no such file"))
        else:
            self.feed(lc.NoGpu("all GPUs full"))

    @rule(status=STATUSES)
    def process_dies(self, status: ExitStatus) -> None:
        w = self.world
        for pid in sorted(w.live):
            w.live.discard(pid)
            w.dead[pid] = ExitStatus(None, signal.SIGKILL) if pid in w.doomed else status

    @rule(data=st.data())
    def reap(self, data: st.DataObject) -> None:
        w = self.world
        if w.dead:
            pid = data.draw(st.sampled_from(sorted(w.dead)))
            self.feed(lc.Exited(pid, w.dead[pid], unasked=pid in w.unasked))

    @rule(data=st.data(), trigger=st.booleans(), ready=st.booleans())
    def notify(self, data: st.DataObject, trigger: bool, ready: bool) -> None:
        if not self.world.spawned:
            return
        pid = data.draw(st.sampled_from(self.world.spawned[-3:]))
        self.feed(lc.Ready(pid) if ready else lc.Heartbeat(pid, trigger=trigger))

    @rule(data=st.data(), extend=st.booleans(), seconds=USEC_SECONDS)
    def notify_usec(self, data: st.DataObject, extend: bool, seconds: float) -> None:
        """EXTEND_TIMEOUT_USEC or WATCHDOG_USEC, from the current process or an earlier one
        (a datagram handled after its process was replaced)."""
        if not self.world.spawned:
            return
        pid = data.draw(st.sampled_from(self.world.spawned[-3:]))
        self.feed(lc.ExtendTimeout(pid, seconds) if extend else lc.WatchdogTimeout(pid, seconds))

    @precondition(lambda self: self.rec.pid is not None)
    @rule(extend=st.booleans(), seconds=USEC_SECONDS)
    def notify_usec_now(self, extend: bool, seconds: float) -> None:
        """The same from the live process (more often: what a loader or a stop sends)."""
        pid = self.rec.pid
        assert pid is not None
        self.feed(lc.ExtendTimeout(pid, seconds) if extend else lc.WatchdogTimeout(pid, seconds))

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 3.0, 10.0, 60.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        deadline = self.rec.deadline
        if deadline is not None and self.now >= deadline:
            self.feed(lc.Timer())

    @rule()
    def next_deadline(self) -> None:
        deadline = self.rec.deadline
        if deadline is not None:
            self.now = max(self.now, deadline)
            self.feed(lc.Timer())

    @rule()
    def early_timer(self) -> None:
        self.feed(lc.Timer())

    @rule()
    def gpu_freed(self) -> None:
        self.feed(lc.GpuFreed())

    @initialize(t=timings(), sync_spawn=st.booleans())
    def configure(self, t: lc.Timing, sync_spawn: bool) -> None:
        self.t = t
        # no pre-start hook: the runtime spawns at once, its answer is the next event
        self.sync_spawn = sync_spawn

    @rule(t=timings())
    def reload_timing(self, t: lc.Timing) -> None:
        # applied in place: what the worker's environment depends on (its watchdog, how it
        # says ready) is a new definition, which restarts it instead
        self.t = replace(
            t,
            watchdog_s=self.t.watchdog_s,
            ready_at_spawn=self.t.ready_at_spawn,
            drain_signal=self.t.drain_signal,
        )
        self.feed(lc.Retime())

    @precondition(lambda self: self.rec.state is S.STARTING and self.rec.pid is not None)
    @rule(start_timeout_s=st.sampled_from([0.5, 1.0, 5.0, 30.0]))
    def reload_start_timeout(self, start_timeout_s: float) -> None:
        # the one a loading worker (maybe granted more by EXTEND_TIMEOUT_USEC) is held to
        self.t = replace(self.t, start_timeout_s=start_timeout_s)
        self.feed(lc.Retime())

    # --- commands (one rule: the world's events come as often as the commands) ----------

    @rule(
        command=st.sampled_from(
            [
                "start",
                "stop",
                "shutdown",
                "restart",
                "reload",
                "drain",
                "kill",
                "heal",
                "heal_drain",
            ]
        ),
        reason=st.sampled_from(HEALER),
    )
    def command(self, command: str, reason: ExitReason) -> None:
        ev: lc.Event
        if command == "start":  # an operator's, or a reload's that clears fatal
            ev = lc.Start()
        elif command in ("stop", "shutdown"):
            ev = lc.Stop(ExitReason.STOP if command == "stop" else ExitReason.SHUTDOWN)
        elif command in ("restart", "reload"):
            ev = lc.Restart(ExitReason.RESTART if command == "restart" else ExitReason.RELOAD)
        elif command == "drain":  # an operator's (of the worker or of its whole group)
            ev = lc.Drain(restart=False)
        elif command == "kill":  # the second shutdown signal
            ev = lc.Kill("second signal")
        elif command == "heal":
            ev = lc.Restart(reason)
        else:
            ev = lc.Drain(restart=True, reason=reason)
        if command in ("start", "restart", "reload"):
            self.wants_stop = False
        elif command in ("stop", "shutdown", "drain", "kill"):
            self.wants_stop = True
        self.feed(ev)

    # --- a stop is carried out whatever the process does ---------------------------------

    @precondition(lambda self: self.wants_stop)
    @rule()
    def settle_after_stop(self) -> None:
        """With no more commands, a worker asked to stop ends stopped (its process gone)."""
        w = self.world
        for _ in range(20):
            if w.dead:
                pid = min(w.dead)
                self.feed(lc.Exited(pid, w.dead[pid], unasked=pid in w.unasked))
            elif w.live & w.doomed:
                self.process_dies(ExitStatus(None, signal.SIGKILL))
            elif self.rec.deadline is not None:
                self.now = max(self.now, self.rec.deadline)
                self.feed(lc.Timer())
            else:
                break
        assert self.rec.state in (S.STOPPED, S.FATAL), f"not stopped: {self.rec}"
        assert not w.unreaped()

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def one_process_known(self) -> None:
        rec, w = self.rec, self.world
        if rec.pid is None:
            assert not w.unreaped(), f"lost track of {w.unreaped()}: {rec}"
        else:
            assert w.unreaped() == {rec.pid}, f"{rec.pid} vs {w.unreaped()}"

    @invariant()
    def states_and_pids(self) -> None:
        rec = self.rec
        if rec.state in (S.STOPPED, S.FATAL, S.BACKOFF):
            assert rec.pid is None
        if rec.state in (S.READY, S.DRAINING, S.STOPPING):
            assert rec.pid is not None

    @invariant()
    def every_wait_ends(self) -> None:
        rec = self.rec
        if rec.state in (S.BACKOFF, S.DRAINING) or (rec.state is S.STARTING and rec.pid):
            assert rec.deadline is not None, f"waits forever: {rec}"
        if rec.state is S.STOPPING:
            assert rec.deadline is not None or rec.killed, f"waits forever: {rec}"
        if rec.state is S.STARTING and rec.pid is None:
            assert self.world.spawn_asked, f"no spawn to wait for: {rec}"
        if rec.state is S.READY:
            # the process's own watchdog (WATCHDOG_USEC), else the group's
            watchdog_s = self.t.watchdog_s if rec.watchdog_s is None else rec.watchdog_s
            assert (rec.deadline is not None) == (watchdog_s > 0), f"watchdog {watchdog_s}: {rec}"


LifecycleMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLifecycleRandomRuns = LifecycleMachine.TestCase
