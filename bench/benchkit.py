"""What the bench scripts share: tracking every process a run starts, so that all of it can be
killed at the end, and reading the supervisor's JSON log.

The scripts run as ``python bench/<script>.py`` (``bench/`` is ``sys.path[0]``) and import this
module as ``from benchkit import Tracker``. Dependencies: stdlib + psutil.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from types import FrameType
from typing import Any

import psutil

RUN_ID_ENV = "BENCH_RUN_ID"  # the marker: every process of a run carries it in its environment


# --------------------------------------------------------------------------- process tracking


@dataclass
class Tracker:
    """Everything this run started, so that it can all be killed at the end: the pids it was
    given (with their create times) and every process carrying ``BENCH_RUN_ID=<run_id>``."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    procs: dict[int, float] = field(default_factory=dict)  # pid -> psutil create_time
    popens: list[subprocess.Popen[Any]] = field(default_factory=list)

    def add_pid(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self.procs.setdefault(pid, psutil.Process(pid).create_time())

    def add_popen(self, proc: subprocess.Popen[Any]) -> None:
        """A process we launched: tracked, and reaped by ``kill_all``."""
        self.popens.append(proc)
        self.add_pid(proc.pid)

    def ours(self) -> list[psutil.Process]:
        """Live processes that are ours: tracked pids (same create time) or carrying our marker."""
        found: dict[int, psutil.Process] = {}
        for pid, created in self.procs.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    found[pid] = p
        me = os.getpid()
        for p in psutil.process_iter(["create_time"]):
            created = p.info["create_time"] or 0.0
            if p.pid == me or p.pid in found or created < self.started_at - 1:
                continue
            with contextlib.suppress(psutil.Error):
                if (
                    p.environ().get(RUN_ID_ENV) == self.run_id
                    and p.status() != psutil.STATUS_ZOMBIE
                ):
                    found[p.pid] = p
        return list(found.values())

    def kill_all(self) -> list[str]:
        """SIGKILL every process group and process we started; return what survived."""
        own_pgid = os.getpgid(0)
        for _ in range(3):
            live = self.ours()
            if not live:
                break
            for p in live:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    pgid = os.getpgid(p.pid)
                    if pgid != own_pgid:
                        os.killpg(pgid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGKILL)
            psutil.wait_procs(live, timeout=3)
            for proc in self.popens:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
        for proc in self.popens:  # reap our direct children
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
        left = []
        for p in self.ours():
            with contextlib.suppress(psutil.Error):
                left.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        return left


def free_port_range(n: int) -> int:
    """A base port with ``n`` free ports from it, below the ephemeral range (so that no
    outgoing connection takes one meanwhile)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        else:
            return base
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row")


def interrupt(signum: int, frame: FrameType | None) -> None:
    """A signal handler (SIGTERM, SIGHUP) that ends the run as Ctrl-C does: its cleanup runs."""
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def run_guarded(
    tracker: Tracker, body: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any], int, list[str]]:
    """Run ``body(results)`` with SIGTERM ending it as Ctrl-C does, then kill every process of
    the run. Returns the results, the exit code so far (0; 1 after an error, which is printed
    and put in ``results["error"]``; 130 when interrupted) and what was left running (said on
    stderr; a reason to exit 1)."""
    signal.signal(signal.SIGTERM, interrupt)
    results: dict[str, Any] = {}
    code = 0
    try:
        try:
            body(results)
        finally:
            tracker.kill_all()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # report it, clean up, exit 1
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        results["error"] = f"{type(e).__name__}: {e}"
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left = tracker.kill_all()
    if left:
        print(f"LEFT RUNNING: {left}", file=sys.stderr)
        code = code or 1
    if code == 130:
        print("leftover processes: " + (", ".join(left) if left else "none"))
    return results, code, left


# --------------------------------------------------------------------------- the supervisor's log


class Log:
    """The supervisor's JSON log lines (``--log-format json``), read by a thread; waits on a
    condition, no polling."""

    def __init__(self, stream: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.other: list[str] = []  # lines that are not JSON
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                with self._cond:
                    self.other.append(line.rstrip())
                continue
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()

    def mark(self) -> int:
        with self._cond:
            return len(self.events)

    def wait(
        self, timeout: float, after: int = 0, n: int = 1, **match: Any
    ) -> list[dict[str, Any]]:
        """The first ``n`` events after ``after`` matching ``match``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [
                    e for e in self.events[after:] if all(e.get(k) == v for k, v in match.items())
                ]
                if len(found) >= n:
                    return found[:n]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{len(found)} of {n} events {match} within {timeout} s")
                self._cond.wait(remaining)

    def count(self, **match: Any) -> int:
        with self._cond:
            return sum(all(e.get(k) == v for k, v in match.items()) for e in self.events)

    def tail(self, n: int = 8) -> str:
        with self._cond:
            lines = [json.dumps(e) for e in self.events[-n:]] + self.other[-n:]
        return "\n".join(lines[-n:])


def ts(event: dict[str, Any]) -> float:
    """A log event's ``timestamp``, in ``time.time()`` seconds."""
    return datetime.fromisoformat(event["timestamp"]).timestamp()
