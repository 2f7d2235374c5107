"""Ready after argv[1] seconds; with ``--from-child`` a (long-lived) child sends READY=1;
with ``--hold PATH`` those seconds begin only once PATH is gone (a load the test ends)."""

import os
import sys
import time

from common import forever, notify, say

if "--hold" in sys.argv:
    hold = sys.argv[sys.argv.index("--hold") + 1]
    while os.path.exists(hold):
        time.sleep(0.02)
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
