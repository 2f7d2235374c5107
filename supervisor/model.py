"""Shared vocabulary: worker states and their transition table, launch specs, exit records.

Stdlib only, no I/O. Everything here is immutable or a plain value.
"""

from __future__ import annotations

import enum
import math
import re
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from supervisor.errors import IllegalTransition


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None, in mappings, lists and tuples too
    (strict JSON has no such numbers: a document must never fail to encode because a figure
    read somewhere was one)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class WorkerState(enum.StrEnum):
    """Lifecycle states of one worker (DESIGN.md section 5)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FATAL = "fatal"


S = WorkerState

#: Every transition the lifecycle allows; ``transition()`` enforces it.
ALLOWED: Mapping[WorkerState, frozenset[WorkerState]] = {
    # operator/initial start
    S.STOPPED: frozenset({S.STARTING}),
    # ready signal, start timeout/operator stop (-> stopping), exit (-> backoff or fatal)
    # (stopped before its process was spawned: waiting for the GPU-release barrier)
    S.STARTING: frozenset({S.READY, S.STOPPING, S.BACKOFF, S.FATAL, S.STOPPED}),
    # drain, stop/restart/hang (-> stopping), exit (-> backoff or fatal)
    S.READY: frozenset({S.DRAINING, S.STOPPING, S.BACKOFF, S.FATAL}),
    # drain timeout (-> stopping), exit during drain (-> restart, stay stopped, or a failure)
    S.DRAINING: frozenset({S.STOPPING, S.STARTING, S.STOPPED, S.BACKOFF, S.FATAL}),
    # exit after a stop: restart now, stay stopped, or wait/give up when it counted as a failure
    S.STOPPING: frozenset({S.STARTING, S.STOPPED, S.BACKOFF, S.FATAL}),
    # delay elapsed (-> starting), operator stop
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED}),
    # only an operator start (or a reload) clears fatal
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
}

#: States in which the worker has a live process.
RUNNING_STATES: frozenset[WorkerState] = frozenset({S.STARTING, S.READY, S.DRAINING, S.STOPPING})


def transition(current: WorkerState, target: WorkerState) -> WorkerState:
    """Return ``target`` if the table allows ``current -> target``, else raise."""
    if target not in ALLOWED[current]:
        raise IllegalTransition(f"illegal transition {current.value} -> {target.value}")
    return target


class ExitReason(enum.StrEnum):
    """Why a worker process ended (the post-mortem ``reason`` vocabulary of DESIGN.md section 8)."""

    EXIT = "exit"
    SIGNAL = "signal"
    HANG = "hang"
    START_TIMEOUT = "start_timeout"
    DRAIN = "drain"
    STOP = "stop"
    RESTART = "restart"
    RELOAD = "reload"
    SPAWN_FAILED = "spawn_failed"
    SHUTDOWN = "shutdown"
    # healing actions (self-healing): the process was stopped because of
    LEAK = "leak"
    GPU_MEMORY_LIMIT = "gpu_memory_limit"
    HOST_MEMORY_LIMIT = "host_memory_limit"
    THERMAL = "thermal"  # migrated off a hot GPU
    XID = "xid"
    GPU_LOST = "gpu_lost"
    ROW_REMAP_FAILURE = "row_remap_failure"  # moved off a GPU whose row remapper failed
    RECOVERY_ACTION = "recovery_action"  # moved off a GPU the driver says needs a reset
    LOG_PATTERN = "log_pattern"  # a sticky-error line in its output
    # a scheduled recycle (``health.max_age_s``): taken like a healing drain, but no death
    MAX_AGE = "max_age"


#: Exits caused by a healing action: each gets a post-mortem with the action's evidence.
HEALING_REASONS = frozenset(
    {
        ExitReason.LEAK,
        ExitReason.GPU_MEMORY_LIMIT,
        ExitReason.HOST_MEMORY_LIMIT,
        ExitReason.THERMAL,
        ExitReason.XID,
        ExitReason.GPU_LOST,
        ExitReason.ROW_REMAP_FAILURE,
        ExitReason.RECOVERY_ACTION,
        ExitReason.LOG_PATTERN,
    }
)

#: Reasons of the restarts and drains the healer posts: one that finds the worker at rest
#: (stopped, fatal, in backoff) or being stopped for good does nothing.
HEALER_REASONS = HEALING_REASONS | {ExitReason.MAX_AGE}


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """A decoded wait status: exactly one of ``code`` and ``signal`` is set; ``core_dumped``:
    the signal left a core dump (``WCOREDUMP``)."""

    code: int | None
    signal: int | None
    core_dumped: bool = False

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        """Decode a raw ``waitpid`` status word (exits and signals only)."""
        if status & 0x7F == 0:
            return cls(code=(status >> 8) & 0xFF, signal=None)
        return cls(code=None, signal=status & 0x7F, core_dumped=bool(status & 0x80))

    @property
    def signal_name(self) -> str | None:
        """``SIGKILL`` and so on, or None for a plain exit."""
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"SIG{self.signal}"

    def describe(self) -> str:
        """``exit code 3``, ``killed by SIGKILL`` or ``killed by SIGSEGV (core dumped)``."""
        if self.signal is not None:
            return f"killed by {self.signal_name}" + (" (core dumped)" if self.core_dumped else "")
        return f"exit code {self.code}"


@dataclass(frozen=True, slots=True)
class LastExit:
    """What the API calls ``last_exit``: code, signal, reason and wall-clock time."""

    code: int | None
    signal: int | None
    reason: str
    at: float  # wall-clock seconds since the epoch


@dataclass(frozen=True, slots=True)
class Account:
    """Who a group's workers run as (``[[workers]] user``), from the user database."""

    user: str  # as configured
    name: str  # the user's name (its number where the database has none)
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, the primary one included
    home: str
    shell: str
    switch: bool  # the supervisor runs as someone else: the worker changes credentials

    def environ(self) -> dict[str, str]:
        """What a login gives (systemd's ``User=`` too): ``HOME``, ``USER``, ``LOGNAME``,
        ``SHELL``; the group's ``env`` may still set them."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell}


@dataclass(frozen=True, slots=True)
class Liveness:
    """``[workers.health] liveness_url``: asked while the worker is ready."""

    url: str
    interval_s: float
    timeout_s: float
    failures: int


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything needed to start one worker process; computed by ``plan``."""

    name: str
    group: str
    index: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    port: int | None
    gpus: tuple[str, ...] | None  # None: CUDA_VISIBLE_DEVICES left unset
    ready_url: str | None  # set when readiness is an HTTP health URL
    notify: bool  # readiness by sd_notify READY=1
    watchdog_s: float
    cwd: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)
    #: ``[[workers]] user``: who it runs as (None: as the supervisor); a string says why that
    #: user cannot be had (spawning fails with it, never runs as the supervisor's user instead)
    account: Account | str | None = None
    #: ``[workers.limits]``: ``(name, soft, hard)`` set before the program runs (None: unlimited)
    limits: tuple[tuple[str, int | None, int | None], ...] = ()
    #: ``cpu_affinity``: the CPUs it is pinned to before the program runs (None: inherited)
    cpus: tuple[int, ...] | None = None
    #: ``health.liveness_url``: what the supervisor asks while the worker is ready (None: off);
    #: not part of what is launched (a reload that changes it applies to the running process)
    liveness: Liveness | None = field(default=None, compare=False)


# --- GPUs ----------------------------------------------------------------------------------

#: NVML clock-event reason bits (same values as the deprecated "throttle reasons").
CLOCK_EVENT_REASONS: Mapping[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


#: XID classes (NVML.md section 2). Worker-fatal: the GPU stays usable, the worker's CUDA
#: context does not (restart the workers on it). Device-fatal: the GPU needs a reset (quarantine
#: it, move its workers). Any other XID is informational: counted only.
WORKER_FATAL_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 94)
DEVICE_FATAL_XIDS: tuple[int, ...] = (46, 48, 62, 64, 74, 79, 95, 109, 119, 120, 140, 143)


def clock_event_names(mask: int | None) -> tuple[str, ...] | None:
    """Names of the bits set in an NVML clock-event mask (None stays None)."""
    if mask is None:
        return None
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return tuple(names)


#: The most CPUs a CPU list may name (Linux's NR_CPUS is at most 8192).
MAX_CPUS = 8192


_CPU_RANGE = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?", re.ASCII)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """A Linux CPU list (``"0-7,16-23"``, as ``/sys/.../local_cpulist``, ``taskset -c`` and
    cpusets write it) as sorted CPU numbers; ``ValueError`` saying what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        # ASCII digits only: int() would take "1_0" and other scripts' digits
        found = _CPU_RANGE.fullmatch(part)
        if found is None:
            raise ValueError(f"{part!r} is not a CPU number or a range such as 0-7")
        lo = int(found[1])
        hi = int(found[2]) if found[2] is not None else lo
        if not 0 <= lo <= hi < MAX_CPUS:
            raise ValueError(f"{part!r}: CPUs are numbered 0 to {MAX_CPUS - 1}, low to high")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """CPU numbers as a Linux CPU list: ``(0, 1, 2, 3, 8)`` -> ``"0-3,8"``."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """What does not change while the supervisor runs: read once per device."""

    index: int
    uuid: str
    name: str
    memory_total_mb: float | None = None
    #: the CPUs close to the GPU (its NUMA node's), None where the backend cannot tell
    cpus: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process holding memory on a device; ``used_mb`` is None when NVML cannot tell."""

    pid: int
    used_mb: float | None


#: NVML's GPU recovery actions (``nvmlDeviceGpuRecoveryAction_t``, field
#: ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``): what the driver says a GPU needs after an error.
RECOVERY_ACTIONS: Mapping[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}


def recovery_action_name(code: int | None) -> str | None:
    """The name of a recovery action code (``code_<n>`` for one this version does not know)."""
    if code is None:
        return None
    return RECOVERY_ACTIONS.get(code, f"code_{code}")


@dataclass(frozen=True, slots=True)
class RemappedRows:
    """A GPU's row remapper (Ampere and later, ``nvmlDeviceGetRemappedRows``): rows of its
    memory remapped for correctable and uncorrectable errors, a remap waiting for the GPU's
    next reset (``pending``), and whether a remap failed (``failure``: the GPU has a bad row it
    could not replace: NVIDIA's "reset, then replace the GPU if it comes again")."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One device at one tick. Every field the device does not report is None, never 0."""

    index: int
    uuid: str
    name: str
    healthy: bool = True
    error: str | None = None
    memory_total_mb: float | None = None
    memory_used_mb: float | None = None
    memory_free_mb: float | None = None
    utilization_percent: float | None = None
    temperature_c: float | None = None
    temperature_slowdown_c: float | None = None
    temperature_shutdown_c: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    encoder_percent: float | None = None
    decoder_percent: float | None = None
    clocks_event_reasons: int | None = None
    #: the driver's GPU recovery action (``RECOVERY_ACTIONS``; None: not reported, before R550)
    recovery_action: int | None = None
    #: volatile ECC error counts (since the driver loaded), None without ECC (off, GeForce)
    ecc_errors_corrected: int | None = None
    ecc_errors_uncorrected: int | None = None
    remapped_rows: RemappedRows | None = None  # None: no row remapper (pre-Ampere, MIG)
    #: pages retired for ECC errors wait for a reset or driver reload (before Ampere: page
    #: retirement; None where the GPU has none, Ampere and later included)
    retired_pages_pending: bool | None = None
    processes: tuple[GpuProcess, ...] | None = None  # None: the process list is unavailable
    cpus: tuple[int, ...] | None = None  # the CPUs close to it (DeviceIdentity.cpus)
    #: unhealthy only because its handle or UUID answered a passing error (UNKNOWN, TIMEOUT:
    #: not a lost GPU) when the backend opened: a GPU seen before is not lost for it
    unidentified: bool = False

    @property
    def throttle_reasons(self) -> tuple[str, ...] | None:
        """Clock-event reasons by name, ``gpu_idle`` left out."""
        names = clock_event_names(self.clocks_event_reasons)
        return None if names is None else tuple(n for n in names if n != "gpu_idle")


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An XID error reported for a device."""

    gpu_index: int
    uuid: str | None
    xid: int
    at: float  # monotonic seconds when it was read


@dataclass(frozen=True, slots=True)
class WorkerUsage:
    """One worker's resources at one tick (its whole process tree)."""

    name: str
    pids: tuple[int, ...]
    gpu_memory_mb: float | None
    gpu_memory_by_gpu: Mapping[str, float]
    attribution: str  # "pid" | "device" | "unavailable" | "none"
    host_rss_mb: float | None
    cpu_percent: float | None
    #: the tree's PSS, read where its RSS (pages shared by forked processes counted once per
    #: process) is over the host budget; None: not read, the RSS stands
    host_pss_mb: float | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    """Everything sampled at one tick: immutable, stamped with the monotonic clock."""

    t: float
    devices: tuple[DeviceSample, ...]
    workers: Mapping[str, WorkerUsage]
    nvml_available: bool
    error: str | None = None
    duration_s: float = 0.0
    #: when ``/proc`` was read for the workers' host figures (it is read less often than the
    #: GPUs: samples in between repeat that reading); None: unknown, a reading per sample
    host_at: float | None = None

    def device(self, uuid: str) -> DeviceSample | None:
        """The device with this UUID, if sampled."""
        return next((d for d in self.devices if d.uuid == uuid), None)
