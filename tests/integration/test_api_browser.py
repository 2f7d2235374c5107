"""The API against what browsers and odd clients send: cross-site requests, DNS rebinding,
oversized request heads, tokens that cannot be sent (real server, real sockets)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from supervisor.client import Client, resolve
from supervisor.config import ApiSection
from supervisor.errors import ConfigError, UsageError
from supervisor.listen import load_token
from tests.conftest import SupervisorFactory
from tests.harness import Supervisor, worker_cmd

TOKEN = "s3cr3t-token"  # noqa: S105 - test data


def tokenless(supervisor: SupervisorFactory) -> Supervisor:
    """A supervisor with a tokenless API on loopback and one ready worker, a-0."""
    sup = supervisor(
        {
            "gpu": {"backend": "none"},
            "api": {"listen": "127.0.0.1:0"},
            "workers": [{"name": "a", "command": worker_cmd("ready_then_sleep")}],
        }
    )
    sup.ready("a-0")
    return sup


def test_a_web_page_cannot_act_on_or_read_a_tokenless_api(supervisor: SupervisorFactory) -> None:
    """Regression: a page on any site the operator had open could stop a worker with a
    cross-site "simple" POST (no preflight) to the default, tokenless 127.0.0.1 API, and read
    the API through DNS rebinding (a name of its own resolved to 127.0.0.1)."""
    sup = tokenless(supervisor)
    with sup.api() as http:
        answer = http.post(
            "/api/v1/workers/a-0/stop",
            headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
            content=b"x",
        )
        assert answer.status_code == 403, answer.text
        assert "cross-origin" in answer.json()["error"]
        assert http.get("/api/v1/workers/a-0").json()["state"] == "ready"
        for path in ("/api/v1/workers", "/metrics", "/"):  # fast path and framework alike
            rebound = http.get(path, headers={"Host": "evil.example:9811"})
            assert rebound.status_code == 403, (path, rebound.status_code)
        # the status page's own origin and programs without one are served
        origin = "http://" + urlsplit(sup.api_url()).netloc
        same = http.post("/api/v1/workers/a-0/restart", headers={"Origin": origin})
        assert same.status_code == 202, same.text
    assert sup.stop() == 0


def test_an_oversized_request_head_is_refused(supervisor: SupervisorFactory) -> None:
    """Regression: one client streaming an endless header line kept the supervisor's loop busy
    (the parser gathers the pieces by copying) until the request deadline, before any token
    was checked, and could reconnect at once."""
    sup = tokenless(supervisor)
    parts = urlsplit(sup.api_url())
    address = (parts.hostname, parts.port)
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        answer = b""
        try:
            for _ in range(64):  # 4 MiB at most: it is refused long before
                s.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = s.recv(64)
    assert answer.startswith(b"HTTP/1.1 431"), answer
    # the same head in one piece that ends it (regression: counted only while unfinished)
    with socket.create_connection(address, timeout=5) as s:
        head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000
        s.sendall(head + b"\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 431")
    # a big but reasonable head (cookies, long tokens) still works, on a kept-alive connection
    with sup.api() as http:
        for _ in range(2):
            ok = http.get("/healthz", headers={"X-Big": "a" * 32_000})
            assert ok.status_code == 200
        assert http.post("/api/v1/workers/a-0/restart", content=b"x" * 200_000).status_code == 202
    assert sup.stop() == 0


def test_tokens_that_cannot_be_sent_are_errors_not_tracebacks(tmp_path: Path) -> None:
    """Regression: a non-ASCII token was accepted by the server but could never match, and the
    client failed on it with a traceback; a token in the environment with a trailing newline
    (a Secret put into a variable) made every command fail with a message that printed it."""
    path = tmp_path / "token"
    path.write_text("tökén\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="printable ASCII"):
        load_token(ApiSection(listen="127.0.0.1:0", token_file=path))
    with pytest.raises(UsageError, match="GPU_SUPERVISOR_API_TOKEN") as info:
        resolve("http://127.0.0.1:9", None, {"GPU_SUPERVISOR_API_TOKEN": "tökén"})
    assert "tökén" not in str(info.value)
    assert resolve("http://127.0.0.1:9", None, {"GPU_SUPERVISOR_API_TOKEN": f"{TOKEN}\n"})[1] == (
        TOKEN
    )
    # a header value the HTTP library refuses is never echoed
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(10)

    def take_one() -> None:
        try:
            conn = srv.accept()[0]
        except OSError:
            return  # closed without a connection: the client failed before connecting
        with conn:
            conn.settimeout(10)
            conn.recv(65536)

    taker = threading.Thread(target=take_one, daemon=True)
    taker.start()
    try:
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        with Client(url, f"{TOKEN}\n", 5) as client, pytest.raises(UsageError) as bad:
            client.request("GET", "/api/v1/workers")
        assert TOKEN not in str(bad.value) and "could not be sent" in str(bad.value)
    finally:
        srv.close()
        taker.join(10)


def test_a_request_that_does_not_parse_gets_a_json_error(supervisor: SupervisorFactory) -> None:
    """Regression: a request line the HTTP parser refuses (`curl .../workers/gpen-ä` sends the
    name as raw UTF-8, not percent-encoded) got uvicorn's text/plain "Invalid HTTP request
    received." instead of the JSON error every other refusal is."""
    sup = tokenless(supervisor)
    parts = urlsplit(sup.api_url())
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as s:
        s.sendall("GET /api/v1/workers/a-ä HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert b"content-type: application/json" in head.lower(), answer
    error = json.loads(body)["error"]
    assert "percent-encoded" in error, error
    with sup.api() as http:  # the server goes on
        assert http.get("/api/v1/workers/a-0").status_code == 200
    assert sup.stop() == 0
