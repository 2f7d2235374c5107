"""The kernel's OOM killer takes the supervisor last, and its workers are not protected with it.

``processes.protect_from_oom_killer`` lowers the supervisor's ``oom_score_adj`` (-900; needs
CAP_SYS_RESOURCE), and ``processes.spawn`` gives every worker the score the supervisor started
with (at least 0) before the worker's program runs. Regression: nothing set it, and in a shared
memory cgroup the OOM killer picked the supervisor first (it was the largest process): its workers
died through PR_SET_PDEATHSIG and a worker's children were orphaned and kept running.

Lowering a score needs CAP_SYS_RESOURCE; raising one never does. Where the test process lacks
the capability (containers usually do), the same code is exercised one step up the scale: the
"supervisor" process first raises itself to 500 (its "environment's" score) and protects itself
at 0 (allowed: an unprivileged process may go back down to the lowest score it ever had), and its
workers must come out at 500. The tests that need the real -900 skip there, saying so.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor import processes
from tests.conftest import SupervisorFactory
from tests.harness import ROOT, worker_cmd

CAP_SYS_RESOURCE = 24


def _has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


CAN_LOWER = _has_cap_sys_resource()
needs_cap = pytest.mark.skipif(
    not CAN_LOWER, reason="lowering oom_score_adj needs CAP_SYS_RESOURCE, which this process lacks"
)
needs_no_cap = pytest.mark.skipif(
    CAN_LOWER, reason="this process has CAP_SYS_RESOURCE: lowering its score cannot be refused"
)
#: The "environment's" score in the unprivileged variants, and where the supervisor goes from it.
START = 500
PROTECTED = 0
#: This test process's own score: the probes inherit it.
OWN_SCORE = int(Path("/proc/self/oom_score_adj").read_text())


@functools.cache
def _scale_usable() -> bool:
    """Whether a child of ours may go up to START and back down to PROTECTED unprivileged (not
    where a privileged writer set a score above PROTECTED for us: a pod's QoS score, say)."""
    adj = "/proc/self/oom_score_adj"
    script = f"echo {START} > {adj} && echo {PROTECTED} > {adj}"
    return subprocess.run(["sh", "-c", script], capture_output=True, check=False).returncode == 0


@pytest.fixture
def shifted_scale() -> None:
    if not _scale_usable():
        pytest.skip(
            f"this process (oom_score_adj {OWN_SCORE}) may not go from {START} back down to "
            f"{PROTECTED} without CAP_SYS_RESOURCE"
        )


# A process standing in for the supervisor: optionally raise its own score to ``start``, call
# protect_from_oom_killer(score), spawn one worker through processes.spawn along ``path``, and
# print what the supervisor, the worker and a child the worker forked at once ended up with.
PROBE = r"""
import dataclasses, json, os, signal, sys
from pathlib import Path

from supervisor import processes
from supervisor.model import LaunchSpec

start, score, path, cgroup = json.loads(sys.argv[1])
SELF = Path("/proc/self/oom_score_adj")
if start is not None:
    SELF.write_text(str(start))
if path == "no setpriv":
    processes._setpriv = lambda: None
elif path == "setpriv without choom":
    processes._choom = lambda: None
protection = processes.protect_from_oom_killer(*([] if score is None else [score]))
# The worker's first act is to fork (os.system): what that child inherits, it prints.
worker = "import os, signal; os.system('cat /proc/self/oom_score_adj'); signal.pause()"
spec = LaunchSpec(
    name="w-0", group="w", index=0, argv=(sys.executable, "-c", worker), env=dict(os.environ),
    port=None, gpus=None, ready_url=None, notify=False, watchdog_s=0.0,
)
child = processes.spawn(spec, None if cgroup is None else Path(cgroup))
os.set_blocking(child.output_fd, True)
line = b""
while not line.endswith(b"\n"):
    chunk = os.read(child.output_fd, 64)
    if not chunk:
        break
    line += chunk
worker_score = int(Path(f"/proc/{child.pid}/oom_score_adj").read_text())
os.kill(child.pid, signal.SIGKILL)
child.popen.wait()
os.close(child.output_fd)
print(json.dumps({
    "protection": dataclasses.asdict(protection),
    "supervisor": int(SELF.read_text()),
    "worker": worker_score,
    "worker_child": int(line) if line.strip() else line.decode(),
    "argv": [os.path.basename(a) for a in child.popen.args],
}))
"""

SPAWN_PATHS = ["setpriv and choom", "setpriv without choom", "no setpriv", "worker cgroup"]


def probe(
    tmp_path: Path, start: int | None, score: int | None, path: str = "setpriv and choom"
) -> dict[str, Any]:
    setpriv_paths = ("setpriv and choom", "setpriv without choom")
    if path in setpriv_paths and processes.probe_spawn_helper() is None:
        pytest.skip("util-linux setpriv with --pdeathsig is not installed")
    if path == "setpriv and choom" and shutil.which("choom") is None:
        pytest.skip("util-linux choom is not installed")
    # The preexec_fn path: a cgroup directory whose cgroup.procs is a plain file (joining it
    # is a harmless write; the path is what matters here).
    cgroup = None
    if path == "worker cgroup":
        (tmp_path / "cgroup.procs").write_text("")
        cgroup = str(tmp_path)
    args = json.dumps([start, score, path, cgroup])
    result = subprocess.run(
        [sys.executable, "-c", PROBE, args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return out


@pytest.mark.usefixtures("shifted_scale")
@pytest.mark.parametrize("path", SPAWN_PATHS)
def test_workers_get_back_the_score_the_supervisor_started_with(tmp_path: Path, path: str) -> None:
    """Unprivileged, one step up the scale: started at 500, protected at 0, workers at 500,
    and so is a child the worker forks the moment it starts (it must not inherit 0)."""
    out = probe(tmp_path, START, PROTECTED, path)
    assert out["protection"] == {
        "before": START,
        "now": PROTECTED,
        "workers": START,
        "error": None,
    }
    assert out["supervisor"] == PROTECTED
    assert out["worker"] == START
    if path == "setpriv without choom":
        # Written to /proc/<pid> right after Popen, while setpriv is still starting: a child
        # forked before that would keep the supervisor's score (docs/deployment.md).
        assert out["argv"][:2] == ["setpriv", "--pdeathsig"]
        assert "choom" not in out["argv"]
    else:
        assert out["worker_child"] == START
    if path == "setpriv and choom":
        assert out["argv"][:6] == ["setpriv", "--pdeathsig", "KILL", "--", "choom", "-n"]
        assert out["argv"][6:8] == [str(START), "--"]


@needs_cap
@pytest.mark.parametrize("path", SPAWN_PATHS)
def test_the_supervisor_goes_to_minus_900_and_its_workers_stay_at_0(
    tmp_path: Path, path: str
) -> None:
    """With CAP_SYS_RESOURCE (root outside a container): the real numbers (from 0, the usual
    start; from a lower one the supervisor keeps that, and workers still get 0)."""
    out = probe(tmp_path, None, None, path)
    assert processes.SUPERVISOR_OOM_SCORE_ADJ == -900
    now, workers = min(OWN_SCORE, -900), max(OWN_SCORE, 0)
    assert out["protection"] == {
        "before": OWN_SCORE,
        "now": now,
        "workers": workers,
        "error": None,
    }
    assert out["supervisor"] == now
    assert out["worker"] == workers
    if path != "setpriv without choom":
        assert out["worker_child"] == workers


@needs_no_cap
def test_without_cap_sys_resource_nothing_changes_and_nothing_raises(tmp_path: Path) -> None:
    """The refusal is reported, not raised; workers then inherit the same score, with no extra
    exec in their start (no choom)."""
    if OWN_SCORE <= processes.SUPERVISOR_OOM_SCORE_ADJ:
        pytest.skip(f"this process runs at oom_score_adj {OWN_SCORE} already")
    out = probe(tmp_path, None, None)
    protection = out["protection"]
    assert (protection["before"], protection["now"]) == (OWN_SCORE, OWN_SCORE)
    assert protection["workers"] == max(OWN_SCORE, 0)
    assert "CAP_SYS_RESOURCE" in protection["error"]
    assert out["supervisor"] == out["worker"] == out["worker_child"] == OWN_SCORE
    assert "choom" not in out["argv"]


@pytest.mark.usefixtures("shifted_scale")
def test_a_score_already_that_low_is_left_alone(tmp_path: Path) -> None:
    """As under systemd's OOMScoreAdjust=-900: the supervisor keeps what it was given (here
    200, asked for 500), and workers, at that score already, are spawned as before."""
    out = probe(tmp_path, 200, 500)
    assert out["protection"] == {"before": 200, "now": 200, "workers": 200, "error": None}
    assert out["supervisor"] == out["worker"] == out["worker_child"] == 200
    assert "choom" not in out["argv"]


def test_an_unreadable_proc_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """No /proc (or no oom_score_adj in it): nothing is changed, and workers inherit as before."""
    monkeypatch.setattr(processes, "_read_oom_score_adj", lambda *_: None)
    monkeypatch.setattr(processes, "_worker_oom_score_adj", None)
    got = processes.protect_from_oom_killer()
    assert got == processes.OomProtection(None, None, None, got.error)
    assert got.error is not None and "oom_score_adj" in got.error and not got.changed
    assert processes._oom_score_for_worker() is None
    assert processes._worker_oom_score_adj is None


@needs_cap
def test_a_supervisor_started_at_minus_900_runs_its_workers_at_0(
    supervisor: SupervisorFactory,
) -> None:
    """The systemd unit's case (OOMScoreAdjust=-900): a real supervisor started at -900 gives
    its workers, and what they fork, the kernel's default 0."""
    choom = shutil.which("choom")
    if choom is None:
        pytest.skip("util-linux choom is not installed")
    sup = supervisor(
        {
            "workers": [
                {
                    "name": "fg",
                    "command": worker_cmd("fork_grandchild"),
                    "ready": "notify",
                    "gpus": "none",
                }
            ]
        },
        prefix=[choom, "-n", "-900", "--"],
    )
    sup.ready("fg-0")
    (spawned,) = sup.find(event="worker.spawned")
    worker = psutil.Process(spawned["pid"])
    tree = [worker, *worker.children(recursive=True)]
    assert len(tree) == 2
    assert Path(f"/proc/{sup.pid}/oom_score_adj").read_text().strip() == "-900"
    for proc in tree:
        assert Path(f"/proc/{proc.pid}/oom_score_adj").read_text().strip() == "0", proc
    assert sup.stop() == 0


# --- the OOM killer itself, in a memory cgroup (v1) ------------------------------------------

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
LIMIT_MB = 256
#: The stand-in supervisor holds this much more than its interpreter, so that it is the largest
#: process in the cgroup: at equal scores the OOM killer takes it first (the regression).
BALLAST_MB = 60
HOG_CHILDREN = 6
HOG_CHILD_MB = 40  # 6 x 40 MB + the supervisor's ~95 MB > the 256 MB limit

# The stand-in supervisor: join the cgroup, take the environment's score, grow, protect itself
# (or not), spawn the hog worker through processes.spawn and wait for it.
OOM_SUPERVISOR = r"""
import json, os, sys
from pathlib import Path

procs, start, score, ballast_mb, children, child_mb = json.loads(sys.argv[1])
Path(procs).write_text(str(os.getpid()))  # everything from here on is charged to the cgroup
if start is not None:
    Path("/proc/self/oom_score_adj").write_text(str(start))

from supervisor import processes
from supervisor.model import LaunchSpec

ballast = b"\x01" * (ballast_mb << 20)
if score != "none":
    processes.protect_from_oom_killer(*([] if score is None else [score]))
hog = sys.argv[2]
spec = LaunchSpec(
    name="hog-0", group="hog", index=0, argv=(sys.executable, hog, str(children), str(child_mb)),
    env=dict(os.environ), port=None, gpus=None, ready_url=None, notify=False, watchdog_s=0.0,
)
child = processes.spawn(spec)
code = child.popen.wait()
os.set_blocking(child.output_fd, True)
output = os.read(child.output_fd, 1 << 16).decode()
print(json.dumps({
    "supervisor": int(Path("/proc/self/oom_score_adj").read_text()),
    "worker_code": code,
    "worker_output": output,
}), flush=True)
"""

# The worker: N children, each growing to M MB, holding it until the worker has heard from all
# (done or killed); then they exit and the worker reports how many the OOM killer took.
HOG = r"""
import json, os, sys

children, child_mb = int(sys.argv[1]), int(sys.argv[2])
go_r, go_w = os.pipe()
kids = []
for _ in range(children):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.close(r)
        held = [b"\x02" * (1 << 20) for _ in range(child_mb)]
        os.write(w, b"1")
        os.read(go_r, 1)  # EOF once the worker is done (or dead)
        os._exit(0)
    os.close(w)
    kids.append((pid, r))
for _, r in kids:
    os.read(r, 1)  # b"1" when it got all its memory, b"" when it was killed
os.close(go_w)
statuses = [os.waitpid(pid, 0)[1] for pid, _ in kids]
killed = sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in statuses)
score = int(open("/proc/self/oom_score_adj").read())
print(json.dumps({"children": children, "killed": killed, "worker_score": score}))
"""


def _own_memory_cgroup() -> Path | None:
    if not (MEMORY_V1 / "memory.limit_in_bytes").is_file():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMORY_V1 / path.lstrip("/")
    return None


@contextlib.contextmanager
def memory_cgroup(name: str, limit_mb: int) -> Iterator[Path]:
    """A child of this process's cgroup v1 memory cgroup with a limit; everything still in it
    is killed (and waited for) and the cgroup removed afterwards. Skips where it cannot be."""
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("no cgroup v1 memory hierarchy (/sys/fs/cgroup/memory)")
    cgroup = parent / name
    try:
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
        with contextlib.suppress(OSError):  # absent without swap accounting
            (cgroup / "memory.swappiness").write_text("0")
    except OSError as exc:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {parent}: {exc}")
    try:
        yield cgroup
    finally:
        left: list[psutil.Process] = []
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(pid))
                proc.send_signal(signal.SIGKILL)
                left.append(proc)
        _, alive = psutil.wait_procs(left, timeout=10)
        cgroup.rmdir()
        assert not alive, f"still alive in {cgroup}: {alive}"


def oom_kills(cgroup: Path) -> int:
    for line in (cgroup / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    pytest.skip("this kernel's memory.oom_control has no oom_kill counter")


def run_oom_scenario(
    tmp_path: Path, start: int | None, score: int | str | None
) -> tuple[subprocess.CompletedProcess[str], int, list[str]]:
    """Run the stand-in supervisor in a fresh memory cgroup; its result, the cgroup's OOM-kill
    count and the pids still in the cgroup when it exited."""
    hog = tmp_path / "hog.py"
    hog.write_text(HOG)
    with memory_cgroup(f"gpu-supervisor-oom-test-{os.getpid()}", LIMIT_MB) as cgroup:
        args = [
            str(cgroup / "cgroup.procs"),
            start,
            score,
            BALLAST_MB,
            HOG_CHILDREN,
            HOG_CHILD_MB,
        ]
        cmd: Sequence[str] = [sys.executable, "-c", OOM_SUPERVISOR, json.dumps(args), str(hog)]
        result = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        return result, oom_kills(cgroup), (cgroup / "cgroup.procs").read_text().split()


def _victims_are_in_the_worker(result: subprocess.CompletedProcess[str], kills: int) -> None:
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    out = json.loads(result.stdout.splitlines()[-1])
    assert kills >= 1, out  # the scenario did run out of memory
    if out["worker_code"] == 0:  # the OOM killer took some of the worker's children
        report = json.loads(out["worker_output"].splitlines()[-1])
        assert report["killed"] >= 1, report
    else:  # or the worker's main process (it is the cheapest to lose after them)
        assert out["worker_code"] == -signal.SIGKILL, out


@pytest.mark.usefixtures("shifted_scale")
def test_the_oom_killer_takes_the_workers_memory_not_the_supervisor(tmp_path: Path) -> None:
    """A 256 MB cgroup, a supervisor of ~95 MB and a worker whose 6 children grow to 40 MB
    each: with the supervisor protected (500 -> 0 here; -900 under systemd) the kernel kills in
    the worker's tree, and the supervisor lives on to see it."""
    result, kills, left = run_oom_scenario(tmp_path, START, PROTECTED)
    _victims_are_in_the_worker(result, kills)
    assert left == []
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["supervisor"] == PROTECTED


@needs_cap
def test_the_oom_killer_takes_the_workers_memory_not_the_supervisor_at_minus_900(
    tmp_path: Path,
) -> None:
    result, kills, left = run_oom_scenario(tmp_path, None, None)
    _victims_are_in_the_worker(result, kills)
    assert left == []
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["supervisor"] == -900


@pytest.mark.usefixtures("shifted_scale")
def test_without_protection_the_oom_killer_takes_the_supervisor(tmp_path: Path) -> None:
    """The control, showing the scenario above has teeth: the same cgroup with every process at
    the same score (as before the fix), and the kernel kills the supervisor first."""
    result, kills, _ = run_oom_scenario(tmp_path, START, "none")
    assert kills >= 1
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stdout, result.stderr)
