"""The log stream's reader goes away (``2>fifo``, ``| tee``, a log shim that dies): the real
supervisor keeps supervising, and stops cleanly on SIGTERM.

The supervisor is started here rather than by the harness: its stderr is a pipe that the test
reads, then closes. Every wait is on a condition with a deadline: a log line (``select``), a
datagram from a worker (a socket timeout), the supervisor's exit (``Popen.wait``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from supervisor.logs import RECOVERED_EVENT
from tests import tomlw
from tests.conftest import SupervisorFactory
from tests.harness import ROOT

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)

#: A worker that reports to the test over a datagram socket: ``start <pid> <SigIgn line>``
#: once it runs, ``term <pid>`` when it gets SIGTERM (then exits 0).
WORKER = """\
import os, signal, socket, sys

address = "\\0" + sys.argv[1][1:]
ignored = sys.argv[2] if len(sys.argv) > 2 else ""
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)


def send(text):
    sock.sendto(f"{text} {os.getpid()} {ignored}".encode(), address)


def on_term(signum, frame):
    send("term")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
send("start")
print("started", flush=True)  # passed through (log_passthrough) to the supervisor's stdout
while True:
    signal.pause()
"""

#: The worker's command: a shell reports the signals it was started with ignored (Python would
#: ignore SIGPIPE itself), then runs the Python worker.
SHELL = 'exec "$0" "$@" "$(grep ^SigIgn: /proc/self/status)"'


class Reports:
    """The test's end of the workers' datagram socket (abstract namespace: no path length)."""

    def __init__(self) -> None:
        self.name = f"@gpu-supervisor-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])

    def next(
        self, kind: str, proc: subprocess.Popen[bytes], timeout: float = 15.0
    ) -> tuple[int, str]:
        """``(pid, sigign)`` of the next report of ``kind`` (others are skipped); fails at once
        if the supervisor ``proc`` exits first (its pidfd becomes readable)."""
        deadline = time.monotonic() + timeout
        # not reaped yet (a zombie at worst): its pid is still its own
        pidfd = os.pidfd_open(proc.pid) if proc.returncode is None else None
        watched: list[Any] = [self.sock] if pidfd is None else [self.sock, pidfd]
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no {kind!r} report from a worker within {timeout}s")
                ready, _, _ = select.select(watched, [], [], remaining)
                if self.sock in ready:
                    what, pid, *rest = self.sock.recv(4096).decode().split(maxsplit=2)
                    if what == kind:
                        return int(pid), " ".join(rest)
                elif ready:
                    raise AssertionError(
                        f"the supervisor exited with {proc.wait()} before a {kind!r} report"
                    )
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def reports() -> Iterator[Reports]:
    r = Reports()
    yield r
    r.close()


def read_events(fd: int, want: set[str], timeout: float = 20.0) -> dict[str, dict[str, Any]]:
    """Read JSON log lines from ``fd`` until an event of each name in ``want`` was seen."""
    deadline = time.monotonic() + timeout
    seen: dict[str, dict[str, Any]] = {}
    pending = b""
    while not want <= seen.keys():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {sorted(want - seen.keys())} in the log within {timeout}s")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(f"the supervisor closed its stderr; seen {sorted(seen)}")
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                seen.setdefault(event.get("event"), event)
    return seen


def ignored(text: str, sig: int) -> bool:
    """Whether the ``SigIgn:`` mask (of /proc/<pid>/status) in ``text`` has ``sig`` in it."""
    mask = int(text.split("SigIgn:", 1)[1].split()[0], 16)
    return bool(mask & (1 << (sig - 1)))


def sigpipe_ignored(text: str) -> bool:
    """Whether the ``SigIgn:`` mask (of /proc/<pid>/status) in ``text`` has SIGPIPE in it."""
    return ignored(text, signal.SIGPIPE)


def end_all(proc: subprocess.Popen[bytes], pids: list[int]) -> None:
    """What a test that failed midway left: the supervisor's session, then the workers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def start_logging_to_a_pipe(
    tmp_path: Path,
    reports: Reports,
    stdout_too: bool,
    restart: dict[str, Any],
    pipe_size: int | None,
) -> tuple[subprocess.Popen[bytes], int]:
    """The supervisor (one reporting worker ``w``, restarted at once) with its stderr, and with
    ``stdout_too`` its stdout (the worker's output passed through), into a pipe; ``(process,
    the pipe's read end)``. The test reads the pipe, or not."""
    script = tmp_path / "report_worker.py"
    script.write_text(WORKER)
    config = {
        "supervisor": {"state_dir": str(tmp_path / "state")},
        "api": {"listen": "127.0.0.1:0"},
        "workers": [
            {
                "name": "w",
                "command": ["/bin/sh", "-c", SHELL, sys.executable, str(script), reports.name],
                "ready": "none",
                "log_passthrough": stdout_too,
                "restart": {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, **restart},
            }
        ],
    }
    config_path = tmp_path / "config.toml"
    config_path.write_text(tomlw.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    argv = [sys.executable, "-m", "supervisor", "run", "-c", str(config_path)]
    r, w = os.pipe()
    if pipe_size is not None:
        fcntl.fcntl(w, F_SETPIPE_SZ, pipe_size)
    proc = subprocess.Popen(
        [*argv, "--log-format", "json", "--log-level", "info"],
        stdin=subprocess.DEVNULL,
        stdout=w if stdout_too else subprocess.DEVNULL,
        stderr=w,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    os.close(w)
    return proc, r


@pytest.mark.parametrize("stdout_too", [False, True], ids=["stderr", "stderr+stdout"])
def test_supervision_goes_on_when_the_log_reader_goes_away(
    tmp_path: Path, reports: Reports, stdout_too: bool
) -> None:
    """stderr's reader is gone: a worker crash (logged: EPIPE) is still handled (the worker is
    restarted), the API still answers, and SIGTERM still stops the worker with SIGTERM and the
    supervisor with exit 0. Before: the first log line after the reader left ended the
    supervisor (exit 141), and its workers were SIGKILLed by PDEATHSIG. ``stdout_too``: the
    workers' passthrough output went to the same pipe (``2>&1 | tee``); what was left in
    stdout's buffer made the exit code 1."""
    proc, r = start_logging_to_a_pipe(
        tmp_path, reports, stdout_too, {"stable_s": 0.1}, pipe_size=None
    )
    pids: list[int] = []
    try:
        try:
            seen = read_events(r, {"supervisor.start", "api.listening"})
        finally:
            os.close(r)  # the reader goes away
        url = str(seen["api.listening"]["url"])
        first, sigign = reports.next("start", proc)
        pids.append(first)
        assert not sigpipe_ignored(sigign), f"the worker was started with SIGPIPE ignored: {sigign}"

        with httpx.Client(base_url=url, timeout=10) as api:
            assert api.get("/api/v1/workers/w-0").json()["pid"] == first
            os.kill(first, signal.SIGKILL)  # a crash: logged (EPIPE), then a restart
            second, _ = reports.next("start", proc)
            pids.append(second)
            assert second != first
            assert proc.poll() is None, f"the supervisor exited with {proc.returncode}"
            assert api.get("/api/v1/workers/w-0").json()["pid"] == second
            assert api.get("/healthz").status_code == 200

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        stopped, _ = reports.next("term", proc)
        assert stopped == second
        state = json.loads((tmp_path / "state" / "state.json").read_text())
        assert state, "state.json was written"
    finally:
        end_all(proc, pids)


def test_worker_starts_with_no_signal_ignored(supervisor: SupervisorFactory) -> None:
    """Python ignores SIGPIPE in the supervisor (a write to a closed pipe raises EPIPE there);
    an ignored signal survives exec, so a worker must get SIGPIPE back at SIG_DFL (``Popen``'s
    ``restore_signals``), or ``worker | head`` inside it would never end its writer. So too
    the signals the supervisor was started with ignored (`nohup`, a shell's background job):
    regression: its workers ignored SIGQUIT (nginx's graceful stop, as a drain_signal) too."""
    inherited = (signal.SIGQUIT, signal.SIGUSR1, signal.SIGHUP)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in inherited}
    try:
        sup = supervisor(
            {
                "workers": [
                    {
                        "name": "s",
                        # "mask" first: a bare mask of digits (0000000000000004) after the name
                        # reads as a pid to the harness, which then finds pid 4 "outlived" it
                        "command": [
                            "/bin/sh",
                            "-c",
                            'echo "mask $(grep ^SigIgn: /proc/self/status)"; exec sleep 600',
                        ],
                        "ready": "none",
                        "log_passthrough": True,
                    }
                ]
            }
        )
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    line = sup.wait_line("[s-0]", contains="SigIgn:")
    assert not sigpipe_ignored(line), line
    for sig in inherited:
        assert not ignored(line, sig), (sig.name, line)
    said = sup.wait_event(event="supervisor.signals_ignored")
    assert {"SIGQUIT", "SIGUSR1", "SIGHUP"} <= set(said["signals"]), said
    # SIGHUP is the supervisor's own all the same (a reload; `nohup` only wants it to survive
    # a hangup): the log said it stayed ignored (regression), it says it is handled
    assert said["handled"] == ["SIGHUP"], said
    mark = sup.mark()
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="supervisor.reload", after=mark)
    assert sup.stop() == 0


def test_signals_blocked_when_the_supervisor_started_are_unblocked(
    supervisor: SupervisorFactory,
) -> None:
    """Regression: a supervisor started with signals blocked (a launcher that blocked them and
    did not restore its mask before exec) kept them blocked, and a blocked signal mask
    survives fork and exec: with SIGCHLD blocked the reaper never ran, so a crashed worker was
    never noticed nor restarted, and every worker started with SIGUSR1 (a drain_signal) and
    SIGCHLD blocked. Now the supervisor unblocks them at start (but those it holds until its
    handlers are in place) and says so; its workers start with nothing blocked."""
    blocked = ("SIGCHLD", "SIGUSR1", "SIGALRM", "SIGTERM")
    block = (
        "import os, signal, sys\n"
        f"signal.pthread_sigmask(signal.SIG_BLOCK, [getattr(signal, s) for s in {blocked!r}])\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n"
    )
    sup = supervisor(
        {
            "workers": [
                {
                    "name": "b",
                    # "mask" first: see test_worker_starts_with_no_signal_ignored
                    "command": [
                        "/bin/sh",
                        "-c",
                        'echo "mask $(grep ^SigBlk: /proc/self/status)"; exec sleep 600',
                    ],
                    "ready": "none",
                    "log_passthrough": True,
                    "restart": {"stable_s": 0},
                }
            ]
        },
        prefix=[sys.executable, "-c", block],
    )
    line = sup.wait_line("[b-0]", contains="SigBlk:")
    assert line.split()[-1] == "0000000000000000", line
    said = sup.wait_event(event="supervisor.signals_unblocked")
    assert set(said["signals"]) == {"SIGCHLD", "SIGUSR1", "SIGALRM"}, said
    pid = sup.ready("b-0")["pid"]
    mark = sup.mark()
    os.kill(pid, signal.SIGKILL)
    assert sup.wait_event(event="worker.exited", after=mark, timeout=5)["pid"] == pid
    sup.wait_event(event="worker.spawned", worker="b-0", after=mark)
    assert sup.stop() == 0


@pytest.mark.parametrize("stdout_too", [False, True], ids=["stderr", "stderr+stdout"])
def test_supervision_goes_on_when_the_log_reader_stops_reading(
    tmp_path: Path, reports: Reports, stdout_too: bool
) -> None:
    """stderr's reader is there but reads nothing (a paused terminal, a stopped ``| grep``, a
    hung log shim): crashes are still handled and the API answers; once it reads again, the log
    says how many lines it lost. Before: the first line that found the pipe full blocked the
    supervisor in write() until the reader read again (no restart, /healthz timing out)."""
    # a pipe of one page: a few log lines fill it
    proc, r = start_logging_to_a_pipe(tmp_path, reports, stdout_too, {"burst": 100}, 4096)
    pids: list[int] = []
    try:
        seen = read_events(r, {"supervisor.start", "api.listening"})
        url = str(seen["api.listening"]["url"])
        pid, _ = reports.next("start", proc)
        pids.append(pid)
        with httpx.Client(base_url=url, timeout=10) as api:
            for _ in range(6):  # each crash logs ~1 kB: the pipe is full after a few
                os.kill(pid, signal.SIGKILL)
                pid, _ = reports.next("start", proc)
                pids.append(pid)
                assert api.get("/healthz").status_code == 200
            assert api.get("/api/v1/workers/w-0").json()["pid"] == pid
            while select.select([r], [], [], 0)[0]:  # the reader reads again: all there is
                os.read(r, 65536)
            os.kill(pid, signal.SIGKILL)  # logs again, now that there is room
            back = read_events(r, {RECOVERED_EVENT})[RECOVERED_EVENT]
            assert back["dropped"] > 0 and back["errno"] in ("EAGAIN", "EWOULDBLOCK"), back
            pids.append(reports.next("start", proc)[0])
        proc.send_signal(signal.SIGTERM)
        read_events(r, {"supervisor.exit"})
        assert proc.wait(30) == 0
    finally:
        os.close(r)
        end_all(proc, pids)


@pytest.mark.parametrize("faulthandler_on", [True, False])
def test_a_fault_signal_started_ignored_still_ends_the_supervisor(faulthandler_on: bool) -> None:
    """A supervisor started with SIGSEGV (and SIGQUIT) ignored: SIGQUIT gets the do-nothing
    handler (its workers get the default), but a real segfault still ends it (faulthandler's
    report first, where it is on). Regression: the do-nothing handler replaced faulthandler's,
    and a segfault spun for ever (the faulting instruction ran again and again)."""
    code = (
        "import ctypes, faulthandler, sys\n"
        f"{'faulthandler.enable()' if faulthandler_on else ''}\n"
        "from supervisor.processes import pass_on_ignored_signals\n"
        "print(' '.join(pass_on_ignored_signals()), flush=True)\n"
        "ctypes.string_at(0)\n"
    )

    def ignore() -> None:
        signal.signal(signal.SIGSEGV, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)

    done = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=ignore,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        check=False,
    )
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-500:])
    assert "SIGQUIT" in done.stdout.split(), done.stdout
