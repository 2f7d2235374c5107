"""The in-use reporter that ``in_use_reporter = "torch"`` puts in front of a Python worker's
``sitecustomize`` (``supervisor/worker_site/sitecustomize.py``): what it reads, and, in real
interpreters started the way the supervisor starts workers, what it sends, from forked children
too, and that the ``sitecustomize`` it shadows still runs."""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from supervisor.plan import WORKER_SITE_DIR
from supervisor.worker_site import sitecustomize as site

FAKE_TORCH = str(Path(__file__).resolve().parents[1] / "fake_torch")
MIB = 1024 * 1024


def fake_torch(
    initialized: bool = True, allocated: tuple[int, ...] = (0,), importing: bool = False
) -> SimpleNamespace:
    def memory_allocated(device: int) -> int:
        return allocated[device]

    cuda = SimpleNamespace(
        is_initialized=lambda: initialized,
        device_count=lambda: len(allocated),
        memory_allocated=memory_allocated,
    )
    return SimpleNamespace(cuda=cuda, __spec__=SimpleNamespace(_initializing=importing))


def broken_torch() -> SimpleNamespace:
    def fail() -> bool:
        raise RuntimeError("CUDA driver gone")

    return SimpleNamespace(cuda=SimpleNamespace(is_initialized=fail))


@pytest.mark.parametrize(
    ("modules", "mb"),
    [
        ({}, None),  # torch not imported: nothing to say
        ({"torch": fake_torch(initialized=False)}, None),  # CUDA not initialised by the program
        ({"torch": fake_torch(importing=True)}, None),  # still being imported
        ({"torch": SimpleNamespace()}, None),  # a torch without torch.cuda
        ({"torch": broken_torch()}, None),
        ({"torch": fake_torch(allocated=(300 * MIB,))}, 300.0),
        ({"torch": fake_torch(allocated=(100 * MIB, 50 * MIB))}, 150.0),  # every device
        ({"torch": fake_torch(allocated=(0,))}, 0.0),
    ],
)
def test_what_torch_holds(modules: dict[str, Any], mb: float | None) -> None:
    assert site.in_use_mb(modules) == mb


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[socket.socket]:
    """A datagram socket standing in for the supervisor's notify socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify.sock"))
        sock.settimeout(10)
        yield sock


def test_a_report_is_the_lowest_reading_of_its_interval_sent_when_changed_or_due(
    listener: socket.socket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reporter = site.Reporter(str(tmp_path / "notify.sock"), 5.0)
    for mb in (1600, 1536, 1700):  # polls, one of them between batches
        monkeypatch.setitem(sys.modules, "torch", fake_torch(allocated=(mb * MIB,)))
        reporter.poll()
    assert reporter.flush(100.0)
    assert listener.recv(4096) == b"X_GPU_MEMORY_IN_USE_MB=1536.0"
    reporter.poll()  # 1700 again: changed, sent
    assert reporter.flush(105.0)
    assert listener.recv(4096) == b"X_GPU_MEMORY_IN_USE_MB=1700.0"
    reporter.poll()
    assert not reporter.flush(110.0)  # unchanged, 5 s after the last: not yet
    reporter.poll()
    assert reporter.flush(120.0)  # unchanged, 15 s: sent again (keeps it fresh)
    assert listener.recv(4096) == b"X_GPU_MEMORY_IN_USE_MB=1700.0"
    monkeypatch.delitem(sys.modules, "torch")
    reporter.poll()
    assert not reporter.flush(200.0)  # nothing read: nothing to say
    gone = site.Reporter(str(tmp_path / "gone.sock"), 5.0)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(allocated=(MIB,)))
    gone.poll()
    assert not gone.flush(0.0)  # no supervisor listening: no error, tried again next time
    gone.poll()
    assert gone.last_text is None


def test_a_full_notify_queue_never_holds_the_reporter(
    listener: socket.socket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor stalls and its socket's queue fills: the report is dropped (tried again
    next time). Regression: a blocking send held the reporter's thread until there was room."""
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    with filler, contextlib.suppress(BlockingIOError):
        for _ in range(100_000):
            filler.sendto(b"x" * 64, str(tmp_path / "notify.sock"))
    reporter = site.Reporter(str(tmp_path / "notify.sock"), 5.0)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(allocated=(MIB,)))
    reporter.poll()
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(reporter.flush(100.0)), daemon=True)
    thread.start()
    thread.join(5)
    assert done == [False]
    assert reporter.last_text is None


@pytest.mark.parametrize(
    ("text", "last", "last_at", "now", "send"),
    [
        ("X=1.0", None, float("-inf"), 0.0, True),  # the first
        ("X=1.1", "X=1.0", 100.0, 105.0, True),  # changed
        ("X=1.0", "X=1.0", 100.0, 105.0, False),
        ("X=1.0", "X=1.0", 100.0, 114.9, False),
        ("X=1.0", "X=1.0", 100.0, 115.0, True),  # three intervals: again
    ],
)
def test_should_send(text: str, last: str | None, last_at: float, now: float, send: bool) -> None:
    assert site.should_send(text, last, last_at, now, 5.0) is send


@pytest.mark.parametrize(
    ("value", "every"), [(None, 5.0), ("0.25", 0.25), ("0", 5.0), ("soon", 5.0), ("1e9", 5.0)]
)
def test_report_interval(value: str | None, every: float) -> None:
    assert site._every(value) == every


PROGRAM = textwrap.dedent(
    """
    import os, subprocess, sys, threading, time

    before = [t.name for t in threading.enumerate()]
    import torch  # tests/fake_torch

    after = [t.name for t in threading.enumerate()]
    torch.cuda.init()
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.cuda.set_allocated(0, mb * 2**20)
    if mb == 5:
        print("threads before torch", before, "after", after, flush=True)
        # a rank holding 7 MiB, spawned (a forked one could not use CUDA, as in PyTorch)
        subprocess.Popen([sys.executable, __file__, "7"])
        if os.fork() == 0:  # a forked child: holds 9 MiB in vain
            torch.cuda.set_allocated(0, 9 * 2**20)
    while True:
        time.sleep(0.05)
    """
)


def test_a_python_worker_reports_from_every_process_and_the_shadowed_sitecustomize_runs(
    listener: socket.socket, tmp_path: Path
) -> None:
    """The reporter starts with the program's ``import torch`` (no thread before), reports from
    a spawned rank too, not from a forked child, and the user's own sitecustomize still runs."""
    usersite = tmp_path / "usersite"
    usersite.mkdir()
    (usersite / "sitecustomize.py").write_text("print('user sitecustomize ran', flush=True)\n")
    program = tmp_path / "worker.py"
    program.write_text(PROGRAM)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, str(usersite), FAKE_TORCH]),
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "notify.sock"),
        "GPU_SUPERVISOR_IN_USE_EVERY_S": "0.05",
    }
    proc = subprocess.Popen(
        [sys.executable, str(program)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "user sitecustomize ran\n"
        threads = proc.stdout.readline()
        assert threads.startswith("threads before torch ['MainThread'] after [")
        assert "gpu-supervisor-in-use" in threads
        wanted = {b"X_GPU_MEMORY_IN_USE_MB=5.0", b"X_GPU_MEMORY_IN_USE_MB=7.0"}
        seen: set[bytes] = set()
        deadline = time.monotonic() + 10
        while not wanted <= seen:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            seen.add(listener.recv(4096))  # socket.timeout past the deadline fails the test
        assert b"X_GPU_MEMORY_IN_USE_MB=9.0" not in seen  # the forked child
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_second_copy_on_the_path_neither_loops_nor_reports_twice(
    listener: socket.socket, tmp_path: Path
) -> None:
    """The reporter's directory twice on the path (another spelling, as nested supervisors
    give; and a copy): one reporter, and the chain still reaches the user's sitecustomize."""
    usersite = tmp_path / "usersite"
    usersite.mkdir()
    (usersite / "sitecustomize.py").write_text("print('user sitecustomize ran', flush=True)\n")
    alias = tmp_path / "alias"
    alias.symlink_to(WORKER_SITE_DIR)
    copy = tmp_path / "copy"
    shutil.copytree(WORKER_SITE_DIR, copy)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [WORKER_SITE_DIR, str(alias), str(copy), str(usersite), FAKE_TORCH]
        ),
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "notify.sock"),
    }
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import threading, torch\n"
            "print(sum(t.name == 'gpu-supervisor-in-use' for t in threading.enumerate()))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["user sitecustomize ran", "1"], out.stderr
    assert "Error in sitecustomize" not in out.stderr


def test_nothing_is_sent_without_the_supervisors_socket(tmp_path: Path) -> None:
    """Started without ``GPU_SUPERVISOR_IN_USE_SOCKET`` the reporter starts no thread, even
    once torch is imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, FAKE_TORCH])}
    env.pop("GPU_SUPERVISOR_IN_USE_SOCKET", None)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import threading, sitecustomize, torch; "
            "print(sitecustomize.__file__, [t.name for t in threading.enumerate()])",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert out.startswith(os.path.join(WORKER_SITE_DIR, "sitecustomize.py"))  # it did run
    assert "gpu-supervisor-in-use" not in out


def test_it_runs_in_older_worker_interpreters_with_the_standard_library_only() -> None:
    """The reporter runs in the worker's Python (3.8 or later), not ours: its grammar and its
    imports must be those of a bare 3.8."""
    source = (Path(WORKER_SITE_DIR) / "sitecustomize.py").read_text()
    tree = ast.parse(source, feature_version=(3, 8))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0
    }
    assert imported - {"__future__"} <= sys.stdlib_module_names
    assert "from __future__ import annotations" in source  # X | None annotations stay strings


def _interpreter(version: str) -> str | None:
    """A Python ``version`` on this machine (pyenv's versions, or PATH), if there is one."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(root.glob(f"{version}.*/bin/python")) if root.is_dir() else []
    if candidates:
        return str(candidates[-1])
    found = shutil.which(f"python{version}")
    return found if found and "/shims/" not in found else None  # a shim may not run it


@pytest.mark.parametrize("version", ["3.8", "3.12", "3.13"])
def test_it_reports_from_other_worker_interpreters(
    version: str, listener: socket.socket, tmp_path: Path
) -> None:
    interpreter = _interpreter(version)
    if interpreter is None:
        pytest.skip(f"no Python {version} on this machine (python{version} or pyenv)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, FAKE_TORCH]),
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "notify.sock"),
        "GPU_SUPERVISOR_IN_USE_EVERY_S": "0.05",
    }
    program = "import time, torch; torch.cuda.init(); torch.cuda.set_allocated(0, 3 * 2**20)\n"
    program += "while True: time.sleep(0.05)"
    proc = subprocess.Popen([interpreter, "-c", program], env=env, stderr=subprocess.PIPE)
    try:
        assert listener.recv(4096) == b"X_GPU_MEMORY_IN_USE_MB=3.0"
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stderr is not None
        errors = proc.stderr.read()
        proc.stderr.close()
    assert b"Error" not in errors, errors


@pytest.mark.parametrize("torch_imports", [True, False])
def test_looking_for_torch_starts_nothing_importing_it_does(
    tmp_path: Path, torch_imports: bool
) -> None:
    """``importlib.util.find_spec("torch")`` (how libraries check that torch is there) and an
    ``import torch`` that fails start no thread; an import that succeeds does, and torch keeps
    its own loader. Regression: any lookup of the name started the reporter."""
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('broken torch')\n")
    torch_dir = FAKE_TORCH if torch_imports else str(broken)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, torch_dir]),
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "nobody.sock"),
    }
    code = (
        "import importlib.util, sys, threading\n"
        "names = lambda: [t.name for t in threading.enumerate()]\n"
        "found = importlib.util.find_spec('torch') is not None\n"
        "print(found, 'torch' in sys.modules, names())\n"
        "try:\n"
        "    import torch\n"
        "    print(type(torch.__spec__.loader).__name__, names())\n"
        "except ImportError:\n"
        "    print('no torch', names())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.splitlines()
    assert out[0] == "True False ['MainThread']"
    if torch_imports:
        assert out[1] == "SourceFileLoader ['MainThread', 'gpu-supervisor-in-use']"
    else:
        assert out[1] == "no torch ['MainThread']"


FORKED_RANK = textwrap.dedent(
    """
    import os, time
    import torch  # tests/fake_torch; CUDA not initialised yet, as vLLM's fork of its ranks

    if os.fork() == 0:  # rank 1: forked before CUDA was initialised, so it may use it
        torch.cuda.init()
        torch.cuda.set_allocated(0, 9 * 2**20)
    else:  # rank 0: the parent
        torch.cuda.init()
        torch.cuda.set_allocated(0, 5 * 2**20)
    while True:
        time.sleep(0.05)
    """
)


def test_a_child_forked_before_cuda_was_initialised_reports_too(
    listener: socket.socket, tmp_path: Path
) -> None:
    """A rank forked by a parent that had imported torch but not initialised CUDA (vLLM's
    default ``fork`` of its tensor-parallel ranks) may use CUDA: it reports for itself.
    Regression: the reporter's thread did not survive the fork, so only the parent reported
    and the ranks' leaks were judged on the parent's figure alone."""
    program = tmp_path / "worker.py"
    program.write_text(FORKED_RANK)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, FAKE_TORCH]),
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "notify.sock"),
        "GPU_SUPERVISOR_IN_USE_EVERY_S": "0.05",
    }
    proc = subprocess.Popen([sys.executable, str(program)], env=env, start_new_session=True)
    try:
        wanted = {b"X_GPU_MEMORY_IN_USE_MB=5.0", b"X_GPU_MEMORY_IN_USE_MB=9.0"}
        seen: set[bytes] = set()
        deadline = time.monotonic() + 10
        while not wanted <= seen:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            seen.add(listener.recv(4096))  # socket.timeout past the deadline fails the test
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


LOCKED_AT_FORK = textwrap.dedent(
    """
    import os, sys, threading
    import torch  # tests/fake_torch: the reporter's thread starts

    thread = next(t for t in threading.enumerate() if t.name == "gpu-supervisor-in-use")
    reporter = thread._target.__self__
    held, release = threading.Event(), threading.Event()

    def hold():  # as the reporter's thread does a moment each time it waits
        with reporter.stopped._cond:
            held.set()
            release.wait()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    pid = os.fork()  # lands while another thread holds the event's lock
    release.set()
    if pid == 0:
        sys.exit(0)  # the child ends normally: the exit handlers run
    _, status = os.waitpid(pid, 0)
    print("child exited", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def test_a_forked_child_exits_even_if_the_fork_caught_the_reporter_mid_wait(
    tmp_path: Path,
) -> None:
    """The child of a fork that caught the reporter's thread holding its event's lock exits.
    Regression: the child's exit handler set the parent's event, whose lock no thread of the
    child would ever release: the child hung at exit (and its parent with it)."""
    program = tmp_path / "worker.py"
    program.write_text(LOCKED_AT_FORK)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, FAKE_TORCH]),
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "nobody.sock"),
    }
    proc = subprocess.Popen(
        [sys.executable, str(program)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        out, err = "", "hung"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert out == "child exited 0\n", err


def test_a_process_that_never_imports_torch_pays_for_no_extra_modules(tmp_path: Path) -> None:
    """Every Python process of the worker's tree runs the reporter at start-up (shell helpers,
    tools, compilers): until torch is imported it loads nothing the interpreter would not have
    loaded anyway. Regression: ``socket``, ``threading`` and ``contextlib`` (with ``enum``,
    ``selectors``, ``collections``) came with it, about 10 ms more for every such process."""
    heavy = ("socket", "selectors", "enum", "threading", "contextlib", "collections")
    code = f"import sys; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    env = {**os.environ, "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "nobody.sock")}
    env.pop("PYTHONPATH", None)
    without = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
    )
    env["PYTHONPATH"] = WORKER_SITE_DIR
    ran = f"; print({site.MARK!r} in sys.modules)"
    with_site = subprocess.run(
        [sys.executable, "-c", code + ran], env=env, capture_output=True, text=True, timeout=30
    )
    assert with_site.stdout == without.stdout + "True\n", (with_site.stderr, without.stderr)


SERVES_AFTER_MAIN = textwrap.dedent(
    """
    import sys, threading, torch  # tests/fake_torch

    torch.cuda.init()
    torch.cuda.set_allocated(0, 3 * 2**20)


    def serve():
        threading.main_thread().join()  # the main thread has returned: this one serves on
        torch.cuda.set_allocated(0, 5 * 2**20)
        sys.stdin.read()  # until the test closes stdin


    threading.Thread(target=serve).start()
    """
)


def test_it_reports_while_non_daemon_threads_serve_after_the_main_thread_returned(
    listener: socket.socket, tmp_path: Path
) -> None:
    """A program whose main thread returns while its non-daemon threads go on serving (a pool
    it left working, a server thread it started last) is not exiting: the reporter reports on.
    Regression: it stopped when the main thread returned, so such a worker's reports went
    stale (a rank's leak was missed: its memory left the worker's sum)."""
    program = tmp_path / "worker.py"
    program.write_text(SERVES_AFTER_MAIN)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, FAKE_TORCH]),
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "notify.sock"),
        "GPU_SUPERVISOR_IN_USE_EVERY_S": "0.05",
    }
    proc = subprocess.Popen([sys.executable, str(program)], env=env, stdin=subprocess.PIPE)
    listener.settimeout(2)
    try:
        seen = []
        while b"X_GPU_MEMORY_IN_USE_MB=5.0" not in seen:
            try:
                seen.append(listener.recv(4096))
            except TimeoutError:
                break
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        finally:
            proc.kill()
            proc.wait(10)
    assert b"X_GPU_MEMORY_IN_USE_MB=5.0" in seen, seen
    assert proc.returncode == 0
