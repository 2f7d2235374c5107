"""Ready, then exit with code 3 after argv[1] seconds (default 0); with ``--hold PATH`` ready
only once PATH is gone; with ``--crash-once PATH`` those seconds begin once PATH exists (it
removes it: one crash a touch, as late as the test chooses)."""

import os
import sys
import time

from common import notify, say


def _path_after(flag: str) -> str | None:
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None


delay = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
hold, crash_once = _path_after("--hold"), _path_after("--crash-once")
while hold is not None and os.path.exists(hold):
    time.sleep(0.02)
notify("READY=1")
say("ready")
if crash_once is not None:
    while not os.path.exists(crash_once):
        time.sleep(0.02)
    os.unlink(crash_once)
time.sleep(delay)
say("crashing")
sys.exit(3)
