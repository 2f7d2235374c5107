"""Supervisor CPU while idle with 32 workers: with no GPU telemetry, and at 2 Hz on 2 sim GPUs.

    .venv/bin/python bench/idle_cpu.py [--seconds 60] [--python PATH]

Starts ``gpu-supervisor run`` with 32 sleeping workers, lets it settle for 3 s, then reads the
supervisor process's own user+system CPU over the window (workers excluded). Targets: backend
none <= 0.1 s per minute; sim at 2 Hz <= 0.3 s per minute.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def config(base: Path, backend: str) -> Path:
    path = base / f"{backend}.toml"
    worker = [sys.executable, "-S", str(ROOT / "bench" / "worker.py"), str(base / "starts.txt")]
    argv = ", ".join(f'"{a}"' for a in worker)
    path.write_text(
        f'[supervisor]\nstate_dir = "{base / "state"}"\nsample_interval_s = 0.5\n'
        f'[gpu]\nbackend = "{backend}"\nsim_dir = "{base / "sim"}"\nsim_devices = 2\n'
        f'[[workers]]\nname = "w"\ncommand = [{argv}]\nreplicas = 32\nready = "none"\n'
        "max_workers_per_gpu = 16\n"
    )
    return path


def measure(cfg: Path, seconds: float, python: str) -> tuple[float, float]:
    proc = subprocess.Popen(
        [python, "-m", "supervisor", "run", "-c", str(cfg), "--log-format", "json"],
        cwd=cfg.parent,  # not the checkout: with --python, the installed package is the one run
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(3)  # settle: all workers started
        p = psutil.Process(proc.pid)
        before = p.cpu_times()
        time.sleep(seconds)
        after = p.cpu_times()
        rss = p.memory_info().rss / 2**20
    finally:
        proc.terminate()
        proc.wait(30)
    cpu = (after.user + after.system) - (before.user + before.system)
    return cpu * 60 / seconds, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter with gpu-supervisor installed (e.g. bench/.venvs/gpu-supervisor/bin/"
        "python, which bench/peers.py builds: a non-editable install with runtime deps only)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-idle-") as tmp:
        base = Path(tmp)
        rows = []
        for backend, target in (("none", 0.1), ("sim", 0.3)):
            per_min, rss = measure(config(base, backend), args.seconds, args.python)
            rows.append((backend, per_min, rss, target))
    print(f"32 idle workers, {args.seconds:g} s window, supervisor process only:")
    print("| backend | CPU s/min | RSS MiB | target | verdict |")
    print("|---|---|---|---|---|")
    for backend, per_min, rss, target in rows:
        verdict = "PASS" if per_min <= target else "FAIL"
        print(f"| {backend} | {per_min:.3f} | {rss:.1f} | <= {target} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
