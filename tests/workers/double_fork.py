"""Double-fork a grandchild (argv[2] of them, default 1) that outlives its parent and exits
after argv[1] s; ready.

The grandchild is re-parented to the supervisor (PID 1 or child subreaper), which must reap it.
"""

import os
import sys
import time

from common import forever, notify, say

delay = float(sys.argv[1]) if len(sys.argv) > 1 else 0.3
times = int(sys.argv[2]) if len(sys.argv) > 2 else 1  # how many such grandchildren
for _ in range(times):
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            if times == 1:
                say("orphan")
            time.sleep(delay)
            os._exit(7)
        os._exit(0)
    os.waitpid(child, 0)
notify("READY=1")
say("ready")
forever()
