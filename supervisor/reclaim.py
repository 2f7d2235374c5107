"""Ending the orphans a killed supervisor left running (I/O; decisions in ``policy.reclaim``).

Runs once at start-up, before any worker starts, so orphans stop holding GPU memory before the
new workers are placed. Each orphan gets SIGTERM, then SIGKILL after a bounded wait; psutil's
create-time check guards every signal, so a pid reused in between is not hit either.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import psutil

from supervisor import procfs
from supervisor.plan import INSTANCE_VAR, WORKER_VAR
from supervisor.policy.reclaim import Candidate, Live, Verdict, candidates, judge, marked

#: How long orphans get to exit after SIGTERM before SIGKILL.
TERM_WAIT_S = 3.0
KILL_WAIT_S = 3.0
#: How often a SIGTERM's wait looks whether a forced stop wants it cut short.
HURRY_POLL_S = 0.1


def _live(pid: int, marked_at: int | None) -> tuple[Live | None, psutil.Process | None]:
    """What runs under ``pid`` now; ``marked_at``: the start (ticks) of the process found
    there carrying our marker, if one was (the same process only if it started then)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None, None
        st = procfs.read_stat(pid)
        ticks = st.start_ticks if st is not None else None
        marked_now = ticks is not None and ticks == marked_at
        return Live(pid, proc.create_time(), proc.ppid(), ticks, marked_now), proc
    except psutil.Error:
        return None, None


def _carrying(marker: str) -> dict[int, tuple[str, float, int, int]]:
    """pid -> (worker, create time, parent, start in ticks) of every process with ``marker``
    as its ``INSTANCE_VAR``."""
    out: dict[int, tuple[str, float, int, int]] = {}
    for pid, env in procfs.carrying(INSTANCE_VAR, marker).items():
        st = procfs.read_stat(pid)
        if st is not None and not st.zombie:
            worker = env.get(WORKER_VAR, "")
            out[pid] = (worker, procfs.ticks_to_time(st.start_ticks), st.ppid, st.start_ticks)
    return out


def reclaim(
    doc: Mapping[str, Any],
    marker: str | None = None,
    own_pid: int | None = None,
    hurry: threading.Event | None = None,
) -> list[dict[str, Any]]:
    """End the orphans recorded in a previous ``state.json``, and (with ``marker``, the id of
    our ``state_dir``) every process whose environment carries it: left by a killed
    predecessor, as no other running supervisor holds this ``state_dir``. Returns one record
    per candidate.

    Blocking (waits up to ``TERM_WAIT_S + KILL_WAIT_S``): call it from a worker thread. Once
    ``hurry`` is set (a forced stop), the orphans still there get SIGKILL without waiting
    out their SIGTERM's wait.
    """
    own = os.getpid() if own_pid is None else own_pid
    results: list[dict[str, Any]] = []
    doomed: list[tuple[Candidate, psutil.Process]] = []
    recorded = candidates(doc, procfs.boot_id(), procfs.ticks_per_second())
    carrying = _carrying(marker) if marker else {}
    found = marked({pid: c[:3] for pid, c in carrying.items()}, recorded, own)
    for cand in [*recorded, *found]:
        live, proc = _live(cand.pid, carrying[cand.pid][3] if cand.pid in carrying else None)
        verdict = judge(cand, live, own)
        results.append(
            {
                "worker": cand.worker,
                "pid": cand.pid,
                "leader": cand.leader,
                "create_time": cand.create_time,
                "verdict": verdict.value,
                "found": "environment" if cand in found else "recorded",
            }
        )
        if verdict is Verdict.END and proc is not None:
            doomed.append((cand, proc))
    if not doomed:
        return results
    procs: list[psutil.Process] = []
    denied: dict[int, str] = {}
    for _, p in doomed:
        try:
            p.terminate()  # psutil checks the create time before signalling
        except psutil.AccessDenied:
            # Regression: another user's process (a predecessor run as root, seen by a
            # supervisor run as an ordinary user) was waited for, then said sent SIGKILL.
            denied[p.pid] = _denied(p)
            continue
        except psutil.Error:
            pass
        procs.append(p)
    alive = procs
    deadline = time.monotonic() + TERM_WAIT_S
    while alive and not (hurry is not None and hurry.is_set()):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, alive = psutil.wait_procs(alive, timeout=min(left, HURRY_POLL_S))
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, still = psutil.wait_procs(alive, timeout=KILL_WAIT_S)
    killed = {p.pid for p in alive}
    survivors = {p.pid for p in still}
    for r in results:
        if r["verdict"] == Verdict.END.value and r["pid"] in denied:
            r["ended"] = False  # and no "signal": none was sent
            r["error"] = denied[r["pid"]]
        elif r["verdict"] == Verdict.END.value:
            r["signal"] = "SIGKILL" if r["pid"] in killed else "SIGTERM"
            r["ended"] = r["pid"] not in survivors
    return results


def _denied(proc: psutil.Process) -> str:
    """Why ``proc`` could not be signalled (EPERM): whose it is, and who we are."""
    try:
        owner = f"uid {proc.uids().real}"
    except psutil.Error:
        owner = "another user"
    return (
        f"permission denied: the process belongs to {owner}, the supervisor runs as "
        f"uid {os.geteuid()}: not signalled (end it as its user or as root)"
    )
