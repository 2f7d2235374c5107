"""Supervisor CPU per notify datagram (heartbeats, in-use reports) from a worker.

    .venv/bin/python bench/notify_cost.py [--rates 30,100,1000] [--seconds 10] [--rounds 3]

One ``gpu-supervisor run`` with one worker (``ready = "none"``, no GPU telemetry, API off) that
sends ``X_GPU_MEMORY_IN_USE_MB=<n>`` datagrams to its notify socket at a steady rate for a window,
then nothing for a window of the same length. The supervisor's own CPU (``/proc/<pid>/stat``
user + system; the worker is another process) over the sending window, less the quiet window,
divided by the datagrams sent, is the cost of one datagram: the wake-up, reading it with its
sender's credentials, finding the worker and the healer's bookkeeping. At low rates every
datagram wakes the supervisor on its own; at high rates several are read per wake-up. Each
rate runs ``--rounds`` times; the median is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

#: The sender: waits for the go file, sends RATE datagrams a second for SECONDS, says "done".
SENDER = """
import os, socket, sys, time
rate, seconds, go = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
address = os.environ["GPU_SUPERVISOR_IN_USE_SOCKET"]
print("waiting", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
count = int(rate * seconds)
start = time.monotonic()
for i in range(count):
    sock.sendto(f"X_GPU_MEMORY_IN_USE_MB={300 + i % 7}".encode(), address)
    wait = start + (i + 1) / rate - time.monotonic()
    if wait > 0:
        time.sleep(wait)
print("done", count, flush=True)
time.sleep(3600)
"""


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def one(base: Path, rate: float, seconds: float, python: str) -> float:
    """Microseconds of supervisor CPU per datagram at ``rate`` per second."""
    go = base / f"go-{rate}-{time.monotonic_ns()}"
    sender = base / "sender.py"
    sender.write_text(SENDER)
    cfg = base / "notify.toml"
    cfg.write_text(
        f'[supervisor]\nstate_dir = "{base / "state"}"\n[api]\nlisten = ""\n'
        '[gpu]\nbackend = "none"\n'
        f'[[workers]]\nname = "s"\ncommand = ["{python}", "{sender}", "{rate}", "{seconds}", '
        f'"{go}"]\nready = "none"\nlog_passthrough = true\n'
        'health = { in_use_reporter = "torch" }\n'
    )
    env = dict(os.environ)
    if python != sys.executable:  # --python: its installed package, not a checkout on the path
        env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(
        [python, "-m", "supervisor", "run", "-c", str(cfg), "--log-format", "json"],
        cwd=base,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the worker is up: settle, then go
            if line.rstrip().endswith(" waiting"):
                break
        else:
            raise SystemExit(f"gpu-supervisor exited with {proc.wait()} on {cfg}")
        time.sleep(1.0)
        sup = psutil.Process(proc.pid)
        before = cpu_s(sup)
        go.touch()
        sent = 0
        for line in proc.stdout:
            if " done " in f" {line}":
                sent = int(line.split("done", 1)[1].split()[0])
                break
        sending = cpu_s(sup) - before
        quiet_before = cpu_s(sup)
        time.sleep(seconds)
        quiet = cpu_s(sup) - quiet_before
    finally:
        proc.terminate()
        proc.wait(30)
    if not sent:
        raise SystemExit("the sender did not finish")
    return max(0.0, sending - quiet) / sent * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="30,100,1000")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-notify-") as tmp:
        for rate in rates:
            costs = [one(Path(tmp), rate, args.seconds, args.python) for _ in range(args.rounds)]
            rows.append((rate, statistics.median(costs), costs))
    print(f"supervisor CPU per notify datagram, {args.seconds:g} s windows, median of rounds:")
    print("| datagrams/s | us per datagram (median) | rounds |")
    print("|---|---|---|")
    for rate, median, costs in rows:
        shown = ", ".join(f"{c:.0f}" for c in costs)
        print(f"| {rate:g} | {median:.0f} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
