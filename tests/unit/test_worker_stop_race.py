"""A worker that dies on its own just as the operator stops or restarts it (a real process)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import anyio

from supervisor.model import ExitReason, ExitStatus, WorkerState
from supervisor.policy import lifecycle as lc
from supervisor.processes import Child, Reaped
from supervisor.worker import WorkerRunner
from tests.unit.test_worker_queue import closed, runner


async def made(tmp_path: Path) -> WorkerRunner:
    return runner(tmp_path)  # (made in an event loop; what follows needs none)


def test_a_worker_dead_before_the_stop_signal_keeps_its_crash(tmp_path: Path) -> None:
    """Regression: a worker whose process crashed (exit 3) just before an operator's stop or
    restart was handled (dead, not yet reaped, when the stop signal went out) had its death
    called ``stop``/``restart``: no post-mortem, and ``last_exit.reason`` hid the crash. The
    runner now tells the lifecycle that the process had ended before the signal."""
    r = anyio.run(made, tmp_path)
    child = subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)
    try:
        # it has ended (a zombie, not collected: the reaper has not run yet)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        r.record = lc.WorkerRecord(state=WorkerState.READY, pid=child.pid)
        r._apply(lc.Stop())  # the operator's stop: the stop signal goes out now
        stopping = r.record.state
    finally:
        _, status = os.waitpid(child.pid, 0)  # the reaper's part
        child.returncode = 3  # collected here: Popen must not wait for it again
    r._on_reaped(Reaped(child.pid, ExitStatus.from_wait_status(status)))
    assert stopping is WorkerState.STOPPING
    event = r._recv.receive_nowait()
    assert event == lc.Exited(child.pid, ExitStatus(3, None), unasked=True)
    r._apply(event)
    assert r.record.state is WorkerState.STOPPED
    assert r.record.last_exit is not None and r.record.last_exit.reason is ExitReason.EXIT
    closed(r)


def test_a_worker_alive_at_the_stop_signal_is_stopped_not_dead(tmp_path: Path) -> None:
    """The other side: a process still running when the stop signal goes out ends by it."""
    r = anyio.run(made, tmp_path)
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        r.record = lc.WorkerRecord(state=WorkerState.READY, pid=child.pid)
        r._apply(lc.Stop())  # SIGTERM to its group
        status = child.wait(timeout=5)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    r._on_reaped(Reaped(child.pid, ExitStatus(None, -status)))
    event = r._recv.receive_nowait()
    assert event == lc.Exited(child.pid, ExitStatus(None, 15), unasked=False)
    r._apply(event)
    assert r.record.last_exit is not None and r.record.last_exit.reason is ExitReason.STOP
    closed(r)


def test_a_worker_reaped_before_the_stop_signal_keeps_its_crash(tmp_path: Path) -> None:
    """Regression: a worker whose process crashed (exit 3) and was already collected by the
    reaper (its exit queued behind the operator's stop) when the stop signal went out had its
    death called ``stop``: the exit had been queued as asked for before the runner saw that the
    process was gone, so no post-mortem, and ``last_exit.reason`` hid the crash."""
    r = anyio.run(made, tmp_path)
    child = subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)
    read_end, write_end = os.pipe()
    os.close(write_end)
    try:
        r._child = Child(child.pid, read_end, child)
        r.record = lc.WorkerRecord(state=WorkerState.READY, pid=child.pid)
        _, status = os.waitpid(child.pid, 0)  # the reaper collects it: its exit is queued
        child.returncode = 3  # collected here: Popen must not wait for it again
        r._on_reaped(Reaped(child.pid, ExitStatus.from_wait_status(status)))
        r._apply(lc.Stop())  # the operator's stop, queued before the exit, handled now
        stopping = r.record.state
        event = r._recv.receive_nowait()
        assert isinstance(event, lc.Exited)
        r._apply(event)
    finally:
        os.close(read_end)
    assert stopping is WorkerState.STOPPING
    assert r.record.state is WorkerState.STOPPED
    assert r.record.last_exit is not None and r.record.last_exit.reason is ExitReason.EXIT
    closed(r)


def test_a_worker_ended_by_the_drain_signal_is_not_called_a_crash(tmp_path: Path) -> None:
    """Regression: a reload's drain sent its ``drain_signal`` (SIGUSR1, which the server did
    not handle: it ended by it); when the drain timeout's stop signal was to go out, the
    process had ended, so its death was taken for its own: a ``signal`` post-mortem for the
    roll-out's own drain. A process already signalled by its runner ended by our asking."""
    r = anyio.run(made, tmp_path)
    r.timing = lc.Timing(watchdog_s=1.0, drain_signal=signal.SIGUSR1, drain_timeout_s=1.0)
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        r.record = lc.WorkerRecord(state=WorkerState.READY, pid=child.pid)
        r._apply(lc.Drain(restart=False, reason=ExitReason.RELOAD))  # SIGUSR1 to its group
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it ended by it
        r._clock.advance(2.0)  # type: ignore[attr-defined]
        r._apply(lc.Timer())  # the drain timeout
        stopping = r.record.state
    finally:
        _, status = os.waitpid(child.pid, 0)  # the reaper's part
        child.returncode = -signal.SIGUSR1  # collected here: Popen must not wait for it again
    r._on_reaped(Reaped(child.pid, ExitStatus.from_wait_status(status)))
    assert stopping is WorkerState.STOPPING
    event = r._recv.receive_nowait()
    assert event == lc.Exited(child.pid, ExitStatus(None, signal.SIGUSR1), unasked=False)
    r._apply(event)
    assert r.record.last_exit is not None and r.record.last_exit.reason is ExitReason.RELOAD
    closed(r)


def test_a_clean_exit_just_before_the_stop_signal_is_the_stop(tmp_path: Path) -> None:
    """A process that exited 0 just before the operator's stop signal went out (a server that
    finished draining on its own) is no crash: its end is the stop, no post-mortem."""
    r = anyio.run(made, tmp_path)
    child = subprocess.Popen(["true"], start_new_session=True)
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        r.record = lc.WorkerRecord(state=WorkerState.READY, pid=child.pid)
        r._apply(lc.Stop())
    finally:
        _, status = os.waitpid(child.pid, 0)
        child.returncode = 0
    r._on_reaped(Reaped(child.pid, ExitStatus.from_wait_status(status)))
    event = r._recv.receive_nowait()
    assert isinstance(event, lc.Exited)
    r._apply(event)
    assert r.record.last_exit is not None and r.record.last_exit.reason is ExitReason.STOP
    closed(r)
