"""The supervisor speaks sd_notify to its own service manager: READY=1, WATCHDOG=1, STATUS=."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.backends.sim import SimBackend
from tests.conftest import SupervisorFactory
from tests.harness import worker_cmd


class Manager:
    """A fake service manager: a datagram socket that keeps every message it got."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.got: list[str] = []

    def wait_for(self, want: str, timeout: float = 10.0, count: int = 1) -> str:
        """The ``count``-th message (old or new) containing ``want``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [m for m in self.got if want in m]
            if len(found) >= count:
                return found[count - 1]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {want!r} within {timeout}s; got {self.got[-20:]}")
            self.sock.settimeout(remaining)
            try:
                self.got.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue


def test_ready_watchdog_and_status_reach_the_manager(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    path = tmp_path / "systemd.sock"
    with service_manager(path) as manager:
        sup = supervisor(
            {
                "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim")},  # two GPUs
                "workers": [
                    {"name": "a", "command": worker_cmd("notify_ready_late", "0.3"), "replicas": 2},
                    {"name": "b", "command": worker_cmd("ready_then_sleep"), "gpus": "none"},
                ],
            },
            env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"},
        )
        # READY=1 comes only once every group has a ready worker.
        ready_msg = manager.wait_for("READY=1")
        assert "STATUS=" in ready_msg
        ready_at = manager.got.index(ready_msg)
        # (the log lines may reach the harness after the datagram: wait, do not just look)
        a_ready = sup.wait_event(event="worker.state", group="a", new="ready")
        b_ready = sup.wait_event(event="worker.state", worker="b-0", new="ready")
        assert a_ready["timestamp"] <= sup.wait_event(event="supervisor.ready")["timestamp"]
        assert b_ready["timestamp"] <= sup.wait_event(event="supervisor.ready")["timestamp"]
        assert all("READY=1" not in m for m in manager.got[:ready_at])
        # WATCHDOG=1 keeps coming, every WATCHDOG_USEC/2 (0.2 s), not just once
        assert manager.wait_for("WATCHDOG=1", count=3)
        assert manager.wait_for("STATUS=3/3 ready, 0 fatal, 2 GPUs")
        assert sup.stop() == 0
        assert manager.wait_for("STOPPING=1")


def test_workers_do_not_inherit_the_managers_socket(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    path = tmp_path / "systemd.sock"
    with service_manager(path):
        sup = supervisor(
            {
                "workers": [
                    {
                        "name": "q",
                        "command": worker_cmd("ready_then_sleep"),
                        "ready": "none",
                        "log_passthrough": True,
                    }
                ]
            },
            env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"},
        )
        line = sup.wait_line("[q-0] ", contains=" env ")
        assert "NOTIFY_SOCKET" not in line and "WATCHDOG_USEC" not in line
        assert sup.stop() == 0


@contextlib.contextmanager
def service_manager(path: Path) -> Iterator[Manager]:
    """A fake service manager listening at ``path`` (the supervisor's ``NOTIFY_SOCKET``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        yield Manager(sock)


def fill_queue(path: Path) -> socket.socket:
    """Fill the manager's queue (``net.unix.max_dgram_qlen`` datagrams): a busy manager."""
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        for i in range(100_000):
            filler.sendto(b"FILLER=%d" % i, str(path))
    return filler


def drain(manager: Manager) -> list[str]:
    """Every message the manager has now (without waiting)."""
    manager.sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            manager.got.append(manager.sock.recv(4096).decode())
    manager.sock.setblocking(True)
    return manager.got


def test_ready_gets_through_a_manager_queue_that_was_full(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The defect: READY=1 found the manager's queue full (a busy systemd; start-up's STATUS=
    lines fill a queue of 10) and was lost for good: systemd timed the start out and killed
    everything. Now it is kept and sent again until the manager takes it."""
    path = tmp_path / "systemd.sock"
    with service_manager(path) as manager:
        filler = fill_queue(path)
        sup = supervisor(
            {
                "workers": [
                    {"name": "a", "command": worker_cmd("ready_then_sleep"), "ready": "none"}
                ]
            },
            env={"NOTIFY_SOCKET": str(path)},
        )
        sup.wait_event(event="supervisor.ready")  # sent (or kept) before it is logged
        drain(manager)  # the manager reads at last: the queue has room
        assert manager.wait_for("READY=1")
        assert sup.stop() == 0
        assert manager.wait_for("STOPPING=1")
        filler.close()


@pytest.mark.parametrize("why", ["fatal", "crash_loop", "waiting_gpu"])
def test_a_group_that_cannot_get_ready_does_not_hold_ready_back(
    supervisor: SupervisorFactory, tmp_path: Path, why: str
) -> None:
    """The defect: a group whose every worker went fatal at start-up (or waits for a GPU:
    one lost at boot, a budget no GPU fits) held READY=1 back for good: systemd's start
    timeout then stopped everything, the healthy groups too, and its restart did the same
    every 5 minutes. Now READY=1 comes once the other groups are ready, and the status and
    the log say which group is down.

    ``crash_loop``: one that never goes fatal (``burst = 0``, or starts that time out one
    after another, start_timeout_s apart: never more than ``burst`` within ``interval_s``)
    held it back the same way: the unit's TimeoutStartSec=300 ran out while it kept
    retrying. A group whose every worker has failed since the start is not waited for."""
    path = tmp_path / "systemd.sock"
    bad: dict[str, Any]
    config: dict[str, Any] = {}
    if why == "fatal":
        bad = {
            "name": "bad",
            "command": ["/bin/sh", "-c", "exit 3"],  # never ready (notify)
            "restart": {"burst": 2, "backoff_initial_s": 0.01, "backoff_max_s": 0.02},
        }
    elif why == "crash_loop":
        bad = {
            "name": "bad",
            "command": ["/bin/sh", "-c", "exit 3"],
            "restart": {"burst": 0, "backoff_initial_s": 0.05, "backoff_max_s": 0.1},
        }
    else:  # a budget of 90000 MiB on GPUs of 81920
        config["gpu"] = {"backend": "sim", "sim_dir": str(tmp_path / "sim"), "sim_devices": 1}
        bad = {
            "name": "bad",
            "command": worker_cmd("ready_then_sleep"),
            "health": {"gpu_memory_limit_mb": 90000},
        }
    with service_manager(path) as manager:
        good = {"name": "good", "command": worker_cmd("ready_then_sleep"), "gpus": "none"}
        sup = supervisor({**config, "workers": [good, bad]}, env={"NOTIFY_SOCKET": str(path)})
        ready = manager.wait_for("READY=1")
        # READY=1 comes once bad-0 has failed: a fatal one may then still be backing off
        assert "STATUS=1/2 ready, " in ready, ready
        status = "1/2 ready, 1 fatal" if why == "fatal" else "1/2 ready, 0 fatal"
        assert manager.wait_for(f"STATUS={status}")
        assert sup.wait_event(event="supervisor.ready_degraded")["groups"] == ["bad"]
        if why == "crash_loop":  # it goes on being restarted
            with sup.api() as http:
                assert http.get("/api/v1/workers/bad-0").json()["state"] != "fatal"
        if why == "waiting_gpu":
            assert sup.find(event="worker.waiting_gpu", worker="bad-0")
        assert sup.stop() == 0


def test_a_reload_rejected_during_start_up_does_not_say_ready(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The defect: a reload rejected (its placement impossible) while the workers were still
    loading sent READY=1 at once: systemd took the service as up with none ready."""
    path = tmp_path / "systemd.sock"
    sim = {"backend": "sim", "sim_dir": str(tmp_path / "sim")}  # two GPUs
    slow = {"name": "a", "command": worker_cmd("notify_ready_late", "2.0")}
    with service_manager(path) as manager:
        sup = supervisor({"gpu": sim, "workers": [slow]}, env={"NOTIFY_SOCKET": str(path)})
        sup.wait_event(event="worker.state", worker="a-0", new="starting")
        sup.write_config(
            {
                "gpu": sim,
                "workers": [
                    slow,
                    {
                        "name": "big",
                        "command": worker_cmd("ready_then_sleep"),
                        "replicas": 5,
                        "max_workers_per_gpu": 1,
                    },
                ],
            }
        )
        sup.signal(signal.SIGHUP)
        sup.wait_event(event="supervisor.reload_rejected", reason="placement")
        sup.wait_event(event="supervisor.ready", timeout=20)
        got = drain(manager)
        assert any("RELOADING=1" in m and "MONOTONIC_USEC=" in m for m in got), got
        readies = [m for m in got if "READY=1" in m]
        assert len(readies) == 1 and "STATUS=1/1 ready" in readies[0], got
        assert sup.stop() == 0


def test_ready_follows_reloading_once_the_file_is_in_force(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """SIGHUP: RELOADING=1, then READY=1 once the new file is accepted, while its roll-out
    goes on (stable_s 30 here). Regression: READY=1 came at the end of the roll-out, so
    systemd showed the unit "reloading" for minutes, held a second `systemctl reload` back
    until then (no newer file could supersede the roll-out) and timed long ones out."""
    path = tmp_path / "systemd.sock"
    group = {
        "name": "a",
        "replicas": 2,
        "command": worker_cmd("ready_then_sleep"),
        "restart": {"stable_s": 30},
    }
    with service_manager(path) as manager:
        sup = supervisor({"workers": [group]}, env={"NOTIFY_SOCKET": str(path)})
        sup.ready("a-0")
        sup.ready("a-1")
        manager.wait_for("READY=1")
        mark = sup.mark()
        sup.write_config({"workers": [{**group, "env": {"V": "2"}}]})
        sup.signal(signal.SIGHUP)
        assert "MONOTONIC_USEC=" in manager.wait_for("RELOADING=1")
        assert "STATUS=" in manager.wait_for("READY=1", count=2)
        # the roll-out goes on: each replaced worker must stay ready for 30 s
        assert not sup.find(event="supervisor.reload_done", after=mark)
        assert sup.stop() == 0


def test_a_watchdog_abort_leaves_every_thread_s_stack(supervisor: SupervisorFactory) -> None:
    """systemd's watchdog ends a wedged supervisor with SIGABRT: where it was stuck must be in
    the journal (faulthandler), not nothing."""
    sup = supervisor({"workers": [{"name": "a", "command": worker_cmd("ready_then_sleep")}]})
    sup.ready("a-0")
    sup.signal(signal.SIGABRT)
    # (the dump of the other threads, taken while they run, is best effort: it can itself end
    # in a SIGSEGV, after what it wrote so far)
    assert sup.wait_exit() in (-signal.SIGABRT, -signal.SIGSEGV)
    text = "\n".join(sup.raw_stderr)
    assert "Fatal Python error: Aborted" in text, text[-2000:]


def slow_orphan(tmp_path: Path) -> tuple[int, Path, Path]:
    """A process recorded in ``tmp_path/state/state.json`` as worker a-0's of an earlier run
    (not our child): on SIGTERM it touches the returned ``termed`` path, then exits once the
    returned ``release`` path exists (20 s at most), so the start-up reclaim waits for it
    until then. (It took 0.3 s once: a test lagging that long under load signalled a
    supervisor whose start-up was over.)"""
    termed, release = tmp_path / "termed", tmp_path / "release"
    script = tmp_path / "orphan.py"
    script.write_text(
        "import os, pathlib, signal, time\n"
        "def on_term(*_):\n"
        f"    pathlib.Path({str(termed)!r}).touch()\n"
        "    deadline = time.monotonic() + 20\n"
        f"    while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print(os.getpid(), flush=True); os.close(1); os.close(2); time.sleep(20)\n"
    )
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} {script} &"], capture_output=True, text=True, check=True
    )
    pid = int(out.stdout)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    record = {"name": "a-0", "pid": pid, "pid_create_time": psutil.Process(pid).create_time()}
    (state_dir / "state.json").write_text(json.dumps({"schema_version": 1, "workers": [record]}))
    return pid, termed, release


def test_a_stop_during_start_up_is_not_followed_by_ready(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: with ``systemd_ready = "start"``, a SIGTERM during start-up (here while the
    reclaim waits for a predecessor's orphan) sent STOPPING=1, and then the start-up went on
    to send READY=1 (and log supervisor.ready): systemd took a service that was stopping for
    one that had just started."""
    orphan, termed, release = slow_orphan(tmp_path)
    path = tmp_path / "systemd.sock"
    try:
        with service_manager(path) as manager:
            sup = supervisor(
                {
                    "supervisor": {"systemd_ready": "start"},
                    "workers": [{"name": "a", "command": worker_cmd("ready_then_sleep")}],
                },
                env={"NOTIFY_SOCKET": str(path)},
            )
            sup.wait_until(termed.exists, what="the reclaim's SIGTERM to the orphan")
            sup.signal(signal.SIGTERM)
            stopping = manager.wait_for("STOPPING=1")
            release.touch()  # the reclaim's wait ends: the start-up would go on from here
            assert sup.wait_exit() == 0
            got = drain(manager)
            after = got[got.index(stopping) + 1 :]
            assert not [m for m in after if "READY=1" in m], got
            assert not sup.find(event="supervisor.ready")
    finally:
        with contextlib.suppress(psutil.Error):
            psutil.Process(orphan).kill()


def test_a_stop_while_a_reload_reads_its_file_applies_nothing(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: a SIGTERM that came while a SIGHUP's reload was reading its file (a slow
    disk, NFS; here a FIFO whose writer comes later) let the reload go on once the file was
    read: RELOADING=1 and READY=1 after STOPPING=1 (systemd took a stopping service for a
    reloaded one), and the new file's groups started while the supervisor stopped."""
    path = tmp_path / "systemd.sock"
    stubborn = {"name": "a", "command": worker_cmd("ignore_sigterm"), "stop_timeout_s": 2}
    with service_manager(path) as manager:
        sup = supervisor({"workers": [stubborn]}, env={"NOTIFY_SOCKET": str(path)})
        sup.ready("a-0")
        manager.wait_for("READY=1")
        sup.write_config({"workers": [stubborn, {"name": "b", "command": ["true"]}]})
        content = sup.config_path.read_bytes()
        sup.config_path.unlink()
        os.mkfifo(sup.config_path)
        sup.signal(signal.SIGHUP)

        def reader_waits() -> int | None:
            # a writer's open succeeds once the reload's open waits for one
            with contextlib.suppress(OSError):
                return os.open(sup.config_path, os.O_WRONLY | os.O_NONBLOCK)
            return None

        writer = sup.wait_until(reader_waits, "the reload reading the config file")
        sup.signal(signal.SIGTERM)
        stopping = manager.wait_for("STOPPING=1")
        with os.fdopen(writer, "wb") as fh:  # the file is read now, during the stop
            fh.write(content)
        assert sup.wait_exit() == 0
        got = drain(manager)
        after = got[got.index(stopping) + 1 :]
        assert not [m for m in after if "RELOADING=1" in m or "READY=1" in m], got
        assert not sup.find(event="worker.spawned", worker="b-0")
        assert sup.find(event="supervisor.reload_rejected", reason="stopping")


@pytest.mark.parametrize("late", ["library", "driver"])
def test_status_says_the_gpus_once_nvml_answers_after_the_start(
    supervisor: SupervisorFactory, tmp_path: Path, fake_nvml_libdir: Path, late: str
) -> None:
    """NVML does not answer at the start (``library``: no library yet, the driver installed
    late, under ``backend = "nvml"``; ``driver``: the library is there but the driver is not
    loaded yet, under ``backend = "auto"``), then does. Regression: ``STATUS=`` said "no GPU
    telemetry" for as long as no worker changed state (hours on a quiet machine), though the
    GPUs were read again: it was only sent on a worker's change, never when the GPUs seen
    changed. Regression (``driver``): auto fell back to no telemetry for good, so the GPUs
    never came."""
    path = tmp_path / "systemd.sock"
    libdir = tmp_path / "lib"
    libdir.mkdir()
    world = tmp_path / "sim"
    SimBackend(world, 2).open()
    if late == "driver":
        shutil.copy(fake_nvml_libdir / "libnvidia-ml.so.1", libdir / "libnvidia-ml.so.1")
        (world / "init_rc").write_text("9\n")  # NVML_ERROR_DRIVER_NOT_LOADED
    cfg = {
        "supervisor": {"sample_interval_s": 0.1},
        "gpu": {"backend": "nvml" if late == "library" else "auto"},
        "workers": [{"name": "g", "gpus": "none", "command": worker_cmd("ready_then_sleep")}],
    }
    env = {
        "NOTIFY_SOCKET": str(path),
        "LD_LIBRARY_PATH": str(libdir),
        "GPU_SUPERVISOR_SIM_DIR": str(world),
    }
    with service_manager(path) as manager:
        sup = supervisor(cfg, env=env)
        assert "STATUS=1/1 ready, 0 fatal, no GPU telemetry" in manager.wait_for("READY=1")
        if late == "library":
            shutil.copy(fake_nvml_libdir / "libnvidia-ml.so.1", libdir / "libnvidia-ml.so.1")
        else:
            (world / "init_rc").unlink()
        sup.wait_event(event="gpu.backend", timeout=15)
        assert manager.wait_for("STATUS=1/1 ready, 0 fatal, 2 GPUs", timeout=5)
        assert sup.stop() == 0


def test_status_says_no_gpu_telemetry_while_nvml_is_down(
    supervisor: SupervisorFactory, tmp_path: Path, fake_nvml_libdir: Path
) -> None:
    """NVML answers at the start, then stops answering (a driver reload: UNINITIALIZED).
    Regression: ``STATUS=`` went on saying "2 GPUs" for as long as NVML was down (the GPUs
    once seen were counted), while ``nvml_up`` was 0 and the API said no telemetry; only a
    supervisor that started without NVML said "no GPU telemetry"."""
    path = tmp_path / "systemd.sock"
    world = tmp_path / "sim"
    SimBackend(world, 2).open()
    cfg = {
        "supervisor": {"sample_interval_s": 0.1},
        "gpu": {"backend": "nvml"},
        "workers": [{"name": "g", "gpus": "none", "command": worker_cmd("ready_then_sleep")}],
    }
    env = {
        "NOTIFY_SOCKET": str(path),
        "LD_LIBRARY_PATH": str(fake_nvml_libdir),
        "GPU_SUPERVISOR_SIM_DIR": str(world),
    }
    gpu0 = (world / "gpus" / "0").read_text()
    with service_manager(path) as manager:
        sup = supervisor(cfg, env=env)
        assert "STATUS=1/1 ready, 0 fatal, 2 GPUs" in manager.wait_for("READY=1")
        (world / "gpus" / "0").write_text(gpu0 + "rc_nvmlDeviceGetMemoryInfo 1\n")
        sup.wait_event(event="gpu.unavailable")
        assert manager.wait_for("STATUS=1/1 ready, 0 fatal, no GPU telemetry", timeout=5)
        assert sup.stop() == 0
