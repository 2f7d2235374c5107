"""Serve GET /health on PORT: 503 for argv[1] seconds, then 200 (``--redirect``: /health
answers 307 to /health/, which answers that, as a framework does for a route with a slash)."""

import http.server
import os
import sys
import time

from common import say

ready_at = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 0.3)
redirect = "--redirect" in sys.argv


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if redirect and self.path == "/health":
            self.send_response(307)
            self.send_header("Location", "/health/")
            self.end_headers()
            return
        code = 200 if time.monotonic() >= ready_at else 503
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok" if code == 200 else b"loading")

    def log_message(self, format: str, *args: object) -> None:
        pass


server = http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler)
say("listening")
server.serve_forever()
