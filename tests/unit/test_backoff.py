"""Backoff, stability and give-up (pure, with hypothesis properties)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.policy.backoff import (
    FailureHistory,
    RestartPolicy,
    backoff_delay,
    is_stable_run,
    ready_poll_s,
    record_failure,
)

P = RestartPolicy(backoff_initial_s=1, backoff_max_s=60, burst=5, interval_s=120, stable_s=10)


def test_delays_double_and_cap() -> None:
    assert [backoff_delay(n, P) for n in range(0, 9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]


@given(st.integers(min_value=1, max_value=10_000))
def test_delay_is_bounded_and_monotonic(n: int) -> None:
    assert 0 < backoff_delay(n, P) <= P.backoff_max_s
    assert backoff_delay(n, P) <= backoff_delay(n + 1, P)


def test_more_than_burst_within_interval_is_fatal() -> None:
    h = FailureHistory()
    verdicts = []
    for i in range(6):
        v = record_failure(h, 100.0 + i, P)
        h = v.history
        verdicts.append(v.fatal)
    assert verdicts == [False] * 5 + [True]


def test_old_failures_leave_the_window() -> None:
    h = FailureHistory(times=(0.0, 1.0, 2.0, 3.0, 4.0), consecutive=5)
    v = record_failure(h, 200.0, P)
    assert not v.fatal and v.history.times == (200.0,)


@given(st.lists(st.floats(min_value=0, max_value=1e6), max_size=50))
def test_burst_zero_never_fatal(times: list[float]) -> None:
    policy = RestartPolicy(burst=0)
    h = FailureHistory()
    for t in sorted(times):
        v = record_failure(h, t, policy)
        assert not v.fatal
        h = v.history


@given(st.integers(min_value=0, max_value=8), st.integers(min_value=1, max_value=300))
def test_the_history_keeps_no_more_failures_than_the_verdict_needs(burst: int, n: int) -> None:
    """Regression: every failure within ``interval_s`` was kept and copied at each failure:
    with ``burst = 0`` (never fatal) and no backoff delay, a worker crashing 150 times a
    second held ~18000 times, each failure costing a copy of all of them. The newest
    ``burst + 1`` decide the verdict, and only they are kept; the verdict is unchanged."""
    policy = RestartPolicy(burst=burst, backoff_initial_s=0.0, interval_s=1e9)
    h = FailureHistory()
    fatal_at = None
    for i in range(n):
        v = record_failure(h, float(i), policy)
        assert len(v.history.times) <= burst + 1
        if v.fatal and fatal_at is None:
            fatal_at = i
        h = v.history
    assert fatal_at == (burst if 0 < burst < n else None)


def test_stable_run() -> None:
    assert is_stable_run(100.0, 110.0, P)
    assert not is_stable_run(100.0, 109.9, P)
    assert not is_stable_run(None, 1e9, P)


@pytest.mark.parametrize(
    ("probing_for_s", "pause_s"), [(0, 0.2), (5, 0.2), (6, 0.2), (15, 0.5), (30, 1.0), (600, 1.0)]
)
def test_a_server_that_loads_long_is_asked_for_readiness_less_often(
    probing_for_s: float, pause_s: float
) -> None:
    """Regression: an HTTP health URL was asked every 0.2 s however long the server loaded:
    64 workers loading a model for minutes were 320 requests a second, a quarter of the
    supervisor's core. Every 0.2 s for the first seconds, then less often, once a second from
    30 s on."""
    assert ready_poll_s(probing_for_s) == pytest.approx(pause_s)


@given(st.floats(0, 1e6), st.floats(0, 1e6))
def test_the_readiness_pause_grows_with_the_time_probed_and_stays_bounded(
    a: float, b: float
) -> None:
    lo, hi = sorted((a, b))
    assert 0.2 <= ready_poll_s(lo) <= ready_poll_s(hi) <= 1.0


@pytest.mark.parametrize(
    ("probing_for_s", "left_s", "pause_s"),
    [
        (600, 100, 1.0),
        (600, 2.5, 0.5),
        (600, 2.1, 0.1),
        (600, 2.0, 0.2),
        (600, 0.3, 0.2),
        (0, 1, 0.2),
    ],
)
def test_the_last_seconds_of_start_timeout_are_probed_often_again(
    probing_for_s: float, left_s: float, pause_s: float
) -> None:
    """Regression: a server that loaded long was asked once a second to the end, so one
    ready in the last second of ``start_timeout_s`` was killed unseen (its next probe was due
    after the deadline). In the last 2 s the probes come every 0.2 s again."""
    assert ready_poll_s(probing_for_s, left_s) == pytest.approx(pause_s)


@given(st.floats(0, 1e6), st.floats(0, 1e6))
def test_no_readiness_pause_ends_past_the_final_seconds(
    probing_for_s: float, left_s: float
) -> None:
    pause = ready_poll_s(probing_for_s, left_s)
    assert 0 < pause <= 1.0
    if left_s > 2.0:
        assert left_s - pause >= 2.0 - 1e-9  # the final seconds are reached, not skipped
