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

import anyio
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
