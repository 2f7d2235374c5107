"""The Healer's bookkeeping across samples, with a fake runtime (no processes, a fake clock):
one-shot findings, migrations, derating across re-placements, per-process cooldowns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest

from supervisor.clock import FakeClock
from supervisor.config import Settings, parse_settings
from supervisor.healing import Healer
from supervisor.model import DeviceSample, ExitReason, Sample, WorkerState, WorkerUsage
from supervisor.plan import GpuSlot, slot_for
from supervisor.policy import lifecycle as lc
from supervisor.policy.heal import Finding

GPUS = [f"GPU-{i}" for i in range(3)]


class Journal:
    def __init__(self) -> None:
        self.items: list[tuple[str, str | None, dict[str, Any]]] = []

    def append(self, wall: float, kind: str, worker: str | None, **fields: Any) -> None:
        self.items.append((kind, worker, fields))


class Runner:
    """What the healer reads of a worker, and what it posts to it."""

    def __init__(self, name: str, gpu: str, state: WorkerState = WorkerState.READY) -> None:
        self.name = name
        group, index = name.rsplit("-", 1)
        self.spec = SimpleNamespace(group=group, index=int(index), gpus=(gpu,))
        self.record = SimpleNamespace(
            pid=100, ready_at=0.0, started_at=0.0, state=state, restarts=0, after_exit=None
        )
        self.last_exit_pid: int | None = None
        self.posted: list[Any] = []
        #: an event that takes it down, posted by someone else (a roll-out, an operator) and
        #: not yet taken by its task (the healer's own posts stay in ``posted``)
        self.queued: Any = None

    @property
    def state(self) -> WorkerState:
        state: WorkerState = self.record.state
        return state

    def post(self, event: Any) -> None:
        self.posted.append(event)

    def queued_down(self) -> Any:
        return self.queued


@dataclass
class Host:
    settings: Settings
    runners: dict[str, Any]
    clock: FakeClock = field(default_factory=lambda: FakeClock(start=0.0))
    cordoned: set[str] = field(default_factory=set)
    journal: Journal = field(default_factory=Journal)
    actions_total: dict[tuple[str, str], int] = field(default_factory=dict)
    devices: dict[str, DeviceSample] = field(default_factory=dict)
    rolling: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.devices = {
            u: DeviceSample(
                i,
                u,
                "sim",
                memory_total_mb=80000,
                memory_free_mb=70000,
                temperature_c=50,
                temperature_slowdown_c=90,
                clocks_event_reasons=0,
            )
            for i, u in enumerate(GPUS)
        }

    def workers(self) -> list[Any]:
        return list(self.runners.values())

    def slots(self) -> list[GpuSlot]:
        return [slot_for(d) for d in self.devices.values()]

    def changed(self) -> None:
        pass

    def temperature(self, gpu: str, celsius: float) -> None:
        self.devices[gpu] = replace(self.devices[gpu], temperature_c=celsius)

    def tick(self, healer: Healer, seconds: float = 1.0) -> None:
        self.clock.advance(seconds)
        # a sample's time is when the sampler took it: a little before the loop handles it
        taken = self.clock.now() - 0.005
        healer.on_sample(Sample(taken, tuple(self.devices.values()), {}, True))

    def acts(self) -> list[tuple[str, str | None]]:
        return [(kind.removeprefix("heal."), worker) for kind, worker, _ in self.journal.items]


def setup(on_thermal: str, *runners: Runner) -> tuple[Host, Healer]:
    groups = sorted({r.spec.group for r in runners})
    cfg = {
        "gpu": {"backend": "sim"},
        "workers": [
            {
                "name": g,
                "command": ["x"],
                "replicas": sum(r.spec.group == g for r in runners),
                "health": {
                    "on_thermal": on_thermal,
                    "max_unavailable": 5,
                    "log_restart_patterns": ["CUDA error"],
                },
            }
            for g in groups
        ],
    }
    host = Host(parse_settings(cfg), {r.name: r for r in runners})
    return host, Healer(host)  # type: ignore[arg-type]


def one_unavailable(host: Host) -> None:
    """Every group of ``host`` with ``max_unavailable = 1``."""
    host.settings = host.settings.model_copy(
        update={
            "workers": tuple(
                g.model_copy(update={"health": g.health.model_copy(update={"max_unavailable": 1})})
                for g in host.settings.workers
            )
        }
    )


def two_groups_on_two_gpus() -> tuple[Host, Healer, Runner, Runner, Runner, Runner]:
    """Groups w and x (max_unavailable 1), one worker of each on GPU-0 and on GPU-1: an XID
    on a GPU concerns two workers there (it is neither's alone)."""
    w0, x0 = Runner("w-0", GPUS[0]), Runner("x-0", GPUS[0])
    w1, x1 = Runner("w-1", GPUS[1]), Runner("x-1", GPUS[1])
    host, healer = setup("derate", w0, w1, x0, x1)
    one_unavailable(host)
    return host, healer, w0, w1, x0, x1


def test_a_restore_due_within_the_cooldown_of_the_last_one_is_not_lost() -> None:
    """Hot 0-25 s and 60-71 s (sustain 10 s, clear 30 s): derate, restore, derate, restore;
    the second restore came 46 s after the first and was dropped by the 60 s cooldown."""
    g0 = Runner("g-0", GPUS[0])
    host, healer = setup("derate", g0)
    for t in range(200):
        host.temperature(GPUS[0], 88 if t < 25 or 60 <= t < 71 else 50)
        host.tick(healer)
    assert [a for a in host.acts() if a[0] in ("derate", "restore")] == [
        ("derate", "g-0"),
        ("restore", "g-0"),
        ("derate", "g-0"),
        ("restore", "g-0"),
    ]
    assert healer.state.derated == {}


def test_a_gap_in_the_samples_is_not_time_a_gpu_was_seen_hot_or_cool() -> None:
    """Regression: a hot GPU read cool once before the samples stopped for 5 minutes (an
    NVML call hung, the supervisor was stopped) and once after was cool again at once and
    its derated worker routed back; one read hot once before and once after was hot at
    once. ``thermal_sustain_s`` and ``thermal_clear_s`` need samples all along."""
    g0 = Runner("g-0", GPUS[0])
    host, healer = setup("derate", g0)
    host.temperature(GPUS[0], 88)
    for _ in range(11):
        host.tick(healer)
    assert "g-0" in healer.state.derated
    host.temperature(GPUS[0], 50)
    host.tick(healer)
    host.clock.advance(300.0)  # no sample for 5 minutes
    host.tick(healer)
    assert "g-0" in healer.state.derated  # one cool reading after the gap is not 30 s of it
    for _ in range(29):
        host.tick(healer)
    assert "g-0" in healer.state.derated
    host.tick(healer)
    assert healer.state.derated == {}
    # and one hot reading before a gap and one after are not 10 s of heat
    host.temperature(GPUS[0], 88)
    host.tick(healer)
    host.clock.advance(300.0)
    host.tick(healer)
    assert healer.hot_gpus() == set()
    for _ in range(10):
        host.tick(healer)
    assert healer.hot_gpus() == {GPUS[0]}


def test_a_migration_never_lands_on_a_hot_gpu_or_one_too_full() -> None:
    m0 = Runner("m-0", GPUS[0])
    host, healer = setup("migrate", m0)
    host.temperature(GPUS[2], 89)  # hot (and empty) before GPU-0 is
    host.devices[GPUS[1]] = replace(host.devices[GPUS[1]], memory_free_mb=500)
    for _ in range(12):
        host.tick(healer)
    healer.avoid["m-0"] = {GPUS[0]}
    healer.need_mb["m-0"] = 2000.0
    usable = {s.uuid: s.why_not for s in healer.migration_slots("m-0", host.slots())}
    assert usable == {
        GPUS[0]: "is hot (migrating off it)",
        GPUS[1]: "has 500 MiB free, the worker used 2000",
        GPUS[2]: "is hot",
    }


def test_a_stopped_migration_lets_the_next_one_go() -> None:
    m0, m1 = Runner("m-0", GPUS[0]), Runner("m-1", GPUS[1])
    host, healer = setup("migrate", m0, m1)
    host.temperature(GPUS[0], 89)
    host.temperature(GPUS[1], 89)
    for _ in range(12):
        host.tick(healer)
    assert [a for a in host.acts() if a[0] == "migrate"] == [("migrate", "m-0")]
    m0.record.state = WorkerState.STOPPED  # the operator stopped it mid-way
    host.tick(healer)
    assert [a for a in host.acts() if a[0] == "migrate"] == [("migrate", "m-0"), ("migrate", "m-1")]
    assert any(isinstance(e, lc.Drain) for e in m1.posted)


def test_a_derated_worker_placed_on_a_cool_gpu_is_restored() -> None:
    """Derated on hot GPU-0, then moved off it (an XID quarantined it, say): its new process
    runs on a cool GPU, so it is routed again, though GPU-0 itself never cooled."""
    g0 = Runner("g-0", GPUS[0])
    host, healer = setup("derate", g0)
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        host.tick(healer)
    assert "g-0" in healer.state.derated
    g0.spec.gpus = (GPUS[1],)
    healer.on_spawned(g0, 200)  # type: ignore[arg-type]
    assert healer.state.derated == {} and host.acts()[-1] == ("restore", "g-0")
    # and one that starts again on the hot GPU stays derated
    host.temperature(GPUS[1], 89)
    for _ in range(12):
        host.tick(healer)
    healer.on_spawned(g0, 300)  # type: ignore[arg-type]
    assert "g-0" in healer.state.derated


def test_the_replacement_of_a_restarted_worker_is_judged_afresh() -> None:
    """A sticky CUDA error from the replacement, 5 s after the last restart for one, restarts
    it too: the cooldown is about one process, not the worker's name."""
    s0 = Runner("s-0", GPUS[0])
    host, healer = setup("derate", s0)
    host.tick(healer)
    healer.on_line(s0, "RuntimeError: CUDA error: an illegal memory access")  # type: ignore[arg-type]
    s0.record.pid = 200
    healer.on_spawned(s0, 200)  # type: ignore[arg-type]
    host.tick(healer, 5.0)
    healer.on_line(s0, "RuntimeError: CUDA error: an illegal memory access")  # type: ignore[arg-type]
    assert [e for e in s0.posted if isinstance(e, lc.Restart)] == [
        lc.Restart(reason=ExitReason.LOG_PATTERN)
    ] * 2


def test_a_hang_restart_is_logged_and_counted_like_a_healing_action() -> None:
    w0 = Runner("w-0", GPUS[0])
    host, healer = setup("derate", w0)
    w0.last_exit_pid = 100
    healer.on_restarted(w0, "hang", "no WATCHDOG=1 within watchdog_s")  # type: ignore[arg-type]
    assert host.journal.items[-1][:2] == ("heal.restart", "w-0")
    assert host.actions_total == {("restart", "hang"): 1}


def test_a_deferred_finding_alerts_once() -> None:
    """GPU-0 turns hot while a migration off GPU-1 is in flight: its migrate waits, and the
    finding is asked about at every sample; its alert (for the derated worker) goes once."""
    m0, m1, g0 = Runner("m-0", GPUS[1]), Runner("m-1", GPUS[0]), Runner("g-0", GPUS[0])
    host, healer = setup("migrate", m0, m1)
    host.settings = parse_settings(
        {
            "gpu": {"backend": "sim"},
            "workers": [
                {"name": "m", "command": ["x"], "replicas": 2, "health": {"on_thermal": "migrate"}},
                {"name": "g", "command": ["x"], "health": {"on_thermal": "derate"}},
            ],
        }
    )
    host.runners["g-0"] = g0
    host.temperature(GPUS[1], 89)
    for _ in range(12):
        host.tick(healer)
    assert host.acts() == [("migrate", "m-0")]  # in flight from now on (it never respawns)
    host.temperature(GPUS[0], 89)
    for _ in range(200):
        host.tick(healer)
    assert host.acts()[1:] == [("derate", "g-0"), ("alert", None)]


def test_a_migrate_for_a_draining_worker_leaves_its_exit_to_the_drain() -> None:
    """Draining for a leak when its GPU turns hot: the move is noted for the next process,
    but the post-mortem evidence stays the leak's, and no second Drain is posted."""
    m0 = Runner("m-0", GPUS[0], state=WorkerState.DRAINING)
    host, healer = setup("migrate", m0)
    healer._exit_evidence["m-0"] = {"action": "drain", "slope_mb_per_min": 50.0}
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        host.tick(healer)
    assert host.acts() == [("migrate", "m-0")] and healer.avoid["m-0"] == {GPUS[0]}
    assert healer.exit_evidence("m-0") == {"action": "drain", "slope_mb_per_min": 50.0}
    assert m0.posted == []


def test_a_migrate_in_the_round_of_a_leak_drain_leaves_the_exit_to_the_drain() -> None:
    """The drain and the migrate of one worker decided together (its events not handled yet:
    still READY): one Drain, the leak's evidence, and the next process goes elsewhere."""
    m0 = Runner("m-0", GPUS[0])
    host, healer = setup("migrate", m0)
    host.tick(healer)
    healer._add(Finding("leak", "grows", worker="m-0", evidence={"slope_mb_per_min": 50.0}))
    healer._add(Finding("thermal", "GPU 0 is hot", gpu=GPUS[0]))
    healer._run(host.clock.now())
    assert host.acts() == [("drain", "m-0"), ("migrate", "m-0")]
    assert [type(e) for e in m0.posted] == [lc.Drain]
    assert healer.exit_evidence("m-0")["slope_mb_per_min"] == 50.0  # type: ignore[index]
    assert healer.avoid["m-0"] == {GPUS[0]}


def test_a_worker_without_a_process_does_not_starve_the_leak_judgements_of_the_others() -> None:
    """A fatal worker (no process, so it is never judged) kept the head of the judgement queue
    at every tick, and the one judgement a tick went to it: a leaking neighbour was never
    judged again and never restarted."""
    dead = Runner("budget-0", GPUS[0], WorkerState.FATAL)
    dead.record.pid = None
    leak = Runner("leak-0", GPUS[0])
    cfg = {
        "supervisor": {"sample_interval_s": 0.25},
        "gpu": {"backend": "sim"},
        "workers": [
            {"name": "budget", "command": ["x"]},
            {
                "name": "leak",
                "command": ["x"],
                "health": {
                    "leak_warmup_s": 1,
                    "leak_window_s": 30,
                    "oom_horizon_s": 100000,
                    "on_leak": "restart",
                },
            },
        ],
    }
    host = Host(parse_settings(cfg), {r.name: r for r in (dead, leak)})
    healer = Healer(host)  # type: ignore[arg-type]
    for _ in range(80):  # 20 s, 30 MiB/s
        host.clock.advance(0.25)
        now = host.clock.now()
        usage = WorkerUsage(
            "leak-0", (100,), 1000 + 30 * now, {GPUS[0]: 1000 + 30 * now}, "pid", 100.0, 0.0
        )
        healer.on_sample(Sample(now, tuple(host.devices.values()), {"leak-0": usage}, True))
    assert lc.Restart(reason=ExitReason.LEAK) in leak.posted
    assert dead.posted == []


def test_an_oom_kill_elsewhere_long_before_a_death_is_not_blamed_on_it(
    monkeypatch: Any,
) -> None:
    """Without a cgroup count of its own, a worker's SIGKILL was host_oom whenever the machine
    had had any OOM kill since the worker started (hours before, in another container): the
    system-wide count is now read at samples and a death compared with the count of a second
    or two before it."""
    from supervisor import procfs

    count = [5]
    monkeypatch.setattr(procfs, "oom_kills", lambda events=None: count[0])
    g0 = Runner("g-0", GPUS[0])
    host, healer = setup("none", g0)
    healer.on_spawned(g0, 100)  # type: ignore[arg-type]
    for _ in range(5):
        host.tick(healer)
    count[0] = 6  # an OOM kill elsewhere on the machine
    for _ in range(60):
        host.tick(healer)
    # the worker is SIGKILLed a minute later: not by that OOM kill
    assert healer.oom_kills_since("g-0", healer.oom_baseline("g-0")) == 0
    # the kernel's kill of the worker itself, just before the reap, counts
    count[0] = 7
    host.clock.advance(0.3)
    assert healer.oom_kills_since("g-0", healer.oom_baseline("g-0")) == 1
    assert healer.oom_scope("g-0") == "host"
    # a process younger than the guard is compared with the count at its spawn
    healer.on_spawned(g0, 101)  # type: ignore[arg-type]
    count[0] = 8
    host.clock.advance(0.2)
    assert healer.oom_kills_since("g-0", healer.oom_baseline("g-0")) == 1


def test_a_second_xid_while_the_first_is_deferred_concerns_the_processes_there_then() -> None:
    """XID 13 on GPU-0 at t=10 is deferred (w-1 of the group is not ready, max_unavailable 1);
    w-0 restarts by itself at t=15; a second XID 13 at t=20 may be its new process's: when
    the group may lose a worker again, w-0 is restarted. Regression: the second XID was
    merged into the first, kept its time, and w-0's new process counted as come after."""
    from supervisor.model import XidEvent

    w0, w2 = Runner("w-0", GPUS[0]), Runner("w-2", GPUS[0])
    w1 = Runner("w-1", GPUS[1], WorkerState.STARTING)
    host, healer = setup("derate", w0, w1, w2)
    one_unavailable(host)
    host.clock.advance(10.0)
    healer.on_xid(XidEvent(0, GPUS[0], 13, host.clock.now()))
    assert not w0.posted and not w2.posted  # deferred: w-1 is down already
    host.clock.advance(5.0)
    w0.record.started_at = host.clock.now()  # crashed and restarted at t=15: ready again
    host.clock.advance(5.0)
    healer.on_xid(XidEvent(0, GPUS[0], 13, host.clock.now()))
    assert not w0.posted and not w2.posted
    w1.record.state = WorkerState.READY
    host.tick(healer)
    assert [type(e).__name__ for e in w0.posted] == ["Restart"]  # one at a time: w-0 first
    assert not w2.posted


def test_a_worker_an_action_was_posted_to_counts_as_down_before_its_task_takes_it() -> None:
    """XID 13 on GPU-0 restarts w-0 (and x-0 beside it); XID 13 on GPU-1, judged in the same
    step of the loop (its task has not taken the Restart yet: w-0 still says ready), waits for
    w-0 to be back (max_unavailable 1). Regression: w-1 was restarted too, both of group w
    down at once. Once w-0's new process runs, w-1's turn comes."""
    from supervisor.model import XidEvent

    host, healer, w0, w1, x0, x1 = two_groups_on_two_gpus()
    host.clock.advance(10.0)
    healer.on_xid(XidEvent(0, GPUS[0], 13, host.clock.now()))
    healer.on_xid(XidEvent(1, GPUS[1], 13, host.clock.now()))
    assert [type(e).__name__ for e in w0.posted + x0.posted] == ["Restart", "Restart"]
    assert not w1.posted and not x1.posted  # deferred: w-0 and x-0 are going down
    host.clock.advance(2.0)
    for r in (w0, x0):  # restarted, ready again
        r.record.pid, r.record.started_at = 200, host.clock.now()
        healer.on_spawned(r, 200)  # type: ignore[arg-type]
    host.tick(healer)
    assert [type(e).__name__ for e in w1.posted + x1.posted] == ["Restart", "Restart"]


def test_an_action_its_worker_never_takes_holds_the_group_back_only_a_while() -> None:
    """A Restart posted to w-0 that its lifecycle ignored (it stays ready, same process):
    w-0 counts as going down for POSTED_HOLD_S, not for good."""
    from supervisor.healing import POSTED_HOLD_S
    from supervisor.model import XidEvent

    host, healer, _, w1, _, _ = two_groups_on_two_gpus()
    host.clock.advance(10.0)
    healer.on_xid(XidEvent(0, GPUS[0], 13, host.clock.now()))
    healer.on_xid(XidEvent(1, GPUS[1], 13, host.clock.now()))
    assert not w1.posted
    host.clock.advance(POSTED_HOLD_S + 1)
    host.tick(healer)
    assert [type(e).__name__ for e in w1.posted] == ["Restart"]


@pytest.mark.parametrize(
    "event",
    [lc.Restart(ExitReason.RELOAD), lc.Restart(), lc.Stop(), lc.Drain(restart=False)],
    ids=["reload", "rolling-restart", "operator-stop", "operator-drain"],
)
def test_a_worker_a_roll_out_has_posted_a_restart_to_counts_as_down(event: Any) -> None:
    """Regression: a roll-out (or an operator's restart, stop or drain) posted its event to
    w-0, and a finding about its sibling w-1 was judged in the same step of the loop, before
    w-0's task took the event: w-0 still said ready, so w-1 was restarted too, both of group
    w down at once with max_unavailable 1. A worker with such an event queued counts as
    going down; once it is back, w-1's turn comes."""
    from supervisor.model import XidEvent

    host, healer, w0, w1, x0, x1 = two_groups_on_two_gpus()
    w0.queued = event  # posted by the roll-out, not yet taken by w-0's task
    host.clock.advance(10.0)
    healer.on_xid(XidEvent(1, GPUS[1], 13, host.clock.now()))
    assert [type(e).__name__ for e in x1.posted] == ["Restart"]  # group x has none down
    assert not w1.posted  # deferred: w-0 is going down
    w0.queued, w0.record.state = None, WorkerState.STOPPING  # its task took it
    host.tick(healer)
    assert not w1.posted
    w0.record.pid, w0.record.started_at = 200, host.clock.now()  # back, ready again
    w0.record.state = WorkerState.READY
    healer.on_spawned(w0, 200)  # type: ignore[arg-type]
    host.tick(healer)
    assert [type(e).__name__ for e in w1.posted] == ["Restart"]
    assert not w0.posted and not x0.posted


def test_a_worker_started_on_a_gpu_that_is_hot_already_is_derated() -> None:
    """GPU-0 turned hot with g-0 on it (derated); g-1 starts there afterwards (a scale, an
    explicit list): derated at its start. Regression: it was routed to, preferred even."""
    g0, g1 = Runner("g-0", GPUS[0]), Runner("g-1", GPUS[0])
    host, healer = setup("derate", g0, g1)
    del host.runners["g-1"]  # not there yet when the GPU turns hot
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        host.tick(healer)
    assert set(healer.state.derated) == {"g-0"}
    host.runners["g-1"] = g1
    healer.on_spawned(g1, 200)  # type: ignore[arg-type]
    assert set(healer.state.derated) == {"g-0", "g-1"}
    assert ("derate", "g-1") in host.acts()


def test_a_cordon_worker_started_on_a_gpu_that_turned_hot_empty_cordons_it() -> None:
    """GPU-1 turned hot with no worker on it (nothing to cordon for then); c-1 of an
    ``on_thermal = "cordon"`` group starts there afterwards (a scale, an explicit list): the
    GPU is cordoned at its start, and uncordoned once it is cool. Regression: it was never
    cordoned while it stayed hot, so every later placement could go onto it. A heat cordon
    the operator lifted stays lifted when a worker starts there again."""
    c0, c1 = Runner("c-0", GPUS[0]), Runner("c-1", GPUS[1])
    host, healer = setup("cordon", c0, c1)
    del host.runners["c-1"]  # not there yet when the GPU turns hot
    host.temperature(GPUS[1], 89)
    for _ in range(12):
        host.tick(healer)
    assert healer.hot_gpus() == {GPUS[1]} and host.cordoned == set()
    host.runners["c-1"] = c1
    healer.on_spawned(c1, 200)  # type: ignore[arg-type]
    assert host.cordoned == {GPUS[1]} and host.acts() == [("cordon", None)]
    host.temperature(GPUS[1], 50)
    for _ in range(40):
        host.tick(healer)
    assert host.cordoned == set() and host.acts() == [("cordon", None), ("uncordon", None)]
    host.temperature(GPUS[1], 89)  # hot again, c-1 on it: cordoned as it turns hot
    for _ in range(12):
        host.tick(healer)
    assert host.cordoned == {GPUS[1]}
    host.cordoned.discard(GPUS[1])  # the operator uncordons it (the runtime's Cordon)
    healer.state.thermal_cordoned.discard(GPUS[1])
    healer.on_spawned(c1, 300)  # type: ignore[arg-type]
    assert host.cordoned == set()
    assert host.acts() == [("cordon", None), ("uncordon", None), ("cordon", None)]


def test_an_xid_on_the_replacement_within_the_cooldown_is_acted_on() -> None:
    """XID 13 restarts w-0; 8 s after its replacement started, another XID 13 on the GPU
    restarts the new process too. Regression: the 60 s cooldown dropped it for good (the
    worker stayed in routing on a dead CUDA context)."""
    from supervisor.model import XidEvent

    w0 = Runner("w-0", GPUS[0])
    host, healer = setup("derate", w0)
    host.clock.advance(10.0)
    healer.on_xid(XidEvent(0, GPUS[0], 13, host.clock.now()))
    assert [type(e).__name__ for e in w0.posted] == ["Restart"]
    host.clock.advance(1.0)
    w0.record.started_at = host.clock.now()
    healer.on_spawned(w0, 200)  # type: ignore[arg-type]
    host.clock.advance(8.0)
    healer.on_xid(XidEvent(0, GPUS[0], 13, host.clock.now()))
    assert [type(e).__name__ for e in w0.posted] == ["Restart", "Restart"]


def test_a_deferred_budget_breach_that_ended_is_not_acted_on() -> None:
    """w-0 is over its GPU budget while its sibling is stopped (deferred: max_unavailable 1),
    then back under it; when the sibling is back, nothing is done to w-0. Regression: the
    stale finding restarted the healthy worker (with the old figure as its evidence)."""
    from supervisor.model import WorkerUsage

    w0, w1 = Runner("w-0", GPUS[0]), Runner("w-1", GPUS[1], WorkerState.STOPPED)
    cfg = {
        "gpu": {"backend": "sim"},
        "workers": [
            {
                "name": "w",
                "command": ["x"],
                "replicas": 2,
                "health": {"gpu_memory_limit_mb": 1000, "max_unavailable": 1},
            }
        ],
    }
    host = Host(parse_settings(cfg), {"w-0": w0, "w-1": w1})
    healer = Healer(host)  # type: ignore[arg-type]

    def sample(mb: float) -> None:
        host.clock.advance(1.0)
        usage = WorkerUsage("w-0", (100,), mb, {GPUS[0]: mb}, "pid", 100.0, 1.0)
        healer.on_sample(
            Sample(host.clock.now(), tuple(host.devices.values()), {"w-0": usage}, True)
        )

    for mb in (1500, 1500, 1500):
        sample(mb)
    assert not w0.posted  # deferred: w-1 is not ready
    for mb in (500, 500):
        sample(mb)
    w1.record.state = WorkerState.READY
    for mb in (500, 500):
        sample(mb)
    assert not w0.posted
    # over it again, with the sibling back: acted on, with the figure of now
    for mb in (1700, 1700):
        sample(mb)
    assert [type(e).__name__ for e in w0.posted] == ["Restart"]


def test_migrate_of_a_worker_with_an_explicit_gpu_list_says_why_it_cannot() -> None:
    m0 = Runner("m-0", GPUS[0])
    host, healer = setup("migrate", m0)
    group = host.settings.workers[0]
    host.settings = host.settings.model_copy(
        update={"workers": (group.model_copy(update={"gpus": (0,)}),)}
    )
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        host.tick(healer)
    alerts = [f for kind, w, f in host.journal.items if kind == "heal.alert" and w == "m-0"]
    assert alerts and not m0.posted
    assert healer._can_migrate([Finding("thermal", "hot", gpu=GPUS[0])]) == {
        "m-0": 'its GPUs are listed (gpus = [...]): only gpus = "auto" workers move'
    }


def test_a_worker_a_reload_is_removing_is_judged_movable_by_its_own_placement() -> None:
    """A reload scaled m to 1 while m-1 still runs on hot GPU-0 (its roll-out removes it
    last; GPU-1 holds m-0, one worker a GPU): whether it can move is found by placing it, not
    taken for granted. Regression:
    placement left it out, which read as "it can move", and its restart then crashed the
    supervisor's placement (KeyError)."""
    m0, m1 = Runner("m-0", GPUS[1]), Runner("m-1", GPUS[0])
    host, healer = setup("migrate", m0, m1)
    group = host.settings.workers[0]
    full = {"replicas": 1, "max_workers_per_gpu": 1}
    host.settings = host.settings.model_copy(update={"workers": (group.model_copy(update=full),)})
    hot = [Finding("thermal", "hot", gpu=GPUS[0])]
    host.temperature(GPUS[2], 89)
    assert healer._can_migrate([*hot, Finding("thermal", "hot", gpu=GPUS[2])]) == {"m-1": False}
    host.temperature(GPUS[2], 50)
    assert healer._can_migrate(hot) == {"m-1": True}


def test_the_gpu_budget_is_per_gpu_for_a_worker_on_two() -> None:
    """Placement reserves gpu_memory_limit_mb on each GPU of a worker, and the worker gets it as
    a per-device cap; the check summed the GPUs, so a worker with 12000 MiB on each of two GPUs
    and a budget of 20000 was restarted until it went fatal. Now one GPU over it is a breach."""
    from supervisor.model import WorkerUsage

    w0 = Runner("w-0", GPUS[0])
    cfg = {
        "gpu": {"backend": "sim"},
        "workers": [
            {"name": "w", "command": ["x"], "health": {"gpu_memory_limit_mb": 20000}},
        ],
    }
    host = Host(parse_settings(cfg), {"w-0": w0})
    healer = Healer(host)  # type: ignore[arg-type]

    def sample(a: float, b: float) -> None:
        host.clock.advance(1.0)
        usage = WorkerUsage("w-0", (100,), a + b, {GPUS[0]: a, GPUS[1]: b}, "pid", 100.0, 1.0)
        healer.on_sample(
            Sample(host.clock.now(), tuple(host.devices.values()), {"w-0": usage}, True)
        )

    for _ in range(4):
        sample(12000, 12000)
    assert not w0.posted
    for _ in range(2):
        sample(21000, 100)
    assert [type(e).__name__ for e in w0.posted] == ["Restart"]


class Alerts:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, doc: dict[str, Any]) -> None:
        self.sent.append(doc)


def test_a_worker_ready_for_max_age_is_recycled_one_at_a_time_without_an_alert() -> None:
    """``max_age_s`` 100 with 50 of jitter: each process is due between 100 and 150 s after it
    was ready, at the share of the jitter drawn for it; the group's second worker waits while
    the first is down (max_unavailable 1); a recycle is logged and counted, not sent as an
    alert; the replacement is due again, from its own readiness."""
    r0, r1 = Runner("r-0", GPUS[0]), Runner("r-1", GPUS[1])
    host = Host(
        parse_settings(
            {
                "gpu": {"backend": "sim"},
                "workers": [
                    {
                        "name": "r",
                        "command": ["x"],
                        "replicas": 2,
                        "health": {"max_age_s": 100, "max_age_jitter_s": 50},
                    }
                ],
            }
        ),
        {"r-0": r0, "r-1": r1},
    )
    alerts = Alerts()
    draws = iter([0.2, 0.4, 0.0, 0.0])  # r-0, r-1, then their next processes
    rng = SimpleNamespace(random=lambda: next(draws))
    healer = Healer(host, alerts, rng=rng)  # type: ignore[arg-type]
    host.tick(healer, 109.0)
    assert host.acts() == []  # r-0 is due at 110
    host.tick(healer, 1.5)  # (a sample is taken 5 ms before the loop sees it)
    assert r0.posted == [lc.Drain(restart=True, reason=ExitReason.MAX_AGE)]
    assert host.acts() == [("drain", "r-0")]
    r0.record.state = WorkerState.DRAINING
    host.tick(healer, 20.0)  # r-1 due at 120: r-0 is down
    assert r1.posted == []
    r0.record.state = WorkerState.READY  # back: a new process, ready at 130
    r0.record.pid, r0.record.ready_at = 200, host.clock.now()
    healer.on_spawned(r0, 200)  # type: ignore[arg-type]
    host.tick(healer, 0.5)
    assert r1.posted == [lc.Drain(restart=True, reason=ExitReason.MAX_AGE)]
    r1.record.state = WorkerState.DRAINING
    r0.posted.clear()
    host.tick(healer, 99.0)
    assert r0.posted == []  # due 100 s after it was ready
    r1.record.state = WorkerState.READY
    r1.record.pid, r1.record.ready_at = 201, host.clock.now()
    healer.on_spawned(r1, 201)  # type: ignore[arg-type]
    host.tick(healer, 1.0)
    assert r0.posted == [lc.Drain(restart=True, reason=ExitReason.MAX_AGE)]
    assert host.actions_total == {("drain", "max_age"): 3}
    assert alerts.sent == []
    assert healer.exit_evidence("r-0") == {
        "ready_for_s": 100.495,
        "max_age_s": 100.0,
        "max_age_jitter_s": 50.0,
        "due_after_s": 100.0,
        "action": "drain",
        "message": "ready for 100 s (max_age_s = 100): recycled",
    }


def _recycling(max_age_s: float, **health: Any) -> dict[str, Any]:
    return {
        "gpu": {"backend": "sim"},
        "workers": [
            {
                "name": "r",
                "command": ["x"],
                "replicas": 2,
                "health": {"max_age_s": max_age_s, **health},
            }
        ],
    }


def _two_due() -> tuple[Host, Healer, Runner, Runner]:
    """r-0 and r-1 both due at 100 s (no jitter): r-0 is drained, r-1 waits its turn."""
    r0, r1 = Runner("r-0", GPUS[0]), Runner("r-1", GPUS[1])
    host = Host(parse_settings(_recycling(100)), {"r-0": r0, "r-1": r1})
    healer = Healer(host)  # type: ignore[arg-type]
    host.tick(healer, 101.0)
    assert r0.posted == [lc.Drain(restart=True, reason=ExitReason.MAX_AGE)]
    assert r1.posted == []
    r0.record.state = WorkerState.DRAINING
    host.tick(healer, 1.0)
    return host, healer, r0, r1


def test_a_deferred_recycle_says_it_is_due_in_the_worker_object() -> None:
    """``recycle_in_s``: 0 while due and waiting its turn (docs/healing.md, api.Worker); it
    said null (off, not ready, or under way) from the moment the recycle was first deferred."""
    _host, healer, _r0, r1 = _two_due()
    assert r1.posted == []
    assert healer.annotate("r-1", {})["recycle_in_s"] == 0.0


@pytest.mark.parametrize("max_age_s", [0.0, 1000.0])
def test_a_reload_that_turns_recycles_off_or_later_cancels_a_deferred_one(
    max_age_s: float,
) -> None:
    """r-1 is due and waits for r-0's recycle; a reload sets max_age_s to 0 (off) or raises
    it past r-1's age ("a reload that changes max_age_s applies to the running processes at
    once"). Regression: the deferred recycle went ahead once r-0 was back."""
    host, healer, r0, r1 = _two_due()
    host.settings = parse_settings(_recycling(max_age_s))
    r0.record.state = WorkerState.READY  # back: a new process
    r0.record.pid, r0.record.ready_at = 200, host.clock.now()
    healer.on_spawned(r0, 200)  # type: ignore[arg-type]
    host.tick(healer, 1.0)
    assert r1.posted == []
    assert healer.annotate("r-1", {})["recycle_in_s"] == (
        None if max_age_s == 0 else pytest.approx(1000 - host.clock.now(), abs=0.1)
    )


def _rows(host: Host, gpu: str, *, pending: bool = False, failure: bool = False) -> None:
    from supervisor.model import RemappedRows

    host.devices[gpu] = replace(
        host.devices[gpu], remapped_rows=RemappedRows(3, 1 if failure else 0, pending, failure)
    )


def test_a_failed_row_remap_quarantines_the_gpu_once_and_moves_its_workers() -> None:
    """``remapped_rows.failure`` (seen at the first sample: the XID 64 that came with it
    was before the supervisor watched) quarantines GPU-0 and drains both its workers at once
    (they serve on memory the GPU cannot repair: max_unavailable does not hold them back),
    reason ``row_remap_failure``; a flag that stays on is not acted on again, and an
    operator's lift of the quarantine holds while it does."""
    a0, a1 = Runner("a-0", GPUS[0]), Runner("a-1", GPUS[0])
    host, healer = setup("derate", a0, a1)
    one_unavailable(host)
    _rows(host, GPUS[0], failure=True)
    host.tick(healer)
    assert GPUS[0] in healer.state.quarantined
    assert "row remap failed" in healer.state.quarantined[GPUS[0]]
    drain = lc.Drain(restart=True, reason=ExitReason.ROW_REMAP_FAILURE)
    assert a0.posted == [drain] and a1.posted == [drain]
    assert host.actions_total[("quarantine", "row_remap_failure")] == 1
    assert healer.lift_quarantine(GPUS[0]) is not None
    for _ in range(3):
        host.tick(healer)
    assert GPUS[0] not in healer.state.quarantined  # the operator's word holds
    assert host.actions_total[("quarantine", "row_remap_failure")] == 1
    # cleared (the GPU was replaced or reset and repaired), then failing again: acted on again
    _rows(host, GPUS[0])
    host.tick(healer)
    _rows(host, GPUS[0], failure=True)
    host.tick(healer)
    assert GPUS[0] in healer.state.quarantined
    assert host.actions_total[("quarantine", "row_remap_failure")] == 2


def test_a_pending_row_remap_is_an_alert_once_and_touches_no_worker() -> None:
    """``remapped_rows.pending``: running work is unaffected (NVIDIA): one alert, reason
    ``row_remap_pending``, no worker posted to, no quarantine or cordon; again only after it
    cleared (the GPU was reset) and came back."""
    a0 = Runner("a-0", GPUS[1])
    host, healer = setup("derate", a0)
    _rows(host, GPUS[1], pending=True)
    for _ in range(3):
        host.tick(healer, 70.0)  # past the alert cooldown: still once
    assert host.actions_total == {("alert", "row_remap_pending"): 1}
    assert a0.posted == [] and not healer.state.quarantined and not host.cordoned
    _rows(host, GPUS[1])
    host.tick(healer)
    _rows(host, GPUS[1], pending=True)
    host.tick(healer, 70.0)
    assert host.actions_total == {("alert", "row_remap_pending"): 2}


def test_retired_pages_pending_is_an_alert_once() -> None:
    """Before Ampere: pages retired for ECC errors wait for a reset: one alert (reason
    ``retired_pages_pending``), nothing else; again only after it cleared and came back."""
    a0 = Runner("a-0", GPUS[1])
    host, healer = setup("derate", a0)
    for pending in (True, True, False, True):
        host.devices[GPUS[1]] = replace(host.devices[GPUS[1]], retired_pages_pending=pending)
        host.tick(healer, 70.0)
    assert host.actions_total == {("alert", "retired_pages_pending"): 2}
    assert a0.posted == [] and not healer.state.quarantined


def _recovery(host: Host, gpu: str, code: int) -> None:
    host.devices[gpu] = replace(host.devices[gpu], recovery_action=code)


def test_a_recovery_action_of_a_reset_quarantines_the_gpu_when_it_changes() -> None:
    """The driver's recovery action (R550+): ``gpu_reset`` quarantines GPU-0 and drains both
    its workers at once (nothing there works until the reset), reason ``recovery_action``;
    the same action at the next samples is not acted on again (an operator's lift holds);
    ``none`` after the reset lifts nothing by itself; ``drain_p2p`` and a code this version
    does not know are alerts only."""
    a0, a1 = Runner("a-0", GPUS[0]), Runner("a-1", GPUS[0])
    host, healer = setup("derate", a0, a1)
    _recovery(host, GPUS[0], 0)
    host.tick(healer)
    assert host.actions_total == {}
    _recovery(host, GPUS[0], 1)
    host.tick(healer)
    assert "gpu reset" in healer.state.quarantined[GPUS[0]]
    drain = lc.Drain(restart=True, reason=ExitReason.RECOVERY_ACTION)
    assert a0.posted == [drain] and a1.posted == [drain]
    assert healer.lift_quarantine(GPUS[0]) is not None
    host.tick(healer)
    assert GPUS[0] not in healer.state.quarantined
    _recovery(host, GPUS[0], 0)
    host.tick(healer)
    for code in (3, 9):
        _recovery(host, GPUS[0], code)
        host.tick(healer, 70.0)
    assert host.actions_total == {
        ("quarantine", "recovery_action"): 1,
        ("drain", "recovery_action"): 2,
        ("alert", "recovery_action"): 2,
    }
    assert GPUS[0] not in healer.state.quarantined


@pytest.mark.parametrize("kind", ["recovery_action", "row_remap_failure", "gpu_lost"])
def test_a_worker_moved_off_a_failing_gpu_moves_again_when_its_new_gpu_fails(kind: str) -> None:
    """a-0 is drained off GPU-0 (its recovery action says reset, a row remap failed, it was
    lost) and
    starts on GPU-1; 10 s later GPU-1 fails the same way (a fabric error reaching the GPUs one
    by one): GPU-1 is quarantined and a-0, a new process there, is drained off it too.
    Regression: the 60 s cooldown of (drain, a-0, reason) outlived the process it was about,
    the drain was dropped, and with the flag staying on a-0 stayed on a quarantined GPU for
    good."""
    a0 = Runner("a-0", GPUS[0])
    host, healer = setup("derate", a0)

    def fail(gpu: str) -> None:
        if kind == "recovery_action":
            _recovery(host, gpu, 1)
        elif kind == "gpu_lost":
            host.devices[gpu] = DeviceSample(0, gpu, "sim", healthy=False, error="GPU is lost")
        else:
            _rows(host, gpu, failure=True)

    fail(GPUS[0])
    host.tick(healer)
    drain = lc.Drain(restart=True, reason=ExitReason(kind))
    assert a0.posted == [drain]
    a0.posted.clear()
    a0.spec.gpus = (GPUS[1],)  # drained: started again on GPU-1
    a0.record.pid, a0.record.started_at = 200, host.clock.now()
    healer.on_spawned(a0, 200)  # type: ignore[arg-type]
    host.tick(healer, 5.0)
    fail(GPUS[1])
    host.tick(healer, 5.0)
    assert set(healer.state.quarantined) == {GPUS[0], GPUS[1]}
    assert a0.posted == [drain]
    assert host.actions_total[("drain", kind)] == 2


def host_budget_of(limit_mb: float) -> tuple[Host, Healer, Runner]:
    """One worker, w-0, of a group with ``host_memory_limit_mb = limit_mb``."""
    w0 = Runner("w-0", GPUS[0])
    cfg = {
        "gpu": {"backend": "sim"},
        "workers": [{"name": "w", "command": ["x"], "health": {"host_memory_limit_mb": limit_mb}}],
    }
    host = Host(parse_settings(cfg), {"w-0": w0})
    return host, Healer(host), w0  # type: ignore[arg-type]


def test_one_reading_of_host_memory_over_its_budget_is_not_two_samples() -> None:
    """``/proc`` is read every 2 s (``HOST_EVERY_S``) while samples come every 0.5 s, and the
    samples in between repeat the last reading: one reading of RSS over
    ``host_memory_limit_mb`` (a spike) counted as two consecutive samples and restarted the
    worker. Now only a new reading counts (``Sample.host_at``): two readings over it do."""
    from supervisor.model import WorkerUsage

    host, healer, w0 = host_budget_of(100)

    def sample(rss: float, read_at: float) -> None:
        host.clock.advance(0.5)
        usage = WorkerUsage("w-0", (100,), 10.0, {GPUS[0]: 10.0}, "pid", rss, 1.0)
        healer.on_sample(
            Sample(
                host.clock.now(),
                tuple(host.devices.values()),
                {"w-0": usage},
                True,
                host_at=read_at,
            )
        )

    sample(50, 0.4)
    for _ in range(4):  # one reading (at 1.0) of a spike, repeated by four samples
        sample(150, 1.0)
    sample(50, 3.0)
    assert not w0.posted
    sample(150, 5.0)
    sample(150, 5.0)
    assert not w0.posted
    sample(160, 7.0)  # a second reading over it
    assert [type(e).__name__ for e in w0.posted] == ["Restart"]


def test_the_host_budget_of_a_forked_tree_is_judged_on_its_pss() -> None:
    """A worker that forks after loading (pre-fork servers, loader processes) shares its pages
    with its children: their RSS counts them once per process (4 x 300 MiB for 300 MiB held).
    Where the sampler read the tree's PSS (its RSS over the budget), the budget is judged on
    that. Regression: such a worker was restarted over a budget it was well under."""
    from supervisor.model import WorkerUsage

    host, healer, w0 = host_budget_of(600)

    def sample(rss: float, pss: float | None) -> None:
        host.clock.advance(2.0)  # a new reading each time
        usage = WorkerUsage("w-0", (100, 101), 10.0, {GPUS[0]: 10.0}, "pid", rss, 1.0, pss)
        now = host.clock.now()
        healer.on_sample(
            Sample(now, tuple(host.devices.values()), {"w-0": usage}, True, host_at=now)
        )

    for _ in range(4):
        sample(1200, 320)
    assert not w0.posted
    sample(1300, 650)
    sample(1300, 660)  # two readings over it by PSS
    assert [type(e).__name__ for e in w0.posted] == ["Restart"]
    [said] = [f for kind, _, f in host.journal.items if kind == "heal.restart"]
    assert "host memory (PSS) 660 MiB over its budget of 600 MiB" in said["message"]


def _tp_host(health: dict[str, Any], interval_s: float | None = None) -> tuple[Host, Runner]:
    """t-0 of a group with gpus_per_worker = 2 on GPU-0 and GPU-1 (a tensor-parallel server),
    with these ``[workers.health]`` values (and ``sample_interval_s``)."""
    t0 = Runner("t-0", GPUS[0])
    t0.spec.gpus = (GPUS[0], GPUS[1])
    cfg: dict[str, Any] = {
        "gpu": {"backend": "sim"},
        "workers": [{"name": "t", "command": ["x"], "gpus_per_worker": 2, "health": health}],
    }
    if interval_s is not None:
        cfg["supervisor"] = {"sample_interval_s": interval_s}
    return Host(parse_settings(cfg), {"t-0": t0}), t0


def _tp_worker(on_thermal: str) -> tuple[Host, Healer, Runner]:
    """``_tp_host`` with 15000 MiB on each GPU."""
    host, t0 = _tp_host({"on_thermal": on_thermal, "max_unavailable": 5})
    return host, Healer(host), t0  # type: ignore[arg-type]


def _tp_tick(host: Host, healer: Healer) -> None:
    host.clock.advance(1.0)
    by_gpu = {GPUS[0]: 15000.0, GPUS[1]: 15000.0}
    usage = WorkerUsage("t-0", (100,), 30000.0, by_gpu, "pid", 100.0, 1.0)
    healer.on_sample(Sample(host.clock.now(), tuple(host.devices.values()), {"t-0": usage}, True))


def test_a_worker_on_two_gpus_migrates_where_each_gpu_has_room_for_its_share() -> None:
    """Regression: a migration target had to have the worker's memory summed over its GPUs
    free on each GPU: a tensor-parallel worker with 15000 MiB on each of two GPUs was never
    moved off its hot GPU onto one with 20000 MiB free ("no cooler GPU has room")."""
    host, healer, _ = _tp_worker("migrate")
    host.devices[GPUS[2]] = replace(host.devices[GPUS[2]], memory_free_mb=20000)
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        _tp_tick(host, healer)
    assert ("migrate", "t-0") in host.acts()
    assert ("alert", "t-0") not in host.acts()
    usable = {s.uuid for s in healer.migration_slots("t-0", host.slots()) if s.usable}
    assert usable == {GPUS[1], GPUS[2]}


def test_a_worker_on_two_hot_gpus_stays_derated_until_both_are_cool() -> None:
    """Regression: a worker derated for one hot GPU of its two was routed again as soon as
    that one cooled, while its other GPU was still hot."""
    host, healer, _ = _tp_worker("derate")
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        _tp_tick(host, healer)
    host.temperature(GPUS[1], 89)
    for _ in range(12):
        _tp_tick(host, healer)
    assert "t-0" in healer.state.derated
    assert healer.hot_gpus() == {GPUS[0], GPUS[1]}
    host.temperature(GPUS[0], 50)
    for _ in range(40):
        _tp_tick(host, healer)
    assert healer.hot_gpus() == {GPUS[1]}
    assert "t-0" in healer.state.derated
    host.temperature(GPUS[1], 50)
    for _ in range(40):
        _tp_tick(host, healer)
    assert healer.state.derated == {}


def test_a_leak_on_one_gpu_of_two_is_projected_against_that_gpus_budget() -> None:
    """Regression: the GPU budget is per GPU, but a leak of a worker on two GPUs was projected
    against twice the budget less what both held: 5750 MiB growing 30 MiB/s on GPU-0 (of a
    10000 MiB budget) and 1000 flat on GPU-1 was 440 s from its budget, not 140, and with a
    300 s horizon the worker was restarted over its budget instead of drained before it."""
    health = {
        "gpu_memory_limit_mb": 10000,
        "leak_warmup_s": 1,
        "leak_window_s": 30,
        "oom_horizon_s": 300,
    }
    host, t0 = _tp_host(health, interval_s=0.25)
    healer = Healer(host)  # type: ignore[arg-type]
    for _ in range(100):  # 25 s
        host.clock.advance(0.25)
        now = host.clock.now()
        by_gpu = {GPUS[0]: 5000 + 30 * now, GPUS[1]: 1000.0}
        usage = WorkerUsage("t-0", (100,), sum(by_gpu.values()), by_gpu, "pid", 100.0, 0.0)
        healer.on_sample(Sample(now, tuple(host.devices.values()), {"t-0": usage}, True))
    leak = healer.annotate("t-0", {})["leak"]
    assert leak["suspected"] and 130 < leak["projected_oom_s"] < 150, leak
    assert lc.Drain(restart=True, reason=ExitReason.LEAK) in t0.posted


@pytest.mark.parametrize("tp", [2, 4])
def test_a_leak_on_every_gpu_of_a_tensor_parallel_worker_is_projected_per_gpu(tp: int) -> None:
    """Regression: a worker on several GPUs had its leak's rate taken from its memory summed
    over its GPUs, but its headroom from one GPU: where every rank leaks alike (the usual
    tensor-parallel case), 10 MiB/min on each GPU with 500 MiB used of a 1000 MiB budget was
    projected to run out in 25 minutes on two GPUs, 12.5 on four (drained that much too
    early), not 50. Each GPU's floor is now judged against that GPU's headroom."""
    gpus = [f"GPU-{i}" for i in range(tp)]
    t0 = Runner("t-0", gpus[0])
    t0.spec.gpus = tuple(gpus)
    cfg = {
        "supervisor": {"sample_interval_s": 1.0},
        "gpu": {"backend": "sim"},
        "workers": [
            {
                "name": "t",
                "command": ["x"],
                "gpus_per_worker": tp,
                "health": {
                    "gpu_memory_limit_mb": 1000,
                    "leak_warmup_s": 0,
                    "leak_window_s": 600,
                    "oom_horizon_s": 300,
                },
            }
        ],
    }
    host = Host(parse_settings(cfg), {"t-0": t0})
    template = host.devices[GPUS[0]]
    host.devices = {
        u: replace(template, index=i, uuid=u, memory_free_mb=70000) for i, u in enumerate(gpus)
    }
    healer = Healer(host)  # type: ignore[arg-type]
    for _ in range(600):  # 10 minutes: each GPU from 400 to 500 MiB, 10 MiB/min
        host.clock.advance(1.0)
        now = host.clock.now()
        by_gpu = dict.fromkeys(gpus, 400 + 10 * now / 60)
        usage = WorkerUsage("t-0", (100,), sum(by_gpu.values()), by_gpu, "pid", 100.0, 0.0)
        healer.on_sample(Sample(now, tuple(host.devices.values()), {"t-0": usage}, True))
    leak = healer.annotate("t-0", {})["leak"]
    # 500 MiB left on each GPU at 10 MiB/min: 50 minutes
    assert leak["suspected"] and leak["projected_oom_s"] == pytest.approx(3000, rel=0.1), leak
    assert leak["slope_mb_per_min"] == pytest.approx(10, rel=0.1), leak
    assert t0.posted == []


@pytest.mark.parametrize(
    ("leaking", "nvml", "placed", "projected"),
    [
        # every rank leaks 10 MiB/min, 600 of 1000 MiB used on each GPU: 400 / 10 = 40 min
        ((0, 1), (600.0, 600.0), True, 2400),
        # only the rank on GPU-0 (300 used there) leaks, GPU-1 is the fullest: 700 / 10
        ((0,), (300.0, 800.0), True, 4200),
        # the ranks' GPUs unknown (no process lists): the sum against the fullest GPU
        ((0, 1), (600.0, 600.0), False, 1200),
    ],
)
def test_the_reports_of_a_tensor_parallel_worker_are_judged_per_gpu(
    leaking: tuple[int, ...], nvml: tuple[float, float], placed: bool, projected: float
) -> None:
    """Regression: a worker on two GPUs whose ranks report ``X_GPU_MEMORY_IN_USE_MB`` had the
    sum of the reports judged against one headroom (its fullest GPU's), though NVML's process
    lists say which GPU each rank is on: 10 MiB/min on each rank with 400 MiB left on each
    GPU was projected to run out in 20 minutes, not 40 (drained with a 30-minute horizon),
    and one rank's leak was projected against another GPU's headroom. Each GPU's reports are
    now judged against that GPU's headroom; unplaced reports are still judged summed."""
    import os

    from supervisor.model import GpuProcess

    gpus = (GPUS[0], GPUS[1])
    health = {
        "gpu_memory_limit_mb": 1000,
        "leak_warmup_s": 0,
        "leak_window_s": 600,
        "oom_horizon_s": 1800,
    }
    host, t0 = _tp_host(health, interval_s=1.0)
    ranks = (os.getpid(), os.getppid())  # running processes: a gone rank's reports are dropped
    for i, (u, pid) in enumerate(zip(gpus, ranks, strict=True)):
        procs = (GpuProcess(pid, nvml[i]),) if placed else None
        host.devices[u] = replace(host.devices[u], processes=procs)
    healer = Healer(host)  # type: ignore[arg-type]
    by_gpu = dict(zip(gpus, nvml, strict=True))
    usage = WorkerUsage("t-0", ranks, sum(nvml), by_gpu, "pid", 100.0, 0.0)
    for _ in range(600):  # 10 minutes, a report from each rank every 5 s
        host.clock.advance(1.0)
        now = host.clock.now()
        if now % 5 == 0:
            for i, pid in enumerate(ranks):
                mb = 200 + (10 * now / 60 if i in leaking else 0)
                healer.on_notify(t0, pid, {"X_GPU_MEMORY_IN_USE_MB": f"{mb:.1f}"})  # type: ignore[arg-type]
        healer.on_sample(Sample(now, tuple(host.devices.values()), {"t-0": usage}, True))
    leak = healer.annotate("t-0", {})["leak"]
    assert leak["source"] == "worker", leak
    assert leak["suspected"] and leak["projected_oom_s"] == pytest.approx(projected, rel=0.1), leak
    assert (t0.posted == []) == (projected > 1800)


def test_the_alert_of_a_worker_that_stayed_on_two_gpus_names_its_hot_one() -> None:
    """Regression: a worker on GPU-0 and GPU-1 that could not move off hot GPU-1 was said to
    be stuck on its hot GPU-0 (the alert's gpu was the first of its GPUs, which is cool)."""
    host, healer, t0 = _tp_worker("migrate")
    host.temperature(GPUS[1], 89)
    for _ in range(12):
        _tp_tick(host, healer)
    assert healer.hot_gpus() == {GPUS[1]}
    healer.on_migration_stayed(t0, (GPUS[0], GPUS[1]), "no cooler GPU has room")  # type: ignore[arg-type]
    kind, worker, fields = host.journal.items[-1]
    assert (kind, worker, fields["gpu"]) == ("heal.alert", "t-0", GPUS[1])


def test_a_worker_on_two_gpus_may_migrate_onto_the_one_it_keeps() -> None:
    """Regression: the GPU a tensor-parallel worker keeps when it moves off its hot one had to
    have the worker's share free besides what the worker itself holds there: on GPU-0 (hot)
    and GPU-1 (10000 MiB free, 15000 of them its own), with GPU-2 (20000 free) the only other,
    it never moved ("no cooler GPU has room"), though GPU-1 and GPU-2 take it."""
    host, healer, t0 = _tp_worker("migrate")
    host.devices[GPUS[1]] = replace(host.devices[GPUS[1]], memory_free_mb=10000)
    host.devices[GPUS[2]] = replace(host.devices[GPUS[2]], memory_free_mb=20000)
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        _tp_tick(host, healer)
    assert ("migrate", "t-0") in host.acts()
    assert ("alert", "t-0") not in host.acts()
    # once its process is gone, the GPU's free memory has its share back: not counted twice
    t0.record.pid = None
    host.devices[GPUS[1]] = replace(host.devices[GPUS[1]], memory_free_mb=14000)
    usable = {s.uuid for s in healer.migration_slots("t-0", host.slots()) if s.usable}
    assert usable == {GPUS[2]}


def leaking(**budgets: float) -> tuple[Runner, Host, Healer]:
    """One worker ``w-0`` on GPU 0 whose leaks are judged at once (no warm-up, a 60 s window,
    a 300 s horizon, ``on_leak = "restart"``) against ``budgets``, samples every 0.5 s."""
    w0 = Runner("w-0", GPUS[0])
    health = {"leak_warmup_s": 0, "leak_window_s": 60, "oom_horizon_s": 300, "on_leak": "restart"}
    cfg = {
        "supervisor": {"sample_interval_s": 0.5},
        "gpu": {"backend": "sim"},
        "workers": [{"name": "w", "command": ["x"], "health": {**health, **budgets}}],
    }
    host = Host(parse_settings(cfg), {"w-0": w0})
    return w0, host, Healer(host, host_available_mb=lambda: 100_000.0)  # type: ignore[arg-type]


def sample_leak(
    host: Host, healer: Healer, gpu: float, rss: float, pss: float | None = None
) -> None:
    """0.5 s later, a sample of ``w-0`` holding ``gpu`` MiB on GPU 0, ``rss`` (``pss``) of host
    memory."""
    from supervisor.model import WorkerUsage

    host.clock.advance(0.5)
    now = host.clock.now()
    usage = WorkerUsage("w-0", (100, 101), gpu, {GPUS[0]: gpu}, "pid", rss, 1.0, pss)
    healer.on_sample(Sample(now, tuple(host.devices.values()), {"w-0": usage}, True, host_at=now))


def test_the_host_leak_of_a_forked_tree_is_projected_to_its_pss_budget() -> None:
    """Regression: where the host budget is judged on the tree's PSS (a pre-fork server: its
    RSS counts the shared pages once per process, and is over the budget), the host leak's
    projection still measured the headroom on the RSS: a budget "already exceeded", so
    ``host_projected_oom_s`` was 0 and the worker was drained at once (as imminent, past
    ``max_unavailable``) while its PSS was far under the budget. The headroom is now the
    budget less what the budget is judged on (the PSS where read)."""
    w0, host, healer = leaking(host_memory_limit_mb=2000)
    for _ in range(240):  # 120 s: RSS grows 120 MiB/min, PSS stays at 800 MiB
        now = host.clock.now() + 0.5
        sample_leak(host, healer, gpu=10.0, rss=2400 + 2 * now, pss=800.0)
    leak = healer.annotate("w-0", {})["leak"]
    assert leak["host_suspected"], leak
    # 1200 MiB left under the budget at 2 MiB/s: 600 s, beyond the 300 s horizon
    assert leak["host_projected_oom_s"] == pytest.approx(600, rel=0.2)
    assert w0.posted == []


def test_a_gpu_and_a_host_leak_at_once_act_on_the_sooner_one() -> None:
    """Regression: where the GPU and the host leak were both acted on in one judgement, the
    host one (judged second) replaced the GPU one under the same finding: the action, its
    message and evidence said host memory although the GPU ran out first. The one projected
    to run out sooner is acted on."""
    _, host, healer = leaking(gpu_memory_limit_mb=5000, host_memory_limit_mb=3000)
    while not host.journal.items and host.clock.now() < 200:
        now = host.clock.now() + 0.5
        gpu = 4700 + now  # 60 MiB/min: about 250 s left when it is judged a leak
        rss = 2680 + now  # 60 MiB/min too: 20 s more left than on the GPU
        sample_leak(host, healer, gpu=gpu, rss=rss)
    leak = healer.annotate("w-0", {})["leak"]
    assert leak["suspected"] and leak["host_suspected"], leak
    assert leak["projected_oom_s"] < leak["host_projected_oom_s"] <= 300, leak
    kind, worker, fields = host.journal.items[0]
    assert (kind, worker, fields["reason"]) == ("heal.restart", "w-0", "leak")
    assert fields["message"].startswith("GPU memory grows"), fields


def _on_thermal(host: Host, choice: str) -> None:
    """Every group of ``host`` with ``on_thermal = choice`` (as a reload applies it)."""
    host.settings = host.settings.model_copy(
        update={
            "workers": tuple(
                g.model_copy(update={"health": g.health.model_copy(update={"on_thermal": choice})})
                for g in host.settings.workers
            )
        }
    )


@pytest.mark.parametrize("choice", ["none", "alert", "migrate", "cordon"])
def test_turning_derating_off_restores_the_derated_workers_at_once(choice: str) -> None:
    """Regression: a reload that changed ``on_thermal`` from ``derate`` to another choice left
    the workers derated then out of routing until their GPU cooled: they are restored at the
    next sample, said as a ``restore`` with the reason."""
    g0 = Runner("g-0", GPUS[0])
    host, healer = setup("derate", g0)
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        host.tick(healer)
    assert "g-0" in healer.state.derated
    _on_thermal(host, choice)
    host.tick(healer)
    assert healer.state.derated == {}
    assert [a for a in host.acts() if a[0] in ("derate", "restore")] == [
        ("derate", "g-0"),
        ("restore", "g-0"),
    ]
    restore = next(f for kind, _, f in host.journal.items if kind == "heal.restore")
    assert restore["reason"] == "thermal" and "on_thermal" in restore["message"]


@pytest.mark.parametrize("state", [WorkerState.STOPPED, WorkerState.FATAL])
def test_a_worker_without_a_process_is_not_derated(state: WorkerState) -> None:
    """Regression: a stopped or fatal worker on a GPU that turned hot was derated (the API and
    ``worker_derated`` said 1 for a worker with no process), and a derated worker that was
    stopped stayed derated; one started again on the hot GPU is derated at its start."""
    g0, g1 = Runner("g-0", GPUS[0], state), Runner("g-1", GPUS[0])
    g0.record.pid = None
    host, healer = setup("derate", g0, g1)
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        host.tick(healer)
    assert set(healer.state.derated) == {"g-1"}
    g1.record.state, g1.record.pid = state, None  # g-1 stops (or gives up)
    healer.on_stopped(g1)  # type: ignore[arg-type]
    host.tick(healer)
    assert healer.state.derated == {}
    assert ("restore", "g-1") not in host.acts()  # not back in routing: it serves nothing
    g0.record.state, g0.record.pid = WorkerState.STARTING, 200
    healer.on_spawned(g0, 200)  # type: ignore[arg-type]
    assert set(healer.state.derated) == {"g-0"}


def test_a_worker_on_two_gpus_stays_derated_for_the_one_still_hot() -> None:
    """Regression: derated for GPU 0, then GPU 1 turned hot too, then GPU 0 cooled: the worker
    rightly stayed derated, but ``derated_reason`` still named GPU 0, cool by then."""
    host, healer, _ = _tp_worker("derate")
    host.temperature(GPUS[0], 89)
    for _ in range(12):
        _tp_tick(host, healer)
    assert healer.state.derated["t-0"].startswith("GPU 0 is hot")
    host.temperature(GPUS[1], 89)
    for _ in range(12):
        _tp_tick(host, healer)
    host.temperature(GPUS[0], 50)
    for _ in range(40):
        _tp_tick(host, healer)
    assert healer.hot_gpus() == {GPUS[1]}
    assert healer.state.derated["t-0"].startswith("GPU 1 is hot")


def _reloaded_mid_run(
    health: Callable[[bool], dict[str, float]], at_s: int, run_s: int, mb: Callable[[float], float]
) -> tuple[Healer, Runner]:
    """One worker t-0 sampled every second for ``run_s`` s with ``mb(now)`` MiB, the settings'
    ``[workers.health]`` being ``health(False)`` until a reload at ``at_s``, ``health(True)``
    after."""

    def settings(reloaded: bool) -> Settings:
        return parse_settings(
            {
                "gpu": {"backend": "sim"},
                "workers": [{"name": "t", "command": ["x"], "health": health(reloaded)}],
            }
        )

    t0 = Runner("t-0", GPUS[0])
    host = Host(settings(False), {"t-0": t0})
    healer = Healer(host)  # type: ignore[arg-type]
    for second in range(run_s):
        if second == at_s:
            host.settings = settings(True)  # the reload
        host.clock.advance(1.0)
        now = host.clock.now()
        usage = WorkerUsage("t-0", (100,), mb(now), {GPUS[0]: mb(now)}, "pid", 100.0, 0.0)
        healer.on_sample(Sample(now, tuple(host.devices.values()), {"t-0": usage}, True))
    return healer, t0


def test_a_reload_that_widens_the_leak_window_applies_to_the_running_workers() -> None:
    """A leak of 12 MiB/min grows too little in a 60 s window to be told from noise, and is
    found in a 600 s one. Regression: the floor series of a running process kept the window
    it was started with (they held 60 s of samples), so a reload to ``leak_window_s = 600``
    never found the leak until the worker was restarted, while the reload said it applied."""
    healer, t0 = _reloaded_mid_run(
        lambda reloaded: {
            "leak_warmup_s": 1,
            "leak_window_s": 600 if reloaded else 60,
            "oom_horizon_s": 1e6,
        },
        60,
        660,
        lambda now: 5000 + 12 * now / 60,
    )
    assert healer.annotate("t-0", {})["leak"]["suspected"]
    assert lc.Drain(restart=True, reason=ExitReason.LEAK) in t0.posted


def test_a_reload_that_lengthens_the_leak_warm_up_applies_to_a_worker_warming_up() -> None:
    """t-0 grows 60 MiB/min for 500 s after ready (a model warming up), then stays flat; 10 s
    after its ready, a reload raises ``leak_warmup_s`` from 60 to 600 s. Regression: the warm-up
    of a running process was fixed when it became ready, so the reload did not apply to it:
    its warm-up growth was judged a leak and it was drained, while the reload said it applied."""
    _, t0 = _reloaded_mid_run(
        lambda reloaded: {"leak_warmup_s": 600 if reloaded else 60, "oom_horizon_s": 1e6},
        10,
        700,
        lambda now: 5000 + min(now, 500.0),
    )
    assert t0.posted == []


def test_a_worker_moved_for_heat_is_not_moved_again_for_heat_within_the_window() -> None:
    """m-0 moved off hot GPU-0 to GPU-1 at 10 s; GPU-1 turns hot 20 s later, GPU-2 has been
    cool all along: m-0 stays (an alert says why) until 80 s (2 x (sustain + clear)) after
    its move, then moves. Regression: it moved again as soon as its new GPU turned hot, a
    worker on GPUs that heat in turn ping-ponging, bounded only by the 60 s cooldown."""
    m0 = Runner("m-0", GPUS[0])
    host, healer = setup("migrate", m0)
    host.temperature(GPUS[0], 89)
    while not m0.posted:
        host.tick(healer)
    moved_at = host.clock.now()
    # its process exits (the post-mortem takes the evidence); the next one runs on GPU-1
    assert healer.exit_evidence("m-0") is not None
    m0.posted.clear()
    m0.spec.gpus = (GPUS[1],)
    m0.record.pid, m0.record.started_at = 101, moved_at
    healer.on_spawned(m0, 101)  # type: ignore[arg-type]
    host.temperature(GPUS[0], 50)
    for _ in range(20):
        host.tick(healer)
    host.temperature(GPUS[1], 89)
    for _ in range(15):
        host.tick(healer)
    alerts = [f for kind, w, f in host.journal.items if kind == "heal.alert" and w == "m-0"]
    assert [f["gpu"] for f in alerts] == [GPUS[1]] and not m0.posted
    why = healer._can_migrate([Finding("thermal", "hot", gpu=GPUS[1])])["m-0"]
    assert isinstance(why, str) and why.startswith("moved for heat"), why
    while not m0.posted:
        host.tick(healer)
        assert host.clock.now() < moved_at + 200, "never moved"
    assert host.clock.now() >= moved_at + 80
    assert [type(e) for e in m0.posted] == [lc.Drain]
