"""SIGKILL the supervisor at random moments during heavy worker churn, many times.

Runs the suite's churn test (tests/integration/test_records.py) with a full count of kills
(default 100; CI runs fewer): after every kill each file in state_dir must parse and validate
against docs/schemas, and the next supervisor must start over it and reclaim what is left.

    .venv/bin/python bench/churn_kill.py [KILLS]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    kills = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    env = {**os.environ, "GPU_SUPERVISOR_CHURN_KILLS": str(kills)}
    test = "tests/integration/test_records.py::test_sigkill_during_churn_never_leaves_a_torn_file"
    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=0", test],
        cwd=ROOT,
        env=env,
        check=False,
    )
    elapsed = time.monotonic() - t0
    verdict = "PASS" if result.returncode == 0 else "FAIL"
    print(f"churn kill: {kills} SIGKILLs, every file valid: {verdict} ({elapsed:.1f} s)")
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
