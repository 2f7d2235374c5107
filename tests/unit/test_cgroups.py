"""cgroup v2 support detection and worker placement, on fake cgroup directories and for real.

The fake directories exercise the decisions (which hierarchy, which controllers, what is
written where); the last test uses the machine's own cgroup v2 hierarchy and skips, saying why,
where the memory controller is not delegated to us.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cgroups import PREFIX, WorkerCgroups, own_cgroup, probe, with_memory

MOUNTINFO_HYBRID = (
    "35 24 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
MOUNTINFO_NAMESPACED = "50 40 0:40 /system.slice/x.service /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"


def fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


@pytest.mark.parametrize(
    ("cgroup", "mountinfo", "expected"),
    [
        ("0::/\n4:memory:/x\n", MOUNTINFO_HYBRID, "/sys/fs/cgroup/unified"),
        (
            "0::/system.slice/gpu.service\n",
            MOUNTINFO_HYBRID,
            "/sys/fs/cgroup/unified/system.slice/gpu.service",
        ),
        # a container's cgroup namespace mount shows the part below its root
        ("0::/system.slice/x.service/w\n", MOUNTINFO_NAMESPACED, "/sys/fs/cgroup/w"),
        ("4:memory:/x\n", MOUNTINFO_HYBRID, None),  # cgroup v1 only
        ("0::/\n", "35 24 0:30 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n", None),  # not mounted
    ],
)
def test_own_cgroup(tmp_path: Path, cgroup: str, mountinfo: str, expected: str | None) -> None:
    got = own_cgroup(fake_proc(tmp_path, cgroup, mountinfo))
    assert (None if got is None else str(got)) == expected


def fake_cgroup(tmp_path: Path, controllers: str, subtree: str = "") -> Path:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text(subtree)
    return root


def test_no_memory_controller_means_rss_watch(tmp_path: Path) -> None:
    support = probe(fake_cgroup(tmp_path, "cpu hugetlb"))
    assert (support.memory, support.mode) == (False, "rss_watch")
    assert "memory controller is not available" in support.why and "cpu hugetlb" in support.why


def test_delegated_subtree_enables_memory_and_places_workers(tmp_path: Path) -> None:
    root = fake_cgroup(tmp_path, "cpu memory pids")
    support = probe(root, move_self=False)
    assert (support.memory, support.mode, support.why) == (True, "memory.max", "")
    assert (root / "cgroup.subtree_control").read_text() == "+memory"
    cgroups = WorkerCgroups(support)
    assert cgroups.place("gpen-0", 4242, 512)
    leaf = root / f"{PREFIX}gpen-0"
    assert (leaf / "memory.max").read_text() == str(512 * 1024 * 1024)
    assert (leaf / "cgroup.procs").read_text() == "4242"
    assert cgroups.events_file("gpen-0") == leaf / "memory.events"
    assert not cgroups.place("gpen-1", 4243, 0)  # no budget: no cgroup


def test_without_support_nothing_is_written(tmp_path: Path) -> None:
    cgroups = WorkerCgroups(probe(fake_cgroup(tmp_path, "cpu")))
    assert not cgroups.place("gpen-0", 4242, 512)
    assert cgroups.path("gpen-0") is None and cgroups.events_file("gpen-0") is None


def test_real_memory_max_is_enforced_where_delegated(tmp_path: Path) -> None:
    """On a machine with a delegated cgroup v2 memory controller, a child over memory.max is
    OOM-killed by the kernel. Probed without moving this test process (move_self=False)."""
    support = probe(move_self=False)
    if not support.memory:
        pytest.skip(f"per-worker memory.max cannot be tested here: {support.why}")
    cgroups = WorkerCgroups(support)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdin.read(); b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        assert cgroups.place("memtest", child.pid, 64)
        assert child.stdin is not None
        child.stdin.close()
        assert child.wait(30) == -9
        events = (cgroups.events_file("memtest") or Path("/nonexistent")).read_text()
        assert "oom_kill 1" in events
    finally:
        child.kill()
        child.wait()
        cgroups.remove("memtest")


def contained_root(tmp_path: Path, procs: str) -> Path:
    root = fake_cgroup(tmp_path, "cpu pids")
    (root / "cgroup.kill").write_text("")
    (root / "cgroup.type").write_text("domain\n")
    (root / "cgroup.procs").write_text(procs)
    return root


def test_a_cgroup_of_its_own_contains_every_worker(tmp_path: Path) -> None:
    """Alone in a writable cgroup with cgroup.kill: every worker gets a cgroup (a budget or
    not), and killing it writes cgroup.kill; no memory controller, so no memory.max."""
    root = contained_root(tmp_path, f"{os.getpid()}\n")
    support = probe(root, move_self=False, memory=False)
    assert (support.contain, support.contain_why, support.containment) == (True, "", "cgroup")
    assert (support.memory, support.why) == (False, "no worker has host_memory_limit_mb")
    cgroups = WorkerCgroups(support)
    leaf = root / f"{PREFIX}gpen-0"
    assert cgroups.prepare("gpen-0", 0) == leaf  # before the spawn: the child joins it
    assert cgroups.place("gpen-0", 4242)  # after: made sure of
    assert (leaf / "cgroup.procs").read_text() == "4242"
    assert not (leaf / "memory.max").exists() and cgroups.events_file("gpen-0") is None
    assert cgroups.kill("gpen-0")
    assert (leaf / "cgroup.kill").read_text() == "1"
    # once killed, the next kill waits for the next placement
    assert not cgroups.kill("gpen-0")
    # never placed (a spawn that failed, a placement that failed): the caller ends the tree
    assert not cgroups.kill("gpen-9")
    (leaf / "cgroup.kill").write_text("")  # a fake directory: rmdir needs it empty
    assert not cgroups.remove("gpen-0") and cgroups.sweep() == ["gpen-0"]
    (leaf / "cgroup.procs").unlink()
    (leaf / "cgroup.kill").unlink()
    assert cgroups.sweep() == [] and not leaf.exists()


def test_a_failed_placement_leaves_the_tree_to_the_fallback(tmp_path: Path) -> None:
    root = contained_root(tmp_path, "")
    cgroups = WorkerCgroups(probe(root, move_self=False, memory=False))
    assert cgroups.prepare("gpen-0", 0) is not None
    (root / f"{PREFIX}gpen-0" / "cgroup.procs").mkdir()  # writing the pid fails
    assert not cgroups.place("gpen-0", 4242)
    assert not cgroups.kill("gpen-0")


def test_worker_cgroups_of_an_earlier_run_are_killed(tmp_path: Path) -> None:
    root = contained_root(tmp_path, "")
    for name, procs in (("old-0", "77\n78\n"), ("old-1", ""), ("keep-0", "79\n")):
        (root / f"{PREFIX}{name}").mkdir()
        (root / f"{PREFIX}{name}" / "cgroup.procs").write_text(procs)
    (root / "gpu-supervisor").mkdir()  # the supervisor's own leaf (memory mode) is not one
    cgroups = WorkerCgroups(probe(root, move_self=False, memory=False))
    assert cgroups.stale(known=["keep-0"]) == {"old-0": [77, 78], "old-1": []}
    assert (root / f"{PREFIX}old-0" / "cgroup.kill").read_text() == "1"
    assert not (root / f"{PREFIX}keep-0" / "cgroup.kill").exists()
    assert set(cgroups.sweep()) == {"old-0", "old-1"}  # fake directories are not empty
    # not alone in its cgroup: another supervisor's directories are not ours to kill
    (tmp_path / "x").mkdir()
    shared = WorkerCgroups(probe(contained_root(tmp_path / "x", "1\n"), memory=False))
    assert shared.stale() == {}


def test_a_budget_and_containment_together(tmp_path: Path) -> None:
    root = contained_root(tmp_path, "")
    (root / "cgroup.controllers").write_text("cpu memory\n")
    support = probe(root, move_self=False)
    assert support.contain and support.memory
    cgroups = WorkerCgroups(support)
    assert cgroups.place("a-0", 11, 256) and cgroups.place("b-0", 12, 0)
    assert (root / f"{PREFIX}a-0" / "memory.max").read_text() == str(256 * 1024 * 1024)
    # no budget: "max" (a reload may have lifted one), but still its own cgroup
    assert (root / f"{PREFIX}b-0" / "memory.max").read_text() == "max"
    assert (root / f"{PREFIX}b-0" / "cgroup.procs").read_text() == "12"


@pytest.mark.parametrize(
    ("procs", "kill_file", "why"),
    [
        ("1\n2\n", True, "holds other processes too (pids 1 2)"),
        ("", False, "has no cgroup.kill (Linux < 5.14)"),
        ("", None, "is the hierarchy's root cgroup"),
    ],
)
def test_no_containment_in_a_shared_cgroup_or_without_cgroup_kill(
    tmp_path: Path, procs: str, kill_file: bool | None, why: str
) -> None:
    """A cgroup shared with other processes (the hierarchy's root here, a login session) is
    not the supervisor's to divide; without cgroup.kill nothing can end a cgroup at once."""
    root = contained_root(tmp_path, procs)
    if kill_file is None:  # the root cgroup: neither cgroup.type nor cgroup.kill
        (root / "cgroup.type").unlink()
    if not kill_file:
        (root / "cgroup.kill").unlink()
    support = probe(root, move_self=False, memory=False)
    assert not support.contain and why in support.contain_why
    assert support.containment == "process_tree"
    cgroups = WorkerCgroups(support)
    assert not cgroups.place("gpen-0", 4242, 0) and not cgroups.kill("gpen-0")
    assert not (root / f"{PREFIX}gpen-0").exists()


def test_the_first_budget_added_by_a_reload_enables_memory_max(tmp_path: Path) -> None:
    root = contained_root(tmp_path, "")
    (root / "cgroup.controllers").write_text("cpu memory\n")
    support = probe(root, move_self=False, memory=False)
    assert not support.memory and support.contain
    now = with_memory(support, move_self=False)
    assert now.memory and now.contain and (root / "cgroup.subtree_control").read_text() == "+memory"
    assert with_memory(now) is now  # probed once


def test_a_worker_without_a_cgroup_has_no_oom_count_of_its_own(tmp_path: Path) -> None:
    """The memory controller is delegated (some group has a budget) but there is no
    containment (no cgroup.kill, Linux < 5.14): a worker without ``host_memory_limit_mb`` gets
    no cgroup. Its ``memory.events`` was named all the same; reading it failed and the count
    fell back to the whole machine's since its spawn, said to be the cgroup's: a SIGKILL (an
    operator's) hours after any OOM kill elsewhere on the host was called ``host_oom``. Now it
    has none (the healer then judges the system-wide count near the death, scope ``host``)."""
    root = fake_cgroup(tmp_path, "cpu memory pids")
    cgroups = WorkerCgroups(probe(root, move_self=False))
    assert cgroups.prepare("gpen-0", 512) is not None
    assert cgroups.events_file("gpen-0") == root / f"{PREFIX}gpen-0" / "memory.events"
    assert cgroups.prepare("plain-0", 0) is None
    assert cgroups.events_file("plain-0") is None
    # a reload that lifts the budget: the cgroup is left unused (the process does not join it)
    assert cgroups.prepare("gpen-0", 0) is None
    assert cgroups.events_file("gpen-0") is None
    # one whose cgroup could not be made has none either
    (root / f"{PREFIX}bad-0").write_text("")  # mkdir fails
    assert cgroups.prepare("bad-0", 512) is None
    assert cgroups.events_file("bad-0") is None


def test_a_lifted_budget_does_not_put_the_new_process_under_the_old_memory_max(
    tmp_path: Path,
) -> None:
    """Regression: with the memory controller but no containment (a shared cgroup, Linux <
    5.14), a reload that removed ``host_memory_limit_mb`` gave the next process no cgroup at
    its spawn, but the placement after the spawn moved it into the worker's old cgroup all
    the same, where the old ``memory.max`` still held: the kernel OOM-killed a worker at a
    budget the configuration no longer had."""
    root = fake_cgroup(tmp_path, "cpu memory pids")
    cgroups = WorkerCgroups(probe(root, move_self=False))
    leaf = root / f"{PREFIX}gpen-0"
    assert cgroups.place("gpen-0", 4242, 512)
    assert cgroups.prepare("gpen-0", 0) is None  # the next spawn, the budget lifted
    assert not cgroups.place("gpen-0", 4343)
    assert (leaf / "cgroup.procs").read_text() == "4242"
