"""Detectors (supervisor.policy.detect): table-driven cases and hypothesis properties.

The leak detector is fed the way the runtime feeds it: one sample every 0.5 s into a
``FloorSeries(keep_s=600)`` reset to ``since`` (the end of the warm-up), ``judge_leak`` every 5 s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.model import DEVICE_FATAL_XIDS, WORKER_FATAL_XIDS, DeviceSample
from supervisor.policy import detect
from supervisor.policy.detect import (
    BUDGET_SAMPLES,
    FLOOR_BUCKET_S,
    NO_VERDICT,
    THERMAL_REASONS,
    FloorSeries,
    LeakSettings,
    LeakVerdict,
    ThermalSettings,
    ThermalTrack,
    budget_streak,
    coarse_floors,
    headroom,
    hot_reason,
    in_use_on_gpus,
    in_use_total,
    judge_leak,
    match_pattern,
    reports_fresh,
    theil_sen,
    thermal_step,
    xid_class,
)

LEAK = LeakSettings(window_s=600.0, min_mb_per_min=10.0, horizon_s=300.0)
SAMPLE_S = 0.5
JUDGE_S = 5.0
SINCE = 60.0

Trace = Callable[[float], float | None]


def run(
    value: Trace,
    until: float,
    *,
    since: float = SINCE,
    judge_from: float | None = None,
    headroom_mb: float | None = None,
    stop_when_suspected: bool = False,
    settings_: LeakSettings = LEAK,
    bucket_s: float = FLOOR_BUCKET_S,
) -> list[tuple[float, LeakVerdict]]:
    """Sample ``value(t)`` every 0.5 s from 0 to ``until``; judge every 5 s from ``judge_from``."""
    series = FloorSeries(keep_s=settings_.window_s, bucket_s=bucket_s)
    series.reset(since=since)
    verdicts: list[tuple[float, LeakVerdict]] = []
    next_judge = since if judge_from is None else judge_from
    for i in range(int(until / SAMPLE_S) + 1):
        t = i * SAMPLE_S
        series.add(t, value(t))
        if t + 1e-9 >= next_judge:
            next_judge += JUDGE_S
            verdict = judge_leak(series.points(), t, settings_, headroom_mb)
            verdicts.append((t, verdict))
            if stop_when_suspected and verdict.suspected:
                break
    return verdicts


def first_suspected(verdicts: list[tuple[float, LeakVerdict]]) -> float | None:
    return next((t for t, v in verdicts if v.suspected), None)


def ramp(base: float, rate_mb_per_min: float, start: float, quantum: float = 2.0) -> Trace:
    """Flat ``base`` until ``start``, then a leak in ``quantum`` MiB steps (whole MiB, as NVML)."""

    def value(t: float) -> float:
        if t < start:
            return base
        return float(
            round(base + math.floor(rate_mb_per_min * (t - start) / 60 / quantum) * quantum)
        )

    return value


# --- theil_sen / coarse_floors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([], None),
        ([(0.0, 5.0)], None),
        ([(1.0, 5.0), (1.0, 9.0)], None),  # no two distinct x: no slope
        ([(0.0, 0.0), (2.0, 4.0)], 2.0),
        ([(0.0, 10.0), (1.0, 8.0), (2.0, 6.0)], -2.0),
        ([(0.0, 0.0), (1.0, 1.0), (2.0, 2.0), (3.0, 3.0), (4.0, 100.0)], 1.0),  # one outlier
        ([(0.0, 7.0), (1.0, 7.0), (2.0, 7.0)], 0.0),
    ],
)
def test_theil_sen(points: list[tuple[float, float]], expected: float | None) -> None:
    assert theil_sen(points) == expected


def test_coarse_floors_short_input_is_copied() -> None:
    points = [(float(t), float(t)) for t in range(5)]
    out = coarse_floors(points, target=12)
    assert out == points
    assert out is not points


@pytest.mark.parametrize(
    ("n", "target"),
    [(24, 12), (121, 12), (100, 7), (13, 12)],
)
def test_coarse_floors_keeps_the_minimum_of_each_interval(n: int, target: int) -> None:
    # A sawtooth: every interval's minimum is a low tooth.
    points = [(float(t), 100.0 + (t % 3) * 10.0 - t * 0.01) for t in range(n)]
    out = coarse_floors(points, target=target)
    assert len(out) <= target
    assert [t for t, _ in out] == sorted(t for t, _ in out)
    width = (points[-1][0] - points[0][0]) / target
    for t, v in out:
        k = min(int((t - points[0][0]) / width), target - 1)
        members = [p for p in points if min(int((p[0] - points[0][0]) / width), target - 1) == k]
        assert v == min(m[1] for m in members)
    assert out[-1][0] >= points[-1][0] - width  # the last interval is represented


# --- FloorSeries ---------------------------------------------------------------------------


def test_floor_series_ignores_samples_before_since_and_none() -> None:
    s = FloorSeries(keep_s=600.0)
    s.add(1.0, 100.0)  # since is None: nothing yet
    assert len(s) == 0
    s.reset(since=10.0)
    s.add(9.5, 50.0)  # before since
    s.add(10.0, None)  # missing sample
    assert s.points() == []
    s.add(10.0, 70.0)
    assert s.points() == [(10.0, 70.0)]


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        # one bucket [10, 15): the minimum and its time
        ([(10.0, 80.0), (11.0, 60.0), (12.0, 90.0), (14.5, 61.0)], [(11.0, 60.0)]),
        # two buckets
        ([(10.0, 80.0), (14.9, 70.0), (15.0, 90.0), (16.0, 85.0)], [(14.9, 70.0), (16.0, 85.0)]),
        # a spike inside a bucket does not matter, a dip does
        (
            [(20.0, 100.0), (21.0, 900.0), (22.0, 100.0), (25.0, 100.0), (26.0, 10.0)],
            [(20.0, 100.0), (26.0, 10.0)],
        ),
    ],
)
def test_floor_series_keeps_bucket_minima(
    samples: list[tuple[float, float]], expected: list[tuple[float, float]]
) -> None:
    s = FloorSeries(keep_s=600.0, bucket_s=5.0)
    s.reset(since=0.0)
    for t, v in samples:
        s.add(t, v)
    assert s.points() == expected
    assert len(s) == len(expected)


def test_floor_series_prunes_older_than_keep() -> None:
    s = FloorSeries(keep_s=60.0, bucket_s=5.0)
    s.reset(since=0.0)
    for i in range(0, 400):
        s.add(i * 0.5, 1000.0 - i)  # falling: each bucket's minimum is its last sample
    times = [t for t, _ in s.points()]
    now = 399 * 0.5
    assert min(times) >= now - 60.0
    assert len(s) <= 60.0 / 5.0 + 1


def test_floor_series_reset_forgets_and_moves_since() -> None:
    s = FloorSeries(keep_s=600.0)
    s.reset(since=0.0)
    for i in range(20):
        s.add(float(i), 5.0)
    assert len(s) > 0
    s.reset(since=100.0)
    assert len(s) == 0 and s.since == 100.0
    s.add(50.0, 1.0)
    assert len(s) == 0
    s.reset(None)
    s.add(200.0, 1.0)
    assert len(s) == 0


# --- judge_leak ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "points",
    [
        [],
        [(0.0, 100.0)],
        [(float(t), 100.0 + t) for t in range(0, 25, 5)],  # 5 points: too few
        [(float(t), 100.0 + t) for t in range(0, 26, 2)],  # 13 points over 24 s: too short
    ],
)
def test_not_enough_data_is_no_verdict(points: list[tuple[float, float]]) -> None:
    now = points[-1][0] if points else 0.0
    assert judge_leak(points, now, LEAK, 1000.0) is NO_VERDICT
    assert NO_VERDICT.slope_mb_per_min is None and not NO_VERDICT.suspected


def test_points_outside_the_window_are_ignored() -> None:
    old = [(float(t), 1000.0 + 50 * t) for t in range(0, 300, 5)]
    # Everything is older than the window at now = 2000: no verdict at all.
    assert judge_leak(old, 2000.0, LEAK, None) is NO_VERDICT


def test_flat_has_a_verdict_but_no_suspicion() -> None:
    verdicts = run(lambda t: 4000.0, until=SINCE + 700)
    later = [v for t, v in verdicts if t >= SINCE + detect.MIN_SPAN_S + JUDGE_S]
    assert later and all(v.slope_mb_per_min is not None for v in later)
    assert not any(v.suspected or v.act for _, v in verdicts)
    assert later[-1].slope_mb_per_min == 0.0


@pytest.mark.parametrize("step_mb", [20.0, 64.0, 300.0, 2000.0, 6000.0])
@pytest.mark.parametrize("step_at", [SINCE + 30, SINCE + 700])  # young series / full window
def test_one_step_of_the_cache_is_never_suspected(step_mb: float, step_at: float) -> None:
    """Judged from just before the step until it has left the 10-minute window."""
    verdicts = run(
        lambda t: 5000.0 + (step_mb if t >= step_at else 0.0),
        until=step_at + 610,
        judge_from=step_at - JUDGE_S,
    )
    assert first_suspected(verdicts) is None


@pytest.mark.parametrize("steps", [2, 3])
def test_a_few_far_apart_cache_steps_are_not_suspected(steps: int) -> None:
    """Two or three steps of one segment each, minutes apart: at most three segments move."""
    at = [SINCE + 100 + 200 * k for k in range(steps)]
    verdicts = run(
        lambda t: 5000.0 + 20.0 * sum(t >= a for a in at),
        until=at[-1] + 300,
        judge_from=at[0],
    )
    assert first_suspected(verdicts) is None


@pytest.mark.parametrize(
    ("rate", "quantum", "within_s"),
    [(30.0, 2.0, 300.0), (10.0, 2.0, 420.0), (200.0, 20.0, 150.0), (2000.0, 20.0, 150.0)],
)
def test_linear_leak_is_suspected(rate: float, quantum: float, within_s: float) -> None:
    start = SINCE + 300
    verdicts = run(ramp(6000.0, rate, start, quantum), until=start + within_s)
    found = first_suspected(verdicts)
    assert found is not None and found > start
    verdict = next(v for t, v in verdicts if t == found)
    assert verdict.slope_mb_per_min is not None
    assert 0.7 * rate <= verdict.slope_mb_per_min <= 1.3 * rate
    ev = verdict.evidence()
    assert ev["window_points"] == verdict.points and ev["floor_growth_mb"] == verdict.growth_mb


@pytest.mark.parametrize(
    ("headroom_mb", "projected_s", "act"),
    [
        (None, None, False),  # unknown headroom: nothing projected or acted on
        (3000.0, 3000.0, False),  # 50 minutes away
        (400.0, 400.0, False),  # beyond the 300 s horizon
        (250.0, 250.0, True),
        (0.0, 0.0, True),
        (-50.0, 0.0, True),  # already over: runs out now
    ],
)
def test_projection_and_act_against_the_horizon(
    headroom_mb: float | None, projected_s: float | None, act: bool
) -> None:
    rate = 60.0  # MiB/min = 1 MiB/s: the projection in seconds is the headroom in MiB
    start = SINCE + 100
    verdicts = run(
        ramp(6000.0, rate, start, 1.0),
        until=start + 600,
        judge_from=start + 595,
        headroom_mb=headroom_mb,
    )
    verdict = verdicts[-1][1]
    assert verdict.suspected and verdict.slope_mb_per_min is not None
    assert verdict.slope_mb_per_min == pytest.approx(rate, rel=0.05)
    if projected_s is None:
        assert verdict.projected_oom_s is None
    else:
        assert verdict.projected_oom_s == pytest.approx(projected_s, rel=0.05, abs=1e-9)
        assert verdict.projected_oom_s == pytest.approx(
            max(0.0, headroom_mb or 0.0) / (verdict.slope_mb_per_min / 60.0)
        )
    assert verdict.act is act


def test_act_needs_suspicion() -> None:
    verdicts = run(lambda t: 7000.0, until=SINCE + 600, headroom_mb=0.0)
    assert not any(v.act for _, v in verdicts)


def test_a_point_a_little_older_than_the_last_one_keeps_the_floor_in_time_order() -> None:
    """Regression: an in-use report is stamped with the loop's clock and a sample's copy of it
    with the sample's (a few milliseconds earlier); across a bucket's edge the older one went
    after the newer one, and the detector, which bisects the points by time, read an unsorted
    series. A point older than the last is the last bucket's."""
    series = FloorSeries(keep_s=600.0, bucket_s=5.0)
    series.reset(since=0.0)
    series.add(10.004, 100.0)
    series.add(9.999, 90.0)
    series.add(12.0, 95.0)
    times = [t for t, _ in series.points()]
    assert times == sorted(times)
    assert series.points() == [(10.004, 90.0)]


def test_slow_growth_below_the_threshold_projects_nothing() -> None:
    """Regression: a worker whose floor creeps up slower than ``leak_min_mb_per_min`` (2 MiB/min
    against 10: not a leak) on a GPU its cache all but fills (20 MiB of headroom) was projected
    to run out in 10 minutes: ``worker_projected_oom_seconds`` went under 600 and the
    projected-OOM alert, which says the supervisor acts, fired though it never would. Nothing
    is projected for growth not judged a leak."""
    verdicts = run(ramp(7000.0, 2.0, SINCE, 1.0), until=SINCE + 600, headroom_mb=20.0)
    assert not any(v.suspected or v.act for _, v in verdicts)
    slopes = [v.slope_mb_per_min for _, v in verdicts if v.slope_mb_per_min is not None]
    assert slopes and max(slopes) > 1.0  # the growth is seen, and published as a slope
    assert all(v.projected_oom_s is None for _, v in verdicts)


def test_releases_show_the_floor_a_leak_raises() -> None:
    """A cache released every 90 s (empty_cache): the dips rise with the leak."""
    start = SINCE + 200
    leak = ramp(0.0, 20.0, start, 2.0)

    def value(t: float) -> float:
        cache = 0.0 if (t % 90.0) < 0.5 else 1500.0
        return 6000.0 + cache + (leak(t) or 0.0)

    found = first_suspected(run(value, until=start + 600, stop_when_suspected=True))
    assert found is not None and start < found <= start + 400


def test_cache_refills_between_releases_are_not_a_leak() -> None:
    """Released every 150 s; after each release the cache refills and creeps up by a segment
    a minute: the plateau grows for minutes on end, the dips stay where they are."""

    def value(t: float) -> float:
        since_release = t % 150.0
        if since_release < 0.5:
            return 6000.0
        return 7500.0 + 20.0 * math.floor(since_release / 60.0)

    assert first_suspected(run(value, until=SINCE + 1000, judge_from=SINCE + 300)) is None


def test_longer_window_and_bucket() -> None:
    window = LeakSettings(window_s=1200.0, min_mb_per_min=10.0, horizon_s=300.0)
    start = SINCE + 300
    verdicts = run(
        ramp(3000.0, 40.0, start, 2.0),
        until=start + 700,
        settings_=window,
        bucket_s=FLOOR_BUCKET_S * 2,
        stop_when_suspected=True,
    )
    assert first_suspected(verdicts) is not None


# --- properties ----------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    sd=st.floats(0.0, 10.0),
    base=st.floats(300.0, 70000.0),
    spike_every=st.one_of(st.none(), st.floats(20.0, 300.0)),
    spike_max=st.floats(20.0, 1500.0),
    missing=st.floats(0.0, 0.05),
)
def test_flat_with_noise_and_spikes_is_never_suspected(
    seed: int,
    sd: float,
    base: float,
    spike_every: float | None,
    spike_max: float,
    missing: float,
) -> None:
    """A flat floor, Gaussian noise (sd <= 10 MiB), short spikes (<= 8 s, 20-1500 MiB, on average
    every >= 20 s), missing samples: never suspected over 11 minutes (the window fills at 10)."""
    rng = random.Random(seed)
    spike = {"until": -1.0, "mb": 0.0}

    def value(t: float) -> float | None:
        if spike_every and t >= spike["until"] and rng.random() < SAMPLE_S / spike_every:
            spike["until"] = t + rng.uniform(0.5, 8.0)
            spike["mb"] = rng.uniform(20.0, spike_max)
        v = base + rng.gauss(0.0, sd) + (spike["mb"] if t < spike["until"] else 0.0)
        return None if rng.random() < missing else float(round(v))

    verdicts = run(value, until=SINCE + 660, headroom_mb=1.0)
    assert first_suspected(verdicts) is None
    assert not any(v.act for _, v in verdicts)


def leak_bound_s(rate_mb_per_min: float, settings_: LeakSettings = LEAK) -> float:
    """The longest a noise-free monotonic leak of ``rate`` (>= 2 x the threshold) goes unflagged.

    Once a leak fills a whole scale ``S``, each of the scale's four segments grows by about
    ``rate x S / 4`` (at least 15 MiB at the rates and scales below, above ``RISE_MIN_MB``; a
    noise-free ramp has no noise), every slope is ``rate >= 2 x min_mb_per_min`` (above the 0.8
    and 0.3 fractions required), the segments grow at one pace and there are no dips: only the
    scale's minimum growth can fail. The block levels grow by ``rate x (S - block)`` from the
    first block to the last, and the scale needs ``max(MIN_GROWTH_MB x max(1, SHORT_SCALE x
    window / S), NEED_FRACTION x SLOPE_TOLERANCE x threshold x S / 60)``. For the 600 s window
    and 10 MB/min, the two shortest scales:

    ====== ======================= ========== ===================
    scale  blocks (width)          needs      enough from
    ====== ======================= ========== ===================
    120 s  12 (10 s)               64 MiB     34.9 MB/min
    180 s  12 (15 s)               42.7 MiB   15.5 MB/min (all)
    ====== ======================= ========== ===================

    The bound is that scale plus 15 s: the last block needs its second point (one 5 s floor
    bucket), judging runs every 5 s, and 5 s for the bucket the onset falls in. So: 135 s from
    34.9 MB/min, 195 s from 20 MB/min (2 x the threshold) up.
    """
    window = settings_.window_s
    factor = window / 600.0
    for fraction in sorted(detect.SCALES):
        scale = window * fraction
        per = detect.BLOCKS_PER_SEGMENT
        while per > 1 and scale / (detect.SEGMENTS * per) < detect.MIN_BLOCK_S * factor:
            per -= 1
        width = scale / (detect.SEGMENTS * per)
        need = max(
            settings_.min_growth_mb * max(1.0, detect.SHORT_SCALE * window / scale),
            detect.NEED_FRACTION * detect.SLOPE_TOLERANCE * settings_.min_mb_per_min * scale / 60.0,
        )
        if rate_mb_per_min * (scale - width) / 60.0 >= need:
            return scale + 3 * JUDGE_S
    raise AssertionError("no scale is long enough")


@pytest.mark.parametrize(
    ("rate", "bound"), [(20.0, 195.0), (34.0, 195.0), (35.0, 135.0), (2000.0, 135.0)]
)
def test_leak_bound_table(rate: float, bound: float) -> None:
    assert leak_bound_s(rate) == bound


@settings(max_examples=30, deadline=None)
@given(
    rate=st.floats(2 * LEAK.min_mb_per_min, 2000.0),
    flat_for=st.one_of(st.just(0.0), st.floats(0.0, 900.0)),
    quantum=st.sampled_from([1.0, 2.0]),
    base=st.floats(300.0, 70000.0),
)
def test_monotonic_leak_is_always_suspected_within_the_bound(
    rate: float, flat_for: float, quantum: float, base: float
) -> None:
    """A leak of >= 2 x the threshold, in steps of at most 2 MiB, starting anywhere (right after
    the warm-up or with up to 15 minutes of flat floor before it): suspected by
    :func:`leak_bound_s` after its start."""
    start = SINCE + flat_for
    bound = leak_bound_s(rate)
    verdicts = run(
        ramp(round(base), rate, start, quantum),
        until=start + bound,
        judge_from=start,
        stop_when_suspected=True,
    )
    found = first_suspected(verdicts)
    assert found is not None, f"not suspected within {bound} s"
    assert found >= start


# --- headroom / budgets --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "limit", "free", "expected"),
    [
        (100.0, 0.0, None, None),  # no budget, no device figure
        (100.0, None, None, None),
        (100.0, 1000.0, None, 900.0),
        (100.0, 1000.0, 500.0, 500.0),  # the nearer limit wins
        (100.0, 1000.0, 5000.0, 900.0),
        (None, 1000.0, 500.0, 500.0),  # current unknown: only the device
        (None, 1000.0, None, None),
        (1200.0, 1000.0, 5000.0, -200.0),  # over budget already
        (100.0, 0.0, 300.0, 300.0),  # budget 0 means none
    ],
)
def test_headroom(
    current: float | None, limit: float | None, free: float | None, expected: float | None
) -> None:
    assert headroom(current, limit, free) == expected


@pytest.mark.parametrize(
    ("streak", "value", "limit", "expected"),
    [
        (0, 150.0, 100.0, 1),
        (1, 150.0, 100.0, 2),
        (5, 100.0, 100.0, 0),  # equal is not over
        (5, 50.0, 100.0, 0),
        (3, None, 100.0, 0),  # missing sample breaks the streak
        (3, 500.0, 0.0, 0),  # limit 0: off
    ],
)
def test_budget_streak(streak: int, value: float | None, limit: float, expected: int) -> None:
    assert budget_streak(streak, value, limit) == expected


def test_budget_needs_consecutive_samples() -> None:
    streak = 0
    for v in (150.0, 90.0, 150.0, 150.0):
        streak = budget_streak(streak, v, 100.0)
    assert streak == BUDGET_SAMPLES == 2


# --- thermal -------------------------------------------------------------------------------

TH = ThermalSettings(margin_c=5.0, sustain_s=10.0, clear_s=30.0, hysteresis_c=3.0)


def gpu(
    temp: float | None = 60.0, slowdown: float | None = 90.0, mask: int | None = 0
) -> DeviceSample:
    return DeviceSample(
        index=0,
        uuid="GPU-0",
        name="sim",
        temperature_c=temp,
        temperature_slowdown_c=slowdown,
        clocks_event_reasons=mask,
    )


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        (gpu(60.0), None),
        (gpu(85.0), "temperature 85 C within 5 C of the slowdown threshold 90 C"),
        (gpu(84.9), None),
        (gpu(95.0, None), None),  # no threshold known
        (gpu(None, 90.0), None),
        (gpu(60.0, mask=0x20), "clock events: sw_thermal_slowdown"),
        (gpu(60.0, mask=0x40 | 0x8), "clock events: hw_slowdown, hw_thermal_slowdown"),
        (gpu(60.0, mask=0x1), None),  # idle
        (gpu(60.0, mask=0x4), None),  # a power cap set on purpose
        (gpu(60.0, mask=None), None),
    ],
)
def test_hot_reason(sample: DeviceSample, expected: str | None) -> None:
    assert hot_reason(sample, TH) == expected


def test_thermal_reasons_are_heat_and_power_trouble() -> None:
    assert "gpu_idle" not in THERMAL_REASONS and "sw_power_cap" not in THERMAL_REASONS
    assert "hw_thermal_slowdown" in THERMAL_REASONS


def steps(samples: list[tuple[float, DeviceSample]]) -> list[str | None]:
    track = ThermalTrack()
    changes: list[str | None] = []
    for now, d in samples:
        track, change = thermal_step(track, d, now, TH)
        changes.append(change)
    return changes


def test_hot_only_after_sustain() -> None:
    hot = gpu(88.0)
    assert steps([(0.0, hot), (5.0, hot), (9.9, hot), (10.0, hot), (15.0, hot)]) == [
        None,
        None,
        None,
        "hot",
        None,
    ]


def test_a_cool_sample_before_sustain_restarts_it() -> None:
    hot, cool = gpu(88.0), gpu(60.0)
    assert steps([(0.0, hot), (8.0, cool), (9.0, hot), (15.0, hot), (19.0, hot)]) == [
        None,
        None,
        None,
        None,
        "hot",
    ]


def test_hysteresis_and_clear() -> None:
    hot = gpu(88.0)
    warm = gpu(83.0)  # below the hot mark (85) but not 3 C further: not cool
    cool = gpu(81.0)  # < 85 - 3
    changes = steps(
        [
            (0.0, hot),
            (10.0, hot),  # hot
            (20.0, warm),
            (40.0, warm),
            (60.0, warm),  # still hot: warm is not cool
            (61.0, cool),
            (80.0, cool),
            (85.0, hot),  # interrupts the clear
            (86.0, cool),
            (100.0, cool),
            (116.0, cool),  # 30 s of cool since 86
        ]
    )
    assert changes == [None, "hot", None, None, None, None, None, None, None, None, "cool"]


def test_clock_events_keep_it_hot_and_name_the_reason() -> None:
    track = ThermalTrack()
    throttled = gpu(60.0, mask=0x40)
    track, _ = thermal_step(track, throttled, 0.0, TH)
    track, change = thermal_step(track, throttled, 10.0, TH)
    assert change == "hot" and track.hot and "hw_thermal_slowdown" in track.why
    track, change = thermal_step(track, throttled, 100.0, TH)
    assert change is None and track.hot and track.cool_since is None


def test_readings_that_vanish_while_hot_are_not_cool() -> None:
    """Regression: a hot GPU whose temperature (or clock-event reasons) NVML stopped giving,
    say for a passing error, counted as cool after ``clear_s`` and its workers were routed
    again; cool must be read, for all of ``clear_s``."""
    hot, cool = gpu(88.0), gpu(60.0)
    blind = gpu(None, 90.0, mask=None)
    no_temperature = gpu(None, 90.0)
    no_clocks = gpu(60.0, mask=None)
    changes = steps(
        [
            (0.0, hot),
            (10.0, hot),  # hot
            (11.0, blind),
            (50.0, blind),  # 39 s without readings: still hot
            (51.0, no_temperature),
            (90.0, no_temperature),  # clocks clean, but it was hot by temperature
            (91.0, no_clocks),
            (130.0, no_clocks),  # temperature cool, clocks unknown
            (131.0, cool),
            (160.0, cool),  # 29 s of cool readings
            (161.0, cool),  # 30 s: cool
        ]
    )
    assert changes == [None, "hot", None, None, None, None, None, None, None, None, "cool"]


def test_a_gpu_without_a_temperature_cools_on_its_clock_events() -> None:
    """A GPU that never reports a temperature (hot by clock events) still clears."""
    throttled, clean = gpu(None, None, mask=0x40), gpu(None, None, mask=0)
    assert steps([(0.0, throttled), (10.0, throttled), (11.0, clean), (41.0, clean)]) == [
        None,
        "hot",
        None,
        "cool",
    ]


def test_a_gap_in_a_gpus_samples_restarts_the_sustain_and_the_clear() -> None:
    """Regression: a GPU read hot once before a gap in its samples (NVML hung or down for
    minutes, the supervisor stopped) and once after it counted as hot all through the gap:
    ``thermal_sustain_s`` held on two readings five minutes apart and its workers were
    derated or moved; and a hot GPU read cool once before the gap and once after was cool
    again at once (its workers routed back), though nothing was read in between. Both
    counts need the GPU read all along: after a gap longer than ``max_gap_s`` they start
    again (a GPU hot already stays hot)."""
    s = replace(TH, max_gap_s=6.0)
    hot, cool = gpu(88.0), gpu(60.0)
    track = ThermalTrack()
    changes: dict[float, str | None] = {}
    timeline = [(0.0, hot)]  # then 5 minutes without a reading
    timeline += [(300.0 + 5 * i, hot) for i in range(3)]  # hot for 10 s: hot at 310
    timeline += [(315.0, cool)]  # then 5 minutes without a reading
    timeline += [(615.0 + 5 * i, cool) for i in range(7)]  # cool for 30 s: cool at 645
    for now, d in timeline:
        track, change = thermal_step(track, d, now, s)
        changes[now] = change
    assert {t: c for t, c in changes.items() if c} == {310.0: "hot", 645.0: "cool"}
    # without a gap, the same readings count as before
    assert steps([(0.0, hot), (5.0, hot), (10.0, hot)]) == [None, None, "hot"]


# --- XIDs and log patterns -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("xid", "worker", "device", "expected"),
    [
        (79, WORKER_FATAL_XIDS, DEVICE_FATAL_XIDS, "device"),
        (48, WORKER_FATAL_XIDS, DEVICE_FATAL_XIDS, "device"),
        (13, WORKER_FATAL_XIDS, DEVICE_FATAL_XIDS, "worker"),
        (43, WORKER_FATAL_XIDS, DEVICE_FATAL_XIDS, "worker"),
        (999, WORKER_FATAL_XIDS, DEVICE_FATAL_XIDS, "info"),
        (13, [13], [13], "device"),  # in both: the device class wins
        (7, (7,), (), "worker"),
        (7, iter([1, 7]), iter([2]), "worker"),  # any iterable
    ],
)
def test_xid_class(xid: int, worker: object, device: object, expected: str) -> None:
    assert xid_class(xid, worker, device) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("line", "patterns", "expected"),
    [
        ("CUDA error: out of memory", ["out of memory", "CUDA error"], "out of memory"),
        ("CUDA error: out of memory", ["CUDA error", "out of memory"], "CUDA error"),
        ("all fine", ["out of memory"], None),
        ("Out Of Memory", ["out of memory"], None),  # case-sensitive
        ("anything", ["", "any"], "any"),  # empty patterns never match
        ("anything", [], None),
    ],
)
def test_match_pattern(line: str, patterns: list[str], expected: str | None) -> None:
    assert match_pattern(line, patterns) == expected


@pytest.mark.parametrize(
    ("last_at", "now", "window_s", "fresh"),
    [
        (None, 100.0, 600.0, False),  # never reported
        (100.0, 100.0, 600.0, True),
        (100.0, 130.0, 600.0, True),  # 30 s for a 600 s window
        (100.0, 130.5, 600.0, False),
        (10.0, 10.6, 12.0, True),  # scaled with a 12 s window: 0.6 s
        (10.0, 10.7, 12.0, False),
    ],
)
def test_reports_stand_for_the_memory_while_fresh(
    last_at: float | None, now: float, window_s: float, fresh: bool
) -> None:
    assert reports_fresh(last_at, now, window_s) is fresh


@pytest.mark.parametrize(
    ("reports", "now", "total"),
    [
        ({}, 100.0, None),  # no process reported
        ({7: (300.0, 99.0)}, 100.0, 300.0),
        ({7: (300.0, 99.0), 8: (200.0, 95.0)}, 100.0, 500.0),  # ranks of one worker add up
        ({7: (300.0, 99.0), 8: (200.0, 69.0)}, 100.0, 300.0),  # 8 went quiet 31 s ago
        ({7: (300.0, 60.0)}, 100.0, None),  # nothing fresh: judged on NVML again
        ({7: (0.0, 100.0)}, 100.0, 0.0),  # holding nothing is a report
    ],
)
def test_in_use_is_the_sum_of_fresh_reports_per_process(
    reports: dict[int, tuple[float, float]], now: float, total: float | None
) -> None:
    assert in_use_total(reports, now, 600.0) == total


@pytest.mark.parametrize(
    ("placed", "by_gpu"),
    [
        ({7: {"A"}, 8: {"B"}, 9: {"B"}}, {"A": 300.0, "B": 250.0}),  # one rank per GPU and more
        ({7: {"A"}, 8: {"B"}}, None),  # 9 reports but is on none of the worker's GPUs (yet)
        ({7: {"A"}, 8: {"B"}, 9: {"A", "B"}}, None),  # 9 on both: nothing says where it grows
        ({7: {"A"}, 8: {"B"}, 9: set()}, None),
    ],
)
def test_in_use_per_gpu_only_where_each_reporter_is_on_one_gpu(
    placed: dict[int, set[str]], by_gpu: dict[str, float] | None
) -> None:
    """Regression: the reports of a worker on several GPUs were only ever summed, though
    NVML's process lists tell on which GPU each rank is; they are per GPU where every fresh
    report's process is on exactly one of the worker's GPUs (a stale one does not count)."""
    reports = {7: (300.0, 99.0), 8: (200.0, 98.0), 9: (50.0, 97.0), 10: (900.0, 10.0)}
    assert in_use_on_gpus(reports, placed, 100.0, 600.0) == by_gpu
    assert in_use_on_gpus({}, placed, 100.0, 600.0) is None


@pytest.mark.parametrize(
    ("ready_at", "max_age_s", "jitter_s", "draw", "due"),
    [
        (None, 3600.0, 0.0, 0.5, None),  # not ready
        (100.0, 0.0, 60.0, 0.5, None),  # off
        (100.0, 3600.0, 0.0, 0.9, 3700.0),
        (100.0, 3600.0, 600.0, 0.5, 4000.0),
        (100.0, 3600.0, 600.0, 0.0, 3700.0),
        (100.0, 3600.0, 600.0, 7.0, 4300.0),  # a draw is a share of the jitter, at most all
    ],
)
def test_max_age_due(
    ready_at: float | None, max_age_s: float, jitter_s: float, draw: float, due: float | None
) -> None:
    assert detect.max_age_due(ready_at, max_age_s, jitter_s, draw) == due
