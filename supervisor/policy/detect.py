"""Detectors (DESIGN.md section 2): pure judgements over sampled values and an injected time.

Nothing here reads a clock, a file or a process: callers pass the values and ``now``.

- Leak: the memory *floor* (per-interval minima: caching allocators hold memory in steps and
  release it now and then, so raw samples mostly show the cache, the minima show what is really
  kept) is tracked by :class:`FloorSeries`; :func:`judge_leak` looks at several time scales of
  the window and calls it a leak only when the floor grew in every quarter of a scale (a few
  steps of the cache are not a leak), by a minimum amount and at the threshold rate; releases
  (dips to the true floor) that stay flat veto what grows between them.
- Budget: :func:`budget_streak` counts consecutive samples over a limit.
- Thermal: :func:`thermal_step` is a per-GPU state machine with a sustain time and hysteresis.
- XIDs: :func:`xid_class`. Log lines: :func:`match_pattern`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from supervisor.model import DeviceSample

# --- leak ----------------------------------------------------------------------------------

#: Width of the fine buckets a floor series keeps (seconds, for a 600 s window; the runtime
#: scales it with the window).
FLOOR_BUCKET_S = 5.0
#: Nothing is judged before the series has this many fine points spanning this long (seconds
#: for a 600 s window, scaled with it).
MIN_POINTS = 6
MIN_SPAN_S = 30.0
#: About this many points :func:`coarse_floors` merges a series into by default.
TARGET_POINTS = 12
#: The floor must have grown by at least this much over a scale (MiB): less is noise or one
#: allocator segment. Short scales need more (see :data:`SHORT_SCALE`).
MIN_GROWTH_MB = 32.0

#: The time scales judged, as fractions of ``window_s``: the leak may have started anywhere in
#: the window, and the shortest scale that it fills answers fastest. None is shorter than two
#: minutes (of a 600 s window): within a minute, a burst of bigger batches adds as much as a
#: fast leak. Steps of a tenth: a staircase of 20 MiB segments every two minutes (10 MB/min in
#: the large pool) fits a 7 or 9 minute scale sooner than an 8 or 10 minute one; steps of a
#: twentieth let fragmentation segments through (docs/benchmarks.md).
SCALES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
#: A scale is cut into this many segments of ``BLOCKS_PER_SEGMENT`` blocks each (blocks at least
#: ``MIN_BLOCK_S`` long, for a 600 s window); every segment must show growth of its own.
SEGMENTS = 4
BLOCKS_PER_SEGMENT = 3
MIN_BLOCK_S = 10.0
#: The fitted slope may be this much below ``min_mb_per_min`` (estimates of a leak at exactly the
#: threshold scatter around it); each segment's own slope must reach ``SEGMENT_SLOPE`` of it.
SLOPE_TOLERANCE = 0.8
SEGMENT_SLOPE = 0.3
#: The slowest segment must grow at least this fraction as fast as the fastest (one big step and
#: some small ones is not a leak).
BALANCE = 0.25
#: Growth needed over a scale: the larger of ``MIN_GROWTH_MB`` x ``SHORT_SCALE x window / scale``
#: (so short scales need fast growth) and ``NEED_FRACTION`` of what the threshold rate gives.
SHORT_SCALE = 0.4
NEED_FRACTION = 0.5
#: Each segment must grow by at least this (MiB), and by ``RISE_NOISE`` x the noise of a point.
RISE_MIN_MB = 8.0
RISE_NOISE = 2.0
#: The noise of a point is estimated from this quantile of the (detrended) differences between
#: points one to three apart; ``NOISE_Q_Z`` is where ``|N(0, 1)|`` has that quantile.
NOISE_QUANTILE = 0.25
NOISE_Q_Z = 0.3186
#: A dip (an allocator release: a point well below both of its neighbourhoods) is at least this
#: deep (MiB), and ``DIP_NOISE`` x the noise.
DIP_MIN_MB = 48.0
DIP_NOISE = 6.0
#: When the dips of a scale are flat (slope below this fraction of the tolerated threshold), the
#: growth between them is the cache refilling, not a leak.
DIP_VETO = 0.5


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
        if self._buckets and t < self._buckets[-1][1]:
            # a little older than the last point (a report stamped by the loop, its copy by
            # the sample): the last bucket's, so the points stay in time order (bisected)
            t = self._buckets[-1][1]
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

    How (``docs/benchmarks.md`` has the figures on synthetic caching-allocator traces):

    1. *Dips* are points well below the points on both sides (an allocator release shows the
       true floor for a moment); the rest is the *plateau* (mostly the allocator's cache).
    2. Every scale of :data:`SCALES` (the last ``scale`` seconds) is cut into
       :data:`SEGMENTS` segments of blocks; a block's level is its second-lowest plateau point
       (one stray low point does not count). A scale suspects a leak when the Theil-Sen slope of
       the block levels reaches ``SLOPE_TOLERANCE x min_mb_per_min``, the levels grew by the
       scale's minimum growth, and *every* segment grew (by more than the noise, at a slope of
       its own, and not far slower than the others). One step of the cache, or two or three,
       moves at most that many segments: it is never enough. Scales under a minute or two need
       faster growth (:data:`SHORT_SCALE`).
    3. Where a scale holds dips, their own staircase can suspect a leak too (the true floor is
       rising), and dips that stay flat veto the plateau: what grows between releases is the
       cache refilling.

    The verdict reports the fastest-growing suspected scale (or the longest scale when nothing
    is suspected); ``act`` needs the projection to the headroom at that slope within
    ``horizon_s``.
    """
    window = [(t, v) for t, v in points if now - settings.window_s <= t <= now]
    factor = settings.window_s / 600.0
    if len(window) < MIN_POINTS or window[-1][0] - window[0][0] < MIN_SPAN_S * factor:
        return NO_VERDICT
    threshold = settings.min_mb_per_min
    values = [v for _, v in window]
    depth = max(DIP_MIN_MB, DIP_NOISE * _noise(values))
    dip = _dips(values, depth)
    plateau = [p for p, d in zip(window, dip, strict=True) if not d]
    dips = [p for p, d in zip(window, dip, strict=True) if d]
    plateau_t = [t for t, _ in plateau]
    dips_t = [t for t, _ in dips]
    rise = max(RISE_MIN_MB, RISE_NOISE * _noise([v for _, v in plateau]))
    min_block = MIN_BLOCK_S * factor
    available = now - window[0][0]
    best: _Scale | None = None
    longest: _Scale | None = None
    partial_done = False
    for fraction in SCALES:
        scale = settings.window_s * fraction
        if scale > available:
            if partial_done:
                continue
            scale, partial_done = available, True  # judge what there is, once
        start = now - scale
        need = max(
            settings.min_growth_mb * max(1.0, SHORT_SCALE * settings.window_s / scale),
            NEED_FRACTION * SLOPE_TOLERANCE * threshold * scale / 60.0,
        )
        shape = _Shape(start, scale, threshold, need, rise, min_block)
        in_scale = dips[bisect.bisect_left(dips_t, start) :]
        on_scale = plateau[bisect.bisect_left(plateau_t, start) :]
        veto = False
        results: list[_Scale] = []
        if len(in_scale) >= 2 and in_scale[-1][0] - in_scale[0][0] >= scale / 3:
            per_s = theil_sen(in_scale) or 0.0
            veto = per_s * 60.0 < DIP_VETO * SLOPE_TOLERANCE * threshold
            on_dips = _staircase(in_scale, shape, SEGMENTS, second=False, adaptive=True)
            if on_dips is not None:
                results.append(on_dips)
        on_plateau = _staircase(on_scale, shape, SEGMENTS)
        if on_plateau is not None:
            if veto:
                on_plateau = replace(on_plateau, suspected=False)
            results.append(on_plateau)
        for result in results:
            longest = longest or result
            if result.suspected and (best is None or result.slope > best.slope):
                best = result
    chosen = best or longest
    if chosen is None:
        return NO_VERDICT
    per_s = chosen.slope / 60.0
    projected: float | None = None
    if best is not None and headroom_mb is not None and per_s > 0:
        # only for growth judged a leak: a projection on a flat trace's noise slope (a worker
        # whose cache fills its GPU: little headroom) fired the projected-OOM alert, which
        # says the supervisor acts, while it never would
        projected = max(0.0, headroom_mb) / per_s
    act = best is not None and projected is not None and projected <= settings.horizon_s
    return LeakVerdict(
        slope_mb_per_min=chosen.slope,
        suspected=best is not None,
        projected_oom_s=projected,
        act=act,
        points=chosen.blocks,
        span_s=chosen.span,
        growth_mb=chosen.growth,
        recent_mb_per_min=chosen.recent,
    )


def urgency(verdict: LeakVerdict) -> tuple[float, bool, float]:
    """Sort key of leak verdicts, most urgent first: the soonest projected to run out, then a
    suspected one, then the fastest growing (a worker's GPUs, or its GPU and host memory)."""
    slope = verdict.slope_mb_per_min
    return (
        math.inf if verdict.projected_oom_s is None else verdict.projected_oom_s,
        not verdict.suspected,
        -slope if slope is not None else math.inf,
    )


@dataclass(frozen=True, slots=True)
class _Shape:
    """What one scale is judged against."""

    start: float
    scale: float
    threshold: float  # min_mb_per_min
    need_mb: float  # growth over the scale
    rise_mb: float  # growth of every segment
    min_block_s: float


@dataclass(frozen=True, slots=True)
class _Scale:
    """One scale's judgement."""

    suspected: bool
    slope: float  # MiB/min
    span: float
    growth: float
    blocks: int
    recent: float  # the last segment's slope, MiB/min


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


def _noise(values: Sequence[float]) -> float:
    """The noise (sd) of one point, from the 10th percentile of detrended lag-1..3 differences.

    The low percentile and the best of three lags keep steps, dips and alternating release
    patterns (most differences large) from inflating it.
    """
    best = math.inf
    for lag in (1, 2, 3):
        if len(values) < lag + 8:
            break
        diffs = [values[i + lag] - values[i] for i in range(len(values) - lag)]
        mid = _median(diffs)
        spread = sorted(abs(d - mid) for d in diffs)
        # |N(0, 2 s^2)| has its NOISE_QUANTILE quantile at NOISE_Q_Z x sqrt(2) x s.
        best = min(best, spread[int(len(spread) * NOISE_QUANTILE)] / (NOISE_Q_Z * math.sqrt(2.0)))
    return 0.0 if best == math.inf else best


def _dips(values: Sequence[float], depth: float) -> list[bool]:
    """Which points are dips: local minima ``depth`` below the higher of two points each side."""
    out = [False] * len(values)
    for i in range(2, len(values) - 2):
        v = values[i]
        out[i] = (
            v <= values[i - 1]
            and v <= values[i + 1]
            and v < max(values[i - 1], values[i - 2]) - depth
            and v < max(values[i + 1], values[i + 2]) - depth
        )
    return out


def _second_lowest(values: Sequence[float]) -> float:
    low = second = math.inf
    for v in values:
        if v < low:
            low, second = v, low
        elif v < second:
            second = v
    return second


def _staircase(
    points: Sequence[tuple[float, float]],
    shape: _Shape,
    segments: int,
    *,
    second: bool = True,
    adaptive: bool = False,
) -> _Scale | None:
    """Judge ``points`` (none before ``shape.start``) as ``segments`` segments of blocks.

    None when a block is empty.

    ``second``: a block's level is its second-lowest point (of three or more), else its lowest.
    ``adaptive``: use fewer blocks per segment until none is empty (sparse points: dips).
    Blocks are at least ``shape.min_block_s`` long where that leaves two a segment or more; with
    one block a segment, every block-to-block step is a segment of its own.
    """
    per = BLOCKS_PER_SEGMENT
    while per > 1 and shape.scale / (segments * per) < shape.min_block_s:
        per -= 1
    while True:
        count = segments * per
        width = shape.scale / count
        groups: list[list[float]] = [[] for _ in range(count)]
        last = count - 1
        for t, v in points:
            k = int((t - shape.start) / width)
            groups[k if k < last else last].append(v)
        if all(groups):
            break
        if not adaptive or per == 1:
            return None
        per -= 1
    levels = [_second_lowest(g) if second and len(g) >= 3 else min(g) for g in groups]
    blocks = [(shape.start + (k + 0.5) * width, v) for k, v in enumerate(levels)]
    per_s = theil_sen(blocks)
    if per_s is None:
        return None
    slope = per_s * 60.0
    growth = levels[-1] - levels[0]
    # The count - 1 block-to-block steps, split into contiguous groups: every step in one segment
    # (one block per segment leaves one step fewer than segments: then a segment per step).
    parts = min(segments, count - 1)
    cuts = [round(j * (count - 1) / parts) for j in range(parts + 1)]
    seg_growth: list[float] = []
    seg_pace: list[float] = []  # growth per block step (segments may hold unequal numbers)
    seg_slope: list[float] = []
    for lo, hi in itertools.pairwise(cuts):
        seg = blocks[lo : hi + 1]
        seg_growth.append(seg[-1][1] - seg[0][1])
        seg_pace.append(seg_growth[-1] / (hi - lo))
        seg_slope.append((theil_sen(seg) or 0.0) * 60.0)
    suspected = (
        slope >= SLOPE_TOLERANCE * shape.threshold
        and growth >= shape.need_mb
        and min(seg_slope) >= SEGMENT_SLOPE * shape.threshold
        and min(seg_growth) >= shape.rise_mb
        and min(seg_pace) >= BALANCE * max(seg_pace)
    )
    return _Scale(suspected, slope, shape.scale, growth, count, seg_slope[-1])


#: A worker's own in-use reports stand for its GPU memory while the last one is at most this old
#: (seconds, for a 600 s window; scaled with it like the floor buckets).
REPORT_FRESH_S = 30.0


def reports_fresh(last_at: float | None, now: float, window_s: float) -> bool:
    """True while a worker's last in-use report (at ``last_at``) is recent enough to judge by."""
    return last_at is not None and now - last_at <= REPORT_FRESH_S * window_s / 600.0


def in_use_total(
    reports: Mapping[int, tuple[float, float]], now: float, window_s: float
) -> float | None:
    """What a worker's processes report in use: the sum of each one's latest report that is
    still fresh (``reports``: pid -> ``(MiB, reported at)``); None when none is."""
    fresh = [mb for mb, at in reports.values() if reports_fresh(at, now, window_s)]
    return sum(fresh) if fresh else None


def in_use_on_gpus(
    reports: Mapping[int, tuple[float, float]],
    placed: Mapping[int, Collection[str]],
    now: float,
    window_s: float,
) -> dict[str, float] | None:
    """What a worker on several GPUs reports in use on each of them: per GPU, the sum of the
    fresh reports of its processes there (``placed``: pid -> the worker's GPUs NVML lists the
    process on). None when a fresh report's process is not on exactly one of them (nothing
    says where its memory is: the total is judged then) or no report is fresh."""
    by_gpu: dict[str, float] = {}
    for pid, (mb, at) in reports.items():
        if not reports_fresh(at, now, window_s):
            continue
        on = placed.get(pid, ())
        if len(on) != 1:
            return None
        (gpu,) = on
        by_gpu[gpu] = by_gpu.get(gpu, 0.0) + mb
    return by_gpu or None


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


def max_age_due(
    ready_at: float | None, max_age_s: float, jitter_s: float, draw: float
) -> float | None:
    """When a worker ready since ``ready_at`` is due for its recycle (``health.max_age_s``):
    ``max_age_s`` after it, plus ``draw`` (in [0, 1), drawn once per process) of
    ``jitter_s``; None when off (0) or not ready."""
    if max_age_s <= 0 or ready_at is None:
        return None
    return ready_at + max_age_s + min(max(draw, 0.0), 1.0) * jitter_s


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
    #: a GPU not read for longer than this (NVML hung or down, the supervisor stopped) starts
    #: both counts again: what held before the gap is not known to have held through it
    max_gap_s: float = math.inf


@dataclass(frozen=True, slots=True)
class ThermalTrack:
    """One GPU's thermal state between samples."""

    hot: bool = False  # acted on as hot
    hot_since: float | None = None  # the condition has held since
    cool_since: float | None = None  # the cool condition has held since
    why: str = ""
    #: the readings the GPU gave while hot (clock-event reasons; temperature and threshold):
    #: it is cool again only on those, a sample without one of them does not count as cool
    clocks_seen: bool = False
    temperature_seen: bool = False
    seen_at: float | None = None  # the last sample of this GPU


def _readings(d: DeviceSample) -> tuple[bool, bool]:
    """Whether the sample has the clock-event reasons, and the temperature with its threshold."""
    return (
        d.clocks_event_reasons is not None,
        d.temperature_c is not None and d.temperature_slowdown_c is not None,
    )


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


def _cool(track: ThermalTrack, d: DeviceSample, s: ThermalSettings) -> bool | None:
    """True: cool; False: not; None: not known (a reading the GPU gave while hot is missing,
    e.g. NVML answered a passing error for it)."""
    if THERMAL_REASONS.intersection(d.throttle_reasons or ()):
        return False
    clocks, temperature = _readings(d)
    if (track.clocks_seen and not clocks) or (track.temperature_seen and not temperature):
        return None
    if d.temperature_c is None or d.temperature_slowdown_c is None:
        return True
    return d.temperature_c < d.temperature_slowdown_c - s.margin_c - s.hysteresis_c


ThermalChange = Literal["hot", "cool"] | None


def thermal_step(
    track: ThermalTrack, d: DeviceSample, now: float, s: ThermalSettings
) -> tuple[ThermalTrack, ThermalChange]:
    """Advance one GPU's thermal state with a sample; say when it turns hot or cool."""
    why = hot_reason(d, s)
    clocks, temperature = _readings(d)
    gap = track.seen_at is not None and now - track.seen_at > s.max_gap_s
    # (regression: one hot reading before a gap and one after were heat sustained all
    # through it, and one cool reading before and after was cool for all of clear_s)
    track = replace(track, seen_at=now, cool_since=None if gap else track.cool_since)
    if not track.hot:
        if why is None:
            return ThermalTrack(seen_at=now), None
        since = track.hot_since if track.hot_since is not None and not gap else now
        if now - since >= s.sustain_s:
            return ThermalTrack(True, since, None, why, clocks, temperature, now), "hot"
        return ThermalTrack(hot_since=since, why=why, seen_at=now), None
    cool = _cool(track, d, s)
    if cool is None:  # cool must be seen for all of clear_s (regression: readings that
        return replace(track, cool_since=None), None  # vanished counted as cool)
    if not cool:
        return replace(
            track,
            cool_since=None,
            why=why or track.why,
            clocks_seen=track.clocks_seen or clocks,
            temperature_seen=track.temperature_seen or temperature,
        ), None
    since = track.cool_since if track.cool_since is not None else now
    if now - since >= s.clear_s:
        return ThermalTrack(seen_at=now), "cool"
    return replace(track, cool_since=since), None


# --- XIDs and log lines --------------------------------------------------------------------


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
