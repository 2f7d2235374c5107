"""HostSampler on real processes: a tree outlives its leader's exit until the leader is reaped."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import replace

import pytest

from supervisor import procfs
from supervisor.sampler import HostSampler


def test_an_exited_leaders_tree_is_kept_until_it_is_reaped() -> None:
    """When the main process exits, its children are re-parented at once, so a walk from the
    (zombie) leader finds nothing below it: the sampler keeps the tree it saw, which is what the
    supervisor kills after the exit (processes that left the process group included)."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; read x"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None and leader.stdin is not None
    child = int(leader.stdout.readline())
    try:
        host = HostSampler(full_every_s=0.0)
        trees, _, _ = host.sample({"w-0": leader.pid})
        assert trees["w-0"] == {leader.pid, child}
        started = host.starts[child]
        leader.stdin.close()  # the leader exits; nobody reaps it yet: a zombie
        while True:
            st = procfs.read_stat(leader.pid)
            if st is not None and st.zombie:
                break
            os.sched_yield()
        trees, _, _ = host.sample({"w-0": leader.pid})
        assert trees["w-0"] == {leader.pid, child}
        assert host.starts[child] == started
        # a new leader under the same name starts a new tree
        trees, _, _ = host.sample({"w-0": os.getpid()})
        assert child not in trees["w-0"]
    finally:
        os.kill(child, signal.SIGKILL)
        leader.stdin.close()
        leader.stdout.close()
        leader.wait()


def test_a_reused_pid_is_no_member(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between full scans known members are read one by one: a pid that now names another
    process (its start time changed: the member died and the pid was reused) leaves the tree,
    so it is neither measured nor killed as the worker's."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; read x"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None and leader.stdin is not None
    child = int(leader.stdout.readline())
    try:
        host = HostSampler(full_every_s=3600.0)
        trees, _, _ = host.sample({"w-0": leader.pid})  # the first read is a full scan
        assert trees["w-0"] == {leader.pid, child}
        real = procfs.read_stat

        def reused(pid: int) -> procfs.ProcStat | None:
            st = real(pid)
            return replace(st, start_ticks=st.start_ticks + 1) if st and pid == child else st

        monkeypatch.setattr(procfs, "read_stat", reused)
        trees, _, _ = host.sample({"w-0": leader.pid})
        assert trees["w-0"] == {leader.pid}
        assert host.full_scans == 1  # it was the one-by-one read
    finally:
        os.kill(child, signal.SIGKILL)
        leader.stdin.close()
        leader.stdout.close()
        leader.wait()
