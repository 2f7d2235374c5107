"""Chaos: random operations against a real gpu-supervisor on simulated GPUs, with invariants.

    .venv/bin/python bench/chaos.py [--seed N] [--seconds 90] [--mix default|healing|nvml]
                                    [--keep]

One ``gpu-supervisor run`` of this checkout (``tests/harness.py``'s ``Supervisor``: JSON log,
API on a free port) with ``[gpu] backend = "sim"`` and ``tests/workers/sim_worker.py`` workers.
For ``--seconds`` it applies bursts of random operations chosen by ``--seed`` (printed; the run
is repeatable as far as the timing of two processes allows), and after every burst it checks
the invariants (each may take up to 15 s to hold again). Then a quiet period (every GPU cool,
answering, quarantines lifted, every group started) and a SIGTERM.

``--mix default``: API commands (start, stop, restart, drain of workers and groups), rolling
restarts, cordons and lifts, SIGKILL and SIGSTOP of workers (a watchdog group), reloads
(scale, environment, ports, a group removed or added; over SIGHUP or the API), XIDs, hot GPUs,
lost GPUs, SIGUSR1 through the API.

``--mix healing``: the healing paths: a leaking group (``--leak``, ``on_leak`` drain or
restart), a group whose workers' sim GPU memory the run raises over ``gpu_memory_limit_mb``, a
``migrate`` and a ``derate`` group under hot GPUs, device-fatal and worker-fatal XIDs with
quarantines lifted through the API, and a group of 3 leaking replicas with
``max_unavailable = 1``; plus kills, API commands and reloads.

``--mix nvml``: ``[gpu] backend = "nvml"`` through the real pynvml and the fake
``libnvidia-ml.so.1`` (``tests/fakenvml``, built with gcc into the run's directory: exit 2
without gcc), the default mix's operations and groups (with leak detection and a
``gpu_memory_limit_mb`` that no worker reaches) interleaved with NVML faults: ``rc_<symbol>``
per device (memory info, process lists, temperature, clock reasons, handle, UUID,
utilisation, power, field values, remapped rows) and system-wide (device count, event set
create and wait), with the codes drivers give (passing: UNKNOWN, TIMEOUT, INSUFFICIENT_SIZE,
INVALID_ARGUMENT; gone: UNINITIALIZED, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH; lost:
GPU_IS_LOST, RESET_REQUIRED; for good, on optional readings only: NOT_SUPPORTED,
NO_PERMISSION), hanging calls (``hang_ms``), process lists that grow between NVML's two calls
(``procs_race``), faults cleared, GPUs lost and back, XIDs.

Invariants: the API's workers are the configured ones, live, descendants of the supervisor,
on distinct ports; ``state.json`` agrees with the API; ``/metrics`` has no series of removed
workers or groups; workers a reload removed are gone; no traceback or ``api.error`` in the
log; healing never takes a *ready* worker down while its group already has
``max_unavailable`` workers not ready (but for the exceptions docs/healing.md lists); no
disruptive action or alert repeated on the same process within the 60 s cooldown; every death
has a post-mortem file; derated workers are restored once their GPU cools; after the quiet
period every worker is ready; ``nvml_up`` agrees with ``/api/v1/gpu/status``; exit code 0 on
SIGTERM, no process left, no zombie. ``--mix nvml`` adds: no leak or budget action (nor its
post-mortem), since no worker leaks or reaches its budget: a fault made it; no ``gpu_lost`` and
no quarantine of a GPU without a lost fault, a lost GPU or a device-fatal XID on it; once the
faults are cleared, telemetry is back within 70 s (the reopen backoff reaches 60 s): every GPU
answering with its memory, temperature and processes, XIDs are watched and delivered again, and each
worker's GPU memory is what it holds.

Exit 0 when every invariant held; 1 (with the seed and the tail of the operation log) when one
broke; 130 when interrupted. Every process of the run carries ``BENCH_RUN_ID`` and is SIGKILLed
at the end (``benchkit.Tracker``), on a failed invariant and on Ctrl-C too. The run's directory
(config, sim world, state, ``events.jsonl``) is kept with ``--keep`` or when an invariant broke.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchkit import Tracker, interrupt  # noqa: E402

from supervisor.backends.sim import SimBackend  # noqa: E402
from tests.fakenvml.build import FakeNvmlBuildError, build_fake_nvml, find_compiler  # noqa: E402
from tests.harness import Supervisor, alive, worker_cmd  # noqa: E402

Group = dict[str, Any]

#: Healing reasons that act on a worker whatever ``max_unavailable`` says (docs/healing.md:
#: the lifecycle's own restarts, and workers that serve nothing useful any more).
UNBOUNDED = frozenset(
    {"hang", "start_timeout", "gpu_lost", "row_remap_failure", "recovery_action", "log_pattern"}
)
DISRUPTIVE = frozenset({"drain", "restart", "migrate"})
COOLDOWN_S = 60.0
LEAK_IMMINENT_S = 60.0
#: ``worker.exited`` reasons that are no death (the operator's, a reload's, a recycle's).
NO_DEATH = frozenset({"stop", "restart", "reload", "shutdown", "drain", "max_age"})
DEVICE_XIDS = (48, 79, 95)
WORKER_XIDS = (13, 31, 43, 94)
HOT_REASONS = (0x20, 0x40, 0x8)  # sw thermal, hw thermal, hw slowdown

# --mix nvml: NVML return codes (/work/shared/NVML.md section 2), by what a driver means by them
NVML_PASSING = (999, 10, 7, 2)  # UNKNOWN, TIMEOUT, INSUFFICIENT_SIZE, INVALID_ARGUMENT
NVML_GONE = (1, 9, 18)  # UNINITIALIZED, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH
NVML_LOST = (15, 16)  # GPU_IS_LOST, RESET_REQUIRED
NVML_FOR_GOOD = (3, 4)  # NOT_SUPPORTED, NO_PERMISSION: that reading is not asked again
DEVICE_SYMBOLS = (
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetRemappedRows",
)
#: readings a GPU may lack for good (NOT_SUPPORTED, NO_PERMISSION): where it does, the run
#: expects none after the faults clear
OPTIONAL_SYMBOLS = frozenset(
    {
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetPowerUsage",
    }
)
SYSTEM_SYMBOLS = ("nvmlDeviceGetCount_v2", "nvmlEventSetWait_v2", "nvmlEventSetCreate")
#: what each group's workers hold on each of their GPUs (MiB), far under the budget
NVML_MB = {"alpha": 500, "beta": 800, "gamma": 300}
NVML_BUDGET_MB = 1500
#: docs/deployment.md: NVML is opened again with backoff, 1 s doubling to 60 s
REOPEN_MAX_S = 60.0
LEAK_OR_BUDGET = frozenset({"leak", "gpu_memory_limit"})


def fault_key(key: str) -> bool:
    """A ``gpus/<i>`` key of the fake library's fault injection."""
    return key.startswith("rc_") or key in ("hang_ms", "procs_race")


class Chaos:
    def __init__(
        self,
        seed: int,
        seconds: float,
        mix: str,
        tmp: Path,
        tracker: Tracker,
        libdir: Path | None = None,
    ) -> None:
        self.seed = seed
        self.seconds = seconds
        self.mix = mix
        self.rng = random.Random(seed)
        self.tmp = tmp
        self.sim = tmp / "sim"
        self.tracker = tracker
        self.t0 = time.monotonic()
        self.oplog: list[str] = []
        self.violations: list[str] = []
        self.removed_pids: dict[int, str] = {}
        self.ngpu = 3 if mix == "healing" else self.rng.choice([2, 3])
        self.groups: list[Group] = self.initial_groups()
        env = {"BENCH_RUN_ID": tracker.run_id}
        # --mix nvml: the faults in force, and what they excuse
        self.sys_faults: dict[str, int] = {}
        self.lost_ok: set[int] = set()  # GPUs that may be reported lost and quarantined
        self.for_good: set[tuple[int, str]] = set()  # (GPU, symbol) answered 3 or 4
        self.uuid_index: dict[str, int] = {}
        if mix == "nvml":
            assert libdir is not None
            # the world the fake library reads
            self.uuid_index = {d.uuid: d.index for d in SimBackend(self.sim, self.ngpu).open()}
            env.update(GPU_SUPERVISOR_SIM_DIR=str(self.sim), LD_LIBRARY_PATH=str(libdir))
        self.sup = Supervisor(tmp, self.config(), env=env)
        self.http: httpx.Client | None = None
        # log-based invariants: how far the log has been judged, and what it said so far
        self.seen = 0
        self.state: dict[str, str] = {}  # worker -> its last state in the log
        self.pending_down: set[str] = set()  # acted on while ready, not yet out of ready
        self.pid_of: dict[str, int] = {}  # worker -> its latest spawned pid
        self.last_act: dict[tuple[str, str, str], tuple[float, int | None]] = {}
        self.deaths: dict[str, collections.deque[tuple[float, int | None, str]]] = {}
        self.gpus_of: dict[str, list[str]] = {}  # worker -> GPU UUIDs (from the API)
        self.judged: collections.Counter[str] = collections.Counter()  # what was checked

    # ------------------------------------------------------------------ configuration

    def log(self, *parts: object) -> None:
        line = f"[{time.monotonic() - self.t0:7.2f}] " + " ".join(str(p) for p in parts)
        self.oplog.append(line)
        print(line, flush=True)

    def group(self, name: str, replicas: int, **extra: Any) -> Group:
        g: Group = {
            "name": name,
            "replicas": replicas,
            "command": worker_cmd("sim_worker", str(self.rng.choice([300, 500, 800]))),
            "log_passthrough": True,
            "stop_timeout_s": 1,
            "drain_timeout_s": 1,
            "start_timeout_s": 10,
            "env": {"V": "0"},
            "restart": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "stable_s": 1, "burst": 0},
            "health": {"max_unavailable": 1},
        }
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(g.get(key), dict):
                g[key] = {**g[key], **value}
            else:
                g[key] = value
        return g

    def leak_health(self) -> dict[str, Any]:
        return {"leak_warmup_s": 0, "leak_window_s": 12, "leak_min_mb_per_min": 10}

    def template(self, name: str) -> Group:
        """The group ``name`` as the mix first configures it (a reload may add it again)."""
        rng = self.rng
        if self.mix == "nvml":
            return self.group(
                name,
                rng.choice([1, 2]),
                command=worker_cmd("sim_worker", str(NVML_MB[name])),
                health={
                    "watchdog_s": 1.5,
                    **self.leak_health(),
                    "gpu_memory_limit_mb": NVML_BUDGET_MB,
                    "on_leak": "restart",
                    "on_over_budget": "restart",
                },
            )
        if self.mix == "default":
            return self.group(name, rng.choice([1, 2]), health={"watchdog_s": 1.5})
        sim = "sim_worker"
        if name == "leaky":
            return self.group(
                name,
                rng.choice([1, 2]),
                command=worker_cmd(sim, "300", "--leak", str(rng.choice([4, 6]))),
                health={
                    **self.leak_health(),
                    "gpu_memory_limit_mb": 1200,
                    "on_leak": rng.choice(["drain", "restart"]),
                },
            )
        if name == "budget":
            return self.group(
                name,
                rng.choice([1, 2]),
                command=worker_cmd(sim, "400"),
                health={
                    "gpu_memory_limit_mb": 1000,
                    "on_over_budget": rng.choice(["drain", "restart"]),
                },
            )
        if name == "hot":
            return self.group(name, rng.choice([1, 2]), health={"on_thermal": "migrate"})
        if name == "cool":
            return self.group(
                name,
                2,
                health={"on_thermal": "derate", "max_unavailable": rng.choice([1, 2])},
            )
        # "trio": 3 leaking replicas, max_unavailable 1, drains that take a while
        return self.group(
            name,
            3,
            command=worker_cmd(sim, "500", "--leak", "4"),
            drain_timeout_s=1.5,
            health={
                **self.leak_health(),
                "gpu_memory_limit_mb": 1500,
                "on_leak": "drain",
                "max_unavailable": 1,
            },
        )

    def initial_groups(self) -> list[Group]:
        if self.mix != "healing":
            alpha = self.template("alpha")
            beta = self.template("beta")
            beta["health"].pop("watchdog_s")
            for g in (alpha, beta):
                g["replicas"] = self.rng.choice([2, 3])
                if self.rng.random() < 0.5:
                    g["port_base"] = 21000 if g is alpha else 22000
            return [alpha, beta]
        return [self.template(n) for n in ("leaky", "budget", "hot", "cool", "trio")]

    def names(self) -> list[str]:
        if self.mix != "healing":
            return ["alpha", "beta", "gamma"]
        return ["leaky", "budget", "hot", "cool", "trio"]

    def config(self) -> dict[str, Any]:
        gpu: dict[str, Any] = {"backend": "sim", "sim_dir": str(self.sim)}
        gpu["sim_devices"] = self.ngpu
        if self.mix == "nvml":
            gpu = {"backend": "nvml", "sim_dir": str(self.sim), "release_timeout_s": 1.0}
        if self.mix == "healing":
            gpu.update(thermal_sustain_s=0.5, thermal_clear_s=0.5, release_timeout_s=2)
        return {
            "supervisor": {"sample_interval_s": 0.2, "shutdown_timeout_s": 10},
            "gpu": gpu,
            "workers": [dict(g) for g in self.groups],
        }

    def desired(self) -> set[str]:
        return {f"{g['name']}-{i}" for g in self.groups for i in range(g["replicas"])}

    def max_unavailable(self, group: str) -> int:
        for g in self.groups:
            if g["name"] == group:
                return int(g["health"].get("max_unavailable", 1))
        return 1

    # ------------------------------------------------------------------ reading the world

    @property
    def api(self) -> httpx.Client:
        assert self.http is not None
        return self.http

    def events(self) -> list[dict[str, Any]]:
        with self.sup._cond:
            return list(self.sup.events)

    def workers(self) -> list[dict[str, Any]]:
        r = self.api.get("/api/v1/workers")
        r.raise_for_status()
        ws: list[dict[str, Any]] = r.json()
        for w in ws:
            self.gpus_of[w["name"]] = list(w.get("gpus") or [])
        return ws

    def chain_ok(self, pid: int) -> bool:
        with contextlib.suppress(psutil.Error):
            return any(p.pid == self.sup.pid for p in psutil.Process(pid).parents())
        return False

    def halted_now(self) -> bool:
        """A roll-out halted since the last reload (by design it leaves the old workers)."""
        evs = self.events()
        halted = False
        for i, e in enumerate(evs):
            if e.get("event") == "supervisor.rollout_halted":
                halted = True
            elif e.get("event") == "supervisor.reload":
                nxt = [x.get("event") for x in evs[i + 1 : i + 3]]
                if "supervisor.reload_rejected" not in nxt:
                    halted = False
        return halted

    def check_once(self) -> str | None:
        ws = self.workers()
        names = {w["name"] for w in ws}
        # a halted roll-out keeps the workers it would have removed (docs: by design)
        kept = names if self.halted_now() else set()
        if names != self.desired() and not kept:
            return f"API workers {sorted(names)} != desired {sorted(self.desired())}"
        ports: dict[int, str] = {}
        for w in ws:
            if w["pid"] is not None and w["state"] in ("starting", "ready", "draining"):
                if not alive(w["pid"]):
                    return f"{w['name']} {w['state']} pid {w['pid']} not alive"
                if not self.chain_ok(w["pid"]):
                    return f"{w['name']} pid {w['pid']} not a descendant of the supervisor"
            if w["pid"] is not None and w["state"] == "ready":
                if w["port"] in ports:
                    return f"port {w['port']} shared by {ports[w['port']]} and {w['name']}"
                ports[w["port"]] = w["name"]
        for pid, name in list(self.removed_pids.items()):
            if alive(pid) and name not in kept:
                return f"removed worker {name} pid {pid} still alive"
        try:
            st = json.loads((self.sup.state_dir / "state.json").read_text())
        except (OSError, ValueError) as e:
            return f"state.json unreadable: {e}"
        sn = {w["name"]: (w["state"], w["pid"]) for w in st["workers"]}
        an = {w["name"]: (w["state"], w["pid"]) for w in ws}
        if sn != an:
            return f"state.json {sn} != api {an}"
        status = self.api.get("/api/v1/gpu/status").json()
        devices = status["devices"]
        cool = {d.get("uuid") for d in devices if d.get("hot") is False}
        for w in ws:
            if w.get("derated") and w["gpus"] and all(g in cool for g in w["gpus"]):
                return f"{w['name']} derated ({w.get('derated_reason')}) on cool GPUs {w['gpus']}"
        text = self.api.get("/metrics").text
        up = re.search(r"^gpu_supervisor_nvml_up (\S+)$", text, re.M)
        again = self.api.get("/api/v1/gpu/status").json()["nvml_available"]
        if up is None:
            return "/metrics has no gpu_supervisor_nvml_up"
        if again == status["nvml_available"] and float(up.group(1)) != float(again):
            return f"gpu_supervisor_nvml_up {up.group(1)} but gpu/status nvml_available {again}"
        extra = set(re.findall(r'worker="([^"]+)"', text)) - self.desired() - kept
        if extra:
            return f"/metrics has series for workers {sorted(extra)}"
        gextra = set(re.findall(r'group="([^"]+)"', text)) - {g["name"] for g in self.groups}
        if gextra:
            return f"/metrics has series for groups {sorted(gextra)}"
        return None

    def hold(self, what: str, broken: Callable[[], str | None], timeout: float) -> bool:
        """Wait up to ``timeout`` for ``broken()`` to say nothing; a violation if it still does."""
        deadline = time.monotonic() + timeout
        last: str | None = None
        while time.monotonic() < deadline:
            try:
                last = broken()
            except (httpx.HTTPError, KeyError) as e:
                last = f"check error {e!r}"
            if last is None:
                return True
            time.sleep(0.1)
        self.violate(f"{what}: {last}")
        return False

    def check(self, what: str, timeout: float = 15.0) -> None:
        self.hold(f"after {what}", self.check_once, timeout)
        self.judge_log()

    def violate(self, what: str) -> None:
        self.violations.append(what)
        self.log("VIOLATION", what[:2000])

    # ------------------------------------------------------------------ the log's invariants

    def judge_log(self, final: bool = False) -> None:
        evs = self.events()
        for e in evs[self.seen :]:
            self.judge_event(e)
        self.seen = len(evs)
        now = time.time()
        for worker, deaths in self.deaths.items():
            while deaths and (final or now - deaths[0][0] > 10):
                _at, pid, reason = deaths.popleft()
                self.violate(f"death of {worker} pid {pid} ({reason}) has no post-mortem")
        with self.sup._cond:
            raw = list(self.sup.raw_stderr)
            self.sup.raw_stderr.clear()
        if any("Traceback" in line for line in raw):
            self.violate("raw stderr traceback:\n" + "\n".join(raw[-30:]))

    def judge_event(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        worker = e.get("worker")
        at = datetime.fromisoformat(e["timestamp"]).timestamp()
        crashed = "exc_info" in e or "exception" in e or "traceback" in json.dumps(e).lower()
        if (e.get("level") in ("error", "critical") and crashed) or kind in (
            "api.error",
            "loop.crashed",
        ):
            self.violate(f"error event {json.dumps(e)[:1500]}")
        if self.mix == "nvml":
            self.judge_fault_effects(e)
        if not isinstance(worker, str):
            return
        if kind == "worker.state":
            if e["old"] == "ready":
                self.pending_down.discard(worker)
            self.state[worker] = e["new"]
        elif kind == "worker.spawned":
            self.pid_of[worker] = e["pid"]
        elif kind == "worker.exited" and e.get("reason") not in NO_DEATH:
            self.deaths.setdefault(worker, collections.deque()).append(
                (at, e.get("pid"), str(e.get("reason")))
            )
        elif kind == "records.postmortem":
            deaths = self.deaths.get(worker)
            if deaths:
                deaths.popleft()
                self.judged["deaths with a post-mortem"] += 1
            path = self.sup.state_dir / "postmortems" / f"{e['id']}.json"
            if not path.exists():
                self.violate(f"post-mortem {e['id']} logged but no file {path}")
        elif kind == "heal.action":
            self.judge_action(e, worker, at)

    def judge_fault_effects(self, e: dict[str, Any]) -> None:
        """--mix nvml: no worker leaks or reaches its budget, and no GPU is lost or quarantined
        but those the run made lost (a lost fault or GPU, a device-fatal XID)."""
        kind, reason = e.get("event"), e.get("reason")
        if kind in ("heal.action", "records.postmortem") and reason in LEAK_OR_BUDGET:
            self.violate(
                f"{kind} {reason} (no worker leaks or reaches its budget): {json.dumps(e)}"
            )
        if kind != "heal.action" or (reason != "gpu_lost" and e.get("action") != "quarantine"):
            return
        self.judged["GPUs lost or quarantined judged against the faults"] += 1
        index = (e.get("evidence") or {}).get("gpu_index", self.uuid_index.get(e.get("gpu") or ""))
        if index not in self.lost_ok:
            self.violate(
                f"{e['action']} ({reason}) of GPU {index}, not lost nor made lost by a fault or "
                f"an XID: {json.dumps(e)[:800]}"
            )

    def judge_action(self, e: dict[str, Any], worker: str, at: float) -> None:
        action, reason = e["action"], e["reason"]
        pid = self.pid_of.get(worker)
        if action in DISRUPTIVE or action == "alert":
            key = (action, worker, reason)
            last = self.last_act.get(key)
            if (
                last is not None
                and last[1] == pid
                and at - last[0] < COOLDOWN_S
                and reason not in ("hang", "start_timeout")
            ):
                self.violate(
                    f"{action} {worker} ({reason}) repeated on pid {pid} "
                    f"{at - last[0]:.1f} s after the last: {json.dumps(e)[:600]}"
                )
            self.last_act[key] = (at, pid)
            self.judged["actions judged for the cooldown"] += 1
        if action not in DISRUPTIVE or reason in UNBOUNDED:
            return
        was_ready = self.state.get(worker) == "ready" and worker not in self.pending_down
        if not was_ready:
            return
        ev = e.get("evidence") or {}
        if reason == "xid" and (action == "drain" or self.sole_on(worker, e.get("gpu"))):
            return  # device-fatal (quarantine + drain), or the only worker on the GPU
        oom = ev.get("projected_oom_s")
        if reason == "leak" and isinstance(oom, int | float) and oom <= LEAK_IMMINENT_S:
            return
        group = worker.rsplit("-", 1)[0]
        current = self.desired()
        down = sorted(
            w
            for w, s in self.state.items()
            if w != worker
            and w.rsplit("-", 1)[0] == group
            and w in current
            and (s != "ready" or w in self.pending_down)
        )
        bound = self.max_unavailable(group)
        self.judged["actions on ready workers judged for max_unavailable"] += 1
        if len(down) >= bound:
            states = {w: self.state[w] for w in down}
            self.violate(
                f"max_unavailable {bound} of {group} exceeded: {action} {worker} ({reason}) "
                f"while {states} not ready: {json.dumps(e)[:600]}"
            )
        self.pending_down.add(worker)

    def sole_on(self, worker: str, gpu: Any) -> bool:
        busy = [
            w
            for w, gpus in self.gpus_of.items()
            if gpu in gpus and self.state.get(w) not in ("stopped", "fatal", "backoff")
        ]
        return busy == [worker]

    # ------------------------------------------------------------------ operations

    def rand_worker(self) -> str:
        return self.rng.choice(sorted(self.desired()) or [f"{self.names()[0]}-0"])

    def rand_group(self) -> str:
        return str(self.rng.choice([g["name"] for g in self.groups] + [self.names()[0]]))

    def world_gpu(self, i: int, *, faults_cleared: bool = False, **changes: Any) -> None:
        """Change GPU ``i``'s world file: a key set to None is removed; ``faults_cleared``
        removes every fault the fake NVML library reads."""
        f = self.sim / "gpus" / str(i)
        lines = f.read_text().splitlines() if f.exists() else []
        kv = dict(line.split(None, 1) for line in lines if line.strip())
        if faults_cleared:
            kv = {k: v for k, v in kv.items() if not fault_key(k)}
        for k, v in changes.items():
            if v is None:
                kv.pop(k, None)
            else:
                kv[k] = str(v)
        t = f.with_name(f".{i}.tmp")
        t.write_text("".join(f"{k} {v}\n" for k, v in kv.items()))
        os.replace(t, f)

    def op_api(self) -> str:
        cmd = self.rng.choice(["stop", "start", "restart", "drain", "start", "start"])
        if self.rng.random() < 0.3:
            g = self.rand_group()
            r = self.api.post(f"/api/v1/groups/{g}/{cmd}")
            return f"POST groups/{g}/{cmd} -> {r.status_code}"
        w = self.rand_worker()
        r = self.api.post(f"/api/v1/workers/{w}/{cmd}")
        return f"POST workers/{w}/{cmd} -> {r.status_code}"

    def op_rolling(self) -> str:
        g = self.rand_group()
        r = self.api.post(f"/api/v1/groups/{g}/rolling-restart")
        return f"rolling-restart {g} -> {r.status_code}"

    def op_cordon(self) -> str:
        i = self.rng.randrange(self.ngpu)
        c = self.rng.choice(["cordon", "uncordon", "uncordon", "lift"])
        if c == "lift":
            r = self.api.post(f"/api/v1/gpus/{i}/uncordon", params={"lift_quarantine": "true"})
        else:
            r = self.api.post(f"/api/v1/gpus/{i}/{c}")
        return f"{c} gpu {i} -> {r.status_code} {r.text[:100] if r.status_code >= 400 else ''}"

    def op_kill(self) -> str:
        ws = [w for w in self.workers() if w["pid"]]
        if not ws:
            return "kill: no pid"
        w = self.rng.choice(ws)
        with contextlib.suppress(ProcessLookupError):
            os.kill(w["pid"], signal.SIGKILL)
        return f"SIGKILL {w['name']} pid {w['pid']}"

    def op_sigstop(self) -> str:
        ws = [w for w in self.workers() if w["pid"] and w["group"] == "alpha"]
        if not ws:
            return "sigstop: no alpha pid"
        w = self.rng.choice(ws)
        with contextlib.suppress(ProcessLookupError):
            os.kill(w["pid"], signal.SIGSTOP)
        return f"SIGSTOP (heartbeats missing) {w['name']} pid {w['pid']}"

    def op_reload(self) -> str:
        rng = self.rng
        before = self.desired()
        saved = copy.deepcopy(self.groups)
        change = rng.choice(["scale", "scale", "env", "port", "remove", "add", "noop"])
        if self.mix == "healing" and change == "port":
            change = "env"
        desc = change
        if change == "scale" and self.groups:
            g = rng.choice(self.groups)
            g["replicas"] = rng.choice([0, 1, 2, 2, 3, 3, 4])
            desc += f" {g['name']}={g['replicas']}"
        elif change == "env" and self.groups:
            g = rng.choice(self.groups)
            g["env"] = {"V": str(rng.randrange(1000))}
            desc += f" {g['name']}"
        elif change == "port" and self.groups:
            g = rng.choice(self.groups)
            port = rng.choice([None, 21000, 22000, 23000, 21001, 22002])
            if port is None:
                g.pop("port_base", None)
            else:
                g["port_base"] = port
            desc += f" {g['name']}={port}"
        elif change == "remove" and len(self.groups) > 1:
            g = rng.choice(self.groups)
            self.groups = [x for x in self.groups if x is not g]
            desc += f" {g['name']}"
        elif change == "add":
            have = {g["name"] for g in self.groups}
            free = [n for n in self.names() if n not in have]
            if free:
                n = rng.choice(free)
                self.groups.append(self.template(n))
                desc += f" {n}"
        evs0 = self.api.get("/api/v1/events").json()
        seq0 = evs0[-1]["seq"] if evs0 else 0
        self.sup.write_config(self.config())
        via = rng.choice(["SIGHUP", "api"])
        if via == "SIGHUP":
            self.sup.signal(signal.SIGHUP)
        else:
            self.api.post("/api/v1/reload")
        deadline = time.monotonic() + 10
        ev: dict[str, Any] = {"event": "??"}
        while time.monotonic() < deadline:
            got = [
                e
                for e in self.api.get("/api/v1/events", params={"since": seq0}).json()
                if e.get("type") in ("reload.accepted", "reload.rejected")
            ]
            if got:
                ev = got[-1]
                break
            time.sleep(0.05)
        if ev.get("type") != "reload.accepted":
            self.log("  reload rejected:", json.dumps(ev)[:300])
            self.groups = saved
        after = self.desired()
        spawned = [e for e in self.events() if e.get("event") == "worker.spawned"]
        for name in before - after:
            for e in spawned:
                if e.get("worker") == name:
                    self.removed_pids[e["pid"]] = name
        for pid, name in list(self.removed_pids.items()):
            if name in after:
                del self.removed_pids[pid]  # the name came back
        return f"reload ({via}) {desc} -> {ev.get('type', ev.get('event'))}"

    def op_xid(self) -> str:
        i = self.rng.randrange(self.ngpu)
        if self.mix == "healing":
            xid = self.rng.choice([*DEVICE_XIDS, *WORKER_XIDS, *WORKER_XIDS])
        else:
            xid = self.rng.choice([13, 31, 43, 48, 63, 92, 94, 13, 43])
        if xid in DEVICE_XIDS:
            self.lost_ok.add(i)
        with open(self.sim / "events", "a") as f:
            f.write(f"{i} {xid}\n")
        return f"XID {xid} on gpu {i}"

    def op_temp(self) -> str:
        i = self.rng.randrange(self.ngpu)
        t = self.rng.choice([40, 50, 95, 99])
        reasons = self.rng.choice([0, 0, 0, *HOT_REASONS])
        self.world_gpu(i, temperature_c=t, clocks_event_reasons=reasons)
        return f"gpu {i} temp {t} reasons {reasons:#x}"

    def op_lost(self) -> str:
        i = self.rng.randrange(self.ngpu)
        v = self.rng.choice([0, 0, 1])
        if v:
            self.lost_ok.add(i)
        self.world_gpu(i, lost=v)
        return f"gpu {i} lost={v}"

    def op_signal(self) -> str:
        w = self.rand_worker()
        r = self.api.post(f"/api/v1/workers/{w}/signal", params={"signal": "SIGUSR1"})
        return f"signal SIGUSR1 {w} -> {r.status_code}"

    def op_breach(self) -> str:
        """A ``budget`` worker's sim GPU memory raised over its ``gpu_memory_limit_mb``."""
        ws = [w for w in self.workers() if w["pid"] and w["group"] == "budget" and w["gpus"]]
        if not ws:
            return "breach: no budget worker with a process"
        w = self.rng.choice(ws)
        mb = self.rng.choice([1200, 2500])
        proc = self.sim / "procs" / str(w["pid"])
        if not proc.exists():
            return f"breach: {w['name']} has no claim yet"
        tmp = proc.with_name(f".chaos-{w['pid']}.tmp")
        tmp.write_text("".join(f"{g} {mb}\n" for g in w["gpus"]))
        os.replace(tmp, proc)
        return f"breach {w['name']} pid {w['pid']} {mb} MiB"

    def op_lift(self) -> str:
        i = self.rng.randrange(self.ngpu)
        self.world_gpu(i, lost=0)
        r = self.api.post(f"/api/v1/gpus/{i}/uncordon", params={"lift_quarantine": "true"})
        return f"lift gpu {i} -> {r.status_code}"

    def set_sys_faults(self) -> None:
        t = self.sim / ".nvml.tmp"
        t.write_text("".join(f"rc_{sym} {code}\n" for sym, code in self.sys_faults.items()))
        os.replace(t, self.sim / "nvml")

    def op_fault(self) -> str:
        i = self.rng.randrange(self.ngpu)
        sym = self.rng.choice(DEVICE_SYMBOLS)
        kind = self.rng.choices(["passing", "gone", "lost", "for good"], [5, 3, 1, 1])[0]
        if kind == "for good" and sym not in OPTIONAL_SYMBOLS:
            kind = "passing"
        codes = {"passing": NVML_PASSING, "gone": NVML_GONE, "lost": NVML_LOST}
        code = self.rng.choice(codes.get(kind, NVML_FOR_GOOD))
        if kind == "lost":
            self.lost_ok.add(i)
        elif kind == "for good":
            self.for_good.add((i, sym))
        fault: dict[str, Any] = {f"rc_{sym}": code}
        self.world_gpu(i, **fault)
        return f"fault gpu {i} rc_{sym} {code} ({kind})"

    def op_sys_fault(self) -> str:
        sym = self.rng.choice(SYSTEM_SYMBOLS)
        self.sys_faults[sym] = code = self.rng.choice(NVML_PASSING + NVML_GONE)
        self.set_sys_faults()
        return f"fault system rc_{sym} {code}"

    def op_clear(self) -> str:
        what = self.rng.choice(["gpu", "gpu", "system", "all"])
        gpus = [self.rng.randrange(self.ngpu)] if what == "gpu" else []
        for i in range(self.ngpu) if what == "all" else gpus:
            self.world_gpu(i, faults_cleared=True)
        if what != "gpu":
            self.sys_faults.clear()
            self.set_sys_faults()
        return f"faults cleared: {what} {gpus or ''}"

    def op_hang(self) -> str:
        i = self.rng.randrange(self.ngpu)
        ms = self.rng.choice([300, 2000, 4000, 7000])
        self.world_gpu(i, hang_ms=ms)
        time.sleep(self.rng.uniform(0.5, 3.0))
        if self.rng.random() < 0.6:
            self.world_gpu(i, hang_ms=None)
            return f"gpu {i} calls hang {ms} ms, cleared"
        return f"gpu {i} calls hang {ms} ms (left)"

    def op_race(self) -> str:
        i = self.rng.randrange(self.ngpu)
        n = self.rng.choice([1, 2, 3, 5, 10])
        self.world_gpu(i, procs_race=n)
        return f"gpu {i} procs_race {n}"

    def ops(self) -> list[tuple[Any, int]]:
        if self.mix == "healing":
            return [
                (self.op_api, 2),
                (self.op_kill, 2),
                (self.op_reload, 2),
                (self.op_xid, 2),
                (self.op_temp, 5),
                (self.op_breach, 3),
                (self.op_lift, 3),
                (self.op_lost, 1),
            ]
        ops = [
            (self.op_api, 8),
            (self.op_rolling, 2),
            (self.op_cordon, 4),
            (self.op_kill, 4),
            (self.op_sigstop, 2),
            (self.op_reload, 5),
            (self.op_xid, 2),
            (self.op_temp, 2),
            (self.op_lost, 1),
        ]
        if self.mix == "nvml":
            ops += [
                (self.op_fault, 8),
                (self.op_sys_fault, 3),
                (self.op_clear, 6),
                (self.op_hang, 2),
                (self.op_race, 2),
                (self.op_lift, 3),
            ]
        return ops

    # ------------------------------------------------------------------ the run

    def telemetry_missing(self) -> str | None:
        """--mix nvml: what GPU telemetry still lacks (None: every GPU answers again)."""
        st = self.api.get("/api/v1/gpu/status").json()
        if not st["nvml_available"]:
            return f"NVML down: {st.get('error')}"
        if len(st["devices"]) != self.ngpu:
            return f"{len(st['devices'])} GPUs of {self.ngpu}"
        missing = []
        for d in st["devices"]:
            i = d["id"]
            if not d["healthy"] and not d["quarantined"]:
                missing.append((i, f"unhealthy: {d.get('error')}"))
            if d["memory"]["used_mb"] is None:
                missing.append((i, "memory"))
            temp_for_good = (i, "nvmlDeviceGetTemperatureV") in self.for_good
            if d.get("temperature_celsius") is None and not temp_for_good:
                missing.append((i, "temperature"))
            if d.get("processes") is None:
                missing.append((i, "processes"))
        return f"readings missing: {missing}" if missing else None

    def xids_unwatched(self) -> str | None:
        devices = self.api.get("/api/v1/gpu/status").json()["devices"]
        bad = [
            (d["id"], d.get("xids_watched")) for d in devices if d.get("xids_watched") is not True
        ]
        return f"XIDs not watched on {bad}" if bad or not devices else None

    def memory_wrong(self) -> str | None:
        bad = []
        for w in self.workers():
            want = NVML_MB[w["group"]] * max(1, len(w["gpus"] or []))
            got = w.get("gpu_memory_mb")
            if got is None or abs(got - want) > 1:
                bad.append((w["name"], w["gpus"], got, want))
        return f"(worker, GPUs, gpu_memory_mb, held) {bad}" if bad else None

    def nvml_back(self) -> None:
        """--mix nvml, every worker ready after the faults cleared: XIDs watched and delivered
        again, and each worker's GPU memory what it holds."""
        self.hold("XIDs watched again after the faults cleared", self.xids_unwatched, 35)
        mark = len(self.events())
        with open(self.sim / "events", "a") as f:
            f.write("0 92\n")

        def undelivered() -> str | None:
            xids = [e for e in self.events()[mark:] if e.get("event") == "gpu.xid"]
            return None if any(e.get("xid") == 92 for e in xids) else "no gpu.xid 92 on GPU 0"

        self.hold("an XID after the faults cleared", undelivered, 35)
        self.hold("GPU memory per worker after the faults cleared", self.memory_wrong, 10)

    def quiet(self) -> None:
        self.log("quiet period")
        for i in range(self.ngpu):
            self.world_gpu(i, faults_cleared=True, lost=0, temperature_c=40, clocks_event_reasons=0)
        if self.mix == "nvml":
            self.sys_faults.clear()
            self.set_sys_faults()
            t = time.monotonic()
            if self.hold(
                "telemetry after the faults cleared", self.telemetry_missing, REOPEN_MAX_S + 10
            ):
                self.log(f"telemetry back {time.monotonic() - t:.1f} s after the faults cleared")
        self.check("quiet", 30)
        # a lift is refused (409) until a sample has seen the GPU answer again
        lifting = set(range(self.ngpu))
        deadline = time.monotonic() + 15
        while lifting and time.monotonic() < deadline:
            for i in sorted(lifting):
                r = self.api.post(f"/api/v1/gpus/{i}/uncordon", params={"lift_quarantine": "true"})
                if r.status_code != 409:
                    lifting.discard(i)
            time.sleep(0.2)
        if lifting:
            self.violate(f"quarantines of GPUs {sorted(lifting)} not lifted in 15 s")
        for g in self.groups:
            if g["replicas"]:
                code = self.api.post(f"/api/v1/groups/{g['name']}/start").status_code
                self.log("start group", g["name"], code)
        # a derated worker is restored thermal_clear_s after its GPU cooled (30 s by default)
        deadline = time.monotonic() + (30 if self.mix == "healing" else 45)
        notready: list[tuple[str, str]] = []
        derated: list[str] = []
        while time.monotonic() < deadline:
            ws = self.workers()
            notready = [(w["name"], w["state"]) for w in ws if w["state"] != "ready"]
            derated = [w["name"] for w in ws if w.get("derated")]
            if not notready and not derated:
                break
            time.sleep(0.2)
        if notready:
            self.violate(f"not all ready after start + lift: {notready}")
        if derated:
            self.violate(f"still derated with every GPU cool: {derated}")
        self.judged["derated workers restored in the quiet period"] += len(
            {
                e["worker"]
                for e in self.events()
                if e.get("event") == "heal.action" and e["action"] == "derate"
            }
        )
        self.check("all started", 20)
        if self.mix == "nvml":
            self.nvml_back()
            self.judge_log()

    def run(self) -> None:
        self.log(f"SEED {self.seed} mix {self.mix} dir {self.tmp}")
        self.sup.start()
        self.tracker.add_pid(self.sup.pid)
        self.http = httpx.Client(base_url=self.sup.api_url(20), timeout=10)
        funcs, weights = zip(*self.ops(), strict=True)
        self.check("start", 30)
        nops = 0
        while time.monotonic() - self.t0 < self.seconds:
            for _ in range(self.rng.choice([1, 1, 2, 3])):
                f = self.rng.choices(funcs, weights)[0]
                try:
                    self.log("OP", f())
                except httpx.HTTPError as e:
                    self.violate(f"http error in {f.__name__}: {e!r}")
                nops += 1
                time.sleep(self.rng.uniform(0, 0.4 if self.mix == "default" else 1.2))
            self.check(f"op#{nops}")
        self.quiet()
        self.log("SIGTERM")
        self.sup.signal(signal.SIGTERM)
        code = self.sup.wait_exit(40)
        self.log("exit code", code)
        if code != 0:
            self.violate(f"exit code {code}")
        self.judge_log(final=True)
        left = [p for p in self.sup.seen_pids if alive(p)]
        if left:
            self.violate(f"processes left after the supervisor's exit: {left}")
        zombies = []
        for p in self.sup.seen_pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(p).status() == psutil.STATUS_ZOMBIE:
                    zombies.append(p)
        if zombies:
            self.violate(f"zombies after exit: {zombies}")

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        survivors = self.sup.close()
        if survivors:
            self.violate(f"the harness's close killed survivors {survivors}")
        with open(self.tmp / "events.jsonl", "w") as fh:
            for e in self.events():
                fh.write(json.dumps(e) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--seconds", type=float, default=90.0, help="operations for this long")
    parser.add_argument("--mix", choices=("default", "healing", "nvml"), default="default")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"SEED {seed}", flush=True)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    if args.mix == "nvml" and find_compiler() is None:
        print("--mix nvml needs gcc to build the fake libnvidia-ml.so.1: gcc is not installed")
        return 2
    tracker = Tracker()
    tmp = Path(tempfile.mkdtemp(prefix=f"chaos-{args.mix}-{seed}-"))
    libdir = None
    if args.mix == "nvml":
        try:
            libdir = build_fake_nvml(tmp / "fakenvml")
        except FakeNvmlBuildError as exc:
            print(f"--mix nvml: {exc}")
            shutil.rmtree(tmp, ignore_errors=True)
            return 2
    chaos = Chaos(seed, args.seconds, args.mix, tmp, tracker, libdir)
    interrupted = False
    try:
        chaos.run()
    except KeyboardInterrupt:
        interrupted = True
        chaos.log("interrupted")
    except Exception as exc:  # a crash of the driver is reported as one, with the seed
        chaos.violate(f"driver error {exc!r}")
    finally:
        with contextlib.suppress(Exception):
            chaos.close()
        left = tracker.kill_all()
        if left:
            chaos.violate(f"processes of the run still alive after the cleanup: {left}")
    if chaos.violations:
        print(f"\nFAILED: seed {seed} mix {args.mix}: {len(chaos.violations)} violation(s)")
        for v in chaos.violations:
            print("  V:", v[:2000])
        print("operation log tail:")
        print("\n".join(chaos.oplog[-40:]))
        print(f"run directory kept: {tmp}")
        print(f"again: python bench/chaos.py --seed {seed} --mix {args.mix}")
        return 1
    print(f"OK: seed {seed} mix {args.mix}: every invariant held")
    for what, n in sorted(chaos.judged.items()):
        print(f"  {n:5d} {what}")
    if args.keep:
        print(f"run directory kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
