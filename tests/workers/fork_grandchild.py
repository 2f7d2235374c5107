"""Fork a grandchild that ignores SIGTERM and sleeps (``--setsid``: it leaves the group too)."""

import os
import signal
import sys

from common import forever, notify, say

pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--setsid" in sys.argv:
        os.setsid()
    say("grandchild")
    forever()
say(f"forked {pid}")
notify("READY=1")
say("ready")
forever()
