"""``api.listen`` bound on real sockets of both address families (IPv4, IPv6)."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from supervisor import listen
from supervisor.client import Client
from supervisor.errors import ListenError
from tests.conftest import SupervisorFactory
from tests.harness import worker_cmd


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(
    not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1 cannot be bound)"
)


def _resolves_to(monkeypatch: pytest.MonkeyPatch, name: str, *infos: tuple[Any, ...]) -> None:
    """Make ``name`` resolve to ``infos`` (as ``/etc/hosts`` would); other names as before."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if host != name:
            return real(host, port, *args, **kwargs)
        return [
            (family, socket.SOCK_STREAM, 6, "", (addr, port, *rest))
            for family, addr, *rest in infos
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_whose_first_address_cannot_be_bound_binds_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: only the first address a name resolves to was tried. ``localhost:9811``
    in a container whose /etc/hosts says ``::1 localhost`` first but whose IPv6 is turned off
    (Docker's default hosts file, ``disable_ipv6=1``) failed to start ("cannot assign requested
    address") though 127.0.0.1 was there to bind."""
    # 2001:db8::/32 is for documentation: no interface of this machine has such an address
    _resolves_to(
        monkeypatch,
        "localhost",
        (socket.AF_INET6, "2001:db8::1", 0, 0),
        (socket.AF_INET, "127.0.0.1"),
    )
    sock, url = listen.bind("localhost:0")
    with sock:
        port = sock.getsockname()[1]
        assert sock.family == socket.AF_INET
        assert url == f"http://127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass


def test_an_address_family_the_kernel_refuses_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a family the kernel does not support (``[::1]:9811`` on a kernel booted with
    ``ipv6.disable=1``) failed in ``socket()``, outside the error handling: the supervisor
    ended with an OSError traceback instead of the one-line ``api.listen`` error."""
    # a family with no support in this kernel stands in for IPv6 turned off at boot
    _resolves_to(monkeypatch, "::1", (socket.AF_APPLETALK, "::1", 0, 0))
    with pytest.raises(ListenError) as info:
        listen.bind("[::1]:9811")
    message = str(info.value)
    assert message.startswith("api.listen [::1]:9811: "), message
    assert "\n" not in message


@needs_ipv6
def test_the_ipv6_wildcard_takes_ipv4_connections_too() -> None:
    """Regression: ``api.listen = "[::]:9811"`` was bound IPv6-only: the API was unreachable
    on every IPv4 address (a dual-stack pod's IPv4 IP, 127.0.0.1), and since there is one
    ``listen`` value no setting could serve both families. ``[::]`` now takes both (as Go,
    Node and Python's http.server do); ``0.0.0.0`` stays IPv4 only."""
    sock, url = listen.bind("[::]:0")
    with sock:
        port = sock.getsockname()[1]
        assert url == f"http://[::]:{port}"
        for address in ("127.0.0.1", "::1"):
            with socket.create_connection((address, port), timeout=2):
                pass


@needs_ipv6
def test_an_ipv6_loopback_listen_binds_ipv6_loopback_only() -> None:
    """``[::1]`` is IPv6 loopback, nothing else (the wildcard's dual stack is not for it)."""
    sock, url = listen.bind("[::1]:0")
    with sock:
        port = sock.getsockname()[1]
        assert url == f"http://[::1]:{port}"
        with socket.create_connection(("::1", port), timeout=2):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _V6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


@pytest.fixture(params=["0.0.0.0", "::"])  # noqa: S104 - URLs, not binds
def wildcard_api(request: pytest.FixtureRequest) -> Iterator[str]:
    """A server that answers on loopback, and the URL of it with the wildcard address (the
    one ``api.listening`` logs for ``0.0.0.0:PORT`` or ``[::]:PORT``)."""
    wildcard: str = request.param
    if wildcard == "::" and not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1 cannot be bound)")
    server_class = _V6Server if wildcard == "::" else http.server.ThreadingHTTPServer
    server = server_class(("::1" if wildcard == "::" else "127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        yield f"http://[::]:{port}" if wildcard == "::" else f"http://0.0.0.0:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=2)


def test_a_wildcard_url_is_not_sent_through_the_proxy(
    monkeypatch: pytest.MonkeyPatch, wildcard_api: str
) -> None:
    """Regression: ``--url http://0.0.0.0:9811`` (the URL the supervisor logs as
    ``api.listening`` for a wildcard listen) was not taken for this machine, so with
    ``http_proxy`` set (many hosts and images) the client asked the proxy, and said "cannot
    reach the supervisor ...: is it running?" about one that ran."""
    with socket.socket() as closed:  # a proxy that refuses: nothing listens on its port
        closed.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with Client(wildcard_api, timeout=2) as client:
        assert client.json("/healthz") == {"status": "ok"}


def test_targets_name_the_host_the_health_url_reaches_the_worker_on(
    supervisor: SupervisorFactory,
) -> None:
    """Regression: ``/api/v1/targets`` always said ``127.0.0.1:PORT``, also for a worker whose
    readiness or liveness URL reaches it on another host (an IPv6-only server asked at
    ``http://[::1]:{port}/health``; a Node server that binds ``localhost``, ::1 only where
    that resolves to ::1 first): Prometheus scraped an address nothing listened on, and the
    target was down while the worker served. The host of the URL that names the worker's
    port is used; 127.0.0.1 where none does."""
    sleeper = worker_cmd("ready_then_sleep")
    groups: list[dict[str, Any]] = [
        {"name": "v6", "command": sleeper, "ready": "http://[::1]:{port}/health"},
        {"name": "lh", "command": sleeper, "health": {"liveness_url": "http://localhost:{port}/"}},
        {"name": "other", "command": sleeper, "ready": "http://[::1]:9/health?for={port}"},
        {"name": "plain", "command": sleeper},
    ]
    sup = supervisor({"workers": [{**g, "metrics_path": "/metrics"} for g in groups]})
    with sup.api() as http:
        workers = {w["name"]: w["port"] for w in http.get("/api/v1/workers").json()}
        targets = {t["labels"]["worker"]: t["targets"] for t in http.get("/api/v1/targets").json()}
    assert targets == {
        "v6-0": [f"[::1]:{workers['v6-0']}"],
        "lh-0": [f"localhost:{workers['lh-0']}"],
        "other-0": [f"127.0.0.1:{workers['other-0']}"],
        "plain-0": [f"127.0.0.1:{workers['plain-0']}"],
    }
    assert sup.stop() == 0
