"""The log sink: a log stream that fails (its reader gone, a full disk) never reaches the caller.

Real pipes and real descriptors (``/dev/full`` for a full disk); no mocks of ``os``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest
import structlog

from supervisor import logs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.fixture
def pipe() -> Iterator[tuple[int, TextIO]]:
    """``(read_fd, write_stream)`` of a fresh pipe; both closed afterwards (if still open)."""
    r, w = os.pipe()
    stream = os.fdopen(w, "w", encoding="utf-8")
    yield r, stream
    with contextlib.suppress(OSError):
        os.close(r)
    with contextlib.suppress(OSError):
        stream.close()


def read_all(fd: int) -> str:
    """Everything in the pipe now (the read end is made non-blocking)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def target(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_closed_pipe_is_swallowed_and_later_lines_discarded(
    pipe: tuple[int, TextIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    """stderr is a pipe whose reader has gone: no exception reaches the caller, the lines are
    discarded from then on, and the descriptor then points at /dev/null (so that the final
    flush of ``sys.stderr``, or anything else written there, cannot fail either)."""
    r, stream = pipe
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure_logging("json", "info")
    log = structlog.get_logger()
    log.info("before", n=1)
    [before] = events(read_all(r))
    assert before["event"] == "before" and before["n"] == 1 and before["level"] == "info"

    os.close(r)
    log.warning("after.1")  # EPIPE here
    log.error("after.2", worker="w-0")
    log.info("after.3")

    sink = logs.log_sink()
    assert sink is not None
    assert sink.broken and not sink.healthy
    assert sink.dropped == 3
    assert isinstance(sink.fault, BrokenPipeError)
    assert target(stream.fileno()) == os.devnull
    stream.write("held in the text buffer")  # what the interpreter flushes at exit
    stream.flush()


def test_on_health_is_told_once_and_may_log(pipe: tuple[int, TextIO]) -> None:
    """The health callback hears of a broken stream once, however many lines follow; it may
    itself log (as ``WriteHealth.failed`` does) without a deadlock or a loop."""
    r, stream = pipe
    sink = logs.configure_logging("json", "info", stream=stream)
    told: list[OSError | None] = []

    def on_health(exc: OSError | None) -> None:
        told.append(exc)
        structlog.get_logger().error("records.write_failed", file="stderr")

    sink.on_health = on_health
    os.close(r)
    for i in range(5):
        structlog.get_logger().info("line", i=i)
    assert len(told) == 1 and isinstance(told[0], BrokenPipeError)
    assert sink.dropped == 6  # five lines and the callback's own


def test_lines_are_whole_json_lines_from_threads(pipe: tuple[int, TextIO]) -> None:
    """The fast path writes each line whole (non-ASCII included), threads never interleave."""
    r, stream = pipe
    sink = logs.configure_logging("json", "info", stream=stream)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(iter(lambda: os.read(r, 65536), b"")))
    reader.start()

    def burst(t: int) -> None:
        log = structlog.get_logger()
        for i in range(200):
            log.info("line", t=t, i=i, text="é" * (i % 7) + "x" * 5000 * (i % 3))

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()  # its own non-blocking description of the pipe is a writer too
    stream.close()
    reader.join(10)
    lines = events(b"".join(got).decode())
    assert len(lines) == 800
    assert {(e["t"], e["i"]) for e in lines} == {(t, i) for t in range(4) for i in range(200)}
    assert all(e["text"] == "é" * (e["i"] % 7) + "x" * 5000 * (e["i"] % 3) for e in lines)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_full_disk_drops_lines_then_recovers_with_one_notice(pipe: tuple[int, TextIO]) -> None:
    """ENOSPC may clear up: each line is dropped, not the stream; the first line that gets
    through again comes after one notice of how many were lost."""
    r, out = pipe
    with open("/dev/full", "w", encoding="utf-8") as full:
        sink = logs.configure_logging("json", "info", stream=full)
        told: list[OSError | None] = []
        sink.on_health = told.append
        log = structlog.get_logger()
        log.info("lost.1")
        log.info("lost.2")
        assert not sink.broken and not sink.healthy
        assert sink.dropped == 2
        assert target(full.fileno()) == "/dev/full"  # still tried: not sent to /dev/null
        assert len(told) == 1 and isinstance(told[0], OSError) and told[0].errno == errno.ENOSPC

        os.dup2(out.fileno(), full.fileno())  # space again
        log.info("back", n=3)
        log.info("next")
        notice, back, nxt = events(read_all(r))
    assert notice["event"] == logs.RECOVERED_EVENT and notice["level"] == "warning"
    assert notice["dropped"] == 2 and notice["errno"] == "ENOSPC"
    assert "timestamp" in notice
    assert back["event"] == "back" and back["n"] == 3 and nxt["event"] == "next"
    assert sink.healthy and sink.fault is None and sink.dropped == 2
    assert told[1:] == [None]


def test_non_blocking_stream_drops_a_line_it_cannot_take(pipe: tuple[int, TextIO]) -> None:
    """EAGAIN (a non-blocking stderr with a slow reader) drops the line; a line cut short by it
    is ended before the next, so that every later line still parses."""
    r, stream = pipe
    sink = logs.configure_logging("json", "info", stream=stream)
    w = stream.fileno()
    os.set_blocking(w, False)
    page = b"-" * 4096
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(w, page)  # atomic (<= PIPE_BUF): whole pages until the pipe is full
    log = structlog.get_logger()
    log.info("lost.whole")
    assert sink.dropped == 1 and not sink.broken
    os.read(r, 4096)  # room for one page: a long line is cut there
    log.info("lost.cut", text="y" * 10000)
    assert sink.dropped == 2 and not sink.broken

    text = read_all(r)
    os.set_blocking(r, True)
    log.info("back")
    tail = read_all(r)
    assert text.endswith("y" * 100)  # the start of the cut line went out
    assert tail.startswith("\n")  # and is ended first
    notice, back = events(tail[1:])
    assert notice["event"] == logs.RECOVERED_EVENT
    assert notice["dropped"] == 2 and notice["errno"] in ("EAGAIN", "EWOULDBLOCK")
    assert back["event"] == "back"


def test_stream_without_descriptor() -> None:
    """A stream with no file descriptor (io.StringIO) is written through as before; one whose
    writes fail is dropped from, quietly."""
    buf = io.StringIO()
    logs.configure_logging("json", "info", stream=buf)
    structlog.get_logger().info("hello", n=1)
    [hello] = events(buf.getvalue())
    assert hello["event"] == "hello"

    class Failing(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(errno.EIO, "Input/output error")

    with Failing() as failing:
        sink = logs.configure_logging("json", "info", stream=failing)
        structlog.get_logger().info("lost")
        assert sink.dropped == 1 and not sink.broken

    closed = io.StringIO()
    sink = logs.configure_logging("json", "info", stream=closed)
    closed.close()
    structlog.get_logger().info("lost")  # ValueError: I/O operation on closed file
    assert sink.broken and sink.dropped == 1


def test_closed_descriptor_is_left_alone() -> None:
    """EBADF: the descriptor was closed under the sink. Lines are discarded, and the number is
    not taken back with /dev/null (it may be someone else's by then); a health callback that
    fails is ignored."""
    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "w", closefd=False) as stream:
        sink = logs.configure_logging("json", "info", stream=stream)

        def on_health(exc: OSError | None) -> None:
            raise RuntimeError("a bug in the callback")

        sink.on_health = on_health
        os.close(w)
        structlog.get_logger().info("lost")
        structlog.get_logger().info("lost")
        assert sink.broken and sink.dropped == 2
        assert isinstance(sink.fault, OSError) and sink.fault.errno == errno.EBADF
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(w)


def test_console_format_notice() -> None:
    """The notice comes in the stream's own format."""
    assert logs.LogSink(io.StringIO()).render_notice({"event": "x"}) == '{"event": "x"}'
    logs.configure_logging("console", "info", stream=io.StringIO())
    sink = logs.log_sink()
    assert sink is not None
    text = sink.render_notice({"event": logs.RECOVERED_EVENT, "dropped": 4})
    assert logs.RECOVERED_EVENT in text and "dropped" in text and "warn" in text


def test_no_stderr_at_all() -> None:
    """Started with descriptor 2 closed, Python has ``sys.stderr = None``: lines are discarded."""
    sink = logs.LogSink(None)
    sink.info("nowhere")
    assert sink.broken and sink.dropped == 1


def test_interpreter_exit_after_broken_pipe_is_clean() -> None:
    """A process whose stderr reader has gone logs, prints to stderr, and exits normally: no
    exception, and exit 0 (the interpreter's final flush of stderr would otherwise fail: exit
    code 120, "Exception ignored ... BrokenPipeError")."""
    script = (
        "import sys, structlog\n"
        "from supervisor.logs import configure_logging\n"
        "configure_logging('json', 'info')\n"
        "structlog.get_logger().info('one')\n"
        "sys.stderr.write('held in the buffer until exit')\n"
        "print('survived', flush=True)\n"
    )
    r, w = os.pipe()
    os.close(r)  # nobody will read stderr
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=w,
            cwd=ROOT,
            timeout=30,
            check=False,
        )
    finally:
        os.close(w)
    assert done.stdout == b"survived\n"
    assert done.returncode == 0


def fill(fd: int) -> None:
    """Fill the pipe whose write end is ``fd`` (left blocking, as stderr is)."""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(fd, b"-" * 4096)
    os.set_blocking(fd, True)


def test_a_reader_that_stops_reading_does_not_block_the_logger(pipe: tuple[int, TextIO]) -> None:
    """The defect: stderr a pipe whose reader stopped reading (a paused terminal, a stopped
    ``| grep``, a hung log shim): the next log line blocked in write(), and with it the event
    loop and all supervision. Now the line waits STALL_WAIT_S at most, the ones after it not
    at all, and the stream is used again once it takes bytes (with the notice of the loss)."""
    r, stream = pipe
    sink = logs.configure_logging("json", "info", stream=stream)
    fill(stream.fileno())
    log = structlog.get_logger()
    log.info("lost.1")  # would block for good before (pytest-timeout ends the test then)
    log.info("lost.2", text="z" * 20000)
    assert sink.dropped == 2 and not sink.healthy and not sink.broken
    assert sink.fault is not None and sink.fault.strerror == logs.STALLED

    read_all(r)  # the reader reads again
    log.info("back")
    notice, back = events(read_all(r))
    assert notice["event"] == logs.RECOVERED_EVENT and notice["dropped"] == 2
    assert notice["errno"] in ("EAGAIN", "EWOULDBLOCK") and notice["error"] == logs.STALLED
    assert back["event"] == "back" and sink.healthy


def test_passthrough_drops_what_a_stalled_stdout_cannot_take(pipe: tuple[int, TextIO]) -> None:
    """The same for the workers' output passed through to stdout: dropped and counted while
    the stream is full, said in the log once per stall; lines stay whole after it."""
    from supervisor.output import Passthrough

    r, stream = pipe
    log_r, log_w = os.pipe()
    with os.fdopen(log_w, "w", encoding="utf-8") as log_stream:
        logs.configure_logging("json", "info", stream=log_stream)
        out = Passthrough(stream.fileno())
        fill(stream.fileno())
        out(b"[w-0] lost\n")
        out(b"[w-0] lost too\n")
        assert out.stalled and out.dropped_bytes == len(b"[w-0] lost\n[w-0] lost too\n")
        os.read(r, 4096)  # room for one piece: a long chunk is cut there
        out(b"[w-0] " + b"y" * 9000 + b"\n")
        read_all(r)
        out(b"[w-0] back\n")
        assert not out.stalled
        text = read_all(r)
        said = events(read_all(log_r))
    os.close(log_r)
    assert text.endswith("\n[w-0] back\n")  # the cut line was ended before it
    assert [e["event"] for e in said] == [
        "output.passthrough_stalled",
        "output.passthrough_recovered",
    ]
    assert said[1]["dropped_bytes"] == out.dropped_bytes > 9000 - 4096


def test_a_terminal_that_stops_reading_does_not_block_the_logger() -> None:
    """A terminal polls writable with a few bytes of room, and a write of more then blocks
    until it has them all (an ssh session whose network stalled, a hung terminal emulator):
    polling before each write was not enough. Writes go through a non-blocking description of
    the terminal of their own; the terminal itself stays blocking for everyone else."""
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", encoding="utf-8", closefd=False) as tty:
            sink = logs.configure_logging("json", "info", stream=tty)
            log = structlog.get_logger()
            for i in range(2000):  # ~400 kB: far more than the terminal holds
                log.info("line", i=i, text="y" * 150)
            assert sink.dropped > 0 and not sink.broken
            assert os.get_blocking(slave)  # not changed under the others who share it
            sink.close()
    finally:
        os.close(master)
        os.close(slave)


def test_a_socket_that_stops_reading_does_not_block_the_logger() -> None:
    """journald hands a service a stream socket for stderr: the same, with send(MSG_DONTWAIT)."""
    import socket

    ours, theirs = socket.socketpair()
    try:
        with os.fdopen(ours.fileno(), "w", encoding="utf-8", closefd=False) as stream:
            sink = logs.configure_logging("json", "info", stream=stream)
            log = structlog.get_logger()
            for i in range(5000):  # ~1 MB: more than the socket's buffers hold
                log.info("line", i=i, text="y" * 150)
            assert sink.dropped > 0 and not sink.broken
            theirs.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while theirs.recv(1 << 20):
                    pass
            log.info("back")
            sink.close()
        theirs.setblocking(True)
        theirs.settimeout(5)
        tail = theirs.recv(1 << 16).decode()
        assert logs.RECOVERED_EVENT in tail and '"event": "back"' in tail
    finally:
        ours.close()
        theirs.close()
