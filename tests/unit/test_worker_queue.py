"""A worker's event queue under a flood of sd_notify datagrams (no process needed)."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import anyio
import anyio.lowlevel

from supervisor.clock import FakeClock
from supervisor.model import LaunchSpec, WorkerState, WorkerUsage
from supervisor.notify import NotifyMessage
from supervisor.output import WorkerOutput
from supervisor.policy import lifecycle as lc
from supervisor.processes import Reaper
from supervisor.worker import WorkerRunner


def runner(tmp_path: Path, read_notify: object = None) -> WorkerRunner:
    spec = LaunchSpec(
        name="w-0",
        group="w",
        index=0,
        argv=("true",),
        env={},
        port=None,
        gpus=None,
        ready_url=None,
        notify=True,
        watchdog_s=1.0,
    )
    out = WorkerOutput("w-0", tmp_path / "w-0.log", 0, 0)
    r = WorkerRunner(
        spec,
        lc.Timing(watchdog_s=1.0),
        reaper=Reaper(),
        clock=FakeClock(),
        output=out,
        on_change=lambda _r: None,
        register_pid=lambda _p, _r: None,
        read_notify=read_notify,  # type: ignore[arg-type]
    )
    r.record = lc.WorkerRecord(state=WorkerState.READY, pid=42, deadline=1001.0)
    return r


def closed(r: WorkerRunner) -> None:
    r._send.close()
    r._recv.close()
    r.output.close()


def test_a_flood_of_heartbeats_queues_one(tmp_path: Path) -> None:
    """A worker that floods the socket with WATCHDOG=1 (and READY=1) adds one event of each
    kind until it is handled: the queue cannot grow, and a Stop is not held behind it.
    Regression: every datagram was queued (352 MB, a stop that waited for minutes)."""
    anyio.run(_flood, tmp_path)


async def _flood(tmp_path: Path) -> None:
    r = runner(tmp_path)
    for _ in range(10_000):
        r.on_notify(NotifyMessage(42, {"WATCHDOG": "1", "READY": "1"}))
    r.post(lc.Stop())
    queued = [r._recv.receive_nowait() for _ in range(r._recv.statistics().current_buffer_used)]
    assert [type(e) for e in queued] == [lc.Ready, lc.Heartbeat, lc.Stop]
    heartbeat = queued[1]
    assert isinstance(heartbeat, lc.Heartbeat)
    r._apply(heartbeat)  # handled: the next heartbeat is queued again
    r.on_notify(NotifyMessage(42, {"WATCHDOG": "1"}))
    assert r._recv.statistics().current_buffer_used == 1
    closed(r)


def test_a_flood_of_watchdog_triggers_queues_one(tmp_path: Path) -> None:
    """A process that sends WATCHDOG=trigger in a loop (a hostile worker, or a watchdog library
    that retries) is stopped for the first one; the rest say nothing new. Regression: each
    datagram queued an event and logged a warning (the queue grew by ~63 events a wake-up
    of the event loop, without bound, while the stop went on)."""
    anyio.run(_trigger_flood, tmp_path)


async def _trigger_flood(tmp_path: Path) -> None:
    r = runner(tmp_path)
    for _ in range(10_000):
        r.on_notify(NotifyMessage(42, {"WATCHDOG": "trigger"}))
    assert r.watchdog_triggered
    queued = [r._recv.receive_nowait() for _ in range(r._recv.statistics().current_buffer_used)]
    assert queued == [lc.Heartbeat(42, trigger=True)]
    closed(r)


def test_a_flood_of_timeout_fields_queues_one_each_with_what_counts(tmp_path: Path) -> None:
    """EXTEND_TIMEOUT_USEC and WATCHDOG_USEC sent in a loop queue one event each, handled with
    the longest extension and the latest watchdog sent meanwhile (a flood cannot grow the
    queue, and no extension is lost to the one queued first); a value that is no unsigned
    number (``-1``, ``5s``) changes nothing."""
    anyio.run(_timeout_flood, tmp_path)


async def _timeout_flood(tmp_path: Path) -> None:
    r = runner(tmp_path)  # ready at 1000, watchdog deadline 1001
    for i in range(1, 1001):
        extend = "5000000" if i == 500 else str(i * 1000)
        r.on_notify(
            NotifyMessage(42, {"WATCHDOG_USEC": str(i * 2000), "EXTEND_TIMEOUT_USEC": extend})
        )
    r.on_notify(NotifyMessage(42, {"WATCHDOG_USEC": "-1", "EXTEND_TIMEOUT_USEC": "5s"}))
    queued = [r._recv.receive_nowait() for _ in range(r._recv.statistics().current_buffer_used)]
    assert [type(e) for e in queued] == [lc.WatchdogTimeout, lc.ExtendTimeout]
    for event in queued:
        assert isinstance(event, lc.WatchdogTimeout | lc.ExtendTimeout)
        r._apply(event)
    assert r.record.watchdog_s == 2.0  # the last one sent
    assert r.record.deadline == 1005.0  # the longest extension (from the watchdog's 1002)
    assert r._recv.statistics().current_buffer_used == 0
    closed(r)


def test_a_passed_deadline_reads_the_socket_first(tmp_path: Path) -> None:
    """When a deadline passes (the supervisor was stalled longer than watchdog_s, say), the
    heartbeats still waiting in the notify socket are read before the deadline is judged.
    Regression: healthy workers were restarted for a hang after every stall."""
    anyio.run(_deadline, tmp_path)


def stalled(tmp_path: Path, empty_reads: int) -> tuple[WorkerRunner, list[int]]:
    """A ready worker whose watchdog deadline passed long ago, and whose notify socket gives a
    heartbeat at the read after ``empty_reads`` empty ones; and the count of reads."""
    holder: list[WorkerRunner] = []
    reads = [0]

    def read_notify() -> int:
        reads[0] += 1
        if reads[0] <= empty_reads:
            return 0
        holder[0].on_notify(NotifyMessage(42, {"WATCHDOG": "1"}))
        return 1

    r = runner(tmp_path, read_notify)
    holder.append(r)
    r.record = lc.WorkerRecord(state=WorkerState.READY, pid=42, deadline=0.0)  # long passed
    return r, reads


async def _deadline(tmp_path: Path) -> None:
    r, _ = stalled(tmp_path, 0)  # the socket held a heartbeat sent during the stall
    with anyio.fail_after(5):
        event = await r._next_event()
    assert isinstance(event, lc.Heartbeat)
    silent = runner(tmp_path)
    silent.record = r.record
    assert isinstance(await silent._next_event(), lc.Timer)  # nothing to read: judged
    closed(r)
    closed(silent)


def test_a_stop_while_the_pre_start_hook_runs_means_no_process(tmp_path: Path) -> None:
    """The defect: a stop (or restart) posted while the pre-start hook ran (the GPU-release
    barrier, re-placement) was applied to "starting, no process yet" (-> stopped), and the
    hook then spawned anyway: a live worker process nothing tracked (16 threads sending
    start/stop/restart left 12 of them, holding their port and GPU memory until the
    supervisor exited). Now the hook's answer is queued behind the stop and dropped."""
    anyio.run(_stop_during_prepare, tmp_path)


async def _stop_during_prepare(tmp_path: Path) -> None:
    entered, release = anyio.Event(), anyio.Event()
    returned = False

    async def prepare(r: WorkerRunner) -> LaunchSpec | str:
        nonlocal returned
        entered.set()
        await release.wait()
        returned = True
        return r.spec

    r = runner(tmp_path)
    r.spec = dataclasses.replace(r.spec, argv=("sleep", "600"))
    r._prepare = prepare
    r.record = lc.WorkerRecord()  # stopped
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await tg.start(r.run)
                r.post(lc.Start())
                await entered.wait()
                release.set()  # the hook goes on first, the stop is queued before it is done
                r.post(lc.Stop())
                # until the hook has returned and what it queued is handled
                while not returned or r._recv.statistics().current_buffer_used:
                    await anyio.lowlevel.checkpoint()
                assert r.record.state is WorkerState.STOPPED
                assert r._child is None and r.spawn_attempts == 0
                r.cancel()
    finally:
        if r._child is not None:
            os.kill(r._child.pid, signal.SIGKILL)
            os.waitpid(r._child.pid, 0)  # noqa: ASYNC222 - killed: at once
        closed(r)


def test_after_a_stall_heartbeats_still_on_their_way_are_waited_for(tmp_path: Path) -> None:
    """The socket's queue is small (10 datagrams in a container): during a stall of the
    supervisor, the heartbeats of most workers wait in their sendto() and come in only once
    the queue was read. Regression: the deadline was judged right after that first read, and
    healthy workers were restarted for a hang after stalls (1-2 of 16 a time)."""
    anyio.run(_late_heartbeat, tmp_path)


async def _late_heartbeat(tmp_path: Path) -> None:
    r, reads = stalled(tmp_path, 2)  # nothing at the first reads; the heartbeat at a later one
    with anyio.fail_after(5):
        event = await r._next_event()
    assert isinstance(event, lc.Heartbeat)
    # a deadline only just passed (no stall) is judged at once, as before
    r.record = lc.WorkerRecord(state=WorkerState.READY, pid=42, deadline=r._clock.now())
    reads[0] = -100
    with anyio.fail_after(5):
        assert isinstance(await r._next_event(), lc.Timer)
    closed(r)


def test_a_sample_that_has_not_seen_the_process_gives_no_figures(tmp_path: Path) -> None:
    """Regression: right after a (re)spawn, the last sample (taken while the worker had no
    process) gave the new process 0.0 MiB of GPU memory until the next tick."""
    anyio.run(_not_seen, tmp_path)


async def _not_seen(tmp_path: Path) -> None:
    r = runner(tmp_path)
    before = WorkerUsage("w-0", (), 0.0, {}, "pid", None, None)
    view = r.view(before)
    assert view["gpu_memory_mb"] is None and view["attribution"] == "none", view
    seen = WorkerUsage("w-0", (42, 43), 700.0, {"GPU-a": 700.0}, "pid", 12.5, 3.0)
    view = r.view(seen)
    assert view["gpu_memory_mb"] == 700.0 and view["host_rss_mb"] == 12.5, view
    closed(r)


def test_an_event_that_takes_the_worker_down_is_known_until_its_task_takes_it(
    tmp_path: Path,
) -> None:
    """Regression: a roll-out's (or an operator's) Restart posted to a ready worker left no
    trace until the worker's task took it, a step of the event loop later: the healer judging
    the group in between saw one more ready worker than there was (``max_unavailable``).
    ``queued_down()`` says what is queued to take it down (heartbeats are not), until taken;
    its taking is a change (waiters look again) even when the record stays as it was."""
    anyio.run(_queued_down, tmp_path)


async def _queued_down(tmp_path: Path) -> None:
    r = runner(tmp_path)
    changes: list[WorkerRunner] = []
    r._on_change = changes.append
    r.on_notify(NotifyMessage(42, {"WATCHDOG": "1"}))
    assert r.queued_down() is None
    stop, drain = lc.Stop(), lc.Drain(restart=False)
    r.post(stop)
    r.post(drain)
    assert r.queued_down() is stop
    heartbeat = r._recv.receive_nowait()
    assert isinstance(heartbeat, lc.Heartbeat)
    r._apply(heartbeat)
    assert r.queued_down() is stop
    r.record = lc.WorkerRecord()  # its process went meanwhile: a stop changes nothing
    r._apply(lc.Stop())  # one never queued (applied directly) is not the queued one
    assert r.queued_down() is stop
    changes.clear()
    taken = r._recv.receive_nowait()
    assert isinstance(taken, lc.Stop)
    r._apply(taken)
    assert r.queued_down() is drain
    assert changes == [r]
    taken = r._recv.receive_nowait()
    assert isinstance(taken, lc.Drain)
    r._apply(taken)
    assert r.queued_down() is None
    closed(r)


def test_a_backoff_that_ended_during_a_stall_restarts_without_a_grace(tmp_path: Path) -> None:
    """Regression: a backoff whose end the supervisor noticed late (a loaded host) got the
    stall's grace for heartbeats too (0.5 s more), though a worker in backoff has no process
    to send any: its restart came 1.02 s after its exit instead of 0.2 s (CI)."""
    anyio.run(_backoff_after_stall, tmp_path)


async def _backoff_after_stall(tmp_path: Path) -> None:
    r, reads = stalled(tmp_path, 1_000)  # the socket has nothing
    r.record = lc.WorkerRecord(state=WorkerState.BACKOFF, pid=None, deadline=0.0)  # long passed
    with anyio.fail_after(5):
        assert isinstance(await r._next_event(), lc.Timer)
    assert reads[0] == 1  # read once, as at any passed deadline; no grace waited out
    closed(r)
