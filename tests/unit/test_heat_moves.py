"""Moves for heat (``on_thermal = "migrate"``) over time: pure, with the clock passed in.

Regression: with GPUs that heat in turn (a hot chassis: GPU 0 hot, the worker moves to GPU 1,
GPU 1 turns hot a minute later, the worker moves back...) a worker ping-ponged between them,
bounded only by the 60 s cooldown of an action: a move went onto a GPU that had been hot a
moment before (or was within the margin already), and the same worker moved again and again.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.policy.heal import heat_blocked, heat_memory_s, heat_move_wait

W = heat_memory_s(10.0, 30.0)


def test_heat_is_remembered_for_two_turns_of_the_detector() -> None:
    """Regression: a GPU cool again for a moment was a target at once."""
    assert heat_memory_s(10.0, 30.0) == 80.0
    assert heat_memory_s(0.3, 0.3) == pytest.approx(1.2)


@pytest.mark.parametrize(
    ("hot_at", "now", "blocked"),
    [
        ({}, 100.0, {}),  # never hot: any GPU will do
        ({"A": 100.0}, 100.0, {"A": 0.0}),  # hot (or within the margin) now
        ({"A": 50.0}, 100.0, {"A": 50.0}),  # hot 50 s ago: not yet
        ({"A": 20.0}, 100.0, {}),  # hot exactly W ago: a target again
        ({"A": 10.0, "B": 90.0}, 100.0, {"B": 10.0}),
    ],
)
def test_a_gpu_hot_within_the_window_is_no_target(
    hot_at: dict[str, float], now: float, blocked: dict[str, float]
) -> None:
    """Regression: a GPU that had been hot (or was within the margin) a moment before took
    the worker moved off another hot GPU."""
    assert heat_blocked(hot_at, now, W) == blocked


@pytest.mark.parametrize(
    ("moved_at", "now", "slowed", "wait"),
    [
        (None, 100.0, False, None),  # never moved for heat: it may
        (90.0, 100.0, False, 70.0),  # moved 10 s ago: waits the rest of the window
        (90.0, 100.0, True, None),  # ... unless its GPU slows its clocks now (worse)
        (20.0, 100.0, False, None),  # moved W ago: it may again
        (30.0, 100.0, False, 10.0),
    ],
)
def test_a_worker_moved_for_heat_is_not_moved_again_within_the_window(
    moved_at: float | None, now: float, slowed: bool, wait: float | None
) -> None:
    """Regression: a worker moved for heat moved again as soon as its new GPU turned hot."""
    got = heat_move_wait(moved_at, now, W, slowed=slowed)
    assert got == (None if wait is None else pytest.approx(wait))


@st.composite
def heat_sequences(draw: st.DrawFn) -> tuple[int, list[tuple[float, int, bool, bool]]]:
    """GPUs that heat in turn: (seconds since the last step, the GPUs hot now as a bitmask,
    whether the heat follows the worker onto its GPU, whether its GPU slows its clocks)."""
    n = draw(st.integers(2, 4))
    steps = draw(
        st.lists(
            st.tuples(
                st.floats(0.5, 60.0),
                st.integers(0, 2**n - 1),
                st.booleans(),
                st.booleans(),
            ),
            max_size=60,
        )
    )
    return n, steps


@settings(max_examples=200, deadline=None)
@given(heat_sequences())
def test_a_worker_makes_few_heat_moves_per_window(
    seq: tuple[int, list[tuple[float, int, bool, bool]]],
) -> None:
    """Under any heat sequence a worker moves at most once per window while its GPUs are
    only near their threshold, and at most once per other GPU per window when they slow
    their clocks (each target must have been cool for a window, the GPU it leaves was hot).
    Regression: GPUs heating in turn moved a worker back and forth at every turn."""
    n, steps = seq
    gpus = [f"G{i}" for i in range(n)]
    on, now = gpus[0], 0.0
    hot_at: dict[str, float] = {}
    moved_at: float | None = None
    moves: list[tuple[float, bool]] = []
    for dt, mask, follows, slowed in steps:
        now += dt
        hot = {on} if follows else {g for i, g in enumerate(gpus) if mask >> i & 1}
        for g in hot:
            hot_at[g] = now
        if on not in hot:
            continue
        if heat_move_wait(moved_at, now, W, slowed=slowed) is not None:
            continue
        blocked = heat_blocked(hot_at, now, W)
        targets = [g for g in gpus if g != on and g not in blocked]
        if targets:
            on, moved_at = targets[0], now
            moves.append((now, slowed))
    for i, (t, _) in enumerate(moves):
        window = [m for m in moves[i:] if m[0] - t < W]
        assert len(window) <= n - 1
        if not any(s for _, s in window[1:]):
            assert len(window) == 1
