"""``Runtime._end_leftovers`` on real processes: what an exited worker left among our children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from supervisor import processes, procfs
from supervisor.plan import WORKER_VAR
from supervisor.runtime import LEFTOVER_ROUNDS, Runtime


def test_leftovers_cost_one_read_of_proc_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each leftover's descendants come from one read of the process table a round, not one
    read of all of ``/proc`` per leftover (psutil's ``children(recursive=True)``): a worker
    that left hundreds of children on a busy host blocked the event loop for seconds."""
    leader = subprocess.Popen(["sleep", "300"], process_group=0)
    kids: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(12):
            kids.append(subprocess.Popen(["sleep", "300"], process_group=leader.pid))
        reads = [0]
        real_scan, real_ppid_map = procfs.scan, psutil._ppid_map  # type: ignore[attr-defined]

        def scan() -> dict[int, procfs.ProcStat]:
            reads[0] += 1
            return real_scan()

        def ppid_map() -> dict[int, int]:
            reads[0] += 1
            result: dict[int, int] = real_ppid_map()
            return result

        monkeypatch.setattr(procfs, "scan", scan)
        monkeypatch.setattr(psutil, "_ppid_map", ppid_map)
        rt: Any = object.__new__(Runtime)
        rt.cgroups = SimpleNamespace(kill=lambda name: False)
        rt._trees, rt._pids = {}, {}
        rt.sampler = SimpleNamespace(started_ticks=lambda pid: None)
        warned: list[dict[str, Any]] = []
        rt.log = SimpleNamespace(warning=lambda event, **kw: warned.append(kw))
        runner = SimpleNamespace(name="w-0", output=SimpleNamespace(pipe_inodes=frozenset))
        rt._end_leftovers(runner, leader.pid)
        assert sorted(warned[0]["pids"]) == sorted(k.pid for k in kids)
        assert reads[0] <= LEFTOVER_ROUNDS
    finally:
        for proc in [*kids, leader]:
            proc.kill()
            proc.wait()


_FORKS_ESCAPEE = """
import os, signal, sys, time
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.setsid()
    print(os.getpid(), flush=True)
    time.sleep(300)
    os._exit(0)
time.sleep(300)
"""


def test_a_member_killed_by_the_last_tree_read_takes_what_it_forked_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a member of the exited worker's tree, as the sampler last read it, was
    killed and then passed over: a grandchild it forked after that read and that called
    setsid() was still its child (it had not died yet), so no read of our children found
    it, and once the member died it was re-parented to the supervisor and lived on (a
    crash-test's grandchild outlived its worker under heavy load). Its descendants are now
    taken with it, as for a member found among our children."""
    assert processes.set_child_subreaper()  # as the supervisor: orphans come to us
    leader = subprocess.Popen(["sleep", "300"], process_group=0)
    member = subprocess.Popen(
        [sys.executable, "-S", "-c", _FORKS_ESCAPEE],
        process_group=leader.pid,
        stdout=subprocess.PIPE,
        env={**os.environ, WORKER_VAR: "w-0"},
    )
    assert member.stdout is not None
    escapee = psutil.Process(int(member.stdout.readline()))
    try:
        leader.kill()  # the worker's main process exited (its group is killed with it)
        leader.wait()
        st = procfs.read_stat(member.pid)
        assert st is not None
        real_kill, real_children = os.kill, procfs.own_children
        held = [True]

        def kill(pid: int, sig: int) -> None:
            if pid == member.pid and held[0]:
                return  # the SIGKILL is pending: the member has not died yet
            real_kill(pid, sig)

        def own_children() -> set[int]:
            seen = real_children()
            if held[0]:  # the member dies right after that read: its child is ours now
                held[0] = False
                real_kill(member.pid, signal.SIGKILL)
                os.waitid(os.P_PID, member.pid, os.WEXITED | os.WNOWAIT)
            return seen

        monkeypatch.setattr(os, "kill", kill)
        monkeypatch.setattr(procfs, "own_children", own_children)
        rt: Any = object.__new__(Runtime)
        rt.cgroups = SimpleNamespace(kill=lambda name: False)
        rt._trees, rt._pids = {"w-0": frozenset({leader.pid, member.pid})}, {}
        rt.sampler = SimpleNamespace(started_ticks={member.pid: st.start_ticks}.get)
        rt.log = SimpleNamespace(warning=lambda event, **kw: None)
        runner = SimpleNamespace(name="w-0", output=SimpleNamespace(pipe_inodes=frozenset))
        rt._end_leftovers(runner, leader.pid)
        monkeypatch.undo()
        try:
            escapee.wait(timeout=2)
        except psutil.TimeoutExpired:
            pytest.fail("the grandchild forked since the last read outlived the worker")
    finally:
        monkeypatch.undo()
        with contextlib.suppress(psutil.Error):
            escapee.kill()
        member.kill()
        member.wait()
        with contextlib.suppress(psutil.Error):
            escapee.wait(timeout=2)  # ours once the member died: reaped here
        processes._prctl()(processes.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        assert member.stdout is not None
        member.stdout.close()
