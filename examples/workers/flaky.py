"""A flaky demo worker: ready quickly, then breaks after a random few seconds, in one of two ways.

``flaky.py MIN MAX``: after MIN..MAX seconds, either it crashes (exit code 1, a Python
traceback-like line: a post-mortem with reason ``exit``), or it prints a sticky CUDA error and
carries on, broken, as a real worker would (the supervisor's ``log_restart_patterns`` match
it: restarted with reason ``log_pattern``).
"""

from __future__ import annotations

import os
import random
import sys
import time

from sdnotify import notify


def main() -> None:
    low = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    high = float(sys.argv[2]) if len(sys.argv) > 2 else 8.0
    name = os.environ.get("GPU_SUPERVISOR_WORKER", "flaky")
    notify("READY=1")
    life = random.uniform(low, high)  # noqa: S311 - a demo's crash timing, not cryptography
    crash = random.random() < 0.5  # noqa: S311
    print(f"{name}: ready, will {'crash' if crash else 'break'} in {life:.1f}s", flush=True)
    time.sleep(life)
    if crash:
        print(f"{name}: RuntimeError: simulated crash in the request loop", flush=True)
        sys.exit(1)
    print(f"{name}: RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
    while True:  # a sticky CUDA error: the process lives on, useless, until it is restarted
        time.sleep(60)


if __name__ == "__main__":
    main()
