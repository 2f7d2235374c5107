"""The supervisor speaks sd_notify to its own service manager: READY=1, WATCHDOG=1, STATUS=."""

from __future__ import annotations

import socket
import time
from pathlib import Path

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
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
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
        manager = Manager(sock)
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
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
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
