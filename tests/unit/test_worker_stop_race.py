"""A worker that dies on its own just as the operator stops or restarts it (a real process)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio

from supervisor.model import ExitReason, ExitStatus, WorkerState
from supervisor.policy import lifecycle as lc
from supervisor.processes import Reaped
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
