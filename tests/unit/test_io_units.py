"""Small I/O units tested for real: output rotation and tail, datagram parsing, signal mapping."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor import processes, procfs
from supervisor.notify import parse_datagram, socket_path_for
from supervisor.output import TAIL_CHARS, TAIL_LINES, WorkerOutput
from supervisor.records import dump_json
from supervisor.runtime import SIGNAL_REPEAT_S, Reload, Shutdown, signal_intent

PR_GET_PDEATHSIG = 2


def test_output_rotates_by_size_and_keeps_backups(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "w-0.log"
    out = WorkerOutput("w-0", log, max_bytes=100, backups=2)
    for i in range(30):
        out.feed(f"line {i:02d} ......\n".encode())
    out.close()
    files = sorted(p.name for p in log.parent.iterdir())
    assert files == ["w-0.log", "w-0.log.1", "w-0.log.2"]
    assert all(p.stat().st_size <= 100 for p in log.parent.iterdir())
    assert log.read_text().endswith("line 29 ......\n")


def test_rotated_logs_above_a_lowered_log_backups_are_removed(tmp_path: Path) -> None:
    """Regression: after ``log_backups`` was lowered, the rotated files numbered above the new
    count (``w-0.log.5`` with 3) were never removed: they stayed forever. They go when the log
    is opened or rotated; another worker's whose name starts alike (``w-01``) and files not
    numbered as a rotation would be are left."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("w-0.log.3", "w-0.log.4", "w-0.log.5", "w-0.log.12", "w-01.log.5", "w-0.log.05"):
        (logs / name).write_text("old\n")
    for name in ("w-0.log.5.gz", "w-0.log.x", "w-0.log"):
        (logs / name).write_text("other\n")
    out = WorkerOutput("w-0", logs / "w-0.log", max_bytes=100, backups=3)
    out.feed(b"first\n")  # opened: the stale ones go at once
    left = {"w-0.log", "w-0.log.3", "w-01.log.5", "w-0.log.05", "w-0.log.5.gz", "w-0.log.x"}
    assert {p.name for p in logs.iterdir()} == left
    (logs / "w-0.log.4").write_text("old\n")  # another run's, made while this one writes
    for i in range(20):
        out.feed(f"line {i:02d} ......\n".encode())  # rotates
    out.close()
    assert {p.name for p in logs.iterdir()} == left | {"w-0.log.1", "w-0.log.2"}


def test_output_keeps_the_last_lines_and_partial_lines(tmp_path: Path) -> None:
    out = WorkerOutput("w-0", tmp_path / "w.log", max_bytes=0, backups=0)
    out.feed(b"".join(f"{i}\n".encode() for i in range(TAIL_LINES + 50)))
    out.feed(b"no newline")
    out.flush_partial()
    out.close()
    lines = out.lines()
    assert len(lines) == TAIL_LINES
    assert lines[-1] == "no newline"
    assert lines[-2] == str(TAIL_LINES + 49)


def test_the_tail_holds_a_bounded_number_of_characters(tmp_path: Path) -> None:
    """Regression: 200 lines of 16 KiB of undecodable bytes (a worker writing binary data) were
    held as 3.2 M U+FFFD characters and written as 19 MB post-mortems (``\\ufffd`` each)."""
    out = WorkerOutput("w-0", tmp_path / "w.log", max_bytes=0, backups=0)
    for _ in range(TAIL_LINES):
        out.feed(b"\x80" * 16000 + b"\n")
    out.feed(b"last\n")
    lines = out.lines()
    assert lines[-1] == "last"
    assert sum(map(len, lines)) <= TAIL_CHARS
    assert len(lines) == 1 + TAIL_CHARS // 16000
    assert len(dump_json({"log_tail": lines})) < 1_000_000  # UTF-8, not \\ufffd escapes
    out.feed(b"\x80" * 40000 + b"\n")  # one line longer than it all: still the newest
    assert out.lines()[-1].startswith("\ufffd" * 100)
    out.close()


def test_passthrough_prefixes_each_line(tmp_path: Path) -> None:
    seen: list[bytes] = []
    out = WorkerOutput("w-1", tmp_path / "w.log", 0, 0, passthrough=True, stdout=seen.append)
    out.feed(b"a\nb")
    out.feed(b"c\n")
    out.close()
    assert seen == [b"[w-1] a\n", b"[w-1] bc\n"]


def test_output_survives_an_unwritable_log(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = WorkerOutput("w", blocker / "sub" / "w.log", 0, 0)  # parent is a file
    out.feed(b"still kept\n")
    assert out.lines() == ["still kept"]
    assert out.file.write_errors == 1


def test_parse_datagram() -> None:
    assert parse_datagram(b"READY=1\nSTATUS=a=b\n\nnoise\nWATCHDOG=1") == {
        "READY": "1",
        "STATUS": "a=b",
        "WATCHDOG": "1",
    }


def test_socket_path_falls_back_when_too_long(tmp_path: Path) -> None:
    assert socket_path_for(tmp_path) == tmp_path / "notify.sock"
    deep = tmp_path / ("x" * 120)
    fallback = socket_path_for(deep)
    assert len(str(fallback)) < 108
    assert fallback.parent.is_dir()
    fallback.parent.rmdir()


def test_signal_mapping() -> None:
    assert signal_intent(signal.SIGTERM, False) == Shutdown("SIGTERM")
    assert signal_intent(signal.SIGINT, True) == Shutdown("SIGINT")
    assert signal_intent(signal.SIGHUP, False) == Reload()
    assert signal_intent(signal.SIGHUP, True) is None
    assert signal_intent(signal.SIGUSR1, False) is None
    # the same stop signal twice in an instant (GNU timeout: the child, then its group) is
    # one request; again later, it forces the stop
    assert signal_intent(signal.SIGTERM, True, since_same_s=0.001) is None
    assert signal_intent(signal.SIGTERM, False, since_same_s=0.001) is None
    assert signal_intent(signal.SIGTERM, True, since_same_s=SIGNAL_REPEAT_S) == Shutdown("SIGTERM")
    assert signal_intent(signal.SIGHUP, False, since_same_s=0.001) == Reload()


def test_nspids_and_inner_pids_of_a_nested_pid_namespace() -> None:
    assert procfs.nspids(os.getpid()) == (os.getpid(),)
    assert procfs.inner_pids([os.getpid()]) == {}
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare is not installed")
    # `unshare --fork` forks the command as pid 1 of the new namespace and waits for it.
    outer = subprocess.Popen([unshare, "--pid", "--fork", "sleep", "60"])
    try:
        parent = psutil.Process(outer.pid)
        deadline = time.monotonic() + 10
        child = None
        while child is None and time.monotonic() < deadline:
            kids = parent.children()
            if kids and procfs.nspids(kids[0].pid)[-1:] == (1,):
                child = kids[0].pid
            elif outer.poll() is not None:
                pytest.skip("unshare --pid --fork not permitted here")
            else:
                psutil.wait_procs([parent], timeout=0.005)  # returns at once if it exits
        assert child is not None, "unshare did not start its child within 10 s"
        assert procfs.nspids(child) == (child, 1)
        assert procfs.inner_pids([child, os.getpid()]) == {1: child}
    finally:
        outer.kill()
        outer.wait(10)
    assert procfs.nspids(outer.pid) == ()


@pytest.fixture
def fresh_setpriv_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    processes._setpriv.cache_clear()
    yield
    monkeypatch.undo()
    processes._setpriv.cache_clear()


def _helper(directory: Path, body: str) -> Path:
    path = directory / "setpriv"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.mark.usefixtures("fresh_setpriv_probe")
def test_setpriv_is_recognised_from_its_binary_without_running_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = tmp_path / "ran"
    helper = _helper(tmp_path, f"# {' --pdeathsig keep|clear|<signame>'}\ntouch {ran}\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert processes._setpriv() == str(helper)
    assert not ran.exists()


@pytest.mark.usefixtures("fresh_setpriv_probe")
def test_setpriv_falls_back_to_asking_its_help(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The option's name is not in the file, only in what it prints.
    helper = _helper(tmp_path, 'echo " --pd""eathsig keep|clear|<signame>"\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert processes._setpriv() == str(helper)


@pytest.mark.usefixtures("fresh_setpriv_probe")
def test_setpriv_without_pdeathsig_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _helper(tmp_path, "# --keep-pdeathsig is another option\necho usage: setpriv --nnp\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert processes._setpriv() is None


def test_prctl_is_found_in_the_loaded_c_library() -> None:
    value = ctypes.c_int(-1)
    assert processes._prctl()(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) == 0
    assert value.value == 0  # the test process has no parent-death signal


def test_tasks_of_a_user_count_every_thread_of_its_processes() -> None:
    """``procfs.tasks_of_user`` counts as RLIMIT_NPROC does: threads of the real user."""
    mine = procfs.tasks_of_user(os.getuid())
    assert mine is not None and mine >= psutil.Process().num_threads()
    assert procfs.tasks_of_user(2**31 - 2) == 0  # a user with no process
