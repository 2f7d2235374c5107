"""Time as a port: ``Clock`` (monotonic ``now`` + ``sleep``), the anyio clock and a fake."""

from __future__ import annotations

import time
from typing import Protocol

import anyio


class Clock(Protocol):
    """Monotonic time for loop code."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wall(self) -> float:
        """Wall-clock seconds since the epoch (records and logs only)."""
        ...


class SystemClock:
    """The real clocks: ``time.monotonic`` and ``time.time``."""

    def now(self) -> float:
        """Monotonic seconds."""
        return time.monotonic()

    def wall(self) -> float:
        """Seconds since the epoch."""
        return time.time()


class AnyioClock(SystemClock):
    """Monotonic time from the running event loop (follows a trio MockClock in tests)."""

    def now(self) -> float:
        """The event loop's clock."""
        return anyio.current_time()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset

    def now(self) -> float:
        """The fake monotonic time."""
        return self._now

    def wall(self) -> float:
        """The fake wall time."""
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        self._now += seconds
