"""Which logs of workers no longer configured are removed (pure).

A worker's output goes to ``state_dir/logs/<worker>.log`` and its rotated ``.1`` ...
``.<log_backups>``. A reload that removes a worker (its group removed or renamed, scaled down),
or a restart with a config without it, leaves those files behind: what an operator reads after
a bad deploy, so they are kept, but only up to what the configured workers' logs may hold
together (``budget``). Past it, the files of the worker written least recently go first, all of
one worker's together; the most recently written one is always kept (one worker's logs at most
over the budget: there is none when no worker is configured). A configured worker's are never
candidates, nor, in the caller, a worker that still has a runner.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

#: ``<worker>.log`` or ``<worker>.log.<N>``: a worker's name is its group's then ``-<index>``
#: (config.py's group names); anything else in ``logs/`` is not a log of this layout.
LOG_FILE = re.compile(
    r"(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*-(?:0|[1-9][0-9]*))\.log(?:\.[1-9][0-9]*)?"
)


def worker_of(filename: str) -> str | None:
    """The worker whose log file ``filename`` is (``w-0.log``, ``w-0.log.3``), else None."""
    match = LOG_FILE.fullmatch(filename)
    return match.group("name") if match else None


@dataclass(frozen=True, slots=True)
class WorkerLogs:
    """The log files on disk of one worker."""

    name: str
    newest_mtime: float  # when the most recently written of its files was written
    total_bytes: int  # what its files hold together


def budget(workers: int, log_max_bytes: int, log_backups: int) -> int | None:
    """What the logs of ``workers`` configured workers may hold together; None: no bound
    (``log_max_bytes = 0``: their logs are never rotated, so neither are these removed)."""
    if log_max_bytes <= 0:
        return None
    return max(workers, 0) * (max(log_backups, 0) + 1) * log_max_bytes


def to_remove(
    logs: Iterable[WorkerLogs], budget: int | None, configured: Collection[str]
) -> list[str]:
    """The workers (not in ``configured``) whose log files go, least recently written first,
    so that the rest hold at most ``budget`` bytes, or are the one written last."""
    candidates = sorted(
        (w for w in logs if w.name not in configured),
        key=lambda w: (w.newest_mtime, w.name),
    )
    if budget is None:
        return []
    total = sum(w.total_bytes for w in candidates)
    out: list[str] = []
    for w in candidates[:-1]:  # the most recently written is kept
        if total <= budget:
            break
        out.append(w.name)
        total -= w.total_bytes
    return out
