"""Run a real supervisor in a child process and wait on what it logs and prints.

Nothing here sleeps to wait: every wait is on a condition variable that the reader threads
signal as lines arrive, with a deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.server
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests import tomlw

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"

Match = Mapping[str, Any]


def client(*args: str) -> subprocess.Popen[str]:
    """``gpu-supervisor ARGS`` (a client command) started in the background, its output
    piped (text): for a command that waits (``reload --wait``) while the test goes on."""
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def run_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``gpu-supervisor ARGS`` run to its end (30 s at most), its output captured (text)."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env=None if env is None else dict(env),
        check=False,
    )


def worker_cmd(script: str, *args: str) -> list[str]:
    """``[python, tests/workers/<script>.py, *args]``."""
    return [sys.executable, str(WORKERS / f"{script}.py"), *args]


def _matches(event: Mapping[str, Any], match: Match) -> bool:
    for key, want in match.items():
        have = event.get(key)
        if callable(want):
            if not want(have):
                return False
        elif have != want:
            return False
    return True


class Supervisor:
    """A ``gpu-supervisor run`` child process with its JSON log and stdout captured."""

    def __init__(
        self,
        tmp_path: Path,
        config: Mapping[str, Any],
        *,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        log_level: str = "info",
    ) -> None:
        self.tmp_path = tmp_path
        self.state_dir = tmp_path / "state"
        cfg = dict(config)
        sup = dict(cfg.get("supervisor", {}))
        sup.setdefault("state_dir", str(self.state_dir))
        cfg["supervisor"] = sup
        self.config_path = tmp_path / "config.toml"
        self.write_config(cfg)
        inherited = {
            k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
        }
        self.env = {**inherited, **(env or {})}
        self.prefix = list(prefix)
        self.log_level = log_level
        self.events: list[dict[str, Any]] = []
        self.stdout: list[str] = []
        self.raw_stderr: list[str] = []
        self.seen_pids: set[int] = set()
        self._cond = threading.Condition()
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []

    def write_config(self, config: Mapping[str, Any]) -> None:
        """(Re)write the config file."""
        cfg = dict(config)
        sup = dict(cfg.get("supervisor", {}))
        sup.setdefault("state_dir", str(self.state_dir))
        cfg["supervisor"] = sup
        # A free loopback port, so that tests in parallel never collide on 9811.
        cfg.setdefault("api", {"listen": "127.0.0.1:0"})
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(tomlw.dumps(cfg))
        os.replace(tmp, self.config_path)

    @property
    def pid(self) -> int:
        """The supervisor's pid."""
        assert self._proc is not None
        return self._proc.pid

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The supervisor process."""
        assert self._proc is not None
        return self._proc

    def start(self) -> Supervisor:
        """Launch the supervisor."""
        argv = [
            *self.prefix,
            sys.executable,
            "-m",
            "supervisor",
            "run",
            "-c",
            str(self.config_path),
        ]
        self._proc = subprocess.Popen(
            [*argv, "--log-format", "json", "--log-level", self.log_level],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=_stop_with_test_process,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        for stream, sink in (
            (self._proc.stdout, self._on_stdout),
            (self._proc.stderr, self._on_stderr),
        ):
            t = threading.Thread(target=self._read, args=(stream, sink), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _read(self, stream: Any, sink: Callable[[str], None]) -> None:
        for raw in stream:
            sink(raw.decode("utf-8", errors="replace").rstrip("\n"))
        with self._cond:
            self._cond.notify_all()

    def _on_stdout(self, line: str) -> None:
        with self._cond:
            self.stdout.append(line)
            parts = line.split()
            # worker lines look like "[name] name pid text" (log_passthrough); a worker in a
            # PID namespace of its own prints its pid there, which is not ours to watch or kill
            if len(parts) >= 3 and parts[2].isdigit() and not _not_a_test_pid(int(parts[2])):
                self.seen_pids.add(int(parts[2]))
            if "forked" in parts and parts[-1].isdigit() and not _not_a_test_pid(int(parts[-1])):
                self.seen_pids.add(int(parts[-1]))
            self._cond.notify_all()

    def _on_stderr(self, line: str) -> None:
        with self._cond:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                self.raw_stderr.append(line)
            else:
                if isinstance(event, dict):
                    self.events.append(event)
                    if event.get("event") == "worker.spawned" and isinstance(event.get("pid"), int):
                        self.seen_pids.add(event["pid"])
                else:
                    self.raw_stderr.append(line)
            self._cond.notify_all()

    def wait_until(
        self, check: Callable[[], Any], what: str, timeout: float = 10.0, every: float = 0.05
    ) -> Any:
        """Wait until ``check()`` holds for something outside the log (a file, a process):
        asked again every ``every`` s, or at once when the supervisor prints something."""
        return self._wait(check, timeout, what, every)

    def _wait(
        self, check: Callable[[], Any], timeout: float, what: str, every: float | None = None
    ) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                result = check()
                if result is not None and result is not False:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    tail = "\n".join(json.dumps(e) for e in self.events[-25:])
                    raise AssertionError(
                        f"timed out after {timeout}s waiting for {what}\nlast events:\n{tail}\n"
                        f"stdout tail: {self.stdout[-10:]}\nstderr: {self.raw_stderr[-10:]}"
                    )
                self._cond.wait(remaining if every is None else min(every, remaining))

    def wait_event(self, timeout: float = 10.0, after: int = 0, **match: Any) -> dict[str, Any]:
        """The first log event at position >= ``after`` whose fields match."""

        def check() -> dict[str, Any] | None:
            for event in self.events[after:]:
                if _matches(event, match):
                    return event
            return None

        result: dict[str, Any] = self._wait(check, timeout, f"event {match}")
        return result

    def wait_events(
        self, count: int, timeout: float = 10.0, after: int = 0, **match: Any
    ) -> list[dict[str, Any]]:
        """The first ``count`` matching events."""

        def check() -> list[dict[str, Any]] | None:
            found = [e for e in self.events[after:] if _matches(e, match)]
            return found[:count] if len(found) >= count else None

        result: list[dict[str, Any]] = self._wait(check, timeout, f"{count} x event {match}")
        return result

    def wait_line(
        self,
        prefix: str,
        timeout: float = 10.0,
        after: int = 0,
        *,
        contains: str = "",
        endswith: str = "",
    ) -> str:
        """The first stdout line (from position ``after``) with this prefix, infix and suffix."""

        def ok(line: str) -> bool:
            return line.startswith(prefix) and contains in line and line.endswith(endswith)

        def check() -> str | None:
            return next((line for line in self.stdout[after:] if ok(line)), None)

        text = f"{prefix}...{contains}...{endswith}"

        result: str = self._wait(check, timeout, f"stdout line with {text!r}")
        return result

    def mark(self) -> int:
        """The current event position (for ``after=``)."""
        with self._cond:
            return len(self.events)

    def find(self, after: int = 0, **match: Any) -> list[dict[str, Any]]:
        """Every event so far that matches (``after``: from that ``mark()`` on)."""
        with self._cond:
            return [e for e in self.events[after:] if _matches(e, match)]

    def ready(self, worker: str, timeout: float = 10.0, after: int = 0) -> dict[str, Any]:
        """Wait until ``worker`` becomes ready; return that event."""
        return self.wait_event(timeout, after, event="worker.state", worker=worker, new="ready")

    def api_url(self, timeout: float = 10.0) -> str:
        """The API's base URL, from the ``api.listening`` event (``http://...`` or ``unix:/...``)."""
        return str(self.wait_event(timeout, event="api.listening")["url"])

    def api(self, timeout: float = 10.0, token: str | None = None) -> httpx.Client:
        """An HTTP client for the API (close it, or use it in a ``with`` block)."""
        url = self.api_url(timeout)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url.startswith("unix:"):
            transport = httpx.HTTPTransport(uds=url[len("unix:") :])
            return httpx.Client(
                base_url="http://localhost", transport=transport, headers=headers, timeout=10
            )
        return httpx.Client(base_url=url, headers=headers, timeout=10)

    def wait_api(
        self, path: str, check: Callable[[Any], bool], timeout: float = 10.0, every: float = 0.05
    ) -> Any:
        """GET ``path`` until ``check(json)`` holds (asking again every ``every`` s, or at once
        when the supervisor prints something); return that JSON."""
        deadline = time.monotonic() + timeout
        last: Any = None
        with self.api() as api:
            while True:
                last = api.get(path).json()
                if check(last):
                    return last
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out after {timeout}s: GET {path} -> {last}")
                with self._cond:
                    self._cond.wait(min(every, remaining))

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the supervisor."""
        self.proc.send_signal(sig)

    def reload_rejected(self, config: Mapping[str, Any] | str) -> dict[str, Any]:
        """Reload with ``config`` (SIGHUP; a string: the file's text as it is), which must be
        rejected with nothing stopped; returns the ``supervisor.reload_rejected`` event."""
        mark = self.mark()
        if isinstance(config, str):
            self.config_path.write_text(config)
        else:
            self.write_config(config)
        self.signal(signal.SIGHUP)
        rejected = self.wait_event(event="supervisor.reload_rejected", after=mark)
        assert not self.find(event="worker.state", new="stopping", after=mark)
        return rejected

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the supervisor to exit; return its code."""
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(timeout)
        return code

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (once the supervisor has its signal handlers) and wait."""
        if self.proc.poll() is None:
            self.wait_event(event="supervisor.start")
            self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def close(self) -> list[int]:
        """Kill whatever is left; return the pids seen that were still alive (should be none)."""
        if self._proc is None:
            return []
        if self._proc.poll() is None:
            # a test that failed midway: a clean stop first, so what it started ends too
            self._proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(15)
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)
        for t in self._threads:
            t.join(5)
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()
        survivors = []
        procs = []
        for pid in self.seen_pids:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    procs.append(p)
        alive = _wait_dead(procs, timeout=3)
        for p in alive:
            survivors.append(p.pid)
            with contextlib.suppress(psutil.Error):
                p.kill()
        return survivors


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_dead(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each of ``procs`` has exited; return those still alive after ``timeout``.
    A zombie counts as exited: a worker orphaned by a SIGKILLed supervisor is re-parented to
    PID 1, which may take its time to reap it (a second or two in some containers)."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _dead(p)]
    while alive and time.monotonic() < deadline:
        _, alive = psutil.wait_procs(alive, timeout=min(0.05, deadline - time.monotonic()))
        alive = [p for p in alive if not _dead(p)]
    return alive


PR_SET_PDEATHSIG = 1


def _stop_with_test_process() -> None:
    """In the supervisor's child before exec: SIGTERM when the test process (its thread that
    started it) ends, so a pytest killed from outside (``timeout``, a CI runner's cancel), whose
    fixtures never run, leaves no supervisor running (it stops its workers as at any SIGTERM).
    Supervisors are started from the test's own thread, which lives as long as the run."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _not_a_test_pid(pid: int) -> bool:
    """True for pid 1: a worker in a PID namespace of its own prints that pid (its own there),
    and our init is never a test's process to watch or kill."""
    return pid <= 1


def another_user(why: str) -> pwd.struct_passwd:
    """``nobody``'s entry, for a test that needs a process or file of another user than the
    suite's (root): skipped, saying ``why``, where the suite is not root or there is none."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: {why}")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine's user database has no 'nobody'")


def mount_tmpfs(target: Path, options: str) -> None:
    """Mount a tmpfs with ``options`` on ``target`` (an existing directory; unmount it with
    ``umount -l``), or skip where this machine does not let the suite."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")


def rebound_once_removed(sup: Supervisor, socket: Path, worker: str) -> None:
    """Remove the private directory of ``sup``'s notify socket ``socket`` (as a
    temporary-file cleaner does), wait until it is made again (0700) with the socket bound in
    it, and see ``worker`` restarted become ready through it."""
    mark = sup.mark()
    shutil.rmtree(socket.parent)
    sup.wait_event(5, mark, event="notify.rebound")
    assert stat.S_IMODE(socket.parent.stat().st_mode) == 0o700
    with sup.api() as http:
        assert http.post(f"/api/v1/workers/{worker}/restart").status_code == 202
    sup.ready(worker, after=mark)


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(pids: Sequence[int], timeout: float = 5.0) -> list[int]:
    """Wait until every pid is gone; return those still alive at the deadline."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return [p.pid for p in _wait_dead(procs, timeout)]


FREEZER_V1 = Path("/sys/fs/cgroup/freezer")


@contextlib.contextmanager
def stuck(pid: int, name: str) -> Iterator[None]:
    """Hold ``pid`` in a frozen cgroup v1 freezer cgroup: a SIGKILL stays pending (the process
    stays alive, holding its GPU memory) until it is thawed, as for a GPU process stuck in the
    kernel (D state) after an XID. Thawed (and its cgroup removed) on the way out."""
    if not (FREEZER_V1 / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 freezer here to make a process that SIGKILL cannot end")
    frozen = FREEZER_V1 / name
    frozen.mkdir()
    try:
        (frozen / "cgroup.procs").write_text(str(pid))
        (frozen / "freezer.state").write_text("FROZEN")
        yield
    finally:
        (frozen / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 10
        while left := (frozen / "cgroup.procs").read_text().split():
            # a thawed process with a pending SIGKILL is on its way out: until it is gone,
            # it is still listed here (and cannot be moved)
            for member in left:
                with contextlib.suppress(OSError):
                    (FREEZER_V1 / "cgroup.procs").write_text(member)
            assert time.monotonic() < deadline, f"{frozen} still holds {left}"
            os.sched_yield()
        frozen.rmdir()


def sampled_in_tree(sup: Supervisor, worker: str, pid: int) -> dict[str, Any]:
    """Wait for a ``gpu.sample`` (log level debug) that has ``pid`` in ``worker``'s tree."""
    return sup.wait_event(
        event="gpu.sample",
        workers=lambda w: isinstance(w, dict) and pid in w.get(worker, {}).get("pids", []),
    )


@contextlib.contextmanager
def stuck_holder(sup: Supervisor, worker: str, tmp_path: Path) -> Iterator[int]:
    """The ``--holder`` child of ``worker`` (a ``gpu_user`` worker: it holds GPU memory of its
    own), once a sample saw it in the worker's tree, held :func:`stuck` (yielded: its pid):
    what the worker's restarts find still holding memory at the GPU-release barrier."""
    holder = int(sup.wait_line(f"[{worker}] ", endswith=" holder").split()[2])
    sampled_in_tree(sup, worker, holder)
    with stuck(holder, f"gpu-supervisor-test-{os.getpid()}-{tmp_path.name}"):
        yield holder


def crash_into_barrier(sup: Supervisor, worker: str, leader: int, after: int) -> None:
    """Kill ``worker``'s main process (its holder stuck: :func:`stuck_holder`) and wait until
    its restart waits at the GPU-release barrier (starting, no process yet)."""
    os.kill(leader, signal.SIGKILL)
    sup.wait_event(event="worker.killed_leftovers", worker=worker, after=after)
    sup.wait_event(event="worker.state", worker=worker, new="starting", pid=None, after=after)


def most_not_ready(states: Sequence[Mapping[str, Any]]) -> int:
    """The most workers out of ``ready`` at once in these ``worker.state`` events (counting
    only workers that were ready before: a roll-out or healing took them down)."""
    down: set[str] = set()
    worst = 0
    for e in states:
        if e["new"] == "ready":
            down.discard(e["worker"])
        elif e["old"] == "ready":
            down.add(e["worker"])
        worst = max(worst, len(down))
    return worst


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A throwaway HTTP server (threaded, on a free loopback port) answering with ``handler``:
    its base URL; shut down afterwards."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class Flood(http.server.BaseHTTPRequestHandler):
    """A 200 whose body never ends (a URL that streams: server-sent events, a download): 64 MiB
    of it as fast as it goes (the tests' own bound), then the connection held open a while."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        chunk = b"x" * 65536
        try:
            for _ in range(1024):
                self.wfile.write(chunk)
            self.wfile.flush()
            time.sleep(10)  # the server's pace, not a test waiting (its thread is a daemon)
        except OSError:
            return  # the prober gave up

    def log_message(self, format: str, *args: object) -> None:
        pass
