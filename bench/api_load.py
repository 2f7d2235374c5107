"""HTTP API under load: 64 workers on 8 simulated GPUs.

    .venv/bin/python bench/api_load.py [--seconds 10] [--connections 8] [--kills 15]

Starts ``gpu-supervisor run`` (API on a free loopback port, 64 ``bench/worker.py`` workers that
claim sim GPU memory, ``ready = "none"``, ``restart.stable_s = 0``), then:

1. crash -> replacement, idle: SIGKILL a worker's pid, time until the supervisor logs the
   replacement's ``worker.spawned`` (its JSON log's timestamp minus the kill time), ``--kills``
   times, one at a time;
2. ``GET /metrics``, ``GET /api/v1/workers`` and ``GET /api/v1/route?group=w``, each alone
   for ``--seconds`` with ``--connections`` keep-alive connections from a load generator in a
   separate process (raw asyncio HTTP/1.1, no client library on the hot path): requests per
   second, p50, p99, and the supervisor's CPU time per request (user + system, after the
   warm-up);
3. crash -> replacement again while the load generator hits both endpoints.

Targets: /metrics >= 1000 req/s with p99 <= 20 ms; crash -> replacement under load <= 2x idle.
Raw results go to ``bench/results/api-load-<UTC time>.json``.

``--load-only URL PATH[,PATH] SECONDS CONNECTIONS`` runs just the load generator (what step 2
starts) and prints its JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
from benchkit import Log, ts

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 64
GPUS = 8
WARMUP_S = 1.0
ROUTE = "/api/v1/route?group=w"


# --- load generator ---------------------------------------------------------------------------


class _Stop:
    """Set when the controller closes our stdin: stop early."""

    flag = False


async def _connection(
    host: str, port: int, path: str, until: float, warm_until: float, out: list[float]
) -> int:
    """One keep-alive connection sending ``GET path`` back to back; returns the error count."""
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    errors = 0
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= until or _Stop.flag:
                return errors
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            status = int(head.split(b" ", 2)[1])
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            t1 = time.perf_counter()
            if status != 200:
                errors += 1
            if t0 >= warm_until:
                out.append(t1 - t0)
    finally:
        writer.close()


async def _load(url: str, paths: list[str], seconds: float, connections: int) -> dict[str, Any]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    start = time.perf_counter()
    warm_until = start + WARMUP_S
    until = warm_until + seconds
    latencies: dict[str, list[float]] = {p: [] for p in paths}
    jobs = [
        _connection(
            host, port, paths[i % len(paths)], until, warm_until, latencies[paths[i % len(paths)]]
        )
        for i in range(connections)
    ]
    errors = await asyncio.gather(*jobs)
    seconds = min(seconds, max(time.perf_counter() - warm_until, 1e-9))
    result: dict[str, Any] = {"connections": connections, "seconds": seconds, "errors": sum(errors)}
    for path, lat in latencies.items():
        lat.sort()
        result[path] = {
            "requests": len(lat),
            "rps": round(len(lat) / seconds, 1),
            "p50_ms": round(lat[len(lat) // 2] * 1000, 3) if lat else None,
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 3)
            if lat
            else None,
        }
    return result


def load_only(url: str, paths: str, seconds: float, connections: int) -> None:
    def watch_stdin() -> None:
        sys.stdin.read()
        _Stop.flag = True

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(json.dumps(asyncio.run(_load(url, paths.split(","), seconds, connections))))


def start_load(
    url: str, paths: list[str], seconds: float, connections: int
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--load-only",
            url,
            ",".join(paths),
            str(seconds),
            str(connections),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def finish_load(proc: subprocess.Popen[str], timeout: float, stop: bool = False) -> dict[str, Any]:
    """Wait for the load generator and return its result (``stop``: end it now)."""
    if not stop:
        proc.wait(timeout)  # its result is one short line: the pipe cannot fill up
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode})")
    result: dict[str, Any] = json.loads(out)
    return result


# --- the supervisor ---------------------------------------------------------------------------


def write_config(base: Path) -> Path:
    worker = [
        sys.executable,
        "-S",
        str(ROOT / "bench" / "worker.py"),
        str(base / "starts.txt"),
        "--sim-mib",
        "1000",
    ]
    argv = ", ".join(json.dumps(a) for a in worker)
    path = base / "api-load.toml"
    path.write_text(
        f'[supervisor]\nstate_dir = "{base / "state"}"\nsample_interval_s = 0.5\n'
        f'[gpu]\nbackend = "sim"\nsim_dir = "{base / "sim"}"\nsim_devices = {GPUS}\n'
        "release_timeout_s = 2\n"
        '[api]\nlisten = "127.0.0.1:0"\n'
        f'[[workers]]\nname = "w"\ncommand = [{argv}]\nreplicas = {WORKERS}\nready = "none"\n'
        f"max_workers_per_gpu = {WORKERS // GPUS}\nstop_timeout_s = 2\n"
        "[workers.restart]\nstable_s = 0\ndelay_s = 0\n"
    )
    return path


def crash_latencies(log: Log, pids: dict[str, int], kills: int, rng: random.Random) -> list[float]:
    """SIGKILL random workers one at a time; seconds from the kill to the replacement's spawn."""
    out = []
    for _ in range(kills):
        name = rng.choice(sorted(pids))
        mark = log.mark()
        killed_at = time.time()
        os.kill(pids[name], signal.SIGKILL)
        spawned = log.wait(10, after=mark, event="worker.spawned", worker=name)[0]
        pids[name] = spawned["pid"]
        out.append(ts(spawned) - killed_at)
        time.sleep(rng.uniform(0.05, 0.15))  # gap between kills (not a wait for a condition)
    return out


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--kills", type=int, default=15)
    parser.add_argument("--load-only", nargs=4, metavar=("URL", "PATHS", "SECONDS", "CONNS"))
    args = parser.parse_args()
    if args.load_only:
        url, paths, seconds, conns = args.load_only
        load_only(url, paths, float(seconds), int(conns))
        return 0
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="gpu-api-load-") as tmp:
        base = Path(tmp)
        cfg = write_config(base)
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "-c", str(cfg), "--log-format", "json"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stderr is not None
        log = Log(proc.stderr)
        try:
            url = log.wait(30, event="api.listening")[0]["url"]
            for i in range(WORKERS):
                log.wait(30, event="worker.spawned", worker=f"w-{i}")
            pids = {e["worker"]: e["pid"] for e in log.events if e.get("event") == "worker.spawned"}
            time.sleep(2.0)  # settle: a few samples with every worker's memory
            idle = crash_latencies(log, pids, args.kills, rng)
            loads = {}
            me = psutil.Process(proc.pid)
            for path in ("/metrics", "/api/v1/workers", ROUTE):
                p = start_load(url, [path], args.seconds, args.connections)
                time.sleep(WARMUP_S)  # the generator counts requests after its warm-up
                cpu = sum(me.cpu_times()[:2])
                done = finish_load(p, args.seconds + 30)
                cpu = sum(me.cpu_times()[:2]) - cpu  # the supervisor's, over the counted part
                per = cpu / max(1, done[path]["requests"]) * 1000
                loads[path] = {**done[path], "errors": done["errors"], "cpu_ms_per_req": per}
            longest = args.kills * 12.0
            p = start_load(url, ["/metrics", "/api/v1/workers"], longest, args.connections)
            time.sleep(WARMUP_S + 0.5)
            loaded = crash_latencies(log, pids, args.kills, rng)
            mixed = finish_load(p, 30, stop=True)  # the load lasted for every kill
            errors = log.count(event="api.error") + log.count(event="api.server")
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
    result = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "workers": WORKERS,
        "gpus": GPUS,
        "connections": args.connections,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "load": loads,
        "mixed_load_during_kills": mixed,
        "crash_idle_s": idle,
        "crash_loaded_s": loaded,
        "api_errors_logged": errors,
        "supervisor_exit": code,
    }
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"api-load-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(result, indent=2))

    m, w, r = loads["/metrics"], loads["/api/v1/workers"], loads[ROUTE]
    idle_ms, loaded_ms = ms(idle), ms(loaded)
    print(
        f"{WORKERS} workers on {GPUS} sim GPUs, {args.connections} connections, {args.seconds:g} s"
    )
    print("| measure | result | target | verdict |")
    print("|---|---|---|---|")
    print(
        f"| /metrics | {m['rps']:.0f} req/s, p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms "
        f"| >= 1000 req/s, p99 <= 20 ms | {'PASS' if m['rps'] >= 1000 and m['p99_ms'] <= 20 else 'FAIL'} |"
    )
    print(
        f"| /api/v1/workers | {w['rps']:.0f} req/s, p50 {w['p50_ms']:.2f} ms, "
        f"p99 {w['p99_ms']:.2f} ms; supervisor CPU {w['cpu_ms_per_req']:.2f} ms/request | | |"
    )
    print(
        f"| {ROUTE} | {r['rps']:.0f} req/s, p50 {r['p50_ms']:.2f} ms, "
        f"p99 {r['p99_ms']:.2f} ms; supervisor CPU {r['cpu_ms_per_req']:.2f} ms/request | | |"
    )
    ratio = loaded_ms / idle_ms if idle_ms else float("inf")
    print(
        f"| crash -> replacement spawned, median | idle {idle_ms} ms, under load {loaded_ms} ms "
        f"({ratio:.2f}x) | <= 2x idle | {'PASS' if ratio <= 2 else 'FAIL'} |"
    )
    mm, mw = mixed["/metrics"], mixed["/api/v1/workers"]
    print(
        f"(load during the kills: /metrics {mm['rps']:.0f} req/s p99 {mm['p99_ms']:.2f} ms, "
        f"/api/v1/workers {mw['rps']:.0f} req/s p99 {mw['p99_ms']:.2f} ms; "
        f"non-200 answers {mixed['errors'] + m['errors'] + w['errors'] + r['errors']}, "
        f"API errors logged {errors}, supervisor exit {code})"
    )
    print(f"raw: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
