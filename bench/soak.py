"""Soak: the supervisor's own resources over thousands of worker restarts.

    .venv/bin/python bench/soak.py [--minutes 10] [--quick] [--crashers 8] [--steady 3]

One ``gpu-supervisor run`` of this checkout (``PYTHONPATH``; API on ``127.0.0.1:0``) with
``[gpu] backend = "sim"`` on 3 sim GPUs, ``sample_interval_s = 0.5``, in a temp dir, and:

- ``--crashers`` workers (two groups, ``crash`` and ``loop``, half each) that die after
  0.3-1.5 s at random: exit 1, SIGKILL, a CUDA out-of-memory line then exit 1, a fork that
  leaves a sleeping child behind then exit 3, SIGABRT; each claims 200 MiB of its sim GPU and
  prints 5-40 lines first (now and then a 20 KiB line). ``crash`` restarts at once
  (``stable_s = 0``: every run counts as stable); ``loop`` takes the crash-loop path
  (``stable_s = 30``, ``backoff_initial_s = 0.05``, ``backoff_max_s = 0.4``) with ``burst = 0``,
  so no worker ever goes fatal: thousands of restarts in 10 minutes;
- ``--steady`` healthy workers (``bench/worker.py --sim-mib 1000 --http``, ready and liveness
  through their health URL);
- retention made small so that it is exercised: ``postmortem_keep = 100``,
  ``log_max_bytes = 65536``, ``log_backups = 2``;
- a client that asks every second for ``/metrics`` (one keep-alive connection, as Prometheus
  does), ``/api/v1/workers``, the status page ``/`` and what the page polls
  (``/api/v1/gpu/status``, ``/api/v1/events?since=SEQ``), each on a new connection; every 5 s
  ``/api/v1/postmortems``, a crasher's ``/api/v1/workers/NAME/log``, ``/readyz``,
  ``/healthz``; every 2 s another crasher's log followed across its rotations (``file`` and
  ``offset`` from the last answer, as ``logs -f`` does);
- every 30 s a SIGHUP reload that scales ``steady`` between ``--steady`` and one fewer (every
  4th also gives it another environment: a roll-out);
- every 45 s ``POST /api/v1/workers/steady-0/restart`` (an operator's restart);
- sim GPU events: an informational XID (63) every 20 s, a worker-fatal one (13) every 60 s, a
  temperature change every 15 s and a 15 s heat spell (2 degrees under the slowdown threshold:
  ``on_thermal = "derate"``) every 150 s. The harness removes ``procs/<pid>`` files of dead
  workers (as a real driver forgets a dead process).

Every ``--sample-s`` (10 s; 5 s with ``--quick``) it records the supervisor process's open fds
(``/proc/PID/fd``), RSS, PSS (``smaps_rollup``), threads, children (direct, all descendants,
zombies), CPU time, ``state_dir`` (post-mortem files, log files and bytes, the largest log
file, ``.tmp`` leftovers), the restarts done (the sum of the workers' ``restarts`` in
``/api/v1/workers``), the sizes of ``/metrics`` and ``/api/v1/workers``, the mean sampler
tick and the API latencies of the interval. Inside the supervisor, a probe (``python -c`` of
a few lines that starts a thread, then runs ``python -m supervisor``) asks its event loop for
the number of asyncio tasks and, after a ``gc.collect()`` (what is reachable, not garbage a
collection has not reached yet), ``gc``-tracked objects by type and
``sys.getallocatedblocks()``. Error events of the supervisor's log are counted and the first
three of each kept.

At the end: a table of each figure after the warm-up (the median of the three samples from
its end), at the end (the median of the last three), its maximum and its growth per 1000
restarts (least squares over every sample after the warm-up), and a PASS/FAIL verdict (see
``docs/benchmarks.md``, "Soak"). The warm-up is the first ``--warmup-s`` (60 s; 30 s with
``--quick``) and lasts until the supervisor's event journal (the last 4096 events,
``/api/v1/events``) is full: it fills by design, after ~100 s here. ``--quick`` (1.5 minutes)
is a smoke run: the journal is not full by then, so memory and objects are not judged
(SKIP). Raw results: ``bench/results/soak-<UTC>.json``. Every process of the run (the supervisor in a session of
its own, its workers marked with ``BENCH_RUN_ID``) is SIGKILLed at the end, on an error and on
Ctrl-C / SIGTERM; the run checks that none is left. Exit 0 on PASS, 1 on FAIL, an error or a
process left running, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import psutil
from benchkit import Tracker, free_port_range, run_guarded

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "worker.py"
GPUS = 3
POSTMORTEM_KEEP = 100
LOG_MAX_BYTES = 65536
LOG_BACKUPS = 2
SAMPLE_METRIC = "gpu_supervisor_sample_duration_seconds"
#: the last samples of the run and the first after the warm-up whose median is "end" / "warm-up"
WINDOW = 3
#: supervisor.journal.JOURNAL_SIZE: the event journal (what /api/v1/events serves) holds the last
#: 4096 events; it fills, legitimately, after ~100 s of this run's restarts (~7 a second, 5-6
#: events each), so the warm-up lasts until it is full.
JOURNAL_EVENTS = 4096

#: Runs the supervisor with a probe thread: every SOAK_PROBE_EVERY_S it has the event loop
#: count its asyncio tasks and gc-tracked objects (on the loop's own thread, so that nothing
#: changes under the count) and appends one JSON line to SOAK_PROBE_FILE. Both variables are
#: taken out of the environment before any worker is spawned. The thread blocks every signal:
#: the supervisor's handling of them is left as it is.
PROBE = r"""
import asyncio, gc, json, os, runpy, signal, sys, threading, time
_path = os.environ.pop("SOAK_PROBE_FILE")
_every = float(os.environ.pop("SOAK_PROBE_EVERY_S"))
_loops = []

class _Policy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        loop = super().new_event_loop()
        _loops.append(loop)
        return loop

asyncio.set_event_loop_policy(_Policy())

def _count(loop):
    t0 = time.perf_counter()
    tasks = asyncio.all_tasks(loop)
    coros = {}
    for t in tasks:
        c = t.get_coro()
        name = getattr(c, "__qualname__", type(c).__name__)
        coros[name] = coros.get(name, 0) + 1
    enabled = gc.isenabled()
    before = len(gc.get_objects())
    collected = gc.collect()  # what is still reachable, not garbage waiting for a collection
    objs = gc.get_objects()
    types = {}
    for o in objs:
        k = type(o)
        types[k] = types.get(k, 0) + 1
    del objs
    by_name = {f"{k.__module__}.{k.__qualname__}": n for k, n in types.items() if n >= 20}
    line = {
        "t": time.time(),
        "tasks": len(tasks),
        "task_coros": coros,
        "objects": sum(types.values()),
        "objects_before_collect": before,
        "collected": collected,
        "gc_enabled": enabled,
        "blocks": sys.getallocatedblocks(),
        "garbage": len(gc.garbage),
        "threads": threading.active_count(),
        "types": by_name,
        "took_s": round(time.perf_counter() - t0, 4),
    }
    with open(_path, "a") as f:
        f.write(json.dumps(line) + "\n")

def _probe():
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    while True:
        time.sleep(_every)
        if _loops and not _loops[-1].is_closed():
            try:
                _loops[-1].call_soon_threadsafe(_count, _loops[-1])
            except RuntimeError:
                return

threading.Thread(target=_probe, name="soak-probe", daemon=True).start()
sys.argv = ["gpu-supervisor", *sys.argv[1:]]
runpy.run_module("supervisor", run_name="__main__", alter_sys=True)
"""

#: A worker that dies 0.3-1.5 s after its start, in one of five ways.
CRASHER = r"""
import os, random, signal, sys, time
rng = random.Random()
world = os.environ.get("GPU_SUPERVISOR_SIM_DIR")
gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
if world and gpus:
    tmp = os.path.join(world, "procs", f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(f"{g} 200\n" for g in gpus))
    os.replace(tmp, os.path.join(world, "procs", str(os.getpid())))
for i in range(rng.randrange(5, 40)):
    print(f"step {i} " + "x" * rng.randrange(20, 120))
if rng.random() < 0.01:
    print("y" * 20000)
sys.stdout.flush()
time.sleep(rng.uniform(0.3, 1.5))
r = rng.random()
if r < 0.40:
    print("fatal: simulated error", file=sys.stderr)
    sys.exit(1)
if r < 0.65:
    os.kill(os.getpid(), signal.SIGKILL)
if r < 0.75:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
          file=sys.stderr, flush=True)
    sys.exit(1)
if r < 0.85:
    if os.fork() == 0:  # a child left behind, holding the output pipe
        time.sleep(3600)
        os._exit(0)
    sys.exit(3)
os.abort()
"""


@dataclass(frozen=True)
class Plan:
    seconds: float
    warmup_s: float
    sample_s: float
    crashers: int
    steady: int
    reload_every_s: float = 30.0
    scrape_every_s: float = 1.0


def _toml(value: str) -> str:
    return json.dumps(value)


# --------------------------------------------------------------------------- the configuration


def write_config(
    base: Path, run_id: str, plan: Plan, port_base: int, steady: int, generation: int = 0
) -> Path:
    env = f"BENCH_START_FILE = {_toml(str(base / 'starts'))}, BENCH_RUN_ID = {_toml(run_id)}"
    # another environment for the steady group: a reload rolls it out
    steady_env = env + f", BENCH_GENERATION = {_toml(str(generation))}"
    crasher = ", ".join(_toml(a) for a in (sys.executable, "-S", str(base / "crasher.py")))
    steady_cmd = ", ".join(
        _toml(a) for a in (sys.executable, "-S", str(WORKER), "--sim-mib", "1000", "--http")
    )
    loop = plan.crashers // 2
    text = (
        f"[supervisor]\nstate_dir = {_toml(str(base / 'state'))}\nsample_interval_s = 0.5\n"
        f"postmortem_keep = {POSTMORTEM_KEEP}\nlog_max_bytes = {LOG_MAX_BYTES}\n"
        f"log_backups = {LOG_BACKUPS}\n"
        f'[gpu]\nbackend = "sim"\nsim_dir = {_toml(str(base / "sim"))}\nsim_devices = {GPUS}\n'
        '[api]\nlisten = "127.0.0.1:0"\n'
        # restarts at once: every run is "stable"
        f'[[workers]]\nname = "crash"\ncommand = [{crasher}]\nreplicas = {plan.crashers - loop}\n'
        f'env = {{ {env} }}\nready = "none"\nmax_workers_per_gpu = 8\nstop_timeout_s = 2\n'
        "[workers.restart]\nstable_s = 0\ndelay_s = 0\nburst = 0\n"
        # the crash-loop path: backoff, never fatal
        f'[[workers]]\nname = "loop"\ncommand = [{crasher}]\nreplicas = {loop}\n'
        f'env = {{ {env} }}\nready = "none"\nmax_workers_per_gpu = 8\nstop_timeout_s = 2\n'
        "[workers.restart]\nstable_s = 30\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.4\n"
        "burst = 0\ninterval_s = 60\n"
        f'[[workers]]\nname = "steady"\ncommand = [{steady_cmd}]\nreplicas = {steady}\n'
        f'env = {{ {steady_env} }}\nready = "http://127.0.0.1:{{port}}/health"\n'
        f"port_base = {port_base}\nmax_workers_per_gpu = 8\nstop_timeout_s = 2\n"
        '[workers.health]\nliveness_url = "http://127.0.0.1:{port}/health"\n'
    )
    path = base / "soak.toml"
    tmp = base / ".soak.toml.tmp"
    tmp.write_text(text)
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------- the supervisor


class LogCounter:
    """The supervisor's JSON log (stderr), read by a thread: events counted by name and level,
    the last lines kept, and the API's URL."""

    def __init__(self, stream: Any) -> None:
        self.counts: Counter[str] = Counter()
        self.levels: Counter[str] = Counter()  # "warning worker.x", "error ..."
        self.last: deque[str] = deque(maxlen=40)
        self.errors: dict[str, list[dict[str, Any]]] = {}  # error events: the first 3 of each
        self.url: str | None = None
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._cond:
                self.last.append(line.rstrip())
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    self.counts["(not json)"] += 1
                    continue
                name = str(event.get("event"))
                self.counts[name] += 1
                level = str(event.get("level", ""))
                if level in ("warning", "error", "critical"):
                    self.levels[f"{level} {name}"] += 1
                if level in ("error", "critical") and len(self.errors.get(name, ())) < 3:
                    self.errors.setdefault(name, []).append(event)
                if name == "api.listening":
                    self.url = str(event.get("url"))
                self._cond.notify_all()

    def count(self, name: str) -> int:
        with self._cond:
            return self.counts[name]

    def wait(self, name: str, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.counts[name] < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def tail(self, n: int = 12) -> str:
        with self._cond:
            return "\n".join(list(self.last)[-n:])


class Supervisor:
    def __init__(self, cfg: Path, probe_file: Path, probe_every_s: float, tracker: Tracker):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "BENCH_RUN_ID": tracker.run_id,
            "SOAK_PROBE_FILE": str(probe_file),
            "SOAK_PROBE_EVERY_S": str(probe_every_s),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, "run", "-c", str(cfg), "--log-format", "json"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        tracker.add_popen(self.proc)
        self.pid = self.proc.pid
        assert self.proc.stderr is not None
        self.log = LogCounter(self.proc.stderr)
        if not self.log.wait("api.listening", 1, 60) or self.log.url is None:
            raise RuntimeError(f"no API (exit {self.proc.poll()}); log tail:\n{self.log.tail()}")
        url = urlsplit(self.log.url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80

    def request(self, method: str, path: str, timeout: float = 30) -> tuple[int, float, bytes]:
        """On a new connection: (status, seconds, body)."""
        status, dt, body, _ = self.request_with_headers(method, path, timeout)
        return status, dt, body

    def request_with_headers(
        self, method: str, path: str, timeout: float = 30
    ) -> tuple[int, float, bytes, dict[str, str]]:
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        return resp.status, time.perf_counter() - t0, body, headers

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"supervisor exited {self.proc.returncode}:\n{self.log.tail()}")


# --------------------------------------------------------------------------- load and chaos


#: a worker's log followed across its rotations, as ``logs -f`` and the status page do
FOLLOW = "/api/v1/workers/crash-1/log"


class Scraper:
    """The API client: one thread, a fixed schedule (see the module docstring)."""

    EVERY_S: Sequence[tuple[str, float]] = (
        ("/api/v1/workers", 1),
        ("/", 1),
        ("/api/v1/gpu/status", 1),
        ("/api/v1/events", 1),
        ("/api/v1/postmortems", 5),
        ("/api/v1/workers/crash-0/log?limit=4096", 5),
        (FOLLOW, 2),
        ("/readyz", 5),
        ("/healthz", 5),
    )

    def __init__(self, sup: Supervisor, every_s: float, t0: float) -> None:
        self.sup, self.every_s, self.t0 = sup, every_s, t0
        self.lock = threading.Lock()
        #: every series ``/metrics`` has shown (name and labels) -> when first (s from launch)
        self.series_first: dict[str, float] = {}
        self.latencies: dict[str, list[float]] = {}  # since the last take()
        self.requests = 0
        self.errors: Counter[str] = Counter()
        self.restarts = 0
        self.restarts_all = 0
        self.states: Counter[str] = Counter()
        self.fatal_seen: set[str] = set()
        self.workers_bytes = 0
        self.metrics_bytes = 0
        self.metrics_series = 0
        self.tick_sum = self.tick_count = 0.0
        self.events_seq = 0
        self.follow: tuple[str, str] | None = None  # X-Log-File, X-Log-Offset
        self.follow_bytes = 0
        self.follow_lost = 0
        self._metrics_conn: http.client.HTTPConnection | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _note(self, path: str, status: int, dt: float, ok: Sequence[int] = (200,)) -> None:
        with self.lock:
            self.requests += 1
            self.latencies.setdefault(path.split("?")[0], []).append(dt)
            if status not in ok:
                self.errors[f"{path.split('?')[0]} {status}"] += 1

    def _metrics(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._metrics_conn is None:
                self._metrics_conn = http.client.HTTPConnection(
                    self.sup.host, self.sup.port, timeout=30
                )
            self._metrics_conn.request("GET", "/metrics")
            resp = self._metrics_conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            if self._metrics_conn is not None:
                self._metrics_conn.close()
            self._metrics_conn = None  # the server may close an idle keep-alive: reconnect
            with self.lock:
                self.errors[f"/metrics {type(exc).__name__}"] += 1
            return
        self._note("/metrics", resp.status, time.perf_counter() - t0)
        text = body.decode(errors="replace")
        tick_sum = tick_count = 0.0
        series = 0
        now = time.monotonic() - self.t0
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series += 1
            self.series_first.setdefault(line.rsplit(" ", 1)[0], now)
            if line.startswith(SAMPLE_METRIC + "_sum"):
                tick_sum = float(line.split()[-1])
            elif line.startswith(SAMPLE_METRIC + "_count"):
                tick_count = float(line.split()[-1])
        with self.lock:
            self.metrics_bytes, self.metrics_series = len(body), series
            self.tick_sum, self.tick_count = tick_sum, tick_count

    def _get(self, path: str) -> None:
        if path == "/api/v1/events":
            path = f"/api/v1/events?since={self.events_seq}"
        elif path == FOLLOW:
            path += "?limit=65536" + (
                f"&file={quote(self.follow[0])}&offset={quote(self.follow[1])}"
                if self.follow
                else ""
            )
        try:
            status, dt, body, headers = self.sup.request_with_headers("GET", path)
        except (OSError, http.client.HTTPException) as exc:
            with self.lock:
                self.errors[f"{path.split('?')[0]} {type(exc).__name__}"] += 1
            return
        self._note(path, status, dt, (200, 503) if path == "/readyz" else (200,))
        if status != 200:
            return
        if path.startswith(FOLLOW) and "x-log-file" in headers:
            self.follow = (headers["x-log-file"], headers.get("x-log-offset", "0"))
            self.follow_bytes += len(body)
            self.follow_lost += headers.get("x-log-lost") == "1"
        if path.startswith("/api/v1/events"):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                events = json.loads(body)
                if events:
                    self.events_seq = max(self.events_seq, max(int(e["seq"]) for e in events))
        elif path == "/api/v1/workers":
            with contextlib.suppress(ValueError, KeyError, TypeError):
                workers = json.loads(body)
                states = Counter(str(w["state"]) for w in workers)
                crash = sum(int(w["restarts"]) for w in workers if w["group"] != "steady")
                every = sum(int(w["restarts"]) for w in workers)
                with self.lock:
                    self.workers_bytes = len(body)
                    self.states = states
                    self.restarts, self.restarts_all = crash, every
                    self.fatal_seen |= {w["name"] for w in workers if w["state"] == "fatal"}

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            t0 = time.monotonic()
            self._metrics()
            for path, every in self.EVERY_S:
                if n % int(every) == 0:
                    self._get(path)
            n += 1
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - t0)))

    def take_latencies(self) -> dict[str, list[float]]:
        with self.lock:
            out, self.latencies = self.latencies, {}
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(40)
        if self._metrics_conn is not None:
            self._metrics_conn.close()


class Chaos:
    """Reloads, operator restarts and sim GPU events on a schedule, on one thread."""

    def __init__(
        self, sup: Supervisor, base: Path, plan: Plan, port_base: int, run_id: str
    ) -> None:
        self.sup, self.base, self.plan = sup, base, plan
        self.port_base, self.run_id = port_base, run_id
        self.world = base / "sim"
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _gpu_file(self, index: int) -> Path:
        return self.world / "gpus" / str(index)

    def _set_temperature(self, index: int, celsius: int) -> None:
        path = self._gpu_file(index)
        lines = [
            line
            for line in path.read_text().splitlines()
            if line and not line.startswith("temperature_c ")
        ]
        lines.append(f"temperature_c {celsius}")
        tmp = path.with_name(f".{index}.soak.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)

    def _xid(self, index: int, xid: int) -> None:
        with open(self.world / "events", "a") as f:
            f.write(f"{index} {xid}\n")

    def _run(self) -> None:
        t0 = time.monotonic()
        due = {
            "reload": self.plan.reload_every_s,
            "restart": 45.0,
            "xid63": 20.0,
            "xid13": 60.0,
            "temp": 15.0,
        }
        heat_every, heat_for = 150.0, 15.0
        next_heat, heat_until, hot = 75.0, -1.0, -1
        rng = random.Random(7)
        reloads = 0
        while not self._stop.wait(0.5):
            now = time.monotonic() - t0
            try:
                if now >= due["reload"]:
                    due["reload"] += self.plan.reload_every_s
                    reloads += 1
                    steady = self.plan.steady - (reloads % 2)  # one fewer, then back
                    generation = reloads // 4  # and every 4th reload rolls the group out
                    write_config(
                        self.base, self.run_id, self.plan, self.port_base, steady, generation
                    )
                    self.sup.proc.send_signal(signal.SIGHUP)
                    self.counts["reload"] += 1
                if now >= due["restart"]:
                    due["restart"] += 45.0
                    status, _, _ = self.sup.request("POST", "/api/v1/workers/steady-0/restart")
                    self.counts[f"restart {status}"] += 1
                if now >= due["xid63"]:
                    due["xid63"] += 20.0
                    self._xid(rng.randrange(GPUS), 63)
                    self.counts["xid 63"] += 1
                if now >= due["xid13"]:
                    due["xid13"] += 60.0
                    self._xid(rng.randrange(GPUS), 13)
                    self.counts["xid 13"] += 1
                if now >= due["temp"]:
                    due["temp"] += 15.0
                    index = rng.randrange(GPUS)
                    if index != hot:
                        self._set_temperature(index, rng.randrange(40, 70))
                        self.counts["temperature"] += 1
                if now >= next_heat:
                    next_heat += heat_every
                    hot, heat_until = rng.randrange(GPUS), now + heat_for
                    self._set_temperature(hot, 85)  # slowdown 87, margin 5: hot
                    self.counts["heat spell"] += 1
                if hot >= 0 and now >= heat_until:
                    self._set_temperature(hot, 50)
                    hot = -1
            except (OSError, http.client.HTTPException) as exc:
                self.errors.append(f"{now:.0f} s: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(40)


# --------------------------------------------------------------------------- measuring


def proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "Threads"):
            out[key] = int(value.split()[0])
    return out


def pss_kib(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return None


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_of(directory: Path) -> list[tuple[Path, int]]:
    out = []
    for dirpath, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                out.append((Path(dirpath) / name, os.lstat(Path(dirpath) / name).st_size))
    return out


def state_dir_figures(state: Path) -> dict[str, Any]:
    files = tree_of(state)
    pm = [(p, s) for p, s in files if p.parent.name == "postmortems" and p.suffix == ".json"]
    logs = [(p, s) for p, s in files if p.parent.name == "logs"]
    per_worker: Counter[str] = Counter(p.name.split(".log")[0] for p, _ in logs)
    return {
        "files": len(files),
        "bytes": sum(s for _, s in files),
        "postmortems": len(pm),
        "postmortem_bytes": sum(s for _, s in pm),
        "log_files": len(logs),
        "log_bytes": sum(s for _, s in logs),
        "log_max_file_bytes": max((s for _, s in logs), default=0),
        "log_files_per_worker_max": max(per_worker.values(), default=0),
        "tmp_leftovers": sum(".tmp" in p.name for p, _ in files),
    }


def remove_dead_procs(world: Path) -> int:
    """``procs/<pid>`` of processes that are gone (a real driver forgets them)."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(world / "procs"):
            if entry.name.isdigit() and not psutil.pid_exists(int(entry.name)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def last_probe(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError):
        lines = path.read_text().splitlines()
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                doc: dict[str, Any] = json.loads(line)
                return doc
    return None


def sample(
    sup: Supervisor, base: Path, scraper: Scraper, probe_file: Path, t: float
) -> dict[str, Any]:
    pid = sup.pid
    status = proc_status(pid)
    me = psutil.Process(pid)
    descendants = me.children(recursive=True)
    zombies = 0
    for p in descendants:
        with contextlib.suppress(psutil.Error):
            zombies += p.status() == psutil.STATUS_ZOMBIE
    lat = scraper.take_latencies()
    all_lat = sorted(x for v in lat.values() for x in v)
    probe = last_probe(probe_file) or {}
    with scraper.lock:
        api = {
            "restarts": scraper.restarts,
            "restarts_all": scraper.restarts_all,
            "states": dict(scraper.states),
            "workers_bytes": scraper.workers_bytes,
            "metrics_bytes": scraper.metrics_bytes,
            "metrics_series": scraper.metrics_series,
            "series_seen": len(scraper.series_first),
            "tick_sum": scraper.tick_sum,
            "tick_count": scraper.tick_count,
            "events_seq": scraper.events_seq,
            "requests": scraper.requests,
        }
    return {
        "t": round(t, 2),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "rss_kib": status.get("VmRSS"),
        "rss_anon_kib": status.get("RssAnon"),
        "hwm_kib": status.get("VmHWM"),
        "pss_kib": pss_kib(pid),
        "threads": status.get("Threads"),
        "children": len(me.children()),
        "descendants": len(descendants),
        "zombies": zombies,
        "cpu_s": cpu_s(pid),
        "spawned": sup.log.count("worker.spawned"),
        "exited": sup.log.count("worker.exited"),
        "reloads_done": sup.log.count("supervisor.reload_done"),
        "tasks": probe.get("tasks"),
        "objects": probe.get("objects"),
        "objects_before_collect": probe.get("objects_before_collect"),
        "gc_enabled": probe.get("gc_enabled"),
        "blocks": probe.get("blocks"),
        "probe_t": probe.get("t"),
        "api_p50_ms": round(statistics.median(all_lat) * 1000, 2) if all_lat else None,
        "api_max_ms": round(all_lat[-1] * 1000, 2) if all_lat else None,
        **api,
        **state_dir_figures(base / "state"),
    }


# --------------------------------------------------------------------------- the verdict


def median_of(samples: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(values) if values else None


def slope_per_1000(samples: Sequence[dict[str, Any]], key: str) -> float | None:
    """Least-squares growth of ``key`` per 1000 restarts."""
    pts = [(s["restarts"], s[key]) for s in samples if s.get(key) is not None]
    if len(pts) < 3:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    return float(sum((x - mx) * (y - my) for x, y in pts) / sxx * 1000)


#: figure -> (label, scale to the unit shown)
FIGURES: Sequence[tuple[str, str, float]] = (
    ("restarts", "restarts (API)", 1),
    ("fds", "open fds", 1),
    ("threads", "threads", 1),
    ("tasks", "asyncio tasks", 1),
    ("rss_kib", "RSS MiB", 1 / 1024),
    ("pss_kib", "PSS MiB", 1 / 1024),
    ("rss_anon_kib", "RssAnon MiB", 1 / 1024),
    ("objects", "gc-tracked objects", 1),
    ("blocks", "allocated blocks", 1),
    ("children", "children", 1),
    ("descendants", "descendants", 1),
    ("zombies", "zombies", 1),
    ("postmortems", "post-mortem files", 1),
    ("log_files", "log files", 1),
    ("log_bytes", "log KiB", 1 / 1024),
    ("log_max_file_bytes", "largest log file KiB", 1 / 1024),
    ("files", "files in state_dir", 1),
    ("bytes", "state_dir KiB", 1 / 1024),
    ("tmp_leftovers", ".tmp files", 1),
    ("metrics_series", "/metrics series", 1),
    ("series_seen", "/metrics series ever seen", 1),
    ("workers_bytes", "/api/v1/workers bytes", 1),
    ("api_p50_ms", "API p50 ms (the interval's requests)", 1),
)

FD_SLACK = 4
THREAD_SLACK = 2
TASK_SLACK = 4
RSS_MIB_PER_1000 = 2.0
OBJECTS_PER_1000 = 500
#: series first seen in the second half of the judged run: a handful of (worker, reason)
#: pairs met late by chance; a label value per restart or per process would add hundreds
LATE_SERIES = 10


def warmed_up(samples: Sequence[dict[str, Any]], plan: Plan) -> float:
    """When the warm-up ended: ``plan.warmup_s`` and the event journal full (at the latest
    when a third of the run is left)."""
    latest = plan.seconds - (plan.seconds - plan.warmup_s) / 3
    for s in samples:
        if s["t"] >= plan.warmup_s and (s["events_seq"] >= JOURNAL_EVENTS or s["t"] >= latest):
            return float(s["t"])
    return plan.warmup_s


Check = tuple[str, str, str]  # what, the figures, PASS | FAIL | SKIP


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def judge(
    samples: list[dict[str, Any]],
    plan: Plan,
    names: int,
    warm_t: float,
    series_first: dict[str, float],
) -> tuple[dict[str, Any], list[Check]]:
    """The table's figures and the checks."""
    after = [s for s in samples if s["t"] >= warm_t]
    warm, end = after[:WINDOW], after[-WINDOW:]
    figures: dict[str, Any] = {}
    for key, _, _ in FIGURES:
        figures[key] = {
            "warmup": median_of(warm, key),
            "end": median_of(end, key),
            "max": max((s[key] for s in samples if s.get(key) is not None), default=None),
            "per_1000": slope_per_1000(after, key) if key != "restarts" else None,
        }
    restarts = (figures["restarts"]["end"] or 0) - (figures["restarts"]["warmup"] or 0)
    checks: list[Check] = []

    def flat(key: str, slack: float) -> None:
        f = figures[key]
        if f["warmup"] is None or f["end"] is None:
            checks.append((key, "not measured", "FAIL"))
            return
        ok = f["end"] <= f["warmup"] + slack
        checks.append(
            (key, f"end {f['end']:g} <= warm-up {f['warmup']:g} + {slack:g}", verdict(ok))
        )

    flat("fds", FD_SLACK)
    flat("threads", THREAD_SLACK)
    flat("tasks", TASK_SLACK)
    # Until the event journal is full, memory grows by design (--quick: it is not full yet).
    full = after[0]["events_seq"] >= JOURNAL_EVENTS
    skip = "" if full else " (the event journal was still filling: not judged)"
    rss = figures["rss_kib"]["per_1000"]
    ok = rss is not None and rss / 1024 <= RSS_MIB_PER_1000
    checks.append(
        (
            "rss",
            f"{(rss or 0) / 1024:+.2f} MiB per 1000 restarts <= {RSS_MIB_PER_1000:g}{skip}",
            verdict(ok) if full else "SKIP",
        )
    )
    objs = figures["objects"]["per_1000"]
    ok = objs is not None and objs <= OBJECTS_PER_1000
    checks.append(
        (
            "objects",
            f"{objs or 0:+.0f} per 1000 restarts <= {OBJECTS_PER_1000}{skip}",
            verdict(ok) if full else "SKIP",
        )
    )
    workers = plan.crashers + plan.steady
    max_desc = figures["descendants"]["max"] or 0
    zombies = figures["zombies"]["end"] or 0
    # each crasher: itself and at most the child it leaves behind, until that is killed
    checks.append(
        (
            "descendants",
            f"max {max_desc} <= {2 * workers}; zombies at end {zombies:g} <= {plan.crashers}",
            verdict(max_desc <= 2 * workers and zombies <= plan.crashers),
        )
    )
    # the writer prunes right after each write: one more for that moment, none at the end
    pm = figures["postmortems"]["max"] or 0
    pm_end = figures["postmortems"]["end"] or 0
    checks.append(
        (
            "postmortems",
            f"max {pm} <= postmortem_keep {POSTMORTEM_KEEP} + 1 (a write before its prune); "
            f"end {pm_end:g} <= {POSTMORTEM_KEEP}",
            verdict(pm <= POSTMORTEM_KEEP + 1 and pm_end <= POSTMORTEM_KEEP),
        )
    )
    per_file = LOG_MAX_BYTES + 32 * 1024  # rotated at a line's end: one line over at most
    biggest = figures["log_max_file_bytes"]["max"] or 0
    files_max = max((s["log_files_per_worker_max"] for s in samples), default=0)
    log_bound = names * (LOG_BACKUPS + 1) * per_file
    log_max = figures["log_bytes"]["max"] or 0
    checks.append(
        (
            "logs",
            f"largest file {biggest / 1024:.0f} KiB <= {per_file / 1024:.0f}; "
            f"files per worker <= {LOG_BACKUPS + 1} (max {files_max}); "
            f"all {log_max / 1024:.0f} KiB <= {log_bound / 1024:.0f}",
            verdict(biggest <= per_file and files_max <= LOG_BACKUPS + 1 and log_max <= log_bound),
        )
    )
    tmp_end = figures["tmp_leftovers"]["end"] or 0
    checks.append((".tmp files", f"end {tmp_end:g} <= 1", verdict(tmp_end <= 1)))
    # The series shown vary (a scaled-down worker's go, a worker's GPU memory only while it
    # holds some); what must not grow is the set of them: a label value that is new comes
    # early (a restart reason, a worker and reason first met), not one per restart or pid.
    half = after[len(after) // 2]["t"]
    late = sorted(k for k, t in series_first.items() if t >= half)
    figures["series_first_seen_late"] = late
    checks.append(
        (
            "/metrics series",
            f"{len(late)} of {len(series_first)} first seen in the second half "
            f"(after {half:.0f} s) <= {LATE_SERIES}",
            verdict(len(late) <= LATE_SERIES),
        )
    )
    gc_off = [s["t"] for s in after if s.get("gc_enabled") is False]
    checks.append(
        (
            "gc enabled",
            f"off at {gc_off[0]:.0f} s" if gc_off else "on throughout",
            verdict(not gc_off),
        )
    )
    figures["restarts_after_warmup"] = restarts
    return figures, checks


def fmt(value: float | None, scale: float) -> str:
    if value is None:
        return "-"
    v = value * scale
    return f"{v:.1f}" if scale != 1 or v != int(v) else f"{int(v)}"


def table(figures: dict[str, Any]) -> str:
    rows = [
        "| figure | after warm-up | end | max | growth per 1000 restarts |",
        "|---|---|---|---|---|",
    ]
    for key, label, scale in FIGURES:
        f = figures[key]
        per = f["per_1000"]
        rows.append(
            f"| {label} | {fmt(f['warmup'], scale)} | {fmt(f['end'], scale)} | "
            f"{fmt(f['max'], scale)} | {'-' if per is None else f'{per * scale:+.2f}'} |"
        )
    return "\n".join(rows)


def type_growth(probe_file: Path, warm_t: float, top: int = 12) -> list[tuple[str, int, int]]:
    """Object types that grew most between the first probe after the warm-up and the last."""
    lines = []
    with contextlib.suppress(FileNotFoundError):
        for line in probe_file.read_text().splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
    after = [p for p in lines if p["t"] >= warm_t]
    if len(after) < 2:
        return []
    first, last = after[0]["types"], after[-1]["types"]
    grown = [(k, first.get(k, 0), n) for k, n in last.items() if n > first.get(k, 0)]
    grown.sort(key=lambda g: g[2] - g[1], reverse=True)
    return grown[:top]


# --------------------------------------------------------------------------- the run


def soak(plan: Plan, base: Path, tracker: Tracker) -> dict[str, Any]:
    (base / "crasher.py").write_text(CRASHER.lstrip())
    port_base = free_port_range(plan.steady)
    cfg = write_config(base, tracker.run_id, plan, port_base, plan.steady)
    probe_file = base / "probe.jsonl"
    launched = time.monotonic()
    launched_wall = time.time()
    sup = Supervisor(cfg, probe_file, plan.sample_s, tracker)
    scraper = Scraper(sup, plan.scrape_every_s, launched)
    chaos = Chaos(sup, base, plan, port_base, tracker.run_id)
    samples: list[dict[str, Any]] = []
    removed = 0
    try:
        next_at = launched + plan.sample_s
        while True:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += plan.sample_s
            sup.check_alive()
            removed += remove_dead_procs(base / "sim")
            t = time.monotonic() - launched
            s = sample(sup, base, scraper, probe_file, t)
            samples.append(s)
            print(
                f"[{t:5.0f} s] restarts {s['restarts']:5d}  fds {s['fds']:3d}  "
                f"rss {s['rss_kib'] / 1024:6.1f} MiB  threads {s['threads']:2d}  "
                f"tasks {s['tasks']}  objects {s['objects']}  pm {s['postmortems']:3d}  "
                f"logs {s['log_bytes'] / 1024:6.0f} KiB  desc {s['descendants']:2d}",
                flush=True,
            )
            if t >= plan.seconds:
                break
    finally:
        chaos.stop()
        scraper.stop()
    names = plan.crashers + plan.steady
    warm_t = warmed_up(samples, plan)
    with scraper.lock:
        series_first = dict(scraper.series_first)
    figures, checks = judge(samples, plan, names, warm_t, series_first)
    tick = [(s["t"], s["tick_sum"], s["tick_count"]) for s in samples if s["t"] >= warm_t]
    tick_ms = {}
    if len(tick) >= 2 * WINDOW:
        first, last = tick[:WINDOW], tick[-WINDOW:]
        for label, part in (("warmup", first), ("end", last)):
            dn = part[-1][2] - part[0][2]
            tick_ms[label] = round((part[-1][1] - part[0][1]) / dn * 1000, 3) if dn else None
    cpu = [(s["restarts"], s["cpu_s"]) for s in samples if s["t"] >= warm_t]
    cpu_per_restart_ms = None
    if len(cpu) >= 2 and cpu[-1][0] > cpu[0][0]:
        cpu_per_restart_ms = round((cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]) * 1e3, 2)
    with scraper.lock:
        fatal = sorted(scraper.fatal_seen)
        api = {
            "requests": scraper.requests,
            "errors": dict(scraper.errors),
            "fatal_seen": fatal,
            "log_followed_bytes": scraper.follow_bytes,
            "log_follow_lost": scraper.follow_lost,
        }
    checks.append(("no worker fatal", ", ".join(fatal) or "none", verdict(not fatal)))
    reloads = sup.log.count("supervisor.reload_done")
    checks.append(
        (
            "reloads",
            f"{reloads} done of {chaos.counts['reload']} sent",
            verdict(reloads >= chaos.counts["reload"] - 1),  # the last may still run
        )
    )
    return {
        "samples": samples,
        "figures": figures,
        "checks": [{"what": w, "figures": f, "verdict": v} for w, f, v in checks],
        "tick_ms": tick_ms,
        "cpu_per_restart_ms": cpu_per_restart_ms,
        "api": api,
        "chaos": dict(chaos.counts),
        "chaos_errors": chaos.errors,
        "log_counts": dict(sup.log.counts.most_common()),
        "log_warnings": dict(sup.log.levels.most_common()),
        "log_errors": sup.log.errors,
        "warmed_up_s": warm_t,
        "type_growth": type_growth(probe_file, launched_wall + warm_t),
        "sim_procs_removed": removed,
        "probe_lines": len(probe_file.read_text().splitlines()) if probe_file.exists() else 0,
    }


def git_revision() -> str | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    return None


def report(doc: dict[str, Any]) -> str:
    figures = doc["figures"]
    plan = doc["plan"]
    out = [
        f"{plan['crashers']} crashing + {plan['steady']} steady workers on {GPUS} sim GPUs, "
        f"{doc['elapsed_s']:.0f} s, {doc['cpus']} CPUs; warm-up until {doc['warmed_up_s']:g} s "
        f"({plan['warmup_s']:g} s and the event journal full); "
        f"{figures['restarts']['end']:.0f} restarts, "
        f"{figures['restarts_after_warmup']:.0f} after the warm-up",
        "",
        table(figures),
        "",
        f"sampler tick mean: warm-up {doc['tick_ms'].get('warmup', '-')} ms, "
        f"end {doc['tick_ms'].get('end', '-')} ms; supervisor CPU per restart: "
        f"{doc['cpu_per_restart_ms']} ms",
        f"API: {doc['api']['requests']} requests, errors {doc['api']['errors'] or 'none'}; "
        f"a log followed: {doc['api']['log_followed_bytes'] / 1024:.0f} KiB read, "
        f"{doc['api']['log_follow_lost']} answers with X-Log-Lost",
        f"chaos: {doc['chaos']}"
        + (f"; errors {doc['chaos_errors']}" if doc["chaos_errors"] else ""),
        f"warnings logged: {doc['log_warnings'] or 'none'}",
    ]
    for name, events in doc["log_errors"].items():
        first = {k: v for k, v in events[0].items() if k not in ("event", "level", "timestamp")}
        out.append(f"error {name}, the first: {first}")
    if doc["type_growth"]:
        out.append(
            "object types grown most after the warm-up: "
            + ", ".join(f"{k} {a}->{b}" for k, a, b in doc["type_growth"][:8])
        )
    if doc["figures"].get("series_first_seen_late"):
        out.append(f"/metrics series first seen late: {doc['figures']['series_first_seen_late']}")
    out.append("")
    for check in doc["checks"]:
        out.append(f"{check['verdict']}  {check['what']}: {check['figures']}")
    out.append(f"verdict: {doc['verdict']}")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="1.5 minutes, 30 s warm-up")
    parser.add_argument("--warmup-s", type=float, default=None)
    parser.add_argument("--sample-s", type=float, default=None)
    parser.add_argument("--crashers", type=int, default=8)
    parser.add_argument("--steady", type=int, default=3)
    args = parser.parse_args()
    if args.crashers < 2 or args.steady < 2:
        parser.error("--crashers and --steady: at least 2")
    q = args.quick
    plan = Plan(
        seconds=(1.5 if q else args.minutes) * 60,
        warmup_s=args.warmup_s if args.warmup_s is not None else (30.0 if q else 60.0),
        sample_s=args.sample_s if args.sample_s is not None else (5.0 if q else 10.0),
        crashers=args.crashers,
        steady=args.steady,
    )
    if plan.seconds < plan.warmup_s + 2 * WINDOW * plan.sample_s:
        parser.error("the run is too short for its warm-up and two windows of samples")
    tracker = Tracker()
    t_start = time.monotonic()

    def run(results: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="gpu-soak-") as tmp:
            try:
                results.update(soak(plan, Path(tmp), tracker))
            finally:
                tracker.kill_all()  # before the directory goes: nothing writes in it then

    results, code, left = run_guarded(tracker, run)
    if code == 130:
        return code
    passed = code == 0 and all(c["verdict"] != "FAIL" for c in results.get("checks", []))
    doc = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_revision(),
        "plan": {**asdict(plan), "quick": q, "gpus": GPUS},
        "retention": {
            "postmortem_keep": POSTMORTEM_KEEP,
            "log_max_bytes": LOG_MAX_BYTES,
            "log_backups": LOG_BACKUPS,
        },
        "thresholds": {
            "fd_slack": FD_SLACK,
            "thread_slack": THREAD_SLACK,
            "task_slack": TASK_SLACK,
            "rss_mib_per_1000": RSS_MIB_PER_1000,
            "objects_per_1000": OBJECTS_PER_1000,
        },
        "cpus": os.cpu_count(),
        "elapsed_s": round(time.monotonic() - t_start, 1),
        "left_running": left,
        "verdict": "PASS" if passed else "FAIL",
        **results,
    }
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"soak-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(doc, indent=2))
    if code == 0:
        print(report(doc))
    print("leftover processes: " + (", ".join(left) if left else "none"))
    print(f"raw: {out.relative_to(ROOT)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
