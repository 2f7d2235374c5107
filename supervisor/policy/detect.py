"""Detectors (DESIGN.md section 2): pure judgements over sampled values and an injected time.

Nothing here reads a clock, a file or a process: callers pass the values and ``now``.

- Leak: the memory *floor* (per-interval minima: caching allocators hold memory in steps and
  release it now and then, so raw samples mostly show the cache, the minima show what is really
  kept) is tracked by :class:`FloorSeries`; :func:`judge_leak` fits a Theil-Sen slope to it over
  the window, and calls it a leak only when the recent half grows too (one step up of the cache
  is not a leak) and the floor grew by a minimum amount.
- Budget: :func:`budget_streak` counts consecutive samples over a limit.
- Thermal: :func:`thermal_step` is a per-GPU state machine with a sustain time and hysteresis.
- XIDs: :func:`xid_class`. Log lines: :func:`match_pattern`.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from supervisor.model import DeviceSample

# --- leak ----------------------------------------------------------------------------------

#: Width of the fine buckets a floor series keeps (seconds); judging merges them further.
FLOOR_BUCKET_S = 5.0
#: A leak needs at least this many coarse floor points, spanning at least this long.
MIN_POINTS = 6
MIN_SPAN_S = 45.0
#: About this many coarse points are fitted (the fine buckets are merged to get them).
TARGET_POINTS = 12
#: The floor must have grown by at least this much over the window (MiB): less is noise or one
#: allocator block.
MIN_GROWTH_MB = 32.0


@dataclass(frozen=True, slots=True)
class LeakSettings:
    """The ``[workers.health]`` leak keys, as values."""

    window_s: float = 600.0
    min_mb_per_min: float = 10.0
    horizon_s: float = 300.0
    min_growth_mb: float = MIN_GROWTH_MB


@dataclass(frozen=True, slots=True)
class LeakVerdict:
    """What the leak detector says about one series now."""

    slope_mb_per_min: float | None  # None: not enough data yet
    suspected: bool
    projected_oom_s: float | None  # time to exhaust the headroom at this slope
    act: bool  # suspected and projected to run out within the horizon
    points: int = 0
    span_s: float = 0.0
    growth_mb: float = 0.0
    recent_mb_per_min: float | None = None

    def evidence(self) -> dict[str, float | int | None]:
        """The figures behind the verdict (for post-mortems, logs and alerts)."""
        return {
            "slope_mb_per_min": _round(self.slope_mb_per_min),
            "recent_slope_mb_per_min": _round(self.recent_mb_per_min),
            "projected_oom_s": _round(self.projected_oom_s),
            "floor_growth_mb": _round(self.growth_mb),
            "window_points": self.points,
            "window_span_s": _round(self.span_s),
        }


NO_VERDICT = LeakVerdict(None, False, None, False)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class FloorSeries:
    """Per-bucket minima of one value over the last ``keep_s`` seconds (bounded memory).

    Only points at or after ``since`` count (the warm-up after readiness); :meth:`reset` starts
    over, e.g. for a new process.
    """

    def __init__(self, keep_s: float, bucket_s: float = FLOOR_BUCKET_S) -> None:
        self.keep_s = keep_s
        self.bucket_s = bucket_s
        self.since: float | None = None
        #: ``(time of the minimum, minimum)`` per bucket, oldest first.
        self._buckets: deque[tuple[int, float, float]] = deque()

    def reset(self, since: float | None) -> None:
        """Forget every point; judge only points at or after ``since`` (None: none yet)."""
        self._buckets.clear()
        self.since = since

    def add(self, t: float, value: float | None) -> None:
        """Take one sample (None values and samples before ``since`` are ignored)."""
        if value is None or self.since is None or t < self.since:
            return
        key = int(t // self.bucket_s)
        if self._buckets and self._buckets[-1][0] == key:
            _, _, v_min = self._buckets[-1]
            if value < v_min:
                self._buckets[-1] = (key, t, value)
        else:
            self._buckets.append((key, t, value))
        while self._buckets and self._buckets[0][1] < t - self.keep_s:
            self._buckets.popleft()

    def points(self) -> list[tuple[float, float]]:
        """``(t, floor)`` per fine bucket, oldest first."""
        return [(t, v) for _, t, v in self._buckets]

    def __len__(self) -> int:
        return len(self._buckets)


def theil_sen(points: Sequence[tuple[float, float]]) -> float | None:
    """The median of the pairwise slopes (units of value per unit of t); None below 2 points."""
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if x2 > x1
    ]
    return statistics.median(slopes) if slopes else None


def coarse_floors(
    points: Sequence[tuple[float, float]], target: int = TARGET_POINTS
) -> list[tuple[float, float]]:
    """Merge fine floor points into about ``target`` equal-width intervals (minimum of each)."""
    if len(points) <= target:
        return list(points)
    start, end = points[0][0], points[-1][0]
    width = (end - start) / target or 1.0
    merged: dict[int, tuple[float, float]] = {}
    for t, v in points:
        key = min(int((t - start) / width), target - 1)
        best = merged.get(key)
        if best is None or v < best[1]:
            merged[key] = (t, v)
    return [merged[k] for k in sorted(merged)]


def judge_leak(
    points: Sequence[tuple[float, float]],
    now: float,
    settings: LeakSettings,
    headroom_mb: float | None,
) -> LeakVerdict:
    """Judge the floor ``points`` (``FloorSeries.points()``) of the last ``window_s`` at ``now``.

    ``headroom_mb``: memory left before the worker's budget or the device's (or host's) total,
    whichever is nearer; None when unknown (then nothing is projected and nothing acted on).
    """
    window = [(t, v) for t, v in points if now - settings.window_s <= t <= now]
    if len(window) < MIN_POINTS or window[-1][0] - window[0][0] < MIN_SPAN_S:
        return NO_VERDICT
    floors = coarse_floors(window)
    if len(floors) < MIN_POINTS:
        return NO_VERDICT
    per_s = theil_sen(floors)
    recent_per_s = theil_sen(floors[len(floors) // 2 :])
    if per_s is None or recent_per_s is None:
        return NO_VERDICT
    slope = per_s * 60.0
    recent = recent_per_s * 60.0
    span = floors[-1][0] - floors[0][0]
    growth = floors[-1][1] - floors[0][1]
    threshold = settings.min_mb_per_min
    suspected = (
        slope >= threshold
        and recent >= threshold / 2
        and growth >= max(settings.min_growth_mb, threshold * span / 60.0 / 2)
    )
    projected: float | None = None
    if headroom_mb is not None and slope > 0:
        projected = max(0.0, headroom_mb) / per_s
    act = suspected and projected is not None and projected <= settings.horizon_s
    return LeakVerdict(
        slope_mb_per_min=slope,
        suspected=suspected,
        projected_oom_s=projected,
        act=act,
        points=len(floors),
        span_s=span,
        growth_mb=growth,
        recent_mb_per_min=recent,
    )


def headroom(
    current_mb: float | None, limit_mb: float | None, free_mb: float | None
) -> float | None:
    """Memory left before ``limit_mb`` (the budget, 0/None: none) or ``free_mb`` runs out."""
    left: list[float] = []
    if limit_mb and current_mb is not None:
        left.append(limit_mb - current_mb)
    if free_mb is not None:
        left.append(free_mb)
    return min(left) if left else None


# --- budgets -------------------------------------------------------------------------------

#: Consecutive samples over a budget before it counts as exceeded.
BUDGET_SAMPLES = 2


def budget_streak(streak: int, value: float | None, limit_mb: float) -> int:
    """The number of consecutive samples over ``limit_mb`` after this one (limit 0: off)."""
    if not limit_mb or value is None:
        return 0
    return streak + 1 if value > limit_mb else 0


# --- thermal / power -----------------------------------------------------------------------

#: Clock-event reasons that mean heat or power trouble (idle and caps set on purpose are not).
THERMAL_REASONS = frozenset(
    {"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown", "hw_power_brake_slowdown"}
)


@dataclass(frozen=True, slots=True)
class ThermalSettings:
    """When a GPU counts as hot (``[gpu]`` thermal keys)."""

    margin_c: float = 5.0  # this close to the slowdown threshold counts as hot
    sustain_s: float = 10.0  # hot for this long before acting
    clear_s: float = 30.0  # cool for this long before restoring
    hysteresis_c: float = 3.0  # cool means this much further below the hot mark


@dataclass(frozen=True, slots=True)
class ThermalTrack:
    """One GPU's thermal state between samples."""

    hot: bool = False  # acted on as hot
    hot_since: float | None = None  # the condition has held since
    cool_since: float | None = None  # the cool condition has held since
    why: str = ""


def hot_reason(d: DeviceSample, s: ThermalSettings) -> str | None:
    """Why this sample counts as hot (None: it does not)."""
    active = sorted(THERMAL_REASONS.intersection(d.throttle_reasons or ()))
    if active:
        return "clock events: " + ", ".join(active)
    if d.temperature_c is not None and d.temperature_slowdown_c is not None:
        mark = d.temperature_slowdown_c - s.margin_c
        if d.temperature_c >= mark:
            return (
                f"temperature {d.temperature_c:g} C within {s.margin_c:g} C of the slowdown "
                f"threshold {d.temperature_slowdown_c:g} C"
            )
    return None


def _cool(d: DeviceSample, s: ThermalSettings) -> bool:
    if THERMAL_REASONS.intersection(d.throttle_reasons or ()):
        return False
    if d.temperature_c is None or d.temperature_slowdown_c is None:
        return True
    return d.temperature_c < d.temperature_slowdown_c - s.margin_c - s.hysteresis_c


ThermalChange = Literal["hot", "cool"] | None


def thermal_step(
    track: ThermalTrack, d: DeviceSample, now: float, s: ThermalSettings
) -> tuple[ThermalTrack, ThermalChange]:
    """Advance one GPU's thermal state with a sample; say when it turns hot or cool."""
    why = hot_reason(d, s)
    if not track.hot:
        if why is None:
            return ThermalTrack(), None
        since = track.hot_since if track.hot_since is not None else now
        if now - since >= s.sustain_s:
            return ThermalTrack(hot=True, hot_since=since, why=why), "hot"
        return ThermalTrack(hot_since=since, why=why), None
    if not _cool(d, s):
        return replace(track, cool_since=None, why=why or track.why), None
    since = track.cool_since if track.cool_since is not None else now
    if now - since >= s.clear_s:
        return ThermalTrack(), "cool"
    return replace(track, cool_since=since), None


# --- XIDs and log lines --------------------------------------------------------------------

#: NVML.md section 2: the GPU stays usable, the worker's CUDA context does not.
WORKER_FATAL_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 94)
#: NVML.md section 2: the GPU needs a reset; quarantine it.
DEVICE_FATAL_XIDS: tuple[int, ...] = (46, 48, 62, 64, 74, 79, 95, 109, 119, 120, 140, 143)

XidClass = Literal["worker", "device", "info"]


def xid_class(xid: int, worker_fatal: Iterable[int], device_fatal: Iterable[int]) -> XidClass:
    """``device`` (quarantine the GPU), ``worker`` (restart its workers) or ``info`` (count)."""
    if xid in set(device_fatal):
        return "device"
    if xid in set(worker_fatal):
        return "worker"
    return "info"


def match_pattern(line: str, patterns: Sequence[str]) -> str | None:
    """The first of ``patterns`` that ``line`` contains (plain substrings, case-sensitive)."""
    return next((p for p in patterns if p and p in line), None)
