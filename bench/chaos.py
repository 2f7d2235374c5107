"""Chaos: random operations against a real gpu-supervisor on simulated GPUs, with invariants.

    .venv/bin/python bench/chaos.py [--seed N] [--seconds 90]
                                    [--mix default|healing|nvml|rollout] [--keep]

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

``--mix rollout``: roll-outs while other things happen. Groups ``ra`` (watchdog, ``on_thermal``
derate), ``rb`` (migrate) and, added and removed by reloads, ``rc``: 2-4 replicas each,
``max_unavailable`` 1-2, ``stable_s`` 0.5-1.5, ``start_timeout_s`` 4, on 3 GPUs, some with a
``port_base``. Every definition a reload writes carries a marker, ``CHAOS_DEF=<n>`` in the
group's ``env`` (read back from ``/proc/PID/environ``); a definition is good (``sim_worker``,
some leaking) or fails: the worker exits at start, never becomes ready, or exits just after
its ``READY=1``, before ``stable_s``. Operations: reloads (over the API, SIGHUP or
``gpu-supervisor reload --wait`` in the background; each request's file is known, none is
written before the supervisor read the last) that change one or two groups' environment,
arguments or ``limits``, give them a failing definition, tune them in place, scale them, roll
them back to an earlier good definition, change what they run but not the marker (arguments,
``limits.nofile``, ``gpu_memory_limit_mb``, ``port_base``), hand one group's ports to another,
add or remove ``rc``; two reloads in a row (the second supersedes the first's roll-outs);
``POST .../rolling-restart`` (or ``restart --rolling --wait``), more often of a group being
rolled; SIGKILL and SIGSTOP of workers, more often of a group being rolled (old and new
replicas alike); operators' stop, start, restart and drain; XIDs (worker-fatal, device-fatal;
XIDs carry no pid here, so every worker-fatal one is pid-less); hot GPUs; quarantines lifted.
Its invariants, from the journal (``/api/v1/events``) and the log: every roll-out ends
(``rollout.done`` / ``rollout.halted``, or listed as superseded before it began) within 30 s
plus 15 s a worker; ``reload.done`` comes after its groups' roll-outs and lists as halted and
superseded exactly those that were; a halt is true: superseded by a later reload that was
made, refused, the new definition fails, or something the run did to the group's workers or
their GPUs (a kill, an operator's command, an XID, heat, a healing action, a worker running a
failing definition by then: the known halt on a pid-less worker-fatal XID on a new replica's
GPU falls in there); a roll-out takes a ready worker down only while fewer than
``max_unavailable`` others of its group are on their way down or up (but waiting for a GPU);
no group has two workers on failing programs for longer than two failed starts (a roll-out
halts at the first); after a halt of a failing definition it runs only where the roll-out
halted; each ``--wait`` client's exit code is the journal's verdict. In the quiet period: every
roll-out ends, groups are started, and every worker of a group whose last reload roll-out
was done runs that roll-out's definition (marker, arguments, open-files limit); then a final
``reload --wait`` gives every group a new good definition: it must exit 0, and every worker be
ready on it.

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
import subprocess
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

# --mix rollout: definitions that fail (the worker exits at start, never becomes ready, or
# exits just after its READY=1, before stable_s), and the bounds the roll-outs are held to
BAD_DEFS = ("exit", "hang", "crash")
ROLL_START_TIMEOUT_S = 4.0
#: a roll-out ends (rollout.done or rollout.halted) within this plus ROLL_PER_WORKER_S a worker
ROLL_BASE_S = 30.0
ROLL_PER_WORKER_S = 15.0
#: workers of a group on their way down or back up (the roll-out waits for them)
BUSY = frozenset({"starting", "stopping", "draining", "backoff"})


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
        self.ngpu = 3 if mix in ("healing", "rollout") else self.rng.choice([2, 3])
        # --mix rollout: the definitions written (CHAOS_DEF marker -> kind), each group's
        # history of them, the file each reload request read, the roll-outs not ended yet,
        # what may excuse a halt, and the client commands waiting in the background
        self.defs = 0
        self.def_kind: dict[int, str] = {}
        self.def_hist: dict[str, list[Group]] = {}
        self.req_file: dict[int, list[Group]] = {}
        self.reload_reqs = 0  # the supervisor's reload request numbers (chaos makes them all)
        self.rolling_reqs = 0  # and its rolling restart request numbers
        self.jseq = 0  # the journal read so far
        self.journal: list[dict[str, Any]] = []
        self.open_rolls: list[dict[str, Any]] = []
        self.ended_rolls: list[dict[str, Any]] = []
        self.accepted: dict[int, dict[str, Any]] = {}  # reload request -> its reload.accepted
        self.last_roll: dict[str, dict[str, Any]] = {}  # group -> its last reload roll-out
        self.excuses: list[tuple[float, str, str | None, str | None]] = []
        self.ever_on: dict[str, set[str]] = {}  # worker -> every GPU it was seen on
        self.argv_of: dict[str, list[str]] = {}  # worker -> its latest process's argv
        self.op_restart: dict[str, float] = {}  # worker or group -> an operator's restart
        self.waiting: list[tuple[subprocess.Popen[str], str, int | None, str, float]] = []
        self.gpu_wait: dict[str, bool] = {}  # worker -> in backoff waiting for a GPU
        self.removing: set[str] = set()  # groups a reload removed (from the log)
        self.spread_since: dict[str, float] = {}  # group -> since when 2 run failing programs
        self.groups: list[Group] = self.initial_groups()
        self.initial_file = copy.deepcopy(self.groups)
        self.force: list[Group] = copy.deepcopy(self.groups)  # --mix rollout: in_force()
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
        if self.mix == "rollout":
            replicas = rng.choice([2, 3, 4])
            g = self.group(
                name,
                replicas,
                start_timeout_s=ROLL_START_TIMEOUT_S,
                restart={"stable_s": rng.choice([0.5, 1.0, 1.5])},
                health={
                    **self.leak_health(),
                    "gpu_memory_limit_mb": 2000,
                    "on_leak": "restart",
                    "max_unavailable": rng.choice([1, 2]),
                    "on_thermal": {"ra": "derate", "rb": "migrate"}.get(name, "alert"),
                    **({"watchdog_s": 1.5} if name == "ra" else {}),
                },
            )
            self.new_def(g, "good")
            return g
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
        if self.mix == "rollout":
            groups = [self.template("ra"), self.template("rb")]
            for g, port in zip(groups, (21000, 22000), strict=True):
                if self.rng.random() < 0.5:
                    g["port_base"] = port
            return groups
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
        if self.mix == "rollout":
            return ["ra", "rb", "rc"]
        if self.mix != "healing":
            return ["alpha", "beta", "gamma"]
        return ["leaky", "budget", "hot", "cool", "trio"]

    def config(self) -> dict[str, Any]:
        gpu: dict[str, Any] = {"backend": "sim", "sim_dir": str(self.sim)}
        gpu["sim_devices"] = self.ngpu
        if self.mix == "nvml":
            gpu = {"backend": "nvml", "sim_dir": str(self.sim), "release_timeout_s": 1.0}
        if self.mix in ("healing", "rollout"):
            gpu.update(thermal_sustain_s=0.5, thermal_clear_s=0.5, release_timeout_s=2)
        return {
            "supervisor": {"sample_interval_s": 0.2, "shutdown_timeout_s": 10},
            "gpu": gpu,
            "workers": [dict(g) for g in self.groups],
        }

    def in_force(self) -> list[Group]:
        """The groups as the supervisor runs them: --mix rollout, the file of the last reload
        it accepted (each request's file is known), but for a group whose roll-out of it
        halted or was superseded (its definition before that reload); else the file."""
        if self.mix != "rollout":
            return self.groups
        return list(self.force)

    def desired(self) -> set[str]:
        return {f"{g['name']}-{i}" for g in self.in_force() for i in range(g["replicas"])}

    def max_unavailable(self, group: str) -> int:
        for g in self.in_force():
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
        if self.mix == "rollout":  # the workers that exist now (a reload removes some)
            self.gpus_of = {n: g for n, g in self.gpus_of.items() if n in {w["name"] for w in ws}}
        for w in ws:
            self.gpus_of[w["name"]] = list(w.get("gpus") or [])
            self.ever_on.setdefault(w["name"], set()).update(w.get("gpus") or [])
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
        if self.mix == "rollout":
            # the groups a roll-out runs on (or halted on) have the workers of two plans
            self.poll_journal()
            loose = self.loose_groups()
            kept = {n for n in names if n.rpartition("-")[0] in loose}
            want = {n for n in self.desired() if n.rpartition("-")[0] not in loose}
            if names - kept != want:
                return f"API workers {sorted(names - kept)} != desired {sorted(want)}"
            spread = self.failing_spread(ws)
            if spread:
                return spread
        elif names != self.desired() and not kept:
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
        gextra = set(re.findall(r'group="([^"]+)"', text)) - {g["name"] for g in self.in_force()}
        if self.mix == "rollout":
            gextra -= self.loose_groups() | {g["name"] for g in self.groups}
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
        if self.mix == "rollout":
            self.poll_journal()  # the files in force, for the log's take-downs
        self.judge_log()
        if self.mix == "rollout":
            self.poll_journal()
            self.judge_clients()
            now = time.time()
            for ro in self.open_rolls:
                if not ro.get("overdue") and now - ro["t0"] > ro["bound"]:
                    ro["overdue"] = True
                    self.violate(f"roll-out not ended in {ro['bound']:g} s: {ro}")

    def lift_all_and_start(self) -> None:
        """The quiet period's first step: every quarantine lifted (a lift is refused, 409,
        until a sample has seen the GPU answer again: tried for 15 s), every group started."""
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
        if kind == "supervisor.reload":
            self.removing = (self.removing | set(e.get("removed") or ())) - set(
                e.get("added") or ()
            )
        if not isinstance(worker, str):
            return
        if kind == "worker.state":
            if self.mix == "rollout":
                self.judge_takedown(e, worker, at)
                # a worker waiting for a GPU looks again (starting, no process) now and then
                if e["new"] == "backoff":
                    why = str(e.get("reason", ""))
                    self.gpu_wait[worker] = why.startswith("waiting for a GPU")
                elif not (e["new"] == "starting" and e["old"] == "backoff"):
                    self.gpu_wait[worker] = False
            if e["old"] == "ready":
                self.pending_down.discard(worker)
            self.state[worker] = e["new"]
        elif kind == "worker.spawned":
            self.pid_of[worker] = e["pid"]
            self.argv_of[worker] = list(e.get("argv") or [])
            self.gpu_wait[worker] = False
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
        elif kind == "worker.moved":
            self.gpus_of[worker] = list(e.get("new_gpus") or [])
            self.ever_on.setdefault(worker, set()).update(self.gpus_of[worker])
        elif kind == "heal.action":
            self.judge_action(e, worker, at)
            if e["action"] in DISRUPTIVE:
                self.excuses.append((at, f"heal {e['action']} ({e['reason']})", worker, None))

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
        if reason == "xid" and ev.get("only_worker_on_gpu"):
            # the placements read last may be older than a restart that moved a worker off
            # the GPU (a reload's): read them again before calling it a breach
            with contextlib.suppress(httpx.HTTPError):
                self.workers()
            if self.sole_on(worker, e.get("gpu")):
                return
        oom = ev.get("projected_oom_s")
        if reason == "leak" and isinstance(oom, int | float) and oom <= LEAK_IMMINENT_S:
            return
        group = worker.rsplit("-", 1)[0]
        current = self.desired()
        if self.mix == "rollout":  # a halted roll-out's file is not in force: the API's
            current &= set(self.gpus_of)
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
            on_gpu = {w: self.state.get(w) for w, g in self.gpus_of.items() if e.get("gpu") in g}
            self.violate(
                f"max_unavailable {bound} of {group} exceeded: {action} {worker} ({reason}) "
                f"while {states} not ready (on its GPU: {on_gpu}): {json.dumps(e)[:600]}"
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
        if self.mix == "rollout":
            return [
                (self.op_roll_reload, 7),
                (self.op_double_reload, 2),
                (self.op_roll_restart, 4),
                (self.op_roll_kill, 5),
                (self.op_roll_api, 4),
                (self.op_roll_xid, 2),
                (self.op_roll_temp, 2),
                (self.op_lift, 2),
            ]
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

    # ------------------------------------------------------------------ --mix rollout

    def new_def(self, g: Group, kind: str) -> int:
        """Give group ``g`` a new definition of ``kind`` (its ``CHAOS_DEF`` marker, returned):
        ``good`` or ``leaky`` (they run), or one that fails (``BAD_DEFS``)."""
        self.defs += 1
        n = self.defs
        g["env"] = {**g.get("env", {}), "CHAOS_DEF": str(n)}
        if kind == "good":
            g["command"] = worker_cmd("sim_worker", str(self.rng.choice([300, 500, 800])))
        elif kind == "leaky":
            g["command"] = worker_cmd("sim_worker", "300", "--leak", "4")
        elif kind == "exit":
            g["command"] = worker_cmd("exit_with_code", "3")
        elif kind == "hang":
            g["command"] = worker_cmd("never_ready")
        else:  # crash: ready, then exits before stable_s
            g["command"] = worker_cmd("crash_after", "0.2")
        self.def_kind[n] = kind
        self.def_hist.setdefault(g["name"], []).append(copy.deepcopy(g))
        return n

    @staticmethod
    def marker(g: Group) -> int:
        return int(g["env"]["CHAOS_DEF"])

    def bad(self, marker: int | None) -> bool:
        return marker is not None and self.def_kind.get(marker) in BAD_DEFS

    def find(self, groups: list[Group], name: str) -> Group | None:
        return next((g for g in groups if g["name"] == name), None)

    def log_count(self, kind: str, **match: Any) -> int:
        return sum(
            1
            for e in self.events()
            if e.get("event") == kind and all(e.get(k) == v for k, v in match.items())
        )

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.05)
        self.violate(f"{what}: not within {timeout:g} s")
        return False

    def client(self, *args: str) -> subprocess.Popen[str]:
        """``gpu-supervisor ARGS --url API`` in the background (a ``--wait`` client)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", *args, "--url", str(self.api.base_url)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "BENCH_RUN_ID": self.tracker.run_id},
        )
        self.tracker.add_popen(proc)
        return proc

    def taken_up(self, request: int) -> bool:
        """The supervisor read the file of reload ``request`` (it was accepted, rejected or
        checked to supersede a roll-out in progress)."""
        self.poll_journal()
        if any(
            e["type"] in ("reload.accepted", "reload.rejected") and e.get("request", 0) >= request
            for e in self.journal
        ):
            return True
        return self.log_count("supervisor.reload_queued", request=request) > 0

    def issue_reload(self, via: str) -> tuple[int, subprocess.Popen[str] | None]:
        """Write the config and ask for a reload (``api``, ``SIGHUP`` or ``cli``: ``reload
        --wait`` in the background); return its request number once the supervisor has read
        its file (no other file is written before: each request's file is known)."""
        self.sup.write_config(self.config())
        r = self.reload_reqs + 1
        self.req_file[r] = copy.deepcopy(self.groups)
        proc = None
        if via == "api":
            got = int(self.api.post("/api/v1/reload").json()["request"])
            if got != r:
                self.violate(f"reload request numbered {got}, {r} expected")
                self.req_file[got] = self.req_file.pop(r)
                r = got
        elif via == "SIGHUP":
            n0 = self.log_count("supervisor.signal", signal="SIGHUP")
            self.sup.signal(signal.SIGHUP)
            self.wait_for(
                "SIGHUP logged",
                lambda: self.log_count("supervisor.signal", signal="SIGHUP") > n0,
                10,
            )
        else:
            n0 = self.log_count("api.command", command="reload")
            p = proc = self.client("reload", "--wait")
            self.wait_for(
                "reload --wait's request",
                lambda: (
                    self.log_count("api.command", command="reload") > n0 or p.poll() is not None
                ),
                10,
            )
            self.waiting.append((proc, "reload", r, "", time.time()))
        self.reload_reqs = r
        self.wait_for(f"reload request {r} taken up", lambda: self.taken_up(r), 10)
        return r, proc

    def loose_groups(self) -> set[str]:
        """Groups a roll-out runs on, or whose last reload roll-out did not complete."""
        loose = {str(ro["group"]) for ro in self.open_rolls}
        loose |= {g for g, ro in self.last_roll.items() if ro["end"]["type"] != "rollout.done"}
        return loose

    def rolls_of(self, group: str) -> list[dict[str, Any]]:
        return [ro for ro in self.open_rolls if ro["group"] == group]

    def op_roll_reload(self) -> str:
        """A reload that changes one or two groups' definitions (environment, arguments,
        limits; some that fail), tunes them in place, scales them, rolls one back to an
        earlier definition, or adds or removes a group."""
        rng = self.rng
        descs = []
        for g in rng.sample(self.groups, min(len(self.groups), rng.choice([1, 1, 1, 2]))):
            change = rng.choices(
                ["env", "args", "limits", "bad", "tune", "scale", "leaky", "back", "group", "same"],
                [4, 3, 2, 4, 2, 2, 1, 2, 1, 3],
            )[0]
            with_ports = [x for x in self.groups if x is not g and x.get("port_base")]
            if change == "group" and with_ports and rng.random() < 0.6:
                # ports handed over: this group takes another's range, which moves on
                other = rng.choice(with_ports)
                free = [
                    p
                    for p in (21000, 22000, 23000, 24000)
                    if p not in {x.get("port_base") for x in self.groups}
                ]
                g["port_base"] = other["port_base"]
                other["port_base"] = free[0]
                descs.append(
                    f"{g['name']} takes {other['name']}'s ports {g['port_base']}, "
                    f"{other['name']} moves to {other['port_base']}"
                )
                continue
            if change == "same":  # what the workers run changes, but not their marker
                what = rng.choice(["args", "limits", "budget", "port"])
                if what == "args" and self.def_kind[self.marker(g)] == "good":
                    g["command"] = worker_cmd("sim_worker", str(rng.choice([300, 500, 800])))
                elif what == "limits":
                    g["limits"] = {"nofile": rng.choice([1024, 2048, 4096])}
                elif what == "budget":  # a placement setting: workers may move
                    g["health"] = {**g["health"], "gpu_memory_limit_mb": rng.choice([2000, 2500])}
                else:
                    port = rng.choice([None, 21000, 22000, 23000])
                    if port is None:
                        g.pop("port_base", None)
                    elif port not in {x.get("port_base") for x in self.groups}:
                        g["port_base"] = port
                descs.append(f"{g['name']} same def {self.marker(g)}, new {what}")
                continue
            if change in ("env", "args", "limits", "leaky", "bad"):
                if change == "limits":
                    g["limits"] = {"nofile": rng.choice([1024, 2048, 4096])}
                kind = {"bad": rng.choice(BAD_DEFS), "leaky": "leaky"}.get(change, "good")
                prev = self.def_kind[self.marker(g)]
                if change == "env" and prev in ("good", "leaky"):  # the same program
                    cmd = list(g["command"])
                    n = self.new_def(g, prev)
                    g["command"] = cmd
                    self.def_hist[g["name"]][-1] = copy.deepcopy(g)
                else:
                    n = self.new_def(g, kind)
                descs.append(f"{g['name']} {change} -> def {n} ({self.def_kind[n]})")
            elif change == "tune":
                g["restart"] = {**g["restart"], "stable_s": rng.choice([0.5, 1.0, 1.5])}
                g["health"] = {**g["health"], "max_unavailable": rng.choice([1, 2])}
                descs.append(
                    f"{g['name']} tune stable_s={g['restart']['stable_s']} "
                    f"max_unavailable={g['health']['max_unavailable']}"
                )
            elif change == "scale":
                g["replicas"] = rng.choice([1, 2, 3, 4])
                descs.append(f"{g['name']} scale {g['replicas']}")
            elif change == "back":
                good = [
                    h
                    for h in self.def_hist[g["name"]]
                    if self.def_kind[self.marker(h)] in ("good", "leaky")
                    and self.marker(h) != self.marker(g)
                ]
                if not good:
                    continue
                h = good[-1]
                g["command"], g["env"] = list(h["command"]), dict(h["env"])
                if "limits" in h:
                    g["limits"] = dict(h["limits"])
                else:
                    g.pop("limits", None)
                descs.append(f"{g['name']} back to def {self.marker(g)}")
            else:
                have = {x["name"] for x in self.groups}
                if "rc" in have:
                    self.groups = [x for x in self.groups if x["name"] != "rc"]
                    descs.append("rc removed")
                elif len(self.groups) < 3:
                    self.groups.append(self.template("rc"))
                    descs.append(f"rc added (def {self.marker(self.groups[-1])})")
        if not descs:
            return "reload: nothing to change"
        via = rng.choice(["api", "api", "SIGHUP", "cli"])
        r, _ = self.issue_reload(via)
        return f"reload #{r} ({via}) " + "; ".join(descs)

    def op_double_reload(self) -> str:
        """A reload, then another one while its roll-outs run (it supersedes them)."""
        first = self.op_roll_reload()
        time.sleep(self.rng.uniform(0.1, 2.5))
        return f"{first} || then {self.op_roll_reload()}"

    def op_roll_restart(self) -> str:
        """``POST .../rolling-restart`` (or ``restart --rolling --wait`` in the background),
        more often of a group a roll-out runs on."""
        busy = sorted({ro["group"] for ro in self.open_rolls})
        g = self.rng.choice(busy if busy and self.rng.random() < 0.4 else self.names())
        if self.rng.random() < 0.35:
            n0 = self.log_count("api.command", command="rolling-restart", target=g)
            proc = self.client("restart", "--rolling", "--wait", g)
            self.wait_for(
                "restart --rolling --wait's request",
                lambda: (
                    self.log_count("api.command", command="rolling-restart", target=g) > n0
                    or proc.poll() is not None
                ),
                10,
            )
            q: int | None = None
            if self.log_count("api.command", command="rolling-restart", target=g) > n0:
                self.rolling_reqs += 1
                q = self.rolling_reqs
                self.open_roll("rolling_restart", g, q, time.time())
            self.waiting.append((proc, "rolling", q, g, time.time()))
            return f"restart --rolling --wait {g} (request {q})"
        r = self.api.post(f"/api/v1/groups/{g}/rolling-restart")
        if r.status_code == 202:
            q = int(r.json()["request"])
            if q != self.rolling_reqs + 1:
                self.violate(f"rolling restart request {q}, {self.rolling_reqs + 1} expected")
            self.rolling_reqs = q
            self.open_roll("rolling_restart", g, q, time.time())
            return f"rolling-restart {g} -> 202 request {q}"
        return f"rolling-restart {g} -> {r.status_code} {r.text[:120]}"

    def op_roll_kill(self) -> str:
        """SIGKILL or SIGSTOP a worker, more often one of a group a roll-out runs on."""
        ws = [w for w in self.workers() if w["pid"]]
        busy = {ro["group"] for ro in self.open_rolls}
        hot = [w for w in ws if w["group"] in busy]
        if not ws:
            return "kill: no pid"
        w = self.rng.choice(hot if hot and self.rng.random() < 0.7 else ws)
        sig = self.rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP])
        self.excuses.append((time.time(), sig.name, w["name"], None))  # (before it acts)
        with contextlib.suppress(ProcessLookupError):
            os.kill(w["pid"], sig)
        return f"{sig.name} {w['name']} pid {w['pid']} ({w['state']})"

    def op_roll_api(self) -> str:
        """An operator's stop, start, restart or drain of a worker or a group."""
        cmd = self.rng.choice(["stop", "start", "restart", "drain", "start", "restart"])
        if self.rng.random() < 0.3:
            target = self.rand_group()
            path = f"/api/v1/groups/{target}/{cmd}"
        else:
            target = self.rand_worker()
            path = f"/api/v1/workers/{target}/{cmd}"
        now = time.time()
        if cmd == "restart":
            self.op_restart[target] = now
        r = self.api.post(path)
        self.excuses.append((now, f"operator {cmd}", target, None))
        return f"POST {path} -> {r.status_code}"

    def op_roll_xid(self) -> str:
        i = self.rng.randrange(self.ngpu)
        xid = self.rng.choice([13, 31, 43, 13, 48, 79])
        if xid in DEVICE_XIDS:
            self.lost_ok.add(i)
        uuid = f"GPU-00000000-0000-0000-0000-{i:012d}"
        self.excuses.append((time.time(), f"XID {xid}", None, uuid))
        with open(self.sim / "events", "a") as f:
            f.write(f"{i} {xid}\n")
        return f"XID {xid} on gpu {i}"

    def op_roll_temp(self) -> str:
        i = self.rng.randrange(self.ngpu)
        uuid = f"GPU-00000000-0000-0000-0000-{i:012d}"
        self.excuses.append((time.time(), "hot GPU", None, uuid))
        return self.op_temp()

    # --- the journal's invariants

    def open_roll(self, kind: str, group: str, request: int, t0: float, **extra: Any) -> None:
        g = self.find(self.groups, group)
        replicas = g["replicas"] if g else 4
        self.open_rolls.append(
            {
                "kind": kind,
                "group": group,
                "request": request,
                "t0": t0,
                "bound": ROLL_BASE_S + ROLL_PER_WORKER_S * max(replicas, 4),
                **extra,
            }
        )

    def poll_journal(self) -> None:
        if self.http is None:
            return
        got = self.api.get("/api/v1/events", params={"since": self.jseq}).json()
        for e in got:
            if self.jseq and e["seq"] != self.jseq + 1:
                self.violate(f"journal events {self.jseq + 1}..{e['seq'] - 1} missed")
            self.jseq = e["seq"]
            e["t"] = datetime.fromisoformat(e["at"].replace("Z", "+00:00")).timestamp()
            self.journal.append(e)
            self.judge_journal(e)

    def judge_journal(self, e: dict[str, Any]) -> None:
        kind = e["type"]
        if kind == "reload.accepted":
            r = int(e["request"])
            file = self.req_file.get(r)
            if file is None:
                self.violate(f"reload.accepted for request {r}, which chaos never made: {e}")
                return
            self.accepted[r] = {**e, "file": file}
            before = {g["name"]: g for g in self.force}
            self.force = list(file)
            for name in e.get("changed") or ():
                g = self.find(file, name)
                marker = self.marker(g) if g else None
                self.open_roll(
                    "reload", name, r, e["t"], marker=marker, file=g, before=before.get(name)
                )
            for name in e.get("removed") or ():
                for ro in self.rolls_of(name):  # a rolling restart of it is cut short
                    ro["removed"] = True
        elif kind in ("rollout.done", "rollout.halted"):
            self.end_roll(e)
        elif kind == "reload.done":
            self.judge_reload_done(e)
        elif kind == "reload.rejected":
            self.log("  reload rejected:", json.dumps(e)[:300])

    def end_roll(self, e: dict[str, Any]) -> None:
        group, kind = str(e.get("group")), e.get("kind")
        if kind == "placement":
            self.violate(f"a placement roll-out with telemetry up all along: {e}")
            return
        if kind == "reload":
            mine = [ro for ro in self.rolls_of(group) if ro["kind"] == "reload"]
        else:
            mine = [
                ro
                for ro in self.rolls_of(group)
                if ro["kind"] == "rolling_restart" and ro["request"] == e.get("request")
            ]
        if not mine:
            self.violate(f"{e['type']} of no roll-out chaos knows of: {e}")
            return
        ro = mine[0]
        self.open_rolls.remove(ro)
        ro["end"] = e
        self.ended_rolls.append(ro)
        took = e["t"] - ro["t0"]
        self.judged[f"roll-outs ended ({kind})"] += 1
        if took > ro["bound"]:
            self.violate(f"roll-out of {group} ({kind}) took {took:.1f} s > {ro['bound']} s: {e}")
        if kind == "reload":
            self.last_roll[str(group)] = ro
            if e["type"] == "rollout.done":
                self.removed_with(ro)
            else:
                self.keep_before(ro)
        if e["type"] == "rollout.halted":
            self.judge_halt(ro, e)

    def keep_before(self, ro: dict[str, Any]) -> None:
        """A reload's roll-out of a group that halted (or was superseded) leaves the group's
        definition before that reload in force (replicas, thresholds and all)."""
        if ro.get("before") is not None:
            self.force = [ro["before"] if g["name"] == ro["group"] else g for g in self.force]

    def removed_with(self, ro: dict[str, Any]) -> None:
        """A done roll-out of a scale-down removed the workers past the new replicas."""
        g = ro.get("file")
        if not g:
            return
        for s in self.events():
            w = s.get("worker")
            if s.get("event") != "worker.spawned" or not isinstance(w, str):
                continue
            group, _, index = w.rpartition("-")
            if group == g["name"] and int(index) >= g["replicas"]:
                self.removed_pids[s["pid"]] = w

    def judge_halt(self, ro: dict[str, Any], e: dict[str, Any]) -> None:
        """A halt is true: superseded by a later reload that was made, refused, the new
        definition failed, or something the run did to the group's workers or GPUs."""
        reason = str(e.get("reason", ""))
        group = str(ro["group"])
        if e.get("superseded"):
            made = self.log_count("supervisor.reload_queued", supersedes=True) > 0 or any(
                j["type"] == "reload.accepted"
                and j["t"] >= ro["t0"]
                and group in (j.get("changed") or []) + (j.get("removed") or [])
                for j in self.journal
            )
            if not made:
                self.violate(f"roll-out of {group} 'superseded' with no later reload: {e}")
            self.judged["halts: superseded by a later reload"] += 1
            return
        if reason.startswith("refused"):
            self.judged["rolling restarts refused"] += 1
            return
        if ro["kind"] == "reload" and self.bad(ro.get("marker")):
            self.judged["halts: the new definition fails"] += 1
            return
        if "halted with its workers still on ports" in reason:
            # the roll-out it waited for halted: named in the event, and true if it did
            others = reason.split("the roll-out of ", 1)[1].split(" halted", 1)[0].split(", ")
            ended = [self.last_roll.get(o, {}).get("end", {}) for o in others]
            if all(x.get("type") == "rollout.halted" for x in ended):
                self.judged["halts: ports another group's halted roll-out left held"] += 1
                return
        # (the journal's times are to the millisecond)
        excuses = self.excuses_for(group, ro["t0"] - 1.0, e["t"] + 0.5)
        if not excuses:
            # the journal (read from the API) can be ahead of the event log (read from the
            # supervisor's stderr): the spawn that explains the halt may not be read yet
            self.events_reach(e["t"])
            excuses = self.excuses_for(group, ro["t0"] - 1.0, e["t"] + 0.5)
        if excuses:
            self.judged["halts: explained by what the run did"] += 1
            self.log(f"  halt of {group} ({ro['kind']}) at {e.get('worker')}: {reason}")
            self.log(f"    explained by {sorted(excuses)[:6]}")
            return
        self.violate(
            f"roll-out of {group} ({ro['kind']}, def {ro.get('marker')}: "
            f"{self.def_kind.get(ro.get('marker') or -1)}) halted with no cause: {e}"
        )

    def events_reach(self, t: float, timeout: float = 3.0) -> None:
        """Wait (up to ``timeout``) until the event log holds an event logged at ``t`` or after."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.events()[-1:]
            if last and datetime.fromisoformat(last[0]["timestamp"]).timestamp() >= t:
                return
            time.sleep(0.05)

    def excuses_for(self, group: str, t0: float, t1: float) -> set[str]:
        """What the run did to ``group``'s workers (or their GPUs) between ``t0`` and ``t1``
        that may halt a roll-out of a good definition (or was a failing one)."""
        mine = [w for w in self.ever_on if w.rpartition("-")[0] == group]
        mine += [w for w in self.argv_of if w.rpartition("-")[0] == group and w not in mine]
        gpus = {u for w in mine for u in self.ever_on.get(w, ())}
        out = set()
        for at, what, target, gpu in self.excuses:
            if not t0 <= at <= t1:
                continue
            if target is not None and (target == group or target.rpartition("-")[0] == group):
                out.add(f"{what} {target}")
            if gpu is not None and gpu in gpus:
                out.add(f"{what} on {gpu[-1]}")
        # what each worker's last process ran by then
        last: dict[str, str] = {}
        for e in self.events():
            w = e.get("worker")
            if e.get("event") != "worker.spawned" or not isinstance(w, str):
                continue
            if datetime.fromisoformat(e["timestamp"]).timestamp() > t1 + 0.05:
                break
            if w.rpartition("-")[0] == group:
                last[w] = " ".join(e.get("argv") or [])
        for w, argv in last.items():
            if any(bad in argv for bad in ("exit_with_code", "never_ready", "crash_after")):
                out.add(f"{w} runs a failing definition")
        return out

    def judge_reload_done(self, e: dict[str, Any]) -> None:
        r = int(e["request"])
        acc = self.accepted.get(r)
        if acc is None:
            self.violate(f"reload.done of request {r} without its reload.accepted: {e}")
            return
        halted, superseded = set(e.get("halted") or ()), set(e.get("superseded") or ())
        for ro in [ro for ro in self.open_rolls if ro["kind"] == "reload" and ro["request"] == r]:
            if ro["group"] in superseded:  # superseded before it began: no rollout.* event
                self.open_rolls.remove(ro)
                ro["end"] = {"type": "superseded before it began", "t": e["t"]}
                self.ended_rolls.append(ro)
                self.keep_before(ro)
                self.judged["roll-outs superseded before they began"] += 1
            elif not e.get("interrupted"):
                self.violate(f"reload.done of request {r} before {ro['group']}'s roll-out ended")
        for ro in self.ended_rolls:
            if ro["kind"] != "reload" or ro["request"] != r:
                continue
            end, group = ro["end"], ro["group"]
            if end["type"] == "rollout.done" and group in halted | superseded:
                self.violate(f"reload.done {e} lists {group}, whose roll-out was done")
            if end["type"] == "rollout.halted":
                if end.get("superseded") and group not in superseded:
                    self.violate(f"reload.done {e} does not list superseded {group}")
                if not end.get("superseded") and group not in halted:
                    self.violate(f"reload.done {e} does not list halted {group}")
        self.judged["reload.done judged against its roll-outs"] += 1
        for name in acc.get("removed") or ():
            self.removed_with({"file": {"name": name, "replicas": 0}})

    def judge_clients(self, final: bool = False) -> None:
        """Each ``--wait`` client's exit code agrees with the journal."""
        for item in list(self.waiting):
            proc, what, request, group, _t = item
            if proc.poll() is None:
                if not final:
                    continue
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.violate(f"{what} --wait (request {request}) still waiting")
                    proc.kill()
                    continue
            self.waiting.remove(item)
            out, err = proc.communicate()
            code = proc.returncode
            self.poll_journal()
            want = self.expected_exit(what, request, group)
            self.judged[f"{what} --wait answers judged"] += 1
            if want == 1 and request is None and code == 2 and "unknown group" in err:
                continue  # a group no reload has added (yet): 2, as documented
            if want is None:
                self.violate(
                    f"{what} --wait (request {request}) exited {code} with no verdict in the "
                    f"journal: {out.strip()[-300:]} {err.strip()[-300:]}"
                )
            elif code != want:
                self.violate(
                    f"{what} --wait (request {request} {group}) exited {code}, the journal "
                    f"says {want}: {out.strip()[-300:]} {err.strip()[-300:]}"
                )

    def expected_exit(self, what: str, request: int | None, group: str) -> int | None:
        if what == "rolling":
            if request is None:
                return 1  # refused (409)
            for j in self.journal:
                if (
                    j["type"] in ("rollout.done", "rollout.halted")
                    and j.get("kind") == "rolling_restart"
                    and j.get("request") == request
                ):
                    return 0 if j["type"] == "rollout.done" else 1
            return None
        assert request is not None
        for j in self.journal:
            if not j["type"].startswith("reload.") or int(j.get("request", 0)) < request:
                continue
            if j["type"] == "reload.rejected":
                return 2 if j["reason"] in ("bad config", "command") else 1
            if j["type"] == "reload.done":
                return 1 if j.get("interrupted") or j.get("halted") or j.get("superseded") else 0
        return None

    def judge_takedown(self, e: dict[str, Any], worker: str, at: float) -> None:
        """A roll-out takes a ready worker down only while no other worker of its group is on
        its way down or back up (README), so never past ``max_unavailable``."""
        if e["old"] != "ready" or e["new"] not in ("stopping", "draining"):
            return
        group = str(e.get("group"))
        reason = e.get("reason")
        operator = max(self.op_restart.get(worker, 0.0), self.op_restart.get(group, 0.0))
        if reason != "reload" and not (reason == "restart" and at - operator > 2.0):
            return
        # a reload's removal of a group, or of the workers a scale-down drops: all at once
        g = self.find(self.in_force(), group)
        if group in self.removing or g is None or int(worker.rpartition("-")[2]) >= g["replicas"]:
            return
        busy = {
            w: s
            for w, s in self.state.items()
            if w != worker
            and w.rpartition("-")[0] == group
            and s in BUSY
            and not self.gpu_wait.get(w)
        }
        self.judged["roll-out take-downs judged"] += 1
        if len(busy) >= self.max_unavailable(group):
            self.violate(
                f"roll-out took {worker} down ({reason}) while {busy} of {group} were on their "
                f"way down or up (max_unavailable {self.max_unavailable(group)}): {e}"
            )
        elif busy:
            self.judged["roll-out take-downs beside a busy worker (within max_unavailable)"] += 1
            self.log(f"  note: roll-out took {worker} down ({reason}) while {busy}")

    def markers(self) -> dict[str, tuple[int | None, tuple[str, ...], int | None, str]]:
        """Each worker with a live process -> what it runs: its ``CHAOS_DEF`` marker
        (/proc/PID/environ), its arguments after the interpreter (/proc/PID/cmdline), its soft
        open-files limit (/proc/PID/limits); and its state."""
        out = {}
        for w in self.workers():
            pid = w["pid"]
            if pid is None or w["state"] not in ("starting", "ready", "draining"):
                continue
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
                limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
            except OSError:
                continue
            got = [int(x.split(b"=", 1)[1]) for x in env if x.startswith(b"CHAOS_DEF=")]
            nofile = [int(x.split()[3]) for x in limits if x.startswith("Max open files")]
            out[w["name"]] = (
                got[0] if got else None,
                tuple(argv[1:]),
                nofile[0] if nofile else None,
                w["state"],
            )
        return out

    def wrong_markers(self, final: dict[str, int] | None = None) -> str | None:
        """Every worker of a group whose last reload roll-out is done runs that roll-out's
        definition: its marker, arguments and limits (``final``: every worker runs that
        one), and none an older one."""
        bad = []
        for name, (got, argv, nofile, state) in self.markers().items():
            group = name.rpartition("-")[0]
            if final is not None:
                g = self.find(self.groups, group)
            else:
                ro = self.last_roll.get(group)
                if ro is None or ro["end"]["type"] != "rollout.done" or self.rolls_of(group):
                    continue
                g = ro.get("file")
            if g is None:
                continue
            want = (self.marker(g), tuple(g["command"][1:]), g.get("limits", {}).get("nofile"))
            if (got, argv, nofile if want[2] is not None else None) != want:
                bad.append(
                    (name, state, (got, argv[-2:], nofile), (want[0], want[1][-2:], want[2]))
                )
        return f"(worker, state, runs, last definition) {bad}" if bad else None

    def failing_spread(self, ws: list[dict[str, Any]]) -> str | None:
        """A roll-out halts at the first worker a failing definition fails on: no group has
        two workers whose last process ran a failing program, for longer than a failed start
        takes (a worker waiting for a GPU that a roll-out passed over may start on it before
        the halt gives it its old definition back)."""
        now = time.monotonic()
        failing: dict[str, list[str]] = {}
        for w in ws:
            argv = " ".join(self.argv_of.get(w["name"], []))
            if w["state"] != "stopped" and any(
                bad in argv for bad in ("exit_with_code", "never_ready", "crash_after")
            ):
                failing.setdefault(w["group"], []).append(w["name"])
        for group, names in failing.items():
            if len(names) < 2:
                self.spread_since.pop(group, None)
                continue
            since = self.spread_since.setdefault(group, now)
            if now - since > 2 * ROLL_START_TIMEOUT_S + 2:
                states = {w["name"]: w["state"] for w in ws if w["name"] in names}
                return f"{group}: {states} all run failing programs for {now - since:.0f} s"
        for group in set(self.spread_since) - set(failing):
            del self.spread_since[group]
        return None

    def bad_spread(self) -> str | None:
        """A roll-out of a failing definition that halted left it on the worker it halted at
        (or none): the others keep what they ran."""
        out = []
        runs = self.markers()
        for group, ro in self.last_roll.items():
            end = ro["end"]
            if end["type"] != "rollout.halted" or end.get("superseded"):
                continue
            if not self.bad(ro.get("marker")) or self.rolls_of(group):
                continue
            on = sorted(w for w, run in runs.items() if run[0] == ro["marker"])
            if set(on) - {end.get("worker")}:
                out.append((group, ro["marker"], end.get("worker"), on))
        self.judged["halted failing definitions: where they run checked"] += len(out) == 0
        return f"(group, failing def, halted at, runs it) {out}" if out else None

    def quiet_rollout(self) -> None:
        """Every roll-out ends; workers run the last definition; a final reload of a good
        definition of every group completes (``reload --wait`` exits 0) and every worker is
        ready on it."""
        self.log("quiet period")
        for i in range(self.ngpu):
            self.world_gpu(i, lost=0, temperature_c=40, clocks_event_reasons=0)
        left = max((ro["t0"] + ro["bound"] for ro in self.open_rolls), default=0.0)

        def still_open() -> str | None:
            self.poll_journal()
            self.judge_log()
            return f"roll-outs not ended: {self.open_rolls}" if self.open_rolls else None

        self.hold("every roll-out ends", still_open, max(5.0, left - time.time()))
        self.judge_clients(final=True)
        self.hold("a failing definition only where its roll-out halted", self.bad_spread, 10)
        self.lift_all_and_start()
        # the workers a roll-out passed over (stopped, waiting for a GPU) start on its plan
        # (not one of a failing definition: a roll-out over workers all stopped, an operator's
        # drain say, is done without proving its definition, which fails when they start)
        done = {
            g
            for g, ro in self.last_roll.items()
            if ro["end"]["type"] == "rollout.done" and not self.bad(ro.get("marker"))
        }

        def done_not_ready() -> str | None:
            ws = [w for w in self.workers() if w["group"] in done and w["state"] != "ready"]
            return f"not ready: {[(w['name'], w['state']) for w in ws]}" if ws else None

        self.hold("the workers of groups whose last roll-out was done ready", done_not_ready, 20)
        self.hold("workers on their group's last definition", self.wrong_markers, 10)
        self.judged["groups whose last roll-out was done, definitions checked"] += len(done)
        # the final reload: a good definition for every group
        final = {}
        for g in self.groups:
            final[g["name"]] = self.new_def(g, "good")
        request, proc = self.issue_reload("cli")
        self.log(f"final reload #{request}: {final}")
        assert proc is not None
        bound = ROLL_BASE_S + ROLL_PER_WORKER_S * 4
        try:
            proc.wait(bound)
        except subprocess.TimeoutExpired:
            self.violate(f"the final reload's roll-outs not done in {bound:g} s")
        self.judge_clients(final=True)
        self.poll_journal()
        last = [j for j in self.journal if j["type"] == "reload.done" and j["request"] >= request]
        if not last or last[0].get("halted") or last[0].get("superseded"):
            self.violate(f"the final reload of good definitions did not complete: {last[:1]}")
        deadline = time.monotonic() + 30
        notready: list[tuple[str, str]] = []
        while time.monotonic() < deadline:
            notready = [(w["name"], w["state"]) for w in self.workers() if w["state"] != "ready"]
            if not notready:
                break
            time.sleep(0.2)
        if notready:
            self.violate(f"not all ready after the final reload: {notready}")
        self.hold("every worker on the final definition", lambda: self.wrong_markers(final), 10)
        self.judged["workers on the final definition"] += len(self.markers())
        self.check("all started", 20)

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
        self.lift_all_and_start()
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
        if self.mix == "rollout":
            self.quiet_rollout()
        else:
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
    parser.add_argument(
        "--mix", choices=("default", "healing", "nvml", "rollout"), default="default"
    )
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
