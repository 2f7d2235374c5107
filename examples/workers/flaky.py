"""A flaky demo worker: ready quickly, then crashes after a random few seconds.

``flaky.py MIN MAX`` crashes with exit code 1 after MIN..MAX seconds, printing a fake CUDA error.
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
    print(f"{name}: ready, will crash in {life:.1f}s", flush=True)
    time.sleep(life)
    print(f"{name}: RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
