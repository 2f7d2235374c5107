"""No thread to be had (a full pids cgroup, systemd's ``TasksMax``): the sampler and the records
writer go on without crashing the supervisor.

``anyio.to_thread.run_sync`` raises ``RuntimeError: can't start new thread`` when it needs a new
worker thread and ``clone()`` fails (anyio's idle threads exit after 10 s, so that can be any
call). The tests make it do so, before the function would have run, while ``Shortage.on``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import pytest
from structlog.testing import capture_logs

from supervisor import records
from supervisor import sampler as sampler_module
from supervisor.backends.sim import SimBackend
from supervisor.model import Sample, XidEvent
from supervisor.records import Recorder, WriteHealth
from supervisor.sampler import Sampler

T = TypeVar("T")
DEADLINE_S = 10.0


class Shortage:
    """``anyio.to_thread.run_sync`` that cannot start a thread while ``on``."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.on = False
        self.refused = 0  # calls refused
        self.ran = 0  # calls that got a thread
        self._real = real
        self._called: anyio.Event | None = None

    async def next_call(self) -> None:
        """Wait for the next call (the sampler and the writer make one every few ms here)."""
        if self._called is None:
            self._called = anyio.Event()
        await self._called.wait()

    async def run_sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._called is not None:
            self._called.set()
            self._called = None
        await anyio.lowlevel.checkpoint()
        if self.on:
            self.refused += 1
            raise RuntimeError("can't start new thread")
        self.ran += 1
        result: T = await self._real(fn, *args, **kwargs)
        return result


@pytest.fixture
def shortage(monkeypatch: pytest.MonkeyPatch) -> Shortage:
    fake = Shortage(anyio.to_thread.run_sync)
    monkeypatch.setattr(anyio.to_thread, "run_sync", fake.run_sync)
    # quicker waits and retries, so that every path runs many times within a test
    monkeypatch.setattr(sampler_module, "XID_WAIT_S", 0.05)
    monkeypatch.setattr(records, "STATE_MIN_INTERVAL_S", 0.05)
    monkeypatch.setattr(records, "CHECK_EVERY_S", 0.05)  # failed post-mortems: retried then
    return fake


async def until(
    shortage: Shortage, check: Callable[[], bool], what: str, timeout: float = DEADLINE_S
) -> None:
    """Wait until ``check()`` holds, looking again at each thread call; fail after ``timeout``."""
    with anyio.move_on_after(timeout):
        while not check():
            await shortage.next_call()
        return
    pytest.fail(f"not within {timeout} s: {what}")


# --- the helper -----------------------------------------------------------------------------


async def test_in_thread_says_when_no_thread_can_be_started(shortage: Shortage) -> None:
    from supervisor.records import ThreadUnavailable, failure_kind, in_thread

    calls: list[int] = []

    def work(x: int) -> int:
        calls.append(threading.get_ident())
        return x * 2

    assert await in_thread(work, 21) == 42 and calls[-1] != threading.get_ident()
    shortage.on = True
    with pytest.raises(ThreadUnavailable) as info:
        await in_thread(work, 1)
    assert isinstance(info.value, OSError) and failure_kind(info.value) == "no_thread"
    assert "can't start new thread" in str(info.value) and len(calls) == 1
    # clean-up that must finish: run right here instead
    assert await in_thread(work, 2, inline=True) == 4 and calls[-1] == threading.get_ident()
    shortage.on = False

    def broken() -> None:
        raise RuntimeError("a bug of the function, not a missing thread")

    with pytest.raises(RuntimeError, match="a bug of the function") as bug:
        await in_thread(broken)
    assert not isinstance(bug.value, ThreadUnavailable)


# --- the sampler ----------------------------------------------------------------------------


async def test_sampler_goes_on_without_threads_and_closes_its_backend_inline(
    tmp_path: Path, shortage: Shortage
) -> None:
    """Regression: ``RuntimeError: can't start new thread`` in a tick, in the XID wait or in
    the backend's close at the end left ``Sampler.serve`` and crashed the supervisor."""
    samples: list[Sample] = []
    closed_in: list[int] = []
    backend = SimBackend(tmp_path / "sim", 1)
    real_close = backend.close

    def close() -> None:
        closed_in.append(threading.get_ident())
        real_close()

    backend.close = close  # type: ignore[method-assign]
    sampler = Sampler(lambda: backend, 0.02, dict, samples.append, lambda e: None)
    assert await sampler.open()
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(sampler.serve)
            await until(shortage, lambda: bool(samples), "a first sample")
            shortage.on = True
            await until(
                shortage, lambda: sampler.tick_errors >= 5, "five ticks lost to the shortage"
            )
            await until(shortage, lambda: sampler.xid_wait_errors >= 1, "an XID wait lost to it")
            shortage.on = False  # threads again: sampling resumes
            before = len(samples)
            await until(shortage, lambda: len(samples) > before + 2, "samples after the shortage")
            shortage.on = True  # and it ends while no thread can be had
            refused = shortage.refused
            await until(shortage, lambda: shortage.refused > refused, "a refusal before the end")
            tg.cancel_scope.cancel()
    assert closed_in == [threading.get_ident()]  # closed, on the event loop
    tick_failed = [e for e in logs if e["event"] == "sampler.tick_failed"]
    assert len(tick_failed) == 1, tick_failed  # rate-limited: once for the whole shortage
    assert "can't start new thread" in tick_failed[0]["error"]


async def test_xids_after_a_shortage_are_still_read(tmp_path: Path, shortage: Shortage) -> None:
    world = tmp_path / "sim"
    xids: list[XidEvent] = []
    sampler = Sampler(lambda: SimBackend(world, 1), 0.02, dict, lambda s: None, xids.append)
    assert await sampler.open()
    async with anyio.create_task_group() as tg:
        await tg.start(sampler.serve)
        shortage.on = True
        await until(shortage, lambda: shortage.refused >= 5, "calls refused")
        await until(shortage, lambda: sampler.xid_wait_errors >= 1, "an XID wait refused")
        with (world / "events").open("a") as fh:
            fh.write("0 79\n")
        shortage.on = False
        await until(shortage, lambda: bool(xids), "the XID written during the shortage")
        tg.cancel_scope.cancel()
    assert [e.xid for e in xids] == [79]


# --- the records writer ---------------------------------------------------------------------


def _recorder(state_dir: Path, health: WriteHealth) -> Recorder:
    (state_dir / "postmortems").mkdir(parents=True)
    return Recorder(state_dir, 10, health, snapshot=lambda: {"workers": [], "n": 1})


def _pm(id_: str) -> dict[str, Any]:
    return {"id": id_, "worker": {"name": "w-0"}, "reason": "exit"}


async def test_records_writer_retries_without_threads_and_recovers(
    tmp_path: Path, shortage: Shortage
) -> None:
    """Regression: a write that could not get a thread crashed the supervisor; now it is a
    failed write (``kind`` ``no_thread``), retried until a thread can be had again."""
    state = tmp_path / "state"
    health = WriteHealth()
    recorder = _recorder(state, health)
    pm_id = "20261130T005320.250000Z-w-0-exit"
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(recorder.serve)
            shortage.on = True
            recorder.postmortem(_pm(pm_id))
            recorder.mark(urgent=True)
            await until(
                shortage,
                lambda: {"state", "postmortem"} <= health.failing.keys(),
                "both writes failed",
            )
            refused = shortage.refused
            await until(
                shortage, lambda: shortage.refused > refused + 3, "retries during the shortage"
            )
            assert not (state / "state.json").exists()
            assert health.problems()["state"]["kind"] == "no_thread"
            shortage.on = False
            await until(shortage, lambda: not health.failing, "the writes recovered")
            tg.cancel_scope.cancel()
    assert json.loads((state / "state.json").read_text()) == {"workers": [], "n": 1}
    assert recorder.store.ids() == [pm_id] and recorder.postmortems_written == 1
    failed = [(e["file"], e["kind"]) for e in logs if e["event"] == "records.write_failed"]
    assert sorted(failed) == [("postmortem", "no_thread"), ("state", "no_thread")]  # once each
    recovered = {e["file"] for e in logs if e["event"] == "records.write_recovered"}
    assert recovered == {"state", "postmortem"}


async def test_final_flush_writes_without_a_thread(tmp_path: Path, shortage: Shortage) -> None:
    """At shutdown the last state and the queued post-mortems are written on the event loop
    when no thread can be started (they were lost, with a traceback, before)."""
    state = tmp_path / "state"
    recorder = _recorder(state, WriteHealth())
    pm_id = "20261130T005320.250000Z-w-0-exit"
    shortage.on = True
    recorder.postmortem(_pm(pm_id))
    await recorder.flush()
    assert shortage.refused >= 2 and shortage.ran == 0
    assert json.loads((state / "state.json").read_text()) == {"workers": [], "n": 1}
    assert recorder.store.ids() == [pm_id]
