"""A steady demo worker: speaks sd_notify (READY, WATCHDOG, STATUS) and serves GET / on PORT.

Stdlib only. Under gpu-supervisor it finds NOTIFY_SOCKET, WATCHDOG_USEC and PORT in its
environment; on its own it just serves.
"""

from __future__ import annotations

import http.server
import os
import signal
import sys
import threading
import time

from sdnotify import notify

NAME = os.environ.get("GPU_SUPERVISOR_WORKER", "steady")


class Handler(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the worker's name."""

    def do_GET(self) -> None:
        body = f"{NAME} ok\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    load_s = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    print(f"{NAME}: loading model for {load_s:g}s", flush=True)
    time.sleep(load_s)  # pretend to load weights
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", int(os.environ.get("PORT", "8001"))), Handler
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    notify("READY=1\nSTATUS=serving")
    print(f"{NAME}: ready on port {server.server_port}", flush=True)
    usec = int(os.environ.get("WATCHDOG_USEC", "0"))
    interval = usec / 3_000_000 if usec else 5.0
    served = 0
    while True:
        time.sleep(interval)
        served += 1
        notify(f"WATCHDOG=1\nSTATUS=serving, {served} heartbeats")


if __name__ == "__main__":
    main()
