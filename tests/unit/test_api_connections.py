"""The API's connection limit and request deadline (``api.Connections``), on a real uvicorn
server over loopback with a small app, short deadlines and a small limit."""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest
import structlog

from supervisor import api, logs
from supervisor.api import Connections, connection_limit, server_for, start_server

Stream = anyio.abc.SocketStream


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio only


class App:
    """``/ok`` answers at once (a POST once its body is in); ``/wait`` once ``release`` is set;
    ``/big`` sends ``big`` bytes (``/big-chunked``: in 1 MiB pieces)."""

    def __init__(self, big: int = 32 << 20) -> None:
        self.release = anyio.Event()
        self.waiting = 0
        self.big = big

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        path = scope["path"]
        if scope["method"] == "POST":  # the whole body first
            while (await receive()).get("more_body"):
                pass
        if path == "/wait":
            self.waiting += 1
            await self.release.wait()
        if path.startswith("/big"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            if path == "/big":
                await send({"type": "http.response.body", "body": b"x" * self.big})
                return
            piece = b"x" * (1 << 20)
            for _ in range(self.big // len(piece)):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b'{"ok":true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"11")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def serving(
    app: Any, limit: int, request_timeout_s: float = 30.0
) -> AsyncIterator[tuple[Connections, Callable[[], Any]]]:
    """Serve ``app`` on a loopback port; yield the connections and a function that connects."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    connections = Connections(limit, request_timeout_s)
    server = server_for(app, connections)
    await start_server(server, sock)
    clients: list[Stream] = []

    async def connect() -> Stream:
        clients.append(await anyio.connect_tcp("127.0.0.1", port))
        return clients[-1]

    try:
        yield connections, connect
    finally:
        for client in clients:
            await client.aclose()
        for listener in server.servers:
            listener.close()
        with anyio.fail_after(5):
            while server.server_state.connections:
                for conn in list(server.server_state.connections):
                    conn.transport.abort()
                await anyio.sleep(0.005)
        for listener in server.servers:
            await listener.wait_closed()
        sock.close()


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``check()`` holds (polling the loop), or fail after ``timeout``."""
    with anyio.fail_after(timeout):
        while True:
            if check():
                return
            await anyio.sleep(0.005)


async def closed(stream: Stream, timeout: float = 5.0, *, unanswered: bool = False) -> bool:
    """Read until the server closes ``stream`` (True), or ``timeout`` passes (False);
    ``unanswered``: and nothing came before the close."""
    received = 0
    with anyio.move_on_after(timeout):
        try:
            while True:
                received += len(await stream.receive(1 << 20))
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            return not (unanswered and received)
    return False


async def still_open(stream: Stream) -> bool:
    """Nothing (not even EOF) arrives within a few loop turns."""
    with anyio.move_on_after(0.05):
        try:
            await stream.receive(1)
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            return False
        return False
    return True


async def answer(stream: Stream) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer with a Content-Length: status, headers, body."""
    data = b""
    with anyio.fail_after(5):
        while b"\r\n\r\n" not in data:
            data += await stream.receive()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        while len(body) < length:
            body += await stream.receive()
    return int(lines[0].split()[1]), headers, body


GET_OK = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


def test_connection_limit_follows_the_open_files_limit() -> None:
    import resource

    assert connection_limit(1 << 20) == api.MAX_CONNECTIONS == 256
    assert connection_limit(20000) == 256
    assert connection_limit(1024) == 128
    assert connection_limit(512) == 64
    assert connection_limit(64) == api.MIN_CONNECTIONS
    assert connection_limit(resource.RLIM_INFINITY) == 256
    assert 16 <= connection_limit() <= 256


async def test_a_request_that_does_not_arrive_whole_in_time_is_closed() -> None:
    """Headers cut short, a body cut short, nothing at all, or a second request cut short on a
    keep-alive connection: each is closed once ``request_timeout_s`` has passed since the
    connection opened or the last answer. A request being served is not."""
    app = App()
    async with serving(app, limit=16, request_timeout_s=0.3) as (connections, connect):
        started = time.monotonic()
        partial = await connect()
        await partial.send(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        body_cut = await connect()
        await body_cut.send(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        silent = await connect()
        busy = await connect()
        await busy.send(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        kept = await connect()
        await kept.send(GET_OK)
        assert (await answer(kept))[0] == 200
        answered = time.monotonic()
        await kept.send(b"GET /ok HTTP/1.1\r\n")

        for stream in (partial, body_cut, silent):
            assert await closed(stream, unanswered=True)
        assert time.monotonic() - started >= 0.29
        assert await closed(kept)
        assert time.monotonic() - answered >= 0.2  # (the answer left the server a bit earlier)
        assert connections.timed_out == 4

        assert await still_open(busy)  # served for longer than the deadline: left alone
        app.release.set()
        status, _, body = await answer(busy)
        assert (status, body) == (200, b'{"ok":true}')
        await busy.send(GET_OK)  # and the connection goes on serving
        assert (await answer(busy))[0] == 200
        assert len(connections.open) == 1


async def test_at_the_limit_a_new_connection_replaces_the_longest_waiting() -> None:
    """Past the limit the connection that has waited longest for a request is closed, so a
    client that sends its request at once is answered however many idle ones there are."""
    async with serving(App(), limit=4) as (connections, connect):
        idle = []
        for _ in range(4):
            idle.append(await connect())
            await until(lambda: len(connections.open) == len(idle))
        await idle[1].send(GET_OK)  # answered: it waits for its next request from now on
        assert (await answer(idle[1]))[0] == 200
        await idle[3].send(b"GET /ok HTTP/1.1\r\n")  # headers cut short: waiting too

        probe = await connect()
        await probe.send(GET_OK)
        assert (await answer(probe))[0] == 200
        assert await closed(idle[0])
        assert [await still_open(s) for s in idle[1:]] == [True, True, True]
        assert connections.evicted == 1

        # next in line: idle[2], idle[3], then idle[1] and the probe (answered since)
        another = await connect()
        assert await closed(idle[2], 1)
        assert [await still_open(s) for s in (idle[1], idle[3], probe)] == [True] * 3

        # the connections that were served a request are between two requests of a client:
        # kept (closing one could reset a request on its way); the empty ones make room
        more = [await connect() for _ in range(20)]
        await until(lambda: connections.evicted == 22)
        assert len(connections.open) == 4
        assert [await closed(s, 1) for s in (idle[3], another)] == [True] * 2
        assert [await still_open(s) for s in (idle[1], probe, *more[-2:])] == [True] * 4


async def test_when_every_connection_is_busy_a_new_one_is_refused_with_503() -> None:
    app = App()
    async with serving(app, limit=2) as (connections, connect):
        busy = [await connect() for _ in range(2)]
        for stream in busy:
            await stream.send(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: app.waiting == 2)

        extra = await connect()
        status, headers, body = await answer(extra)
        assert status == 503 and headers["connection"] == "close"
        assert json.loads(body) == {"error": "too many API connections, try again"}
        assert await closed(extra)
        assert connections.refused == 1 and connections.evicted == 0

        app.release.set()
        for stream in busy:
            assert (await answer(stream))[0] == 200


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
async def test_a_client_that_stops_reading_is_dropped(path: str) -> None:
    """An answer its client does not read (the transport's buffer full, uvicorn waiting for it
    to drain, or ``close()`` waiting for ever to flush it) does not hold its descriptor."""
    async with serving(App(), limit=4, request_timeout_s=0.3) as (connections, connect):
        reader = await connect()
        await reader.send(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await until(lambda: connections.timed_out == 1)
        assert await closed(reader)
        assert not connections.open


async def test_bad_requests_are_one_line_a_minute(
    structlog_to: Callable[[], io.StringIO],
) -> None:
    """uvicorn warns for every bad request: those lines are limited like any repeat."""
    out = structlog_to()
    api._quiet_uvicorn_logging()
    async with serving(App(), limit=8) as (_, connect):
        for _ in range(20):
            stream = await connect()
            await stream.send(b"NOT HTTP AT ALL\r\n\r\n")
            assert (await answer(stream))[0] == 400
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    server = [e for e in lines if e["event"] == "api.server"]
    assert len(server) == 1
    assert server[0]["message"] == "Invalid HTTP request received."
    assert server[0]["suppressed"] == 0


@pytest.fixture
def structlog_to() -> Iterator[Callable[[], io.StringIO]]:
    """Configure structlog to write JSON lines to a buffer; restore the configuration after."""
    saved = structlog.get_config()

    def configure() -> io.StringIO:
        out = io.StringIO()
        logs.configure_logging("json", "info", stream=out)
        return out

    yield configure
    structlog.configure(**saved)


async def test_keep_alive_clients_past_the_limit_see_answers_or_503_never_a_reset() -> None:
    """Twice the limit of keep-alive clients, each sending request after request: every
    request gets an answer, 200, or the client's connection is refused with a 503 before it
    sent anything. Regression: a connection between two requests of its client counted as
    the longest waiting and was closed with its next request already sent (a reset the client
    cannot tell from a lost request)."""
    async with serving(App(), limit=4) as (_connections, connect):
        outcomes: list[str] = []

        async def client() -> None:
            stream = await connect()
            for i in range(15):
                try:
                    await stream.send(GET_OK)
                    status = (await answer(stream))[0]
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    outcomes.append(f"reset after {i} answers")
                    return
                if status == 503 and i == 0:
                    outcomes.append("refused")
                    return
                assert status == 200
            outcomes.append("served")

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(client)
    assert not [o for o in outcomes if o.startswith("reset")], outcomes
    assert "served" in outcomes


async def test_pipelined_requests_are_taken_only_as_fast_as_they_are_answered() -> None:
    """Regression: uvicorn parsed every request a client had pipelined (all it read, up to
    256 KiB at a time, and on after each answer) and queued them all: a client pipelining
    requests faster than they were answered, or never reading the answers, grew the
    supervisor's memory without bound (1.2 GB for 20 MiB sent on 20 connections, /healthz
    answered seconds late). A few wait parsed now, the rest unread until answers go out,
    and every request is still answered, in order."""
    app = App()
    count = 2000
    async with serving(app, limit=4) as (connections, connect):
        stream = await connect()
        await stream.send(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n" + GET_OK * count)
        await until(lambda: app.waiting == 1 and len(connections.open) == 1)
        (conn,) = connections.open
        await until(lambda: len(conn.pipeline) >= api.MAX_PIPELINED)
        assert len(conn.pipeline) <= api.MAX_PIPELINED + api.FEED_PIECE // len(GET_OK)

        app.release.set()
        received = b""
        with anyio.fail_after(10):
            while received.count(b"HTTP/1.1 200 OK\r\n") < count + 1:
                received += await stream.receive(1 << 20)
        assert received.count(b'{"ok":true}') == count + 1


async def test_pipelined_requests_held_unparsed_are_not_taken_for_a_slow_client() -> None:
    """Regression: with requests of a pipelining client held unparsed (``MAX_PIPELINED`` of
    them waiting), the one parsed last was cut in its body, so the connection counted as
    waiting for the rest of a request from its client: while an earlier request was served
    it was closed at ``request_timeout_s`` (or evicted at the limit), every request it had
    sent lost, though all of them had arrived and only the server was behind."""
    app = App()
    body = b"x" * (2 * api.FEED_PIECE)  # longer than a piece: the held bytes cut a body
    post = b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    count = 2 * api.MAX_PIPELINED
    async with serving(app, limit=4, request_timeout_s=0.3) as (connections, connect):
        stream = await connect()
        await stream.send(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n" + post * count)
        await until(lambda: app.waiting == 1 and len(connections.open) == 1)
        (conn,) = connections.open
        await until(lambda: len(conn.pipeline) >= api.MAX_PIPELINED and bool(conn._held))
        assert not await closed(stream, 0.6)  # past the deadline, /wait still served
        assert connections.timed_out == 0

        app.release.set()
        received = b""
        with anyio.fail_after(5):
            while received.count(b"HTTP/1.1 200 OK\r\n") < count + 1:
                received += await stream.receive(1 << 20)
        assert received.count(b'{"ok":true}') == count + 1
