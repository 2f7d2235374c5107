"""A fake GPU inference worker for simulated GPUs (``[gpu] backend = "sim"``).

It "uses" the GPUs in CUDA_VISIBLE_DEVICES by writing ``procs/<pid>`` in the sim world
(GPU_SUPERVISOR_SIM_DIR, which the supervisor exports under the sim backend), speaks sd_notify
(READY=1, WATCHDOG=1, STATUS=) and serves GET / on PORT. Stdlib only.

    fake_inference.py [--memory-mb 2048] [--leak-mb-per-min 0] [--load-s 1]
                      [--crash-after S] [--hang-after S]
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import signal
import sys
import threading
import time
from pathlib import Path

from sdnotify import notify


class World:
    """This process's ``procs/<pid>`` file in the sim world."""

    def __init__(self) -> None:
        sim = os.environ.get("GPU_SUPERVISOR_SIM_DIR")
        self.path = Path(sim) / "procs" / str(os.getpid()) if sim else None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.gpus = [g for g in visible.split(",") if g]

    def claim(self, mib: float) -> None:
        """Say that this process holds ``mib`` on each of its GPUs."""
        if self.path is None or not self.gpus:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(f"{g} {int(mib)}\n" for g in self.gpus))
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Remove the file (a dead pid's file is ignored anyway)."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-mb", type=float, default=2048)
    parser.add_argument("--leak-mb-per-min", type=float, default=0.0)
    parser.add_argument("--load-s", type=float, default=1.0)
    parser.add_argument("--crash-after", type=float, default=0.0)
    parser.add_argument("--hang-after", type=float, default=0.0)
    args = parser.parse_args()
    name = os.environ.get("GPU_SUPERVISOR_WORKER", "fake")
    world = World()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        world.claim(args.memory_mb / 4)
        time.sleep(args.load_s)  # "load the model"
        world.claim(args.memory_mb)
        port = int(os.environ.get("PORT", "8001"))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Ok)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        notify(f"READY=1\nSTATUS=serving on {port}")
        gpus = ",".join(world.gpus) or "-"
        print(f"{name}: ready on GPU(s) {gpus} with {args.memory_mb:g} MiB", flush=True)
        usec = int(os.environ.get("WATCHDOG_USEC", "0"))
        interval = min(usec / 3_000_000, 1.0) if usec else 1.0
        started = time.monotonic()
        while True:
            time.sleep(interval)
            alive = time.monotonic() - started
            if args.crash_after and alive >= args.crash_after:
                print(f"{name}: RuntimeError: CUDA error: an illegal memory access", flush=True)
                sys.exit(1)
            used = args.memory_mb + args.leak_mb_per_min * alive / 60
            world.claim(used)
            if args.hang_after and alive >= args.hang_after:
                continue  # stuck: no more heartbeats
            notify(f"WATCHDOG=1\nSTATUS=serving, {used:.0f} MiB")
    finally:
        world.release()


class Ok(http.server.BaseHTTPRequestHandler):
    """``GET`` of any path answers 200 ``ok`` (a health URL for ``ready = "http://..."``)."""

    def do_GET(self) -> None:
        body = b"ok\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # no line per request in the worker's log


if __name__ == "__main__":
    main()
