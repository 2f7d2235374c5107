"""The healing policy (``policy.heal``) and the healing side of crash classification: pure."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.healing import parse_in_use
from supervisor.model import ExitReason, ExitStatus, WorkerState
from supervisor.policy.classify import classify, may_be_oom_kill
from supervisor.policy.heal import (
    COOLDOWN_S,
    LEAK_IMMINENT_S,
    Finding,
    GroupPolicy,
    WorkerView,
    candidate_acts,
    decide,
)

R = WorkerState.READY
G0 = "GPU-0"
G1 = "GPU-1"


def views(**states: WorkerState) -> dict[str, WorkerView]:
    """Workers ``<group>-<i>``, even indices on GPU-0, odd on GPU-1."""
    out = {}
    for name, state in states.items():
        name = name.replace("_", "-")
        index = int(name.rsplit("-", 1)[1])
        out[name] = WorkerView(
            group=name.rsplit("-", 1)[0], state=state, gpus=(f"GPU-{index % 2}",)
        )
    return out


def leak(worker: str) -> Finding:
    return Finding("leak", "grows", worker=worker, evidence={"slope_mb_per_min": 50.0})


def acts_of(decision: Any) -> list[tuple[str, str | None, str | None, str]]:
    return [(a.action, a.worker, a.gpu, a.reason) for a in decision.acts]


@pytest.mark.parametrize(
    ("finding", "policy", "expected"),
    [
        (leak("w-0"), GroupPolicy(on_leak="drain"), [("drain", "w-0", None, "leak")]),
        (leak("w-0"), GroupPolicy(on_leak="restart"), [("restart", "w-0", None, "leak")]),
        (leak("w-0"), GroupPolicy(on_leak="alert"), [("alert", "w-0", None, "leak")]),
        (
            Finding("gpu_memory_limit", "over", worker="w-0"),
            GroupPolicy(),
            [("restart", "w-0", None, "gpu_memory_limit")],
        ),
        (
            Finding("host_memory_limit", "over", worker="w-0"),
            GroupPolicy(on_over_budget="drain"),
            [("drain", "w-0", None, "host_memory_limit")],
        ),
        (
            Finding("log_pattern", "line", worker="w-0"),
            GroupPolicy(),
            [("restart", "w-0", None, "log_pattern")],
        ),
        (
            Finding("xid_worker", "XID 13", gpu=G0),
            GroupPolicy(),
            [("restart", "w-0", G0, "xid"), ("restart", "w-2", G0, "xid")],
        ),
        (
            Finding("xid_device", "XID 79", gpu=G1),
            GroupPolicy(),
            [("quarantine", None, G1, "xid"), ("drain", "w-1", G1, "xid")],
        ),
        (
            Finding("gpu_lost", "lost", gpu=G1),
            GroupPolicy(),
            [("quarantine", None, G1, "gpu_lost"), ("drain", "w-1", G1, "gpu_lost")],
        ),
        (
            Finding("thermal", "hot", gpu=G0),
            GroupPolicy(on_thermal="derate"),
            [
                ("derate", "w-0", G0, "thermal"),
                ("derate", "w-2", G0, "thermal"),
                ("alert", None, G0, "thermal"),
            ],
        ),
        (
            Finding("thermal", "hot", gpu=G0),
            GroupPolicy(on_thermal="migrate"),
            [("migrate", "w-0", G0, "thermal"), ("migrate", "w-2", G0, "thermal")],
        ),
        (
            Finding("thermal", "hot", gpu=G0),
            GroupPolicy(on_thermal="cordon"),
            [("cordon", None, G0, "thermal")],
        ),
        (
            Finding("thermal", "hot", gpu=G0),
            GroupPolicy(on_thermal="alert"),
            [("alert", None, G0, "thermal")],
        ),
        (Finding("thermal", "hot", gpu=G0), GroupPolicy(on_thermal="none"), []),
        (
            Finding("thermal_cleared", "cool", gpu=G0),
            GroupPolicy(),
            [("uncordon", None, G0, "thermal")],
        ),
        (leak("nobody-0"), GroupPolicy(), []),
        # a recycle drains whatever on_leak says (requests in flight are finished first)
        (
            Finding("max_age", "ready for 86400 s", worker="w-0"),
            GroupPolicy(on_leak="restart"),
            [("drain", "w-0", None, "max_age")],
        ),
    ],
)
def test_candidate_acts(finding: Finding, policy: GroupPolicy, expected: list[Any]) -> None:
    workers = views(w_0=R, w_1=R, w_2=R)
    got = candidate_acts(finding, workers, {"w": policy})
    assert [(a.action, a.worker, a.gpu, a.reason) for a in got] == expected
    assert all(a.evidence == finding.evidence for a in got if a.action != "alert" or not a.worker)


def test_thermal_cleared_restores_only_derated_workers() -> None:
    workers = views(w_0=R, w_2=R)
    workers["w-0"] = WorkerView("w", R, (G0,), derated=True)
    got = candidate_acts(Finding("thermal_cleared", "cool", gpu=G0), workers, {})
    assert [(a.action, a.worker) for a in got] == [("restore", "w-0"), ("uncordon", None)]


def test_migrate_without_room_alerts_instead() -> None:
    workers = views(w_0=R)
    got = candidate_acts(
        Finding("thermal", "hot", gpu=G0),
        workers,
        {"w": GroupPolicy(on_thermal="migrate")},
        can_migrate={"w-0": False},
    )
    assert [(a.action, a.worker) for a in got] == [("alert", "w-0")]
    assert got[0].evidence["migrate"] == "no cooler GPU has room"
    # an explicit GPU list: the alert says that, not that no GPU has room (regression)
    listed = candidate_acts(
        Finding("thermal", "hot", gpu=G0),
        workers,
        {"w": GroupPolicy(on_thermal="migrate")},
        can_migrate={"w-0": "its GPUs are listed"},
    )
    assert listed[0].evidence["migrate"] == "its GPUs are listed"


def test_a_gpu_still_hot_moves_only_the_migrate_workers_that_can_move_now() -> None:
    """A thermal finding made again for a GPU that stays hot (``again``): only the workers of
    migrate groups that can move now are migrated; the derate, cordon and alert of the first
    finding are not done again, nor is the "no room" alert said again."""
    workers = {
        "m-0": WorkerView("m", R, (G0,)),
        "m-2": WorkerView("m", R, (G0,)),
        "d-0": WorkerView("d", R, (G0,)),
        "a-0": WorkerView("a", R, (G0,)),
    }
    policies = {
        "m": GroupPolicy(on_thermal="migrate"),
        "d": GroupPolicy(on_thermal="derate"),
        "a": GroupPolicy(on_thermal="alert"),
    }
    again = Finding("thermal", "still hot", gpu=G0, evidence={"again": True})
    got = candidate_acts(again, workers, policies, can_migrate={"m-0": True, "m-2": False})
    assert [(a.action, a.worker) for a in got] == [("migrate", "m-0")]
    first = candidate_acts(
        Finding("thermal", "hot", gpu=G0), workers, policies, can_migrate={"m-0": True}
    )
    assert {a.action for a in first} == {"migrate", "alert", "derate"}


def test_max_unavailable_defers_the_second_disruptive_action() -> None:
    workers = views(w_0=R, w_1=R, w_2=R)
    d = decide([leak("w-0"), leak("w-1"), leak("w-2")], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("drain", "w-0", None, "leak")]
    assert [f.worker for f in d.deferred] == ["w-1", "w-2"]
    assert "max_unavailable 1" in d.why_deferred[("leak", "w-1")]


def test_recycles_wait_for_max_unavailable_and_never_cut_a_line() -> None:
    """Three workers due at once: one is recycled, the others wait their turn (max_age is no
    fault: unlike a sticky error or an imminent leak it never goes past max_unavailable)."""
    workers = views(w_0=R, w_1=R, w_2=R)
    due = [Finding("max_age", "old", worker=f"w-{i}") for i in range(3)]
    d = decide(due, workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("drain", "w-0", None, "max_age")]
    assert [f.worker for f in d.deferred] == ["w-1", "w-2"]
    d = decide(due[1:], views(w_0=WorkerState.STARTING, w_1=R, w_2=R), {"w": GroupPolicy()}, 1, {})
    assert d.acts == () and len(d.deferred) == 2


def test_recycles_wait_for_a_roll_out_of_their_group() -> None:
    """A roll-out replaces every worker of the group anyway, and halts when one it replaced
    goes down: a recycle waits for it (a fault does not: a leak is drained)."""
    workers = views(w_0=R, w_1=R, v_0=R)
    policies = {"w": GroupPolicy(max_unavailable=2), "v": GroupPolicy()}
    found = [
        Finding("max_age", "old", worker="w-0"),
        Finding("max_age", "old", worker="v-0"),
        leak("w-1"),
    ]
    d = decide(found, workers, policies, 0.0, {}, rolling={"w": "reload"})
    assert sorted(acts_of(d)) == [("drain", "v-0", None, "max_age"), ("drain", "w-1", None, "leak")]
    assert [f.key for f in d.deferred] == [("max_age", "w-0")]
    assert d.why_deferred[("max_age", "w-0")] == "a reload of group w is running"


def test_a_leak_is_acted_on_as_a_leak_though_its_worker_waits_for_a_recycle() -> None:
    """w-0 was due for its recycle and waited its turn (w-1 was down); a leak is found on it
    meanwhile. Once w-1 is back, w-0 is drained for its leak (its post-mortem, its judgement
    as a crash), not recycled. Regression: the recycle, pending first, went first and the
    leak was dropped: no post-mortem, no actions_total{reason="leak"}, no failed start."""
    pending = [Finding("max_age", "old", worker="w-0"), leak("w-0")]
    d = decide(pending, views(w_0=R, w_1=R), {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("drain", "w-0", None, "leak")]


def test_a_recycle_counts_workers_out_of_routing_as_down() -> None:
    """w-0 is derated (its GPU is hot: ready, but out of routing): recycling w-1 would leave
    the group serving with none of two. A fault (a leak) is judged on readiness alone; a
    derated worker's own recycle goes (it serves nothing now anyway)."""
    workers = views(w_0=R, w_1=R)
    workers["w-0"] = WorkerView(group="w", state=R, gpus=(G0,), derated=True)
    recycle = Finding("max_age", "old", worker="w-1")
    d = decide([recycle], workers, {"w": GroupPolicy()}, 0.0, {})
    assert d.acts == () and "not ready or out of routing" in d.why_deferred[recycle.key]
    assert acts_of(decide([leak("w-1")], workers, {"w": GroupPolicy()}, 0.0, {})) == [
        ("drain", "w-1", None, "leak")
    ]
    own = Finding("max_age", "old", worker="w-0")
    assert acts_of(decide([own], workers, {"w": GroupPolicy()}, 0.0, {})) == [
        ("drain", "w-0", None, "max_age")
    ]


def test_a_worker_already_down_counts_against_max_unavailable() -> None:
    workers = views(w_0=WorkerState.BACKOFF, w_1=R)
    d = decide([leak("w-1")], workers, {"w": GroupPolicy()}, 0.0, {})
    assert d.acts == () and [f.worker for f in d.deferred] == ["w-1"]
    d2 = decide([leak("w-1")], workers, {"w": GroupPolicy(max_unavailable=2)}, 0.0, {})
    assert acts_of(d2) == [("drain", "w-1", None, "leak")]


@pytest.mark.parametrize("down", [WorkerState.FATAL, WorkerState.STOPPED])
def test_a_leak_about_to_run_out_is_acted_on_whatever_max_unavailable_says(
    down: WorkerState,
) -> None:
    """A replica stopped or given up on held the group at max_unavailable, so a leak of the
    other one was deferred until it died of it (a crash instead of a drain). A leak projected
    to run out within LEAK_IMMINENT_S goes now; one further off still waits."""
    workers = views(w_0=down, w_1=R)

    def projected(seconds: float) -> Finding:
        return Finding("leak", "grows", worker="w-1", evidence={"projected_oom_s": seconds})

    far = decide([projected(LEAK_IMMINENT_S + 60)], workers, {"w": GroupPolicy()}, 0.0, {})
    assert far.acts == () and [f.worker for f in far.deferred] == ["w-1"]
    near = decide([projected(LEAK_IMMINENT_S - 1)], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(near) == [("drain", "w-1", None, "leak")] and near.deferred == ()


def test_acting_on_a_worker_that_is_not_ready_is_always_allowed() -> None:
    workers = views(w_0=WorkerState.STARTING, w_1=WorkerState.STARTING)
    budget = Finding("gpu_memory_limit", "over", worker="w-0")
    d = decide([budget], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("restart", "w-0", None, "gpu_memory_limit")]


def test_workers_already_leaving_are_not_acted_on_again() -> None:
    workers = views(w_0=WorkerState.DRAINING, w_1=WorkerState.STOPPING, w_2=WorkerState.FATAL)
    d = decide([leak("w-0"), leak("w-1"), leak("w-2")], workers, {"w": GroupPolicy()}, 0.0, {})
    assert d.acts == () and d.deferred == ()


def test_a_broken_worker_that_is_draining_is_restarted_at_once() -> None:
    """A sticky CUDA error or a worker-fatal XID on a draining worker: the drain is cut short
    (it serves nothing and holds its GPU memory); a leak of a draining worker waits for it, and
    a worker already stopping is left to stop. Regression: the restart was dropped, unrecorded."""
    workers = views(w_0=WorkerState.DRAINING, w_2=WorkerState.STOPPING, w_1=R)
    sticky = Finding("log_pattern", "CUDA error", worker="w-0")
    xid = Finding("xid_worker", "XID 13", gpu=G0)
    d = decide([sticky, xid, leak("w-0")], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("restart", "w-0", None, "log_pattern")]  # once, and w-2 not at all
    d = decide([xid], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("restart", "w-0", G0, "xid")] and d.deferred == ()


def test_non_disruptive_actions_are_never_deferred() -> None:
    workers = views(w_0=R, w_2=WorkerState.BACKOFF)
    d = decide([Finding("thermal", "hot", gpu=G0)], workers, {"w": GroupPolicy()}, 0.0, {})
    assert [a.action for a in d.acts] == ["derate", "derate", "alert"]


def test_device_fatal_quarantines_and_drains_every_worker_on_the_gpu_at_once() -> None:
    """Workers on a GPU that had a device-fatal XID serve nothing useful: draining them does
    not wait for max_unavailable (they would otherwise sit on a dead GPU one after another)."""
    workers = views(w_0=R, w_2=R, w_1=R)
    d = decide([Finding("xid_device", "XID 79", gpu=G0)], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [
        ("quarantine", None, G0, "xid"),
        ("drain", "w-0", G0, "xid"),
        ("drain", "w-2", G0, "xid"),
    ]
    assert d.deferred == ()


def test_a_worker_fatal_xid_restarts_within_max_unavailable() -> None:
    """One process's fault (XID 13): its siblings on the GPU are restarted one at a time."""
    workers = views(w_0=R, w_2=R, w_4=R)
    d = decide([Finding("xid_worker", "XID 13", gpu=G0)], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("restart", "w-0", G0, "xid")] and len(d.deferred) == 1


def test_a_worker_fatal_xid_of_the_only_worker_on_the_gpu_is_not_held_back() -> None:
    """The XID is that worker's own (its CUDA context is gone): it is restarted even with the
    group at max_unavailable. Regression: a sibling gone fatal (on another GPU) held it back
    for as long as the sibling stayed fatal, serving nothing on a dead context."""
    workers = views(w_0=R, w_1=WorkerState.FATAL, w_3=WorkerState.STOPPED)
    xid = Finding("xid_worker", "XID 13", gpu=G0)
    d = decide([xid], workers, {"w": GroupPolicy()}, 0.0, {})
    assert acts_of(d) == [("restart", "w-0", G0, "xid")] and d.deferred == ()
    # two workers on the GPU: NVML does not say whose it is; they go one at a time as before
    shared = views(w_0=R, w_2=R, w_1=WorkerState.FATAL)
    d = decide([xid], shared, {"w": GroupPolicy()}, 0.0, {})
    assert d.acts == () and len(d.deferred) == 1


def test_a_deferred_xid_is_not_taken_out_on_a_worker_placed_on_the_gpu_since() -> None:
    """XID 13 on GPU-0 at t=10, deferred (max_unavailable); at t=30 w-2, started at t=20 on
    GPU-0 (its own GPU was lost), is not restarted for it: its process did not exist when
    the XID happened. Regression: it was killed for the XID (counted as a failure)."""
    xid = Finding("xid_worker", "XID 13", gpu=G0, at=10.0)
    workers = {
        "w-0": WorkerView("w", R, (G0,), started_at=1.0),
        "w-2": WorkerView("w", R, (G0,), started_at=20.0),
        "w-1": WorkerView("w", WorkerState.STARTING, (G1,), has_process=False),
    }
    policies = {"w": GroupPolicy()}
    assert [a.worker for a in candidate_acts(xid, workers, policies)] == ["w-0"]
    d = decide([xid], workers, policies, 30.0, {})
    assert d.acts == () and [f.key for f in d.deferred] == [xid.key]  # w-0 waits for w-1
    workers["w-1"] = WorkerView("w", R, (G1,), started_at=25.0)
    d = decide([xid], workers, policies, 31.0, {})
    assert acts_of(d) == [("restart", "w-0", G0, "xid")] and d.deferred == ()
    # the device-fatal kind likewise; a lasting condition (heat) concerns whoever is there
    lost = Finding("gpu_lost", "lost", gpu=G0, at=10.0)
    assert [a.worker for a in candidate_acts(lost, workers, policies)] == [None, "w-0"]
    hot = Finding("thermal", "hot", gpu=G0, at=10.0)
    assert [a.worker for a in candidate_acts(hot, workers, policies)] == ["w-0", "w-2", None]


def test_a_sticky_error_restarts_even_with_the_group_at_max_unavailable() -> None:
    workers = views(w_0=R, w_1=WorkerState.STOPPED)
    pattern = Finding("log_pattern", "CUDA error", worker="w-0")
    assert acts_of(decide([pattern], workers, {"w": GroupPolicy()}, 0.0, {})) == [
        ("restart", "w-0", None, "log_pattern")
    ]
    # a leak of the same worker waits: the one stopped sibling is all the group may miss
    d = decide([leak("w-0")], workers, {"w": GroupPolicy()}, 0.0, {})
    assert d.acts == () and len(d.deferred) == 1


def test_state_changes_are_not_held_back_by_the_cooldown() -> None:
    """A GPU hot again 40 s after it cooled: its workers are derated again (the alert, though,
    is rate-limited); a restore due within the cooldown of the last one is not lost."""
    workers = views(w_0=R)
    recent = {("derate", "w-0", "thermal"): 100.0, ("alert", G0, "thermal"): 100.0}
    hot = Finding("thermal", "hot", gpu=G0, at=140.0)
    assert acts_of(decide([hot], workers, {"w": GroupPolicy()}, 140.0, recent)) == [
        ("derate", "w-0", G0, "thermal")
    ]
    workers = {"w-0": WorkerView("w", R, (G0,), derated=True)}
    recent = {("restore", "w-0", "thermal"): 120.0, ("uncordon", G0, "thermal"): 120.0}
    cool = Finding("thermal_cleared", "cool", gpu=G0, at=150.0)
    assert [a.action for a in decide([cool], workers, {}, 150.0, recent).acts] == [
        "restore",
        "uncordon",
    ]


def test_each_act_of_a_finding_is_taken_once() -> None:
    """A deferred finding is asked about again: what it already did is not done twice."""
    workers = views(w_0=R, w_2=WorkerState.STARTING)
    hot = Finding("thermal", "hot", gpu=G0, at=10.0)
    recent = {("derate", "w-0", "thermal"): 10.0, ("alert", G0, "thermal"): 10.0}
    d = decide([hot], workers, {"w": GroupPolicy()}, 500.0, recent)
    assert acts_of(d) == [("derate", "w-2", G0, "thermal")]


def test_a_migrate_for_a_worker_on_its_way_down_only_says_where_it_goes_next() -> None:
    """A worker draining for a leak, starting or in backoff when its GPU turns hot: the
    migrate is taken at once (its next process avoids the GPU) without availability cost;
    a stopped or fatal one has nothing to move."""
    workers = views(
        w_0=WorkerState.DRAINING,
        w_2=WorkerState.BACKOFF,
        w_4=WorkerState.STOPPED,
        w_6=WorkerState.FATAL,
    )
    policy = {"w": GroupPolicy(on_thermal="migrate", max_unavailable=1)}
    d = decide([Finding("thermal", "hot", gpu=G0)], workers, policy, 0.0, {})
    assert [(a.action, a.worker) for a in d.acts] == [("migrate", "w-0")]
    assert d.acts[0].redirect_only  # the drain already stops it
    assert len(d.deferred) == 1  # one at a time: w-2 next
    recent = {("migrate", "w-0", "thermal"): 0.0}
    d = decide(d.deferred, workers, policy, 1.0, recent, migrating=1)  # w-0's still going
    assert d.acts == () and len(d.deferred) == 1
    d = decide(d.deferred, workers, policy, 2.0, recent)  # w-0 started again elsewhere
    assert [(a.action, a.worker) for a in d.acts] == [("migrate", "w-2")]
    # the same round as a leak drain: both, the drain first
    workers = views(w_0=R, w_1=R)
    both = [leak("w-0"), Finding("thermal", "hot", gpu=G0)]
    d = decide(both, workers, policy, 0.0, {})
    assert [(a.action, a.worker) for a in d.acts] == [("drain", "w-0"), ("migrate", "w-0")]
    assert [a.redirect_only for a in d.acts] == [False, True]


def test_cooldown_suppresses_the_same_action() -> None:
    workers = views(w_0=R)
    recent = {("alert", "w-0", "leak"): 100.0}
    policy = {"w": GroupPolicy(on_leak="alert")}
    assert decide([leak("w-0")], workers, policy, 100.0 + COOLDOWN_S - 1, recent).acts == ()
    assert len(decide([leak("w-0")], workers, policy, 100.0 + COOLDOWN_S, recent).acts) == 1


def test_migrations_go_one_at_a_time() -> None:
    workers = views(w_0=R, w_2=R)
    policy = {"w": GroupPolicy(on_thermal="migrate", max_unavailable=5)}
    d = decide([Finding("thermal", "hot", gpu=G0)], workers, policy, 0.0, {})
    assert [(a.action, a.worker) for a in d.acts] == [("migrate", "w-0")]
    assert len(d.deferred) == 1
    busy = decide([Finding("thermal", "hot", gpu=G0)], workers, policy, 0.0, {}, migrating=1)
    assert busy.acts == () and busy.why_deferred


@settings(max_examples=200, deadline=None)
@given(
    states=st.lists(st.sampled_from(list(WorkerState)), min_size=1, max_size=8),
    leaking=st.lists(st.integers(0, 7), max_size=8),
    max_unavailable=st.integers(1, 4),
)
def test_never_more_than_max_unavailable_down(
    states: list[WorkerState], leaking: list[int], max_unavailable: int
) -> None:
    """Whatever the states and findings, ready workers taken down never push the group's
    not-ready count above max_unavailable (when it was not already above)."""
    workers = {f"w-{i}": WorkerView("w", s, (G0,)) for i, s in enumerate(states)}
    findings = [leak(f"w-{i}") for i in leaking if i < len(states)]
    policy = {"w": GroupPolicy(max_unavailable=max_unavailable)}
    d = decide(findings, workers, policy, 0.0, {})
    down = sum(v.state is not R for v in workers.values())
    taken_ready = sum(1 for a in d.acts if a.disruptive and workers[a.worker or ""].state is R)
    assert taken_ready <= max(0, max_unavailable - down)
    assert len({a.worker for a in d.acts}) == len(d.acts)


# --- classification ---------------------------------------------------------------------------


def test_healing_exit_gets_its_reason_and_the_actions_evidence() -> None:
    got = classify(
        ExitReason.LEAK,
        ExitStatus(None, 15),
        [],
        failure=False,
        healing={"action": "drain", "slope_mb_per_min": 42.0},
    )
    assert got is not None
    assert got.reason == "leak"
    assert got.evidence["slope_mb_per_min"] == 42.0 and got.evidence["signal"] == "SIGTERM"


@pytest.mark.parametrize(
    ("status", "timed_out", "reason"),
    [
        (ExitStatus(0, None), False, None),  # it finished and exited: a recycle, no death
        (ExitStatus(None, 10), False, None),  # its drain signal (SIGUSR1) ended it
        (ExitStatus(None, 11), False, "signal"),  # a SIGSEGV while it drained
        # not ended within drain_timeout_s, so stopped (stop_signal): the plan without a
        # drain_signal (out of routing, then a graceful stop); an operator's stop neither
        (ExitStatus(None, 15), True, None),
    ],
)
def test_a_recycle_is_no_death_unless_it_died_otherwise_or_overran(
    status: ExitStatus, timed_out: bool, reason: str | None
) -> None:
    got = classify(
        ExitReason.MAX_AGE,
        status,
        [],
        failure=False,
        timing={"drain_timeout_s": 30.0},
        healing={"action": "drain", "ready_for_s": 86400.0},
        drain_timed_out=timed_out,
        drain_signal=10,
    )
    assert (got and got.reason) == reason
    if got is not None:
        assert got.evidence["while"] == "max_age" and got.evidence["ready_for_s"] == 86400.0


@pytest.mark.parametrize(
    ("status", "oom_kills", "tail", "reason"),
    [
        (ExitStatus(None, 9), 1, [], "host_oom"),
        (ExitStatus(None, 9), 0, [], "signal"),
        (ExitStatus(None, 15), 3, [], "signal"),  # only a SIGKILL can be the OOM killer
        (ExitStatus(1, None), 2, [], "exit"),
        (ExitStatus(None, 9), 1, ["torch.OutOfMemoryError: CUDA out of memory"], "cuda_oom"),
    ],
)
def test_host_oom_needs_sigkill_and_an_oom_kill(
    status: ExitStatus, oom_kills: int, tail: list[str], reason: str
) -> None:
    kind = ExitReason.SIGNAL if status.signal else ExitReason.EXIT
    got = classify(kind, status, tail, failure=True, oom_kills=oom_kills)
    assert got is not None and got.reason == reason
    if reason == "host_oom":
        assert got.evidence["oom_kills"] == oom_kills


@pytest.mark.parametrize(
    ("status", "oom_kills", "reason"),
    [
        (ExitStatus(137, None), 1, "host_oom"),  # sh -c "python serve.py; exit $?"
        (ExitStatus(247, None), 1, "host_oom"),  # sys.exit(child.returncode): -9 as 247
        (ExitStatus(137, None), 0, "exit"),  # a 137 without an OOM kill is a plain exit
        (ExitStatus(136, None), 2, "exit"),  # 128 + SIGFPE: not the OOM killer's signal
    ],
)
def test_a_wrapper_shell_whose_child_the_oom_killer_took_is_host_oom(
    status: ExitStatus, oom_kills: int, reason: str
) -> None:
    """Regression: a worker started through a wrapper (``sh -c``, a launch script that runs
    python without exec) whose python the kernel's OOM killer took exits 137 (128 + 9) itself,
    not by a signal: its death was ``exit`` although its cgroup's oom_kill count went up, and
    the supervisor did not even read the count for it (only for a SIGKILL)."""
    assert may_be_oom_kill(status) is (status.code in (137, 247))
    got = classify(ExitReason.EXIT, status, [], failure=True, oom_kills=oom_kills)
    assert got is not None and got.reason == reason
    assert got.evidence["exit_code"] == status.code
    assert not may_be_oom_kill(ExitStatus(1, None)) and not may_be_oom_kill(ExitStatus(None, 15))
    assert may_be_oom_kill(ExitStatus(None, 9))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1234.5", 1234.5),
        ("0", 0.0),
        (" 12 ", 12.0),
        ("1e3", 1000.0),
        ("-1", None),
        ("nan", None),
        ("inf", None),
        ("1e308", None),  # two ranks' sum would be infinite (not JSON)
        ("1073741824", 2.0**30),
        ("1073741825", None),
        ("lots", None),
        ("", None),
        ("12 MiB", None),
    ],
)
def test_in_use_reports_are_finite_mib_or_ignored(raw: str, expected: float | None) -> None:
    assert parse_in_use(raw) == expected


def test_a_derated_worker_recycled_counts_once_against_max_unavailable() -> None:
    """max_unavailable 2, w-0 derated and due, w-1 due, w-2 serving: recycling w-0 takes
    nothing more out of routing, so w-1 goes too (one serves meanwhile). Regression: w-0,
    once taken, was counted both as derated and as down, and w-1 was held back."""
    workers = views(w_0=R, w_1=R, w_2=R)
    workers["w-0"] = WorkerView(group="w", state=R, gpus=(G0,), derated=True)
    due = [Finding("max_age", "old", worker=w) for w in ("w-0", "w-1")]
    d = decide(due, workers, {"w": GroupPolicy(max_unavailable=2)}, 0.0, {})
    assert acts_of(d) == [("drain", "w-0", None, "max_age"), ("drain", "w-1", None, "max_age")]
    assert d.deferred == ()


def test_a_recycle_held_back_says_out_of_routing_only_for_its_own_group() -> None:
    """Another group's derated worker is no reason given for this group's recycle."""
    workers = views(w_0=WorkerState.BACKOFF, w_1=R, v_0=R)
    workers["v-0"] = WorkerView(group="v", state=R, gpus=(G0,), derated=True)
    recycle = Finding("max_age", "old", worker="w-1")
    d = decide([recycle], workers, {"w": GroupPolicy(), "v": GroupPolicy()}, 0.0, {})
    assert d.why_deferred[recycle.key] == (
        "group w has 1 of its workers not ready (max_unavailable 1)"
    )


def test_a_recycle_counts_a_worker_derated_in_the_same_round() -> None:
    """GPU-1 turns hot (w-1 derated: out of routing) in the round w-0 is due for its recycle:
    w-0 waits, or the group of two serves with none. Regression: the derate, decided first,
    was not counted, and w-0 went too."""
    workers = views(w_0=R, w_1=R)
    recycle = Finding("max_age", "old", worker="w-0")
    d = decide([Finding("thermal", "hot", gpu=G1), recycle], workers, {"w": GroupPolicy()}, 0.0, {})
    assert [a for a in acts_of(d) if a[0] in ("derate", "drain")] == [
        ("derate", "w-1", G1, "thermal")
    ]
    assert d.deferred == (recycle,)
    own = Finding("max_age", "old", worker="w-1")  # derated now, it serves nothing: it goes
    d = decide([Finding("thermal", "hot", gpu=G1), own], workers, {"w": GroupPolicy()}, 0.0, {})
    assert ("drain", "w-1", None, "max_age") in acts_of(d)


def test_a_worker_fatal_xid_is_its_own_beside_a_sibling_in_backoff_on_the_gpu() -> None:
    """w-0 runs on GPU-0; w-2, placed there too, is in backoff (no process: it crashed, and
    waits to start again). XID 13 on GPU-0 is w-0's own, its CUDA context is gone: it is
    restarted at once. Regression: the sibling without a process counted as a second worker
    on the GPU, so the XID was "not its own" and w-0 waited for max_unavailable, which that
    very sibling held (not ready): it served errors for as long as w-2 kept crashing."""
    xid = Finding("xid_worker", "XID 13", gpu=G0)
    policies = {"w": GroupPolicy()}
    for state in (WorkerState.BACKOFF, WorkerState.STARTING):
        workers = {
            "w-0": WorkerView("w", R, (G0,), started_at=1.0),
            "w-2": WorkerView("w", state, (G0,), has_process=False),
        }
        d = decide([xid], workers, policies, 30.0, {})
        assert ("restart", "w-0", G0, "xid") in acts_of(d) and d.deferred == (), state
        assert d.acts[0].evidence["only_worker_on_gpu"] is True
    # a sibling that has a process there (starting: it may hold a CUDA context) still counts:
    # it is restarted (not ready anyway), w-0 waits its turn
    workers = {
        "w-0": WorkerView("w", R, (G0,), started_at=1.0),
        "w-2": WorkerView("w", WorkerState.STARTING, (G0,), started_at=2.0),
    }
    d = decide([xid], workers, policies, 30.0, {})
    assert acts_of(d) == [("restart", "w-2", G0, "xid")]
    assert [f.key for f in d.deferred] == [xid.key]


def test_a_worker_fatal_xid_on_a_shared_gpu_stays_shared_after_the_first_restart() -> None:
    """Regression: XID 13 on a GPU with two workers of a group: the first is restarted, and
    while it was between processes (in backoff, at the GPU-release barrier, or its new process
    crashed) the second counted as the only worker on the GPU, so the XID passed for its own
    and it was restarted too, past max_unavailable (the whole group down at once). Whether it
    is one worker's own is fixed when the XID is first decided, as the runtime does it (at
    once, and with the deferred finding after)."""
    xid = Finding("xid_worker", "XID 13", gpu=G0, at=10.0)
    policies = {"w": GroupPolicy()}
    workers = {
        "w-0": WorkerView("w", R, (G0,), started_at=1.0),
        "w-2": WorkerView("w", R, (G0,), started_at=1.0),
    }
    d = decide([xid], workers, policies, 10.0, {})
    assert acts_of(d) == [("restart", "w-0", G0, "xid")]
    assert [f.sole for f in d.deferred] == [False]
    # said in the evidence (post-mortem, webhook): a roll-out proves a new replica again
    # after an XID that may not be its own
    assert [a.evidence["only_worker_on_gpu"] for a in d.acts] == [False]
    workers["w-0"] = WorkerView("w", WorkerState.BACKOFF, (G0,), has_process=False)
    d = decide(d.deferred, workers, policies, 10.5, {})
    assert d.acts == () and len(d.deferred) == 1
    workers["w-0"] = WorkerView("w", R, (G0,), started_at=11.0)
    d = decide(d.deferred, workers, policies, 12.0, {})
    assert acts_of(d) == [("restart", "w-2", G0, "xid")] and d.deferred == ()


def test_a_deferred_xid_restarts_no_worker_that_has_no_process_yet() -> None:
    """XID 13 on GPU-0 at t=10, deferred: w-2 (placed on GPU-0) was stopped by an operator,
    holding the group at max_unavailable. At t=30 the operator starts w-2 again: it is
    ``starting``, its process not spawned yet. It held no CUDA context when the XID happened
    and holds none now, so the XID restarts w-0 only. Regression: w-2 got a healing "restart"
    too: a `heal.action` warning, `actions_total{action="restart",reason="xid"}`, a journal
    `heal.restart` and a webhook for a worker that was not running at the XID (and, where
    its spawn came before the restart was taken, its brand-new process was killed)."""
    xid = Finding("xid_worker", "XID 13", gpu=G0, at=10.0)
    policies = {"w": GroupPolicy()}
    workers = {
        "w-0": WorkerView("w", R, (G0,), started_at=1.0),
        "w-2": WorkerView("w", WorkerState.STARTING, (G0,), has_process=False),
    }
    assert [a.worker for a in candidate_acts(xid, workers, policies)] == ["w-0"]
    d = decide([xid], workers, policies, 30.0, {})
    assert acts_of(d) == [("restart", "w-0", G0, "xid")] and d.deferred == ()
