"""Ready after argv[1] seconds; with ``--from-child`` a (long-lived) child sends READY=1."""

import os
import sys
import time

from common import forever, notify, say

time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.5)
if "--from-child" in sys.argv:
    pid = os.fork()
    if pid == 0:
        notify("READY=1")
        say("child sent ready")
        forever()
else:
    notify("READY=1")
say("ready")
forever()
