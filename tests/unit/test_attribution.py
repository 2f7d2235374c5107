"""Per-worker GPU memory attribution (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.model import DeviceSample, GpuProcess
from supervisor.policy.attribution import (
    attribute,
    listed_for_suspects,
    sane_processes,
    still_held,
)


def dev(uuid: str, *procs: tuple[int, float | None], total: float = 1000.0) -> DeviceSample:
    return DeviceSample(
        0, uuid, "g", memory_total_mb=total, processes=tuple(GpuProcess(p, m) for p, m in procs)
    )


def test_sums_the_whole_tree_across_gpus() -> None:
    devices = (dev("A", (10, 100.0), (11, 50.0), (99, 7.0)), dev("B", (12, 25.0)))
    got = attribute(
        devices, {"w": frozenset({10, 11, 12})}, {"w": ("A", "B")}, frozenset({10, 11, 12, 99})
    )
    assert got["w"].total_mb == 175.0
    assert got["w"].by_gpu == {"A": 150.0, "B": 25.0}
    assert got["w"].attribution == "pid"


def test_unknown_amounts_are_not_zero() -> None:
    got = attribute((dev("A", (10, None)),), {"w": frozenset({10})}, {"w": ("A",)}, frozenset({10}))
    assert got["w"].total_mb is None
    assert got["w"].attribution == "pid"


def test_one_unknown_amount_makes_the_total_unknown() -> None:
    """Regression: the known part was reported as the exact total (attribution "pid")."""
    got = attribute(
        (dev("A", (10, None), (11, 200.0)), dev("B", (12, 30.0))),
        {"w": frozenset({10, 11, 12})},
        {"w": ("A", "B")},
        frozenset({10, 11, 12}),
    )
    assert (got["w"].total_mb, dict(got["w"].by_gpu), got["w"].attribution) == (None, {}, "pid")


def test_a_gpu_of_the_worker_whose_processes_are_unknown_makes_the_total_unknown() -> None:
    """Regression: a worker on two GPUs whose second GPU's process list failed this tick (an
    NVML error) or is lost was reported with what it held on the first as its whole GPU memory
    (half of it, attribution "pid"); a worker on one GPU is "unavailable" then."""
    listed = dev("A", (10, 300.0))
    unlisted = DeviceSample(1, "B", "g", memory_total_mb=1000.0, processes=None)
    lost = DeviceSample(1, "B", "g", healthy=False, error="GPU is lost")
    for b in (unlisted, lost):
        got = attribute((listed, b), {"w": frozenset({10})}, {"w": ("A", "B")}, frozenset({10}))
        assert (got["w"].total_mb, dict(got["w"].by_gpu), got["w"].attribution) == (
            None,
            {},
            "unavailable",
        )


def test_listed_gpu_without_our_pids_is_zero() -> None:
    got = attribute(
        (dev("A", (99, 5.0)),), {"w": frozenset({10})}, {"w": ("A",)}, frozenset({10, 99})
    )
    assert got["w"].total_mb == 0.0


def test_invisible_pids_on_an_owned_gpu_are_attributed_by_device() -> None:
    # NVML reports host pids we cannot see (container without the host PID namespace).
    got = attribute(
        (dev("A", (4242, 300.0)),), {"w": frozenset({10})}, {"w": ("A",)}, frozenset({10})
    )
    assert got["w"].total_mb == 300.0
    assert got["w"].attribution == "device"


def test_invisible_pids_on_a_shared_gpu_are_unavailable() -> None:
    trees = {"w": frozenset({10}), "v": frozenset({20})}
    got = attribute(
        (dev("A", (4242, 300.0)),), trees, {"w": ("A",), "v": ("A",)}, frozenset({10, 20})
    )
    assert got["w"].total_mb is None
    assert got["w"].attribution == "unavailable"


def test_unlisted_processes_are_unavailable_and_no_gpu_is_none() -> None:
    devices = (DeviceSample(0, "A", "g", processes=None),)
    got = attribute(
        devices, {"w": frozenset({10}), "n": frozenset({20})}, {"w": ("A",), "n": ()}, frozenset()
    )
    assert got["w"].attribution == "unavailable"
    assert got["w"].total_mb is None
    assert got["n"].attribution == "none"


def test_sanity_checks_drop_impossible_values() -> None:
    procs = sane_processes(dev("A", (0, 5.0), (-3, 5.0), (10, 5000.0), (11, -1.0), (12, 10.0)))
    assert procs == (GpuProcess(10, None), GpuProcess(11, None), GpuProcess(12, 10.0))


def test_a_pid_of_a_nested_namespace_is_mapped_through_its_alias() -> None:
    # The worker (our pid 500) runs in a PID namespace of its own, where it is pid 1, and the
    # driver lists it under that pid; pid 1 also exists here (our init), so it is "visible".
    devices = (dev("A", (1, 300.0)), dev("B", (1, 40.0)))
    trees = {"w": frozenset({500}), "v": frozenset({600})}
    assigned = {"w": ("A",), "v": ("B",)}
    got = attribute(devices, trees, assigned, frozenset({1, 500, 600}), {1: 500})
    assert got["w"].total_mb == 300.0
    assert got["w"].attribution == "pid"
    # GPU B is not w's: the alias is not applied there, and v is not credited with pid 1.
    assert got["v"].total_mb == 0.0
    # Without the alias, pid 1 is someone else's process.
    plain = attribute(devices, trees, assigned, frozenset({1, 500, 600}))
    assert plain["w"].total_mb == 0.0


def test_a_pid_that_is_ours_is_not_replaced_by_an_alias() -> None:
    got = attribute(
        (dev("A", (7, 10.0)),),
        {"w": frozenset({7}), "v": frozenset({900})},
        {"w": ("A",), "v": ("A",)},
        frozenset({7, 900}),
        {7: 900},
    )
    assert got["w"].total_mb == 10.0
    assert got["v"].total_mb == 0.0


_amounts = st.one_of(st.none(), st.integers(0, 900).map(float))


@given(
    lists=st.lists(st.lists(st.tuples(st.integers(1, 12), _amounts), max_size=8), max_size=3),
    trees=st.dictionaries(st.sampled_from("abcd"), st.frozensets(st.integers(1, 12), min_size=1)),
)
def test_pid_matches_sum_every_listed_process_of_the_tree(
    lists: list[list[tuple[int, float | None]]], trees: dict[str, frozenset[int]]
) -> None:
    """Whatever the lists and trees (overlapping ones too): a worker with a listed process is
    attributed by pid, the sum of its processes' amounts, unknown if one amount is."""
    devices = tuple(dev(f"G{i}", *procs) for i, procs in enumerate(lists))
    got = attribute(devices, trees, dict.fromkeys(trees), frozenset(range(1, 13)))
    for name, tree in trees.items():
        mine = [(d.uuid, p.used_mb) for d in devices for p in d.processes or () if p.pid in tree]
        if not mine:
            assert got[name].attribution == "none"
            continue
        assert got[name].attribution == "pid"
        if any(m is None for _, m in mine):
            assert got[name].total_mb is None
        else:
            assert got[name].total_mb == sum(m or 0.0 for _, m in mine)
            by: dict[str, float] = {}
            for uuid, m in mine:
                by[uuid] = by.get(uuid, 0.0) + (m or 0.0)
            assert got[name].by_gpu == by


A, B = "GPU-a", "GPU-b"


@pytest.mark.parametrize(
    ("suspect", "listed", "held"),
    [
        # the stuck process let go of GPU A but still holds GPU B (a worker on both): A is
        # released (regression: its pid listed on B kept A suspect too)
        ({A: frozenset({7}), B: frozenset({7})}, {A: frozenset(), B: frozenset({7})}, {B: {7}}),
        # one of two old pids let go
        ({A: frozenset({7, 8})}, {A: frozenset({8, 100})}, {A: {8}}),
        # A's process list is not known this sample (or A is not listed): kept as it was
        ({A: frozenset({7})}, {A: None, B: frozenset()}, {A: {7}}),
        ({A: frozenset({7})}, {B: frozenset({7})}, {A: {7}}),
        # all gone
        ({A: frozenset({7}), B: frozenset({9})}, {A: frozenset(), B: frozenset({1})}, {}),
    ],
)
def test_a_suspect_gpu_waits_only_for_the_old_pids_listed_on_it(
    suspect: dict[str, frozenset[int]],
    listed: dict[str, frozenset[int] | None],
    held: dict[str, set[int]],
) -> None:
    assert still_held(suspect, listed) == {u: frozenset(p) for u, p in held.items()}


def test_two_stuck_namespace_inits_on_two_gpus_keep_both_suspect() -> None:
    """Old processes 7 (GPU A) and 9 (GPU B), each pid 1 of a PID namespace of its own, are
    listed as pid 1 on their GPUs. Looked up together, inner pid 1 is ambiguous and dropped
    (``procfs.inner_pids``); GPU by GPU, each is found. Regression: both GPUs were released
    while their memory was still held. A GPU whose list is unknown is left out (kept)."""

    def inner_of(pids: frozenset[int]) -> dict[int, set[int]]:
        return {1: set(pids)}  # each is pid 1 in its namespace

    suspect = {A: frozenset({7}), B: frozenset({9})}
    devices = [dev(A, (1, 500.0)), dev(B, (1, 300.0)), DeviceSample(2, "C", "g", processes=None)]
    listed = listed_for_suspects(devices, {**suspect, "C": frozenset({4})}, inner_of)
    assert listed == {A: frozenset({1, 7}), B: frozenset({1, 9})}
    assert still_held(suspect, listed) == suspect
    assert still_held({"C": frozenset({4})}, listed) == {"C": frozenset({4})}


def test_two_stuck_namespace_inits_on_one_gpu_keep_it_suspect_while_either_runs() -> None:
    """Old processes 7 and 9 on GPU A, each pid 1 of a PID namespace of its own: NVML lists
    pid 1 there, whose it cannot say. Regression: the ambiguous pid was dropped, and GPU A was
    released while their memory was still held. Both count as held while they run; once 9
    is gone (not among the running ones), 7 alone."""
    suspect = {A: frozenset({7, 9})}
    devices = [dev(A, (1, 800.0))]
    listed = listed_for_suspects(devices, suspect, lambda pids: {1: set(pids)})
    assert still_held(suspect, listed) == suspect
    listed = listed_for_suspects(devices, suspect, lambda pids: {1: {7}})  # 9 gone
    assert still_held(suspect, listed) == {A: frozenset({7})}
