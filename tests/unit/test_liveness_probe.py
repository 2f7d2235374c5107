"""One liveness probe (``supervisor.worker._ask``) against a server on this machine."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import anyio
import httpx
import pytest

from supervisor.worker import _ask


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
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


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
