"""A big node: 64 workers on 8 simulated GPUs.

    .venv/bin/python bench/big_node.py [--groups 4] [--per-group 16] [--requests 50] [--quick]
        [--phases big,reload,rollout,loading] [--tree CHECKOUT]

Every phase is a fresh ``gpu-supervisor run`` of this checkout (or of ``--tree``: the same
bench on another version; ``PYTHONPATH`` on it, API on
``127.0.0.1:0``: the supervisor binds port 0 and logs the URL), ``[gpu] backend = "sim"`` with
8 sim devices, ``max_workers_per_gpu = 8``, ``sample_interval_s = 0.5``, ``stop_timeout_s =
2``, ``[workers.restart] stable_s = 0``, in a temp dir. Workers are ``python -S
bench/worker.py`` (stdlib only).

1. ``big``: ``--groups`` x ``--per-group`` workers (``--sim-mib 500 --ignore-term``,
   ``ready = "none"``): launch -> all ready in ``GET /api/v1/workers`` (polled every 0.1 s; and the workers' first
   and last start lines); after a 3 s settle, ``--requests`` GETs each (a new connection each)
   of ``/api/v1/workers``, ``/metrics``, ``/api/v1/gpu/status``: size, p50, p99;
   ``state.json``'s size and how often it is replaced in 5 s idle; the mean sampler tick
   (``sample_duration_seconds`` sum / count from ``/metrics``); the supervisor's RSS; SIGKILL
   of every worker at once -> the last replacement's ``worker.spawned`` and all ready again,
   ``/healthz`` asked every 20 ms meanwhile; then SIGTERM to the supervisor -> it has exited
   and every worker pid is gone (the workers ignore SIGTERM: ``stop_timeout_s`` + its
   reaction).
2. ``reload``: one group of ``--per-group`` SIGTERM-ignoring workers; the config rewritten to
   a quarter of them, then SIGHUP -> the supervisor's ``supervisor.reload_done`` (each removed worker needs
   the SIGKILL after ``stop_timeout_s``: ~2 s when they are stopped together).
3. ``rollout``: ``--groups`` x ``--per-group`` SIGTERM-ignoring workers; the config rewritten
   with another environment for every group, then SIGHUP -> ``supervisor.reload_done``, and
   when each group's last replacement was spawned (each replacement waits ``stop_timeout_s``
   for its SIGKILL).
4. ``loading``: ``--groups`` x ``--per-group`` workers behind
   ``ready = "http://127.0.0.1:{port}/health"`` answering 503 (``bench/worker.py --http-503``: loading, never ready; ``start_timeout_s =
   300``), which the supervisor asks every 0.2 s: its CPU (``utime + stime`` of
   ``/proc/<pid>/stat``, workers excluded) over a 10 s window after a 6 s settle, in cores,
   and ``/healthz`` (a new connection every 0.1 s) meanwhile.

``--quick``: 2 groups x 8, 20 requests, 1 s settle, a 2 s idle window, a 5 s CPU window after
3 s (a smoke run, ~35 s). Every process the run starts (the supervisors, each in a session of
its own, and their workers, marked with ``BENCH_RUN_ID`` in their environment) is SIGKILLed
after each phase, on an error and on Ctrl-C / SIGTERM; the run then checks that none is left
(exit 1 if one is, 130 when interrupted). Raw results: ``bench/results/big-node-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
from benchkit import Log, Tracker, free_port_range, run_guarded, ts

ROOT = Path(__file__).resolve().parent.parent
#: The checkout whose supervisor runs (``--tree``: another, for a before/after comparison).
TREE = ROOT
WORKER = ROOT / "bench" / "worker.py"
GPUS = 8
PER_GPU = 8
PATHS = ("/api/v1/workers", "/metrics", "/api/v1/gpu/status")
SAMPLE_METRIC = "gpu_supervisor_sample_duration_seconds"


@dataclass(frozen=True)
class Plan:
    groups: int
    per_group: int
    requests: int
    settle_s: float
    idle_s: float
    cpu_settle_s: float
    cpu_s: float

    @property
    def total(self) -> int:
        return self.groups * self.per_group


# --------------------------------------------------------------------------- one supervisor


def _toml(value: str) -> str:
    return json.dumps(value)


def write_config(
    base: Path,
    run_id: str,
    groups: int,
    replicas: int,
    worker_args: list[str],
    ready: str = "none",
    port_base: int | None = None,
    extra: str = "",
    generation: int = 0,
) -> Path:
    argv = ", ".join(_toml(a) for a in [sys.executable, "-S", str(WORKER), *worker_args])
    env = f"BENCH_START_FILE = {_toml(str(base / 'starts'))}, BENCH_RUN_ID = {_toml(run_id)}"
    if generation:  # another environment: a reload rolls every group out
        env += f", BENCH_GENERATION = {_toml(str(generation))}"
    text = (
        f"[supervisor]\nstate_dir = {_toml(str(base / 'state'))}\nsample_interval_s = 0.5\n"
        f'[gpu]\nbackend = "sim"\nsim_dir = {_toml(str(base / "sim"))}\nsim_devices = {GPUS}\n'
        '[api]\nlisten = "127.0.0.1:0"\n'
    )
    for g in range(groups):
        text += (
            f'[[workers]]\nname = "g{g}"\ncommand = [{argv}]\nreplicas = {replicas}\n'
            f"env = {{ {env} }}\nmax_workers_per_gpu = {PER_GPU}\nready = {_toml(ready)}\n"
            "stop_timeout_s = 2\n"
            + (f"port_base = {port_base + g * replicas}\n" if port_base is not None else "")
            + extra
            + "[workers.restart]\nstable_s = 0\n"
        )
    path = base / "big-node.toml"
    path.write_text(text)
    return path


class Supervisor:
    """``gpu-supervisor run -c CFG`` in a session of its own, its JSON log read."""

    def __init__(self, cfg: Path, tracker: Tracker) -> None:
        env = {**os.environ, "PYTHONPATH": str(TREE), "BENCH_RUN_ID": tracker.run_id}
        self.launched = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "-c", str(cfg), "--log-format", "json"],
            cwd=TREE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        tracker.add_popen(self.proc)
        assert self.proc.stderr is not None
        self.log = Log(self.proc.stderr)
        try:
            url = urlsplit(self.log.wait(60, event="api.listening")[0]["url"])
        except TimeoutError:
            raise RuntimeError(
                f"no API (exit {self.proc.poll()}); log tail:\n{self.log.tail()}"
            ) from None
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80

    def get(self, path: str, timeout: float = 30) -> tuple[float, bytes]:
        """``GET path`` on a new connection: (seconds, body), whatever the status."""
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            body = conn.getresponse().read()
        finally:
            conn.close()
        return time.perf_counter() - t0, body

    def workers(self) -> list[dict[str, Any]]:
        data = json.loads(self.get("/api/v1/workers")[1])
        return data if isinstance(data, list) else data.get("workers", [])

    def pids(self) -> set[int]:
        return {int(w["pid"]) for w in self.workers() if w.get("pid")}

    def wait_ready(self, n: int, timeout: float, not_pids: set[int] | None = None) -> float:
        """Poll the API every 0.1 s until ``n`` workers are ready (none with a pid in
        ``not_pids``); return the ``time.time()`` it was seen."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError, ValueError):
                ready = {w.get("pid") for w in self.workers() if w.get("state") == "ready"}
                if len(ready) >= n and not (not_pids and ready & not_pids):
                    return time.time()
            time.sleep(0.1)
        raise TimeoutError(f"{n} workers not ready within {timeout} s")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"supervisor exited {self.proc.returncode}:\n{self.log.tail()}")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    def sigterm(self, worker_pids: set[int], timeout: float = 60) -> float:
        """SIGTERM -> the supervisor exited and every one of ``worker_pids`` is gone."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        while any(_alive(pid) for pid in worker_pids):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("workers outlived the supervisor")
            time.sleep(0.002)
        return time.monotonic() - t0


def _alive(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


class Prober:
    """``GET /healthz`` every ``every_s`` on a thread, a new connection each."""

    def __init__(self, sup: Supervisor, every_s: float) -> None:
        self.sup, self.every_s = sup, every_s
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.latencies.append(self.sup.get("/healthz", timeout=30)[0])
            except OSError:
                self.errors += 1
            self._stop.wait(self.every_s)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(40)
        lat = self.latencies
        return {
            "requests": len(lat),
            "errors": self.errors,
            "p50_ms": ms(statistics.median(lat)) if lat else None,
            "max_ms": ms(max(lat)) if lat else None,
        }


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def start_times(path: Path) -> list[float]:
    """The workers' start lines: ``<pid> <time_ns>``."""
    with contextlib.suppress(FileNotFoundError):
        return [int(line.split()[1]) / 1e9 for line in path.read_text().splitlines() if line]
    return []


# --------------------------------------------------------------------------- the phases


def phase_big(plan: Plan, base: Path, tracker: Tracker) -> dict[str, Any]:
    n = plan.total
    args = ["--sim-mib", "500", "--ignore-term"]
    sup = Supervisor(write_config(base, tracker.run_id, plan.groups, plan.per_group, args), tracker)
    out: dict[str, Any] = {}
    ready_at = sup.wait_ready(n, 120)
    starts = start_times(base / "starts")
    out["start"] = {
        "all_ready_s": round(ready_at - sup.launched, 3),
        "start_lines": len(starts),
        "first_start_s": round(min(starts) - sup.launched, 3),
        "last_start_s": round(max(starts) - sup.launched, 3),
    }
    time.sleep(plan.settle_s)

    api: dict[str, Any] = {}
    for path in PATHS:
        lat, size = [], 0
        for _ in range(plan.requests):
            dt, body = sup.get(path)
            lat.append(dt)
            size = len(body)
        api[path] = {
            "bytes": size,
            "requests": len(lat),
            "p50_ms": ms(statistics.median(lat)),
            "p99_ms": ms(pct(lat, 0.99)),
        }
    out["api"] = api

    state = base / "state" / "state.json"
    st = state.stat()
    out["state_json_bytes"] = st.st_size
    prev = (st.st_ino, st.st_mtime_ns)
    writes = 0
    t_end = time.monotonic() + plan.idle_s
    while time.monotonic() < t_end:
        with contextlib.suppress(FileNotFoundError):
            st = state.stat()
            if (st.st_ino, st.st_mtime_ns) != prev:
                writes, prev = writes + 1, (st.st_ino, st.st_mtime_ns)
        time.sleep(0.005)
    out["state_json_idle"] = {"writes": writes, "window_s": plan.idle_s}

    metrics = sup.get("/metrics")[1].decode()
    vals = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith((SAMPLE_METRIC + "_sum", SAMPLE_METRIC + "_count"))
    }
    total, count = vals.get(SAMPLE_METRIC + "_sum"), vals.get(SAMPLE_METRIC + "_count")
    out["sample_tick"] = {
        "sum_s": total,
        "count": count,
        "mean_ms": ms(total / count) if total is not None and count else None,
    }
    out["rss_mib"] = round(sup.rss_mib(), 1)

    # SIGKILL of every worker at once
    pids = sup.pids()
    prober = Prober(sup, 0.02)
    time.sleep(0.2)
    mark = sup.log.mark()
    killed_at = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    spawned = sup.log.wait(60, after=mark, n=len(pids), event="worker.spawned")
    ready_again = sup.wait_ready(n, 120, not_pids=pids)
    out["kill_all"] = {
        "killed": len(pids),
        "all_spawned_s": round(max(ts(e) for e in spawned) - killed_at, 3),
        "all_ready_s": round(ready_again - killed_at, 3),
        "healthz": prober.stop(),
    }
    time.sleep(1.0)
    pids = sup.pids()
    out["shutdown"] = {"workers": len(pids), "s": round(sup.sigterm(pids), 3)}
    out["supervisor_exit"] = sup.proc.returncode
    return out


def phase_reload(plan: Plan, base: Path, tracker: Tracker) -> dict[str, Any]:
    n, keep = plan.per_group, max(1, plan.per_group // 4)
    args = ["--sim-mib", "500", "--ignore-term"]
    sup = Supervisor(write_config(base, tracker.run_id, 1, n, args), tracker)
    sup.wait_ready(n, 60)
    time.sleep(1.0)
    write_config(base, tracker.run_id, 1, keep, args)
    mark = sup.log.mark()
    t0 = time.time()
    sup.proc.send_signal(signal.SIGHUP)
    done = sup.log.wait(120, after=mark, event="supervisor.reload_done")[0]
    reload_s = ts(done) - t0
    workers = sup.workers()
    pids = {int(w["pid"]) for w in workers if w.get("pid")}
    shutdown = sup.sigterm(pids)
    return {
        "from": n,
        "to": keep,
        "reload_s": round(reload_s, 3),
        "workers_after": len(workers),
        "halted": done.get("halted"),
        "shutdown_s": round(shutdown, 3),
        "supervisor_exit": sup.proc.returncode,
    }


def phase_rollout(plan: Plan, base: Path, tracker: Tracker) -> dict[str, Any]:
    """Every group changed by one reload: how long until each group is replaced."""
    n = plan.total
    args = ["--sim-mib", "500", "--ignore-term"]
    sup = Supervisor(write_config(base, tracker.run_id, plan.groups, plan.per_group, args), tracker)
    sup.wait_ready(n, 120)
    time.sleep(1.0)
    write_config(base, tracker.run_id, plan.groups, plan.per_group, args, generation=1)
    mark = sup.log.mark()
    t0 = time.time()
    sup.proc.send_signal(signal.SIGHUP)
    done = sup.log.wait(900, after=mark, event="supervisor.reload_done")[0]
    spawned = sup.log.wait(10, after=mark, n=n, event="worker.spawned")
    last: dict[str, float] = {}
    for e in spawned:
        group = str(e["worker"]).rsplit("-", 1)[0]
        last[group] = max(last.get(group, 0.0), ts(e) - t0)
    workers = sup.workers()
    pids = {int(w["pid"]) for w in workers if w.get("pid")}
    shutdown = sup.sigterm(pids)
    return {
        "groups": plan.groups,
        "per_group": plan.per_group,
        "reload_s": round(ts(done) - t0, 3),
        "last_replacement_s": {g: round(v, 3) for g, v in sorted(last.items())},
        "halted": done.get("halted"),
        "shutdown_s": round(shutdown, 3),
        "supervisor_exit": sup.proc.returncode,
    }


def phase_loading(plan: Plan, base: Path, tracker: Tracker) -> dict[str, Any]:
    n = plan.total
    cfg = write_config(
        base,
        tracker.run_id,
        plan.groups,
        plan.per_group,
        ["--http-503"],
        ready="http://127.0.0.1:{port}/health",
        port_base=free_port_range(n),
        extra="start_timeout_s = 300\n",
    )
    sup = Supervisor(cfg, tracker)
    sup.log.wait(120, n=n, event="worker.spawned")
    time.sleep(plan.cpu_settle_s)
    sup.check_alive()
    prober = Prober(sup, 0.1)
    c0, t0 = sup.cpu_s(), time.monotonic()
    time.sleep(plan.cpu_s)
    c1, t1 = sup.cpu_s(), time.monotonic()
    healthz = prober.stop()
    workers = sup.workers()
    states: dict[str, int] = {}
    for w in workers:
        states[w.get("state", "?")] = states.get(w.get("state", "?"), 0) + 1
    pids = {int(w["pid"]) for w in workers if w.get("pid")}
    shutdown = sup.sigterm(pids)
    return {
        "workers": n,
        "window_s": round(t1 - t0, 2),
        "cpu_s": round(c1 - c0, 3),
        "cores": round((c1 - c0) / (t1 - t0), 3),
        "healthz": healthz,
        "states": states,
        "shutdown_s": round(shutdown, 3),
        "supervisor_exit": sup.proc.returncode,
    }


# --------------------------------------------------------------------------- report


def table(r: dict[str, Any]) -> str:
    rows = []
    if "big" in r:
        rows += big_rows(r)
    if "reload" in r:
        rl = r["reload"]
        rows.append(
            (
                f"reload: 1 group of {rl['from']} SIGTERM-ignoring workers -> {rl['to']}",
                f"{rl['reload_s']:.2f} s (SIGHUP -> supervisor.reload_done)",
            )
        )
    if "rollout" in r:
        ro = r["rollout"]
        each = ", ".join(f"{v:.1f}" for v in ro["last_replacement_s"].values())
        rows.append(
            (
                f"reload changing all {ro['groups']} groups of {ro['per_group']} "
                "SIGTERM-ignoring workers",
                f"{ro['reload_s']:.1f} s (SIGHUP -> supervisor.reload_done); each group's "
                f"last replacement at {each} s",
            )
        )
    if "loading" in r:
        ld = r["loading"]
        rows.append(
            (
                f"supervisor CPU, {ld['workers']} workers loading behind a 503 health URL",
                f"{ld['cores']:.2f} core over {ld['window_s']:.0f} s; /healthz p50 "
                f"{ld['healthz']['p50_ms']} ms, max {ld['healthz']['max_ms']} ms",
            )
        )
    if "big" in r:
        big = r["big"]
        rows.append(
            (
                f"SIGTERM with {big['shutdown']['workers']} SIGTERM-ignoring workers",
                f"{big['shutdown']['s']:.2f} s (stop_timeout_s = 2)",
            )
        )
    return "\n".join(["| measure | result |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def big_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    big = r["big"]
    s, k, tick = big["start"], big["kill_all"], big["sample_tick"]
    rows = [
        (
            f"{s['start_lines']} workers: launch -> all ready in the API",
            f"{s['all_ready_s']:.2f} s (start lines {s['first_start_s']:.2f} -> "
            f"{s['last_start_s']:.2f} s after launch)",
        )
    ]
    for path, a in big["api"].items():
        rows.append(
            (
                f"GET {path} ({a['requests']} requests)",
                f"{a['bytes'] / 1000:.1f} KB, p50 {a['p50_ms']:.2f} ms, p99 {a['p99_ms']:.2f} ms",
            )
        )
    idle = big["state_json_idle"]
    rows += [
        (
            "state.json",
            f"{big['state_json_bytes'] / 1000:.1f} KB, {idle['writes']} writes in "
            f"{idle['window_s']:g} s idle",
        ),
        (
            "sample tick (sample_duration_seconds sum / count)",
            f"{tick['mean_ms']} ms mean over {tick['count']:.0f} ticks",
        ),
        ("supervisor RSS", f"{big['rss_mib']:.0f} MiB"),
        (
            f"SIGKILL of all {k['killed']} workers at once",
            f"all spawned in {k['all_spawned_s']:.2f} s, all ready in {k['all_ready_s']:.2f} s; "
            f"/healthz meanwhile p50 {k['healthz']['p50_ms']} ms, max {k['healthz']['max_ms']} ms",
        ),
    ]
    return rows


def git_revision() -> str | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=TREE,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=None, help="groups (4; --quick 2)")
    parser.add_argument("--per-group", type=int, default=None, help="workers a group (16; 8)")
    parser.add_argument("--requests", type=int, default=None, help="GETs an endpoint (50; 20)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 x 8, ~35 s")
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"the phases to run, comma-separated ({','.join(PHASES)})",
    )
    parser.add_argument(
        "--tree",
        type=Path,
        default=ROOT,
        help="the checkout whose supervisor runs (default: this one; another, for a "
        "before/after comparison on the same machine)",
    )
    args = parser.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    if not phases or any(p not in PHASES for p in phases):
        parser.error(f"--phases: one or more of {','.join(PHASES)} (got {args.phases!r})")
    if not (args.tree / "supervisor" / "__init__.py").is_file():
        parser.error(f"--tree {args.tree}: no supervisor/ package there")
    global TREE
    TREE = args.tree.resolve()
    q = args.quick
    plan = Plan(
        groups=args.groups or (2 if q else 4),
        per_group=args.per_group or (8 if q else 16),
        requests=args.requests or (20 if q else 50),
        settle_s=1.0 if q else 3.0,
        idle_s=2.0 if q else 5.0,
        cpu_settle_s=3.0 if q else 6.0,
        cpu_s=5.0 if q else 10.0,
    )
    if plan.total > GPUS * PER_GPU:
        parser.error(f"at most {GPUS * PER_GPU} workers ({GPUS} sim GPUs x {PER_GPU})")
    tracker = Tracker()
    t_start = time.monotonic()

    def run(results: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="gpu-big-node-") as tmp:
            for name in phases:
                phase = PHASES[name]
                base = Path(tmp) / name
                base.mkdir()
                print(f"[{time.monotonic() - t_start:5.1f} s] {name} ...", flush=True)
                try:
                    results[name] = phase(plan, base, tracker)
                finally:
                    tracker.kill_all()

    results, code, left = run_guarded(tracker, run)
    if code == 130:
        return code
    elapsed = time.monotonic() - t_start
    doc = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_revision(),
        "tree": str(TREE),
        "plan": {**asdict(plan), "quick": q, "gpus": GPUS, "max_workers_per_gpu": PER_GPU},
        "cpus": os.cpu_count(),
        "elapsed_s": round(elapsed, 1),
        "left_running": left,
        **results,
    }
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"big-node-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(doc, indent=2))
    if code == 0:
        print(
            f"{plan.groups} groups x {plan.per_group} workers on {GPUS} sim GPUs "
            f"({os.cpu_count()} CPUs, {elapsed:.0f} s)"
        )
        print(table(results))
    print("leftover processes: " + (", ".join(left) if left else "none"))
    print(f"raw: {out.relative_to(ROOT)}")
    return code


PHASES: dict[str, Callable[[Plan, Path, Tracker], dict[str, Any]]] = {
    "big": phase_big,
    "reload": phase_reload,
    "rollout": phase_rollout,
    "loading": phase_loading,
}


if __name__ == "__main__":
    sys.exit(main())
