"""Restart policy: exponential backoff with a cap, a stability reset and a give-up (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """The ``[workers.restart]`` values the decisions need."""

    delay_s: float = 0.0
    stable_s: float = 10.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    burst: int = 5
    interval_s: float = 120.0


@dataclass(frozen=True, slots=True)
class FailureHistory:
    """Recent failed starts: their times (the newest ``burst + 1`` within ``interval_s``) and
    the current streak."""

    times: tuple[float, ...] = ()
    consecutive: int = 0


@dataclass(frozen=True, slots=True)
class FailureVerdict:
    """What to do after a failure: wait ``delay_s`` then retry, or give up (``fatal``)."""

    history: FailureHistory
    fatal: bool
    delay_s: float


def backoff_delay(consecutive: int, policy: RestartPolicy) -> float:
    """Delay before retry number ``consecutive`` (1-based): initial, 2x, 4x, ... capped."""
    if consecutive <= 0:
        return 0.0
    # Cap the exponent first so that a long streak cannot overflow the float.
    exponent = min(consecutive - 1, 64)
    return float(min(policy.backoff_initial_s * (2.0**exponent), policy.backoff_max_s))


def is_stable_run(ready_at: float | None, now: float, policy: RestartPolicy) -> bool:
    """A run counts as stable when the worker was ready for at least ``stable_s``."""
    return ready_at is not None and now - ready_at >= policy.stable_s


def record_failure(history: FailureHistory, now: float, policy: RestartPolicy) -> FailureVerdict:
    """Add a failure at ``now``; more than ``burst`` within ``interval_s`` is fatal.

    ``burst == 0`` never gives up: the delay keeps growing up to ``backoff_max_s``.
    """
    horizon = now - policy.interval_s
    # the newest burst + 1 are all the verdict needs (all of them, copied at each failure,
    # grew without bound with burst = 0 and no backoff delay)
    kept = history.times[max(0, len(history.times) - policy.burst) :]
    times = (*(t for t in kept if t > horizon), now)
    consecutive = history.consecutive + 1
    new = FailureHistory(times=times, consecutive=consecutive)
    fatal = policy.burst > 0 and len(times) > policy.burst
    return FailureVerdict(history=new, fatal=fatal, delay_s=backoff_delay(consecutive, policy))


def record_stable_exit(history: FailureHistory) -> FailureHistory:
    """A stable run resets the backoff streak (the failure window keeps its own horizon)."""
    return FailureHistory(times=history.times, consecutive=0)


#: An HTTP health URL is asked every this many seconds at first (a server that loads in
#: seconds is seen ready at once) ...
READY_POLL_FIRST_S = 0.2
#: ... and less often the longer it loads, down to once a second (a model that loads for
#: minutes: 64 such workers asked every 0.2 s were 320 requests a second, a quarter of the
#: supervisor's core, for readiness that a second's delay does not hurt).
READY_POLL_LAST_S = 1.0
#: How long the pause takes to grow from the first to the last (linearly in the time probed).
READY_POLL_RAMP_S = 30.0
#: In this many last seconds before ``start_timeout_s`` runs out, the probes come every
#: ``READY_POLL_FIRST_S`` again: a server ready in the last second is seen before it is
#: killed for not being ready (with a pause of a second, a probe due just after the deadline
#: never came).
READY_POLL_FINAL_S = 2.0


def ready_poll_s(probing_for_s: float, left_s: float = math.inf) -> float:
    """The pause before the next readiness probe of a worker that has been asked for
    ``probing_for_s`` seconds without a 2xx and has ``left_s`` seconds left of its
    ``start_timeout_s``."""
    if left_s <= READY_POLL_FINAL_S:
        return READY_POLL_FIRST_S
    grown = READY_POLL_LAST_S * probing_for_s / READY_POLL_RAMP_S
    return min(READY_POLL_LAST_S, max(READY_POLL_FIRST_S, grown), left_s - READY_POLL_FINAL_S)
