"""The event journal: recent lifecycle events with increasing sequence numbers (no I/O).

Everything worth telling an operator (state changes, spawns, exits, reclaimed orphans, XIDs,
cordons, reloads) is appended here by the single writer; ``GET /api/v1/events?since=SEQ`` and the
post-mortems read it. A bounded ring: the oldest events fall off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

#: Events kept in memory.
JOURNAL_SIZE = 4096


def rfc3339(wall: float) -> str:
    """``2026-12-03T08:36:44.123Z`` for seconds since the epoch."""
    text = datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Event:
    """One journal entry."""

    seq: int
    at: float  # wall-clock seconds since the epoch
    type: str
    worker: str | None
    fields: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The API's event object: ``seq``, ``at``, ``type``, ``worker``, then the fields."""
        return {
            "seq": self.seq,
            "at": rfc3339(self.at),
            "type": self.type,
            "worker": self.worker,
            **self.fields,
        }


class Journal:
    """A bounded, append-only list of events; ``seq`` starts at 1 and never repeats."""

    def __init__(self, size: int = JOURNAL_SIZE) -> None:
        self._events: deque[Event] = deque(maxlen=size)
        self._seq = 0

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest event (0 when empty)."""
        return self._seq

    def append(self, at: float, type_: str, worker: str | None = None, **fields: Any) -> Event:
        """Record an event; return it."""
        self._seq += 1
        event = Event(self._seq, at, type_, worker, fields)
        self._events.append(event)
        return event

    def since(self, seq: int, limit: int | None = None) -> list[Event]:
        """Events with ``seq`` greater than the given one, oldest first (at most ``limit``)."""
        out = [e for e in self._events if e.seq > seq] if seq > 0 else list(self._events)
        return out if limit is None else out[:limit]

    def for_worker(self, worker: str, limit: int, until: int | None = None) -> list[Event]:
        """The newest ``limit`` events of one worker (up to seq ``until``), oldest first."""
        out: list[Event] = []
        for event in reversed(self._events):
            if until is not None and event.seq > until:
                continue
            if event.worker == worker:
                out.append(event)
                if len(out) >= limit:
                    break
        out.reverse()
        return out
