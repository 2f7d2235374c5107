"""Which processes a previous supervisor left behind may be ended (pure).

The previous ``state.json`` lists every worker's main pid and process tree with create times. A
pid that is alive with the *same* create time is the same process: an orphan, ended. A live pid
with another create time was reused by an unrelated process and is never touched.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Create times are kernel ticks (10 ms) since boot: equal within this, or a different process.
CREATE_TIME_TOLERANCE_S = 0.015


@dataclass(frozen=True, slots=True)
class Candidate:
    """A process the previous supervisor recorded."""

    worker: str
    pid: int
    create_time: float
    leader: bool


@dataclass(frozen=True, slots=True)
class Live:
    """A process alive now."""

    pid: int
    create_time: float
    ppid: int


class Verdict(enum.StrEnum):
    """What to do with a candidate."""

    END = "end"  # an orphan of the previous supervisor
    GONE = "gone"  # no longer running
    REUSED = "reused"  # the pid belongs to another process now
    OURS = "ours"  # our own process or child: never touched


def candidates(doc: Mapping[str, Any]) -> list[Candidate]:
    """Every recorded (pid, create time) in a previous ``state.json``; malformed entries skipped."""
    out: list[Candidate] = []
    seen: set[int] = set()
    workers = doc.get("workers")
    if not isinstance(workers, list):
        return out
    for w in workers:
        if not isinstance(w, dict) or not isinstance(w.get("name"), str):
            continue
        name = w["name"]
        entries: list[tuple[object, object, bool]] = [
            (w.get("pid"), w.get("pid_create_time"), True)
        ]
        tree = w.get("tree")
        if isinstance(tree, list):
            entries += [
                (t.get("pid"), t.get("create_time"), False) for t in tree if isinstance(t, dict)
            ]
        for pid, ct, leader in entries:
            if (
                isinstance(pid, int)
                and not isinstance(pid, bool)
                and pid > 1
                and isinstance(ct, int | float)
                and not isinstance(ct, bool)
                and pid not in seen
            ):
                seen.add(pid)
                out.append(Candidate(name, pid, float(ct), leader))
    return out


def marked(
    found: Mapping[int, tuple[str, float, int]], recorded: list[Candidate], own_pid: int
) -> list[Candidate]:
    """Candidates found by the environment marker (``plan.INSTANCE_VAR``) that ``state.json``
    did not record (a daemon that double-forked, a child forked between two reads of the
    trees): ``found`` maps pid -> (worker name, create time, parent pid). Not us, nor a child
    of ours; the rest are judged like the recorded ones (their create time is their own)."""
    known = {c.pid for c in recorded}
    return [
        Candidate(worker or "?", pid, create_time, leader=False)
        for pid, (worker, create_time, ppid) in sorted(found.items())
        if pid not in known and pid != own_pid and ppid != own_pid and pid > 1
    ]


def judge(candidate: Candidate, live: Live | None, own_pid: int) -> Verdict:
    """The verdict for one candidate given what runs under its pid now."""
    if live is None:
        return Verdict.GONE
    if live.pid == own_pid or live.ppid == own_pid:
        return Verdict.OURS
    if abs(live.create_time - candidate.create_time) > CREATE_TIME_TOLERANCE_S:
        return Verdict.REUSED
    return Verdict.END
