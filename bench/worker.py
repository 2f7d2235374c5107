"""Benchmark worker: record a start line, then sleep until killed.

On start it appends ``<pid> <time.time_ns()>`` to the file named by ``BENCH_START_FILE``
(or the first positional argument), then waits in ``signal.pause()`` forever.

``--ignore-term`` makes it ignore SIGTERM (installed *before* the start line is written, so
a worker that has announced itself is guaranteed to need the supervisor's SIGKILL).
Stdlib only; meant to be run with ``python -S`` so that start-up cost is minimal and equal
for every supervisor.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    ignore_term = "--ignore-term" in argv
    positional = [a for a in argv if not a.startswith("--")]
    path = os.environ.get("BENCH_START_FILE") or (positional[0] if positional else "")
    if not path:
        print("worker.py: set BENCH_START_FILE or pass the start file", file=sys.stderr)
        return 2
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    line = f"{os.getpid()} {time.time_ns()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write() with O_APPEND: lines never interleave
    finally:
        os.close(fd)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
