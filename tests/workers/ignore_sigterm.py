"""Ignore SIGTERM; ready; sleep. Only SIGKILL ends it."""

import signal

from common import forever, notify, say

signal.signal(signal.SIGTERM, signal.SIG_IGN)
notify("READY=1")
say("ready")
forever()
