"""HostSampler on real processes: a tree outlives its leader's exit until the leader is reaped."""

from __future__ import annotations

import os
import signal
import subprocess

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
