"""The test harness itself: a test process killed from outside leaves no supervisor running.

A pytest ended by SIGKILL or by ``timeout`` runs no fixture teardown; before the harness gave
its supervisors a parent-death signal, they (and their workers) ran on, loading the machine
for every later run.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import psutil

from tests.harness import ROOT

SCRIPT = """
import signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.harness import Supervisor, worker_cmd
config = {{"workers": [{{"name": "w", "command": worker_cmd("ready_then_sleep")}}]}}
sup = Supervisor(Path({tmp!r}), config).start()
worker = sup.ready("w-0")
print(sup.pid, worker["pid"], flush=True)
signal.pause()
"""


def test_a_killed_test_process_leaves_no_supervisor_running(tmp_path: Path) -> None:
    script = tmp_path / "a_test.py"
    script.write_text(SCRIPT.format(root=str(ROOT), tmp=str(tmp_path)))
    test = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert test.stdout is not None
    line = test.stdout.readline()
    procs = [psutil.Process(int(pid)) for pid in line.split()]
    assert len(procs) == 2, line
    test.kill()
    test.wait()
    test.stdout.close()
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not alive, f"still running after the test process was killed: {alive}"
