"""``Runtime._others_back`` with fake workers (no processes): what a roll-out waits for before it
takes the next worker of a group down, while healing acts on the group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel

from supervisor.clock import FakeClock
from supervisor.model import ExitReason, WorkerState
from supervisor.policy import lifecycle as lc
from supervisor.runtime import Runtime


class Worker:
    """What a roll-out reads of a worker."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.record = SimpleNamespace(
            state=WorkerState.READY, gpu_waits=0, waiting_for_gpu=False, pid=100
        )
        self.timing = lc.Timing()
        self.spawn_attempts = 0
        self.queued: lc.Event | None = None

    @property
    def state(self) -> WorkerState:
        state: WorkerState = self.record.state
        return state

    def queued_down(self) -> lc.Event | None:
        return self.queued


def runtime(*workers: Worker) -> tuple[Any, list[str]]:
    rt: Any = object.__new__(Runtime)
    rt.runners = {w.name: w for w in workers}
    rt.groups = {"w": [w.name for w in workers]}
    rt._start_queue = []
    rt._shutting_down = False
    rt.rolling = {"w": "rolling restart"}
    rt._roll_waiting = set()
    rt.clock = FakeClock()
    rt._changed = anyio.Event()
    halted: list[str] = []
    rt._rollout_halted = lambda group, runner, why: halted.append(why)
    return rt, halted


def wake(rt: Any) -> None:
    """A worker changed (what ``Runtime.changed`` does for the roll-out's waits)."""
    event, rt._changed = rt._changed, anyio.Event()
    event.set()


async def settle() -> None:
    for _ in range(10):
        await anyio.lowlevel.checkpoint()


def test_a_roll_out_waits_for_a_sibling_whose_healing_drain_is_posted_not_taken() -> None:
    """Regression: the healer posted a drain to w-1 (a leak) and, in the same step of the loop
    (before w-1's task took it: w-1 still said ready), the roll-out looked for a worker of the
    group on its way down, found none, and restarted w-0: both down at once with
    max_unavailable 1. A worker with such an event queued is on its way down: the roll-out
    waits until it is back."""
    anyio.run(_healing_drain_posted)


async def _healing_drain_posted() -> None:
    w0, w1 = Worker("w-0"), Worker("w-1")
    rt, halted = runtime(w0, w1)
    w1.queued = lc.Drain(reason=ExitReason.LEAK)  # the healer's, not yet taken by its task
    result: list[bool] = []

    async def roll() -> None:
        result.append(await rt._others_back("w", w0))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(roll)
            await settle()
            assert not result  # waits for w-1
            w1.queued, w1.record.state = None, WorkerState.DRAINING  # its task took it
            wake(rt)
            await settle()
            assert not result
            w1.record.state = WorkerState.READY  # back
            wake(rt)
    assert result == [True]
    assert not halted
