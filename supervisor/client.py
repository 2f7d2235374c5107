"""Client commands of the CLI: ``status``, ``drain``, ``restart [--rolling]``, ``stop``, ``start``,
``cordon``, ``uncordon``, all through the HTTP API of a running supervisor.

The API is found from ``--url`` or from ``-c FILE`` (its ``[api] listen``; ``unix:/path`` goes
through a unix-socket transport), else from ``GPU_SUPERVISOR_API__LISTEN``, else the default
``127.0.0.1:9811``. The token comes from
``GPU_SUPERVISOR_API_TOKEN`` or the config's ``api.token_file``.

Exit codes (through the errors raised): 0 ok; 1 (``ApiClientError``) when the supervisor is not
running, refuses the command as impossible now (409) or fails; 2 (``UsageError``/``ConfigError``)
for bad use: an unknown worker, group or GPU (404), a bad value (400/422), a missing or wrong
token (401).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from supervisor.client_args import DEFAULT_TIMEOUT_S
from supervisor.errors import ApiClientError, ConfigError, UsageError, connection_reason

# supervisor.config (pydantic, ~150 ms) is imported where a command first reads a setting:
# `--help`, `--version` and a usage error are answered without it.
if TYPE_CHECKING:
    import httpx

    from supervisor.config import Settings
    from supervisor.output import RotatingFile

TOKEN_ENV = "GPU_SUPERVISOR_API_TOKEN"  # noqa: S105 - a variable name, not a secret
API = "/api/v1"


def _check_name(what: str, name: str) -> None:
    """A worker, group or GPU name fits one URL path segment: not empty, ``.``, ``..`` or with a
    ``/`` (they would name another path, or none, and the answer would not say which)."""
    if name in ("", ".", "..") or "/" in name:
        raise UsageError(f"gpu-supervisor: {what} {name!r}: no such name can exist")


# --- connection -------------------------------------------------------------------------------


def url_for(listen: str) -> str | None:
    """The URL a client on this machine uses for ``api.listen`` (None: off, or port 0)."""
    from supervisor.config import parse_listen

    kind, host, port = parse_listen(listen)
    if kind == "unix":
        return f"unix:{host}"
    if kind != "tcp" or port == 0:
        return None
    if host == "0.0.0.0":  # noqa: S104 - a wildcard bind is reached through loopback
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def read_token_file(path: Path) -> str:
    """The token in ``path`` (``ConfigError`` when it cannot be read)."""
    from supervisor.config import token_problem

    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"api.token_file {path}: cannot read: {why}") from None
    problem = token_problem(token)
    if problem is not None:
        raise ConfigError(f"api.token_file {path}: {problem}")
    return token


def client_settings(config: str, *, warn: bool = True) -> Settings:
    """``config``'s settings for a client command: a mistake outside the sections it reads is
    a warning on stderr (``config.load_client_settings``), not an error (``warn=False``: not
    even that, for ``reload``, whose answer names the mistake)."""
    from supervisor.config import load_client_settings

    settings, warning = load_client_settings(config)
    if warning is not None and warn:
        print(f"gpu-supervisor: warning: {warning}", file=sys.stderr)
    return settings


def resolve(
    url: str | None,
    config: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    warn: bool = True,
    read_only: bool = False,
    open_only: bool = False,
) -> tuple[str, str | None]:
    """``(url, token)`` from ``--url``, ``-c FILE`` and the environment. ``read_only``: the
    command only GETs (``status``, ``health``), which needs no token unless ``auth_read``: a
    token file this user cannot read is then no error (the service user's 0600 file, read by
    an operator's shell or a probe). ``open_only``: the command asks only what never needs a
    token (``health``: ``/healthz``): the token file is not read at all."""
    from supervisor.config import environment_client_settings, http_url, parse_listen, token_problem

    environ = os.environ if environ is None else environ
    api = client_settings(config, warn=warn).api if config else environment_client_settings().api
    if url is None:
        url = url_for(api.listen)
        if url is None:
            where = f"{config}: " if config else ""
            if parse_listen(api.listen)[0] == "off":
                raise UsageError(f'gpu-supervisor: {where}api.listen is "" (the API is off)')
            raise UsageError(
                f"gpu-supervisor: {where}api.listen {api.listen} picks a free port: pass --url"
            )
    elif not (url.startswith("unix:/") or http_url(url)):
        raise UsageError(f"gpu-supervisor: --url {url!r}: expected http://HOST:PORT or unix:/path")
    elif not url.startswith("unix:"):
        import httpx

        try:
            httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise UsageError(f"gpu-supervisor: --url {url!r}: {exc}") from None
    # stripped as the file is: a secret put into the environment often ends with a newline
    token = environ.get(TOKEN_ENV, "").strip() or None
    if token is not None and (problem := token_problem(token)) is not None:
        raise UsageError(f"gpu-supervisor: {TOKEN_ENV}: {problem}")
    if token is None and api.token_file is not None and not open_only:
        if read_only and not api.auth_read and not os.access(api.token_file, os.R_OK):
            return url, None
        token = read_token_file(api.token_file)
    return url, token


def is_local(url: str) -> bool:
    """A unix socket, a loopback address (``localhost``, ``127.x``, ``::1``) or a wildcard one
    (``0.0.0.0``, ``::``: a connection to it reaches this machine; the URL ``api.listening``
    logs for a wildcard listen, regression: sent to the ``http_proxy``)."""
    from supervisor.config import is_loopback

    if url.startswith("unix:"):
        return True
    host = urlsplit(url).hostname or ""
    return is_loopback(host) or host in ("0.0.0.0", "::")  # noqa: S104 - not a bind


class Client:
    """A small synchronous client of the supervisor's API."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        import httpx  # only client commands need it: `run` starts ~30 ms sooner without it

        self.url = url
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url.startswith("unix:"):
            transport = transport or httpx.HTTPTransport(uds=url[len("unix:") :])
            base = "http://localhost"
        else:
            base = url.rstrip("/")
        self._http = httpx.Client(
            base_url=base,
            headers=headers,
            timeout=timeout,
            transport=transport,
            # http_proxy/HTTPS_PROXY (set on many hosts and images) are for the outside world,
            # not for a supervisor on this machine
            trust_env=not is_local(url),
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, ok: Sequence[int] = (200,)) -> httpx.Response:
        """Send one request; return the response if its status is one of ``ok`` or a 404."""
        import httpx

        try:
            response = self._http.request(method, path)
        except httpx.LocalProtocolError:  # its text holds the header, which may be the token
            raise UsageError(
                "gpu-supervisor: the request could not be sent (a header value, such as the "
                "token, is not valid in HTTP)"
            ) from None
        except httpx.TimeoutException:
            raise ApiClientError(
                f"no answer from the supervisor at {self.url} (timed out)"
            ) from None
        except httpx.TransportError as exc:
            reason = connection_reason(exc)
            if reason == "permission denied":  # it runs; this user may not open its socket
                raise ApiClientError(
                    f"cannot reach the supervisor at {self.url}: permission denied (run as "
                    "a user who may open its socket, e.g. the service's user or group)"
                ) from None
            raise ApiClientError(
                f"cannot reach the supervisor at {self.url}: is it running? ({reason})"
            ) from None
        except httpx.DecodingError as exc:  # no transport error: a body its encoding garbles
            raise ApiClientError(
                f"the answer from {self.url} cannot be read ({exc}): is --url right?"
            ) from None
        if response.status_code in ok:
            return response
        message = _error_text(response)
        if response.status_code in (400, 401, 403, 404, 422):
            raise UsageError(f"gpu-supervisor: {message}")
        raise ApiClientError(message)

    def json(self, path: str) -> Any:
        """GET ``path`` and return its JSON."""
        return self.request("GET", path).json()


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return f"{body['error']} (HTTP {response.status_code})"
    return f"HTTP {response.status_code} from {response.request.url.path}"


# --- commands ---------------------------------------------------------------------------------

#: How often ``restart --rolling --wait`` asks for new events.
ROLLOUT_POLL_S = 0.5


#: ``/api/v1/events``' header naming the supervisor's run (its ``seq`` starts at 1 in each).
RUN_HEADER = "X-Gpu-Supervisor-Run"
RESTARTED = "gpu-supervisor: the supervisor restarted meanwhile: what it was doing is not known"


def _last_seq(client: Client) -> int:
    events = client.request("GET", f"{API}/events").json()
    return int(events[-1]["seq"]) if events else 0


class _Journal:
    """Polls ``/api/v1/events`` after ``seen``; ``restarted`` once the answers come from
    another run of the supervisor than the first (its numbering started again)."""

    def __init__(self, client: Client, seen: int) -> None:
        self.client = client
        self.seen = seen
        self.run: str | None = None
        self.restarted = False

    def next(self) -> list[dict[str, Any]]:
        answer = self.client.request("GET", f"{API}/events?since={self.seen}")
        run = answer.headers.get(RUN_HEADER)
        if self.run is None:
            self.run = run
        elif run is not None and run != self.run:
            self.restarted = True
            return []
        events: list[dict[str, Any]] = answer.json()
        for e in events:
            self.seen = max(self.seen, int(e["seq"]))
        return events


def _wait_rollout(client: Client, group: str, seen: int, request: int | None = None) -> int:
    """Wait for the journal's ``rollout.done`` / ``rollout.halted`` of ``group``'s rolling
    restart (after event ``seen``) numbered ``request`` (None: a supervisor that numbers none,
    the first); 0 when done, 1 when halted."""
    journal = _Journal(client, seen)
    while True:
        try:
            events = journal.next()
        except ApiClientError:
            # it took the rolling restart, then went (regression: "cannot reach the
            # supervisor", as if its address were wrong)
            print(
                f"gpu-supervisor: the supervisor stopped before the rolling restart of {group} "
                "finished",
                file=sys.stderr,
            )
            return 1
        if journal.restarted:
            print(RESTARTED, file=sys.stderr)
            return 1
        for e in events:
            mine = request is None or e.get("request") == request
            if e.get("group") == group and e.get("kind") == "rolling_restart" and mine:
                if e["type"] == "rollout.done":
                    print(f"{group}: rolling restart done")
                    return 0
                if e["type"] == "rollout.halted":
                    where = f" at {e['worker']}" if e.get("worker") else ""
                    why = f": {e['reason']}" if e.get("reason") else ""
                    print(f"{group}: rolling restart halted{where}{why}")
                    return 1
        time.sleep(ROLLOUT_POLL_S)


def _wait_reload(client: Client, request: int, seen: int, rollouts: bool) -> int:
    """Follow the journal (after event ``seen``) to the verdict on reload ``request``: 0 when
    the file was taken (and, with ``rollouts``, every roll-out it started completed), 1 when a
    roll-out halted or it was rejected for something else, 2 for a bad config file."""
    accepted = False
    journal = _Journal(client, seen)
    while True:
        try:
            events = journal.next()
        except ApiClientError:
            if not accepted:
                raise
            print(
                "gpu-supervisor: the supervisor stopped before the reload's roll-outs finished",
                file=sys.stderr,
            )
            return 1
        if journal.restarted:
            print(RESTARTED, file=sys.stderr)
            return 1
        for e in events:
            if not str(e["type"]).startswith("reload.") or int(e.get("request", 0)) < request:
                continue
            if e["type"] == "reload.rejected":
                why = f"{e['reason']}: {e['error']}" if e.get("error") else e["reason"]
                print(f"gpu-supervisor: reload rejected ({why}); nothing changed", file=sys.stderr)
                return 2 if e["reason"] in ("bad config", "command") else 1
            if e["type"] == "reload.accepted":
                accepted = True
                print(_reload_summary(e), flush=True)
                if not rollouts:
                    return 0
            if e["type"] == "reload.done" and e.get("interrupted"):
                print(
                    "gpu-supervisor: the supervisor stopped before the reload's roll-outs finished",
                    file=sys.stderr,
                )
                return 1
            if e["type"] == "reload.done":
                if e.get("halted"):
                    print(
                        f"roll-out halted for {', '.join(e['halted'])} (see the log: "
                        "supervisor.rollout_halted)"
                    )
                if e.get("superseded"):
                    print(
                        f"roll-out superseded for {', '.join(e['superseded'])}: a later "
                        "reload took it over and rolls out its own file from where this one "
                        "stopped (its verdict is that reload's)"
                    )
                if e.get("halted") or e.get("superseded"):
                    return 1
                print("reload done: every roll-out completed")
                return 0
        time.sleep(ROLLOUT_POLL_S)


def _reload_summary(e: Mapping[str, Any]) -> str:
    scaled = list(e.get("scaled") or ())
    groups = {
        "added": list(e.get("added") or ()),
        "removed": list(e.get("removed") or ()),
        "changed": [g for g in e.get("changed") or () if g not in scaled],  # scaled: changed too
        "scaled": scaled,
    }
    parts = [f"{what} {', '.join(names)}" for what, names in groups.items() if names]
    line = "reload accepted: " + ("; ".join(parts) if parts else "no group changed")
    if e.get("start_only_keys"):
        line += f" (read at start only, restart to apply: {', '.join(e['start_only_keys'])})"
    return line


def main(args: argparse.Namespace) -> int:
    """Run one client command; return the exit code (errors are raised)."""
    if args.command in ("cordon", "uncordon"):
        _check_name("GPU", args.gpu)
    elif args.command == "logs":
        _check_name("worker", args.name)
    elif args.command not in ("status", "reload", "health"):
        _check_name("worker or group", args.name)
    url, token = resolve(
        args.url,
        args.config,
        warn=args.command not in ("reload", "health"),
        read_only=args.command in ("status", "health", "logs"),
        # (regression: with auth_read, a token file this user cannot read failed a liveness
        # check that needs no token)
        open_only=args.command == "health" and not args.ready,
    )
    with Client(url, token, args.timeout) as client:
        try:
            return _run(client, args)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            # not JSON, or not the JSON of a gpu-supervisor (--url names some other server)
            raise ApiClientError(
                f"the answer from {url} is not a gpu-supervisor's "
                f"({type(exc).__name__}: {str(exc)[:200]}): is --url right?"
            ) from None


def _run(client: Client, args: argparse.Namespace) -> int:
    """The command ``args`` names, against ``client``."""
    if args.command == "status":
        return status(client, args.json)
    if args.command == "health":
        return health(client, args.ready)
    if args.command == "logs":
        local = _local_log(args, client.url) if args.follow else None
        return logs(client, args.name, args.lines, args.follow, local=local)
    if args.command == "signal":
        return send_signal(client, args.signal, args.name)
    if args.command in ("cordon", "uncordon"):
        lift = args.command == "uncordon" and args.lift_quarantine
        path = f"{API}/gpus/{_quote(args.gpu)}/{args.command}"
        body = client.request("POST", path + ("?lift_quarantine=true" if lift else "")).json()
        verb = "cordoned" if body["cordoned"] else "uncordoned"
        if lift and not body["quarantined"]:
            verb += ", out of quarantine"
        elif body["quarantined"]:
            # a cordon is lifted, a quarantine (a device-fatal XID) only when asked: say so
            verb += ", but still quarantined (a device-fatal XID or lost: nothing is placed"
            verb += " on it; `uncordon --lift-quarantine` once it has been reset or repaired)"
        # (id null: a GPU no longer listed, a replaced one's cordon lifted)
        named = body["uuid"] if body["id"] is None else f"{body['id']} ({body['uuid']})"
        print(f"GPU {named} {verb}")
        return 0
    if args.command == "reload":
        seen = _last_seq(client)
        request = client.request("POST", f"{API}/reload", ok=(202,)).json()["request"]
        return _wait_reload(client, int(request), seen, args.wait)
    if args.command == "restart" and args.rolling:
        seen = _last_seq(client) if args.wait else 0
        path = f"{API}/groups/{_quote(args.name)}/rolling-restart"
        accepted = client.request("POST", path, ok=(202,))
        print(f"{args.name}: rolling restart started (one worker at a time)", flush=True)
        if args.wait:
            # its own roll-out's verdict, by the request number the 202 gives (an older
            # supervisor gives none: the group's first verdict, as before)
            body = accepted.json()
            number = body.get("request") if isinstance(body, dict) else None
            request = number if isinstance(number, int) else None
            return _wait_rollout(client, args.name, seen, request)
        return 0
    if getattr(args, "wait", False):
        raise UsageError("gpu-supervisor restart: --wait goes with --rolling")
    return command(client, args.command, args.name)


def _local_log(args: argparse.Namespace, url: str) -> RotatingFile | None:
    """Worker ``args.name``'s log files in the ``state_dir`` of ``-c`` (or the environment's),
    for a supervisor on this machine (None for one elsewhere)."""
    if not is_local(url):
        return None
    from supervisor.config import environment_client_settings
    from supervisor.output import RotatingFile  # (structlog, anyio: not at every command)

    sup = (
        client_settings(args.config, warn=False) if args.config else environment_client_settings()
    ).supervisor
    return RotatingFile(sup.state_dir / "logs" / f"{args.name}.log", 0, sup.log_backups)


def _quote(segment: str) -> str:
    return quote(segment, safe="")


def _post_to_worker_or_group(
    client: Client, name: str, action: str, ok: int
) -> tuple[dict[str, Any], bool]:
    """POST ``action`` (``restart``, ``signal?signal=USR1``) to worker ``name``, else to the
    group of that name (``ok``: the status it answers); the answer, and whether it was the
    group's."""
    try:
        path = f"{API}/workers/{_quote(name)}/{action}"
        return client.request("POST", path, ok=(ok,)).json(), False
    except UsageError as exc:
        if "unknown worker" not in str(exc):
            raise
    try:
        path = f"{API}/groups/{_quote(name)}/{action}"
        return client.request("POST", path, ok=(ok,)).json(), True
    except UsageError as exc:
        if "unknown group" not in str(exc):
            raise
        raise UsageError(f"gpu-supervisor: unknown worker or group {name!r}") from None


def command(client: Client, verb: str, name: str) -> int:
    """``drain|restart|stop|start NAME``: a worker, else a group of that name."""
    body, group = _post_to_worker_or_group(client, name, verb, 202)
    if group:
        names = ", ".join(w["name"] for w in body["workers"])
        print(f"{name}: {verb} requested for {len(body['workers'])} workers ({names})")
    else:
        print(f"{name}: {verb} requested (was {body['state']})")
    return 0


def send_signal(client: Client, sig: str, name: str) -> int:
    """``signal SIG NAME``: a worker, else a group of that name."""
    # as kill(1) and the config take them: "usr1", "sigterm" (the API's schema names them
    # in capitals)
    query = f"signal?signal={_quote(sig.strip().upper())}"
    body, group = _post_to_worker_or_group(client, name, query, 200)
    if group:
        sent = ", ".join(f"{w['name']} (pid {w['pid']})" for w in body["workers"])
        print(f"{name}: {sig} sent to {len(body['workers'])} workers: {sent}")
    else:
        print(f"{name}: {sig} sent (pid {body['pid']})")
    return 0


def health(client: Client, ready: bool) -> int:
    """``health [--ready]``: 0 when the supervisor answers (and with ``ready``, when every
    group has a ready worker), else 1 with the reason; a one-line answer either way."""
    if not ready:
        body = client.request("GET", "/healthz").json()
        print(f"ok: gpu-supervisor {body['version']}, up {body['uptime_s']:.0f} s")
        return 0
    answer = client.request("GET", "/readyz", ok=(200, 503))
    body = answer.json()
    if answer.status_code == 200 and body["ready"]:
        groups = body["groups"]
        ready_n = sum(g["ready"] for g in groups.values())
        print(f"ready: {ready_n}/{sum(g['workers'] for g in groups.values())} workers ready")
        return 0
    print(f"not ready: {body.get('error') or answer.status_code}")
    return 1


#: ``logs``: how often ``-f`` asks for more (its first lines: ``client_args.LOG_LINES``); the
#: most it asks for at once (the API's ``limit``); the first read of a tail.
LOG_POLL_S = 0.5
LOG_READ_MAX = 1024 * 1024
LOG_TAIL_FIRST = 65536


def _out(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


#: What a terminal acts on instead of showing it: the C0 controls but tab and newline (ESC
#: starts the sequences that clear the screen, move the cursor, set the title or the
#: clipboard), DEL, the C1 controls (CSI is U+009B), and a carriage return that does not end a
#: line (the line is written over: a fake one in its place).
_CONTROL = re.compile(r"\r(?!\n)|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` (a worker's output, or what a file says of it) with what a terminal would act
    on shown escaped (``\\x1b``): what it shows is what was written, nothing rewrites the
    operator's screen."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class _LogOut:
    """Where ``logs`` writes a worker's output: its bytes as they are (piped, redirected: a
    copy of the log), or on a terminal as text with the control characters escaped
    (``printable``; a byte that is not UTF-8 as ``\\xff``)."""

    def __init__(self, terminal: bool) -> None:
        self.terminal = terminal
        self._cr = ""  # a carriage return at the end of a read: a CRLF's, if a newline follows
        self._decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")

    def write(self, data: bytes, *, final: bool = False) -> None:
        """``final``: nothing follows (a character or CRLF cut short is shown as it is)."""
        if not self.terminal:
            _out(data)
            return
        text = self._cr + self._decoder.decode(data, final)
        self._cr = "\r" if text.endswith("\r") and not final else ""
        text = text[: len(text) - len(self._cr)]
        _out(printable(text).encode(sys.stdout.encoding or "utf-8", "backslashreplace"))

    def lost(self) -> None:
        """What follows does not continue what came before (some of the log is gone)."""
        self.write(b"", final=True)


def logs(
    client: Client,
    name: str,
    lines: int,
    follow: bool,
    sleep: Callable[[float], object] = time.sleep,
    local: RotatingFile | None = None,
) -> int:
    """``logs NAME [-n N] [-f]``: the last ``lines`` lines of the worker's log, then (``follow``)
    what comes after them, every byte once across rotations (``GET .../workers/NAME/log``).
    ``local``: the log's files as this machine sees them, where what the worker wrote after
    the last poll is read once the API no longer answers for it."""
    path = f"{API}/workers/{_quote(name)}/log"
    out = _LogOut(sys.stdout.isatty())
    limit = LOG_TAIL_FIRST if lines else 1  # -n 0: only where the log ends
    while True:  # enough of the end for `lines` lines (a line may be long)
        answer = client.request("GET", f"{path}?limit={limit}")
        data = answer.content
        offset = int(answer.headers["X-Log-Offset"])
        whole = len(data) < limit  # the whole log (its oldest byte kept) is in `data`
        if not lines or whole or data.count(b"\n") > lines or limit >= LOG_READ_MAX:
            break
        limit = min(LOG_READ_MAX, limit * 4)
    if lines:
        if not whole:  # the first line is cut
            data = data[data.find(b"\n") + 1 :] if b"\n" in data else data
        pieces = [line + b"\n" for line in data.split(b"\n")]  # not at "\r": a progress bar
        pieces[-1] = pieces[-1][:-1]  # what follows the last newline (if anything)
        if not pieces[-1]:
            pieces.pop()
        out.write(b"".join(pieces[-lines:]), final=not follow)
    if not follow:
        return 0
    file = answer.headers["X-Log-File"]
    while True:
        try:
            answer = client.request(
                "GET", f"{path}?limit={LOG_READ_MAX}&file={_quote(file)}&offset={offset}"
            )
        except UsageError as exc:
            if "unknown worker" not in str(exc):
                raise
            _rest_of_log(local, file, offset, out)
            raise ApiClientError(f"{name} is gone (a reload removed it)") from None
        except ApiClientError:
            _rest_of_log(local, file, offset, out)  # its last words, written after our last poll
            raise
        if answer.headers.get("X-Log-Lost"):
            print(
                f"gpu-supervisor: some of {name}'s log was gone before it was read "
                "(rotated past its last backup, or emptied on a full disk)",
                file=sys.stderr,
                flush=True,
            )
            out.lost()
        if answer.content:
            out.write(answer.content)
        file, offset = answer.headers["X-Log-File"], int(answer.headers["X-Log-Offset"])
        if len(answer.content) < LOG_READ_MAX:
            sleep(LOG_POLL_S)


def _rest_of_log(local: RotatingFile | None, file: str, offset: int, out: _LogOut) -> None:
    """What the log files hold after ``file``/``offset`` (a follower's place), read from the
    files themselves; nothing where they cannot be read or no longer hold that place."""
    try:
        while local is not None:
            chunk = local.read(LOG_READ_MAX, file, offset)
            if chunk.lost or not chunk.data:  # not that place (nothing said twice), or all
                break
            out.write(chunk.data)
            file, offset = chunk.file, chunk.offset
    except OSError:  # not this user's to read
        pass
    out.lost()  # nothing follows: a character or CRLF cut short is shown as it is


def status(client: Client, as_json: bool) -> int:
    """``status``: GPUs, then workers."""
    gpu = client.json(f"{API}/gpu/status")
    workers = client.json(f"{API}/workers")
    if not (isinstance(gpu, dict) and isinstance(gpu.get("devices"), list)) or not isinstance(
        workers, list
    ):
        raise TypeError("not the shape of /api/v1/gpu/status and /api/v1/workers")
    if as_json:
        print(json.dumps({"gpu": gpu, "workers": workers}, indent=2))
        return 0
    print(format_status(gpu, workers))
    return 0


def _num(value: Any, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{float(value):.{digits}f}{unit}"


def _duration(seconds: float) -> str:
    """``3h05m``, ``12m30s``, ``45s``, ``<1s``."""
    whole = round(seconds)
    if whole == 0 and seconds > 0:
        return "<1s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _health(d: Mapping[str, Any]) -> str:
    """A GPU's HEALTH cell: unhealthy (why), suspect (an exited worker's processes still
    hold memory there: nothing is placed on it), hot (healing acts on it: derate, migrate...)
    or ok."""
    if not d.get("healthy"):
        return f"UNHEALTHY ({d.get('error') or 'lost'})"
    if d.get("suspect"):
        return "SUSPECT (memory still held by an exited worker)" + repair_notes(d)
    return ("HOT" if d.get("hot") else "ok") + repair_notes(d)


def repair_notes(d: Mapping[str, Any]) -> str:
    """What a device object says waits for the operator (a reset for a memory repair, the
    driver's recovery action), as a suffix of a HEALTH cell (``status``, ``gpus``)."""
    notes = ""
    if (d.get("remapped_rows") or {}).get("pending"):
        notes += ", reset pending (row remap)"
    if d.get("retired_pages_pending"):
        notes += ", reset pending (retired pages)"
    if d.get("recovery_action") not in (None, "none"):
        notes += f", recovery action {d['recovery_action']}"
    return notes


def format_status(gpu: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> str:
    """The ``status`` table: GPUs first, then workers."""
    lines: list[str] = []
    devices = gpu.get("devices") or []
    index_of = {d["uuid"]: str(d["id"]) for d in devices}
    if devices:
        rows: list[tuple[str, ...]] = [
            ("GPU", "UUID", "NAME", "MEMORY (MiB)", "UTIL", "TEMP", "HEALTH", "CORDONED")
        ]
        for d in devices:
            mem = d.get("memory") or {}
            rows.append(
                (
                    str(d["id"]),
                    d["uuid"],
                    d["name"],
                    f"{_num(mem.get('used_mb'))}/{_num(mem.get('total_mb'))}",
                    _num(d.get("utilization_percent"), "%"),
                    _num(d.get("temperature_celsius"), "C"),
                    _health(d),
                    "yes" if d.get("cordoned") else "no",
                )
            )
        lines += _table(rows)
    else:
        why = str(gpu.get("error") or "none found")
        lines.append(why if why.startswith("no GPU telemetry") else f"no GPU telemetry: {why}")
    lines.append("")
    if not workers:
        lines.append("no workers")
        return "\n".join(lines)
    rows = [
        ("WORKER", "STATE", "PID", "GPU", "GPU MEM", "IN USE", "RSS", "RESTARTS", "LEAK (MiB/min)")
    ]
    for w in workers:
        gpus = w.get("gpus")
        gpu_text = "-" if not gpus else ",".join(index_of.get(u, u) for u in gpus)
        leak = w.get("leak") or {}
        slope = leak.get("slope_mb_per_min")
        leak_text = (
            "-" if slope is None else f"{slope:+.1f}" + (" !" if leak.get("suspected") else "")
        )
        rows.append(
            (
                w["name"],
                w["state"],
                "-" if w.get("pid") is None else str(w["pid"]),
                gpu_text,
                "-" if w.get("gpu_memory_mb") is None else _num(w["gpu_memory_mb"], " MiB"),
                # what the worker reports its tensors hold (its leak is judged on that)
                "-"
                if w.get("gpu_memory_in_use_mb") is None
                else _num(w["gpu_memory_in_use_mb"], " MiB"),
                "-" if w.get("host_rss_mb") is None else _num(w["host_rss_mb"], " MiB"),
                str(w.get("restarts", 0)),
                leak_text,
            )
        )
    lines += _table(rows)
    # why a worker is not serving: the table has no room for it, an operator needs it first
    not_serving = [
        f"  {w['name']} {w['state']}: {w['reason']}"
        if w["state"] != "ready"
        else f"  {w['name']} derated: {w.get('derated_reason') or 'out of routing'}"
        for w in workers
        if (w["state"] in ("fatal", "backoff", "stopped", "draining") and w.get("reason"))
        or (w["state"] == "ready" and w.get("derated"))
        # about to start, no process yet: waiting its turn (max_starting) or for its GPU
        or (w["state"] == "starting" and w.get("pid") is None and w.get("reason"))
    ]
    if not_serving:
        lines += ["", "not serving:", *not_serving]
    recycles = [
        f"{w['name']} " + ("due (waiting its turn)" if due <= 0 else f"in {_duration(due)}")
        for w in workers
        if isinstance(due := w.get("recycle_in_s"), int | float)
    ]
    if recycles:
        lines += ["", "next recycle (max_age_s): " + "; ".join(recycles)]
    failing = [
        f"  {w['name']}: {live['failed']} of {live['of']} probes of {live['url']} failed in a "
        f"row (last: {live['last']})"
        for w in workers
        if isinstance(live := w.get("liveness"), dict) and live.get("failed")
    ]
    if failing:
        lines += ["", "failing liveness probes:", *failing]
    modes = {str(m) for w in workers if (m := w.get("host_memory_enforcement")) is not None}
    if modes:
        text = {
            "memory.max": "cgroup v2 memory.max per worker, plus the RSS watch",
            "rss_watch": "the RSS watch only (no delegated cgroup v2 memory controller)",
        }
        lines.append("")
        lines.append("host memory budgets: " + "; ".join(text.get(m, m) for m in sorted(modes)))
    return "\n".join(lines)
