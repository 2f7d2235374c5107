"""Reload diff (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from supervisor.config import parse_settings
from supervisor.policy.reload import diff_groups, port_waits


def groups(*specs: dict[str, object]) -> tuple:  # type: ignore[type-arg]
    return parse_settings({"workers": list(specs)}).workers


def test_diff_by_name_and_content() -> None:
    old = groups(
        {"name": "a", "command": ["x"], "port_base": 9000},
        {"name": "b", "command": ["y"], "port_base": 9100},
        {"name": "c", "command": ["z"], "port_base": 9200},
    )
    new = groups(
        {"name": "a", "command": ["x"], "port_base": 9000},
        {"name": "b", "command": ["y", "--v2"], "port_base": 9100},
        {"name": "d", "command": ["w"], "port_base": 9300},
    )
    d = diff_groups(old, new)
    assert d.unchanged == ("a",) and d.changed == ("b",)
    assert d.removed == ("c",) and d.added == ("d",)
    assert not d.is_noop


def test_same_config_is_noop() -> None:
    g = groups({"name": "a", "command": ["x"]})
    assert diff_groups(g, g).is_noop


def test_a_dirty_group_is_changed_whatever_the_files_say() -> None:
    """A group whose rollout halted part-way (its workers run two definitions) is rolled
    again by the next reload, even of the very file it was halted on."""
    g = groups({"name": "a", "command": ["x"]}, {"name": "b", "command": ["y"], "port_base": 9100})
    d = diff_groups(g, g, dirty={"a", "gone"})
    assert d.changed == ("a",) and d.unchanged == ("b",) and not d.is_noop
    assert diff_groups(g, g[1:], dirty={"a"}).removed == ("a",)


def test_keys_read_at_start_only_are_named_and_kept() -> None:
    from supervisor.policy.reload import applied_by_reload, start_only_changes

    w = [{"name": "a", "command": ["x"]}]
    old = parse_settings({"workers": w, "gpu": {"backend": "none"}})
    new = parse_settings(
        {
            "workers": w,
            "supervisor": {"shutdown_timeout_s": 5, "state_dir": "/elsewhere"},
            "api": {"listen": "127.0.0.1:9999", "token_file": "/etc/token"},
            "gpu": {"backend": "sim", "reserve_mb": 1024, "thermal_margin_c": 2},
        }
    )
    assert start_only_changes(old, new) == (
        "supervisor.state_dir",
        "api.listen",
        "api.token_file",
        "gpu.backend",
    )
    applied = applied_by_reload(old, new)
    assert applied.supervisor.shutdown_timeout_s == 5  # applied
    assert applied.supervisor.state_dir == old.supervisor.state_dir  # kept
    assert applied.api == old.api and applied.gpu.backend == "none"
    assert (applied.gpu.reserve_mb, applied.gpu.thermal_margin_c) == (1024, 2)
    assert applied.workers == new.workers
    assert start_only_changes(old, applied) == ()


def test_a_change_of_replicas_only_is_a_scale() -> None:
    old = groups(
        {"name": "a", "command": ["x"], "port_base": 9000, "replicas": 2},
        {"name": "b", "command": ["y"], "port_base": 9100, "replicas": 2},
    )
    new = groups(
        {"name": "a", "command": ["x"], "port_base": 9000, "replicas": 3},
        {"name": "b", "command": ["y", "--v2"], "port_base": 9100, "replicas": 3},
    )
    d = diff_groups(old, new)
    assert d.changed == ("a", "b") and d.scaled == ("a",)
    assert diff_groups(old, new, dirty={"a"}).scaled == ()  # a halted rollout: all of it again


def test_a_change_that_leaves_the_placement_settings_keeps_the_workers_on_their_gpus() -> None:
    """A new command, env or replica count is no reason to move workers between GPUs (the
    roll-out restarts them in place); a change of gpus, gpus_per_worker, max_workers_per_gpu
    or the GPU budget places the group afresh. Regression: every changed group was placed
    again, so reloads swapped workers between GPUs, and rolling a halted roll-out back
    restarted workers already on the target definition because they drew another GPU."""
    base = {"command": ["x"], "gpus": "auto", "replicas": 2}
    old = groups(
        {"name": "cmd", **base, "port_base": 9000},
        {"name": "per", **base, "port_base": 9100},
        {"name": "max", **base, "port_base": 9200},
        {"name": "mem", **base, "port_base": 9300},
        {"name": "list", **base, "port_base": 9400},
    )
    new = groups(
        {
            "name": "cmd",
            **base,
            "command": ["x", "--v2"],
            "env": {"A": "1"},
            "replicas": 3,
            "port_base": 9000,
        },
        {"name": "per", **base, "gpus_per_worker": 2, "port_base": 9100},
        {"name": "max", **base, "max_workers_per_gpu": 1, "port_base": 9200},
        {"name": "mem", **base, "health": {"gpu_memory_limit_mb": 1000}, "port_base": 9300},
        {"name": "list", **base, "gpus": [0], "port_base": 9400},
    )
    d = diff_groups(old, new, dirty={"cmd"})
    assert d.changed == ("cmd", "per", "max", "mem", "list")
    assert d.same_placement == ("cmd",)


def test_a_dirty_group_keeps_its_gpus_only_where_every_placement_it_ran_is_the_new_one() -> None:
    """A roll-out of gpus [1] (from [0]) halted after moving a-0 to GPU 1: reloading the old
    file ([0]) must place the group afresh (a-0 back onto GPU 0), while a halted roll-out of a
    new command only leaves every worker on its GPUs. Regression: same_placement compared the
    two files only, and a-0 stayed on GPU 1, a GPU its group no longer named."""
    old = groups({"name": "a", "command": ["x"], "gpus": [0], "port_base": 9000})
    moved = groups({"name": "a", "command": ["x"], "gpus": [1], "port_base": 9000})
    cmd = groups({"name": "a", "command": ["x", "--v2"], "gpus": [0], "port_base": 9000})
    d = diff_groups(old, old, dirty={"a"}, rolled={"a": moved})
    assert d.changed == ("a",) and d.same_placement == ()
    d = diff_groups(old, old, dirty={"a"}, rolled={"a": cmd})
    assert d.same_placement == ("a",)
    assert diff_groups(old, old, dirty={"a"}).same_placement == ("a",)


def test_a_reload_keeps_the_automatic_ports_of_the_groups() -> None:
    """Groups without port_base keep the ports they run with where they still fit; the groups
    that keep or shrink their range go first, a group that grows into another's moves."""
    from supervisor.config import keep_port_bases

    def bases(data: Mapping[str, Any]) -> dict[str, int | None]:
        return {g.name: g.port_base for g in parse_settings(data).workers}

    running = {"a": range(8001, 8003), "b": range(8003, 8004), "c": range(9000, 9001)}
    data: dict[str, Any] = {
        "workers": [
            {"name": "a", "command": ["x"], "replicas": 3},  # grows into b's port 8003
            {"name": "b", "command": ["x"]},
            {"name": "c", "command": ["x"], "port_base": 9500},  # its own choice wins
            {"name": "d", "command": ["x"]},  # new
        ]
    }
    assert bases(data) == {"a": 8001, "b": 8004, "c": 9500, "d": 8005}  # from scratch
    # a moves past every port in use (its own too, until its workers have moved), d as well
    assert bases(keep_port_bases(data, running)) == {"a": 8004, "b": 8003, "c": 9500, "d": 8007}
    # a group that grows into the ports another group ran on moves, even when that group
    # itself moves (its workers hold the old ports until they are restarted)
    moved: dict[str, Any] = {
        "workers": [
            {"name": "z", "command": ["x"], "replicas": 4},
            {"name": "a", "command": ["x"], "replicas": 3},
        ]
    }
    held = {"z": range(8001, 8003), "a": range(8003, 8005)}
    assert bases(keep_port_bases(moved, held)) == {"z": 8006, "a": 8003}
    data["workers"][0]["replicas"] = 1
    assert bases(keep_port_bases(data, running))["a"] == 8001


def test_ports_held_outside_a_groups_range_go_to_no_other_group() -> None:
    """A roll-out that moved a's workers to 8004-8007 stopped part-way (halted, superseded):
    a's range in force is still 8001-8002, but a-0 holds 8004 and a-2 8006. A group added
    now gets a range past them. Regression: it was given 8004-8005, and its first worker
    failed to bind (address in use) until a-0 moved back."""
    from supervisor.config import keep_port_bases

    def bases(data: Mapping[str, Any]) -> dict[str, int | None]:
        return {g.name: g.port_base for g in parse_settings(data).workers}

    running = {"a": range(8001, 8003), "b": range(8003, 8004)}
    held = {"a": [range(8004, 8005), range(8006, 8007)]}
    data: dict[str, Any] = {
        "workers": [
            {"name": "a", "command": ["x"], "replicas": 2},
            {"name": "b", "command": ["x"]},
            {"name": "c", "command": ["x"], "replicas": 2},  # new
        ]
    }
    assert bases(keep_port_bases(data, running))["c"] == 8004  # as before: onto a-0's port
    assert bases(keep_port_bases(data, running, held)) == {"a": 8001, "b": 8003, "c": 8007}
    # a group that kept its range and grows does not grow into another's held ports either
    data["workers"][1]["replicas"] = 2
    assert bases(keep_port_bases(data, {"b": range(8003, 8004)}, held))["b"] != 8003


@pytest.mark.parametrize(
    ("holders", "waits"),
    [
        ({}, {}),
        ({"b": {"a"}}, {"b": ["a"]}),  # b takes a port a's kept worker leaves: b waits for a
        ({"a": {"b"}, "b": {"a"}}, {}),  # a swap: neither waits (both ways dropped)
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, {}),  # passed round: none waits
        ({"a": {"b"}, "b": {"c"}}, {"a": ["b"], "b": ["c"]}),  # a chain stays
        ({"c": {"b", "a"}, "a": {"b"}, "b": {"a"}}, {"c": ["a", "b"]}),  # swap, and c after it
    ],
)
def test_port_hand_overs_between_changed_groups_order_them_without_a_cycle(
    holders: dict[str, set[str]], waits: dict[str, list[str]]
) -> None:
    """A group whose new workers take a port another changed group's kept worker leaves only
    when its own roll-out reaches it waits for that roll-out; waits that would go round (a
    swap of ports) are dropped both ways, so no roll-out waits for good."""
    assert port_waits(holders, ["a", "b", "c"]) == waits
