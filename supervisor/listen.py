"""The API's listening socket and token, opened before anything starts; the API itself later.

``open_api`` runs in the command line before the runtime: a port in use or an unusable token file
is a one-line error (exit 1 or 2) while nothing has been started yet. FastAPI and uvicorn take
about a fifth of a second to import, so ``serve_api`` imports ``supervisor.api`` in a thread
once the runtime has spawned its workers, and the kernel queues connections on the bound socket
until the server takes them.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.to_thread

from supervisor.config import ApiSection, parse_listen, token_problem
from supervisor.errors import ConfigError, ListenError

if TYPE_CHECKING:
    from supervisor.runtime import Runtime

BACKLOG = 128


@dataclass(frozen=True)
class BoundApi:
    """What ``open_api`` opened: the listening socket, its URL and the bearer token (or None)."""

    sock: socket.socket
    url: str
    token: str | None

    @property
    def unix_path(self) -> str | None:
        """The socket file of a unix-socket API (removed when the server stops)."""
        return self.url[len("unix:") :] if self.url.startswith("unix:") else None

    def close(self) -> None:
        """Close the socket and remove a unix socket's file."""
        self.sock.close()
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)


def open_api(api: ApiSection) -> BoundApi:
    """Read the token and bind ``api.listen``; ``ConfigError`` / ``ListenError`` in one line."""
    token = load_token(api)
    sock, url = bind(api.listen)
    return BoundApi(sock, url, token)


async def serve_api(
    bound: BoundApi,
    runtime: Runtime,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """A runtime service: import the API off the loop, then serve ``bound`` until cancelled.

    The runtime starts it once its workers are spawned. The import takes ~0.2 s in a thread: the
    loop goes on reaping and reading meanwhile, if more slowly (the GIL), where an import on the
    loop would hold everything, readiness and exits included, for that long.
    """
    try:
        # A stop asked for during start-up (or during the import) opens no API: its socket is
        # closed now. Regression: it started listening after the stop, answering meanwhile.
        if runtime.shutting_down:
            task_status.started()
            return
        api = await anyio.to_thread.run_sync(importlib.import_module, "supervisor.api")
        if runtime.shutting_down:
            task_status.started()
            return
        await api.serve(runtime, bound=bound, task_status=task_status)
    finally:
        bound.close()


def load_token(api: ApiSection) -> str | None:
    """The bearer token from ``api.token_file`` (None when unset); ``ConfigError`` if unusable.

    The file must not be readable or writable by group or others.
    """
    path = api.token_file
    if path is None:
        return None
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"api.token_file {path}: not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"api.token_file {path}: mode {mode:04o} lets group or others access the token "
                f"(chmod 600 {path})"
            )
        token = Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(f"api.token_file {path}: file not found") from None
    except UnicodeDecodeError:
        raise ConfigError(f"api.token_file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"api.token_file {path}: cannot read: {exc.strerror or exc}") from None
    problem = token_problem(token)
    if problem is not None:
        raise ConfigError(f"api.token_file {path}: {problem}")
    return token


def bind(listen: str) -> tuple[socket.socket, str]:
    """A listening socket for ``api.listen`` and its URL; ``ListenError`` in one line."""
    kind, host, port = parse_listen(listen)
    if kind == "unix":
        return _bind_unix(listen, host), f"unix:{host}"
    if kind != "tcp":
        raise ListenError("api.listen is off")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"api.listen {listen}: cannot resolve {host!r}: {exc.strerror}") from None
    # Each address the host resolves to, in turn, until one binds: ``localhost`` is often ::1
    # first, which a container with IPv6 turned off cannot bind (regression: only the first
    # was tried, and a family the kernel lacks failed in socket() with a traceback).
    errors: list[OSError] = []
    for family, socktype, proto, _, address in infos:
        try:
            # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets, and
            # without it a keep-alive client waits for a delayed ACK (40 ms) on every response.
            sock = socket.socket(family, socktype, proto or socket.IPPROTO_TCP)
        except OSError as exc:
            errors.append(exc)
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # the wildcard ``[::]`` takes IPv4 connections too (regression: IPv6 only, so
                # no listen value served both families); other addresses are of one family
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(address[0] != "::"))
            sock.bind(address)
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        break
    else:
        # an address in use says most (the port is taken), else the first address's error
        said = next((e for e in errors if e.errno == errno.EADDRINUSE), errors[0])
        raise ListenError(f"api.listen {listen}: {_os_error(said)}") from None
    sock.setblocking(False)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    return sock, f"http://{shown}:{bound_port}"


def _os_error(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


def _bind_unix(listen: str, path: str) -> socket.socket:
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ListenError(f"api.listen {listen}: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except PermissionError:
            # Regression: another user's socket (one a supervisor run as root left, or still
            # serves) was taken for a stale one, and its removal failed with a traceback.
            raise ListenError(
                f"api.listen {listen}: {path} is a socket of uid {os.lstat(path).st_uid} that "
                f"uid {os.geteuid()} may not connect to (a supervisor of that user may serve "
                "it): remove it, or listen elsewhere"
            ) from None
        except OSError:
            try:
                os.unlink(path)  # a stale socket of a supervisor that is gone
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise ListenError(
                    f"api.listen {listen}: cannot remove the stale socket {path}: {_os_error(exc)}"
                ) from None
        else:
            raise ListenError(
                f"api.listen {listen}: address already in use (another supervisor answers there)"
            )
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o660)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"api.listen {listen}: address already in use") from None
        raise ListenError(f"api.listen {listen}: {_os_error(exc)}") from None
    sock.setblocking(False)
    return sock


__all__: Sequence[str] = ("BACKLOG", "BoundApi", "bind", "load_token", "open_api", "serve_api")
