"""Which operator commands make sense in which worker state (pure).

The API answers 409 ("impossible now") when ``refusal`` returns a reason, instead of queueing an
intent that the lifecycle would ignore or turn into something the operator did not ask for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from supervisor.model import WorkerState

S = WorkerState

Command = Literal["start", "stop", "restart", "drain"]

COMMANDS: tuple[Command, ...] = ("start", "stop", "restart", "drain")

#: States in which a ``start`` has nothing to do: the worker runs (or is coming up) already.
_RUNNING = frozenset({S.STARTING, S.READY, S.DRAINING})


def refusal(
    command: Command, state: WorkerState, *, stopping: bool = False, has_process: bool = True
) -> str | None:
    """Why ``command`` is impossible for a worker in ``state`` now, or None when it is possible.

    - ``start``: possible when stopped, fatal (clears it), in backoff (starts at once) or stopping
      (starts again once the process is gone); refused while starting, ready or draining.
    - ``stop``: refused only when the worker is stopped already.
    - ``restart``: possible (from stopped or fatal it is a start), but for a worker about to
      start that has no process yet (``has_process`` False: waiting its turn, ``max_starting``,
      or for its GPU's release): there is nothing to restart, it starts as it is.
    - ``drain``: only a ready worker is in routing, so only a ready worker can be drained; or
      one that healing drains already (it stays stopped after that drain). ``stopping``: the
      worker is on its way to a stop for good already (an operator's drain or stop).
    """
    if command == "start" and state in _RUNNING:
        return f"worker is already {state.value}"
    if command == "stop" and state is S.STOPPED:
        return "worker is already stopped"
    if command == "restart" and state is S.STARTING and not has_process:
        return "worker has no process yet: it is about to start"
    if command == "drain" and state is S.DRAINING and stopping:
        return "worker is already draining"
    if command == "drain" and state not in (S.READY, S.DRAINING):
        return f"only a ready worker can be drained (worker is {state.value})"
    return None


def group_refusal(
    command: Command,
    states: Sequence[WorkerState],
    *,
    stopping: Sequence[bool] | None = None,
    has_process: Sequence[bool] | None = None,
) -> str | None:
    """For a whole group: refused only when the command is impossible for every worker (each
    judged as :func:`refusal` judges it: ``stopping`` and ``has_process`` per worker, in the
    order of ``states``; not given: not stopping, with a process)."""
    if not states:
        return "group has no workers"
    stops = stopping if stopping is not None else [False] * len(states)
    procs = has_process if has_process is not None else [True] * len(states)
    reasons = [
        refusal(command, s, stopping=st, has_process=p)
        for s, st, p in zip(states, stops, procs, strict=True)
    ]
    if all(r is not None for r in reasons):
        return f"{command} is impossible for every worker of the group ({reasons[0]})"
    return None
