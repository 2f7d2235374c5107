"""HostSampler on real processes: trees, start times, an exited leader, a reused pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor import procfs
from supervisor.sampler import HostSampler


@contextlib.contextmanager
def leader_with_child() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A shell (the leader) with a ``sleep`` child; the leader exits when its stdin closes."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; read x"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None and leader.stdin is not None
    child = int(leader.stdout.readline())
    try:
        yield leader, child
    finally:
        os.kill(child, signal.SIGKILL)
        leader.stdin.close()
        leader.stdout.close()
        leader.wait()


def sampled_then_zombie(host: HostSampler, leader: subprocess.Popen[bytes], child: int) -> int:
    """Sample the leader's tree (it and its child), then let the leader exit unreaped (a
    zombie); the child's start time as the sample saw it."""
    assert leader.stdin is not None
    trees, _, _ = host.sample({"w-0": leader.pid})
    assert trees["w-0"] == {leader.pid, child}
    started = host.starts[child]
    leader.stdin.close()  # the leader exits; nobody reaps it yet: a zombie
    while True:
        st = procfs.read_stat(leader.pid)
        if st is not None and st.zombie:
            return started
        os.sched_yield()


def test_an_exited_leaders_tree_is_kept_until_it_is_reaped() -> None:
    """When the main process exits, its children are re-parented at once, so a walk from the
    (zombie) leader finds nothing below it: the sampler keeps the tree it saw, which is what the
    supervisor kills after the exit (processes that left the process group included)."""
    with leader_with_child() as (leader, child):
        host = HostSampler(full_every_s=0.0)
        started = sampled_then_zombie(host, leader, child)
        trees, _, _ = host.sample({"w-0": leader.pid})
        assert trees["w-0"] == {leader.pid, child}
        assert host.starts[child] == started
        # a new leader under the same name starts a new tree; the leftover's start time stays
        trees, _, _ = host.sample({"w-0": os.getpid()})
        assert child not in trees["w-0"] and host.starts[child] == started


def test_a_pid_reused_while_the_leader_is_a_zombie_is_no_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tree kept for an exited (not yet reaped) leader is the one seen before: a member
    that exited since and whose pid now names another process (its start time changed) is not
    in it, so that process is neither measured as the worker's nor killed as its leftover (its
    start time refreshed to the new process's would have let ``_end_leftovers`` kill it)."""
    with leader_with_child() as (leader, child):
        host = HostSampler(full_every_s=0.0)
        started = sampled_then_zombie(host, leader, child)
        real = procfs.scan

        def reused() -> dict[int, procfs.ProcStat]:
            table = real()
            table[child] = replace(table[child], start_ticks=started + 1)
            return table

        monkeypatch.setattr(procfs, "scan", reused)
        trees, _, _ = host.sample({"w-0": leader.pid})
        assert trees["w-0"] == {leader.pid}
        assert host.starts[child] == started  # not the new process's: never killed as ours


def test_a_reused_pid_is_no_member(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between full scans known members are read one by one: a pid that now names another
    process (its start time changed: the member died and the pid was reused) leaves the tree,
    so it is neither measured nor killed as the worker's."""
    with leader_with_child() as (leader, child):
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


def test_a_new_leaders_tree_is_read_again_a_second_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new main process forks right after the scan that found it is in its tree after
    about a second, not only at the next 5 s full scan."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # the sampler's clock
    with leader_with_child() as (leader, child):
        host = HostSampler()
        host.sample({"w-0": os.getpid()})  # a first worker, then a new main process
        scans = host.full_scans
        trees, _, _ = host.sample({"w-0": leader.pid})
        assert host.full_scans == scans + 1 and child in trees["w-0"]
        now[0] += 0.5
        host.sample({"w-0": leader.pid})
        assert host.full_scans == scans + 1  # not yet
        now[0] += 0.6
        host.sample({"w-0": leader.pid})
        assert host.full_scans == scans + 2  # a second after the new leader
        now[0] += 1.1
        host.sample({"w-0": leader.pid})
        assert host.full_scans == scans + 2  # then every 5 s again


def test_a_members_create_time_only_while_it_is_that_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``state.json`` records for a tree member: its create time while the pid is the
    process the trees were read with; nothing once the pid names another process (a reused pid
    recorded with the new process's create time would be killed by the next supervisor's
    reclaim), nor for a pid that was never a member."""
    with leader_with_child() as (leader, child):
        host = HostSampler(full_every_s=3600.0)
        host.sample({"w-0": leader.pid})
        assert host.member_create_time(child) == procfs.create_time(child)
        assert host.member_create_time(os.getpid()) is None  # not a member
        real = procfs.read_stat

        def reused(pid: int) -> procfs.ProcStat | None:
            st = real(pid)
            return replace(st, start_ticks=st.start_ticks + 1) if st and pid == child else st

        monkeypatch.setattr(procfs, "read_stat", reused)  # no sample since: the tree is stale
        assert host.member_create_time(child) is None
        assert host.member_create_time(leader.pid) == procfs.create_time(leader.pid)


def test_samples_between_reads_say_when_their_reading_was_taken() -> None:
    """Between two reads of ``/proc`` (``every_s``) a sample repeats the last reading; it says
    when that reading was taken, so the budget's two consecutive samples are two readings."""
    with leader_with_child() as (leader, _child):
        host = HostSampler(every_s=3600.0)
        host.sample({"w-0": leader.pid})
        first = host.read_at
        assert first is not None
        _, usage, _ = host.sample({"w-0": leader.pid})
        assert host.read_at == first and usage["w-0"][0] is not None


#: A main process whose main thread exits (``pthread_exit``) while another thread runs on:
#: the kernel shows the thread group's leader as a zombie, and its own ``stat`` says 0 RSS.
MAIN_THREAD_EXITS = """
import ctypes, os, subprocess, sys, threading
held = bytearray(64 << 20)
held[::4096] = bytes(len(held) // 4096)
for i in range(0, len(held), 4096):
    held[i] = 1
def later():
    sys.stdin.readline()  # once the main thread is gone: a child of the process goes on
    print(subprocess.Popen(["sleep", "300"]).pid, flush=True)
    sys.stdin.readline()
threading.Thread(target=later).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_whose_main_thread_exited_lives_on() -> None:
    """Its leader shows ``Z`` in ``stat`` while its other threads run: it is no zombie (its
    memory is held, its children are its own), and its RSS is its threads' (the exited
    leader's ``stat`` says 0: a worker doing this looked like 0 MiB to the budget and the
    leak detector, and its new children were never in its tree)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN_THREAD_EXITS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    child = None
    try:
        assert proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 10
        while b"Z" not in Path(f"/proc/{proc.pid}/stat").read_bytes().rpartition(b")")[2][:3]:
            assert time.monotonic() < deadline
            os.sched_yield()
        host = HostSampler(full_every_s=0.0)
        host.sample({"w-0": proc.pid})
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        child = int(proc.stdout.readline())
        st = procfs.read_stat(proc.pid)
        assert st is not None and not st.zombie and st.rss_mb >= 64
        assert procfs.running(proc.pid)
        trees, usage, _ = host.sample({"w-0": proc.pid})
        assert trees["w-0"] == {proc.pid, child}
        rss = usage["w-0"][0]
        assert rss is not None and rss >= 64
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        proc.stdin.close()
        proc.stdout.close()
        proc.wait(timeout=10)


FORKED_TREE = """
import os, sys
held = bytearray(200 * 1024 * 1024)  # touched: resident
for i in range(0, len(held), 4096):
    held[i] = 1
r, w = os.pipe()
for _ in range(3):  # children that share every page with the parent and write none
    if os.fork() == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
os.close(r)
print("forked", flush=True)
sys.stdin.read()
"""


def test_a_forked_tree_over_its_budget_by_rss_is_read_by_pss() -> None:
    """A parent holding 200 MiB and three forked children sharing it: RSS says ~800 MiB for the
    tree, PSS ~200 (each shared page counted once). Over its budget by RSS, the tree's PSS is
    read (and only then: under it, or without a budget, nothing more is read)."""
    with subprocess.Popen(
        [sys.executable, "-c", FORKED_TREE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"forked\n"
            if procfs.pss_mb(proc.pid) is None:
                pytest.skip("no /proc/PID/smaps_rollup here (Linux before 4.14)")
            host = HostSampler(full_every_s=0.0)
            trees, usage, _ = host.sample({"w": proc.pid}, frozenset(), {"w": 400.0})
            assert len(trees["w"]) == 4
            rss = usage["w"][0]
            assert rss is not None and rss > 700
            assert 190 < host.pss["w"] < 400
            host.sample({"w": proc.pid}, frozenset(), {"w": 2000.0})  # under it: not read
            assert host.pss == {}
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the children too (they are init's to reap)


@contextlib.contextmanager
def sleepers(*kwargs: dict[str, object]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``sleep 300`` processes (children of this test), one per ``Popen`` keyword set; killed
    and reaped afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for kw in kwargs:
            procs.append(subprocess.Popen(["sleep", "300"], **kw))  # type: ignore[call-overload]
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_process_re_parented_to_us_is_its_workers() -> None:
    """A worker's daemon that double-forked is re-parented to the supervisor (here: a child
    of this test). Regression: it was in no worker's tree (its memory no worker's)."""
    named = {**os.environ, "GPU_SUPERVISOR_WORKER": "w-0"}
    with (
        sleepers({"process_group": 0}) as (leader,),  # leads a group
        sleepers(
            {"process_group": leader.pid},  # in the worker's process group
            {"start_new_session": True, "env": named},  # left it, carries the worker's name
            {"start_new_session": True},  # some other child of the supervisor's
        ) as (grouped, left, other),
    ):
        # Popen returns at the exec's close-on-exec, before the new environment is set up:
        # read too soon (a loaded CI host), /proc/<pid>/environ is empty (seen once in CI)
        deadline = time.monotonic() + 10
        while procfs.environ_value(left.pid, "GPU_SUPERVISOR_WORKER") is None:
            assert time.monotonic() < deadline, "the sleeper's environment never showed"
            time.sleep(0.01)
        trees, _, _ = HostSampler().sample({"w-0": leader.pid, "w-1": None})
        assert trees["w-0"] == {leader.pid, grouped.pid, left.pid}
        assert trees["w-1"] == frozenset()
        main = {leader.pid: "w-0"}
        var = "GPU_SUPERVISOR_WORKER"
        st = procfs.read_stat(left.pid)
        assert st is not None
        assert procfs.adopted_by(left.pid, st.start_ticks, main, var) == "w-0"
        # started before the worker's main process: an earlier run's leftover
        before = procfs.read_stat(leader.pid)
        assert before is not None
        assert procfs.adopted_by(left.pid, before.start_ticks - 1, main, var) is None
        assert procfs.adopted_by(other.pid, st.start_ticks, main, var) is None
        assert procfs.adopted_by(left.pid, st.start_ticks, {}, var) is None


def test_a_gpu_pid_equal_to_a_thread_id_here_is_not_visible() -> None:
    """Regression: in a container without the host PID namespace NVML lists host pids; one
    that equals the id of a thread here (``/proc/<tid>`` answers, though ``/proc`` does not
    list it) was taken for a process here, so the GPU's processes were not attributed by
    device and the worker alone on the GPU read 0 MiB. A thread's id is no process here; the
    process itself is."""
    started, stop = threading.Event(), threading.Event()

    def run() -> None:
        started.set()
        stop.wait(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(5) and thread.native_id is not None
        tid = thread.native_id
        assert tid != os.getpid() and procfs.read_stat(tid) is not None  # /proc answers
        with leader_with_child() as (leader, _child):
            _, _, visible = HostSampler().sample(
                {"w-0": leader.pid}, gpu_pids=frozenset({tid, os.getpid(), leader.pid})
            )
        assert visible == {os.getpid(), leader.pid}
        assert not procfs.is_process(tid) and procfs.is_process(os.getpid())
        assert not procfs.is_process(2**22 + 7)  # above pid_max: no such process
    finally:
        stop.set()
        thread.join()
