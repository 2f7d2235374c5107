"""Serve GET /health on PORT with HTTP/1.1 keep-alive, and lose every race of a kept-alive
connection: a connection's first request gets 200; a later request on it finds the
connection closed (as when the server's idle keep-alive timeout runs out just as the next
request arrives: uvicorn's 5 s, Node's 5 s). Each answer is said on stdout (``answered 200``)."""

import os
import socket
import threading

from common import say


def serve(conn: socket.socket) -> None:
    with conn:
        answered = False
        buf = b""
        while True:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
            if b"\r\n\r\n" not in buf:
                continue
            buf = b""
            if answered:
                return  # its idle timeout closed it as this request came in
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            answered = True
            say("answered 200")


server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(os.environ["PORT"])))
server.listen(64)
say("listening")
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
