#!/usr/bin/env python3
"""How fast can 32 workers be started at all on this machine, with this config stack?

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/start_bound.py            # 10 interleaved rounds (~1 minute)
    .venv/bin/python bench/start_bound.py --rounds 4

Three ways to start the same 32 SIGTERM-ignoring ``bench/worker.py`` processes, interleaved
round-robin (the order rotates every round), each timed from its first step to the last
worker's start line:

``floor``
    a loop of bare ``Popen`` calls from this (already running) interpreter, as in
    ``bench/peers.py``.
``bound``
    a fresh interpreter of the ``gpu-supervisor`` bench venv that does only what must come
    before the first spawn of any supervisor built on this project's config stack: import
    ``supervisor.config`` (pydantic and pydantic-settings), validate the config file with
    ``load_settings``, build the plan, then start the workers with ``supervisor.processes.spawn``
    (``setpriv --pdeathsig``) in a loop, and nothing else: no event loop, logging, records or
    API. It is a lower bound for ``gpu-supervisor run``, not a supervisor.
``gpu-supervisor``
    ``python -m supervisor run -c FILE`` with the config ``bench/peers.py`` writes.

The figures separate the cost of the mandated config stack and of booting 32 Python workers on
these cores (``bound``) from the supervisor's own overhead (``gpu-supervisor`` - ``bound``).
Harness dependencies: stdlib + psutil (and ``bench/peers.py`` for the shared helpers).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    # The ``bound`` variant, in the gpu-supervisor venv: keep this path free of harness imports.
    import os
    import signal

    from supervisor.config import load_settings
    from supervisor.plan import build_plan
    from supervisor.processes import spawn

    settings = load_settings(sys.argv[2])
    plan = build_plan(settings, {}, os.path.join(sys.argv[3], "notify.sock"))
    children = [spawn(spec) for group in plan.groups for spec in group.workers]
    while True:  # the harness kills the whole session
        signal.pause()

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peers

BOUND = "bound"
VARIANTS = (peers.FLOOR, BOUND, peers.OURS)


def _session_start_s(
    argv: list[str], workdir: Path, starts: peers.StartFile, tracker: peers.Tracker
) -> tuple[float, float]:
    """Launch ``argv`` in its own session; (launch → last start line, 1st → last line) in s."""
    env = peers.child_env()
    env["BENCH_RUN_ID"] = tracker.run_id
    with (workdir / "out.log").open("wb") as log:
        t0 = time.time_ns()
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tracker.add_popen(proc)
    try:
        peers.wait_until(
            peers.pids_at_least(starts, peers.WORKERS),
            peers.START_DEADLINE_S,
            f"{peers.WORKERS} start lines",
            alive=proc,
        )
    finally:
        for pid in starts.pids():
            tracker.add_pid(pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its workers die with it (PDEATHSIG)
            proc.wait(timeout=5)
        elif not starts.lines:
            tail = (workdir / "out.log").read_text(errors="replace").strip().splitlines()[-3:]
            log_tail = " | ".join(tail)
            raise peers.BenchError(f"{argv[1]} exited {proc.returncode}: {log_tail}")
        tracker.kill_all()
    stamps = [ns for _, ns in starts.lines[: peers.WORKERS]]
    return (max(stamps) - t0) / 1e9, (max(stamps) - min(stamps)) / 1e9


def measure(name: str, ours: peers.GpuSupervisor, workdir: Path, tracker: peers.Tracker) -> Any:
    if name == peers.FLOOR:
        return peers.measure_floor_many(workdir, tracker)
    workdir.mkdir(parents=True)
    starts = peers.StartFile(workdir / "starts.txt")
    config = ours.write_config(workdir, starts.path, peers.WORKERS, ignore_term=True)
    if name == BOUND:
        argv = [str(ours.bin / "python"), str(Path(__file__).resolve()), "--child"]
        argv += [str(config), str(workdir)]
    else:
        argv = ours.launch_argv(config)
    start_s, spread_s = _session_start_s(argv, workdir, starts, tracker)
    return {"start_s": start_s, "start_spread_s": spread_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--out", type=Path, help="raw results JSON (default bench/results/)")
    args = parser.parse_args(argv)
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    tracker = peers.Tracker(run_id=uuid.uuid4().hex)
    ours = peers.GpuSupervisor(tracker, log)
    ours.prepare()
    raw: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="start-bound-") as tmp:
            for rnd in range(args.rounds):
                order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
                for name in order:
                    raw[name].append(measure(name, ours, Path(tmp) / f"{rnd}-{name}", tracker))
                log(
                    f"round {rnd + 1}/{args.rounds}: "
                    + ", ".join(f"{v} {raw[v][-1]['start_s']:.3f} s" for v in VARIANTS)
                )
    finally:
        tracker.kill_all()
    med = {v: statistics.median(m["start_s"] for m in raw[v]) for v in VARIANTS}
    spread = {v: statistics.median(m["start_spread_s"] for m in raw[v]) for v in VARIANTS}
    print(f"start of {peers.WORKERS} workers, medians of {args.rounds} interleaved rounds")
    print("| variant | launch → last start line | 1st → last start line |")
    print("|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {med[v]:.3f} s | {spread[v]:.3f} s |")
    print(
        f"config stack + spawn (bound - floor): {med[BOUND] - med[peers.FLOOR]:+.3f} s; "
        f"supervisor overhead (gpu-supervisor - bound): {med[peers.OURS] - med[BOUND]:+.3f} s"
    )
    out = args.out or peers.RESULTS_DIR / time.strftime(
        "start-bound-%Y%m%dT%H%M%SZ.json", time.gmtime()
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "version": ours.version,
        "rounds": args.rounds,
        "duration_s": time.monotonic() - started,
        "median_start_s": med,
        "median_start_spread_s": spread,
        "raw": raw,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
