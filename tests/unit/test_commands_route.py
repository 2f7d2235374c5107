"""Operator commands that are impossible now (409) and routing choices (pure, table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.api import _gpu_loads
from supervisor.model import DeviceSample, Sample, WorkerState
from supervisor.policy.commands import COMMANDS, Command, group_refusal, refusal
from supervisor.policy.route import (
    Candidate,
    GpuLoad,
    NoneReady,
    NoRoom,
    Routed,
    Verdict,
    choose,
)

S = WorkerState
ALL_STATES = list(WorkerState)

# (command, state, possible)
COMMAND_TABLE: list[tuple[Command, WorkerState, bool]] = [
    ("start", S.STOPPED, True),
    ("start", S.FATAL, True),
    ("start", S.BACKOFF, True),
    ("start", S.STOPPING, True),
    ("start", S.STARTING, False),
    ("start", S.READY, False),
    ("start", S.DRAINING, False),
    ("stop", S.STOPPED, False),
    *[("stop", s, True) for s in ALL_STATES if s is not S.STOPPED],
    *[("restart", s, True) for s in ALL_STATES],
    ("drain", S.READY, True),
    ("drain", S.DRAINING, True),  # healing drains it: it stays stopped after that drain
    *[("drain", s, False) for s in ALL_STATES if s not in (S.READY, S.DRAINING)],
]


@pytest.mark.parametrize(("command", "state", "possible"), COMMAND_TABLE)
def test_command_table(command: Command, state: WorkerState, possible: bool) -> None:
    reason = refusal(command, state)
    assert (reason is None) == possible
    if reason is not None:
        assert state.value in reason


def test_a_worker_about_to_start_without_a_process_has_nothing_to_restart() -> None:
    # the lifecycle ignores a Restart then: the API must not answer 202 for it
    assert refusal("restart", WorkerState.STARTING, has_process=False) == (
        "worker has no process yet: it is about to start"
    )
    assert refusal("restart", WorkerState.STARTING) is None  # loading: restarted
    assert refusal("stop", WorkerState.STARTING, has_process=False) is None


def test_a_worker_drained_to_a_stop_already_is_not_drained_again() -> None:
    reason = refusal("drain", S.DRAINING, stopping=True)
    assert reason == "worker is already draining"


def test_table_covers_every_command_and_state() -> None:
    covered = {(c, s) for c, s, _ in COMMAND_TABLE}
    assert covered == {(c, s) for c in COMMANDS for s in ALL_STATES}


def test_group_refused_only_when_impossible_for_all() -> None:
    assert group_refusal("drain", [S.READY, S.STOPPED]) is None
    reason = group_refusal("drain", [S.STOPPED, S.STARTING])
    assert reason is not None and "every worker" in reason
    assert group_refusal("stop", []) == "group has no workers"


def test_group_refusal_weighs_what_the_worker_form_weighs() -> None:
    """Regression: a group's drain while every worker already drains to a stop, or its restart
    while every worker is about to start without a process, answered 202 and did nothing,
    where the same command on each worker answers 409."""
    reason = group_refusal("drain", [S.DRAINING, S.DRAINING], stopping=[True, True])
    assert reason is not None and "already draining" in reason
    assert group_refusal("drain", [S.DRAINING, S.DRAINING], stopping=[True, False]) is None
    reason = group_refusal("restart", [S.STARTING], has_process=[False])
    assert reason is not None and "no process yet" in reason
    assert group_refusal("restart", [S.STARTING, S.READY], has_process=[False, True]) is None


G0, G1, G2 = "GPU-0", "GPU-1", "GPU-2"


def w(
    name: str, gpus: tuple[str, ...] = (G0,), state: WorkerState = S.READY, **kw: Any
) -> Candidate:
    return Candidate(name=name, port=8000 + int(name[-1]), state=state, gpus=gpus, **kw)


LOADS = {
    G0: GpuLoad(free_mb=1000, utilization_percent=50),
    G1: GpuLoad(free_mb=4000, utilization_percent=90),
    G2: GpuLoad(free_mb=4000, utilization_percent=10),
}

# (case, workers, loads, need_mb, expected)
ROUTE_TABLE: list[tuple[str, list[Candidate], dict[str, GpuLoad], float | None, Verdict]] = [
    (
        "most free memory wins",
        [w("a-0", (G0,)), w("a-1", (G1,))],
        LOADS,
        None,
        Routed("a-1", 8001, G1, 4000),
    ),
    (
        "equal memory: lowest utilization wins",
        [w("a-1", (G1,)), w("a-2", (G2,))],
        LOADS,
        None,
        Routed("a-2", 8002, G2, 4000),
    ),
    (
        "full tie: config order",
        [w("a-2", (G2,)), w("a-3", (G2,))],
        LOADS,
        None,
        Routed("a-2", 8002, G2, 4000),
    ),
    (
        "draining, starting and derated workers are skipped",
        [
            w("a-1", (G1,), S.DRAINING),
            w("a-2", (G2,), derated=True),
            w("a-3", (G1,), S.STARTING),
            w("a-0", (G0,)),
        ],
        LOADS,
        None,
        Routed("a-0", 8000, G0, 1000),
    ),
    (
        "unhealthy GPUs are skipped",
        [w("a-1", (G1,)), w("a-2", (G2,)), w("a-0", (G0,))],
        {**LOADS, G1: GpuLoad(4000, 0, healthy=False), G2: GpuLoad(4000, 0, healthy=False)},
        None,
        Routed("a-0", 8000, G0, 1000),
    ),
    (
        "multi-GPU worker counts its tightest GPU",
        [w("a-1", (G1, G0)), w("a-2", (G2,))],
        LOADS,
        None,
        Routed("a-2", 8002, G2, 4000),
    ),
    (
        "need_mb filters out workers without room",
        [w("a-1", (G1,)), w("a-0", (G0,))],
        LOADS,
        2000,
        Routed("a-1", 8001, G1, 4000),
    ),
    (
        "need_mb fits nowhere: 429",
        [w("a-1", (G1,)), w("a-0", (G0,))],
        LOADS,
        5000,
        NoRoom(5000, 4000),
    ),
    (
        "unknown free memory ranks last but is admitted",
        [w("a-5", ("GPU-unknown",)), w("a-0", (G0,))],
        LOADS,
        None,
        Routed("a-0", 8000, G0, 1000),
    ),
    (
        "unknown free memory is not refused by need_mb",
        [w("a-5", ("GPU-unknown",)), w("a-0", (G0,))],
        LOADS,
        2000,
        Routed("a-5", 8005, "GPU-unknown", None),
    ),
    (
        "worker without GPUs",
        [w("c-0", ())],
        {},
        None,
        Routed("c-0", 8000, None, None),
    ),
]


@pytest.mark.parametrize(
    ("case", "workers", "loads", "need_mb", "expected"),
    ROUTE_TABLE,
    ids=[r[0] for r in ROUTE_TABLE],
)
def test_route_table(
    case: str,
    workers: list[Candidate],
    loads: dict[str, GpuLoad],
    need_mb: float | None,
    expected: Verdict,
) -> None:
    assert choose(workers, loads, need_mb) == expected


@pytest.mark.parametrize(
    ("workers", "words"),
    [
        ([], "no workers"),
        (
            [w("a-0", state=S.STARTING), w("a-1", state=S.DRAINING)],
            "a-0 is starting; a-1 is draining",
        ),
    ],
)
def test_none_ready_says_why(workers: list[Candidate], words: str) -> None:
    verdict = choose(workers, LOADS)
    assert isinstance(verdict, NoneReady)
    assert words in verdict.reason


def test_workers_that_tie_take_turns() -> None:
    """Identical workers on identical GPUs (or with no telemetry) take turns request after
    request; a better one still takes every request. Regression: the first in config order
    took every request until the next sample."""
    tied = [w("a-0", (G1,)), w("a-1", (G1,)), w("a-2", (G0,))]  # a-2: less free memory
    picks = [choose(tied, LOADS, turn=t) for t in range(4)]
    assert [p.name for p in picks if isinstance(p, Routed)] == ["a-0", "a-1", "a-0", "a-1"]
    blind = [w("b-0", ()), w("b-1", ()), w("b-2", ())]  # no GPUs: all tie
    names = [choose(blind, {}, turn=t) for t in range(3)]
    assert [p.name for p in names if isinstance(p, Routed)] == ["b-0", "b-1", "b-2"]
    best = [w("c-0", (G0,)), w("c-2", (G2,))]  # c-2 has more free memory: always it
    assert {choose(best, LOADS, turn=t).name for t in range(3)} == {"c-2"}  # type: ignore[union-attr]


def test_workers_that_nearly_tie_take_turns() -> None:
    """Figures a sample apart that differ by an allocator step tie too (regression: the worker
    with 20 MiB more free memory took every request until the next sample), and among workers
    that tie on memory, utilization decides at the granularity of a few points."""
    loads = {
        G0: GpuLoad(free_mb=40_000, utilization_percent=50),
        G1: GpuLoad(free_mb=39_980, utilization_percent=52),  # a cache step less: ties
        G2: GpuLoad(free_mb=30_000, utilization_percent=0),  # far less free: never
    }
    near = [w("d-0", (G0,)), w("d-1", (G1,)), w("d-2", (G2,))]
    names = [choose(near, loads, turn=t).name for t in range(4)]  # type: ignore[union-attr]
    assert names == ["d-0", "d-1", "d-0", "d-1"]
    # memory ties (within 2 %), utilization does not: the idle one takes every request
    busy = {**loads, G1: GpuLoad(free_mb=39_500, utilization_percent=10)}
    assert {choose(near, busy, turn=t).name for t in range(3)} == {"d-1"}  # type: ignore[union-attr]
    # small GPUs: 256 MiB is the least that ties
    small = {G0: GpuLoad(1000, 0), G1: GpuLoad(800, 0), G2: GpuLoad(700, 0)}
    assert {choose(near, small, turn=t).name for t in range(4)} == {"d-0", "d-1"}  # type: ignore[union-attr]


def test_need_mb_counts_the_headroom_under_the_workers_gpu_budget() -> None:
    """Regression: with ``gpu_memory_limit_mb`` set, ``/route`` judged ``need_mb`` (and ranked,
    and reported ``free_mb``) on the device's free memory alone: a worker 100 MiB under its
    budget on a GPU with 4000 MiB free was sent a request needing 2000 MiB, which took it over
    its budget (``on_over_budget``: restarted, the requests in flight lost). The headroom under
    the budget on each of its GPUs counts now (the budget is per GPU)."""
    near = Candidate("a-0", 8000, S.READY, (G1,), budget_mb=3000, used_mb={G1: 2900})
    roomy = Candidate("a-1", 8001, S.READY, (G2,), budget_mb=3000, used_mb={G2: 500})
    assert choose([near], LOADS, 2000) == NoRoom(2000, 100)
    assert choose([near, roomy], LOADS, 2000) == Routed("a-1", 8001, G2, 2500)
    # the tighter of the budget's headroom and the device's free memory, GPU by GPU
    two = Candidate("a-2", 8002, S.READY, (G0, G1), budget_mb=3000, used_mb={G1: 2500})
    assert choose([two], LOADS) == Routed("a-2", 8002, G1, 500)
    # over its budget already: nothing left, not a negative figure
    over = Candidate("a-3", 8003, S.READY, (G2,), budget_mb=3000, used_mb={G2: 3500})
    assert choose([over], LOADS) == Routed("a-3", 8003, G2, 0)
    # its use unknown (not sampled yet): the device's free memory, as before
    blind = Candidate("a-4", 8004, S.READY, (G2,), budget_mb=3000, used_mb=None)
    assert choose([blind], LOADS) == Routed("a-4", 8004, G2, 4000)


def test_route_does_not_rank_on_the_readings_of_a_hung_sampler() -> None:
    """Regression: while an NVML call hung (``/gpu/status`` and the metrics report no
    telemetry then), ``/route`` went on ranking and admitting on the last readings, minutes
    old: every request to the one worker that had the most free memory then, and ``need_mb``
    refused (429) for as long as the hang lasted on figures that no longer held. Its GPUs'
    figures are unknown now, as with NVML down; an unhealthy GPU stays out of routing."""
    sample = Sample(
        t=1.0,
        devices=(
            DeviceSample(0, G0, "g", memory_free_mb=100.0, utilization_percent=90.0),
            DeviceSample(1, G1, "g", healthy=False, error="GPU is lost"),
        ),
        workers={},
        nvml_available=True,
    )

    class Sampler:
        last = sample
        hung: float | None = None

        def stuck(self) -> float | None:
            return self.hung

    class Rt:
        sampler = Sampler()

    rt: Any = Rt()
    assert _gpu_loads(rt)[G0] == GpuLoad(100.0, 90.0)
    rt.sampler.hung = 12.0
    assert _gpu_loads(rt) == {G0: GpuLoad(None, None), G1: GpuLoad(None, None, healthy=False)}
    assert choose([w("a-0", (G0,))], _gpu_loads(rt), 5000) == Routed("a-0", 8000, G0, None)
