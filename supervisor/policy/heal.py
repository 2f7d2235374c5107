"""Healing policy (pure): findings + worker states + group config -> actions.

A *finding* is what a detector saw (a leak, a budget breach, a hot GPU, an XID, a sticky-error
line). :func:`decide` turns findings into :class:`Act` values, each carrying its reason and
evidence, under three rules:

- the group's ``on_leak`` / ``on_over_budget`` / ``on_thermal`` choose the action;
- actions that take a ready worker down (drain, restart, migrate) never leave more than
  ``max_unavailable`` workers of its group not ready; those that would are *deferred* (the
  caller keeps them and asks again later). Acting on a worker that is not ready anyway costs
  nothing and is allowed, and so is acting on one that serves nothing useful any more (on a
  GPU that had a fatal XID or is lost, or printing a sticky CUDA error). Crashes are not
  delayed by any of this: they are not findings;
- each action of a finding is taken once, and alerts and restarts (drain, restart, migrate)
  for the same worker and reason are not repeated within ``cooldown_s`` across findings
  (alert-only policies would otherwise alert on every judgement; an XID burst would restart
  the replacement). State changes (derate, restore, cordon, uncordon, quarantine) are never
  held back by it: they are idempotent, and the one-shot findings that ask for them (a GPU
  turning hot or cool) do not come again;
- a migrate goes one at a time; for a worker already on its way down or starting it only
  decides where the next process goes (no availability cost); one that is deferred waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from supervisor.model import WorkerState

FindingKind = Literal[
    "leak",  # worker: GPU memory (or host RSS) grows and is projected to run out
    "gpu_memory_limit",  # worker: over its GPU memory budget
    "host_memory_limit",  # worker: over its host memory budget
    "log_pattern",  # worker: a sticky CUDA error in its output
    "max_age",  # worker: ready for max_age_s: recycled (drained and restarted), no fault
    "xid_worker",  # GPU: a worker-fatal XID: restart the workers on it
    "xid_device",  # GPU: a device-fatal XID: quarantine it, move its workers
    "gpu_lost",  # GPU: stopped answering: same as device-fatal
    "row_remap_failure",  # GPU: its row remapper failed (a bad row it cannot replace): same
    "row_remap_pending",  # GPU: a row remap waits for its next reset: alert only
    "retired_pages_pending",  # GPU (before Ampere): retired pages wait for a reset: alert
    "recovery_action",  # GPU: the driver says it needs a reset or a reboot (or P2P drained)
    "thermal",  # GPU: hot or power-braked for long enough
    "thermal_cleared",  # GPU: cool again
]

ActionKind = Literal[
    "drain",  # out of routing, wait drain_timeout_s, stop, restart (via the release barrier)
    "restart",
    "stop",  # a restart of a worker being stopped for good (an operator's drain): stopped now
    "migrate",  # drain, then start on another GPU
    "derate",  # out of routing, keeps running
    "restore",  # back into routing
    "cordon",  # no new workers on the GPU
    "uncordon",
    "quarantine",  # the GPU is unusable until the supervisor restarts
    "alert",  # tell someone, change nothing
]

#: Actions that take a worker down.
DISRUPTIVE: frozenset[str] = frozenset({"drain", "restart", "migrate"})

#: Findings about a GPU (the others are about one worker).
GPU_FINDINGS: frozenset[str] = frozenset(
    {
        "xid_worker",
        "xid_device",
        "gpu_lost",
        "row_remap_failure",
        "row_remap_pending",
        "retired_pages_pending",
        "recovery_action",
        "thermal",
        "thermal_cleared",
    }
)

#: The post-mortem / metrics reason of each finding.
REASON: Mapping[str, str] = {
    "leak": "leak",
    "gpu_memory_limit": "gpu_memory_limit",
    "host_memory_limit": "host_memory_limit",
    "log_pattern": "log_pattern",
    "max_age": "max_age",
    "xid_worker": "xid",
    "xid_device": "xid",
    "gpu_lost": "gpu_lost",
    "row_remap_failure": "row_remap_failure",
    "row_remap_pending": "row_remap_pending",
    "retired_pages_pending": "retired_pages_pending",
    "recovery_action": "recovery_action",
    "thermal": "thermal",
    "thermal_cleared": "thermal",
}

#: Default time before the same action for the same worker and reason is taken again.
COOLDOWN_S = 60.0
#: The actions the cooldown holds back (state changes are idempotent and never are).
COOLED: frozenset[str] = frozenset({"alert", *DISRUPTIVE})
#: Findings about workers that serve nothing useful any more (on a GPU with a device-fatal XID
#: or lost; printing a sticky CUDA error): acting on them does not wait for ``max_unavailable``.
#: A worker-fatal XID is not one when several workers share the GPU (it is one process's fault,
#: NVML does not say whose: its siblings wait), but it is for the one worker running on the GPU
#: (:func:`_sole_on`): its CUDA context is gone.
BROKEN: frozenset[str] = frozenset(
    {"xid_device", "gpu_lost", "row_remap_failure", "recovery_action", "log_pattern"}
)
#: The driver's recovery actions (``evidence["recovery_action"]`` of a ``recovery_action``
#: finding) after which nothing on the GPU works until it is reset or the machine rebooted
#: (NVIDIA: "terminate all GPU processes"): quarantined as after a device-fatal XID. The
#: others (``drain_p2p``: quiesce peer-to-peer traffic, then ask again; one this version does
#: not know) are alerts.
RECOVERY_QUARANTINES: frozenset[str] = frozenset(
    {
        "gpu_reset",
        "drain_and_reset",
        "bus_reset",
        "node_reboot",
        "system_reboot",
        "recover_imex_domain",
    }
)
#: A leak projected to run out of memory within this long is acted on whatever
#: ``max_unavailable`` says: the worker is about to die of it anyway, and waiting only turns a
#: drain into a crash (requests in flight lost; on a shared GPU, its neighbours' allocations
#: failing too). A group with a stopped or fatal replica deferred its leaks until then.
LEAK_IMMINENT_S = 60.0


def _imminent(f: Finding) -> bool:
    """``f`` is a leak that runs out of memory within ``LEAK_IMMINENT_S``."""
    if f.kind != "leak":
        return False
    left = f.evidence.get("projected_oom_s")
    return isinstance(left, int | float) and left <= LEAK_IMMINENT_S


#: Findings about no fault (a scheduled recycle, ``max_age_s``): logged at info, not sent as
#: an alert, and held back while a roll-out of the group runs (it replaces every worker anyway,
#: and halts when one it replaced goes down before it has been ready for ``stable_s``).
ROUTINE: frozenset[str] = frozenset({"max_age"})

#: Findings whose restart cuts a drain short: a worker with a sticky error or a worker-fatal
#: XID serves nothing, so waiting out ``drain_timeout_s`` only holds its GPU memory.
CUTS_DRAIN: frozenset[str] = frozenset({"xid_worker", "log_pattern"})


@dataclass(frozen=True, slots=True)
class Finding:
    """What a detector found; ``worker`` or ``gpu`` (a UUID) says what it is about."""

    kind: FindingKind
    message: str
    worker: str | None = None
    gpu: str | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    at: float | None = None  # when it was raised (None: unknown): its acts are taken once
    #: a worker-fatal XID: exactly one worker with a process was on its GPU when it was first
    #: decided (raised): the XID is that worker's own. Fixed then (None: not decided yet), not
    #: looked at again each round: a sibling between processes later does not make the next
    #: one the only worker there (regression: the second went too, past max_unavailable)
    sole: bool | None = None

    @property
    def key(self) -> tuple[str, str]:
        """Identifies the finding while it is pending."""
        return (self.kind, self.worker or self.gpu or "")

    @property
    def reason(self) -> str:
        """The reason recorded for the actions it leads to."""
        return REASON[self.kind]


@dataclass(frozen=True, slots=True)
class Act:
    """One action to carry out, with its reason and evidence."""

    action: ActionKind
    reason: str
    message: str
    worker: str | None = None
    gpu: str | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    #: a migrate for a worker that is going down anyway (or has no process): it only says
    #: where the next process goes, and stops nothing itself
    redirect_only: bool = False

    @property
    def disruptive(self) -> bool:
        """Takes a worker down."""
        return self.action in DISRUPTIVE


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the policy needs to know about a worker."""

    group: str
    state: WorkerState
    gpus: tuple[str, ...] = ()
    derated: bool = False
    has_process: bool = True  # False while starting before the spawn (or in backoff)
    started_at: float | None = None  # when its current process started (monotonic)


@dataclass(frozen=True, slots=True)
class GroupPolicy:
    """A group's ``[workers.health]`` actions."""

    on_leak: Literal["drain", "restart", "alert"] = "drain"
    on_over_budget: Literal["drain", "restart", "alert"] = "restart"
    on_thermal: Literal["derate", "migrate", "cordon", "alert", "none"] = "derate"
    max_unavailable: int = 1


@dataclass(frozen=True, slots=True)
class Decision:
    """The actions to take now, and the findings to ask about again later."""

    acts: tuple[Act, ...]
    deferred: tuple[Finding, ...]
    why_deferred: Mapping[tuple[str, str], str] = field(default_factory=dict)


#: States in which a worker is already on its way down (or out): nothing more to do to it.
_LEAVING = frozenset({WorkerState.DRAINING, WorkerState.STOPPING})
_DOWN = frozenset({WorkerState.STOPPED, WorkerState.FATAL, WorkerState.BACKOFF})


def candidate_acts(
    finding: Finding,
    workers: Mapping[str, WorkerView],
    policies: Mapping[str, GroupPolicy],
    *,
    can_migrate: Mapping[str, bool | str] | None = None,
) -> list[Act]:
    """The actions a finding calls for, before the availability and cooldown rules.

    ``can_migrate``: per worker, whether another GPU would take it (no: ``alert`` instead,
    saying why: the string given, else that no cooler GPU has room).
    """
    f = finding

    def act(
        action: ActionKind,
        worker: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> Act:
        return Act(
            action,
            f.reason,
            f.message,
            worker=worker,
            gpu=f.gpu,
            evidence=f.evidence if evidence is None else evidence,
        )

    if f.kind not in GPU_FINDINGS:
        view = workers.get(f.worker or "")
        if view is None:
            return []
        policy = policies.get(view.group, GroupPolicy())
        if f.kind == "leak":
            choice: ActionKind = policy.on_leak
        elif f.kind in ("gpu_memory_limit", "host_memory_limit"):
            choice = policy.on_over_budget
        elif f.kind == "max_age":
            choice = "drain"  # a recycle: the requests in flight are finished first
        else:
            choice = "restart"
        return [act(choice, f.worker)]
    on_gpu = sorted(n for n, v in workers.items() if f.gpu in v.gpus and not _came_after(f, v))
    acts: list[Act] = []
    if f.kind == "xid_worker":
        # a worker without a process (about to spawn, at the release barrier) holds no CUDA
        # context the XID could have broken: its next process comes after it
        acts += [act("restart", n) for n in on_gpu if workers[n].has_process]
    elif f.kind in ("xid_device", "gpu_lost", "row_remap_failure") or (
        f.kind == "recovery_action" and f.evidence.get("recovery_action") in RECOVERY_QUARANTINES
    ):
        acts.append(act("quarantine"))
        acts += [act("drain", n) for n in on_gpu]
    elif f.kind == "recovery_action":
        acts.append(act("alert"))
    elif f.kind in ("row_remap_pending", "retired_pages_pending"):
        # NVIDIA: running work is unaffected and new work may start; the remap takes effect
        # at the GPU's next reset, which only an operator can choose the moment of
        acts.append(act("alert"))
    elif f.kind == "thermal":
        alerted = cordoned = False
        # a GPU still hot whose migrate workers could not move when it turned hot (or came
        # since): their migration only, once a cooler GPU has room; the rest was done then
        again = bool(f.evidence.get("again"))
        for n in on_gpu:
            choice_t = policies.get(workers[n].group, GroupPolicy()).on_thermal
            if choice_t == "none" or (again and choice_t != "migrate"):
                continue
            if choice_t == "derate" and not workers[n].has_process:
                # nothing runs to route to (stopped, fatal, in backoff): derated at its next
                # start if the GPU is hot then (regression: shown derated with no process)
                continue
            if choice_t == "migrate" and can_migrate is not None and can_migrate.get(n) is not True:
                if again:
                    continue  # said when the GPU turned hot
                why = can_migrate.get(n)
                why = why if isinstance(why, str) else "no cooler GPU has room"
                acts.append(act("alert", n, {**f.evidence, "migrate": why}))
            elif choice_t == "cordon":
                if not cordoned:
                    acts.append(act("cordon"))
                    cordoned = True
            elif choice_t == "alert":
                if not alerted:
                    acts.append(act("alert"))
                    alerted = True
            else:
                acts.append(act(choice_t, n))
        if not alerted and any(a.action == "derate" for a in acts):
            acts.append(act("alert"))
    else:  # thermal_cleared
        acts += [act("restore", n) for n in on_gpu if workers[n].derated]
        acts.append(act("uncordon"))
    return acts


#: Findings about an event on a GPU (not a lasting condition): they are about the processes
#: that were there when it happened.
EVENT_FINDINGS: frozenset[str] = frozenset({"xid_worker", "xid_device", "gpu_lost"})


def _came_after(f: Finding, view: WorkerView) -> bool:
    """``view``'s process started after ``f`` happened on its GPU (an XID deferred by
    ``max_unavailable`` is not the concern of a worker placed there since)."""
    return (
        f.kind in EVENT_FINDINGS
        and f.at is not None
        and view.started_at is not None
        and view.started_at > f.at
    )


def _sole_on(gpu: str | None, workers: Mapping[str, WorkerView]) -> bool:
    """Exactly one worker with a process runs on ``gpu``: an XID there is its own (one
    without a process, in backoff or about to spawn, holds no CUDA context there)."""
    idle = (WorkerState.STOPPED, WorkerState.FATAL)
    return (
        sum(1 for v in workers.values() if gpu in v.gpus and v.has_process and v.state not in idle)
        == 1
    )


def _with_sole(f: Finding, workers: Mapping[str, WorkerView]) -> Finding:
    """``f``, a worker-fatal XID, with whether it is one worker's own fixed (``sole``) and
    said in its evidence (``only_worker_on_gpu``)."""
    sole = _sole_on(f.gpu, workers)
    return replace(f, sole=sole, evidence={**f.evidence, "only_worker_on_gpu": sole})


def decide(
    findings: Sequence[Finding],
    workers: Mapping[str, WorkerView],
    policies: Mapping[str, GroupPolicy],
    now: float,
    recent: Mapping[tuple[str, str, str], float],
    *,
    cooldown_s: float = COOLDOWN_S,
    can_migrate: Mapping[str, bool | str] | None = None,
    migrating: int = 0,
    rolling: Mapping[str, str] | None = None,
) -> Decision:
    """The actions for ``findings`` now.

    ``recent``: ``(action, worker or gpu, reason) -> time`` of actions already taken (for the
    cooldown); ``migrating``: migrations still in flight (they go one at a time); ``rolling``:
    group -> the roll-out of it that runs ("rolling restart", "reload"): routine findings of
    its workers wait for it.
    """
    down: dict[str, int] = {}
    # whose a worker-fatal XID is, fixed at its first decision (Finding.sole)
    # (said in its evidence, ``only_worker_on_gpu``: a roll-out blames a new replica for an
    # XID that was its own, and proves it again once after one that may have been another's)
    findings = [
        _with_sole(f, workers) if f.kind == "xid_worker" and f.sole is None else f for f in findings
    ]
    # a recycle (no fault) also counts the ready workers out of routing (derated: on a hot
    # GPU, or by a derate of this round) as down: it never takes a group's serving below
    # replicas - max_unavailable
    derated: set[str] = set()
    for name, view in workers.items():
        if view.state is not WorkerState.READY:
            down[view.group] = down.get(view.group, 0) + 1
        elif view.derated:
            derated.add(name)
    taken: set[str] = set()  # workers acted on (disruptively) in this round
    acts: list[Act] = []
    deferred: list[Finding] = []
    why: dict[tuple[str, str], str] = {}
    # a recycle is decided after the faults: a worker due for one that leaks (or is over its
    # budget) meanwhile is drained for that, with its post-mortem and judgement as a crash
    for f in sorted(findings, key=lambda f: f.kind in ROUTINE):
        held_back = False
        for act in candidate_acts(f, workers, policies, can_migrate=can_migrate):
            target = act.worker or act.gpu or ""
            last = recent.get((act.action, target, act.reason))
            if last is not None and (
                (f.at is not None and last >= f.at)  # taken for this finding already
                or (act.action in COOLED and now - last < cooldown_s)
            ):
                continue
            if not act.disruptive:
                acts.append(act)
                if act.action == "derate" and workers[act.worker or ""].state is WorkerState.READY:
                    derated.add(act.worker or "")
                continue
            view = workers[act.worker or ""]
            if view.state in (WorkerState.STOPPED, WorkerState.FATAL):
                continue  # nothing runs: its next start is placed afresh
            if act.action == "migrate" and migrating:
                held_back = True
                why[f.key] = "another migration is in flight"
                continue
            going = view.state in _LEAVING or view.state in _DOWN or act.worker in taken
            cut = (
                act.action == "restart"
                and f.kind in CUTS_DRAIN
                and view.state is WorkerState.DRAINING
                and act.worker not in taken
            )
            if act.action != "migrate" and going and not cut:
                continue  # already going down (or down): its restart will come from that
            if act.action == "migrate" and (going or not view.has_process):
                act = replace(act, redirect_only=True)
            if f.kind in ROUTINE and rolling and view.group in rolling:
                held_back = True
                why[f.key] = f"a {rolling[view.group]} of group {view.group} is running"
                continue
            policy = policies.get(view.group, GroupPolicy())
            if view.state is WorkerState.READY and act.worker not in taken:
                broken = (
                    f.kind in BROKEN or (f.kind == "xid_worker" and f.sole is True) or _imminent(f)
                )
                # (the worker itself is no more out of routing for its own recycle)
                unrouted = sum(
                    1 for n in derated if n != act.worker and workers[n].group == view.group
                )
                out = down.get(view.group, 0) + (unrouted if f.kind in ROUTINE else 0)
                if not broken and out >= policy.max_unavailable:
                    held_back = True
                    why[f.key] = (
                        f"group {view.group} has {out} of its workers not ready"
                        + (" or out of routing" if f.kind in ROUTINE and unrouted else "")
                        + f" (max_unavailable {policy.max_unavailable})"
                    )
                    continue
                down[view.group] = down.get(view.group, 0) + 1
                derated.discard(act.worker or "")  # counted as down from now
            if act.action == "migrate":
                migrating += 1
            taken.add(act.worker or "")
            acts.append(act)
        if held_back:
            deferred.append(f)
    return Decision(tuple(acts), tuple(deferred), why)


# --- moves for heat over time --------------------------------------------------------------


def heat_memory_s(sustain_s: float, clear_s: float) -> float:
    """How long moves for heat remember it: ``2 x (thermal_sustain_s + thermal_clear_s)``
    (80 s by default), two turns of the detector (hot for ``sustain_s``, cool for
    ``clear_s``). A GPU hot within it takes no worker moved for heat, and a worker moved for
    heat within it does not move for heat again unless its GPU slows its clocks."""
    return 2.0 * (sustain_s + clear_s)


def heat_blocked(hot_at: Mapping[str, float], now: float, window_s: float) -> dict[str, float]:
    """The GPUs a move for heat must not go to, and how long ago each was hot: those hot (or
    reading hot: a clock event of heat or power, within ``thermal_margin_c``) less than
    ``window_s`` before ``now`` (``hot_at``: GPU -> when it last was)."""
    return {gpu: now - at for gpu, at in hot_at.items() if now - at < window_s}


def heat_move_wait(
    moved_at: float | None, now: float, window_s: float, *, slowed: bool
) -> float | None:
    """How long a worker last moved for heat at ``moved_at`` waits before it moves for heat
    again (None: it may now): until ``window_s`` after that move, unless its GPU got worse
    than near its threshold: ``slowed``, a clock event of heat or power now."""
    if moved_at is None or slowed:
        return None
    left = moved_at + window_s - now
    return left if left > 0 else None
