"""``Runtime._others_back`` with fake workers (no processes): what a roll-out waits for before it
takes the next worker of a group down, while healing acts on the group."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from types import SimpleNamespace
from typing import Any, cast

import anyio
import anyio.lowlevel

from supervisor.clock import AnyioClock, FakeClock
from supervisor.config import Settings
from supervisor.model import ExitReason, WorkerState
from supervisor.policy import lifecycle as lc
from supervisor.runtime import Runtime


class Worker:
    """What a roll-out reads of a worker."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.record = SimpleNamespace(
            state=WorkerState.READY,
            gpu_waits=0,
            waiting_for_gpu=False,
            pid=100,
            after_exit=None,
            extended_until=None,  # (what a roll-out's wait looks at: EXTEND_TIMEOUT_USEC)
        )
        self.timing = lc.Timing()
        self.spawn_attempts = 0
        self.failed_attempt = 0  # the spawn_attempts of its last failed start
        self.queued: lc.Event | None = None
        self.spec: Any = SimpleNamespace(gpus=None)

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


async def waits_until(
    rt: Any, wait: Callable[[], Awaitable[bool]], change: Callable[[], None]
) -> bool:
    """What ``wait()`` (one of the roll-out's waits) returns once ``change()`` happened: it
    must still be waiting before it."""
    result: list[bool] = []

    async def waiting() -> None:
        result.append(await wait())

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting)
            await settle()
            assert not result  # it waits
            change()
            wake(rt)
    return result[0]


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


def test_a_roll_out_halts_for_a_sibling_that_fails_again_with_no_backoff() -> None:
    """Regression: w-1, crash-looping with ``backoff_initial_s = 0``, fails its next start and
    is started again in the same step: the roll-out, waiting for it to be back or to be in
    backoff (or fatal) again, never saw it fail, and waited out drain, stop and start
    timeouts (minutes) before it halted. A failed start of it since the wait began is it
    failing again: halted at once."""
    anyio.run(_sibling_fails_again_with_no_backoff)


async def _sibling_fails_again_with_no_backoff() -> None:
    w0, w1 = Worker("w-0"), Worker("w-1")
    rt, halted = runtime(w0, w1)
    w1.record.state, w1.record.pid = WorkerState.BACKOFF, None  # after a failed start
    w1.spawn_attempts = w1.failed_attempt = 1

    def fails_again() -> None:  # with no delay its next start begins in the same step
        w1.spawn_attempts, w1.failed_attempt = 3, 2
        w1.record.state, w1.record.pid = WorkerState.STARTING, 101

    assert not await waits_until(rt, lambda: rt._others_back("w", w0), fails_again)
    assert halted == ["w-1 failed again: not taking w-0 down too"]


def test_a_resumed_roll_out_halts_at_a_failed_start_with_no_backoff() -> None:
    """Regression: a resumed roll-out waits for w-0, loading the new definition, to come up;
    with ``backoff_initial_s = 0`` its failed start was followed by the next one in the same
    step, never seen in backoff: the roll-out waited out backoff_max_s and the stop and start
    timeouts before it halted. A failed start is one however short its backoff."""
    anyio.run(_resumed_with_no_backoff)


async def _resumed_with_no_backoff() -> None:
    w0 = Worker("w-0")
    w0.record.state = WorkerState.STARTING  # loading the new definition
    w0.spawn_attempts = 1
    rt, halted = runtime(w0)
    rt._superseded = lambda group: False
    assert not await waits_until(rt, lambda: rt._comes_up("w", w0, lc.Timing()), fail(w0))
    assert len(halted) == 1 and "did not become ready" in halted[0], halted


def fail(w: Worker) -> Callable[[], None]:
    """Its start fails; with no backoff delay the next one begins in the same step."""

    def change() -> None:
        w.spawn_attempts, w.failed_attempt, w.record.pid = 2, 1, 101

    return change


def test_a_roll_out_sees_a_moved_worker_fail_its_start_with_no_backoff() -> None:
    """Regression: a roll-out waits for w-0, moved off its GPU by healing, to be ready on
    another one; with ``backoff_initial_s = 0`` its failed start there was followed by the
    next one in the same step, never seen in backoff: the roll-out waited out backoff_max_s,
    the GPU-release barrier and the stop and start timeouts. A failed start is one however
    short its backoff."""
    anyio.run(_moved_with_no_backoff)


async def _moved_with_no_backoff() -> None:
    w0 = Worker("w-0")
    w0.record.state = WorkerState.STARTING  # loading on its new GPU
    w0.spawn_attempts = 1
    rt, _ = runtime(w0)
    rt._superseded = lambda group: False
    rt.settings = SimpleNamespace(gpu=SimpleNamespace(release_timeout_s=10.0))
    assert not await waits_until(rt, lambda: rt._back_after_move("w", w0), fail(w0))


def test_a_roll_out_superseded_while_a_moved_worker_loads_is_superseded_not_halted() -> None:
    """Regression: a reload's roll-out held for ``stable_s`` on w-0, which healing moved off its
    GPU (a device-fatal XID: quarantined). While w-0 loaded on its new GPU, a newer reload
    superseded the roll-out: the wait for w-0 ended (not ready yet) and the roll-out was
    reported halted, "replaced worker did not stay ready for stable_s" (an error blaming the
    definition; ``reload.done`` listed the group as halted) instead of superseded."""
    anyio.run(_superseded_while_moved)


async def _superseded_while_moved() -> None:
    w0 = Worker("w-0")
    w0.record.stop_reason = None
    w0.record.last_exit = None
    w0.spec = SimpleNamespace(gpus=("GPU-A",))
    rt, halted = runtime(w0)
    rt.rolling = {"w": "reload"}
    rt.settings = SimpleNamespace(gpu=SimpleNamespace(release_timeout_s=10.0))
    rt.slots = lambda: [SimpleNamespace(uuid="GPU-A", why_not="is quarantined (XID 79)")]
    rt.sampler = SimpleNamespace(last=None)  # (no sample: the quarantine says it failed)
    rt.healer = SimpleNamespace(
        hot_gpus=lambda: set(),
        xid_maybe_not_own=set(),
        state=SimpleNamespace(quarantined={"GPU-A": "XID 79"}),
    )
    newer = [False]
    rt._superseded = lambda group: newer[0]
    superseded: list[str] = []

    def roll_superseded(group: str, kind: str | None = None) -> bool:
        superseded.append(group)
        return False

    rt._roll_superseded = roll_superseded
    rt._rollout_passes_over = lambda group, runner, reason="": None
    result: list[bool] = []

    async def hold() -> None:
        result.append(await rt._rollout_holds("w", [w0], 60.0, "the rest keep the old config"))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await settle()
            # healing drains it off its quarantined GPU; it starts on another one
            w0.record.state, w0.record.stop_reason = WorkerState.DRAINING, ExitReason.XID
            wake(rt)
            await settle()
            w0.record.state, w0.record.stop_reason = WorkerState.STARTING, None
            w0.record.last_exit = SimpleNamespace(reason=ExitReason.XID)
            w0.spec = SimpleNamespace(gpus=("GPU-B",))
            wake(rt)
            await settle()
            assert not result  # waits for it on GPU-B
            newer[0] = True  # a later reload takes the group over
            wake(rt)
    assert result == [False]
    assert superseded == ["w"]
    assert not halted


def test_a_placement_roll_out_leaves_a_worker_placed_while_it_waited_for_a_sibling() -> None:
    """Regression: a placement roll-out (GPU telemetry came up after w-1 started unplaced)
    waited for a sibling on its way back (a healing drain) before restarting w-1; meanwhile
    w-1 crashed and was restarted onto its GPU by itself. The roll-out then restarted it all
    the same (its check "still unplaced" came before the wait): a worker already placed lost
    its load for nothing. So too one an operator stopped meanwhile (its stop was undone)."""
    anyio.run(_placed_while_waiting)


async def _placed_while_waiting() -> None:
    w0, w1 = Worker("w-0"), Worker("w-1")
    posted: list[lc.Event] = []
    for w in (w0, w1):
        w.record.after_exit = None
    w0.spec = SimpleNamespace(gpus=("GPU-A",))
    w0.record.state = WorkerState.DRAINING  # healing drains it: the roll-out waits for it
    w1.spec = SimpleNamespace(gpus=None)  # started before GPU telemetry: unplaced
    w1.post = posted.append  # type: ignore[attr-defined]
    rt, halted = runtime(w0, w1)
    rt.rolling = {"w": "placement roll-out"}
    rt.actions_total = {}
    rt.log = SimpleNamespace(info=lambda *a, **k: None)
    rt._superseded = lambda group: False
    result: list[bool] = []

    async def roll() -> None:
        result.append(await rt._roll_restart("w", frozenset({"w-1"})))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(roll)
            await settle()
            assert not result and not posted  # waits for w-0
            # w-1 crashed and started again by itself, placed onto its GPU now
            w1.record.state, w1.record.pid = WorkerState.STARTING, 101
            w1.spec = SimpleNamespace(gpus=("GPU-B",))
            wake(rt)
            await settle()
            w0.record.state = WorkerState.READY  # back
            wake(rt)
            await settle()
            tg.cancel_scope.cancel()  # (a restart posted would be waited for)
    assert not posted
    assert result == [True]
    assert not halted


def test_a_placement_roll_out_leaves_serving_a_worker_while_gpu_telemetry_is_down() -> None:
    """Regression: a placement roll-out (GPU telemetry came up after w-0 started unplaced)
    reached w-0 after NVML had gone down again (no GPU to place it on now). ``_has_room``
    found "room": placed without devices, an ``auto`` worker gets nothing, not an error. So
    w-0, serving, was restarted, only to wait for GPU telemetry at its start ("no GPU
    telemetry"): taken down for a placement that could not be. It is left serving, said; the
    roll-out started when telemetry is back places it."""
    w0 = Worker("w-0")
    rt, _ = runtime(w0)
    rt.settings = Settings.model_validate(
        {"workers": [{"name": "w", "command": ["true"], "gpus": "auto"}]}
    )
    rt.workers = lambda: [w0]
    w0.spec = SimpleNamespace(gpus=None, group="w", index=0)
    rt.slots = lambda: []  # NVML down (again): no devices to place on
    said: list[dict[str, Any]] = []
    rt.log = SimpleNamespace(
        warning=lambda event, **fields: said.append({"event": event, **fields})
    )
    assert rt._has_room(w0) is False
    assert [(s["event"], s["worker"]) for s in said] == [("supervisor.placement_skipped", "w-0")]
    assert "telemetry" in said[0]["reason"], said


def _waiting_for_ready(
    rt: Any, w0: Worker
) -> tuple[list[bool], anyio.Event, Callable[[], Coroutine[Any, Any, None]]]:
    """A roll-out's wait for ``w0`` to be ready within a 0.1 s budget: what it answered, an
    event set once the budget ran out (the extensions are looked at), and the wait itself."""
    result: list[bool] = []
    expired = anyio.Event()
    granted_until = rt._granted_until

    def looked_at(*args: Any) -> float | None:
        expired.set()
        until: float | None = granted_until(*args)
        return until

    rt._granted_until = looked_at

    async def wait() -> None:
        settled = await rt._wait_started(
            lambda: False,
            lambda: w0.record.state is WorkerState.READY,
            0.1,
            watched=lambda: (w0,),
        )
        result.append(settled)

    return result, expired, wait


def test_a_roll_out_waits_for_a_start_the_worker_extended() -> None:
    """Regression: a roll-out waited for a restarted worker no longer than its stop budget
    plus ``start_timeout_s``, though the worker had asked for more time to load with
    EXTEND_TIMEOUT_USEC (which the lifecycle grants: no start timeout): the roll-out was
    halted ("did not become ready") while the worker loaded as it said, and a reload that
    removed a worker SIGKILLed one that had asked for time to finish its stop. The wait now
    lasts while the worker's own extended deadline (and the stop after it) has not passed."""
    anyio.run(_extended_start)


async def _extended_start() -> None:
    w0 = Worker("w-0")
    rt, _ = runtime(w0)
    rt.clock = AnyioClock()
    now = rt.clock.now()
    w0.timing = lc.Timing(drain_timeout_s=0.0, stop_timeout_s=0.0)
    # loading, granted 0.6 s more than the 0.1 s budget by EXTEND_TIMEOUT_USEC
    rec = lc.WorkerRecord(state=WorkerState.STARTING, pid=100, started_at=now, deadline=now)
    rec = lc.step(rec, lc.ExtendTimeout(100, 0.6), now, w0.timing)[0]
    w0.record = cast(Any, rec)
    result, expired, wait = _waiting_for_ready(rt, w0)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await expired.wait()
            await settle()
            assert not result, "gave up on a start the worker was granted"
            w0.record = cast(Any, lc.step(rec, lc.Ready(100), rt.clock.now(), w0.timing)[0])
            wake(rt)
    assert result == [True]


def test_a_roll_out_waits_for_a_start_an_extended_stop_delayed() -> None:
    """Regression: the restarted worker's old process asked for time to finish its stop
    (EXTEND_TIMEOUT_USEC) and exited within the roll-out's budget, but late enough that its
    replacement, loading within its own ``start_timeout_s``, was not ready when the budget ran
    out: the extension was of a state that was over, so the roll-out gave up on the new start
    (halted, "did not become ready"). An extension seen while the wait lasts is followed to
    the deadlines after it."""
    anyio.run(_extended_stop_then_start)


async def _extended_stop_then_start() -> None:
    w0 = Worker("w-0")
    rt, _ = runtime(w0)
    rt.clock = AnyioClock()
    now = rt.clock.now()
    w0.timing = lc.Timing(drain_timeout_s=0.0, stop_timeout_s=0.0)
    # its old process stopping, granted a little more time by EXTEND_TIMEOUT_USEC
    rec = lc.WorkerRecord(state=WorkerState.STOPPING, pid=100, deadline=now)
    w0.record = cast(Any, lc.step(rec, lc.ExtendTimeout(100, 0.05), now, w0.timing)[0])
    result, expired, wait = _waiting_for_ready(rt, w0)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await settle()
            # it exited, and its replacement loads (start_timeout_s: until well after the budget)
            started = rt.clock.now()
            new = lc.WorkerRecord(
                state=WorkerState.STARTING, pid=101, started_at=started, deadline=started + 1.0
            )
            w0.record = cast(Any, new)
            wake(rt)
            await expired.wait()
            await settle()
            assert not result, "gave up on a start within its start_timeout_s"
            w0.record = cast(Any, lc.step(new, lc.Ready(101), rt.clock.now(), w0.timing)[0])
            wake(rt)
    assert result == [True]
