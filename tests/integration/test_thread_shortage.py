"""A real supervisor in a full pids cgroup (systemd's ``TasksMax``): no thread can be started,
and supervision goes on (it crashed with ``RuntimeError: can't start new thread``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import SupervisorFactory
from tests.harness import worker_cmd

PIDS_V1 = Path("/sys/fs/cgroup/pids")


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    """A pids cgroup (v1) of its own, removed when its processes are gone."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a pids cgroup")
    if not (PIDS_V1 / "cgroup.procs").is_file():
        pytest.skip(f"no cgroup v1 pids hierarchy at {PIDS_V1}")
    path = PIDS_V1 / f"gpu-supervisor-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a pids cgroup in {PIDS_V1}: {exc}")
    try:
        yield path
    finally:
        (path / "pids.max").write_text("max")
        left = []
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(psutil.Error):
                left.append(psutil.Process(int(pid)))
        psutil.wait_procs(left, timeout=10)  # the supervisor fixture has stopped them
        path.rmdir()


def _refusals(cgroup: Path) -> int:
    """How often the cgroup refused a new task (``pids.events``: ``max N``)."""
    for line in (cgroup / "pids.events").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "max":
            return int(value)
    return 0


def test_a_full_pids_cgroup_does_not_end_supervision(
    pids_cgroup: Path, supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    sup = supervisor(
        {
            "supervisor": {"sample_interval_s": 0.05},
            "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim")},
            "workers": [
                {
                    "name": "g",
                    "command": worker_cmd("ready_then_sleep"),
                    "stop_timeout_s": 2,
                }
            ],
        },
        prefix=["sh", "-c", enter, str(pids_cgroup)],
    )
    ready = sup.ready("g-0")
    url = sup.api_url()
    (pids_cgroup / "pids.max").write_text((pids_cgroup / "pids.current").read_text())
    mark = sup.mark()
    done = threading.Event()

    def ask() -> None:  # each request takes a thread of the pool, or needs a new one
        with httpx.Client(base_url=url, timeout=10) as api:
            while not done.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    api.get("/api/v1/postmortems")

    askers = [threading.Thread(target=ask, daemon=True) for _ in range(16)]
    for t in askers:
        t.start()
    try:
        # the sampler needs a new thread when the requests hold every idle one
        found = sup.wait_until(
            lambda: (
                sup.find(after=mark, event="sampler.tick_failed")
                or sup.find(after=mark, event="supervisor.crashed")
                or sup.proc.poll() is not None
            ),
            "a tick lost to the full pids cgroup",
            timeout=20,
        )
    finally:
        done.set()
        for t in askers:
            t.join(10)
        (pids_cgroup / "pids.max").write_text("max")  # tasks to be had again
    assert not sup.find(event="supervisor.crashed") and sup.proc.poll() is None, found
    assert "thread" in found[0]["error"], found
    assert _refusals(pids_cgroup) > 0
    # supervision went on all along: a crash is noticed, recorded and restarted as ever
    mark = sup.mark()
    os.kill(ready["pid"], signal.SIGKILL)
    sup.ready("g-0", after=mark)
    sup.wait_event(after=mark, event="records.postmortem", worker="g-0")
    assert sup.stop() == 0
