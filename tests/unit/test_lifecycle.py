"""The lifecycle as a pure function: every allowed transition walked, every other one refused."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from supervisor.errors import IllegalTransition
from supervisor.model import ALLOWED, ExitReason, ExitStatus, WorkerState, transition
from supervisor.policy import lifecycle as lc
from supervisor.policy.backoff import FailureHistory, RestartPolicy

S = WorkerState
T = lc.Timing(
    start_timeout_s=5,
    stop_timeout_s=2,
    drain_timeout_s=3,
    watchdog_s=1,
    drain_signal=signal.SIGUSR1,
    restart=RestartPolicy(delay_s=0.5, stable_s=10, backoff_initial_s=1, backoff_max_s=8, burst=2),
)
CRASH = ExitStatus(code=3, signal=None)


def run(
    events: list[lc.Event],
    rec: lc.WorkerRecord | None = None,
    t: lc.Timing = T,
    start: float = 100.0,
    dt: float = 0.0,
) -> tuple[lc.WorkerRecord, list[lc.Action]]:
    rec = rec or lc.WorkerRecord()
    now = start
    actions: list[lc.Action] = []
    for ev in events:
        rec, acts = lc.step(rec, ev, now, t)
        actions += acts
        now += dt
    return rec, actions


def at(rec: lc.WorkerRecord, ev: lc.Event, now: float, t: lc.Timing = T) -> lc.WorkerRecord:
    return lc.step(rec, ev, now, t)[0]


def started(now: float = 100.0, pid: int = 10) -> lc.WorkerRecord:
    rec = at(lc.WorkerRecord(), lc.Start(), now)
    return at(rec, lc.Spawned(pid), now)


def ready(now: float = 100.0, pid: int = 10) -> lc.WorkerRecord:
    return at(started(now, pid), lc.Ready(pid), now)


def transitions(actions: list[lc.Action]) -> list[tuple[S, S]]:
    return [(a.old, a.new) for a in actions if isinstance(a, lc.Transitioned)]


# Each allowed edge, with a scenario that produces it.
def _edges() -> dict[tuple[S, S], lc.WorkerRecord]:
    out: dict[tuple[S, S], lc.WorkerRecord] = {}
    out[(S.STOPPED, S.STARTING)] = at(lc.WorkerRecord(), lc.Start(), 0)
    out[(S.STARTING, S.READY)] = at(started(), lc.Ready(10), 100)
    preparing = at(lc.WorkerRecord(), lc.Start(), 0)  # Spawn issued, not answered yet
    out[(S.STARTING, S.STOPPED)] = at(preparing, lc.Stop(), 0.5)
    out[(S.STARTING, S.STOPPING)] = at(started(), lc.Timer(), 105)
    out[(S.STARTING, S.BACKOFF)] = at(started(), lc.Exited(10, CRASH), 101)
    two_failures = replace(started(), history=FailureHistory((99.0, 99.5), 2))
    out[(S.STARTING, S.FATAL)] = at(two_failures, lc.Exited(10, CRASH), 101)
    out[(S.READY, S.DRAINING)] = at(ready(), lc.Drain(), 101)
    out[(S.READY, S.STOPPING)] = at(ready(), lc.Stop(), 101)
    out[(S.READY, S.BACKOFF)] = at(ready(), lc.Exited(10, CRASH), 120)
    out[(S.READY, S.FATAL)] = at(
        replace(ready(), history=two_failures.history), lc.Exited(10, CRASH), 101
    )
    draining = at(ready(), lc.Drain(), 101)
    out[(S.DRAINING, S.STOPPING)] = at(draining, lc.Timer(), 104)
    out[(S.DRAINING, S.STARTING)] = at(draining, lc.Exited(10, CRASH), 102)
    out[(S.DRAINING, S.STOPPED)] = at(
        at(ready(), lc.Drain(restart=False), 101), lc.Exited(10, CRASH), 102
    )
    hung = at(ready(), lc.Timer(), 101.5)  # watchdog -> stopping (recover)
    out[(S.DRAINING, S.BACKOFF)] = at(
        replace(draining, after_exit=lc.AfterExit.RECOVER), lc.Exited(10, CRASH), 102
    )
    out[(S.DRAINING, S.FATAL)] = at(
        replace(draining, after_exit=lc.AfterExit.RECOVER, history=two_failures.history),
        lc.Exited(10, CRASH),
        102,
    )
    stopping = at(ready(), lc.Stop(), 101)
    out[(S.STOPPING, S.STOPPED)] = at(stopping, lc.Exited(10, CRASH), 102)
    out[(S.STOPPING, S.STARTING)] = at(at(ready(), lc.Restart(), 101), lc.Exited(10, CRASH), 102)
    out[(S.STOPPING, S.BACKOFF)] = at(hung, lc.Exited(10, CRASH), 102)
    out[(S.STOPPING, S.FATAL)] = at(
        replace(hung, history=two_failures.history), lc.Exited(10, CRASH), 102
    )
    backoff = out[(S.STARTING, S.BACKOFF)]
    out[(S.BACKOFF, S.STARTING)] = at(backoff, lc.Timer(), 103)
    out[(S.BACKOFF, S.STOPPED)] = at(backoff, lc.Stop(), 101.5)
    fatal = out[(S.STARTING, S.FATAL)]
    out[(S.FATAL, S.STARTING)] = at(fatal, lc.Start(), 200)
    out[(S.FATAL, S.STOPPED)] = at(fatal, lc.Stop(), 200)
    return out


def test_every_allowed_edge_is_reachable() -> None:
    """The table and the step function agree: each edge in ALLOWED has a scenario."""
    edges = _edges()
    table = {(a, b) for a, targets in ALLOWED.items() for b in targets}
    assert set(edges) == table
    for (_, new), rec in edges.items():
        assert rec.state is new


@pytest.mark.parametrize("old", list(S))
@pytest.mark.parametrize("new", list(S))
def test_transition_enforces_the_table(old: S, new: S) -> None:
    """transition() allows exactly the edges in ALLOWED."""
    if new in ALLOWED[old]:
        assert transition(old, new) is new
    else:
        with pytest.raises(IllegalTransition):
            transition(old, new)


def test_start_spawns_and_sets_start_deadline() -> None:
    rec, acts = run([lc.Start(), lc.Spawned(7)])
    assert rec.state is S.STARTING and rec.pid == 7
    assert rec.deadline == 100 + T.start_timeout_s
    assert any(isinstance(a, lc.Spawn) for a in acts)


def test_ready_none_is_ready_at_spawn_and_arms_watchdog() -> None:
    t = replace(T, ready_at_spawn=True)
    rec, _ = run([lc.Start(), lc.Spawned(7)], t=t)
    assert rec.state is S.READY and rec.deadline == 101


def test_heartbeat_pushes_the_watchdog_deadline() -> None:
    rec = at(ready(), lc.Heartbeat(10), 100.8)
    assert rec.deadline == pytest.approx(101.8)
    rec = at(rec, lc.Timer(), 101.5)  # early timer: ignored
    assert rec.state is S.READY


def test_watchdog_expiry_stops_with_reason_hang() -> None:
    rec, acts = lc.step(ready(), lc.Timer(), 101.0, T)
    assert rec.state is S.STOPPING and rec.stop_reason is ExitReason.HANG
    assert lc.SendSignal(signal.SIGTERM) in acts


def test_a_start_while_stopping_for_a_hang_gives_a_full_burst() -> None:
    """A worker with `burst` failures behind it hangs; the operator's start while it stops
    (the API accepts it: 202) gives it a full burst: its exit is judged (backoff, reason
    hang), not made fatal. Regression: the start was ignored and the worker went fatal."""
    t = replace(T, restart=replace(T.restart, burst=2, interval_s=1000))
    rec = replace(ready(), history=FailureHistory((90.0, 95.0), 2))
    hung = at(rec, lc.Timer(), 101.0, t)
    assert hung.state is S.STOPPING and hung.stop_reason is ExitReason.HANG
    assert at(hung, lc.Exited(10, CRASH), 101.5, t).state is S.FATAL  # without the start
    started_again = at(hung, lc.Start(), 101.2, t)
    rec, acts = lc.step(started_again, lc.Exited(10, CRASH), 101.5, t)
    assert rec.state is S.BACKOFF and rec.deadline == pytest.approx(102.5)
    assert next(a for a in acts if isinstance(a, lc.Exit)).failure is True


@pytest.mark.parametrize("command", [lc.Start(), lc.Restart(), lc.Restart(ExitReason.RELOAD)])
def test_a_start_while_an_operators_stop_is_under_way_gives_a_full_burst(
    command: lc.Event,
) -> None:
    """A worker with `burst` failures behind it is stopped by the operator, who starts (or
    restarts, or a reload restarts) it again before its process is gone: it starts with a full
    `burst`, as it would from stopped. Regression: the failures from before the stop were kept,
    and the next failed start made it fatal at once."""
    t = replace(T, restart=replace(T.restart, burst=2, interval_s=1000))
    rec = replace(ready(), history=FailureHistory((90.0, 95.0), 2))
    stopping = at(rec, lc.Stop(), 101.0, t)
    assert stopping.state is S.STOPPING
    rec = at(at(stopping, command, 101.1, t), lc.Exited(10, ExitStatus(None, 15)), 101.2, t)
    assert rec.state is S.STARTING, rec
    rec = at(rec, lc.Spawned(11), 101.2, t)
    rec = at(rec, lc.Exited(11, CRASH), 101.5, t)  # its first start after the stop fails
    assert rec.state is S.BACKOFF, rec


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (lc.Timer(), ExitReason.HANG),
        (lc.Restart(ExitReason.LEAK), ExitReason.LEAK),
        (lc.Restart(ExitReason.XID), ExitReason.XID),
        (lc.Drain(reason=ExitReason.LEAK), ExitReason.LEAK),  # drained for it
    ],
)
def test_a_stop_while_stopping_for_a_fault_keeps_the_fault_as_the_reason(
    fault: lc.Event, reason: ExitReason
) -> None:
    """Regression: a worker being stopped for a hang (or a healing action, or drained for
    one) ignores SIGTERM, and the supervisor is stopped (or an operator stops it) before
    stop_timeout_s: the Stop replaced the fault with its own reason (``shutdown``), so the
    exit got no post-mortem and the fault's evidence was lost. The stop still wins (it stays
    stopped), the death keeps its reason."""
    hung = at(ready(), fault, 101.0)
    assert hung.state in (S.STOPPING, S.DRAINING) and hung.stop_reason is reason
    for stop in (lc.Stop(ExitReason.SHUTDOWN), lc.Stop()):
        rec = at(hung, stop, 101.2)
        assert rec.after_exit is lc.AfterExit.STOP and rec.stop_reason is reason
        rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(None, 9)), 103.5, T)
        assert rec.state is S.STOPPED
        (exit_,) = [a for a in acts if isinstance(a, lc.Exit)]
        assert exit_.outcome.reason is reason and exit_.failure is False
    # a stop of a worker restarted by an operator (no fault) is a stop as before
    rec = at(at(ready(), lc.Restart(), 101), lc.Stop(ExitReason.SHUTDOWN), 101.2)
    assert rec.stop_reason is ExitReason.SHUTDOWN


@pytest.mark.parametrize("watchdog_s", [1.0, 0.0])
def test_watchdog_trigger_is_a_hang_at_once(watchdog_s: float) -> None:
    """WATCHDOG=trigger (systemd: the service found itself hung) stops a starting or ready
    worker with reason hang, judged like a crash, whether watchdog_s is set or not; a draining
    one is going anyway, and another process's trigger is ignored."""
    t = replace(T, watchdog_s=watchdog_s)
    trigger = lc.Heartbeat(10, trigger=True)
    for rec in (started(), ready()):
        rec, acts = lc.step(rec, trigger, 100.5, t)
        assert rec.state is S.STOPPING and rec.stop_reason is ExitReason.HANG
        assert rec.after_exit is lc.AfterExit.RECOVER and lc.SendSignal(signal.SIGTERM) in acts
    draining = at(ready(), lc.Drain(), 100.2, t)
    assert at(draining, trigger, 100.5, t) == draining
    assert at(ready(), lc.Heartbeat(99, trigger=True), 100.5, t).state is S.READY


def test_stop_timeout_kills_the_tree_once() -> None:
    rec = at(ready(), lc.Stop(), 101)
    rec, acts = lc.step(rec, lc.Timer(), 103, T)
    assert acts == [lc.KillTree()] and rec.killed
    rec, acts = lc.step(rec, lc.Timer(), 104, T)
    assert acts == []


def test_stable_exit_restarts_after_delay_and_resets_streak() -> None:
    rec = replace(ready(), history=FailureHistory((50.0,), 3))
    rec, acts = lc.step(rec, lc.Exited(10, CRASH), 111, T)
    assert rec.state is S.BACKOFF and rec.deadline == 111.5
    assert rec.history.consecutive == 0
    assert next(a for a in acts if isinstance(a, lc.Exit)).failure is False


def test_failures_back_off_exponentially_then_go_fatal() -> None:
    t = replace(T, restart=replace(T.restart, burst=3))
    rec = lc.WorkerRecord()
    now = 100.0
    delays = []
    for pid in range(1, 5):
        rec = at(rec, lc.Start() if rec.state is S.STOPPED else lc.Timer(), now, t)
        rec = at(rec, lc.Spawned(pid), now, t)
        rec = at(rec, lc.Exited(pid, CRASH), now + 0.1, t)
        if rec.state is S.FATAL:
            break
        assert rec.deadline is not None
        delays.append(rec.deadline - (now + 0.1))
        now = rec.deadline
    assert delays == [1, 2, 4]
    assert rec.state is S.FATAL


def test_burst_zero_never_goes_fatal() -> None:
    t = replace(T, restart=replace(T.restart, burst=0))
    rec = at(lc.WorkerRecord(), lc.Start(), 0.0, t)
    now = 0.0
    delays = []
    for pid in range(1, 30):
        rec = at(rec, lc.Spawned(pid), now, t)
        rec = at(rec, lc.Exited(pid, CRASH), now, t)
        assert rec.state is S.BACKOFF
        assert rec.deadline is not None
        delays.append(rec.deadline - now)
        now = rec.deadline
        rec = at(rec, lc.Timer(), now, t)
    assert delays[:5] == [1, 2, 4, 8, 8]
    assert delays[-1] == 8


def test_spawn_failure_counts_as_failure() -> None:
    rec = at(lc.WorkerRecord(), lc.Start(), 0)
    rec, _ = lc.step(rec, lc.SpawnFailed("no such file"), 0, T)
    assert rec.state is S.BACKOFF
    assert rec.last_exit is not None and rec.last_exit.reason is ExitReason.SPAWN_FAILED


def no_gpu(rec: lc.WorkerRecord, now: float) -> tuple[lc.WorkerRecord, list[lc.Action]]:
    """A start (from ``rec`` in BACKOFF or STOPPED) that found no GPU to place on."""
    rec = at(rec, lc.Timer() if rec.state is S.BACKOFF else lc.Start(), now)
    assert rec.state is S.STARTING and rec.pid is None
    return lc.step(rec, lc.NoGpu("GPU 0 is quarantined (xid 79)"), now, T)


def test_no_gpu_waits_in_backoff_without_counting_a_failure() -> None:
    """No GPU to place on is the machine's state, not the worker's: it waits (the backoff's
    doubling, capped) for as long as it takes, and never goes fatal for it (burst is 2)."""
    rec, acts = no_gpu(lc.WorkerRecord(), 0.0)
    assert rec.state is S.BACKOFF and rec.waiting_for_gpu
    assert rec.reason == "waiting for a GPU: GPU 0 is quarantined (xid 79)"
    assert not [a for a in acts if isinstance(a, lc.Exit)]  # no process ended: no post-mortem
    assert rec.history == FailureHistory() and rec.last_exit is None
    now, delays = 0.0, []
    for _ in range(40):
        assert rec.deadline is not None
        delays.append(rec.deadline - now)
        now = rec.deadline
        rec, _ = no_gpu(rec, now)
        assert rec.state is S.BACKOFF
    assert delays[:5] == [1, 2, 4, 8, 8] and delays[-1] == 8  # backoff_max_s = 8
    assert rec.restarts == 0


def test_a_gpu_freed_wakes_only_a_worker_waiting_for_one() -> None:
    rec, _ = no_gpu(lc.WorkerRecord(), 0.0)
    rec, acts = lc.step(rec, lc.GpuFreed(), 0.5, T)
    assert rec.state is S.STARTING and lc.Spawn() in acts and rec.reason == "a GPU became usable"
    rec = at(rec, lc.Spawned(7), 0.5)
    assert rec.gpu_waits == 0  # placed at last: the next wait starts from backoff_initial_s
    crashed = at(rec, lc.Exited(7, CRASH), 1.0)
    assert crashed.state is S.BACKOFF and not crashed.waiting_for_gpu
    assert lc.step(crashed, lc.GpuFreed(), 1.1, T) == (crashed, [])  # a failure's backoff
    assert lc.step(ready(), lc.GpuFreed(), 101, T) == (ready(), [])


def test_stop_while_waiting_for_a_gpu_forgets_the_wait() -> None:
    rec, _ = no_gpu(lc.WorkerRecord(), 0.0)
    rec, _ = no_gpu(rec, 1.0)
    assert rec.gpu_waits == 2
    stopped = at(rec, lc.Stop(), 2.0)
    assert stopped.state is S.STOPPED and stopped.gpu_waits == 0
    rec, _ = no_gpu(stopped, 3.0)
    assert rec.deadline == 4.0  # from the first delay again
    assert at(rec, lc.Kill("second signal"), 3.5).gpu_waits == 0


def test_only_the_repeats_of_the_same_wait_for_a_gpu_are_quiet() -> None:
    """Regression: a worker waiting for a GPU logged its two ``worker.state`` lines (backoff ->
    starting, starting -> backoff) at info at each look (up to one a minute) for as long as
    it waited: ~2900 lines a day per worker on a node whose GPU is gone. The lifecycle now
    marks the repeats of the same wait (``repeat``: logged at debug); the first wait, a
    change of reason, a wake by a freed GPU and whatever ends the wait stay at info."""

    def said(acts: list[lc.Action]) -> list[tuple[S, S, bool]]:
        return [(a.old, a.new, a.repeat) for a in acts if isinstance(a, lc.Transitioned)]

    rec, acts = lc.step(lc.WorkerRecord(), lc.Start(), 0.0, T)
    assert said(acts) == [(S.STOPPED, S.STARTING, False)]
    rec, acts = lc.step(rec, lc.NoGpu("GPU 0 is lost"), 0.0, T)
    assert said(acts) == [(S.STARTING, S.BACKOFF, False)]  # the first: said
    for _ in range(3):  # the same wait, look after look: quiet
        assert rec.deadline is not None
        now = rec.deadline
        rec, acts = lc.step(rec, lc.Timer(), now, T)
        assert said(acts) == [(S.BACKOFF, S.STARTING, True)]
        rec, acts = lc.step(rec, lc.NoGpu("GPU 0 is lost"), now, T)
        assert said(acts) == [(S.STARTING, S.BACKOFF, True)]
        assert rec.state is S.BACKOFF and rec.reason == "waiting for a GPU: GPU 0 is lost"
    assert rec.deadline is not None
    rec = at(rec, lc.Timer(), rec.deadline)
    rec, acts = lc.step(rec, lc.NoGpu("GPU 0 is quarantined (xid 79)"), rec.deadline or 0, T)
    assert said(acts) == [(S.STARTING, S.BACKOFF, False)]  # another reason: said
    rec, acts = lc.step(rec, lc.GpuFreed(), 30.0, T)
    assert said(acts) == [(S.BACKOFF, S.STARTING, False)]  # woken: said
    rec, acts = lc.step(rec, lc.NoGpu("GPU 0 is quarantined (xid 79)"), 30.0, T)
    assert said(acts) == [(S.STARTING, S.BACKOFF, True)]  # the same wait again
    stopped, acts = lc.step(rec, lc.Stop(), 31.0, T)
    assert said(acts) == [(S.BACKOFF, S.STOPPED, False)]
    rec, acts = lc.step(stopped, lc.Start(), 32.0, T)
    rec, acts = lc.step(rec, lc.NoGpu("GPU 0 is quarantined (xid 79)"), 32.0, T)
    assert said(acts) == [(S.STARTING, S.BACKOFF, False)]  # a new wait: said


def test_a_failure_after_a_wait_for_a_gpu_is_a_failure() -> None:
    """A start after a wait that fails for another reason (the program is gone) backs off as
    a failure: a GPU freed meanwhile does not cut that backoff short."""
    rec, _ = no_gpu(lc.WorkerRecord(), 0.0)
    rec = at(rec, lc.Timer(), 1.0)
    rec = at(rec, lc.SpawnFailed("no such file"), 1.0)
    assert rec.state is S.BACKOFF and not rec.waiting_for_gpu and rec.gpu_waits == 0
    assert lc.step(rec, lc.GpuFreed(), 1.5, T) == (rec, [])


@pytest.mark.parametrize(
    ("initial", "cap", "expected"),
    [
        (0.0, 60.0, [1, 2, 4, 8, 16, 32, 60, 60]),  # never a busy loop
        (0.05, 0.2, [1, 1, 1, 1, 1, 1, 1, 1]),  # a fast crash backoff: still 1 s between looks
        (5.0, 600.0, [5, 10, 20, 40, 60, 60, 60, 60]),  # at most a minute between looks
    ],
)
def test_gpu_wait_bounds(initial: float, cap: float, expected: list[float]) -> None:
    policy = RestartPolicy(backoff_initial_s=initial, backoff_max_s=cap)
    assert [lc.gpu_wait_s(policy, n) for n in range(1, 9)] == expected
    assert lc.gpu_wait_s(policy, 10_000) == expected[-1]


def test_stale_events_are_ignored() -> None:
    rec = ready(pid=10)
    assert lc.step(rec, lc.Exited(99, CRASH), 101, T) == (rec, [])
    assert lc.step(rec, lc.Heartbeat(99), 101, T) == (rec, [])


def test_drain_sends_drain_signal_and_restarts_after_exit() -> None:
    rec, acts = lc.step(ready(), lc.Drain(), 101, T)
    assert rec.state is S.DRAINING and lc.SendSignal(signal.SIGUSR1) in acts
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(0, None)), 102, T)
    assert rec.state is S.STARTING and lc.Spawn() in acts


def test_drain_timeout_then_stop_signal() -> None:
    rec = at(ready(), lc.Drain(restart=False), 101)
    rec, acts = lc.step(rec, lc.Timer(), 104, T)
    assert rec.state is S.STOPPING and lc.SendSignal(signal.SIGTERM) in acts
    rec = at(rec, lc.Exited(10, ExitStatus(None, 15)), 105)
    assert rec.state is S.STOPPED


def test_operator_restart_is_not_a_failure() -> None:
    rec = at(ready(), lc.Restart(), 101)
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(None, 15)), 101.5, T)
    assert rec.state is S.STARTING and rec.history.consecutive == 0 and rec.restarts == 1
    assert next(a for a in acts if isinstance(a, lc.Exit)).failure is False


def test_stop_wins_over_pending_restart() -> None:
    rec = at(ready(), lc.Restart(), 101)
    rec = at(rec, lc.Stop(), 101.2)
    rec = at(rec, lc.Exited(10, ExitStatus(None, 15)), 101.5)
    assert rec.state is S.STOPPED


def test_a_healing_restart_does_not_undo_a_stop() -> None:
    """A stop (operator, reload, shutdown) in progress, then a healing restart (a sticky error
    in the last lines, an XID): the worker stays stopped. An operator's restart still wins."""
    for stopping in (lc.Stop(), lc.Drain(restart=False)):
        rec = at(ready(), stopping, 101)
        rec = at(rec, lc.Restart(ExitReason.LOG_PATTERN), 101.1)
        # a draining one is not left to finish its drain on a broken GPU: stopped now
        assert rec.state is S.STOPPING and rec.after_exit is lc.AfterExit.STOP
        rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(None, 15)), 101.5, T)
        assert rec.state is S.STOPPED, stopping
        (exit_,) = [a for a in acts if isinstance(a, lc.Exit)]
        # regression: a drain cut short by an XID was recorded as a drain that timed out
        want = ExitReason.LOG_PATTERN if isinstance(stopping, lc.Drain) else ExitReason.STOP
        assert exit_.outcome.reason is want, exit_
    rec = at(at(ready(), lc.Stop(), 101), lc.Restart(), 101.1)
    rec = at(rec, lc.Exited(10, ExitStatus(None, 15)), 101.5)
    assert rec.state is S.STARTING
    # stopped before it was spawned, or waiting out a backoff: nothing to restart
    rec = at(at(lc.WorkerRecord(), lc.Start(), 100), lc.Stop(), 100.1)
    assert rec.state is S.STOPPED
    assert lc.step(rec, lc.Restart(ExitReason.XID), 100.2, T) == (rec, [])
    rec = at(started(), lc.Exited(10, ExitStatus(1, None)), 100.5)
    assert rec.state is S.BACKOFF
    assert lc.step(rec, lc.Restart(ExitReason.LOG_PATTERN), 100.6, T) == (rec, [])
    assert lc.step(rec, lc.Restart(ExitReason.MAX_AGE), 100.6, T) == (rec, [])


def test_a_recycle_drains_then_restarts_without_counting_a_failure() -> None:
    """``max_age_s``: drained (out of routing, the drain signal), then restarted at once; an
    exit soon after the start is no failed start (the supervisor asked for it)."""
    t = replace(T, drain_signal=signal.SIGUSR1)
    rec, acts = lc.step(ready(), lc.Drain(restart=True, reason=ExitReason.MAX_AGE), 101, t)
    assert rec.state is S.DRAINING and rec.reason == "max_age"
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(0, None)), 101.5, t)
    (exit_,) = [a for a in acts if isinstance(a, lc.Exit)]
    assert exit_.outcome.reason is ExitReason.MAX_AGE and not exit_.failure
    assert rec.state is S.STARTING


def test_a_recycle_that_finds_a_new_process_starting_leaves_it_alone() -> None:
    """A recycle is asked for a ready process; the process crashed before the worker's queue
    got to the drain, and (``delay_s`` 0) its replacement was spawned in the same step. The
    drain is for the process that died: the one loading now (0 s old) is not stopped (the
    drain of a starting worker stops it at once: a second load for nothing)."""
    rec = at(
        ready(), lc.Exited(10, ExitStatus(None, 11)), 200.0, replace(T, restart=RestartPolicy())
    )
    rec = at(rec, lc.Spawned(11), 200.0)
    assert rec.state is S.STARTING and rec.pid == 11
    assert lc.step(rec, lc.Drain(restart=True, reason=ExitReason.MAX_AGE), 200.0, T) == (rec, [])


def test_kill_event_kills_at_once_and_stays_stopped() -> None:
    rec, acts = lc.step(ready(), lc.Kill("shutdown timeout"), 101, T)
    # the kill says why (regression: always "stop timeout", after a second SIGTERM too)
    assert lc.KillTree("shutdown timeout") in acts and rec.after_exit is lc.AfterExit.STOP
    rec = at(rec, lc.Exited(10, ExitStatus(None, 9)), 101.1)
    assert rec.state is S.STOPPED


def test_fatal_is_cleared_by_start() -> None:
    rec = _edges()[(S.STARTING, S.FATAL)]
    rec, _ = lc.step(rec, lc.Start(), 300, T)
    assert rec.state is S.STARTING and rec.history == FailureHistory()


@pytest.mark.parametrize("event", [lc.Start(), lc.Restart(), lc.Restart(ExitReason.RELOAD)])
@pytest.mark.parametrize("state", [S.BACKOFF, S.STOPPED])
def test_a_start_from_backoff_or_stopped_begins_a_new_failure_history(
    event: lc.Event, state: S
) -> None:
    """Regression: a worker in backoff (or stopped by an operator after failures) kept its
    failures across an operator's start or a reload's new definition, which then got one or
    two tries before `fatal`, with the old backoff (fatal cleared the history; these did not)."""
    crashed = at(started(), lc.Exited(10, CRASH), 100.5)
    assert crashed.state is S.BACKOFF and crashed.history.consecutive == 1
    rec = crashed if state is S.BACKOFF else at(crashed, lc.Stop(), 100.6)
    assert rec.state is state and rec.history.consecutive == 1
    rec = at(rec, event, 100.7)
    assert rec.state is S.STARTING and rec.history == FailureHistory()


@pytest.mark.parametrize(
    ("policy", "exit_at"),
    [
        (replace(T.restart, delay_s=0.0), 120.0),  # a stable run, restarted without delay
        (replace(T.restart, backoff_initial_s=0.0, burst=0), 100.0),  # a failure, no backoff
    ],
)
def test_a_zero_delay_restarts_in_the_exit_step(policy: RestartPolicy, exit_at: float) -> None:
    t = replace(T, restart=policy)
    rec, actions = lc.step(ready(), lc.Exited(10, CRASH), exit_at, t)
    assert rec.state is S.STARTING and rec.pid is None and rec.restarts == 1
    assert transitions(actions) == [(S.READY, S.BACKOFF), (S.BACKOFF, S.STARTING)]
    assert isinstance(actions[0], lc.Exit) and isinstance(actions[-1], lc.Spawn)
    assert rec.reason == "backoff elapsed" and rec.last_exit is not None


def test_a_delay_waits_for_the_timer() -> None:
    rec, actions = lc.step(ready(), lc.Exited(10, CRASH), 120.0, T)
    assert rec.state is S.BACKOFF and rec.deadline == 120.5
    assert not any(isinstance(a, lc.Spawn) for a in actions)


def test_a_healing_restart_of_an_unstable_worker_counts_as_a_failure() -> None:
    """A worker that is over its budget (or leaks, or trips an XID) again right after every
    start backs off and goes fatal instead of restarting in a tight loop (DESIGN.md section 5:
    never a restart storm); a stable worker is restarted at once (``delay_s``), not counted.
    Regression: every healing restart started the replacement at once and counted nothing."""
    over = ExitReason.GPU_MEMORY_LIMIT
    rec, acts = run([lc.Restart(over), lc.Exited(10, CRASH)], ready(100.0), start=101.0)
    assert rec.state is S.BACKOFF and rec.deadline == 101.0 + 1  # backoff_initial_s
    assert [a.failure for a in acts if isinstance(a, lc.Exit)] == [True]
    rec = at(rec, lc.Timer(), 102.0)
    rec = at(at(rec, lc.Spawned(11), 102.0), lc.Ready(11), 102.0)
    rec = at(at(rec, lc.Drain(reason=over), 103.0), lc.Exited(11, CRASH), 103.0)
    assert rec.state is S.BACKOFF and rec.deadline == 103.0 + 2  # doubled
    rec = at(at(at(rec, lc.Timer(), 105.0), lc.Spawned(12), 105.0), lc.Restart(over), 106.0)
    rec = at(rec, lc.Exited(12, CRASH), 106.0)
    assert rec.state is S.FATAL and "gpu_memory_limit" in rec.reason  # burst 2
    # ready for stable_s: restarted after delay_s (0.5 s here), not counted
    leak: list[lc.Event] = [lc.Drain(reason=ExitReason.LEAK), lc.Exited(10, CRASH)]
    rec, acts = run(leak, ready(100.0), start=120.0)
    assert rec.state is S.BACKOFF and rec.deadline == 120.5 and rec.history == FailureHistory()
    assert [a.failure for a in acts if isinstance(a, lc.Exit)] == [False]
    # an operator's restart is not judged: started again at once
    rec, _ = run([lc.Restart(), lc.Exited(10, CRASH)], ready(100.0), start=101.0)
    assert rec.state is S.STARTING


def test_a_migration_off_a_hot_gpu_is_no_failed_start() -> None:
    """The GPU's heat is not the worker's doing. Regression: a GPU that turned hot within
    stable_s of the start made the migration a failed start (backoff, toward fatal)."""
    for reason, failure in ((ExitReason.THERMAL, False), (ExitReason.LEAK, True)):
        rec = at(ready(), lc.Drain(restart=True, reason=reason), 101)
        rec = at(rec, lc.Timer(), 104.1)  # the drain ran out: stopped
        rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(None, 15)), 104.2, T)
        (exit_,) = [a for a in acts if isinstance(a, lc.Exit)]
        assert exit_.failure is failure, reason


@pytest.mark.parametrize(
    "reason",
    [
        ExitReason.XID,
        ExitReason.GPU_LOST,
        ExitReason.ROW_REMAP_FAILURE,
        ExitReason.RECOVERY_ACTION,
    ],
)
@pytest.mark.parametrize("loading", [True, False])
def test_a_move_off_a_failed_gpu_is_no_failed_start(reason: ExitReason, loading: bool) -> None:
    """A GPU that fails (a device-fatal XID, lost, a failed row remap, a reset asked for) while
    its worker loads, or within ``stable_s`` of its start, drains it to another GPU: the GPU's
    doing, not the worker's. Regression: it counted as a failed start (backoff before the
    move; a worker with failures already went ``fatal`` instead of moving to a healthy GPU)."""
    rec = replace(started(), history=FailureHistory((99.0, 99.5), 2))  # burst 2: one more fatal
    if not loading:
        rec = at(rec, lc.Ready(10), 100.5)
    rec = at(rec, lc.Drain(restart=True, reason=reason), 101)
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(None, 15)), 101.2, T)
    (exit_,) = [a for a in acts if isinstance(a, lc.Exit)]
    assert exit_.failure is False and rec.state is S.STARTING, rec
    # a worker-fatal XID restarts the worker (its own fault, maybe): a failed start still
    rec = at(started(), lc.Restart(reason=ExitReason.XID), 101)
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(None, 15)), 101.2, T)
    assert [a.failure for a in acts if isinstance(a, lc.Exit)] == [True]


def test_an_operators_drain_of_a_worker_healing_drains_keeps_it_stopped() -> None:
    """Regression: `drain GROUP` while healing drained one of its workers was ignored for that
    worker (which restarted after the healing drain) though the client said it was drained."""
    rec = at(ready(), lc.Drain(restart=True, reason=ExitReason.LEAK), 101)
    assert rec.state is S.DRAINING and rec.after_exit is lc.AfterExit.RECOVER
    rec, acts = lc.step(rec, lc.Drain(restart=False), 101.5, T)  # the operator's
    assert acts == [] and rec.after_exit is lc.AfterExit.STOP and rec.deadline == 104
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(0, None)), 102, T)
    assert rec.state is S.STOPPED
    (exit_,) = [a for a in acts if isinstance(a, lc.Exit)]
    assert exit_.outcome.reason is ExitReason.LEAK  # what it was drained for


def test_an_operators_drain_of_a_worker_being_recycled_stops_it_as_the_operators() -> None:
    """Regression: an operator's drain of a worker that a scheduled recycle (``max_age_s``)
    was draining left it stopped for "max_age" (its state's reason, its exit's, the journal),
    as if a recycle stopped workers for good; a stop, or the same drain a moment later (its
    drain timed out, stopping), said the operator's reason. A recycle is no fault whose death
    the stop must keep: the operator's drain is why it stays stopped."""
    rec = at(ready(), lc.Drain(restart=True, reason=ExitReason.MAX_AGE), 101)
    assert rec.state is S.DRAINING
    rec, acts = lc.step(rec, lc.Drain(restart=False), 101.5, T)  # the operator's
    assert acts == [] and rec.after_exit is lc.AfterExit.STOP and rec.deadline == 104
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(0, None)), 102, T)
    assert rec.state is S.STOPPED and rec.reason == "drain"
    (exit_,) = [a for a in acts if isinstance(a, lc.Exit)]
    assert exit_.outcome.reason is ExitReason.DRAIN and not exit_.failure


def test_a_new_start_timeout_applies_to_a_worker_still_loading() -> None:
    """A reload applied in place (Retime): the start deadline already set follows the new
    start_timeout_s, counted from the spawn. Regression: a raised one came too late, the old
    one failed the load; other states keep their deadlines."""
    rec = started(now=100.0)
    assert rec.deadline == 105.0  # T.start_timeout_s = 5
    longer = replace(T, start_timeout_s=30.0)
    rec, acts = lc.step(rec, lc.Retime(), 104.0, longer)
    assert acts == [] and rec.deadline == 130.0 and rec.state is S.STARTING
    assert lc.step(ready(), lc.Retime(), 104.0, longer) == (ready(), [])


@pytest.mark.parametrize(
    ("name", "queue", "loading", "limit", "expected"),
    [
        ("a", [], set(), 0, True),  # no limit
        ("a", ["a", "b", "c"], set(), 2, True),
        ("b", ["a", "b", "c"], set(), 2, True),
        ("c", ["a", "b", "c"], set(), 2, False),  # its turn comes after a's or b's start
        ("a", ["a", "b"], {"x"}, 2, True),
        ("b", ["a", "b"], {"x"}, 2, False),
        ("a", ["a"], {"a"}, 1, True),  # its own (stale) slot is not in its way
        ("a", ["a"], {"x", "y"}, 1, False),  # a reload lowered the limit below what starts
        ("z", ["a"], set(), 2, False),  # not waiting: not its turn
    ],
)
def test_may_start_is_first_come_first_served_within_max_starting(
    name: str, queue: list[str], loading: set[str], limit: int, expected: bool
) -> None:
    assert lc.may_start(name, queue, loading, limit) is expected


@pytest.mark.parametrize("burst", [0, 3])
def test_a_failed_spawn_never_retries_in_the_same_step(burst: int) -> None:
    """A program that cannot be executed, with ``backoff_initial_s = 0``: the retry waits for a
    Timer (at least ``SPAWN_RETRY_MIN_S``). Regression: the zero delay spawned again within the
    step of the failure, whose answer is the next failure, in a loop that never yielded (the
    supervisor froze: no API, no signals, an endless stream of ``worker.spawn_failed``)."""
    t = replace(
        T, restart=replace(T.restart, backoff_initial_s=0.0, backoff_max_s=0.0, burst=burst)
    )
    rec = at(lc.WorkerRecord(), lc.Start(), 0.0, t)
    rec, actions = lc.step(rec, lc.SpawnFailed("no such file"), 0.0, t)
    assert rec.state is S.BACKOFF and not any(isinstance(a, lc.Spawn) for a in actions)
    assert rec.deadline == lc.SPAWN_RETRY_MIN_S
    # a process that ran and failed is still restarted at once (it came from the reaper)
    crashed, actions = lc.step(started(pid=10), lc.Exited(10, CRASH), 100.5, t)
    assert crashed.state is S.STARTING and isinstance(actions[-1], lc.Spawn)


@pytest.mark.parametrize("waiting", ["backoff", "preparing"])
def test_an_operators_drain_of_a_group_stops_its_workers_that_are_not_up(waiting: str) -> None:
    """``drain GROUP`` takes every worker of the group down for good: one in backoff after a
    crash, or about to spawn (waiting for its GPU's release, its turn), stays stopped too, as
    one still loading does. Regression: they ignored the drain and started afterwards, so the
    drained group came back up."""
    if waiting == "backoff":
        rec = at(started(), lc.Exited(10, CRASH), 100.5)
        assert rec.state is S.BACKOFF
    else:
        rec = at(lc.WorkerRecord(), lc.Start(), 100.0)
        assert rec.state is S.STARTING and rec.pid is None
    # a healing drain (restart=True) of it has nothing to do
    assert lc.step(rec, lc.Drain(restart=True, reason=ExitReason.LEAK), 100.6, T) == (rec, [])
    stopped, actions = lc.step(rec, lc.Drain(restart=False), 100.6, T)
    assert stopped.state is S.STOPPED and stopped.deadline is None
    assert not any(isinstance(a, lc.Spawn) for a in actions)
    assert lc.step(stopped, lc.Timer(), 200.0, T)[0].state is S.STOPPED


def test_a_restart_after_a_stable_run_forgets_the_old_failure_streak() -> None:
    """An operator's (or a reload's) restart of a worker that had been ready for ``stable_s``:
    a failed start afterwards backs off from ``backoff_initial_s``. Regression: the streak of
    failures from before the stable run was kept, so the first failure waited 8 s (or up to
    ``backoff_max_s``) as if the starts had failed in a row."""
    rec = at(started(), lc.Exited(10, CRASH), 100.5)  # 1st failure
    rec = at(rec, lc.Timer(), 101.5)
    rec = at(rec, lc.Spawned(11), 101.5)
    rec = at(rec, lc.Exited(11, CRASH), 102.0)  # 2nd
    rec = at(rec, lc.Timer(), 104.0)
    rec = at(rec, lc.Spawned(12), 104.0)
    rec = at(rec, lc.Ready(12), 105.0)
    assert rec.state is S.READY and rec.history.consecutive == 2
    rec = at(rec, lc.Restart(), 500.0)  # ready for far longer than stable_s (10)
    rec = at(rec, lc.Exited(12, ExitStatus(None, signal.SIGTERM)), 500.5)
    assert rec.state is S.STARTING
    rec = at(rec, lc.Spawned(13), 500.5)
    rec = at(rec, lc.Exited(13, CRASH), 501.0)
    assert rec.state is S.BACKOFF and rec.deadline == 501.0 + T.restart.backoff_initial_s


@pytest.mark.parametrize(
    ("raw", "expected", "described"),
    [
        (3 << 8, ExitStatus(3, None), "exit code 3"),
        (signal.SIGKILL, ExitStatus(None, signal.SIGKILL), "killed by SIGKILL"),
        (
            signal.SIGSEGV | 0x80,
            ExitStatus(None, signal.SIGSEGV, True),
            "killed by SIGSEGV (core dumped)",
        ),
    ],
)
def test_a_wait_status_is_decoded_with_its_core_dump(
    raw: int, expected: ExitStatus, described: str
) -> None:
    status = ExitStatus.from_wait_status(raw)
    assert status == expected and status.describe() == described


@pytest.mark.parametrize(("event", "state"), [(lc.Restart(), S.STARTING), (lc.Stop(), S.STOPPED)])
def test_a_process_dead_before_the_operators_stop_signal_keeps_its_crash(
    event: lc.Restart | lc.Stop, state: WorkerState
) -> None:
    """Regression: a worker that crashed on its own just before an operator's restart or stop
    (its process already ended when the stop signal was to be sent) had its death called
    ``restart``/``stop``: no post-mortem, and ``last_exit.reason`` hid the crash. The operator's
    restart (or stop) still happens; the death is judged as the crash it was."""
    stopping, acts = lc.step(ready(), event, 101, T)
    assert lc.SendSignal(T.stop_signal) in acts
    rec, acts = lc.step(stopping, lc.Exited(10, CRASH, unasked=True), 101.1, T)
    assert rec.state is state
    exits = [a for a in acts if isinstance(a, lc.Exit)]
    assert [e.outcome.reason for e in exits] == [ExitReason.EXIT]
    # the process that ended after the signal was ours to stop
    rec, acts = lc.step(stopping, lc.Exited(10, CRASH), 101.1, T)
    assert [a.outcome.reason for a in acts if isinstance(a, lc.Exit)] == [event.reason]


@pytest.mark.parametrize(
    "toward",
    [
        lc.Drain(restart=True, reason=ExitReason.GPU_LOST),  # healing, while it loaded
        lc.Restart(reason=ExitReason.LEAK),  # healing
        lc.Restart(),  # an operator's restart
        lc.Heartbeat(10, trigger=True),  # hung
    ],
)
def test_an_operators_drain_of_a_stopping_worker_keeps_it_stopped(toward: lc.Event) -> None:
    """Regression: `drain GROUP` reaches every worker of the group; one that was stopping on
    its way to a restart (a healing action, a hang, an operator's restart) ignored the drain
    and started again once its process was gone: the drained group came back."""
    rec = at(started(), toward, 101)
    assert rec.state is S.STOPPING and rec.after_exit is not lc.AfterExit.STOP
    rec, acts = lc.step(rec, lc.Drain(restart=False), 101.5, T)  # the operator's
    assert acts == [] and rec.after_exit is lc.AfterExit.STOP
    rec, acts = lc.step(rec, lc.Exited(10, ExitStatus(None, 15)), 102, T)
    assert rec.state is S.STOPPED and lc.Spawn() not in acts


@pytest.mark.parametrize("command", [lc.Restart(), lc.Restart(ExitReason.RELOAD)])
def test_an_operators_restart_of_a_worker_stopped_for_a_fault_is_a_new_beginning(
    command: lc.Restart,
) -> None:
    """Regression: a restart (an operator's, or a reload's) of a worker being stopped for a
    fault (here a start timeout) was accepted, then ignored: its exit was judged against the
    failures from before, and the worker the operator restarted went ``fatal`` (a start there
    gives it a full ``burst``, as from backoff or fatal: so must a restart)."""
    loading = replace(started(), history=FailureHistory(times=(98.0, 99.0), consecutive=2))
    stopping = at(loading, lc.Timer(), 105)  # start timeout: stopped, to be judged
    assert stopping.state is S.STOPPING and stopping.after_exit is lc.AfterExit.RECOVER
    rec = at(at(stopping, command, 105.5), lc.Exited(10, ExitStatus(None, 15)), 106)
    assert rec.state is not S.FATAL
    as_started = at(at(stopping, lc.Start(), 105.5), lc.Exited(10, ExitStatus(None, 15)), 106)
    assert rec == as_started


@pytest.mark.parametrize("command", [lc.Restart(), lc.Restart(ExitReason.RELOAD)])
@pytest.mark.parametrize("loaded", [False, True])
def test_an_operators_restart_of_a_crash_looping_running_worker_gives_a_full_burst(
    command: lc.Restart, loaded: bool
) -> None:
    """Regression: an operator's restart (or a rolling restart, or a reload's restart of a
    changed group) of a crash-looping worker that was starting (or ready for less than
    ``stable_s``) kept the failures from before: the first failed start of the restarted
    process made it ``fatal`` (a reload's fixed definition got one try), where the same
    restart in backoff, fatal or while stopping gives a full ``burst``."""
    t = replace(T, restart=replace(T.restart, burst=2, interval_s=1000))
    rec = replace(started(), history=FailureHistory((98.0, 99.0), 2))
    if loaded:
        rec = at(rec, lc.Ready(10), 100.5, t)
    rec = at(rec, command, 101, t)
    assert rec.state is S.STOPPING
    rec = at(rec, lc.Exited(10, ExitStatus(None, 15)), 101.2, t)
    assert rec.state is S.STARTING
    rec = at(at(rec, lc.Spawned(11), 101.3, t), lc.Exited(11, CRASH), 101.5, t)
    assert rec.state is S.BACKOFF, rec
    assert rec.history == FailureHistory((101.5,), 1)


def test_a_new_restart_policy_applies_to_a_worker_in_backoff() -> None:
    """Regression: a reload that changes only the restart policy ("applies to them at once")
    left a worker already in backoff on the old delay: one whose crash loop backed off to
    ``backoff_max_s`` waited that long again after the operator lowered it (or ``delay_s``,
    after a stable run). The delay now follows the new policy, counted from the exit."""
    slow = replace(T, restart=replace(T.restart, backoff_initial_s=30, backoff_max_s=60))
    rec = replace(started(), history=FailureHistory((90.0,), 1))
    rec = at(rec, lc.Exited(10, CRASH), 101.0, slow)  # second failure in a row: 60 s
    assert rec.state is S.BACKOFF and rec.deadline == 161.0
    quick = replace(T, restart=replace(T.restart, backoff_initial_s=0.5, backoff_max_s=2))
    rec, acts = lc.step(rec, lc.Retime(), 101.5, quick)
    assert acts == [] and rec.deadline == 102.0 and rec.state is S.BACKOFF  # 2 x 0.5 s
    rec, acts = lc.step(rec, lc.Retime(), 103.0, quick)
    assert rec.deadline == 102.0  # past already: the next Timer starts it
    assert lc.step(rec, lc.Timer(), 103.0, quick)[0].state is S.STARTING
    # after a stable run, the new delay_s
    stable = replace(slow, restart=replace(slow.restart, delay_s=40))
    rec = at(ready(), lc.Exited(10, CRASH), 120.0, stable)
    assert rec.state is S.BACKOFF and rec.deadline == 160.0
    assert at(rec, lc.Retime(), 121.0, quick).deadline == 120.5  # quick's delay_s


# --- sd_notify EXTEND_TIMEOUT_USEC and WATCHDOG_USEC (systemd's meaning) ----------------------


def test_extend_timeout_moves_the_start_deadline_from_its_arrival() -> None:
    """Regression: a worker that sent EXTEND_TIMEOUT_USEC while it loaded (a model that loads
    for minutes, written for a systemd ``Type=notify`` service) was stopped at
    ``start_timeout_s`` all the same. Each message extends from its arrival; a Timer at the old
    deadline does nothing; the new one is a start timeout as before."""
    rec = started(100.0)  # start deadline 105
    rec, acts = lc.step(rec, lc.ExtendTimeout(10, 30.0), 104.0, T)
    assert rec.deadline == 134.0 and rec.state is S.STARTING
    assert acts == [lc.Extended(S.STARTING, 30.0, 134.0, first=True)]
    assert at(rec, lc.Timer(), 105.0).state is S.STARTING
    rec, acts = lc.step(rec, lc.ExtendTimeout(10, 30.0), 120.0, T)
    assert rec.deadline == 150.0 and acts == [lc.Extended(S.STARTING, 30.0, 150.0, first=False)]
    assert at(rec, lc.Timer(), 149.9).state is S.STARTING
    timed_out, acts = lc.step(rec, lc.Timer(), 150.0, T)
    assert timed_out.state is S.STOPPING and timed_out.stop_reason is ExitReason.START_TIMEOUT


def test_extend_timeout_never_shortens_and_is_bounded() -> None:
    """A shorter extension leaves the deadline where it is (as systemd: the timeout only
    moves later); one beyond ``EXTEND_TIMEOUT_MAX_S`` (a typo, ``UINT64_MAX``) moves it by
    that much at most."""
    rec = started(100.0)
    same, acts = lc.step(rec, lc.ExtendTimeout(10, 1.0), 101.0, T)
    assert same.deadline == 105.0 and acts == []
    far = at(rec, lc.ExtendTimeout(10, 1e15), 101.0)
    assert far.deadline == 101.0 + lc.EXTEND_TIMEOUT_MAX_S
    # a later, shorter one does not undo it
    assert at(far, lc.ExtendTimeout(10, 60.0), 102.0).deadline == far.deadline


def test_extend_timeout_of_zero_asks_for_nothing() -> None:
    """``EXTEND_TIMEOUT_USEC=0`` asks for no time: nothing is recorded as granted (it made a
    roll-out's wait follow the worker's deadlines, a stop budget longer than needed)."""
    rec = started(100.0)
    same, acts = lc.step(rec, lc.ExtendTimeout(10, 0.0), 101.0, T)
    assert same == rec and acts == []


def test_extend_timeout_moves_the_stop_and_drain_timeouts_not_a_kill() -> None:
    """During a stop (stop signal sent) the stop timeout moves, as systemd's
    ``TimeoutStopSec=``: no SIGKILL while the worker asks for more time to finish; during a
    drain, the drain timeout. Once the tree was killed there is nothing left to extend."""
    stopping = at(ready(100.0), lc.Stop(), 101.0)  # deadline 103
    rec = at(stopping, lc.ExtendTimeout(10, 20.0), 102.0)
    assert rec.deadline == 122.0
    assert lc.step(rec, lc.Timer(), 103.0, T) == (rec, [])
    assert lc.step(rec, lc.Timer(), 122.0, T)[1] == [lc.KillTree()]
    killed = at(stopping, lc.Timer(), 103.0)
    assert lc.step(killed, lc.ExtendTimeout(10, 20.0), 103.5, T) == (killed, [])
    draining = at(ready(100.0), lc.Drain(), 101.0)  # deadline 104
    rec = at(draining, lc.ExtendTimeout(10, 10.0), 103.0)
    assert rec.deadline == 113.0 and at(rec, lc.Timer(), 104.0).state is S.DRAINING
    # the stop after the drain gets its own stop_timeout_s: an extension is of one state
    stopped = at(rec, lc.Timer(), 113.0)
    assert stopped.state is S.STOPPING and stopped.deadline == 113.0 + T.stop_timeout_s


def test_extend_timeout_while_ready_extends_the_watchdog_until_the_next_heartbeat() -> None:
    """As systemd: a pending watchdog deadline moves too; the next WATCHDOG=1 re-arms it at
    ``watchdog_s`` as always. Without a watchdog there is nothing to extend."""
    rec = at(ready(100.0), lc.ExtendTimeout(10, 5.0), 100.5)  # watchdog 1 s
    assert rec.deadline == 105.5 and at(rec, lc.Timer(), 101.0).state is S.READY
    assert at(rec, lc.Heartbeat(10), 102.0).deadline == 103.0
    no_watchdog = replace(T, watchdog_s=0)
    plain = at(at(started(), lc.Ready(10), 100.0, no_watchdog), lc.ExtendTimeout(10, 5), 101)
    assert plain.deadline is None


def test_extend_timeout_of_another_process_or_none_is_ignored() -> None:
    """A stale message (an earlier process's, or one before the spawn was answered) changes
    nothing."""
    rec = started(100.0)
    assert lc.step(rec, lc.ExtendTimeout(99, 60.0), 101.0, T) == (rec, [])
    preparing = at(lc.WorkerRecord(), lc.Start(), 100.0)
    assert lc.step(preparing, lc.ExtendTimeout(10, 60.0), 101.0, T) == (preparing, [])
    backoff = at(rec, lc.Exited(10, CRASH), 101.0)
    assert lc.step(backoff, lc.ExtendTimeout(10, 60.0), 101.0, T) == (backoff, [])


def test_a_reload_keeps_an_extension_of_the_start() -> None:
    """Retime (a reload that changes ``start_timeout_s`` in place) never shortens what the
    worker was granted: the deadline is the later of the two."""
    rec = at(started(100.0), lc.ExtendTimeout(10, 60.0), 104.0)  # 164
    shorter = replace(T, start_timeout_s=10)
    assert at(rec, lc.Retime(), 105.0, shorter).deadline == 164.0
    longer = replace(T, start_timeout_s=100)
    assert at(rec, lc.Retime(), 105.0, longer).deadline == 200.0


def test_a_reload_keeps_an_extension_that_had_not_moved_the_start_deadline() -> None:
    """Regression: an EXTEND_TIMEOUT_USEC within the start deadline as it was (20 s asked at
    101 against a deadline of 130) was not remembered, so a reload that lowered
    ``start_timeout_s`` to 5 s set the deadline to 105: the worker was stopped as a failed
    start 16 s before the time it had been granted ("at least that long from the message")."""
    t = replace(T, start_timeout_s=30)
    rec = at(at(lc.WorkerRecord(), lc.Start(), 100.0, t), lc.Spawned(10), 100.0, t)
    rec = at(rec, lc.ExtendTimeout(10, 20.0), 101.0, t)
    assert rec.deadline == 130.0  # not moved: the deadline was later already
    shorter = replace(T, start_timeout_s=5)
    assert at(rec, lc.Retime(), 102.0, shorter).deadline == 121.0


def test_a_new_start_forgets_the_extension_and_the_watchdog_override() -> None:
    """The next process starts with ``start_timeout_s`` and ``watchdog_s`` as configured."""
    rec = at(started(100.0), lc.ExtendTimeout(10, 60.0), 101.0)
    rec = at(rec, lc.WatchdogTimeout(10, 7.0), 101.0)
    rec = at(rec, lc.Exited(10, CRASH), 102.0)  # backoff 1 s
    rec = at(at(rec, lc.Timer(), 103.0), lc.Spawned(11), 103.0)
    assert rec.deadline == 108.0 and rec.extended_until is None and rec.watchdog_s is None
    assert at(rec, lc.Ready(11), 104.0).deadline == 105.0


def test_watchdog_usec_changes_this_processs_watchdog_at_runtime() -> None:
    """Regression: WATCHDOG_USEC=... (systemd: the service changes its own watchdog timeout)
    was ignored, so a worker that asked for a longer one was restarted as hung at
    ``watchdog_s``. While ready it re-arms from now; 0 turns it off; sent while loading, it
    applies once ready; heartbeats re-arm at the new value."""
    rec = at(ready(100.0), lc.WatchdogTimeout(10, 10.0), 100.5)
    assert rec.watchdog_s == 10.0 and rec.deadline == 110.5
    assert at(rec, lc.Heartbeat(10), 105.0).deadline == 115.0
    shorter = at(rec, lc.WatchdogTimeout(10, 0.2), 106.0)
    assert shorter.deadline == 106.2
    assert at(shorter, lc.Timer(), 106.2).stop_reason is ExitReason.HANG
    off = at(rec, lc.WatchdogTimeout(10, 0.0), 106.0)
    assert off.deadline is None and at(off, lc.Heartbeat(10), 107.0).deadline is None
    loading = at(started(100.0), lc.WatchdogTimeout(10, 4.0), 101.0)
    assert loading.deadline == 105.0  # still the start timeout
    assert at(loading, lc.Ready(10), 102.0).deadline == 106.0
    # turned on by the worker where the group has none (as systemd does)
    no_watchdog = replace(T, watchdog_s=0)
    on = at(at(started(), lc.Ready(10), 100.0, no_watchdog), lc.WatchdogTimeout(10, 2), 101)
    assert on.deadline == 103.0
