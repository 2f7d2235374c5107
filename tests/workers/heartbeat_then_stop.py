"""Ready, send WATCHDOG=1 argv[1] times (every argv[2] s, by default WATCHDOG_USEC/4), then go
silent."""

import os
import sys
import time

from common import forever, notify, say

count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
interval = int(os.environ.get("WATCHDOG_USEC", "1000000")) / 4_000_000
if len(sys.argv) > 2:
    interval = float(sys.argv[2])
notify("READY=1")
say("ready")
for _ in range(count):
    time.sleep(interval)
    notify("WATCHDOG=1")
say("silent")
forever()
