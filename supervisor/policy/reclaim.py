"""Which processes a previous supervisor left behind may be ended (pure).

The previous ``state.json`` lists every worker's main pid and process tree with create times. A
pid that is alive with the *same* create time is the same process: an orphan, ended. A live pid
with another create time was reused by an unrelated process and is never touched.

Create times are compared as the kernel keeps them, in clock ticks since boot, when the previous
``state.json`` says which boot time it computed them with (``supervisor.boot_time``, and
``boot_id``): a create time in seconds since the epoch is ``btime + ticks / HZ``, and ``btime``
moves whenever the wall clock is stepped (NTP's step at boot, a leap second, ``date -s``), so two
readings of one process differ by the step. Processes recorded in another boot are gone.
Whatever the times say, a live process that carries this ``state_dir``'s marker in its
environment was started by a supervisor of this ``state_dir``: it is ended.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Create times are kernel ticks (10 ms) since boot: equal within this, or a different process.
CREATE_TIME_TOLERANCE_S = 0.015
#: Start times recovered in ticks (from a float create time) are equal within this many ticks.
TICKS_TOLERANCE = 1


@dataclass(frozen=True, slots=True)
class Candidate:
    """A process the previous supervisor recorded."""

    worker: str
    pid: int
    create_time: float
    leader: bool
    start_ticks: int | None = None  # when the record says its boot time: ticks since boot
    other_boot: bool = False  # recorded during another boot: cannot be running now


@dataclass(frozen=True, slots=True)
class Live:
    """A process alive now."""

    pid: int
    create_time: float
    ppid: int
    start_ticks: int | None = None
    marked: bool = False  # carries this state_dir's marker in its environment


class Verdict(enum.StrEnum):
    """What to do with a candidate."""

    END = "end"  # an orphan of the previous supervisor
    GONE = "gone"  # no longer running
    REUSED = "reused"  # the pid belongs to another process now
    OURS = "ours"  # our own process or child: never touched


def _number(value: object) -> float | None:
    """A finite number (a JSON parser takes ``NaN``, ``Infinity`` and ``1e999``), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            number = float(value)
            return number if math.isfinite(number) else None
    return None


def _ticks(create_time: float, btime: float, hz: int) -> int | None:
    """``create_time`` in clock ticks since a boot at ``btime``; None where a malformed record
    gives no finite number (``1e308``: an overflow, not a crash of the start-up)."""
    ticks = (create_time - btime) * hz
    return round(ticks) if math.isfinite(ticks) else None


def candidates(doc: Mapping[str, Any], boot_id: str = "", hz: int = 100) -> list[Candidate]:
    """Every recorded (pid, create time) in a previous ``state.json``; malformed entries skipped.

    ``boot_id``: this boot's (``procfs.boot_id``); ``hz``: clock ticks per second. With the
    record's ``boot_time`` and a matching ``boot_id``, each candidate also gets its start in
    ticks; with another ``boot_id`` every candidate is ``other_boot``.
    """
    out: list[Candidate] = []
    seen: set[int] = set()
    sup = doc.get("supervisor")
    sup = sup if isinstance(sup, dict) else {}
    recorded_boot = sup.get("boot_id")
    other_boot = bool(boot_id and isinstance(recorded_boot, str) and recorded_boot)
    other_boot = other_boot and recorded_boot != boot_id
    btime = _number(sup.get("boot_time"))
    same_boot = bool(boot_id) and recorded_boot == boot_id and btime is not None
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
        for pid, raw, leader in entries:
            ct = _number(raw)
            if (
                isinstance(pid, int)
                and not isinstance(pid, bool)
                and pid > 1
                and ct is not None
                and pid not in seen
            ):
                seen.add(pid)
                ticks = _ticks(ct, btime, hz) if same_boot and btime is not None else None
                out.append(Candidate(name, pid, ct, leader, ticks, other_boot))
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
    if live.marked:  # started by a supervisor of this state_dir, whatever the clocks say
        return Verdict.END
    if candidate.other_boot:
        return Verdict.GONE
    if candidate.start_ticks is not None and live.start_ticks is not None:
        same = abs(live.start_ticks - candidate.start_ticks) <= TICKS_TOLERANCE
    else:
        same = abs(live.create_time - candidate.create_time) <= CREATE_TIME_TOLERANCE_S
    return Verdict.END if same else Verdict.REUSED
