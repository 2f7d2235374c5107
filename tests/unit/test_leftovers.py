"""``Runtime._end_leftovers`` on real processes: what an exited worker left among our children."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from supervisor import procfs
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
