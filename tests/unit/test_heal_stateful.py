"""The healing policy's availability and rate rules under random runs (hypothesis stateful).

Findings come and go (some deferred and asked again), workers go down and come back, time
passes; after every ``decide`` the actions taken are checked against what DESIGN.md section 5
promises: healing never takes more than ``max_unavailable`` of a group down (unless the worker
serves nothing useful any more), never starts what is stopped, takes one migrate at a time, and
does not repeat an action for the same worker and reason within the cooldown.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from supervisor.model import WorkerState
from supervisor.policy.heal import (
    BROKEN,
    COOLDOWN_S,
    COOLED,
    LEAK_IMMINENT_S,
    Finding,
    GroupPolicy,
    WorkerView,
    _sole_on,
    decide,
)

S = WorkerState
GPUS = ("GPU-0", "GPU-1", "GPU-2")
NAMES = ("a-0", "a-1", "a-2", "b-0", "b-1")
WORKER_FINDINGS = ("leak", "gpu_memory_limit", "host_memory_limit", "log_pattern", "max_age")
GPU_FINDINGS = ("xid_worker", "xid_device", "gpu_lost", "thermal", "thermal_cleared")


class HealMachine(RuleBasedStateMachine):
    """Two groups on three GPUs; the runtime's part played by the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.workers: dict[str, WorkerView] = {
            n: WorkerView(
                group=n[0], state=S.READY, gpus=(GPUS[i % 3],), started_at=0.0, has_process=True
            )
            for i, n in enumerate(NAMES)
        }
        self.policies: dict[str, GroupPolicy] = {}
        self.pending: list[Finding] = []
        self.recent: dict[tuple[str, str, str], float] = {}
        self.migrating: set[str] = set()

    @initialize(
        mu=st.sampled_from([0, 1, 2]),
        on_leak=st.sampled_from(["drain", "restart", "alert"]),
        on_thermal=st.sampled_from(["derate", "migrate", "cordon", "alert", "none"]),
    )
    def configure(self, mu: int, on_leak: str, on_thermal: str) -> None:
        policy = GroupPolicy(on_leak=on_leak, on_thermal=on_thermal, max_unavailable=mu)  # type: ignore[arg-type]
        self.policies = {"a": policy, "b": replace(policy, max_unavailable=1)}

    # --- the world ----------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), state=st.sampled_from(list(S)))
    def worker_changes(self, name: str, state: WorkerState) -> None:
        view = self.workers[name]
        has_process = state in (S.READY, S.DRAINING, S.STOPPING, S.STARTING)
        started = self.now if state is S.STARTING else view.started_at
        self.workers[name] = replace(view, state=state, has_process=has_process, started_at=started)
        if state is not S.DRAINING:
            self.migrating.discard(name)

    @rule(dt=st.sampled_from([1.0, 10.0, 30.0, 61.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(
        kind=st.sampled_from(WORKER_FINDINGS),
        name=st.sampled_from(NAMES),
        oom_s=st.sampled_from([None, 30.0, 600.0]),
    )
    def worker_finding(self, kind: str, name: str, oom_s: float | None) -> None:
        evidence = {} if oom_s is None else {"projected_oom_s": oom_s}
        self.pending.append(Finding(kind, "seen", worker=name, evidence=evidence, at=self.now))  # type: ignore[arg-type]

    @rule(kind=st.sampled_from(GPU_FINDINGS), gpu=st.sampled_from(GPUS))
    def gpu_finding(self, kind: str, gpu: str) -> None:
        self.pending.append(Finding(kind, "seen", gpu=gpu, at=self.now))  # type: ignore[arg-type]

    # --- the policy ---------------------------------------------------------------------

    @rule()
    def judge(self) -> None:
        before = dict(self.workers)
        down_before: dict[str, int] = {}
        for v in before.values():
            if v.state is not S.READY:
                down_before[v.group] = down_before.get(v.group, 0) + 1
        migrating_before = len(self.migrating)
        decision = decide(
            self.pending,
            before,
            self.policies,
            self.now,
            self.recent,
            can_migrate=dict.fromkeys(NAMES, True),
            migrating=migrating_before,
        )
        taken: dict[str, int] = {}
        migrates = 0
        for act in decision.acts:
            if act.action in COOLED:
                last = self.recent.get((act.action, act.worker or act.gpu or "", act.reason))
                assert last is None or self.now - last >= COOLDOWN_S, f"repeated: {act}"
            if act.action in ("derate", "restore") and act.worker is not None:
                derated = act.action == "derate"
                self.workers[act.worker] = replace(self.workers[act.worker], derated=derated)
            if not act.disruptive:
                continue
            assert act.worker is not None
            view = self.workers[act.worker]
            assert before[act.worker].state not in (S.STOPPED, S.FATAL), f"started: {act}"
            if act.action == "migrate" and not act.redirect_only:
                migrates += 1
                self.migrating.add(act.worker)
            if view.state is S.READY:
                exempt = any(
                    f.kind in BROKEN
                    or (f.kind == "xid_worker" and _sole_on(act.gpu, before))
                    or (
                        f.kind == "leak"
                        and (f.evidence.get("projected_oom_s") or 1e9) <= LEAK_IMMINENT_S
                    )
                    for f in self.pending
                    if f.reason == act.reason and (f.worker or f.gpu) in (act.worker, act.gpu)
                )
                if not exempt:
                    taken[view.group] = taken.get(view.group, 0) + 1
                self.workers[act.worker] = replace(view, state=S.DRAINING)
        for group, n in taken.items():
            room = max(0, self.policies[group].max_unavailable - down_before.get(group, 0))
            assert n <= room, f"group {group}: {n} taken down, room for {room}: {decision}"
        assert migrates <= (0 if migrating_before else 1), "two migrations at once"
        for act in decision.acts:
            self.recent[(act.action, act.worker or act.gpu or "", act.reason)] = self.now
        self.pending = list(decision.deferred)


HealMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHealRandomRuns = HealMachine.TestCase
