"""Placement (pure): fewest workers, then most free memory, then coolest; budgets; explicit lists."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.config import parse_settings
from supervisor.errors import PlacementError
from supervisor.plan import CORDONED, SUSPECT, GpuSlot, build_plan, covering, place


def groups(*specs: dict[str, Any]) -> Any:
    return parse_settings({"workers": [{"command": ["x"], **s} for s in specs]}).workers


def gpus(n: int = 2, **over: Any) -> list[GpuSlot]:
    return [GpuSlot(i, f"GPU-{i}", 80_000.0, 80_000.0, 40.0, **over) for i in range(n)]


def test_spreads_by_fewest_workers() -> None:
    got = place(groups({"name": "a", "replicas": 3}), gpus(2), 512)
    assert got == {"a-0": ("GPU-0",), "a-1": ("GPU-1",), "a-2": ("GPU-0",)}


def test_ties_go_to_more_free_memory_then_cooler() -> None:
    slots = [GpuSlot(0, "GPU-0", 80e3, 10e3, 30.0), GpuSlot(1, "GPU-1", 80e3, 50e3, 80.0)]
    assert place(groups({"name": "a"}), slots, 0)["a-0"] == ("GPU-1",)
    slots = [GpuSlot(0, "GPU-0", 80e3, 50e3, 70.0), GpuSlot(1, "GPU-1", 80e3, 50e3, 30.0)]
    assert place(groups({"name": "a"}), slots, 0)["a-0"] == ("GPU-1",)


def test_skips_unusable_gpus() -> None:
    slots = [GpuSlot(0, "GPU-0", 80e3, usable=False, why_not="is cordoned"), *gpus(2)[1:]]
    got = place(groups({"name": "a", "replicas": 2}), slots, 0)
    assert set(got.values()) == {("GPU-1",)}


def test_max_workers_per_gpu_is_a_clear_error() -> None:
    with pytest.raises(
        PlacementError,
        match=r"cannot place a-2: needs 1 GPU\(s\), 0 available .*max_workers_per_gpu",
    ):
        place(groups({"name": "a", "replicas": 3, "max_workers_per_gpu": 1}), gpus(2), 0)


def test_gpus_per_worker() -> None:
    got = place(groups({"name": "a", "replicas": 2, "gpus_per_worker": 2}), gpus(4), 0)
    assert got["a-0"] == ("GPU-0", "GPU-1")
    assert got["a-1"] == ("GPU-2", "GPU-3")


def test_budgets_must_fit_under_total_minus_reserve() -> None:
    g = groups({"name": "a", "replicas": 3, "health": {"gpu_memory_limit_mb": 30_000}})
    slots = [GpuSlot(0, "GPU-0", 80_000.0, 80_000.0)]
    with pytest.raises(PlacementError, match="has 19488 MB left for budgets, needs 30000"):
        place(g, slots, 512)


def test_budget_exactly_fits() -> None:
    g = groups({"name": "a", "replicas": 2, "health": {"gpu_memory_limit_mb": 39_744}})
    got = place(g, [GpuSlot(0, "GPU-0", 80_000.0, 80_000.0)], 512)
    assert got == {"a-0": ("GPU-0",), "a-1": ("GPU-0",)}


def test_budgets_fit_beside_the_memory_others_hold() -> None:
    """Regression: budgets were fitted under total - reserve_mb only, whatever processes that
    are no worker of ours held there (another supervisor's workers on the same GPUs): a worker
    with a 30 GB budget went onto a GPU where 60 of 80 GB were held, and died of CUDA OOM at
    every start, while another GPU had room. Memory held by others up to reserve_mb is what the
    reserve is for (counted once)."""
    g = groups({"name": "a", "replicas": 2, "health": {"gpu_memory_limit_mb": 30_000}})
    slots = [
        GpuSlot(0, "GPU-0", 80_000.0, 20_000.0, others_mb=60_000.0),
        GpuSlot(1, "GPU-1", 80_000.0, 80_000.0, others_mb=0.0),
    ]
    assert place(g, slots, 512) == {"a-0": ("GPU-1",), "a-1": ("GPU-1",)}
    with pytest.raises(PlacementError, match="GPU 0 has 20000 MB left for budgets, needs 30000"):
        place(g, slots[:1], 512)
    # others within the reserve: the budgets fit exactly as before
    g = groups({"name": "a", "replicas": 2, "health": {"gpu_memory_limit_mb": 39_744}})
    got = place(g, [GpuSlot(0, "GPU-0", 80_000.0, 79_700.0, others_mb=300.0)], 512)
    assert got == {"a-0": ("GPU-0",), "a-1": ("GPU-0",)}


def test_explicit_lists_resolve_to_uuids() -> None:
    g = groups(
        {"name": "a", "gpus": [1]}, {"name": "b", "gpus": ["GPU-0"]}, {"name": "c", "gpus": "none"}
    )
    got = place(g, gpus(2), 0)
    assert got == {"a-0": ("GPU-1",), "b-0": ("GPU-0",), "c-0": ()}


def test_explicit_unknown_gpu_is_an_error() -> None:
    with pytest.raises(
        PlacementError, match=r"workers\[0\].gpus\[0\]: no GPU with index 7 \(GPUs: 0, 1\)"
    ):
        place(groups({"name": "a", "gpus": [7]}), gpus(2), 0)
    with pytest.raises(PlacementError, match="no GPU with UUID 'GPU-x'"):
        place(groups({"name": "a", "gpus": ["GPU-x"]}), gpus(2), 0)


def test_one_gpu_named_by_index_and_uuid_is_an_error() -> None:
    """Regression: ``[0, "GPU-0"]`` passed (``[0, 0]`` did not), and CUDA_VISIBLE_DEVICES
    listed the GPU twice."""
    with pytest.raises(
        PlacementError, match=r"workers\[0\].gpus\[1\]: 'GPU-0' is the GPU of gpus\[0\] \(0\) again"
    ):
        place(groups({"name": "a", "gpus": [0, "GPU-0"]}), gpus(2), 0)


def test_without_devices_auto_places_nothing_and_lists_pass_through() -> None:
    got = place(groups({"name": "a"}, {"name": "b", "gpus": [3, "GPU-z"]}), [], 0)
    assert got == {"a-0": None, "b-0": ("3", "GPU-z")}


def test_fixed_workers_keep_their_gpus_and_count() -> None:
    g = groups({"name": "a", "replicas": 2})
    got = place(g, gpus(2), 0, fixed={"a-0": ("GPU-1",), "a-1": ("GPU-1",)}, only={"a-1"})
    assert got == {"a-0": ("GPU-1",), "a-1": ("GPU-0",)}


def test_plan_puts_uuids_in_cuda_visible_devices() -> None:
    settings = parse_settings({"workers": [{"name": "a", "command": ["x"], "replicas": 2}]})
    plan = build_plan(settings, {}, None, gpus(2))
    envs = [w.env["CUDA_VISIBLE_DEVICES"] for w in plan.groups[0].workers]
    assert envs == ["GPU-0", "GPU-1"]
    assert plan.warnings == ()


def test_a_worker_on_several_gpus_lists_them_in_index_order() -> None:
    """Regression: a worker on several GPUs got them in the order placement ranked them (the
    most free memory first): GPU 3 then GPU 1 in ``CUDA_VISIBLE_DEVICES``, so its cuda:0 was
    GPU 3, against nvidia-smi's (and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``'s) order that users and
    NCCL's topology expect. The same GPUs are chosen, listed by index."""
    frees = [10_000.0, 60_000.0, 20_000.0, 70_000.0]
    slots = [GpuSlot(i, f"GPU-{i}", 80_000.0, f, 40.0) for i, f in enumerate(frees)]
    settings = parse_settings(
        {"workers": [{"name": "a", "command": ["x"], "replicas": 2, "gpus_per_worker": 2}]}
    )
    assert place(settings.workers, slots, 0) == {
        "a-0": ("GPU-1", "GPU-3"),
        "a-1": ("GPU-0", "GPU-2"),
    }
    plan = build_plan(settings, {}, None, slots)
    envs = [(w.gpus, w.env["CUDA_VISIBLE_DEVICES"]) for w in plan.groups[0].workers]
    assert envs == [(("GPU-1", "GPU-3"), "GPU-1,GPU-3"), (("GPU-0", "GPU-2"), "GPU-0,GPU-2")]


def test_only_a_cordon_lets_a_worker_restart_where_it_was() -> None:
    from supervisor.plan import CORDONED, SUSPECT, GpuSlot, may_restart_in_place

    def slot(uuid: str, why: str = "") -> GpuSlot:
        return GpuSlot(
            index=0, uuid=uuid, total_mb=1000.0, free_mb=1000.0, usable=not why, why_not=why
        )

    slots = [
        slot("A", CORDONED),
        slot("B"),
        slot("C", SUSPECT),
        slot("D", "is quarantined (XID 79)"),
    ]
    assert may_restart_in_place(["A"], slots) and may_restart_in_place(["A", "B"], slots)
    assert not may_restart_in_place(["A", "C"], slots)
    assert not may_restart_in_place(["Z"], slots)  # a GPU no longer listed
    # suspect because of the worker's own previous process: it may, nothing worse may
    assert may_restart_in_place(["A", "C"], slots, own_suspect={"C"})
    assert not may_restart_in_place(["C", "D"], slots, own_suspect={"C", "D"})


def test_auto_workers_are_placed_around_an_explicit_group_later_in_the_config() -> None:
    """Regression: groups were placed in config order, so auto workers filled GPU 0 before a
    later group listed on it was counted: budgets of 90000 MB on an 80000 MB GPU (with room
    to spare on GPU 1)."""
    budget = {"health": {"gpu_memory_limit_mb": 30_000}}
    g = groups({"name": "a", "replicas": 3, **budget}, {"name": "b", "gpus": [0], **budget})
    got = place(g, gpus(2), 512)
    assert got["b-0"] == ("GPU-0",)
    assert sorted(str(got[f"a-{i}"]) for i in range(3)) == ["('GPU-0',)", *["('GPU-1',)"] * 2]
    assert list(got) == ["a-0", "a-1", "a-2", "b-0"]  # in config order still


def test_a_worker_past_its_groups_replicas_is_placed_and_counted() -> None:
    """A reload scaled ``a`` to 1 while a-1 still runs (its roll-out removes it last): a-1,
    restarting off a GPU that became unusable, is placed, and the GPU it holds counts for
    the others. Regression: ``place`` left it out (KeyError: the supervisor crashed)."""
    g = groups({"name": "a", "replicas": 1, "max_workers_per_gpu": 1}, {"name": "b"})
    running = [("a", 0), ("a", 1), ("b", 0)]
    assert "a-1" not in place(g, gpus(3), 0, fixed={"a-0": ("GPU-0",)}, only={"a-1"})
    got = place(covering(g, running), gpus(3), 0, fixed={"a-0": ("GPU-0",)}, only={"a-1"})
    assert got["a-1"] == ("GPU-1",)
    fixed = {"a-0": ("GPU-0",), "a-1": ("GPU-1",)}
    assert place(g, gpus(3), 0, fixed=fixed, only={"b-0"})["b-0"] == ("GPU-1",)  # uncounted
    got = place(covering(g, running), gpus(3), 0, fixed=fixed, only={"b-0"})
    assert got["b-0"] == ("GPU-2",)  # a-1 holds GPU-1: counted
    assert covering(g, [("a", 0)]) == g  # nothing past the replicas: the same groups


def test_a_gpu_listed_twice_is_one_gpu() -> None:
    """Two device files of a simulated world with one UUID (one copied to add a GPU): the GPU
    is placed on once per worker. Regression: gpus_per_worker = 2 gave a worker that GPU
    twice (CUDA_VISIBLE_DEVICES=GPU-0,GPU-0)."""
    slots = [GpuSlot(i, u, 80_000.0, 80_000.0, 40.0) for i, u in enumerate(["A", "A", "B"])]
    got = place(groups({"name": "a", "gpus_per_worker": 2}), slots, 0)
    assert got == {"a-0": ("A", "B")}
    with pytest.raises(PlacementError, match="needs 2 GPU"):
        place(groups({"name": "a", "gpus_per_worker": 2}), slots[:2], 0)


_slot = st.tuples(
    st.sampled_from([None, 16_000.0, 40_000.0, 80_000.0]),
    st.one_of(st.none(), st.floats(0, 80_000)),
    st.one_of(st.none(), st.floats(20, 95)),
    st.sampled_from(["", "", CORDONED, SUSPECT, "is quarantined (XID 79)"]),
)
_group = st.tuples(
    st.integers(0, 4),
    st.one_of(
        st.sampled_from(["auto", "auto", "none"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True),
    ),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from([0, 10_000, 20_000, 39_744]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_slot, max_size=4), st.lists(_group, min_size=1, max_size=3), st.sampled_from([0, 512])
)
def test_placement_properties(slots_in: list[Any], specs: list[Any], reserve: float) -> None:
    """Deterministic; explicit lists as written; auto workers only on usable GPUs, as many
    distinct ones as gpus_per_worker, and never budgets over total - reserve_mb on a GPU."""
    slots = [
        GpuSlot(i, f"GPU-{i}", total, free, temp, usable=not why, why_not=why)
        for i, (total, free, temp, why) in enumerate(slots_in)
    ]
    config = []
    for k, (replicas, where, per_worker, most, budget) in enumerate(specs):
        spec: dict[str, Any] = {"name": f"g{k}", "replicas": replicas, "gpus": where}
        spec["health"] = {"gpu_memory_limit_mb": budget}
        if where == "auto":
            spec.update(gpus_per_worker=per_worker, max_workers_per_gpu=most)
        config.append(spec)
    g = groups(*config)
    try:
        got = place(g, slots, reserve)
    except PlacementError:
        return
    assert got == place(g, slots, reserve)
    by_uuid = {s.uuid: s for s in slots}
    committed = dict.fromkeys(by_uuid, 0.0)
    for group in g:
        for i in range(group.replicas):
            for uuid in got[f"{group.name}-{i}"] or ():
                if uuid in committed:  # (without devices a list is passed as written)
                    committed[uuid] += group.health.gpu_memory_limit_mb
    for group in g:
        for i in range(group.replicas):
            chosen = got[f"{group.name}-{i}"]
            if group.gpus == "none":
                assert chosen == ()
            elif group.gpus != "auto":
                assert chosen == tuple(f"GPU-{n}" if slots else str(n) for n in group.gpus)
            elif not slots:
                assert chosen is None
            else:
                assert chosen is not None and len(set(chosen)) == group.gpus_per_worker
                for uuid in chosen:
                    slot = by_uuid[uuid]
                    assert slot.usable
                    if group.health.gpu_memory_limit_mb:
                        assert slot.total_mb is not None
                        assert committed[uuid] <= slot.total_mb - reserve
