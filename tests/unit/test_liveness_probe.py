"""One liveness probe (``supervisor.worker._ask``) against a server on this machine."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from supervisor.worker import _ask
from tests.harness import Flood, serving


class _Trickle(http.server.BaseHTTPRequestHandler):
    """Headers, then a byte of its body every 0.1 s: a server that is stuck, yet never
    silent for as long as a read timeout."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for _ in range(1000):
            try:
                self.wfile.write(b"x")
                self.wfile.flush()
            except OSError:
                return  # the prober gave up
            time.sleep(0.1)  # the server's pace, not the test waiting

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def trickle() -> Iterator[str]:
    with serving(_Trickle) as url:
        yield url + "/health"


def test_a_probe_gives_up_at_liveness_timeout_s_in_all(trickle: str) -> None:
    """liveness_timeout_s bounds the whole probe, as the docs say ("no 2xx within the
    timeout"), not each read (regression: an answer that trickled in never timed out, and a
    stuck server was never found hung)."""

    async def probe() -> tuple[bool | None, str] | None:
        async with httpx.AsyncClient(trust_env=False) as client:
            with anyio.fail_after(5):  # the test's own bound
                return await _ask(client, trickle, 0.5)

    began = time.monotonic()
    answer = anyio.run(probe)
    assert answer == (False, "timed out after 0.5 s")
    assert time.monotonic() - began < 2.0


def test_a_probe_reads_no_more_of_an_endless_answer_than_it_needs() -> None:
    """Regression: a probe read the whole body of the answer into memory: a liveness or
    readiness URL that streams (or answers with a huge body) grew the supervisor by what came
    in within the timeout, and a 200 that never ended was judged a timeout (a healthy worker
    restarted as hung). Only the start of the body is read; the status says it."""

    async def probe() -> tuple[bool | None, str] | None:
        async with httpx.AsyncClient(trust_env=False) as client:
            with anyio.fail_after(5):  # the test's own bound
                return await _ask(client, url + "/health", 3.0)

    # (well within the probe's timeout, which one reading the endless body waits out; with
    # room for a loaded machine: 0.9 s of a 1 s timeout was not always enough)
    with serving(Flood) as url:
        began = time.monotonic()
        answer = anyio.run(probe)
    assert answer == (True, "HTTP 200")
    assert time.monotonic() - began < 2.5


class _RedirectFlood(Flood):
    """``/health``: a redirect to ``/ok`` whose body never ends; ``/ok``: a 200; ``/loop``: a
    redirect to itself."""

    def do_GET(self) -> None:
        if self.path in ("/ok", "/loop"):
            self.send_response(200 if self.path == "/ok" else 302)
            if self.path == "/loop":
                self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(302)
        self.send_header("Location", "/ok")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for _ in range(1024):
                self.wfile.write(b"x" * 65536)
            self.wfile.flush()
            time.sleep(10)  # the server's pace, not a test waiting (its thread is a daemon)
        except OSError:
            return  # the prober gave up


def test_a_probe_reads_no_more_of_an_endless_redirect_than_it_needs() -> None:
    """Regression: httpx reads the whole body of a redirect before it follows it: a health
    URL answering a redirect whose body never ends (or is huge) grew the supervisor's memory
    and its probe never ended (a healthy worker never ready, or restarted as hung), past
    PROBE_BODY_MAX. Each answer of the chain is read as far as PROBE_BODY_MAX; a loop of
    redirects still ends at the client's limit."""
    from supervisor.worker import HttpProbes

    async def probe(path: str) -> tuple[bool | None, str] | None:
        probes = HttpProbes()  # the supervisor's client: redirects are followed
        try:
            with anyio.fail_after(5):  # the test's own bound
                return await _ask(probes.client(), url + path, 3.0)
        finally:
            await probes.aclose()

    with serving(_RedirectFlood) as url:
        began = time.monotonic()
        answer = anyio.run(probe, "/health")
        elapsed = time.monotonic() - began
        looped = anyio.run(probe, "/loop")
    assert answer == (True, "HTTP 200")
    assert elapsed < 2.5  # within the probe's timeout, as above
    assert looped == (False, "Exceeded maximum allowed redirects.")


class _Cookies(http.server.BaseHTTPRequestHandler):
    """Sets a cookie, and says in its body which cookies it was sent."""

    def do_GET(self) -> None:
        body = (self.headers.get("Cookie") or "").encode()
        self.send_response(200)
        self.send_header("Set-Cookie", f"session=from-{id(self.server)}; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_shared_probe_client_sends_no_worker_the_cookies_of_another() -> None:
    """One client asks every worker (HttpProbes): a cookie one worker's /health sets must not
    go to another worker (nor to the next process on its port), as it did not when each
    probe had a client of its own."""
    from supervisor.worker import HttpProbes

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Cookies) for _ in range(2)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{s.server_address[1]}/health" for s in servers]

    async def probe() -> list[str]:
        probes = HttpProbes()
        try:
            with anyio.fail_after(5):  # the test's own bound
                got = []
                for url in [*urls, *urls]:
                    got.append((await probes.client().get(url, timeout=2.0)).text)
                return got
        finally:
            await probes.aclose()

    try:
        assert anyio.run(probe) == ["", "", "", ""]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class _Loading(http.server.BaseHTTPRequestHandler):
    """A model server still loading: 503 on every GET, connection kept alive."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_each_worker_is_probed_through_a_connection_pool_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: one HTTP client probed every worker, so its one connection pool held a
    kept-alive connection to each worker, and httpx searches the pool at every request: a
    probe's CPU grew with the number of workers (64 workers loading, each probed every
    0.2 s: 2.3 ms a probe instead of 0.7 ms, 0.77 of a core spent by the supervisor while they
    loaded). Each worker's probes go through a client (a pool) of its own, the same one from
    probe to probe; the clients share one TLS context (made once: loading the CA store costs
    ~50 ms); a removed worker's client is closed."""
    from supervisor.worker import HttpProbes

    made: list[object] = []
    real = httpx.create_ssl_context

    def counted(*args: object, **kwargs: object) -> object:
        made.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(httpx, "create_ssl_context", counted)
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Loading) for _ in range(4)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{s.server_address[1]}/health" for s in servers]

    async def probe() -> tuple[int, int, bool, bool]:
        probes = HttpProbes()
        try:
            with anyio.fail_after(5):  # the test's own bound
                clients = [probes.client(f"w-{i}") for i in range(len(urls))]
                for _ in range(2):
                    for i, url in enumerate(urls):
                        client = probes.client(f"w-{i}")
                        assert client is clients[i]  # the same pool from probe to probe
                        assert (await client.get(url, timeout=2.0)).status_code == 503
                await probes.forget("w-0")
                return (
                    len({id(c) for c in clients}),
                    len(made),
                    clients[0].is_closed and not clients[1].is_closed,
                    probes.client("w-0") is not clients[0],
                )
        finally:
            await probes.aclose()

    try:
        assert anyio.run(probe) == (4, 1, True, True)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class _TlsToPlainHttp(httpx.AsyncBaseTransport):
    """The TLS handshake of an https URL answered in plain HTTP, as Python built on OpenSSL
    3.2 or later says it (this machine's OpenSSL may say WRONG_VERSION_NUMBER instead)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import ssl

        error = ssl.SSLError(1, "[SSL: RECORD_LAYER_FAILURE] record layer failure (_ssl.c:1000)")
        error.reason = "RECORD_LAYER_FAILURE"
        error.library = "SSL"
        try:
            raise error
        except ssl.SSLError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc


def test_an_https_url_of_a_plain_http_server_is_unaskable_on_openssl_3_2_too() -> None:
    """Regression: an https liveness URL asked of a worker serving plain HTTP is a mistake of
    the URL's (None: not probed again), but only OpenSSL's WRONG_VERSION_NUMBER was taken for
    it; OpenSSL 3.2 and later say RECORD_LAYER_FAILURE ("record layer failure") for the same
    answer, and there the healthy worker was restarted as hung, again and again."""

    async def probe() -> tuple[bool | None, str]:
        async with httpx.AsyncClient(transport=_TlsToPlainHttp()) as client:
            with anyio.fail_after(5):  # the test's own bound
                return await _ask(client, "https://127.0.0.1:1/health", 1.0)

    ok, why = anyio.run(probe)
    assert ok is None and "record layer failure" in why, (ok, why)


def test_a_probe_in_flight_while_the_supervisor_is_stalled_is_asked_again(
    tmp_path: Path,
) -> None:
    """Regression: a liveness probe in flight while the supervisor was stalled with its workers
    (a paused VM or container, a frozen cgroup, a starved CPU) for longer than
    ``liveness_timeout_s`` timed out the moment it resumed, before the worker, resumed too,
    could answer: counted as a failed probe, and with ``liveness_failures = 1`` the healthy
    worker was restarted as hung. A timeout noticed well after it passed is not judged: the
    worker is asked again at once, as a heartbeat deadline noticed late gets a grace."""
    import dataclasses

    from supervisor.model import Liveness, WorkerState
    from supervisor.policy import lifecycle as lc
    from tests.unit.test_worker_queue import closed, runner

    asked: list[float] = []
    first_asked, thawed = threading.Event(), threading.Event()
    done = threading.Event()  # asked a third time (the stalled probe judged), or given up
    timeout = 0.3

    class FrozenWithTheSupervisor(http.server.BaseHTTPRequestHandler):
        """A healthy worker frozen with the supervisor (``docker pause``, ``systemctl
        freeze``): its first answer goes out a moment after the freeze ends."""

        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            asked.append(time.monotonic())
            first_asked.set()
            if len(asked) == 1:
                thawed.wait(5)  # (the test's bound)
                time.sleep(0.05)  # the worker's pace once it runs again, not the test waiting
            elif len(asked) >= 3:
                done.set()
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    async def main(url: str) -> tuple[list[object], str | None, tuple[int, str]]:
        r = runner(tmp_path)
        live = Liveness(url + "/health", interval_s=0.05, timeout_s=timeout, failures=1)
        r.spec = dataclasses.replace(r.spec, liveness=live)
        r.record = lc.WorkerRecord(state=WorkerState.READY, pid=42)
        r._current_pid = lambda: 42  # type: ignore[method-assign]

        async def probing() -> None:
            try:
                await r._probe_liveness(42)
            finally:
                done.set()  # (it gave up on the worker: the old behaviour)

        try:
            with anyio.fail_after(5):  # the test's own bound
                async with anyio.create_task_group() as tg:
                    tg.start_soon(probing)
                    await anyio.to_thread.run_sync(first_asked.wait, 5)
                    # the freeze: the supervisor's loop blocked past the probe's timeout
                    time.sleep(timeout + 0.5)  # noqa: ASYNC251
                    thawed.set()
                    await anyio.to_thread.run_sync(done.wait, 5)
                    tg.cancel_scope.cancel()
            queued: list[object] = []
            while not r.inbox_empty():
                queued.append(r._recv.receive_nowait())
            return queued, r.liveness_failed, r.liveness_failing
        finally:
            await r._probes.aclose()
            closed(r)

    with serving(FrozenWithTheSupervisor) as url:
        queued, failed, failing = anyio.run(main, url)
    assert queued == [] and failed is None, (queued, failed)
    assert failing == (0, "") and len(asked) >= 3, (failing, asked)
