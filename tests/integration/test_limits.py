"""``[workers.limits]`` on real workers: the limits each worker starts with (read back from
the kernel), what the supervisor cannot give (a failed start saying why, a ``check-config``
warning, a rejected reload, nothing else harmed), and a limit that fails in the child (exit
126, said in the worker's log). The config's forms and the pure checks:
tests/unit/test_limits.py.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor import processes
from supervisor.model import LaunchSpec
from tests.conftest import SupervisorFactory
from tests.harness import ROOT, worker_cmd

INF = resource.RLIM_INFINITY
MEMLOCK = resource.getrlimit(resource.RLIMIT_MEMLOCK)
CAN_RAISE = (
    processes._has_capabilities(processes.CAP_SYS_RESOURCE)
    and processes._in_initial_user_namespace()  # a user namespace's root may not
)


def _limits(pid: int) -> dict[str, tuple[int, int]]:
    proc = psutil.Process(pid)
    return {name: tuple(proc.rlimit(res)) for name, res in processes.RLIMITS.items()}  # type: ignore[misc]


def _group(name: str, **extra: object) -> dict[str, object]:
    return {"name": name, "command": worker_cmd("ready_then_sleep"), "stop_timeout_s": 2, **extra}


def test_workers_start_with_their_groups_limits_and_the_others_with_the_supervisors(
    supervisor: SupervisorFactory,
) -> None:
    # lower than the supervisor's, as anyone may: memlock a page less than its hard limit
    memlock = MEMLOCK[1] - 4096 if MEMLOCK[1] != INF else 1 << 30
    sup = supervisor(
        {
            "workers": [
                _group(
                    "l",
                    limits={
                        "nofile": [1024, 4096],
                        "core": 0,
                        "stack": [4 << 20, 16 << 20],
                        "memlock": memlock,
                    },
                ),
                _group("p"),
            ]
        }
    )
    limited = _limits(sup.ready("l-0")["pid"])
    assert limited["nofile"] == (1024, 4096)
    assert limited["core"] == (0, 0)
    assert limited["stack"] == (4 << 20, 16 << 20)
    assert limited["memlock"] == (memlock, memlock)
    assert limited["nproc"] == tuple(psutil.Process(sup.pid).rlimit(resource.RLIMIT_NPROC))
    # a group without limits has the supervisor's own (its raised open-files limit included)
    assert _limits(sup.ready("p-0")["pid"]) == _limits(sup.pid)
    assert sup.stop() == 0


@pytest.mark.skipif(CAN_RAISE, reason="this process has CAP_SYS_RESOURCE: it may raise them")
def test_limits_the_supervisor_cannot_give_fail_the_start_warn_and_reject_a_reload(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    if MEMLOCK[1] == INF:
        pytest.skip("the hard memlock limit here is unlimited already: nothing to raise")
    raised = {"memlock": "unlimited"}
    sup = supervisor({"workers": [_group("m", limits=raised), _group("r")]})
    failed = sup.wait_event(event="worker.spawn_failed", worker="m-0")
    assert (
        f"limits.memlock: raising the hard limit from {MEMLOCK[1]} to unlimited needs "
        "CAP_SYS_RESOURCE" in failed["error"]
    )
    first = sup.ready("r-0")
    assert not sup.find(event="worker.spawned", worker="m-0")  # nothing was forked

    # a reload that asks the same of a running group is rejected: nothing is stopped
    rejected = sup.reload_rejected(
        {"workers": [_group("m", replicas=0), _group("r", limits=raised)]}
    )
    assert rejected["reason"] == "command"
    assert "group r: limits.memlock: raising the hard limit" in rejected["error"]
    assert psutil.Process(first["pid"]).is_running()
    assert sup.stop() == 0

    # check-config says so and shows each worker's limits
    path = tmp_path / "c.toml"
    path.write_text(
        f"[supervisor]\nstate_dir='{tmp_path / 's'}'\n[gpu]\nbackend='none'\n"
        "[[workers]]\nname='m'\ncommand=['sh','-c','true']\n"
        "[workers.limits]\nmemlock='unlimited'\nnofile=[1024, 4096]\n"
        "[[workers]]\nname='r'\ncommand=['sh','-c','true']\n"
    )
    argv = [sys.executable, "-m", "supervisor", "check-config", "-c", str(path), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    report = json.loads(done.stdout)
    rows = {row["name"]: row for row in report["workers"]}
    assert rows["m-0"]["limits"] == {"memlock": ["unlimited", "unlimited"], "nofile": [1024, 4096]}
    assert rows["r-0"]["limits"] == {}
    assert any(
        w.startswith("group m: limits.memlock: raising the hard limit")
        and w.endswith("(its workers would fail to start)")
        for w in report["warnings"]
    ), report["warnings"]


@pytest.mark.skipif(not CAN_RAISE, reason="raising a hard limit needs CAP_SYS_RESOURCE")
def test_a_supervisor_with_cap_sys_resource_raises_a_hard_limit_for_its_workers(
    supervisor: SupervisorFactory,
) -> None:
    sup = supervisor({"workers": [_group("m", limits={"memlock": "unlimited"})]})
    assert _limits(sup.ready("m-0")["pid"])["memlock"] == (INF, INF)
    assert psutil.Process(sup.pid).rlimit(resource.RLIMIT_MEMLOCK) == MEMLOCK  # its own kept
    assert sup.stop() == 0


def _spec(limits: tuple[tuple[str, int | None, int | None], ...]) -> LaunchSpec:
    return LaunchSpec(
        name="l-0",
        group="l",
        index=0,
        argv=("sleep", "60"),
        env={"PATH": os.defpath},
        port=None,
        gpus=None,
        ready_url=None,
        notify=False,
        watchdog_s=0.0,
        limits=limits,
    )


def _output(fd: int, timeout: float = 20.0) -> bytes:
    deadline, buf = time.monotonic() + timeout, b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no line: {buf!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            assert chunk, f"output ended: {buf!r}"
            buf += chunk
    return buf


def test_spawn_sets_the_limits_in_the_child_and_never_through_setpriv() -> None:
    child = processes.spawn(_spec((("nofile", 256, 512), ("core", 0, 0))))
    try:
        assert isinstance(child.popen.args, list) and child.popen.args[0].endswith("sleep")
        limits = _limits(child.pid)
        assert limits["nofile"] == (256, 512) and limits["core"] == (0, 0)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.popen.wait()
        os.close(child.output_fd)


def test_a_limit_the_child_cannot_set_ends_its_start_with_126_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the check before the fork would refuse it: as if the limit changed since (prlimit)
    monkeypatch.setattr(processes, "limits_problem", lambda *a, **k: None)
    too_many = processes._nr_open() or 1 << 20
    child = processes.spawn(_spec((("nofile", 1024, too_many + 1),)))
    try:
        said = _output(child.output_fd).decode()
        assert (
            said == "gpu-supervisor: cannot set limits.nofile: not allowed to raise maximum limit\n"
        )
        assert child.popen.wait(10) == 126
    finally:
        os.close(child.output_fd)


@pytest.mark.parametrize("hard", ["unlimited", str(16 << 30)])
def test_an_address_space_limit_the_supervisor_inherited_is_not_passed_on(
    supervisor: SupervisorFactory, hard: str
) -> None:
    """Regression: a supervisor started under an address-space limit (``ulimit -v`` in a
    login profile, a batch system that propagates the submitting shell's limits) passed it on
    to every worker, and a CUDA process under ``RLIMIT_AS`` fails to initialise its GPU (it
    reserves far more address space than it uses: DESIGN.md). Now the soft limit is raised to
    the hard one at start, so the workers start without it, and a hard limit that is still
    there is said (a warning)."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("util-linux prlimit is not installed")
    soft = 16 << 30
    sup = supervisor(
        {
            "workers": [
                {
                    "name": "a",
                    "command": [
                        "/bin/sh",
                        "-c",
                        'echo "as $(grep "^Max address space" /proc/self/limits)"; exec sleep 600',
                    ],
                    "ready": "none",
                    "log_passthrough": True,
                }
            ]
        },
        prefix=[prlimit, f"--as={soft}:{hard}", "--"],
    )
    words = sup.wait_line("[a-0]", contains="Max address space").split()
    assert words[-3:-1] == [hard, hard], words  # soft, hard, "bytes"
    said = sup.wait_event(event="supervisor.address_space_limit")
    assert said["before"] == soft, said
    if hard == "unlimited":
        assert (said["now"], said["level"]) == ("unlimited", "info"), said
    else:
        assert (said["now"], said["level"]) == (int(hard), "warning"), said
    assert sup.stop() == 0
