"""A rate limit per key over an injected clock (pure): alerts, and the log lines said at most
once a minute (a trimmed log, dropped post-mortems) whatever layer they come from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RateLimit:
    """At most one alert per key per ``interval_s``; the time is passed in, so this is pure.

    Only allowed alerts start a new interval. Keys whose interval has passed are forgotten, so
    memory is bounded by the keys seen within one interval (amortised O(1) per call).
    """

    interval_s: float = 60.0
    _last: dict[tuple[str, ...], float] = field(default_factory=dict, init=False, repr=False)

    def allow(self, key: tuple[str, ...], now: float) -> bool:
        """True (recording ``now`` for ``key``) unless ``key`` was allowed within the interval."""
        self._prune(now)
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last.pop(key, None)  # re-inserted last: the dict stays ordered by time
        self._last[key] = now
        return True

    @property
    def tracked(self) -> int:
        """How many keys are remembered."""
        return len(self._last)

    def _prune(self, now: float) -> None:
        while self._last:
            oldest = next(iter(self._last))
            if now - self._last[oldest] < self.interval_s:
                return
            del self._last[oldest]
