"""Benchmark worker: record a start line, then sleep until killed.

On start it appends ``<pid> <time.time_ns()>`` to the file named by ``BENCH_START_FILE``
(or the first positional argument), then waits in ``signal.pause()`` forever.

``--sim-mib N`` claims N MiB on each of its GPUs in the simulated-GPU world (``procs/<pid>`` in
``GPU_SUPERVISOR_SIM_DIR``, GPUs from ``CUDA_VISIBLE_DEVICES``), as a sim workload would.
``--ignore-term`` makes it ignore SIGTERM (installed *before* the start line is written, so
a worker that has announced itself is guaranteed to need the supervisor's SIGKILL).
``--http`` answers every GET on ``PORT`` with 200 (a health URL) instead of pausing;
``--http-503`` answers 503 (a model still loading) over HTTP/1.1 keep-alive, a thread per
connection, as an inference server's health URL does while it loads.
Stdlib only; meant to be run with ``python -S`` so that start-up cost is minimal and equal
for every supervisor.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def claim_sim_memory(mib: float) -> None:
    world = os.environ.get("GPU_SUPERVISOR_SIM_DIR")
    gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if not world or not gpus:
        return
    pid = os.getpid()
    tmp = os.path.join(world, "procs", f".{pid}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(f"{g} {mib:g}\n" for g in gpus))
    os.replace(tmp, os.path.join(world, "procs", str(pid)))


def main(argv: list[str]) -> int:
    ignore_term = "--ignore-term" in argv
    positional = [
        a
        for i, a in enumerate(argv)
        if not a.startswith("--") and not (i > 0 and argv[i - 1] == "--sim-mib")
    ]
    path = os.environ.get("BENCH_START_FILE") or (positional[0] if positional else "")
    if not path:
        print("worker.py: set BENCH_START_FILE or pass the start file", file=sys.stderr)
        return 2
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--sim-mib" in argv:
        claim_sim_memory(float(argv[argv.index("--sim-mib") + 1]))
    line = f"{os.getpid()} {time.time_ns()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write() with O_APPEND: lines never interleave
    finally:
        os.close(fd)
    if "--http" in argv:
        serve_health(int(os.environ["PORT"]))
    if "--http-503" in argv:
        serve_loading(int(os.environ["PORT"]))
    while True:
        signal.pause()


def serve_health(port: int) -> None:
    import http.server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: object) -> None:
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()


def serve_loading(port: int) -> None:
    import http.server

    class Loading(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the prober's connection is reused

        def do_GET(self) -> None:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Loading).serve_forever()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
