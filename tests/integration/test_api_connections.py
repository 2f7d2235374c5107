"""Idle and slow API clients cannot use up the supervisor's descriptors (real supervisor).

Regression: clients that opened thousands of connections to the API and sent a partial request
now and then took the supervisor to its open-files limit: crashed workers could not be
restarted (``spawn_failed: Too many open files``), /healthz timed out, and asyncio printed a
plain-text traceback for every failed ``accept()``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest

from tests.conftest import SupervisorFactory
from tests.harness import worker_cmd

#: The supervisor runs with this open-files limit (soft and hard): the API may then hold an
#: eighth of it, 64 connections.
FILES = 512
API_LIMIT = FILES // 8
#: Idle connections the test opens: more than the supervisor could hold without the limit.
IDLE = 700
#: ... and keeps open while it checks /healthz and a restart.
FLOOD = 300

T = TypeVar("T")


def with_files_limit(limit: int) -> list[str]:
    """An argv prefix that runs the rest with RLIMIT_NOFILE ``limit`` (soft and hard)."""
    code = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", code]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def eventually(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``check`` until it returns something other than None (or fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s: {what}")
        time.sleep(0.02)


def still_open(sock: socket.socket) -> bool:
    """The server has not closed ``sock`` (nothing, not even EOF, to read)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:  # reset by the server
        return False


@contextlib.contextmanager
def flooding(host: str, port: int) -> Iterator[None]:
    """A thread that opens idle connections as fast as it can during the block (keeping the
    last ``FLOOD`` of them open)."""
    stop = threading.Event()
    opened: collections.deque[socket.socket] = collections.deque()

    def flood() -> None:
        while not stop.is_set():
            try:
                opened.append(socket.create_connection((host, port), timeout=2))
            except OSError:
                continue
            if len(opened) > FLOOD:
                opened.popleft().close()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        for sock in opened:
            sock.close()


@contextlib.contextmanager
def own_files_limit(wanted: int) -> Iterator[None]:
    """Raise this process's soft open-files limit to ``wanted`` for the block (where allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_cannot_use_up_descriptors(supervisor: SupervisorFactory) -> None:
    """Far more idle connections than the supervisor has descriptors: it holds at most its
    limit of them, /healthz answers, a crashed worker is restarted, stderr stays JSON."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < IDLE + FLOOD + 256:
        pytest.skip(f"the test opens {IDLE + FLOOD} connections; its open-files limit is {hard}")
    sup = supervisor(
        {
            "gpu": {"backend": "none"},
            "workers": [
                {"name": "c", "command": worker_cmd("ready_then_sleep"), "stop_timeout_s": 2}
            ],
        },
        prefix=with_files_limit(FILES),
    )
    first = sup.ready("c-0")
    url = sup.api_url()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/healthz").status_code == 200
    baseline = open_fds(sup.pid)

    idle: list[socket.socket] = []
    with own_files_limit(IDLE + FLOOD + 256):
        try:
            for i in range(IDLE):
                sock = socket.create_connection((host, int(port)), timeout=10)
                sock.settimeout(None)  # blocking: still_open() peeks with MSG_DONTWAIT
                if i % 2:  # half of them start a request and never finish it (slowloris)
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                idle.append(sock)

            with flooding(host, int(port)):
                # a well-behaved client (a liveness probe) still gets its answer, on a new
                # connection each time, while more idle connections keep coming
                for _ in range(5):
                    with httpx.Client(base_url=url, timeout=5) as http:
                        health = http.get("/healthz")
                        assert health.status_code == 200, health.text
                        assert health.json()["status"] == "ok"

                # and a crash is still recovered from
                mark = sup.mark()
                os.kill(first["pid"], signal.SIGKILL)
                sup.wait_event(event="worker.spawned", worker="c-0", after=mark)
                sup.ready("c-0", after=mark)
                assert not sup.find(event="worker.spawn_failed")

            # the supervisor holds no more than its limit of them
            bound = baseline + API_LIMIT + 4  # a state file or /proc read open meanwhile
            eventually(
                lambda: True if open_fds(sup.pid) <= bound else None,
                5,
                f"the supervisor's descriptors back to at most {bound}",
            )
            assert sum(still_open(s) for s in idle) <= API_LIMIT
        finally:
            for sock in idle:
                sock.close()

    shed = sup.find(event="api.connections_shed", reason="evicted")
    assert shed and shed[0]["limit"] == API_LIMIT and shed[0]["level"] == "warning"
    assert not sup.raw_stderr, sup.raw_stderr[:5]  # no plain-text tracebacks
    assert sup.stop() == 0
