"""A worker on simulated GPUs for the self-healing tests.

``sim_worker.py MB [--leak MB_PER_S] [--in-use MB [--in-use-leak MB_PER_S] [--torch]
[--children N]] [--host-mb N] [--say-after S TEXT]``: claims MB MiB on every GPU in
CUDA_VISIBLE_DEVICES (the sim world's procs/<pid>), then READY=1; ``--leak`` grows the claim
every 0.05 s; ``--in-use`` reports that much memory in use with every heartbeat
(``X_GPU_MEMORY_IN_USE_MB``), growing by ``--in-use-leak`` while the claim stays put (a leak
hidden in the allocator's cache); with ``--torch`` it reports nothing itself but holds that much
in ``torch.cuda`` (tests/fake_torch on PYTHONPATH) for the supervisor's in-use reporter, and
``--children N`` starts N more processes holding as much (tensor-parallel ranks, say);
``--host-mb`` holds that much host memory (touched, so it is resident); ``--say-after`` prints
TEXT on stdout after S seconds (a sticky-error line, say).
"""

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import notify, say

args = sys.argv[1:]


def option(name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


mb = float(args[0])
leak = float(option("--leak", "0") or 0)
in_use = option("--in-use")
in_use_leak = float(option("--in-use-leak", "0") or 0)
use_torch = "--torch" in args
children = int(option("--children", "0") or 0)
parent = int(option("--child", "0") or 0)  # a child's parent pid
is_child = parent > 0
host_mb = float(option("--host-mb", "0") or 0)
say_after = float(option("--say-after", "-1") or -1)
text = args[args.index("--say-after") + 2] if "--say-after" in args else ""
world = Path(os.environ["GPU_SUPERVISOR_SIM_DIR"])
gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]


def claim(amount: float) -> None:
    tmp = world / "procs" / f".{os.getpid()}.tmp"
    tmp.write_text("".join(f"{g} {amount:.3f}\n" for g in gpus))
    os.replace(tmp, world / "procs" / str(os.getpid()))


held = bytearray(int(host_mb * 1024 * 1024))
for i in range(0, len(held), 4096):
    held[i] = 1
torch_cuda: Any = None
if use_torch:
    import torch  # tests/fake_torch

    torch_cuda = torch.cuda
    torch_cuda.init()
    if children:
        at = args.index("--children")
        child = [*args[:at], *args[at + 2 :], "--child", str(os.getpid())]
        for _ in range(children):
            subprocess.Popen([sys.executable, __file__, *child])
if not is_child:
    claim(mb)
    notify("READY=1")
    say(f"ready on {','.join(gpus)}")
start = time.monotonic()
said = False
while True:
    time.sleep(0.05)
    elapsed = time.monotonic() - start
    if is_child and os.getppid() != parent:
        sys.exit(0)  # the worker is gone
    if leak:
        claim(mb + leak * elapsed)
    if not said and 0 <= say_after <= elapsed:
        said = True
        print(text, flush=True)
    if torch_cuda is not None:
        torch_cuda.set_allocated(0, int((float(in_use or 0) + in_use_leak * elapsed) * 2**20))
        notify("WATCHDOG=1")
    elif in_use is None:
        notify("WATCHDOG=1")
    else:
        try:
            report = f"{float(in_use) + in_use_leak * elapsed:.3f}"
        except ValueError:
            report = in_use  # a bad report, as given
        notify(f"WATCHDOG=1\nX_GPU_MEMORY_IN_USE_MB={report}")
