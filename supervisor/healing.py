"""Self-healing: feeds samples, XIDs and log lines to the detectors, and carries out the policy.

The judgements are pure (``policy.detect``, ``policy.heal``); this module holds the per-worker
and per-GPU state between samples and executes the actions through the workers' lifecycles
(``Drain``/``Restart`` events with a healing reason), the runtime's cordon set and its own
derate / quarantine sets. Every action is logged (``heal.action`` with reason and evidence),
counted (``actions_total``), journaled and, with ``[alerts] webhook_url``, sent as a webhook.

It runs inside the runtime's single writer: every entry point is called from the event loop.
"""

from __future__ import annotations

import functools
import math
import os
import random
import socket
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import psutil
import structlog

from supervisor import procfs
from supervisor.alerts import Alerter, alert_doc
from supervisor.errors import PlacementError
from supervisor.model import (
    DeviceSample,
    ExitReason,
    Sample,
    WorkerState,
    WorkerUsage,
    XidEvent,
    recovery_action_name,
)
from supervisor.plan import GpuSlot, covering, place
from supervisor.policy import lifecycle as lc
from supervisor.policy.classify import excerpt
from supervisor.policy.detect import (
    BUDGET_SAMPLES,
    FLOOR_BUCKET_S,
    NO_VERDICT,
    THERMAL_REASONS,
    FloorSeries,
    LeakSettings,
    LeakVerdict,
    ThermalSettings,
    ThermalTrack,
    budget_streak,
    headroom,
    in_use_on_gpus,
    in_use_total,
    judge_leak,
    match_pattern,
    max_age_due,
    reports_fresh,
    thermal_step,
    urgency,
    xid_class,
)
from supervisor.policy.heal import (
    EVENT_FINDINGS,
    ROUTINE,
    Act,
    Finding,
    GroupPolicy,
    WorkerView,
    decide,
    heat_blocked,
    heat_memory_s,
    heat_move_wait,
)
from supervisor.sampler import STUCK_AFTER_INTERVALS, STUCK_AFTER_S

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.config import HealthSection, Settings, WorkerGroup
    from supervisor.journal import Journal
    from supervisor.worker import WorkerRunner

MIB = 1024 * 1024
DEFAULT_WINDOW_S = 600.0
#: Available host memory (for the time-to-exhaustion of host leaks) is re-read at most this often.
HOST_FREE_EVERY_S = 5.0
#: the system-wide OOM-kill count (/proc/vmstat) is re-read at most this often at spawns
OOM_COUNT_REUSE_S = 0.25
#: A worker without a cgroup count of its own is judged on the system-wide one, which counts
#: every OOM kill of the machine: it is read at samples (at most this often, while such a worker
#: runs), and a death is compared with the last reading at least ``OOM_GUARD_S`` older than it
#: (a reading between the kernel's kill and the reap would hide the kill), not with the count
#: at its spawn, hours before.
OOM_READ_EVERY_S = 2.0  # /proc/vmstat costs the kernel ~0.2 ms a read: not at every 2 Hz sample
#: (the kernel's kill of a process with a large memory takes seconds to reap: unmapping it,
#: tearing down its GPU context)
OOM_GUARD_S = 5.0
#: A GPU that stays hot is looked at again for workers to migrate off it every
#: ``thermal_sustain_s`` (10 s by default), and at most this often.
MIGRATE_AGAIN_MIN_S = 1.0
#: A worker an action to take down was posted to counts as leaving until its task takes the
#: action (a step of the event loop), for this long at most (an action its lifecycle ignores
#: does not hold its group's other findings back for good).
POSTED_HOLD_S = 5.0
#: Reasons of findings about one process: a new process of the worker is judged afresh.
#: (``xid`` too: a new process is only concerned by XIDs after its start, ``_came_after``, and
#: one on the replacement within a minute of the last restart is news, not the same burst;
#: ``gpu_lost``, ``row_remap_failure`` and ``recovery_action`` too: a worker moved off one GPU
#: whose other GPU fails within the minute must move again, or it stays on a quarantined GPU
#: for good)
PER_PROCESS = frozenset(
    {
        "leak",
        "gpu_memory_limit",
        "host_memory_limit",
        "log_pattern",
        "xid",
        "gpu_lost",
        "row_remap_failure",
        "recovery_action",
        "max_age",
    }
)
#: The notify field in which a worker reports the GPU memory it really holds (MiB): what its
#: allocator has handed out (``torch.cuda.memory_allocated()``), without the cache NVML counts.
IN_USE_FIELD = "X_GPU_MEMORY_IN_USE_MB"


def thermal_gap_s(sample_interval_s: float) -> float:
    """The longest gap between two samples of a GPU that its heat (or cool) is counted across:
    a backend call that takes longer counts as stuck (telemetry down), and one more interval
    passes before the next sample."""
    return max(STUCK_AFTER_S, STUCK_AFTER_INTERVALS * sample_interval_s) + sample_interval_s


def floor_bucket_s(window_s: float) -> float:
    """The floor bucket for a leak window: the detector's default scaled to the window."""
    return FLOOR_BUCKET_S * window_s / DEFAULT_WINDOW_S


#: The most MiB a report may say (a PiB: no GPU holds that): the sum of a worker's reports
#: stays a finite number the API's JSON can carry (two ranks at 1e308 summed to infinity).
IN_USE_MAX_MB = 2.0**30


def parse_in_use(value: str) -> float | None:
    """The MiB of an ``X_GPU_MEMORY_IN_USE_MB`` report (None: not a number from 0 to
    ``IN_USE_MAX_MB``)."""
    try:
        mb = float(value)
    except ValueError:
        return None
    return mb if 0 <= mb <= IN_USE_MAX_MB else None


class HealHost(Protocol):
    """What the healer needs from the runtime."""

    settings: Settings
    runners: dict[str, WorkerRunner]
    cordoned: set[str]
    journal: Journal
    actions_total: dict[tuple[str, str], int]
    clock: Clock
    #: group -> the roll-out of it that runs ("rolling restart", "reload")
    rolling: dict[str, str]

    def workers(self) -> list[WorkerRunner]: ...

    def slots(self) -> list[GpuSlot]: ...

    def changed(self) -> None: ...


@dataclass
class _Watch:
    """One worker's detector state for its current process."""

    pid: int | None
    gpu_floor: FloorSeries
    #: GPU -> the floor of what the worker holds there, for a worker on several GPUs (its
    #: leak is judged GPU by GPU, each against that GPU's headroom)
    gpu_floors: dict[str, FloorSeries]
    host_floor: FloorSeries
    #: the worker's own reports of the GPU memory it holds (``X_GPU_MEMORY_IN_USE_MB``)
    in_use_floor: FloorSeries
    #: pid -> (MiB, reported at): the latest report of each process of the worker's tree
    in_use_by_pid: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: GPU -> the floor of what the worker's processes there report, for a worker on several
    #: GPUs (judged GPU by GPU while each reporting process is on exactly one of them)
    in_use_floors: dict[str, FloorSeries] = field(default_factory=dict)
    #: reporting pid -> the worker's GPUs NVML's process lists have shown it on
    in_use_on: dict[int, set[str]] = field(default_factory=dict)
    bad_report_logged: bool = False
    gpu_leak_source: Literal["nvml", "worker"] = "nvml"
    gpu_streak: int = 0
    host_streak: int = 0
    #: when the host figures last counted for ``host_streak`` were read (``Sample.host_at``)
    host_read_at: float | None = None
    gpu_leak: LeakVerdict = NO_VERDICT
    host_leak: LeakVerdict = NO_VERDICT
    judged_at: float = float("-inf")
    pattern_hit: bool = False
    oom_kills_at_start: int | None = None
    oom_system: bool = False  # the count is the system-wide one (no cgroup count of its own)
    spawned_at: float = 0.0
    gpu_mb: float | None = None  # on its fullest GPU at the last sample (a migration need)
    gpu_by_gpu: Mapping[str, float] = field(default_factory=dict)  # per GPU, then
    #: the share of ``max_age_jitter_s`` this process gets, and whether its recycle is under
    #: way (a deferred one is not: it is judged again at each sample)
    max_age_draw: float = 0.0
    aged: bool = False

    def all_series(self) -> tuple[FloorSeries, ...]:
        """Every floor series of the process (GPU, host, reports; GPU by GPU)."""
        return (
            self.gpu_floor,
            self.host_floor,
            self.in_use_floor,
            *self.gpu_floors.values(),
            *self.in_use_floors.values(),
        )


@dataclass
class HealState:
    """What the healer has decided that the read model shows."""

    derated: dict[str, str] = field(default_factory=dict)  # worker -> why
    quarantined: dict[str, str] = field(default_factory=dict)  # GPU UUID -> why
    thermal: dict[str, ThermalTrack] = field(default_factory=dict)  # GPU UUID -> track
    thermal_cordoned: set[str] = field(default_factory=set)
    #: GPU UUID -> the flags still on when an operator lifted its quarantine (reason ->
    #: value: ``row_remap_failure`` 1, ``recovery_action`` its code), kept in
    #: ``state_dir/quarantine`` so that the lift outlives a restart of the supervisor
    lifted: dict[str, dict[str, int]] = field(default_factory=dict)


class Healer:
    """Detector state and action execution for a runtime."""

    def __init__(
        self,
        host: HealHost,
        alerter: Alerter | None = None,
        *,
        host_available_mb: Callable[[], float | None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.host = host
        self._rng = rng or random.Random()  # noqa: S311 - spreads recycles, no secret
        self.alerter = alerter
        self.log = structlog.get_logger()
        self.state = HealState()
        self._watch: dict[str, _Watch] = {}
        self._pending: dict[tuple[str, str], Finding] = {}
        self._deferred_logged: set[tuple[str, str]] = set()
        self._recent: dict[tuple[str, str, str], float] = {}
        #: worker -> evidence of the healing action that is stopping it (for its post-mortem)
        self._exit_evidence: dict[str, dict[str, Any]] = {}
        #: worker -> (its process's pid and start, when, the state it goes to) of an action
        #: posted to take it down: until its task takes it, the worker still says ready
        self._posted: dict[str, tuple[int | None, float | None, float, WorkerState]] = {}
        #: worker -> GPUs its next placement must avoid (migrate)
        self.avoid: dict[str, set[str]] = {}
        #: worker -> GPU memory it used when its migration was decided (the target must fit it)
        self.need_mb: dict[str, float] = {}
        self._migrating: set[str] = set()
        #: workers whose last healing action was a restart for a worker-fatal XID on a GPU
        #: that other workers shared: maybe not its own (a roll-out proves it again once)
        self.xid_maybe_not_own: set[str] = set()
        self._lost: set[str] = set()
        #: (finding kind, GPU) of the memory-error flags that are on (acted on once)
        self._flags_on: set[tuple[str, str]] = set()
        #: GPU -> the recovery action code last read (acted on when it changes)
        self._recovery: dict[str, int] = {}
        self._migrate_again_at: dict[str, float] = {}  # GPU -> when to look at it again
        #: GPU -> the last sample at which it was hot or read hot (moves for heat avoid it
        #: for ``heat_memory_s``), and the GPUs slowing their clocks for heat at the last one
        self._hot_at: dict[str, float] = {}
        self._slowed: set[str] = set()
        self._sampled_at: float | None = None
        #: worker -> when its last move for heat was decided (not again within the window)
        self._heat_moved: dict[str, float] = {}
        self._host_available_mb = host_available_mb or _host_available_mb
        self._host_free_at: float | None = None
        self._host_free_mb: float | None = None
        #: worker -> its cgroup's memory.events (its own OOM-kill count), when it has one
        self.oom_events_of: Callable[[str], Path | None] = lambda _name: None
        self._oom_count: tuple[float, int | None] | None = None  # (read at, system-wide count)
        self._oom_readings: deque[tuple[float, int]] = deque(maxlen=8)  # at samples

    # --- read model ---------------------------------------------------------------------

    def annotate(self, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Fill the leak fields (and ``derated``) of a worker object."""
        w = self._watch.get(name)
        verdict = w.gpu_leak if w is not None else NO_VERDICT
        host = w.host_leak if w is not None else NO_VERDICT
        in_use = (
            None
            if w is None
            else in_use_total(w.in_use_by_pid, self.host.clock.now(), w.in_use_floor.keep_s)
        )
        obj["gpu_memory_in_use_mb"] = _round(in_use)
        obj["leak"] = {
            "slope_mb_per_min": _round(verdict.slope_mb_per_min),
            "suspected": verdict.suspected,
            "projected_oom_s": _round(verdict.projected_oom_s),
            "source": w.gpu_leak_source if w is not None else "nvml",
            "host_slope_mb_per_min": _round(host.slope_mb_per_min),
            "host_suspected": host.suspected,
            "host_projected_oom_s": _round(host.projected_oom_s),
        }
        obj["recycle_in_s"] = self._recycle_in(name, w)
        obj["derated"] = name in self.state.derated
        if name in self.state.derated:
            obj["derated_reason"] = self.state.derated[name]
        return obj

    def _recycle_in(self, name: str, w: _Watch | None) -> float | None:
        """Seconds until ``name``'s process is due for its ``max_age_s`` recycle (0: due,
        waiting its turn; None: off, not ready, or under way)."""
        runner = self.host.runners.get(name)
        if w is None or runner is None or w.aged or runner.record.pid != w.pid:
            return None
        group = self._group(runner)
        if group is None or runner.state is not WorkerState.READY:
            return None
        due = _recycle_due(runner, w, group.health)
        return None if due is None else round(max(0.0, due - self.host.clock.now()), 1)

    def exit_evidence(self, name: str) -> dict[str, Any] | None:
        """The evidence of the healing action that stopped ``name`` (once)."""
        return self._exit_evidence.pop(name, None)

    def oom_baseline(self, name: str) -> int | None:
        """The OOM-kill count ``name``'s process, dying now, is compared with: its cgroup's at
        its start, or the system-wide one shortly before now (None when unknown)."""
        w = self._watch.get(name)
        if w is None:
            return None
        if w.oom_system:
            before = self.host.clock.now() - OOM_GUARD_S
            for t, count in reversed(self._oom_readings):
                if t <= before:
                    return count if t >= w.spawned_at else w.oom_kills_at_start
        return w.oom_kills_at_start

    def oom_scope(self, name: str) -> str:
        """Whose OOM kills ``oom_kills_since`` counts for ``name``: ``cgroup`` or ``host``."""
        w = self._watch.get(name)
        return "host" if w is None or w.oom_system else "cgroup"

    def oom_kills_since(self, name: str, baseline: int | None) -> int:
        """OOM kills the kernel counted since ``baseline`` (0 when unknown)."""
        if baseline is None:
            return 0
        now = procfs.oom_kills(self.oom_events_of(name))
        return 0 if now is None else max(0, now - baseline)

    # --- inputs -------------------------------------------------------------------------

    def on_spawned(self, runner: WorkerRunner, pid: int) -> None:
        """A new process ``pid`` (not yet in ``runner.record``): its detectors start over.

        Findings about the old process no longer hold back actions on the new one (a leak or a
        sticky error of the new process is news); a derated worker that now runs on GPUs that
        are not hot is back in routing.
        """
        self._reset(runner, pid)
        self._posted.pop(runner.name, None)
        self._migrating.discard(runner.name)
        self.need_mb.pop(runner.name, None)
        for key in [k for k in self._recent if k[1] == runner.name and k[2] in PER_PROCESS]:
            del self._recent[key]
        gpus = set(runner.spec.gpus or ())
        hot = gpus & self.hot_gpus()
        if runner.name in self.state.derated and not hot:
            self._execute(
                Act("restore", "thermal", "placed on GPUs that are not hot", worker=runner.name),
                self.host.clock.now(),
            )
        group = self._group(runner)
        if (
            hot
            and runner.name not in self.state.derated
            and group is not None
            and group.health.on_thermal == "derate"
        ):
            # started on a GPU that is hot already (a scale, an explicit list): the heat was
            # acted on when the GPU turned hot, before this worker was there
            gpu = sorted(hot)[0]
            self._execute(
                Act(
                    "derate",
                    "thermal",
                    f"started on a hot GPU ({gpu})",
                    worker=runner.name,
                    gpu=gpu,
                ),
                self.host.clock.now(),
            )
        if group is not None and group.health.on_thermal == "cordon":
            # so too a GPU that turned hot with no worker of a cordon group on it: no new
            # workers there from now on (regression: never cordoned while it stayed hot);
            # not one cordoned for this heat already, that an operator uncordoned since
            for gpu in sorted(hot - self.host.cordoned):
                last = self._recent.get(("cordon", gpu, "thermal"))
                since = self.state.thermal[gpu].hot_since
                if last is not None and since is not None and last >= since:
                    continue
                self._execute(
                    Act("cordon", "thermal", f"{runner.name} started on a hot GPU", gpu=gpu),
                    self.host.clock.now(),
                )

    def on_stopped(self, runner: WorkerRunner) -> None:
        """``runner`` has no process any more (stopped, fatal): out of routing for that, not
        derated (regression: the API and ``worker_derated`` said derated for a worker with no
        process); started again on a GPU that is hot, it is derated at its start."""
        if self.state.derated.pop(runner.name, None) is not None:
            self.host.changed()

    def forget(self, name: str) -> None:
        """Worker ``name`` is gone for good (a reload removed it): what was kept about it goes.

        Regression: its detectors, findings, cooldowns and ``derated`` stayed for the rest of
        the run (a supervisor whose reloads add and remove groups grew without bound), and a
        worker of the same name added later inherited them (a ``restore`` for a worker that
        was never derated, shown derated until its first spawn)."""
        self._watch.pop(name, None)
        for key in [k for k in self._pending if k[1] == name]:
            del self._pending[key]
        self._deferred_logged = {k for k in self._deferred_logged if k[1] != name}
        for recent in [k for k in self._recent if k[1] == name]:
            del self._recent[recent]
        self._exit_evidence.pop(name, None)
        self.xid_maybe_not_own.discard(name)
        self._posted.pop(name, None)
        self.avoid.pop(name, None)
        self.need_mb.pop(name, None)
        self._migrating.discard(name)
        self._heat_moved.pop(name, None)
        self.state.derated.pop(name, None)

    def on_migration_stayed(self, runner: WorkerRunner, gpus: Sequence[str], why: str) -> None:
        """A migration's worker started on the hot GPU it was leaving: no cooler GPU had room
        by its start (the target filled up or turned hot while it drained). An alert, as when
        no cooler GPU had room at the decision (regression: only a log line, so the operator
        saw a migrate and never learned that the worker stayed); it moves once one has room
        (judged again every ``thermal_sustain_s``, a migrate at most once a minute)."""
        hot = self.hot_gpus()
        # the hot one of its GPUs (regression: the first, a cool one for a worker on two)
        gpu = next((u for u in gpus if u in hot), gpus[0] if gpus else None)
        self._record(
            Act(
                "alert",
                "thermal",
                f"could not move off its hot GPU: {why}; started there again",
                worker=runner.name,
                gpu=gpu,
                evidence={"gpus": list(gpus), "migrate": why},
            ),
            self.host.clock.now(),
        )

    def on_line(self, runner: WorkerRunner, line: str) -> None:
        """A line of a worker's output: a sticky-error pattern restarts it."""
        w = self._watch.get(runner.name)
        group = self._group(runner)
        if w is None or w.pattern_hit or group is None or runner.record.pid is None:
            return
        pattern = match_pattern(line, group.health.log_restart_patterns)
        if pattern is None:
            return
        w.pattern_hit = True
        self._add(
            Finding(
                "log_pattern",
                f"output matches {pattern!r}",
                worker=runner.name,
                evidence={"pattern": pattern, "log_line": excerpt(line, (pattern,))},
            )
        )
        self._run(self.host.clock.now())

    def on_notify(self, runner: WorkerRunner, pid: int, fields: Mapping[str, str]) -> None:
        """A notify datagram from process ``pid`` of a worker's tree: an
        ``X_GPU_MEMORY_IN_USE_MB`` report feeds its leak detector (the worker holds what its
        processes last reported, summed); a bad value is ignored, and logged once per process."""
        raw = fields.get(IN_USE_FIELD)
        w = self._watch.get(runner.name)
        if raw is None or w is None or w.pid is None or w.pid != runner.record.pid:
            return
        mb = parse_in_use(raw)
        if mb is None:
            if not w.bad_report_logged:
                w.bad_report_logged = True
                self.log.warning(
                    "heal.bad_report",
                    worker=runner.name,
                    field=IN_USE_FIELD,
                    value=raw[:64],
                    reason="not a number of MiB >= 0; ignored",
                )
            return
        now = self.host.clock.now()
        window = w.in_use_floor.keep_s
        w.in_use_by_pid[pid] = (mb, now)
        for gone in [
            p for p, (_, at) in w.in_use_by_pid.items() if not reports_fresh(at, now, window)
        ]:
            del w.in_use_by_pid[gone]
        w.in_use_floor.add(now, in_use_total(w.in_use_by_pid, now, window))

    def lift_quarantine(self, uuid: str) -> str | None:
        """An operator's word that GPU ``uuid`` is fit again (reset, repaired): it leaves
        quarantine (why it was there is returned; None if it was not). The caller lifts only
        a GPU that answers; one lost after that is found lost again, and quarantined again."""
        self._lost.discard(uuid)
        why = self.state.quarantined.pop(uuid, None)
        on = {"row_remap_failure": 1} if ("row_remap_failure", uuid) in self._flags_on else {}
        if self._recovery.get(uuid):
            on["recovery_action"] = self._recovery[uuid]
        if why is not None and on:
            self.state.lifted[uuid] = on
        return why

    def forget_gpu(self, uuid: str) -> None:
        """GPU ``uuid`` was replaced (``gpu.replaced``): it is gone for good. Its quarantine,
        lifts, heat cordon and tracks go with it (the GPU that replaced it has a UUID of its
        own: none of them applies to it). Regression: its quarantine was listed in /readyz
        and ``state_dir/quarantine`` for ever."""
        state = self.state
        state.quarantined.pop(uuid, None)
        state.lifted.pop(uuid, None)
        state.thermal.pop(uuid, None)
        if uuid in state.thermal_cordoned:
            state.thermal_cordoned.discard(uuid)
            self.host.cordoned.discard(uuid)
        self._lost.discard(uuid)
        self._flags_on = {f for f in self._flags_on if f[1] != uuid}
        self._recovery.pop(uuid, None)
        self._migrate_again_at.pop(uuid, None)
        self._hot_at.pop(uuid, None)
        self._slowed.discard(uuid)

    def keep_lifts(self, lifted: Mapping[str, Mapping[str, int]]) -> None:
        """Lifts an earlier supervisor's operator made in this boot while a flag of the GPU
        stayed on: the flag, on at the first sample, is not news (regression: the GPU was
        quarantined again at every restart of the supervisor, its lift undone)."""
        for uuid, flags in lifted.items():
            self.state.lifted[uuid] = dict(flags)
            if "row_remap_failure" in flags:
                self._flags_on.add(("row_remap_failure", uuid))
            if "recovery_action" in flags:
                self._recovery[uuid] = flags["recovery_action"]

    def _lift_ends(self, uuid: str, flag: str) -> None:
        """``flag`` of GPU ``uuid`` went off or changed: a lift made while it was on is over."""
        flags = self.state.lifted.get(uuid)
        if flags is not None and flags.pop(flag, None) is not None and not flags:
            del self.state.lifted[uuid]

    def on_xid(self, event: XidEvent) -> None:
        """An XID error: restart the GPU's workers, or quarantine it (informational: nothing)."""
        gpu = self.host.settings.gpu
        kind = xid_class(event.xid, gpu.xid_worker_fatal, gpu.xid_device_fatal)
        uuid = event.uuid or self._uuid_of(event.gpu_index)
        if kind == "info" or uuid is None:
            return
        evidence = {"xid": event.xid, "gpu_index": event.gpu_index, "class": kind}
        now = self.host.clock.now()  # when it happened: its acts are for the processes then
        if kind == "worker":
            finding = Finding(
                "xid_worker", f"XID {event.xid} (worker-fatal)", gpu=uuid, evidence=evidence, at=now
            )
        else:
            finding = Finding(
                "xid_device", f"XID {event.xid} (device-fatal)", gpu=uuid, evidence=evidence, at=now
            )
        self._add(finding)
        self._run(now)

    def on_sample(self, sample: Sample) -> None:
        """Judge every worker and GPU at this sample; act."""
        now = sample.t
        free_of = {d.uuid: d.memory_free_mb for d in sample.devices}
        # Only a worker with a process and a usage in this sample can be judged: one without
        # (in backoff, fatal, stopped) keeps its judged_at of -inf and would take the tick's
        # judgement every time, starving every other worker's leak judgement.
        runners = self.host.workers()
        judgeable = {
            r.name for r in runners if r.record.pid is not None and r.name in sample.workers
        }
        due = sorted(
            (w.judged_at, name)
            for name, w in self._watch.items()
            if name in judgeable and now - w.judged_at >= w.gpu_floor.bucket_s
        )
        # Leak judgements are spread over the ticks (about one bucket's worth of workers per
        # tick), so 64 workers never cost one tick all of their fits at once.
        interval = self.host.settings.supervisor.sample_interval_s
        share = math.ceil(len(self._watch) * interval / FLOOR_BUCKET_S) if self._watch else 0
        judged = {name for _, name in due[: max(1, share)]}
        if any(w.oom_system and w.pid is not None for w in self._watch.values()):
            self._read_oom(now)
        host_free = self._host_free(now) if judged else None
        for runner in runners:
            self._judge_worker(runner, sample, now, free_of, host_free, runner.name in judged)
        self._sampled_at = now
        self._judge_devices(sample, now)
        self._restore_undeserved(now)
        self._run(now)

    def _restore_undeserved(self, now: float) -> None:
        """Derated workers whose group no longer derates (a reload changed ``on_thermal``) are
        back in routing at once (regression: they stayed out of it until the GPU cooled)."""
        for name in list(self.state.derated):
            runner = self.host.runners.get(name)
            group = self._group(runner) if runner is not None else None
            if group is not None and group.health.on_thermal != "derate":
                message = f"on_thermal is {group.health.on_thermal!r} now, not 'derate'"
                self._execute(Act("restore", "thermal", message, worker=name), now)

    def _host_free(self, now: float) -> float | None:
        """Available host memory, read at most every ``HOST_FREE_EVERY_S`` (/proc/meminfo)."""
        if self._host_free_at is None or now - self._host_free_at >= HOST_FREE_EVERY_S:
            self._host_free_mb = self._host_available_mb()
            self._host_free_at = now
        return self._host_free_mb

    # --- detectors ----------------------------------------------------------------------

    def _read_oom(self, now: float) -> None:
        """Note the system-wide OOM-kill count (at most every ``OOM_READ_EVERY_S``)."""
        if self._oom_readings and now - self._oom_readings[-1][0] < OOM_READ_EVERY_S:
            return
        count = procfs.oom_kills()
        if count is not None:
            self._oom_readings.append((now, count))

    def _oom_kills_at_start(self, name: str) -> int | None:
        """The OOM-kill count a new process of ``name`` is compared with when it dies.

        A worker's own cgroup count is read each time; the system-wide one is shared by the
        spawns of one short burst (32 workers starting read ``/proc/vmstat`` once, not 32 times).
        """
        events = self.oom_events_of(name)
        if events is not None:
            return procfs.oom_kills(events)
        now = self.host.clock.now()
        if self._oom_count is None or now - self._oom_count[0] >= OOM_COUNT_REUSE_S:
            self._oom_count = (now, procfs.oom_kills())
        return self._oom_count[1]

    def _reset(self, runner: WorkerRunner, pid: int | None) -> _Watch:
        window = self._health(runner).leak_window_s if self._group(runner) else 600.0
        bucket = floor_bucket_s(window)
        w = _Watch(
            pid=pid,
            gpu_floor=FloorSeries(window, bucket),
            gpu_floors={},
            host_floor=FloorSeries(window, bucket),
            in_use_floor=FloorSeries(window, bucket),
            oom_kills_at_start=self._oom_kills_at_start(runner.name) if pid else None,
            oom_system=self.oom_events_of(runner.name) is None,
            spawned_at=self.host.clock.now(),
            max_age_draw=self._rng.random(),
        )
        self._watch[runner.name] = w
        for key in [k for k in self._pending if k[1] == runner.name]:
            del self._pending[key]
        return w

    def _judge_worker(
        self,
        runner: WorkerRunner,
        sample: Sample,
        now: float,
        free_of: Mapping[str, float | None],
        host_free: float | None,
        judge: bool,
    ) -> None:
        group = self._group(runner)
        if group is None:
            return
        health = group.health
        w = self._watch.get(runner.name)
        pid = runner.record.pid
        if w is None or w.pid != pid:
            w = self._reset(runner, pid)
        if w.gpu_floor.keep_s != health.leak_window_s:
            # a reload changed the window: the running process's series keep the new one
            # (regression: they kept the window it started with until it was restarted)
            for series in w.all_series():
                series.keep_s = health.leak_window_s
                series.bucket_s = floor_bucket_s(health.leak_window_s)
        ready_at = runner.record.ready_at
        if pid is not None and not w.aged:
            self._judge_age(runner, w, health, ready_at, now)
        usage = sample.workers.get(runner.name)
        if pid is None or usage is None:
            return
        gpus = runner.spec.gpus or ()
        if ready_at is not None:
            _warm_up(w, ready_at + health.leak_warmup_s, now, gpus)
        w.gpu_floor.add(now, usage.gpu_memory_mb)
        known = usage.gpu_memory_mb is not None
        for u, series in w.gpu_floors.items():  # a GPU it holds nothing on: 0 MiB there
            series.add(now, usage.gpu_memory_by_gpu.get(u, 0.0) if known else None)
        w.host_floor.add(now, usage.host_rss_mb)
        on_one, host_used = self._judge_budgets(runner, w, usage, health, sample.host_at)
        in_use, in_use_by_gpu = _feed_reports(w, sample, gpus, now, health, judge)
        if judge:
            w.judged_at = now
            self._judge_leaks(
                runner,
                w,
                usage,
                health,
                now,
                _Memory(on_one, host_used, in_use, in_use_by_gpu),
                free_of,
                host_free,
            )

    def _judge_budgets(
        self,
        runner: WorkerRunner,
        w: _Watch,
        usage: WorkerUsage,
        health: HealthSection,
        host_at: float | None,
    ) -> tuple[float | None, float | None]:
        """Count the samples over the GPU and host budgets, and find a breach; return what
        was judged: the GPU memory on the worker's fullest GPU and the host memory."""
        # The GPU budget is per GPU (placement reserves it on each GPU of the worker, and the
        # worker gets it as a per-device cap): a worker on two GPUs is over it when one of
        # them holds more, not when the two together do.
        on_one = (
            max(usage.gpu_memory_by_gpu.values())
            if usage.gpu_memory_by_gpu and usage.gpu_memory_mb is not None
            else usage.gpu_memory_mb
        )
        # what each GPU a migration moves it to must have free: the most it holds on one of
        # its GPUs (regression: the sum over a tensor-parallel worker's GPUs, which no GPU had
        # free, so it was never moved off a hot GPU)
        w.gpu_mb = on_one
        w.gpu_by_gpu = usage.gpu_memory_by_gpu
        w.gpu_streak = budget_streak(w.gpu_streak, on_one, health.gpu_memory_limit_mb)
        # /proc is read less often than samples come: only a new reading counts (a spike seen
        # in one reading, repeated by the samples until the next, is not two samples over)
        # the budget is judged on the tree's PSS where it was read (its RSS over the budget:
        # memory its forked processes share counts once, not once per process)
        host_used = usage.host_rss_mb if usage.host_pss_mb is None else usage.host_pss_mb
        if host_at is None or host_at != w.host_read_at:
            w.host_read_at = host_at
            w.host_streak = budget_streak(w.host_streak, host_used, health.host_memory_limit_mb)
        # A breach deferred (max_unavailable) is acted on only while it lasts, with the newest
        # figures: one that ended meanwhile must not restart a healthy worker later.
        for kind, streak, used in (
            ("gpu_memory_limit", w.gpu_streak, on_one),
            ("host_memory_limit", w.host_streak, host_used),
        ):
            if streak >= BUDGET_SAMPLES:
                measure = "RSS" if usage.host_pss_mb is None else "PSS"
                found = _budget(kind, runner.name, used, health, measure)  # type: ignore[arg-type]
                self._add(found, newest=True)
            else:
                self._pending.pop((kind, runner.name), None)
        return on_one, host_used

    def _judge_leaks(
        self,
        runner: WorkerRunner,
        w: _Watch,
        usage: WorkerUsage,
        health: HealthSection,
        now: float,
        memory: _Memory,
        free_of: Mapping[str, float | None],
        host_free: float | None,
    ) -> None:
        """Judge the GPU and host floors for a leak; find the one that runs out first."""
        gpus = runner.spec.gpus or ()
        known = usage.gpu_memory_mb is not None
        settings = LeakSettings(
            window_s=health.leak_window_s,
            min_mb_per_min=health.leak_min_mb_per_min,
            horizon_s=health.oom_horizon_s,
        )
        frees = [f for u in gpus if (f := free_of.get(u)) is not None]
        device_free = min(frees) if frees else None
        # A worker that reports what it holds is judged by that: NVML counts the allocator's
        # cache too, which hides a leak until the cache is full and grows in steps of its own.
        w.gpu_leak_source = "worker" if memory.in_use is not None else "nvml"
        gpu_floor = w.in_use_floor if w.gpu_leak_source == "worker" else w.gpu_floor
        # the budget is per GPU: what is left of it on the worker's fullest GPU bounds the
        # headroom, as the GPU with the least free memory does (regression: twice the budget
        # less both GPUs' use, for a worker on two: a leak on one GPU was projected to reach
        # the budget long after it did)
        per_gpu = w.gpu_floors if w.gpu_leak_source == "nvml" else None
        if w.gpu_leak_source == "worker" and memory.in_use_by_gpu is not None:
            # the reports of each GPU's ranks against that GPU's headroom (regression: their
            # sum against the fullest GPU's: a leak on every rank ran out N times too soon)
            per_gpu = {u: w.in_use_floors[u] for u in memory.in_use_by_gpu if u in w.in_use_floors}
        if per_gpu:
            # on several GPUs, each GPU's floor against its own headroom, the soonest to run
            # out reported and acted on (regression: the slope of the sum over its GPUs
            # against one GPU's headroom: a leak on every rank ran out N times too soon)
            w.gpu_leak = min(
                (
                    judge_leak(
                        series.points(),
                        now,
                        settings,
                        headroom(
                            usage.gpu_memory_by_gpu.get(u, 0.0) if known else None,
                            health.gpu_memory_limit_mb,
                            free_of.get(u),
                        ),
                    )
                    for u, series in per_gpu.items()
                ),
                key=urgency,
            )
        else:
            w.gpu_leak = judge_leak(
                gpu_floor.points(),
                now,
                settings,
                headroom(memory.on_one, health.gpu_memory_limit_mb, device_free),
            )
        # the headroom under the host budget is measured on what the budget is judged on (the
        # tree's PSS where it was read: a forked tree's RSS counts shared pages once per
        # process, and was "over" a budget its PSS was far under: runs out in 0 s, drained)
        w.host_leak = judge_leak(
            w.host_floor.points(),
            now,
            settings,
            headroom(memory.host_used, health.host_memory_limit_mb, host_free),
        )
        if not (w.gpu_leak.act or w.host_leak.act):  # no longer: a deferred one is dropped
            self._pending.pop(("leak", runner.name), None)
        acting = [
            leak
            for leak in (
                ("gpu", w.gpu_leak, usage.gpu_memory_mb, health.gpu_memory_limit_mb),
                ("host", w.host_leak, memory.host_used, health.host_memory_limit_mb),
            )
            if leak[1].act
        ]
        if not acting:
            return
        # both at once: one finding, of the one that runs out sooner (regression: the host
        # one, judged second, replaced the GPU one, whose memory ran out first)
        kind, verdict, current, limit = min(acting, key=lambda leak: urgency(leak[1]))
        what = "GPU memory" if kind == "gpu" else "host memory (RSS)"
        reported = kind == "gpu" and w.gpu_leak_source == "worker"
        if reported:
            what = "GPU memory in use (reported by the worker)"
        self._add(  # the newest projection (an imminent one is not deferred)
            Finding(
                "leak",
                f"{what} grows {verdict.slope_mb_per_min:.1f} MiB/min; runs out in "
                f"{verdict.projected_oom_s or 0:.0f} s",
                worker=runner.name,
                evidence={
                    "memory": kind,
                    "source": w.gpu_leak_source if kind == "gpu" else "procfs",
                    **verdict.evidence(),
                    "used_mb": _round(current),
                    "in_use_mb": _round(memory.in_use) if reported else None,
                    "limit_mb": limit or None,
                    "oom_horizon_s": health.oom_horizon_s,
                    "leak_min_mb_per_min": health.leak_min_mb_per_min,
                },
            ),
            newest=True,
        )

    def _judge_age(
        self,
        runner: WorkerRunner,
        w: _Watch,
        health: HealthSection,
        ready_at: float | None,
        now: float,
    ) -> None:
        """``max_age_s``: a worker ready that long is recycled (once per process; one
        deferred by ``max_unavailable`` waits its turn, judged again at each sample: a reload
        that turns ``max_age_s`` off or raises it past the worker's age cancels it)."""
        due = _recycle_due(runner, w, health)
        if due is None or ready_at is None or now < due:
            self._pending.pop(("max_age", runner.name), None)
            return
        if runner.state is not WorkerState.READY:
            return
        self._add(
            Finding(
                "max_age",
                f"ready for {now - ready_at:.0f} s (max_age_s = {health.max_age_s:g}): recycled",
                worker=runner.name,
                evidence={
                    "ready_for_s": round(now - ready_at, 3),
                    "max_age_s": health.max_age_s,
                    "max_age_jitter_s": health.max_age_jitter_s,
                    "due_after_s": round(due - ready_at, 3),
                },
            ),
            newest=True,
        )

    def _judge_devices(self, sample: Sample, now: float) -> None:
        gpu = self.host.settings.gpu
        settings = ThermalSettings(
            margin_c=gpu.thermal_margin_c,
            sustain_s=gpu.thermal_sustain_s,
            clear_s=gpu.thermal_clear_s,
            max_gap_s=thermal_gap_s(self.host.settings.supervisor.sample_interval_s),
        )
        for d in sample.devices:
            if not d.healthy:
                if d.uuid not in self._lost and d.uuid not in self.state.quarantined:
                    self._lost.add(d.uuid)
                    self._add(
                        Finding(
                            "gpu_lost",
                            f"GPU {d.index} stopped answering ({d.error})",
                            gpu=d.uuid,
                            evidence={"gpu_index": d.index, "error": d.error},
                        )
                    )
                continue
            self._lost.discard(d.uuid)
            self._judge_memory(d)
            self._judge_recovery(d)
            track = self.state.thermal.get(d.uuid, ThermalTrack())
            track, change = thermal_step(track, d, now, settings)
            self.state.thermal[d.uuid] = track
            if track.hot or track.hot_since is not None:
                self._hot_at[d.uuid] = now
            if THERMAL_REASONS.intersection(d.throttle_reasons or ()):
                self._slowed.add(d.uuid)
            else:
                self._slowed.discard(d.uuid)
            if change is None:
                if track.hot:
                    self._migrate_again(d, track, now)
                continue
            evidence = {
                "gpu_index": d.index,
                "temperature_c": d.temperature_c,
                "temperature_slowdown_c": d.temperature_slowdown_c,
                "throttle_reasons": list(d.throttle_reasons or ()),
                "why": track.why,
            }
            if change == "hot":
                self._add(
                    Finding(
                        "thermal",
                        f"GPU {d.index} is hot: {track.why}",
                        gpu=d.uuid,
                        evidence=evidence,
                    )
                )
            else:
                self._pending.pop(("thermal", d.uuid), None)
                # a migration off it still under way need not avoid it any more (regression:
                # one that found no other GPU started there again with an alert that it
                # "could not move off its hot GPU", cool by then)
                for name in [n for n, gpus in self.avoid.items() if d.uuid in gpus]:
                    self.avoid[name].discard(d.uuid)
                    if not self.avoid[name]:
                        del self.avoid[name]
                self._add(
                    Finding(
                        "thermal_cleared",
                        f"GPU {d.index} is cool again",
                        gpu=d.uuid,
                        evidence=evidence,
                    )
                )

    def _judge_memory(self, d: DeviceSample) -> None:
        """The memory-repair flags (the row remapper's; page retirement's before Ampere), each
        acted on when it turns on (or is on at the first sample: an XID from before the
        supervisor started is never delivered, the flags stay): a failed remap quarantines
        the GPU (as XID 64 would) and moves its workers; a repair pending until the next reset
        is an alert (running work is unaffected, NVIDIA says; the reset is the operator's to
        schedule). An operator's lift of the quarantine holds while the flag stays on."""
        if d.retired_pages_pending is not None:
            self._flag(
                d.retired_pages_pending,
                Finding(
                    "retired_pages_pending",
                    f"GPU {d.index}: retired pages wait for a reset (reset the GPU when it can "
                    "be emptied)",
                    gpu=d.uuid,
                    evidence={"gpu_index": d.index, "retired_pages_pending": True},
                ),
            )
        rows = d.remapped_rows
        if rows is None:
            return
        evidence = {
            "gpu_index": d.index,
            "remapped_rows": {
                "correctable": rows.correctable,
                "uncorrectable": rows.uncorrectable,
                "pending": rows.pending,
                "failure": rows.failure,
            },
        }
        flags = (
            (
                rows.failure,
                Finding(
                    "row_remap_failure",
                    f"GPU {d.index}: a row remap failed (memory it cannot repair; reset it, "
                    "and replace it if it comes again)",
                    gpu=d.uuid,
                    evidence=evidence,
                ),
            ),
            (
                rows.pending,
                Finding(
                    "row_remap_pending",
                    f"GPU {d.index}: a row remap is pending (reset the GPU when it can be emptied)",
                    gpu=d.uuid,
                    evidence=evidence,
                ),
            ),
        )
        for on, finding in flags:
            self._flag(on, finding)

    def _flag(self, on: bool, finding: Finding) -> None:
        """A GPU's flag ``finding`` stands for: acted on when it turns on (or is on at the
        first sample), not again while it stays on."""
        if not on:
            self._flags_on.discard(finding.key)
            if finding.gpu is not None:
                self._lift_ends(finding.gpu, finding.kind)
            self._pending.pop(finding.key, None)
        elif finding.key not in self._flags_on:
            self._flags_on.add(finding.key)
            self._add(finding)

    def _judge_recovery(self, d: DeviceSample) -> None:
        """The driver's recovery action for the GPU (R550 and later), acted on when it changes
        to one other than ``none`` (or is one at the first sample): a reset or a reboot
        quarantines the GPU and moves its workers (nothing there works until then), others
        (``drain_p2p``) are alerts. Back to ``none`` (the GPU was reset) lifts nothing: the
        operator does (``uncordon --lift-quarantine``), as after a device-fatal XID; an
        operator's lift holds while the action stays the same."""
        code = d.recovery_action
        if code is None or code == self._recovery.get(d.uuid):
            return  # (a reading that failed changes nothing: the last one stands)
        self._recovery[d.uuid] = code
        self._lift_ends(d.uuid, "recovery_action")
        self._pending.pop(("recovery_action", d.uuid), None)
        name = recovery_action_name(code)
        if code == 0 or name is None:
            return
        self._add(
            Finding(
                "recovery_action",
                f"GPU {d.index}: the driver says it needs {name.replace('_', ' ')}",
                gpu=d.uuid,
                evidence={"gpu_index": d.index, "recovery_action": name},
            )
        )

    # --- policy and actions -------------------------------------------------------------

    def _add(self, finding: Finding, *, newest: bool = False) -> None:
        """Pend ``finding`` (``newest``: in place of a pending one of the same key, whose
        figures are older; else the first stays)."""
        pending = self._pending.get(finding.key)
        if pending is not None and newest:
            self._pending[finding.key] = finding
            return
        if pending is not None and finding.kind in EVENT_FINDINGS and finding.at is not None:
            # a second XID on a GPU whose first is still deferred: the newest stands for both
            # (every process there at the first was there at the second, or restarted since,
            # and its new process may be the second one's cause)
            self._pending[finding.key] = finding
            return
        self._pending.setdefault(finding.key, finding)

    def _migrate_again(self, d: DeviceSample, track: ThermalTrack, now: float) -> None:
        """A GPU that stays hot with workers of ``on_thermal = "migrate"`` groups on it that
        are not moving (no cooler GPU had room when it turned hot; placed there since, all
        others full): judged again every ``thermal_sustain_s`` (regression: they stayed on
        the hot GPU for good, not derated either)."""
        if now < self._migrate_again_at.get(d.uuid, -math.inf) or self._pending.get(
            ("thermal", d.uuid)
        ):
            return
        again_s = max(self.host.settings.gpu.thermal_sustain_s, MIGRATE_AGAIN_MIN_S)
        self._migrate_again_at[d.uuid] = now + again_s
        for r in self.host.workers():
            group = self._group(r)
            if (
                d.uuid in (r.spec.gpus or ())
                and r.state is WorkerState.READY
                and r.name not in self._migrating
                and group is not None
                and group.moves_off_heat
            ):
                break
        else:
            return
        self._add(
            Finding(
                "thermal",
                f"GPU {d.index} is still hot: {track.why}",
                gpu=d.uuid,
                evidence={"gpu_index": d.index, "why": track.why, "again": True},
            )
        )

    def hot_gpus(self) -> set[str]:
        """The GPUs hot now (thermal)."""
        return {u for u, t in self.state.thermal.items() if t.hot}

    def heating_gpus(self) -> set[str]:
        """The GPUs hot now or reading hot at the last sample (not yet for
        ``thermal_sustain_s``: after a restart of the supervisor, a GPU hot just before)."""
        return {u for u, t in self.state.thermal.items() if t.hot or t.hot_since is not None}

    def heat_window_s(self) -> float:
        """How long moves for heat remember it (``policy.heal.heat_memory_s``)."""
        gpu = self.host.settings.gpu
        return heat_memory_s(gpu.thermal_sustain_s, gpu.thermal_clear_s)

    def _heat_blocked(self) -> dict[str, float]:
        """GPU -> seconds since it was hot, for those a move for heat must not go to."""
        if self._sampled_at is None:
            return {}
        return heat_blocked(self._hot_at, self._sampled_at, self.heat_window_s())

    def migration_slots(self, name: str, slots: list[GpuSlot]) -> list[GpuSlot]:
        """``slots`` as a migration of ``name`` may use them: not the GPU it leaves, no hot
        GPU, none with less free memory than the worker used on one of its GPUs (when both
        are known)."""
        avoid = self.avoid.get(name, set())
        hot = self.hot_gpus()
        blocked = self._heat_blocked()
        need = self.need_mb.get(name)
        w = self._watch.get(name)
        if need is None and w is not None:
            need = w.gpu_mb
        # what its process holds on a GPU it keeps is free there once it moves (regression: a
        # tensor-parallel worker's other GPU had to have its share free twice over); once the
        # process is gone, the GPU's free memory has it back already
        runner = self.host.runners.get(name)
        running = w is not None and runner is not None and runner.record.pid == w.pid
        held = w.gpu_by_gpu if w is not None and w.pid is not None and running else {}
        out = []
        for s in slots:
            if s.uuid in avoid:
                s = replace(s, usable=False, why_not="is hot (migrating off it)")
            elif s.uuid in hot:
                s = replace(s, usable=False, why_not="is hot")
            elif s.uuid in blocked:
                ago, window = blocked[s.uuid], self.heat_window_s()
                why = (
                    f"was hot {ago:.1f} s ago (no move for heat onto a GPU hot within {window:g} s)"
                )
                s = replace(s, usable=False, why_not=why)
            elif need and s.free_mb is not None and s.free_mb + held.get(s.uuid, 0.0) < need:
                why = f"has {s.free_mb:.0f} MiB free, the worker used {need:.0f}"
                s = replace(s, usable=False, why_not=why)
            out.append(s)
        return out

    def _settle_migrations(self) -> None:
        """Migrations end when the worker starts again, and also when it will not (stopped,
        fatal, removed): then the next one may go."""
        for name in list(self._migrating):
            runner = self.host.runners.get(name)
            if runner is None or runner.state in (WorkerState.STOPPED, WorkerState.FATAL):
                self._migrating.discard(name)
                self.avoid.pop(name, None)
                self.need_mb.pop(name, None)

    def _run(self, now: float) -> None:
        self._settle_migrations()
        if not self._pending:
            return
        # stamped with the time its acts are recorded with (a sample's time, not the clock's)
        findings = [f if f.at is not None else replace(f, at=now) for f in self._pending.values()]
        views = {
            r.name: WorkerView(
                group=r.spec.group,
                state=self._state_of(r, now),
                gpus=tuple(r.spec.gpus or ()),
                derated=r.name in self.state.derated,
                has_process=r.record.pid is not None,
                started_at=r.record.started_at if r.record.pid is not None else None,
            )
            for r in self.host.workers()
        }
        policies = {
            g.name: GroupPolicy(
                on_leak=g.health.on_leak,
                on_over_budget=g.health.on_over_budget,
                on_thermal=g.health.on_thermal,
                max_unavailable=g.health.max_unavailable,
            )
            for g in self.host.settings.workers
        }
        decision = decide(
            findings,
            views,
            policies,
            now,
            self._recent,
            can_migrate=self._can_migrate(findings, now),
            migrating=len(self._migrating),
            rolling=self.host.rolling,
        )
        self._pending = {f.key: f for f in decision.deferred}
        for key, why in decision.why_deferred.items():
            if key not in self._deferred_logged:
                self._deferred_logged.add(key)
                self.log.info("heal.deferred", finding=key[0], target=key[1], reason=why)
        self._deferred_logged &= set(self._pending)
        for act in decision.acts:
            self._execute(act, now)
        self._prune_recent(now)

    def _state_of(self, runner: WorkerRunner, now: float) -> WorkerState:
        """The worker's state as decisions see it: leaving once an action to take it down was
        posted, before its task has taken it (a finding judged in that step of the loop, an
        XID or a log line, must count it down: max_unavailable). So too for one that a
        roll-out or an operator posted (a restart, stop or drain still queued)."""
        posted = self._posted.get(runner.name)
        if posted is not None:
            pid, started_at, at, leaving = posted
            if (
                runner.state is WorkerState.READY
                and (runner.record.pid, runner.record.started_at) == (pid, started_at)
                and now - at < POSTED_HOLD_S
            ):
                return leaving
            del self._posted[runner.name]  # taken (or a new process): its own state says it
        if runner.state is WorkerState.READY:
            queued = runner.queued_down()
            if isinstance(queued, lc.Drain):
                return WorkerState.DRAINING
            if queued is not None:
                return WorkerState.STOPPING
        return runner.state

    def _can_migrate(
        self, findings: list[Finding], now: float | None = None
    ) -> dict[str, bool | str]:
        hot = {f.gpu for f in findings if f.kind == "thermal" and f.gpu}
        if not hot:
            return {}
        now = self.host.clock.now() if now is None else now
        window = self.heat_window_s()
        blocked = self._heat_blocked()
        out: dict[str, bool | str] = {}
        slots = [
            replace(s, usable=False, why_not="is hot") if s.uuid in hot else s
            for s in self.host.slots()
        ]
        fixed = {r.name: r.spec.gpus for r in self.host.workers()}
        for r in self.host.workers():
            if not set(r.spec.gpus or ()) & hot:
                continue
            group = self._group(r)
            if group is None or group.gpus != "auto":
                out[r.name] = 'its GPUs are listed (gpus = [...]): only gpus = "auto" workers move'
                continue
            moved_at = self._heat_moved.get(r.name)
            slowed = bool(self._slowed & set(r.spec.gpus or ()))
            if moved_at is not None and heat_move_wait(moved_at, now, window, slowed=slowed):
                out[r.name] = (
                    f"moved for heat {now - moved_at:.1f} s ago: not again within {window:g} s "
                    "while its GPU does not slow its clocks"
                )
                continue
            try:
                place(
                    covering(
                        self.host.settings.workers,
                        ((w.spec.group, w.spec.index) for w in self.host.workers()),
                    ),
                    self.migration_slots(r.name, slots),
                    self.host.settings.gpu.reserve_mb,
                    fixed=fixed,
                    only={r.name},
                )
            except PlacementError:
                # a GPU that would do but for its recent heat: said (not "no room")
                now_hot = hot | self.hot_gpus()
                recent = [
                    str(s.index)
                    for s in slots
                    if s.uuid in blocked and s.uuid not in now_hot and s.usable
                ]
                which = ", ".join(recent)
                were = f"GPU {which} was" if len(recent) == 1 else f"GPUs {which} were"
                out[r.name] = (
                    f"no cooler GPU has room ({were} hot within the last {window:g} s)"
                    if recent
                    else False
                )
            else:
                out[r.name] = True
        return out

    def _execute(self, act: Act, now: float) -> None:
        runner = self.host.runners.get(act.worker or "")
        if act.action in ("drain", "restart", "migrate"):
            if runner is None:
                return
            reason = ExitReason(act.reason)
            if runner.state in (
                WorkerState.DRAINING,
                WorkerState.STOPPING,
            ) and (runner.record.after_exit is lc.AfterExit.STOP):
                # being stopped for good (an operator's drain or stop, a reload): nothing is
                # restarted, drained or moved. A broken one (a restart) is stopped now, its
                # drain cut short; and what is done is said as it is (it said "restart")
                if act.action != "restart":
                    return
                act = replace(
                    act, action="stop", message=f"{act.message} (being stopped: stopped now)"
                )
            if act.action == "migrate" and act.gpu is not None:
                self._heat_moved[runner.name] = now
                self.avoid.setdefault(runner.name, set()).add(act.gpu)
                self._migrating.add(runner.name)
                w = self._watch.get(runner.name)
                if w is not None and w.gpu_mb is not None:
                    self.need_mb[runner.name] = w.gpu_mb
            # A redirect-only migrate leaves the exit to what is already stopping the worker
            # (an exit with evidence pending: an action whose events it has not handled yet).
            if not act.redirect_only and not (
                act.action == "migrate" and runner.name in self._exit_evidence
            ):
                self._exit_evidence[runner.name] = {
                    **act.evidence,
                    "action": act.action,
                    "message": act.message,
                }
                record = runner.record
                if reason is ExitReason.XID and act.evidence.get("only_worker_on_gpu") is False:
                    self.xid_maybe_not_own.add(runner.name)
                else:
                    self.xid_maybe_not_own.discard(runner.name)
                if act.action in ("restart", "stop"):
                    runner.post(lc.Restart(reason=reason))  # a stop when stopping for good
                    leaving = WorkerState.STOPPING
                else:
                    runner.post(lc.Drain(restart=True, reason=reason))
                    leaving = WorkerState.DRAINING
                    w = self._watch.get(runner.name)
                    if reason is ExitReason.MAX_AGE and w is not None:
                        w.aged = True  # under way: not asked again for this process
                self._posted[runner.name] = (record.pid, record.started_at, now, leaving)
        elif act.action == "derate":
            if act.worker is None or act.worker in self.state.derated:
                return
            self.state.derated[act.worker] = act.message
        elif act.action == "restore":
            if act.worker not in self.state.derated:
                return
            gpus = set(runner.spec.gpus or ()) if runner is not None else set()
            group = self._group(runner) if runner is not None else None
            hot = sorted(self.hot_gpus() & gpus)
            if hot and (group is None or group.health.on_thermal == "derate"):
                # one of its other GPUs is still hot: routed again once it cools; derated for
                # that one now (regression: the reason still named the GPU that cooled)
                self.state.derated[act.worker] = self._hot_message(hot[0])
                self.host.changed()
                return
            del self.state.derated[act.worker]
        elif act.action == "cordon":
            if act.gpu is None or act.gpu in self.host.cordoned:
                return
            self.host.cordoned.add(act.gpu)
            self.state.thermal_cordoned.add(act.gpu)
        elif act.action == "uncordon":
            if act.gpu not in self.state.thermal_cordoned:
                return
            self.state.thermal_cordoned.discard(act.gpu)
            self.host.cordoned.discard(act.gpu)
        elif act.action == "quarantine":
            if act.gpu is None or act.gpu in self.state.quarantined:
                return
            self.state.quarantined[act.gpu] = act.message
            self.state.lifted.pop(act.gpu, None)
        self._record(act, now)

    def _record(self, act: Act, now: float) -> None:
        target = act.worker or act.gpu or ""
        self._recent[(act.action, target, act.reason)] = now
        key = (act.action, act.reason)
        self.host.actions_total[key] = self.host.actions_total.get(key, 0) + 1
        group = None
        if act.worker is not None and act.worker in self.host.runners:
            group = self.host.runners[act.worker].spec.group
        log = self.log.info if act.reason in ROUTINE else self.log.warning
        log(
            "heal.action",
            action=act.action,
            reason=act.reason,
            worker=act.worker,
            gpu=act.gpu,
            message=act.message,
            evidence=dict(act.evidence),
        )
        wall = self.host.clock.wall()
        self.host.journal.append(
            wall,
            "heal." + act.action,
            act.worker,
            reason=act.reason,
            gpu=act.gpu,
            message=act.message,
        )
        if self.alerter is not None and act.reason not in ROUTINE:
            self.alerter.send(
                alert_doc(
                    kind="alert" if act.action == "alert" else "action",
                    action=act.action,
                    reason=act.reason,
                    message=act.message,
                    at=wall,
                    worker=act.worker,
                    group=group,
                    gpu=act.gpu,
                    evidence=act.evidence,
                    host=_hostname(),
                    supervisor_pid=_pid(),
                )
            )
        self.host.changed()

    def on_restarted(self, runner: WorkerRunner, reason: str, message: str) -> None:
        """The lifecycle restarted a worker by itself (``hang``: no heartbeat within
        ``watchdog_s``; ``start_timeout``): logged, counted and sent like a healing action."""
        self._record(
            Act(
                "restart",
                reason,
                message,
                worker=runner.name,
                evidence={"pid": runner.last_exit_pid},
            ),
            self.host.clock.now(),
        )

    def on_fatal(self, runner: WorkerRunner, why: str) -> None:
        """A worker gave up (fatal): alert."""
        self._worker_alert(runner, "fatal", "fatal", f"{runner.name} is fatal: {why}", why)

    def on_waiting_gpu(self, runner: WorkerRunner, why: str) -> None:
        """A worker has no GPU to start on (it waits for one): alert."""
        message = f"{runner.name} is waiting for a GPU: {why}"
        self._worker_alert(runner, "alert", "no_gpu", message, why)

    def _worker_alert(
        self, runner: WorkerRunner, kind: str, reason: str, message: str, why: str
    ) -> None:
        if self.alerter is None:
            return
        self.alerter.send(
            alert_doc(
                kind=kind,
                reason=reason,
                message=message,
                at=self.host.clock.wall(),
                worker=runner.name,
                group=runner.spec.group,
                gpu=",".join(runner.spec.gpus or ()) or None,
                evidence={"restarts": runner.record.restarts, "why": why},
                host=_hostname(),
                supervisor_pid=_pid(),
            ),
            key=(reason, runner.name),
        )

    def _prune_recent(self, now: float) -> None:
        if len(self._recent) > 1024:
            for key in [k for k, t in self._recent.items() if now - t > 3600]:
                del self._recent[key]

    # --- helpers ------------------------------------------------------------------------

    def _group(self, runner: WorkerRunner) -> WorkerGroup | None:
        return self.host.settings.group(runner.spec.group)

    def _health(self, runner: WorkerRunner) -> HealthSection:
        group = self._group(runner)
        assert group is not None
        return group.health

    def _hot_message(self, uuid: str) -> str:
        """Why a hot GPU is hot, as its ``thermal`` finding says it."""
        index = next((s.index for s in self.host.slots() if s.uuid == uuid), uuid)
        return f"GPU {index} is hot: {self.state.thermal[uuid].why}"

    def _uuid_of(self, index: int) -> str | None:
        return next((s.uuid for s in self.host.slots() if s.index == index), None)


def _recycle_due(runner: WorkerRunner, w: _Watch, health: HealthSection) -> float | None:
    """When ``runner``'s process (watched as ``w``) is due for its ``max_age_s`` recycle."""
    return max_age_due(
        runner.record.ready_at, health.max_age_s, health.max_age_jitter_s, w.max_age_draw
    )


def _budget(
    kind: Literal["gpu_memory_limit", "host_memory_limit"],
    name: str,
    used: float | None,
    health: HealthSection,
    measure: str = "RSS",
) -> Finding:
    limit = (
        health.gpu_memory_limit_mb if kind == "gpu_memory_limit" else health.host_memory_limit_mb
    )
    what = "GPU memory" if kind == "gpu_memory_limit" else f"host memory ({measure})"
    return Finding(
        kind,
        f"{what} {used or 0:.0f} MiB over its budget of {limit:g} MiB",
        worker=name,
        evidence={"used_mb": _round(used), "limit_mb": limit, "samples_over": BUDGET_SAMPLES},
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(frozen=True, slots=True)
class _Memory:
    """What a worker's leak is judged on at one sample."""

    on_one: float | None  # GPU memory on its fullest GPU (NVML)
    host_used: float | None  # host memory of its tree (RSS, or PSS where read)
    in_use: float | None  # the sum of its processes' fresh reports (None: none is fresh)
    in_use_by_gpu: dict[str, float] | None  # those reports GPU by GPU, where placed


def _warm_up(w: _Watch, since: float, now: float, gpus: Sequence[str]) -> None:
    """Start the worker's floors at the end of its warm-up (``since``), once it is ready."""
    if w.gpu_floor.since is None:
        if len(gpus) > 1:
            keep_s, bucket_s = w.gpu_floor.keep_s, w.gpu_floor.bucket_s
            w.gpu_floors = {u: FloorSeries(keep_s, bucket_s) for u in gpus}
            w.in_use_floors = {u: FloorSeries(keep_s, bucket_s) for u in gpus}
        for series in w.all_series():
            series.reset(since)
    elif since != w.gpu_floor.since and now < max(since, w.gpu_floor.since):
        # a reload changed the warm-up of a process still in it (the old or the new one):
        # judged from the new end on (regression: the one it was ready with held, and a
        # lengthened warm-up's growth was drained as a leak)
        for series in w.all_series():
            series.reset(since)


def _feed_reports(
    w: _Watch,
    sample: Sample,
    gpus: Sequence[str],
    now: float,
    health: HealthSection,
    judge: bool,
) -> tuple[float | None, dict[str, float] | None]:
    """Add the worker's reports (``X_GPU_MEMORY_IN_USE_MB``) to its floors; return their
    fresh sum and, for a worker on several GPUs, what each GPU's processes report (None: a
    reporter is on none or several of them, as far as NVML's process lists tell)."""
    # Reporters send only changes (and a reminder now and then): hold the last figure, of the
    # processes that are still there (checked at each judgement: a replaced rank's memory is
    # gone with it, and an exited rank stays in the tree as a zombie a while).
    if judge:
        for gone in [p for p in w.in_use_by_pid if not procfs.running(p)]:
            del w.in_use_by_pid[gone]
    in_use = in_use_total(w.in_use_by_pid, now, health.leak_window_s)
    if in_use is not None:
        w.in_use_floor.add(now, in_use)
    in_use_by_gpu = None
    if w.in_use_floors:
        _place_reporters(w, sample, gpus)
        in_use_by_gpu = in_use_on_gpus(w.in_use_by_pid, w.in_use_on, now, health.leak_window_s)
        for u, series in w.in_use_floors.items():
            series.add(now, None if in_use_by_gpu is None else in_use_by_gpu.get(u))
    return in_use, in_use_by_gpu


def _place_reporters(w: _Watch, sample: Sample, gpus: Sequence[str]) -> None:
    """Note on which of its ``gpus`` each reporting process of a worker is, as the sample's
    process lists show it (learnt only from a sample that lists every one of its GPUs: a
    process missing from a list not read might be there)."""
    for gone in [p for p in w.in_use_on if p not in w.in_use_by_pid]:
        del w.in_use_on[gone]
    lists = [sample.device(u) for u in gpus]
    listed: list[set[int]] = []
    for d in lists:
        if d is None or d.processes is None:
            return
        listed.append({p.pid for p in d.processes})
    for pid in w.in_use_by_pid:
        on = {u for u, pids in zip(gpus, listed, strict=True) if pid in pids}
        w.in_use_on.setdefault(pid, set()).update(on)


def _host_available_mb() -> float | None:
    try:
        return float(psutil.virtual_memory().available) / MIB
    except OSError:
        return None


@functools.cache
def _hostname() -> str:
    return socket.gethostname()


def _pid() -> int:
    return os.getpid()


__all__ = ("HealHost", "HealState", "Healer")
