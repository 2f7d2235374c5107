"""Claim simulated GPU memory: ``gpu_user.py MB [--crash-after S] [--holder S] [--daemon[-setsid]]``.

Writes procs/<pid> for every GPU in CUDA_VISIBLE_DEVICES, then READY=1. ``--holder S`` first
starts a grandchild in its own session (escaping the process group) that also holds memory and
exits on its own S seconds after the worker is gone. ``--daemon``: a launcher whose server
double-forks (the process between them exits at once, so the server is re-parented to the
supervisor); the server claims the memory and sends READY=1, the launcher waits.
``--daemon-setsid``: the server also leaves the process group.
"""

import os
import sys
import time
from pathlib import Path

from common import forever, notify, say

args = sys.argv[1:]
mb = float(args[0])
crash_after = float(args[args.index("--crash-after") + 1]) if "--crash-after" in args else 0.0
holder = float(args[args.index("--holder") + 1]) if "--holder" in args else 0.0
world = Path(os.environ["GPU_SUPERVISOR_SIM_DIR"])
gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]


def claim(pid: int, amount: float) -> None:
    tmp = world / "procs" / f".{pid}.tmp"
    tmp.write_text("".join(f"{g} {amount:g}\n" for g in gpus))
    os.replace(tmp, world / "procs" / str(pid))


parent = os.getpid()
if holder and os.fork() == 0:
    os.setsid()
    claim(os.getpid(), 100)
    say("holder")
    while True:  # outlive the worker by `holder` seconds
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    time.sleep(holder)
    os._exit(0)
daemon = "--daemon" in args or "--daemon-setsid" in args
if daemon and os.fork() == 0:
    if os.fork() == 0:
        if "--daemon-setsid" in args:
            os.setsid()
        claim(os.getpid(), mb)
        notify("READY=1")
        say("daemon ready")
        forever()
    os._exit(0)
if daemon:
    os.wait()
    say("launched")
    forever()
claim(parent, mb)
notify("READY=1")
say(f"ready on {','.join(gpus)}")
if crash_after:
    time.sleep(crash_after)
    say("crashing")
    sys.exit(5)
forever()
