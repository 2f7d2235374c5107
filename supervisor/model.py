"""Shared vocabulary: worker states and their transition table, launch specs, exit records.

Stdlib only, no I/O. Everything here is immutable or a plain value.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.errors import IllegalTransition


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
    S.STARTING: frozenset({S.READY, S.STOPPING, S.BACKOFF, S.FATAL}),
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


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """A decoded wait status: exactly one of ``code`` and ``signal`` is set."""

    code: int | None
    signal: int | None

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        """Decode a raw ``waitpid`` status word (exits and signals only)."""
        if status & 0x7F == 0:
            return cls(code=(status >> 8) & 0xFF, signal=None)
        return cls(code=None, signal=status & 0x7F)

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
        """``exit code 3`` or ``killed by SIGKILL``."""
        if self.signal is not None:
            return f"killed by {self.signal_name}"
        return f"exit code {self.code}"


@dataclass(frozen=True, slots=True)
class LastExit:
    """What the API calls ``last_exit``: code, signal, reason and wall-clock time."""

    code: int | None
    signal: int | None
    reason: str
    at: float  # wall-clock seconds since the epoch


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
