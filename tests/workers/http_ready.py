"""Serve GET /health on PORT: 503 for argv[1] seconds, then 200 (``--redirect``: /health
answers 307 to /health/, which answers that, as a framework does for a route with a slash;
``--sick-when PATH``: 500 while PATH exists, as a server whose engine died behind a live HTTP
front; ``--sick-once PATH``: 500 for the one answer that finds PATH, which it removes;
``--stall-when PATH``: no answer for 30 s while PATH exists; ``--ignore-term``: SIGTERM is
ignored (a server that drains slowly: it serves until SIGKILL); ``--tls DIR``: HTTPS with
DIR/cert.pem and DIR/key.pem (a self-signed certificate); each answer is said on stdout,
``answered CODE``)."""

import http.server
import os
import signal
import ssl
import sys
import time

from common import say

ready_at = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 0.3)
redirect = "--redirect" in sys.argv
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _path_after(flag: str) -> str | None:
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None


sick_when, stall_when = _path_after("--sick-when"), _path_after("--stall-when")
sick_once = _path_after("--sick-once")


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if redirect and self.path == "/health":
            self.send_response(307)
            self.send_header("Location", "/health/")
            self.end_headers()
            return
        if stall_when is not None and os.path.exists(stall_when):
            say("stalling")
            time.sleep(30)
        code = 200 if time.monotonic() >= ready_at else 503
        if sick_when is not None and os.path.exists(sick_when):
            code = 500
        if sick_once is not None and os.path.exists(sick_once):
            os.unlink(sick_once)
            code = 500
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok" if code == 200 else b"loading")
        say(f"answered {code}")

    def log_message(self, format: str, *args: object) -> None:
        pass


server = http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler)
if (tls := _path_after("--tls")) is not None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(os.path.join(tls, "cert.pem"), os.path.join(tls, "key.pem"))
    server.socket = context.wrap_socket(server.socket, server_side=True)
say("listening")
server.serve_forever()
