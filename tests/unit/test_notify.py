"""The notify socket on real unix datagram sockets: delivery with the sender's pid, serving on
after the socket is bound again, and an error in the handler ending the serving task."""

from __future__ import annotations

import array
import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from supervisor.notify import (
    MAX_SOCKET_PATH,
    NotifyListener,
    NotifyMessage,
    parse_datagram,
    parse_usec,
    private_socket_path,
)


def send(path: Path, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(data, os.fspath(path))


def test_parse_datagram() -> None:
    got = parse_datagram(b"READY=1\nSTATUS=a=b\nnoise\n=x\nX_GPU_MEMORY_IN_USE_MB=12.5")
    assert got == {"READY": "1", "STATUS": "a=b", "X_GPU_MEMORY_IN_USE_MB": "12.5"}


async def test_messages_arrive_with_the_senders_pid_also_after_a_rebind(tmp_path: Path) -> None:
    send_got, receive_got = anyio.create_memory_object_stream[NotifyMessage](10)
    path = tmp_path / "notify.sock"
    listener = NotifyListener(path, send_got.send_nowait)
    async with send_got, receive_got, anyio.create_task_group() as tg:
        await tg.start(listener.serve)
        with anyio.fail_after(5):
            send(path, b"READY=1\nSTATUS=up")
            assert await receive_got.receive() == NotifyMessage(
                os.getpid(), {"READY": "1", "STATUS": "up"}
            )
            path.unlink()  # the state_dir went away
            assert not listener.bound()
            listener.rebind()
            assert listener.bound()
            send(path, b"WATCHDOG=1")
            assert (await receive_got.receive()).fields == {"WATCHDOG": "1"}
        tg.cancel_scope.cancel()
    assert not path.exists()  # closed and removed when serving ends


async def test_an_error_in_the_handler_ends_serving_with_it(tmp_path: Path) -> None:
    def handler(msg: NotifyMessage) -> None:
        raise ValueError(f"bad {msg.fields}")

    path = tmp_path / "notify.sock"
    listener = NotifyListener(path, handler)

    async def serve_one() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(listener.serve)
            send(path, b"READY=1")

    with pytest.raises(ExceptionGroup) as caught, anyio.fail_after(5):
        await serve_one()
    assert caught.group_contains(ValueError, match="bad")
    assert not path.exists()


async def test_close_ends_serving_and_a_second_serve_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    listener = NotifyListener(path, lambda _msg: None)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(listener.serve)
            with pytest.raises(RuntimeError, match="already being served"):
                await listener.serve()
            listener.close()  # the serving task returns on its own: the group exits
    assert not path.exists()


async def test_a_failed_rebind_keeps_the_socket_it_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "notify.sock"
    listener = NotifyListener(path, lambda _msg: None)
    listener.open()
    old = listener._sock
    assert old is not None

    def fail() -> None:
        raise OSError("read-only file system")

    monkeypatch.setattr(listener, "open", fail)
    with pytest.raises(OSError, match="read-only"):
        listener.rebind()
    assert listener._sock is old and old.fileno() >= 0  # not leaked, not closed
    listener.close()
    assert old.fileno() == -1


def test_closing_on_a_read_only_state_dir_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket file cannot be removed (the state_dir turned read-only while running): the
    close still succeeds. Regression: OSError (EROFS) made a clean stop end with exit 1."""
    listener = NotifyListener(tmp_path / "notify.sock", lambda _m: None)
    listener.open()

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    listener.close()  # no exception


def test_a_read_is_at_most_the_limit(tmp_path: Path) -> None:
    """A wake-up reads at most ``limit`` datagrams: a flooding worker cannot keep the event
    loop in the reader callback."""
    got: list[NotifyMessage] = []
    listener = NotifyListener(tmp_path / "notify.sock", got.append)
    listener.open()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        for _ in range(10):
            sender.sendto(b"WATCHDOG=1", os.fspath(tmp_path / "notify.sock"))
    assert listener.drain(4) == 4 and len(got) == 4
    assert listener.drain() == 6
    listener.close()


def test_a_socket_put_in_its_place_is_not_taken_for_the_listeners(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    listener = NotifyListener(path, lambda _m: None)
    listener.open()
    try:
        assert listener.bound()
        path.unlink()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
            other.bind(os.fspath(path))  # someone else's socket at the same path
            assert not listener.bound()  # so it is bound again (regression: taken as ours)
    finally:
        listener.close()


def test_a_directory_of_someone_elses_is_never_used(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    theirs = tmp_path / "shared"
    theirs.mkdir()
    theirs.chmod(0o777)
    os.chown(theirs, 65534, 65534)
    listener = NotifyListener(theirs / "notify.sock", lambda _m: None, dir_mode=0o711)
    with pytest.raises(OSError, match="belongs to uid 65534: not used"):
        listener.open()
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o777 and not (theirs / "notify.sock").exists()
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(NotADirectoryError):  # a link (O_NOFOLLOW), even to a directory of ours
        NotifyListener(link / "notify.sock", lambda _m: None, dir_mode=0o711).open()
    assert stat.S_IMODE(tmp_path.stat().st_mode) != 0o711


def test_senders_it_does_not_accept_are_dropped_before_their_pid_is_looked_at() -> None:
    if os.geteuid() != 0:
        pytest.skip("sending as another user needs root")
    where = Path(tempfile.mkdtemp(prefix="gpu-supervisor-notify-test-"))
    try:
        where.chmod(0o755)
        path = where / "notify.sock"
        got: list[NotifyMessage] = []
        listener = NotifyListener(path, got.append, mode=0o666, accepts=lambda uid: uid == 0)
        listener.open()
        try:
            send(path, b"READY=1")  # from root: accepted
            code = (
                "import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                f"s.sendto(b'READY=1', {os.fspath(path)!r})"
            )
            for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
                with contextlib.suppress(OSError):
                    done = subprocess.run(
                        [python, "-c", code],
                        user=65534,
                        group=65534,
                        extra_groups=[],
                        cwd="/",
                        check=False,
                        capture_output=True,
                        timeout=30,
                    )
                    if done.returncode == 0:
                        break
            else:
                pytest.skip("no Python interpreter here that uid 65534 may run")
            assert listener.drain() == 2
            assert [m.pid for m in got] == [os.getpid()] and listener.dropped == 1
        finally:
            listener.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_field_cut_off_by_the_datagram_limit_is_not_taken(tmp_path: Path) -> None:
    """A datagram longer than the 4096 bytes read of it: its whole fields count, the one the
    limit cut is ignored. Regression: ``X_GPU_MEMORY_IN_USE_MB=12345`` after a long ``STATUS=``
    was read as 12 MiB (the leak detector then judged the worker on a made-up figure)."""
    got: list[NotifyMessage] = []
    listener = NotifyListener(tmp_path / "notify.sock", got.append)
    listener.open()
    try:
        status = "x" * (4096 - len("STATUS=\nREADY=1\nX_GPU_MEMORY_IN_USE_MB=12"))
        send(listener.path, f"STATUS={status}\nREADY=1\nX_GPU_MEMORY_IN_USE_MB=12345".encode())
        send(listener.path, b"READY=1\nSTATUS=" + b"y" * 70_000)  # a STATUS= of 70 kB: cut
        assert listener.drain() == 2
    finally:
        listener.close()
    assert got[0].fields == {"STATUS": status, "READY": "1"}
    assert got[1].fields == {"READY": "1"}


def test_descriptors_sent_along_are_not_kept(tmp_path: Path) -> None:
    """``FDSTORE=1`` (or sd_notify_barrier's ``BARRIER=1``) with descriptors attached: none of
    them is left open in the supervisor (the sender's pipe sees its last reader gone)."""
    got: list[NotifyMessage] = []
    listener = NotifyListener(tmp_path / "notify.sock", got.append)
    listener.open()
    read_end, write_end = os.pipe()
    try:
        before = set(os.listdir("/proc/self/fd"))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_end] * 8))]
            sock.sendmsg([b"FDSTORE=1\nREADY=1"], fds, 0, os.fspath(listener.path))
        os.close(read_end)
        read_end = -1
        assert listener.drain() == 1
        assert set(os.listdir("/proc/self/fd")) <= before
        with pytest.raises(BrokenPipeError):  # no reader left: not one kept in the supervisor
            os.write(write_end, b"x")
    finally:
        listener.close()
        os.close(write_end)
        if read_end >= 0:
            os.close(read_end)
    assert got == [NotifyMessage(os.getpid(), {"FDSTORE": "1", "READY": "1"})]


@pytest.mark.parametrize(
    ("value", "usec"),
    [
        ("0", 0),
        ("300000", 300_000),
        ("18446744073709551615", 2**64 - 1),  # UINT64_MAX (systemd's "infinity")
        ("18446744073709551616", None),
        ("", None),
        ("-1", None),
        ("+5", None),
        (" 5", None),
        ("1_000", None),
        ("5s", None),
        ("\u0665", None),  # a digit, but not an ASCII one
    ],
)
def test_usec_fields_are_read_as_systemd_reads_them(value: str, usec: int | None) -> None:
    """EXTEND_TIMEOUT_USEC / WATCHDOG_USEC: an unsigned 64-bit decimal, nothing else."""
    assert parse_usec(value) == usec


def test_a_private_socket_path_too_long_under_tmpdir_goes_to_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: where ``TMPDIR`` itself is deep (a long ``state_dir`` sends the socket to
    the temporary directory), the socket's path there was too long too: the bind failed and
    the supervisor ended with a traceback. It goes to ``/tmp`` then."""
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = private_socket_path()
    try:
        assert path.parent.parent == Path("/tmp"), path
        assert len(os.fsencode(path)) <= MAX_SOCKET_PATH
        assert list(deep.iterdir()) == []  # the one too deep is removed
    finally:
        path.parent.rmdir()


def test_leftover_private_directories_of_killed_supervisors_are_removed(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the private directory in /tmp that holds the notify socket (a ``state_dir``
    too long for a socket path, or read-only) was left behind by a supervisor killed with
    SIGKILL: one more at each such run. Its name now carries its supervisor's pid, and the
    next start removes those whose supervisor is gone; never a live one's, a link (not
    followed), another user's, one holding anything else, or a name not of ours."""
    from supervisor.notify import remove_leftover_private_dirs

    # short: a socket is bound in it (tmp_path is too deep for one under xdist)
    temp = Path(tempfile.mkdtemp(prefix="lo", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    mine = private_socket_path()  # this process's: alive
    assert mine.parent.name.startswith(f"gpu-supervisor-{os.getpid()}-"), mine
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = gone.pid

    def leftover(name: str, *files: str) -> Path:
        d = temp / name
        d.mkdir(mode=0o700)
        for f in files:
            if f == "notify.sock":
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    s.bind(os.fspath(d / f))  # closed: a stale socket, as SIGKILL leaves it
            else:
                (d / f).write_text("x")
        return d

    killed = leftover(f"gpu-supervisor-{dead}-abcd_123", "notify.sock")
    empty = leftover(f"gpu-supervisor-{dead}-efgh4567")
    kept = [
        leftover(f"gpu-supervisor-{dead}-ijkl8901", "notify.sock", "data"),  # not only ours
        leftover(f"gpu-supervisor-{dead}-mnop"),  # not our naming
        leftover("gpu-supervisor-qrst2345", "notify.sock"),  # older naming: no pid to tell
        leftover(f"gpu-supervisor-{os.getppid()}-uvwx6789", "notify.sock"),  # alive
        leftover(f"other-{dead}-abcdefgh", "notify.sock"),
    ]
    target = leftover("target", "notify.sock")
    (temp / f"gpu-supervisor-{dead}-link0000").symlink_to(target)  # never followed
    foreign = leftover(f"gpu-supervisor-{dead}-user0000", "notify.sock")
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
    kept += [target, foreign]
    removed = remove_leftover_private_dirs([os.fspath(temp)])
    assert sorted(removed) == sorted([killed, empty])
    assert not killed.exists() and not empty.exists()
    assert all(d.is_dir() for d in kept)
    assert (target / "notify.sock").exists()
    assert (temp / f"gpu-supervisor-{dead}-link0000").is_symlink()
    assert mine.parent.is_dir()
    mine.parent.rmdir()


def test_a_flood_from_a_process_of_no_worker_walks_proc_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: each datagram on the notify socket from a process of no worker (another
    program of the same user) walked /proc up its ancestry to find its worker: a flood of
    them cost that walk each. Such a sender (pid and start time) is not looked up again for
    a second; a worker's descendant forked meanwhile is its worker's at once, and a pid
    taken by another process (its start time differs) is looked up again."""
    from types import MethodType, SimpleNamespace

    from supervisor import procfs
    from supervisor.clock import FakeClock
    from supervisor.runtime import Runtime

    walks: list[int] = []
    walk = procfs.owner_of

    def counted(pid: int, *args: Any, **kwargs: Any) -> Any:
        walks.append(pid)
        return walk(pid, *args, **kwargs)

    monkeypatch.setattr(procfs, "owner_of", counted)
    clock = FakeClock()
    rt = SimpleNamespace(_pids={}, runners={}, clock=clock, _unknown_senders=procfs.UnknownPids())
    sender = MethodType(Runtime._sender, rt)
    stranger = subprocess.Popen(["sleep", "30"])
    worker = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE)
    try:
        for _ in range(1000):
            assert sender(stranger.pid) is None
        assert walks == [stranger.pid]  # (regression: 1000 walks)
        clock.advance(1.01)
        assert sender(stranger.pid) is None
        assert walks == [stranger.pid] * 2  # looked up again a second later
        w0 = object()
        rt._pids[worker.pid] = w0  # a worker now: its child (forked now) is its at once
        assert worker.stdout is not None
        forked = int(worker.stdout.readline())  # said once forked
        assert sender(forked) is w0
        # a pid said to be nobody's, now another process's (its start time): looked up
        st = procfs.read_stat(forked)
        assert st is not None
        rt._unknown_senders.add(forked, st.start_ticks - 1, clock.now())
        assert sender(forked) is w0
        # bounded: the oldest are forgotten
        many = procfs.UnknownPids(size=3)
        for pid in range(10, 20):
            many.add(pid, 1, clock.now())
        assert [many.known(pid, 1, clock.now()) for pid in (10, 16, 17, 19)] == [
            False,
            False,
            True,
            True,
        ]
    finally:
        for p in (stranger, worker):
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(p.pid).children(recursive=True):
                    c.kill()
            p.kill()
            p.wait()
        if worker.stdout is not None:
            worker.stdout.close()
