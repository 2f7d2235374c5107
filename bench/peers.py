#!/usr/bin/env python3
"""Comparative benchmark of the supervision core: gpu-supervisor vs supervisord vs circus.

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/peers.py            # full run (~5-6 minutes)
    .venv/bin/python bench/peers.py --quick    # smoke run (~1 minute)

The harness creates its own virtual environments for the peers under ``bench/.venvs/`` (pinned
versions, installed with pip on first use) so that anyone can reproduce the figures. It never
installs PyPI's ``supervisor`` into the project venv: that distribution's import name clashes
with our own package.

Every figure is measured against the same tiny worker (``bench/worker.py``), interleaved
round-robin across the supervisors (the order rotates every round), so that machine drift
affects all of them alike. See ``bench/README.md`` for what each figure means.

Harness dependencies: stdlib + psutil.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from benchkit import Tracker, interrupt

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
VENVS_DIR = BENCH_DIR / ".venvs"
RESULTS_DIR = BENCH_DIR / "results"
WORKER = BENCH_DIR / "worker.py"
PROJECT_PYTHON = Path(sys.executable)

# Pinned so that a rerun measures the same peers; bump deliberately.
SUPERVISORD_SPEC = "supervisor==4.3.0"
CIRCUS_SPEC = "circus==0.19.0"

WORKERS = 32
STOP_TIMEOUT_S = 2.0
CIRCUS_CHECK_DELAY_S = 0.1
POLL_S = 0.001  # start-file poll period
GONE_POLL_S = 0.002  # pid-liveness poll period during stop
SETTLE_S = 1.0  # after the last worker started: let start-up transients pass before RSS/CPU
START_DEADLINE_S = 30.0
STOP_DEADLINE_S = 20.0
RESPAWN_DEADLINE_S = 10.0
PIP_TIMEOUT_S = 600.0

OURS = "gpu-supervisor"
SUPERVISORD = "supervisord"
CIRCUS = "circus"
FLOOR = "floor"
SUPERVISORS = (OURS, SUPERVISORD, CIRCUS)

TARGETS = {
    "crash_ms": "median <= floor median + 5 ms",
    "start_s": "<= 0.5 s",
    "stop_s": "<= 2.15 s",
    "idle_cpu_s_per_min": "<= 0.1 s per minute",
    "rss_mib": "<= 60 MiB",
}


class BenchError(Exception):
    """One measurement could not be taken (deadline, supervisor died, ...)."""


class Unavailable(BenchError):
    """A supervisor cannot be run at all on this machine/checkout: skip it for the whole run."""


@dataclass(frozen=True)
class Plan:
    rounds: int
    kills_per_round: int
    idle_s_per_round: float
    floor_per_round: int
    budget_s: float


FULL = Plan(rounds=6, kills_per_round=5, idle_s_per_round=10.0, floor_per_round=5, budget_s=540)
QUICK = Plan(rounds=2, kills_per_round=4, idle_s_per_round=5.0, floor_per_round=4, budget_s=110)


# --------------------------------------------------------------------------- start-file reading


class StartFile:
    """Incremental reader of the workers' ``<pid> <time_ns>`` lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.write_bytes(b"")
        self._offset = 0
        self._partial = b""
        self.lines: list[tuple[int, int]] = []

    def poll(self) -> int:
        """Read new complete lines; return how many arrived."""
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        if not data:
            return 0
        self._offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        for raw in complete:
            pid, ns = raw.split()
            self.lines.append((int(pid), int(ns)))
        return len(complete)

    def pids(self) -> set[int]:
        return {pid for pid, _ in self.lines}


def lines_at_least(starts: StartFile, n: int) -> Callable[[], bool]:
    """Condition: the start file holds at least ``n`` lines."""

    def cond() -> bool:
        starts.poll()
        return len(starts.lines) >= n

    return cond


def pids_at_least(starts: StartFile, n: int) -> Callable[[], bool]:
    """Condition: at least ``n`` distinct pids have written a start line."""

    def cond() -> bool:
        starts.poll()
        return len(starts.pids()) >= n

    return cond


def wait_until(
    cond: Callable[[], bool],
    deadline_s: float,
    what: str,
    period_s: float = POLL_S,
    alive: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll ``cond`` until it holds; raise BenchError at the deadline or if ``alive`` exits."""
    end = time.monotonic() + deadline_s
    while not cond():
        if alive is not None and alive.poll() is not None:
            raise BenchError(f"supervisor exited (rc={alive.returncode}) while waiting for {what}")
        if time.monotonic() > end:
            raise BenchError(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(period_s)


def _proc_starttime(pid: int) -> int | None:
    """Start time (clock ticks) of a live, non-zombie pid, else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


# --------------------------------------------------------------------------- the supervisors


@dataclass
class Session:
    """One running supervisor instance with its start file."""

    name: str
    proc: subprocess.Popen[bytes]
    starts: StartFile
    workdir: Path
    launched_ns: int
    log_path: Path

    def log_tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string for these paths


def child_env() -> dict[str, str]:
    """The harness's environment for a supervisor it launches, less what would change what it
    runs: ``GPU_SUPERVISOR_*`` settings, and ``PYTHONPATH`` (a checkout on it shadows the
    installed gpu-supervisor, and our package's import name ``supervisor`` shadows
    supervisord's own: ``No module named 'supervisor.supervisord'``)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPU_SUPERVISOR_") and k != "PYTHONPATH"
    }


def _worker_argv(ignore_term: bool) -> list[str]:
    argv = [str(PROJECT_PYTHON), "-S", str(WORKER)]
    if ignore_term:
        argv.append("--ignore-term")
    return argv


class Supervisor:
    name: str = ""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.unavailable: str | None = None
        self.version = ""

    def prepare(self) -> None:
        """Install/check; raise Unavailable when this supervisor cannot run here."""

    def launch_argv(self, config: Path) -> list[str]:
        raise NotImplementedError

    def write_config(self, workdir: Path, start_file: Path, n: int, ignore_term: bool) -> Path:
        raise NotImplementedError

    def cwd(self, workdir: Path) -> Path:
        return workdir

    def launch(self, workdir: Path, n: int, ignore_term: bool) -> Session:
        workdir.mkdir(parents=True)
        starts = StartFile(workdir / "starts.txt")
        config = self.write_config(workdir, starts.path, n, ignore_term)
        log_path = workdir / "supervisor.out"
        env = child_env()
        env["BENCH_RUN_ID"] = self.tracker.run_id
        env["PYTHONUNBUFFERED"] = "1"
        with log_path.open("wb") as log:
            launched_ns = time.time_ns()
            proc = subprocess.Popen(
                self.launch_argv(config),
                cwd=self.cwd(workdir),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.tracker.add_popen(proc)
        return Session(self.name, proc, starts, workdir, launched_ns, log_path)


def _venv_python(name: str) -> Path:
    return VENVS_DIR / name / "bin" / "python"


def ensure_venv(name: str, spec: str, log: Callable[[str], None]) -> Path:
    """Create ``bench/.venvs/<name>`` with ``spec`` installed (once); return its bin dir."""
    venv = VENVS_DIR / name
    marker = venv / ".bench-installed"
    if marker.exists() and marker.read_text().strip() == spec and _venv_python(name).exists():
        return venv / "bin"
    log(f"creating {venv} and installing {spec} (one-time) ...")
    VENVS_DIR.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    try:
        subprocess.run(
            [base, "-m", "venv", "--clear", str(venv)],
            check=True,
            capture_output=True,
            timeout=PIP_TIMEOUT_S,
        )
        subprocess.run(
            [
                str(_venv_python(name)),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                spec,
            ],
            check=True,
            capture_output=True,
            timeout=PIP_TIMEOUT_S,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-3:]
        raise Unavailable(f"installing {spec} failed: {' | '.join(tail)}") from None
    except subprocess.TimeoutExpired:
        raise Unavailable(f"installing {spec} took over {PIP_TIMEOUT_S:g} s") from None
    marker.write_text(spec + "\n")
    return venv / "bin"


def _dist_version(python: Path, dist: str) -> str:
    out = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout.strip() or "?"


class Supervisord(Supervisor):
    name = SUPERVISORD

    def __init__(self, tracker: Tracker, log: Callable[[str], None]) -> None:
        super().__init__(tracker)
        self._log = log
        self.bin = Path()

    def prepare(self) -> None:
        self.bin = ensure_venv("supervisord", SUPERVISORD_SPEC, self._log)
        self.version = "supervisord " + _dist_version(self.bin / "python", "supervisor")

    def launch_argv(self, config: Path) -> list[str]:
        return [str(self.bin / "supervisord"), "-n", "-c", str(config)]

    def write_config(self, workdir: Path, start_file: Path, n: int, ignore_term: bool) -> Path:
        command = " ".join(_worker_argv(ignore_term))
        env = f'BENCH_START_FILE="{start_file}",BENCH_RUN_ID="{self.tracker.run_id}"'
        text = f"""\
[supervisord]
nodaemon=true
logfile={workdir}/supervisord.log
pidfile={workdir}/supervisord.pid
childlogdir={workdir}
loglevel=warn

[program:bench]
command={command}
process_name=%(program_name)s_%(process_num)02d
numprocs={n}
autostart=true
autorestart=true
startsecs=0
startretries=1000000
stopsignal=TERM
stopwaitsecs={STOP_TIMEOUT_S:g}
stopasgroup=true
killasgroup=true
stdout_logfile=NONE
stderr_logfile=NONE
environment={env}
"""
        path = workdir / "supervisord.conf"
        path.write_text(text)
        return path


class Circus(Supervisor):
    name = CIRCUS

    def __init__(self, tracker: Tracker, log: Callable[[str], None]) -> None:
        super().__init__(tracker)
        self._log = log
        self.bin = Path()

    def prepare(self) -> None:
        self.bin = ensure_venv("circus", CIRCUS_SPEC, self._log)
        self.version = "circus " + _dist_version(self.bin / "python", "circus")

    def launch_argv(self, config: Path) -> list[str]:
        return [str(self.bin / "circusd"), str(config)]

    def write_config(self, workdir: Path, start_file: Path, n: int, ignore_term: bool) -> Path:
        argv = _worker_argv(ignore_term)
        text = f"""\
[circus]
check_delay = {CIRCUS_CHECK_DELAY_S:g}
endpoint = ipc://{workdir}/endpoint
pubsub_endpoint = ipc://{workdir}/pubsub
statsd = false
httpd = false
loglevel = warning
logoutput = {workdir}/circusd.log

[watcher:bench]
cmd = {argv[0]}
args = {" ".join(argv[1:])}
numprocesses = {n}
respawn = true
max_retry = -1
warmup_delay = 0
graceful_timeout = {STOP_TIMEOUT_S:g}
stop_signal = SIGTERM
stop_children = true
copy_env = true

[env:bench]
BENCH_START_FILE = {start_file}
BENCH_RUN_ID = {self.tracker.run_id}
"""
        # No stats_endpoint on purpose: setting one silently turns statsd on (circusd-stats).
        path = workdir / "circus.ini"
        path.write_text(text)
        return path


class GpuSupervisor(Supervisor):
    """gpu-supervisor as users install it: built from this checkout into its own venv (runtime
    dependencies only, bytecode compiled by pip), like the peers, and run from outside the
    checkout so that the installed package is the one imported."""

    name = OURS

    def __init__(self, tracker: Tracker, log: Callable[[str], None]) -> None:
        super().__init__(tracker)
        self._log = log
        self.bin = Path()

    def prepare(self) -> None:
        main = REPO_ROOT / "supervisor" / "__main__.py"
        if not main.exists():
            raise Unavailable(f"{main.relative_to(REPO_ROOT)} does not exist yet")
        self.bin = ensure_venv(OURS, str(REPO_ROOT), self._log)
        # The venv is made once; the package is reinstalled from the checkout on every run.
        reinstall = subprocess.run(
            [str(self.bin / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
             "--force-reinstall", "--disable-pip-version-check", str(REPO_ROOT)],
            capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False,
        )  # fmt: skip
        if reinstall.returncode != 0:
            tail = reinstall.stderr.strip().splitlines()[-1:] or [""]
            raise Unavailable(f"installing {REPO_ROOT} failed: {tail[0][:200]}")
        probe = subprocess.run(
            [str(self.bin / "python"), "-m", "supervisor", "run", "--help"],
            cwd=VENVS_DIR,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if probe.returncode != 0:
            lines = (probe.stderr or probe.stdout).strip().splitlines()
            first = lines[-1] if lines else ""
            raise Unavailable(
                f"`python -m supervisor run --help` exited {probe.returncode}: {first[:200]}"
            )
        self.version = "gpu-supervisor " + _dist_version(self.bin / "python", "gpu-supervisor")

    def cwd(self, workdir: Path) -> Path:
        return workdir

    def launch_argv(self, config: Path) -> list[str]:
        return [str(self.bin / "python"), "-m", "supervisor", "run", "-c", str(config)]

    def write_config(self, workdir: Path, start_file: Path, n: int, ignore_term: bool) -> Path:
        command = ", ".join(_toml_str(a) for a in _worker_argv(ignore_term))
        text = f"""\
[supervisor]
state_dir = {_toml_str(str(workdir / "state"))}
shutdown_timeout_s = 30

[gpu]
backend = "none"  # the supervision core only: same on every machine, GPU or not

[[workers]]
name = "bench"
command = [{command}]
replicas = {n}
ready = "none"
gpus = "none"
stop_timeout_s = {STOP_TIMEOUT_S:g}
env = {{ BENCH_START_FILE = {_toml_str(str(start_file))}, \
BENCH_RUN_ID = {_toml_str(self.tracker.run_id)} }}

[workers.restart]
stable_s = 0
burst = 0
backoff_initial_s = 0
"""
        path = workdir / "gpu-supervisor.toml"
        path.write_text(text)
        return path


# --------------------------------------------------------------------------- measurements


def supervisor_procs(root: int, workers: set[int]) -> list[psutil.Process]:
    """The supervisor's own processes: root plus descendants that are not workers."""
    try:
        top = psutil.Process(root)
        children = top.children(recursive=True)
    except psutil.Error:
        return []
    procs = [top]
    for child in children:
        if child.pid in workers:
            continue
        with contextlib.suppress(psutil.Error):
            if any(a.pid in workers for a in child.parents()):
                continue
            procs.append(child)
    return procs


def cpu_seconds(procs: Sequence[psutil.Process]) -> dict[int, float]:
    out: dict[int, float] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


def sched_seconds(procs: Sequence[psutil.Process]) -> float | None:
    """On-CPU time in ns precision from /proc/<pid>/task/*/schedstat (None if unavailable).

    A cross-check of ``cpu_times()``, which the kernel accounts in whole clock ticks.
    """
    total = 0
    try:
        for p in procs:
            for task in os.listdir(f"/proc/{p.pid}/task"):
                with open(f"/proc/{p.pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def rss_bytes(procs: Sequence[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def stop_session(sess: Session, tracker: Tracker, pids: dict[int, int | None]) -> float:
    """SIGTERM the supervisor; return seconds until every worker pid and it are gone."""
    t0 = time.time_ns()
    os.kill(sess.proc.pid, signal.SIGTERM)
    remaining = dict(pids)

    def all_gone() -> bool:
        for pid, st in list(remaining.items()):
            now = _proc_starttime(pid)
            if now is None or (st is not None and now != st):
                del remaining[pid]
        return not remaining and sess.proc.poll() is not None

    wait_until(all_gone, STOP_DEADLINE_S, "workers and supervisor to exit", GONE_POLL_S)
    return (time.time_ns() - t0) / 1e9


def terminate(sess: Session, tracker: Tracker) -> None:
    """Best-effort end of a session (after a failure): kill it and everything it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sess.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        sess.proc.wait(timeout=5)
    with contextlib.suppress(OSError, ValueError, BenchError):
        sess.starts.poll()
    for pid in sess.starts.pids():
        tracker.add_pid(pid)
    tracker.kill_all()


def measure_many(sup: Supervisor, workdir: Path, idle_s: float, tracker: Tracker) -> dict[str, Any]:
    """Start 32 SIGTERM-ignoring workers, sit idle, stop: start/RSS/idle CPU/stop figures."""
    sess = sup.launch(workdir, WORKERS, ignore_term=True)
    try:
        wait_until(
            pids_at_least(sess.starts, WORKERS),
            START_DEADLINE_S,
            f"{WORKERS} worker start lines",
            alive=sess.proc,
        )
        first = sess.starts.lines[:WORKERS]
        start_s = (max(ns for _, ns in first) - sess.launched_ns) / 1e9
        spread_s = (max(ns for _, ns in first) - min(ns for _, ns in first)) / 1e9
        worker_pids = {pid: _proc_starttime(pid) for pid, _ in first}
        for pid in worker_pids:
            tracker.add_pid(pid)
        # Settle: a fixed measurement phase, not a wait for a condition.
        time.sleep(SETTLE_S)
        procs = supervisor_procs(sess.proc.pid, set(worker_pids))
        for p in procs:
            tracker.add_pid(p.pid)
        rss = rss_bytes(procs)
        before = cpu_seconds(procs)
        sched_before = sched_seconds(procs)
        t_idle0 = time.monotonic()
        time.sleep(idle_s)  # the idle window itself
        window = time.monotonic() - t_idle0
        after = cpu_seconds(procs)
        sched_after = sched_seconds(procs)
        rss_after = rss_bytes(procs)
        cpu = sum(after[pid] - before[pid] for pid in before if pid in after)
        sess.starts.poll()
        restarts = len(sess.starts.lines) - WORKERS
        stop_s = stop_session(sess, tracker, worker_pids)
    except BaseException:
        terminate(sess, tracker)
        raise
    tracker.kill_all()
    return {
        "start_s": start_s,
        "start_spread_s": spread_s,
        "rss_bytes": rss,
        "rss_bytes_after_idle": rss_after,
        "supervisor_processes": len(procs),
        "idle_cpu_s": cpu,
        "idle_cpu_schedstat_s": (
            None if sched_before is None or sched_after is None else sched_after - sched_before
        ),
        "idle_window_s": window,
        "unexpected_restarts": restarts,
        "stop_s": stop_s,
    }


def measure_crashes(
    sup: Supervisor, workdir: Path, kills: int, rng: random.Random, tracker: Tracker
) -> list[float]:
    """One worker; SIGKILL it ``kills`` times; return kill -> replacement-start latencies (s)."""
    sess = sup.launch(workdir, 1, ignore_term=False)
    out: list[float] = []
    try:
        wait_until(
            lines_at_least(sess.starts, 1),
            START_DEADLINE_S,
            "the first worker start line",
            alive=sess.proc,
        )
        for _ in range(kills):
            # A random gap de-phases the kills from any periodic loop in the supervisor
            # (supervisord ticks at 1 s, circus at check_delay), so every phase is sampled.
            time.sleep(rng.uniform(0.1, 1.1))
            sess.starts.poll()
            victim = sess.starts.lines[-1][0]
            tracker.add_pid(victim)
            seen = len(sess.starts.lines)
            t_kill = time.time_ns()
            os.kill(victim, signal.SIGKILL)
            wait_until(
                lines_at_least(sess.starts, seen + 1),
                RESPAWN_DEADLINE_S,
                "the replacement's start line",
                alive=sess.proc,
            )
            pid, ns = sess.starts.lines[seen]
            tracker.add_pid(pid)
            out.append((ns - t_kill) / 1e9)
        sess.starts.poll()
        pids = {pid: _proc_starttime(pid) for pid, _ in sess.starts.lines[-1:]}
        stop_session(sess, tracker, pids)
    except BaseException:
        terminate(sess, tracker)
        raise
    tracker.kill_all()
    return out


def measure_floor(workdir: Path, n: int, rng: random.Random, tracker: Tracker) -> list[float]:
    """Bare fork+exec of the same worker from the harness: Popen call -> start line (s)."""
    workdir.mkdir(parents=True)
    starts = StartFile(workdir / "starts.txt")
    env = dict(os.environ, BENCH_START_FILE=str(starts.path), BENCH_RUN_ID=tracker.run_id)
    out = []
    for _ in range(n):
        time.sleep(rng.uniform(0.05, 0.3))
        seen = len(starts.lines)
        t0 = time.time_ns()
        proc = subprocess.Popen(
            _worker_argv(False),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        tracker.add_popen(proc)
        try:
            wait_until(
                lines_at_least(starts, seen + 1),
                RESPAWN_DEADLINE_S,
                "the floor worker's start line",
            )
            out.append((starts.lines[seen][1] - t0) / 1e9)
        finally:
            proc.kill()
            proc.wait(timeout=5)
    return out


def measure_floor_many(workdir: Path, tracker: Tracker) -> dict[str, Any]:
    """Bare fork+exec of 32 workers back to back: first Popen call -> last start line."""
    workdir.mkdir(parents=True)
    starts = StartFile(workdir / "starts.txt")
    env = dict(os.environ, BENCH_START_FILE=str(starts.path), BENCH_RUN_ID=tracker.run_id)
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.time_ns()
    try:
        for _ in range(WORKERS):
            proc = subprocess.Popen(
                _worker_argv(True),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            tracker.add_popen(proc)
            procs.append(proc)
        wait_until(pids_at_least(starts, WORKERS), START_DEADLINE_S, "the floor's start lines")
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=5)
    stamps = [ns for _, ns in starts.lines[:WORKERS]]
    return {
        "start_s": (max(stamps) - t0) / 1e9,
        "start_spread_s": (max(stamps) - min(stamps)) / 1e9,
    }


# --------------------------------------------------------------------------- reporting


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _p90(xs: Sequence[float]) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def _per_min(values: Sequence[float | None], window_s: float) -> float | None:
    if not values or not window_s or any(v is None for v in values):
        return None
    return 60 * sum(v for v in values if v is not None) / window_s


def summarise(raw: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for name in (FLOOR, *SUPERVISORS):
        r = raw.get(name, {})
        crash = r.get("crash_s", [])
        many = r.get("many", [])
        idle_cpu = sum(m.get("idle_cpu_s", 0.0) for m in many)
        idle_win = sum(m.get("idle_window_s", 0.0) for m in many)
        out[name] = {
            "crash_median_ms": None if not crash else 1000 * (_median(crash) or 0),
            "crash_p90_ms": None if not crash else 1000 * (_p90(crash) or 0),
            "crash_n": len(crash),
            "start_s": _median([m["start_s"] for m in many]),
            "start_spread_s": _median([m["start_spread_s"] for m in many]),
            "stop_s": _median([m["stop_s"] for m in many if "stop_s" in m]),
            "idle_cpu_s_per_min": (60 * idle_cpu / idle_win) if idle_win else None,
            "idle_cpu_schedstat_s_per_min": _per_min(
                [m.get("idle_cpu_schedstat_s") for m in many if "idle_window_s" in m], idle_win
            ),
            "idle_window_s": idle_win,
            "rss_mib": (
                None
                if not any("rss_bytes" in m for m in many)
                else (_median([m["rss_bytes"] for m in many if "rss_bytes" in m]) or 0) / 2**20
            ),
            "rounds": len(many),
        }
    return out


def _fmt(value: float | None, unit: str, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f} {unit}"


def render_table(summary: dict[str, dict[str, float | None]], status: dict[str, str]) -> str:
    def col(name: str, key: str, unit: str, digits: int) -> str:
        if status.get(name):
            return "not run"
        return _fmt(summary[name][key], unit, digits)

    rows: list[tuple[str, str, str, int, bool]] = [
        ("crash → replacement started, median", "crash_median_ms", "ms", 1, True),
        ("crash → replacement started, p90", "crash_p90_ms", "ms", 1, True),
        (f"start {WORKERS} workers (launch → last start line)", "start_s", "s", 3, True),
        ("… of which 1st → last start line", "start_spread_s", "s", 3, True),
        (f"stop {WORKERS} SIGTERM-ignoring workers (2 s timeout)", "stop_s", "s", 3, False),
        (f"idle CPU with {WORKERS} workers", "idle_cpu_s_per_min", "s/min", 3, False),
        (
            "… same, from schedstat (ns precision)",
            "idle_cpu_schedstat_s_per_min",
            "s/min",
            3,
            False,
        ),
        (f"RSS after start with {WORKERS} workers", "rss_mib", "MiB", 1, False),
    ]
    lines = [
        f"| metric | floor | {' | '.join(SUPERVISORS)} |",
        "|---|---|" + "---|" * len(SUPERVISORS),
    ]
    for label, key, unit, digits, has_floor in rows:
        floor = _fmt(summary[FLOOR][key], unit, digits) if has_floor else ""
        cells = [col(name, key, unit, digits) for name in SUPERVISORS]
        lines.append(f"| {label} | {floor} | {' | '.join(cells)} |")
    return "\n".join(lines)


def verdicts(summary: dict[str, dict[str, float | None]]) -> dict[str, dict[str, Any]]:
    """PASS/FAIL of each supervisor against the issue's targets."""
    out: dict[str, dict[str, Any]] = {}
    floor = summary[FLOOR]["crash_median_ms"]
    for name in SUPERVISORS:
        s = summary[name]
        checks: dict[str, bool | None] = {}
        crash = s["crash_median_ms"]
        checks["crash_ms"] = None if crash is None or floor is None else crash <= floor + 5
        checks["start_s"] = None if s["start_s"] is None else s["start_s"] <= 0.5
        checks["stop_s"] = None if s["stop_s"] is None else s["stop_s"] <= 2.15
        cpu = s["idle_cpu_s_per_min"]
        checks["idle_cpu_s_per_min"] = None if cpu is None else cpu <= 0.1
        checks["rss_mib"] = None if s["rss_mib"] is None else s["rss_mib"] <= 60
        out[name] = checks
    return out


def render_targets(
    summary: dict[str, dict[str, float | None]],
    verdict: dict[str, dict[str, Any]],
    status: dict[str, str],
) -> str:
    def word(v: bool | None) -> str:
        return "n/a" if v is None else ("PASS" if v else "FAIL")

    values = {
        "crash_ms": ("crash_median_ms", "ms", 1),
        "start_s": ("start_s", "s", 3),
        "stop_s": ("stop_s", "s", 3),
        "idle_cpu_s_per_min": ("idle_cpu_s_per_min", "s/min", 3),
        "rss_mib": ("rss_mib", "MiB", 1),
    }
    lines = [
        f"| target | {OURS} | (supervisord) | (circus) |",
        "|---|---|---|---|",
    ]
    for key, text in TARGETS.items():
        skey, unit, digits = values[key]
        cells = []
        for name in SUPERVISORS:
            if status.get(name):
                cells.append("not run")
                continue
            cells.append(f"{word(verdict[name][key])} ({_fmt(summary[name][skey], unit, digits)})")
        lines.append(f"| {text} | {' | '.join(cells)} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """Finish cleanup even if Ctrl-C is pressed again."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _git_rev() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    rev = out.stdout.strip() or "no-commit"
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    return rev + ("+dirty" if dirty.stdout.strip() else "")


def run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = Plan(
            args.rounds, plan.kills_per_round, plan.idle_s_per_round, plan.floor_per_round, 1e9
        )
    t_begin = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_begin:6.1f}s] {msg}", file=sys.stderr, flush=True)

    tracker = Tracker()
    rng = random.Random(args.seed)
    sups: dict[str, Supervisor] = {
        OURS: GpuSupervisor(tracker, log),
        SUPERVISORD: Supervisord(tracker, log),
        CIRCUS: Circus(tracker, log),
    }
    only = set(args.only.split(",")) if args.only else set(SUPERVISORS)
    status: dict[str, str] = {}  # name -> why it was skipped ("" / absent = ran)
    raw: dict[str, Any] = {name: {"crash_s": [], "many": [], "errors": []} for name in SUPERVISORS}
    raw[FLOOR] = {"crash_s": [], "many": [], "errors": []}
    leftovers: list[str] = []
    truncated = False
    interrupted = False

    for name, sup in sups.items():
        if name not in only:
            status[name] = "excluded with --only"
            continue
        try:
            sup.prepare()
            log(f"{name}: ready ({sup.version})")
        except Unavailable as exc:
            status[name] = str(exc)
            log(f"{name}: SKIPPED — {exc}")

    # The run's time budget starts after the one-time installs.
    deadline = time.monotonic() + plan.budget_s
    tmp = Path(tempfile.mkdtemp(prefix="gsbench-"))
    order = [n for n in SUPERVISORS if not status.get(n)]
    round_times: list[float] = []
    old_handlers = {
        s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        for rnd in range(plan.rounds):
            if round_times and time.monotonic() + max(round_times) * 1.2 > deadline:
                truncated = True
                log(f"time budget reached: stopping after {rnd} rounds")
                break
            t_round = time.monotonic()
            rotation = order[rnd % len(order) :] + order[: rnd % len(order)] if order else []
            participants = [FLOOR, *rotation]
            log(f"round {rnd + 1}/{plan.rounds}: {' → '.join(participants)}")
            for name in participants:
                rdir = tmp / f"r{rnd}-{name}"
                try:
                    if name == FLOOR:
                        raw[FLOOR]["crash_s"] += measure_floor(
                            rdir / "crash", plan.floor_per_round, rng, tracker
                        )
                        raw[FLOOR]["many"].append(measure_floor_many(rdir / "many", tracker))
                        continue
                    if status.get(name):
                        continue
                    sup = sups[name]
                    lat = measure_crashes(sup, rdir / "crash", plan.kills_per_round, rng, tracker)
                    raw[name]["crash_s"] += lat
                    many = measure_many(sup, rdir / "many", plan.idle_s_per_round, tracker)
                    raw[name]["many"].append(many)
                    log(
                        f"  {name}: crash median {1000 * statistics.median(lat):.1f} ms, "
                        f"start {many['start_s']:.3f} s, stop {many['stop_s']:.3f} s, "
                        f"rss {many['rss_bytes'] / 2**20:.1f} MiB, "
                        f"idle cpu {many['idle_cpu_s']:.3f} s/{many['idle_window_s']:.0f} s"
                    )
                except BenchError as exc:
                    tail = ""
                    logs = sorted(rdir.glob("**/supervisor.out"))
                    if logs:
                        text = logs[-1].read_text(errors="replace").strip().splitlines()
                        tail = " | ".join(text[-3:])[:400]
                    msg = f"round {rnd + 1}: {exc}" + (f" — output: {tail}" if tail else "")
                    raw[name]["errors"].append(msg)
                    log(f"  {name}: ERROR {msg}")
                    if name != FLOOR and not raw[name]["many"] and not raw[name]["crash_s"]:
                        status[name] = f"failed on first use: {msg}"
                        log(f"  {name}: SKIPPED for the rest of the run")
                    leftovers += tracker.kill_all()
            round_times.append(time.monotonic() - t_round)
    except KeyboardInterrupt as exc:
        interrupted = True
        log(f"interrupted ({exc or 'Ctrl-C'}): cleaning up")
    finally:
        with _no_interrupts():
            leftovers += tracker.kill_all()
            for s, h in old_handlers.items():
                signal.signal(s, h)
    if leftovers:
        log(f"WARNING: processes survived cleanup: {leftovers}")
    else:
        log("cleanup verified: no process of this run is left")

    summary = summarise(raw)
    verdict = verdicts(summary)
    table = render_table(summary, status)
    targets = render_targets(summary, verdict, status)
    cpu = platform.processor() or platform.machine()
    header = (
        f"{'--quick' if args.quick else 'full'} run, {len(round_times)} complete rounds"
        f"{' (interrupted)' if interrupted else ''}, "
        f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
        f"{', '.join(sups[n].version for n in SUPERVISORS if not status.get(n))}"
    )
    print()
    print(header)
    print()
    print(table)
    print()
    print("Targets (from the issue), PASS/FAIL for gpu-supervisor; peers shown for reference:")
    print()
    print(targets)
    window = max((summary[n]["idle_window_s"] or 0.0) for n in SUPERVISORS)
    if window:
        tick = 1 / os.sysconf("SC_CLK_TCK")
        print(
            f"\nnote: idle CPU is counted in {tick:g} s kernel ticks over a {window:.0f} s window: "
            f"resolution {60 * tick / window:.3f} s/min"
        )
    for name, why in status.items():
        print(f"\nnote: {name} not run: {why}")
    if truncated:
        print("\nnote: run truncated by the time budget")
    for name in (FLOOR, *SUPERVISORS):
        for err in raw[name]["errors"]:
            print(f"\nerror ({name}): {err}")

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_path = RESULTS_DIR / f"peers-{stamp}.json"
    out_path.write_text(
        json.dumps(
            {
                "schema": 1,
                "when": stamp,
                "mode": "quick" if args.quick else "full",
                "plan": plan.__dict__,
                "seed": args.seed,
                "git": _git_rev(),
                "host": {
                    "cpus": os.cpu_count(),
                    "machine": platform.machine(),
                    "kernel": platform.release(),
                    "python": platform.python_version(),
                },
                "versions": {n: sups[n].version for n in SUPERVISORS},
                "skipped": status,
                "truncated": truncated,
                "interrupted": interrupted,
                "leftover_processes": leftovers,
                "elapsed_s": time.monotonic() - t_begin,
                "settings": {
                    "workers": WORKERS,
                    "stop_timeout_s": STOP_TIMEOUT_S,
                    "circus_check_delay_s": CIRCUS_CHECK_DELAY_S,
                    "settle_s": SETTLE_S,
                },
                "summary": summary,
                "targets": verdict,
                "raw": raw,
                "table_markdown": table,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nraw results: {out_path.relative_to(REPO_ROOT)}")
    if interrupted:
        return 130
    return 1 if leftovers else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short smoke run (< 2 minutes)")
    parser.add_argument("--rounds", type=int, default=0, help="override the number of rounds")
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of: {','.join(SUPERVISORS)}"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the random inter-kill gaps")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
