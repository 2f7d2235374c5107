"""Ready, then exit with code 3 after argv[1] seconds (default 0)."""

import sys
import time

from common import notify, say

delay = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
notify("READY=1")
say("ready")
time.sleep(delay)
say("crashing")
sys.exit(3)
