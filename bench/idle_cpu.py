"""Supervisor CPU while idle with 32 workers: with no GPU telemetry, and at 2 Hz on 2 sim GPUs.

    .venv/bin/python bench/idle_cpu.py [--seconds 60] [--python PATH]

Starts ``gpu-supervisor run`` with 32 sleeping workers, lets it settle for 3 s, then reads the
supervisor process's own user+system CPU over the window (workers excluded). Targets: backend
none <= 0.1 s per minute; sim at 2 Hz <= 0.3 s per minute; every worker reporting its in-use
GPU memory (``in_use_reporter = "torch"``: workers holding a changing amount in
``tests/fake_torch``, so the reporter thread in each sends every 5 s) adds <= 0.1 s per minute
to the sim figure. With ``health.liveness_url`` on every worker (each answers its health URL;
asked every 10 s, the default: 3.2 probes a second), what the probes add to the figure without
GPU telemetry is reported (no target: the cost of the feature).

Two readings of the same window: ``utime + stime`` of ``/proc/<pid>/stat`` (psutil; the kernel
charges whole clock ticks to whichever task is running when a tick lands, so a process that
wakes briefly many times a second is counted by sampling), and, where a cgroup v2 hierarchy is
writable, ``usage_usec`` of a cgroup the supervisor alone is moved into after the settle (its
workers stay where they are): nanosecond accounting of every thread, those that exit too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
CGROUP_V2 = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


class OwnCgroup:
    """A cgroup v2 of its own for one process (None readings where none can be made)."""

    def __init__(self, pid: int) -> None:
        self.path: Path | None = None
        for root in CGROUP_V2:
            if not (root / "cgroup.procs").exists() or not (root / "cpu.stat").exists():
                continue
            path = root / f"gpu-supervisor-idle-{os.getpid()}-{pid}"
            try:
                path.mkdir()
                (path / "cgroup.procs").write_text(str(pid))
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            self.path = path
            return

    def usage_s(self) -> float | None:
        if self.path is None:
            return None
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        return None

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # empty once the supervisor has exited


#: A worker whose (fake) torch allocation changes every second, so its reporter sends every
#: report (every 5 s; a steady worker's sends only every 15 s): the most reports there can be.
TORCH_WORKER = (
    "import time, torch; torch.cuda.init()\n"
    "while True:\n"
    "    torch.cuda.set_allocated(0, int((300 + time.time() % 60) * 2**20)); time.sleep(1)"
)


def config(base: Path, backend: str, reports: bool = False, liveness: bool = False) -> Path:
    path = base / f"{backend}{'-reports' if reports else ''}{'-liveness' if liveness else ''}.toml"
    worker = [sys.executable, "-S", str(ROOT / "bench" / "worker.py"), str(base / "starts.txt")]
    extra = ""
    if liveness:
        worker.append("--http")
        extra = 'port_base = 18500\nhealth = { liveness_url = "http://127.0.0.1:{port}/health" }\n'
    if reports:
        program = base / "torch_worker.py"
        program.write_text(TORCH_WORKER + "\n")
        worker = [sys.executable, str(program)]
        fake_torch = ROOT / "tests" / "fake_torch"
        extra = (
            f'env = {{ PYTHONPATH = "{fake_torch}" }}\nhealth = {{ in_use_reporter = "torch" }}\n'
        )
    argv = ", ".join(f"'{a}'" for a in worker)
    path.write_text(
        f'[supervisor]\nstate_dir = "{base / "state"}"\nsample_interval_s = 0.5\n'
        f'[gpu]\nbackend = "{backend}"\nsim_dir = "{base / "sim"}"\nsim_devices = 2\n'
        f'[[workers]]\nname = "w"\ncommand = [{argv}]\nreplicas = 32\nready = "none"\n'
        f"max_workers_per_gpu = 16\n{extra}"
    )
    return path


def supervisor_env(python: str) -> dict[str, str]:
    """The environment for ``python -m supervisor``: with another interpreter (``--python``),
    without ``PYTHONPATH``, which would put a checkout before the package installed there."""
    env = dict(os.environ)
    if python != sys.executable:
        env.pop("PYTHONPATH", None)
    return env


def measure(cfg: Path, seconds: float, python: str) -> tuple[float, float | None, float]:
    proc = subprocess.Popen(
        [python, "-m", "supervisor", "run", "-c", str(cfg), "--log-format", "json"],
        cwd=cfg.parent,  # not the checkout: with --python, the installed package is the one run
        env=supervisor_env(python),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    group: OwnCgroup | None = None
    try:
        time.sleep(3)  # settle: all workers started
        if proc.poll() is not None:
            raise SystemExit(f"gpu-supervisor exited with {proc.returncode} on {cfg}")
        p = psutil.Process(proc.pid)
        group = OwnCgroup(proc.pid)
        before, precise_before = p.cpu_times(), group.usage_s()
        time.sleep(seconds)
        after, precise_after = p.cpu_times(), group.usage_s()
        rss = p.memory_info().rss / 2**20
        if proc.poll() is not None:
            raise SystemExit(f"gpu-supervisor exited with {proc.returncode} on {cfg}")
    finally:
        proc.terminate()
        proc.wait(30)
        if group is not None:
            group.remove()
    cpu = (after.user + after.system) - (before.user + before.system)
    precise = (
        None
        if precise_before is None or precise_after is None
        else (precise_after - precise_before) * 60 / seconds
    )
    return cpu * 60 / seconds, precise, rss


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
        modes: tuple[tuple[str, bool, bool, float | None], ...] = (
            ("none", False, False, 0.1),
            ("sim", False, False, 0.3),
            ("sim", True, False, 0.1),
            ("none", False, True, None),
        )
        for backend, reports, liveness, target in modes:
            cfg = config(base, backend, reports, liveness)
            per_min, precise, rss = measure(cfg, args.seconds, args.python)
            rows.append((backend, reports, liveness, per_min, precise, rss, target))
    print(f"32 idle workers, {args.seconds:g} s window, supervisor process only:")
    print("| backend | CPU s/min (ticks) | CPU s/min (cgroup, ns) | RSS MiB | target | verdict |")
    print("|---|---|---|---|---|---|")
    base_of: dict[str, float] = {}
    for backend, reports, liveness, per_min, precise, rss, target in rows:
        judged = per_min if precise is None else precise
        label, goal = backend, f"<= {target}"
        if reports or liveness:  # judged on what they add to the same backend without them
            judged -= base_of[backend]
            what = "in-use reports (6.4/s)" if reports else "liveness probes (3.2/s)"
            label = f"{backend} + {what}, added: {judged:+.3f}"
            goal = "-" if target is None else f"+ <= {target}"
        else:
            base_of[backend] = judged
        verdict = "-" if target is None else "PASS" if judged <= target else "FAIL"
        shown = "n/a" if precise is None else f"{precise:.3f}"
        print(f"| {label} | {per_min:.3f} | {shown} | {rss:.1f} | {goal} | {verdict} |")
    print("verdict on the cgroup reading where there is one (precise), else on the ticks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
