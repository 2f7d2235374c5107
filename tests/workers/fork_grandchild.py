"""Fork a grandchild that ignores SIGTERM and sleeps (``--setsid``: it leaves the group too;
``--daemon``: it double-forks, so it is re-parented to the supervisor and in no tree;
``--via-child``: a child that stays in the group forks it, with setsid, and the worker exits
with code 3 0.2 s after it is ready; ``--clean-env``: the grandchild then runs with an empty
environment, so that only the output pipe it still holds tells whose it is; ``--obeys-term``:
the grandchild keeps SIGTERM's default action, for tests that do not wait out its grace)."""

import os
import signal
import sys

from common import forever, notify, say

pid = os.fork()
if pid == 0 and "--via-child" in sys.argv:
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.setsid()
        say("grandchild")
    forever()
if pid == 0:
    if "--obeys-term" not in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--setsid" in sys.argv or "--daemon" in sys.argv:
        os.setsid()
    if "--daemon" in sys.argv and os.fork() != 0:
        os._exit(0)  # the middle process: its child is adopted by the supervisor
    say("grandchild")
    if "--clean-env" in sys.argv:
        loop = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        loop += "while True: time.sleep(60)"
        os.execve(sys.executable, [sys.executable, "-S", "-c", loop], {})  # noqa: S606
    forever()
if "--daemon" in sys.argv:
    os.waitpid(pid, 0)
say(f"forked {pid}")
notify("READY=1")
say("ready")
if "--via-child" in sys.argv:
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    signal.signal(signal.SIGALRM, lambda *_: sys.exit(3))
forever()
