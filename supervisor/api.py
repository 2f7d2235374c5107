"""The HTTP API (DESIGN.md section 6): a FastAPI app served by uvicorn inside the runtime's tree.

Handlers run on the event loop and never touch processes: they read the runtime's read model
(``workers()``, ``worker_object()``, ``device_objects()``, the journal, the post-mortem store)
and send intents to the single writer with ``runtime.submit``. Every error is JSON
``{"error": "..."}`` with a 4xx code; the OpenAPI document at ``/openapi.json`` describes every
answer, including the errors.

Auth: with ``api.token_file`` set, mutating endpoints need ``Authorization: Bearer <token>``
(compared in constant time); ``api.auth_read`` extends that to every GET except ``/healthz``.

Connections (``Connections``): at most ``connection_limit()`` are held open (256, less with a
low open-files limit), and a request must arrive whole within ``REQUEST_TIMEOUT_S``: idle and
slow clients cannot use up the descriptors the supervisor needs to restart workers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import errno
import functools
import hashlib
import hmac
import importlib.resources
import json
import logging
import math
import os
import re
import resource
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

import anyio
import anyio.abc
import anyio.to_thread
import structlog
import uvicorn
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from supervisor._version import __version__
from supervisor.config import (
    is_loopback,
    is_loopback_name,
    metrics_target,
    parse_listen,
    parse_signal,
)
from supervisor.journal import JOURNAL_SIZE, rfc3339
from supervisor.listen import BACKLOG, BoundApi
from supervisor.logs import RepeatLimitedHandler, RepeatLimiter, install_loop_exception_handler
from supervisor.metrics import Metrics, state_key
from supervisor.model import LaunchSpec, WorkerState
from supervisor.output import MAX_LOG_READ
from supervisor.policy import lifecycle as lc
from supervisor.policy.commands import COMMANDS, Command, group_refusal, refusal
from supervisor.policy.route import Candidate, GpuLoad, NoneReady, NoRoom, Ranking, pick, rank
from supervisor.runtime import Cordon, WorkerCommand, passed_over
from supervisor.sampler import stuck_text

if TYPE_CHECKING:
    from supervisor.runtime import Runtime

API_PREFIX = "/api/v1"
#: Routing: each GET takes a turn among the group's workers.
ROUTE_PATH = f"{API_PREFIX}/route"
#: How long a cordon request waits for the single writer to apply it before answering.
CORDON_WAIT_S = 2.0
#: Graceful shutdown of open connections when the supervisor exits.
SHUTDOWN_GRACE_S = 2
#: A cached body is reused for at most this long (``uptime_s`` is at most this old).
BODY_REUSE_S = 0.1
#: At most this share of the event loop's time goes to API requests (see ``Front``).
LOOP_SHARE = 0.75
LOOP_PERIOD_S = 0.01
#: ... and this share while a worker is being replaced.
URGENT_SHARE = 0.1
#: Open API connections at most (``connection_limit``) ...
MAX_CONNECTIONS = 256
#: ... and at most this share of the open-files limit: the rest is for the workers' pipes,
#: the records and /proc.
CONNECTIONS_SHARE_OF_FILES = 0.125
#: ... and at least this many, whatever the limit.
MIN_CONNECTIONS = 16
#: A request must have arrived whole (headers and body) this long after its connection opened
#: or the answer before it was sent, else the connection is closed (slowloris).
REQUEST_TIMEOUT_S = 10.0
#: A connection waiting this long for its next request may be closed to make room at the
#: limit (a younger one only if it never sent a request: see ``_GuardedHttp.sheddable``).
EVICT_IDLE_S = 1.0
#: An idle keep-alive connection is closed after this long (uvicorn's ``timeout_keep_alive``).
KEEP_ALIVE_S = 5
#: Requests a client may have sent on one connection ahead of the answers (HTTP pipelining)
#: that are parsed and queued; the rest of its bytes wait, unread, until answers catch up.
#: uvicorn parses all it reads (up to 256 KiB at a time) and reads on after every answer, so a
#: client pipelining requests faster than they were answered, or never reading the answers,
#: grew the supervisor's memory without bound (about 2 KiB per 40-byte request queued).
MAX_PIPELINED = 16
#: What a connection has sent is parsed this many bytes at a time (see ``MAX_PIPELINED``).
FEED_PIECE = 4096

# --- response models (the OpenAPI document is generated from these) ------------------------


class _Open(BaseModel):
    """A JSON object that may carry more fields than the ones documented."""

    model_config = ConfigDict(extra="allow")


class ErrorBody(BaseModel):
    """Every error answer."""

    error: str


class Memory(BaseModel):
    used_mb: float | None
    total_mb: float | None
    free_mb: float | None


class DeviceProcess(_Open):
    pid: int
    worker: str | None
    used_mb: float | None


class Device(_Open):
    """A GPU at the last sample; a field the GPU does not support is null."""

    id: int
    uuid: str
    name: str
    temperature_celsius: float | None
    utilization_percent: float | None
    memory: Memory
    power_watts: float | None
    encoder_util_percent: float | None
    decoder_util_percent: float | None
    throttle_reasons: list[str] | None
    healthy: bool
    cordoned: bool
    processes: list[DeviceProcess] | None


class GpuStatus(_Open):
    devices: list[Device]
    timestamp: Annotated[str, Field(json_schema_extra={"format": "date-time"})]
    nvml_available: bool
    error: str | None


class Leak(_Open):
    slope_mb_per_min: float | None
    suspected: bool
    projected_oom_s: float | None
    #: what the GPU figures were judged on: NVML's per-process memory, or the worker's own
    #: ``X_GPU_MEMORY_IN_USE_MB`` reports
    source: Literal["nvml", "worker"]


class LivenessState(_Open):
    """``health.liveness_url``: the URL asked, the failed probes in a row (of how many make
    the worker hung) and the last failed answer."""

    url: str
    failed: int
    of: int
    last: str | None


class LastExit(_Open):
    code: int | None
    signal: str | int | None
    reason: str
    at: str | None


class Worker(_Open):
    """One worker (DESIGN.md section 6)."""

    name: str
    group: str
    index: int
    state: WorkerState
    pid: int | None
    gpus: list[str] | None
    port: int | None
    restarts: int
    uptime_s: float | None
    ready: bool
    gpu_memory_mb: float | None
    #: the worker's last ``X_GPU_MEMORY_IN_USE_MB`` report (null: none lately)
    gpu_memory_in_use_mb: float | None
    host_rss_mb: float | None
    leak: Leak
    #: seconds until its ``max_age_s`` recycle (0: due, waiting its turn; null: off, not
    #: ready, or under way)
    recycle_in_s: float | None = None
    #: ``health.liveness_url`` (null: none)
    liveness: LivenessState | None = None
    last_exit: LastExit | None


class GroupAccepted(BaseModel):
    group: str
    command: str
    workers: list[Worker]


class RollingRestartAccepted(GroupAccepted):
    #: its ``rollout.done`` / ``rollout.halted`` in the journal carry it as ``request``
    request: int


class ReloadAccepted(BaseModel):
    command: str
    request: int


class GpuCordon(BaseModel):
    id: int | None  # null: the uncordon of a GPU no longer listed (replaced, removed)
    uuid: str
    cordoned: bool
    quarantined: bool


class Route(BaseModel):
    name: str
    port: int | None
    gpu: str | None
    free_mb: float | None


class Target(BaseModel):
    targets: list[str]
    labels: dict[str, str]


class PostmortemSummary(_Open):
    id: str
    worker: str | None
    group: str | None
    reason: str | None
    ended_at: str | None
    exit: dict[str, Any] | None


class Event(_Open):
    seq: int
    at: str
    type: str
    worker: str | None


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    uptime_s: float


class GroupReadiness(BaseModel):
    ready: int
    workers: int
    replicas: int


class Readiness(BaseModel):
    ready: bool
    error: str | None
    reasons: list[str]
    groups: dict[str, GroupReadiness]
    gpus_unhealthy: list[dict[str, Any]]
    records: dict[str, dict[str, Any]]


# --- errors ---------------------------------------------------------------------------------


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "bad request",
        401: "missing or wrong bearer token",
        404: "not found",
        409: "impossible in the current state",
        422: "invalid parameter",
        429: "no worker has the memory asked for",
        503: "unavailable",
    }
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": ErrorBody, "description": text.get(code, "error")}
    return out


def _problem(status: int, message: str, headers: Mapping[str, str] | None = None) -> HTTPException:
    return HTTPException(status, message, headers=dict(headers) if headers else None)


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = first.get("msg", "invalid")
    if loc == "query.signal" and first.get("type") == "string_pattern_mismatch":
        msg = "not a signal of this system (a name such as SIGUSR1 or USR1, or its number)"
    text = f"{loc}: {msg}"
    if "input" in first and first.get("type") != "missing":
        value = repr(first["input"])
        text += f" (got {value if len(value) <= 80 else value[:77] + '...'})"
    return text


# --- auth -----------------------------------------------------------------------------------


def _bearer_check(token: str) -> Callable[[Request], Awaitable[None]]:
    """The dependency that guards an endpoint: 401 unless the bearer token matches.

    A function, not an instance with ``__call__``: FastAPI before 0.123.7 resolves the string
    annotations of this module through the dependency's ``__globals__``, which only a
    function has (``Request`` went unresolved: the API did not start with a token)."""
    expected = token.encode()

    async def check(request: Request) -> None:
        why = bearer_refusal(request.headers.get("authorization", ""), expected)
        if why is not None:
            raise _problem(401, why, {"WWW-Authenticate": "Bearer"})

    return check


def bearer_refusal(header: str, expected: bytes) -> str | None:
    """Why an ``Authorization`` header value does not carry the token (None: it does)."""
    scheme, _, credentials = header.partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not credentials:
        return "missing bearer token (Authorization: Bearer <token>)"
    if not hmac.compare_digest(credentials.encode(), expected):
        return "invalid bearer token"
    return None


def _mib(value: float) -> str:
    """MiB as an operator reads them: ``1000000000``, ``1.5``, ``0.04`` (not ``1e+09``)."""
    return f"{value:.1f}".removesuffix(".0") if abs(value) >= 1 else f"{value:g}"


def _target(spec: LaunchSpec) -> str:
    """``HOST:PORT`` of a worker's own metrics for ``/api/v1/targets``: the host of its
    readiness or liveness URL where that names its port (``[::1]``, ``localhost``: a server
    that listens there only), else 127.0.0.1 (regression: always 127.0.0.1, a target down)."""
    urls = (spec.ready_url, spec.liveness.url if spec.liveness is not None else None)
    for url in urls:
        if not url:
            continue
        parts = urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            continue
        host = parts.hostname
        if host and port == spec.port:
            return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"127.0.0.1:{spec.port}"


#: Methods a browser may send cross-site without asking first are refused from other origins
#: (these change things; GET and HEAD do not, and their answers are not readable cross-site).
_UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _host_name(host: str) -> str:
    """``127.0.0.1:9811`` -> ``127.0.0.1``; ``[::1]:9811`` -> ``::1`` (lower case)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


@functools.lru_cache(maxsize=64)
def _host_allowed(host: str, allowed_hosts: tuple[str, ...]) -> bool:
    """``host`` (a ``Host`` header) names the loopback interface or one of ``allowed_hosts``
    (cached: clients send the same few values on every request)."""
    name = _host_name(host).rstrip(".")
    return is_loopback_name(name) or name in allowed_hosts


def browser_refusal(
    method: str,
    headers: Sequence[tuple[bytes, bytes]],
    loopback_only: bool,
    allowed_hosts: Sequence[str] = (),
) -> str | None:
    """Why a request a web page made the browser send is refused (None: it is not).

    - Cross-site requests: a page on another origin can make the browser POST here without
      asking (a "simple" request needs no preflight), so a tokenless API on the operator's own
      machine could be driven by any web page open there. Unsafe methods are refused when
      their ``Origin`` is not this server (``Host``), or ``Sec-Fetch-Site`` says cross-site.
    - DNS rebinding: a page whose name is made to resolve to 127.0.0.1 is same-origin with
      itself, but its requests carry its own name as ``Host``. On a loopback listener
      (``loopback_only``) any ``Host`` that is not a loopback name or address, or one of
      ``allowed_hosts`` (``api.allowed_hosts``: a local reverse proxy's name), is refused.

    Clients that are not browsers (curl, the CLI, Prometheus) send neither header, or a
    loopback ``Host``: they are not affected.
    """
    host = origin = fetch_site = None
    for key, value in headers:
        if key == b"host":
            if host is not None:  # which one is meant? (RFC 9112: a 400)
                return "more than one Host header"
            host = value.decode("latin-1")
        elif key == b"origin":
            origin = value.decode("latin-1")
        elif key == b"sec-fetch-site":
            fetch_site = value.decode("latin-1").strip().lower()
    if loopback_only and host and not _host_allowed(host, tuple(allowed_hosts)):
        return (
            f"Host {host!r} is not a loopback name: this API listens on loopback only "
            "(a request through a name made to resolve to it is refused; a reverse proxy's "
            "name goes in api.allowed_hosts)"
        )
    if method in _UNSAFE_METHODS:
        if origin is not None:
            parts = origin.strip().lower().split("://", 1)
            if len(parts) != 2 or host is None or parts[1].rstrip("/") != host.strip().lower():
                return f"cross-origin request refused (Origin {origin!r})"
        elif fetch_site in ("cross-site", "same-site"):
            return f"cross-origin request refused (Sec-Fetch-Site {fetch_site})"
    return None


def _auth_dependencies(token: str | None) -> list[Any]:
    """The dependencies of a guarded endpoint (the scheme is there for the OpenAPI document)."""
    if token is None:
        return []
    scheme = HTTPBearer(auto_error=False, description="the token in api.token_file")
    return [Depends(scheme), Depends(_bearer_check(token))]


# --- the status page ------------------------------------------------------------------------

#: The status page (``GET /``): one self-contained HTML file in this package.
STATUS_PAGE = "status.html"


@dataclass(frozen=True, slots=True)
class StatusPage:
    """The page's bytes and the headers it is served with."""

    body: bytes
    headers: Mapping[str, str]


def status_page() -> StatusPage:
    """``supervisor/status.html`` (read through ``importlib.resources``: works from a wheel).

    Its Content-Security-Policy allows the page's one inline ``<style>`` and one inline
    ``<script>`` by their sha256 (nothing else runs, even if text from the API were ever parsed
    as HTML), fetches to this origin only, and no framing.
    """
    text = importlib.resources.files("supervisor").joinpath(STATUS_PAGE).read_text("utf-8")

    def source_hash(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
        if len(blocks) != 1:
            raise RuntimeError(f"{STATUS_PAGE}: {len(blocks)} inline <{tag}> blocks, want 1")
        digest = hashlib.sha256(blocks[0].encode("utf-8")).digest()
        return f"'sha256-{base64.b64encode(digest).decode()}'"

    csp = "; ".join(
        (
            "default-src 'none'",
            f"script-src {source_hash('script')}",
            f"style-src {source_hash('style')}",
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    return StatusPage(
        text.encode("utf-8"),
        {
            "Cache-Control": "no-cache",
            "Content-Security-Policy": csp,
            "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer",
        },
    )


# --- the app --------------------------------------------------------------------------------


def _event(command: Command) -> lc.Start | lc.Stop | lc.Restart | lc.Drain:
    if command == "start":
        return lc.Start()
    if command == "stop":
        return lc.Stop()
    if command == "restart":
        return lc.Restart()
    return lc.Drain(restart=False)


def create_app(runtime: Runtime, metrics: Metrics, token: str | None = None) -> FastAPI:
    """The ASGI app for ``runtime`` (``token``: the bearer token, None for no auth)."""
    rt = runtime
    route_turns: dict[str, int] = {}  # per group: requests routed so far (ties take turns)
    rankings: dict[str, tuple[object, Ranking]] = {}  # per group: state_key, its ranking
    log = structlog.get_logger()
    auth_read = rt.settings.api.auth_read and token is not None
    write_deps = _auth_dependencies(token)
    read_deps = write_deps if auth_read else []
    write_errors = (401,) if token is not None else ()
    read_errors = (401,) if auth_read else ()

    app = FastAPI(
        title="gpu-supervisor",
        version=__version__,
        description="Process supervisor for GPU inference workers (DESIGN.md section 6).",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return JSONResponse(
            {"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _bad_input(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse({"error": _validation_message(exc)}, status_code=422)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> Response:
        log.error("api.error", path=request.url.path, error=repr(exc))
        return JSONResponse({"error": "internal error"}, status_code=500)

    def get(
        path: str,
        model: Any,
        *errors: int,
        responses_extra: dict[int | str, dict[str, Any]] | None = None,
        **kw: Any,
    ) -> Callable[[Any], Any]:
        return app.get(
            path,
            response_model=model,
            responses={**_error_responses(*read_errors, *errors), **(responses_extra or {})},
            dependencies=read_deps,
            **kw,
        )

    def post(path: str, model: Any, status: int, *errors: int) -> Callable[[Any], Any]:
        return app.post(
            path,
            response_model=model,
            status_code=status,
            responses=_error_responses(*write_errors, *errors),
            dependencies=write_deps,
        )

    def client_of(request: Request) -> str:
        return request.client.host if request.client else "unix"

    # --- GPUs ---

    @get(f"{API_PREFIX}/gpu/status", GpuStatus)
    async def gpu_status() -> dict[str, Any]:
        """Every GPU at the last sample; 200 with ``devices: []`` and ``error`` if NVML is down."""
        sample = rt.sampler.last
        stuck = rt.sampler.stuck()
        available = bool(sample and sample.nvml_available) and bool(rt.sampler.identities)
        available = available and stuck is None
        error: str | None
        if sample is None:
            at, error = rt.clock.wall(), "no sample taken yet"
        else:
            at = rt.clock.wall() - max(0.0, rt.clock.now() - sample.t)
            error = sample.error or rt.sampler.error
            if stuck is not None:
                error = stuck_text(stuck)
            if not available and error is None:
                error = f"no GPU telemetry (backend {rt.sampler.backend_name})"
        return {
            "devices": rt.device_objects() if available else [],
            "timestamp": rfc3339(at),
            "nvml_available": available,
            "error": error,
            "backend": rt.sampler.backend_name,
        }

    def gpu_uuid(ident: str) -> str:
        uuid = rt.resolve_gpu(ident)
        if uuid is None:
            known = ", ".join(str(i) for i in sorted(set(rt.gpu_ids().values()))) or "none"
            raise _problem(404, f"unknown GPU {ident!r} (known: {known})")
        return uuid

    def refuse_while_stopping() -> None:
        if rt.shutting_down:  # the command would be dropped: 202 said it was taken
            raise _problem(409, "the supervisor is stopping")

    async def set_cordon(
        request: Request, ident: str, cordon: bool, lift: bool = False
    ) -> dict[str, Any]:
        # an operator's cordon of a GPU no longer listed (replaced: ``gpu.replaced``) is
        # uncordoned by its UUID (regression: 404, the cordon kept in state_dir for ever)
        uuid = ident if not cordon and ident in rt.cordoned else gpu_uuid(ident)
        index = rt.gpu_ids().get(uuid)
        refuse_while_stopping()  # the intent would be dropped (regression: 200, not cordoned)
        if lift and uuid in rt.healer.state.quarantined and not rt.gpu_answers(uuid):
            raise _problem(
                409,
                f"GPU {ident} does not answer (lost or NVML down): it stays quarantined; "
                "reset it, then lift the quarantine",
            )
        rt.submit(Cordon(uuid, cordon, lift_quarantine=lift))
        log.info(
            "api.command",
            command="cordon" if cordon else "uncordon",
            target=uuid,
            lift_quarantine=lift,
            client=client_of(request),
        )

        def applied() -> bool:
            return (uuid in rt.cordoned) == cordon and not (
                lift and uuid in rt.healer.state.quarantined
            )

        await rt.wait_until(lambda: applied() or rt.shutting_down, CORDON_WAIT_S)
        if not applied():
            refuse_while_stopping()  # a stop that began meanwhile dropped it
        return {
            "id": index,
            "uuid": uuid,
            "cordoned": uuid in rt.cordoned,
            "quarantined": uuid in rt.healer.state.quarantined,
        }

    @post(f"{API_PREFIX}/gpus/{{id}}/cordon", GpuCordon, 200, 404, 409)
    async def cordon(request: Request, id: str) -> dict[str, Any]:
        """Place no more workers on this GPU (index or UUID)."""
        return await set_cordon(request, id, True)

    @post(f"{API_PREFIX}/gpus/{{id}}/uncordon", GpuCordon, 200, 404, 409)
    async def uncordon(request: Request, id: str, lift_quarantine: bool = False) -> dict[str, Any]:
        """Allow placing workers on this GPU again (index or UUID). ``lift_quarantine=true``:
        also take it out of quarantine (a device-fatal XID or lost; once it has been reset or
        repaired), which an uncordon alone leaves in force."""
        return await set_cordon(request, id, False, lift_quarantine)

    # --- workers ---

    def runner_of(name: str) -> Any:
        runner = rt.runners.get(name)
        if runner is None:
            raise _problem(404, f"unknown worker {name!r}")
        return runner

    workers_body = _BodyCache(
        lambda: (state_key(rt), int(rt.clock.now() / BODY_REUSE_S)),
        lambda: [rt.worker_object(r) for r in rt.workers()],
    )

    @get(f"{API_PREFIX}/workers", list[Worker])
    async def workers() -> Response:
        """Every worker, in config order."""
        # The hot read (dashboards, load balancers): built once per change or BODY_REUSE_S,
        # serialized without a second validation pass (the response model documents it).
        return Response(workers_body.get(), media_type="application/json")

    @get(f"{API_PREFIX}/workers/{{name}}", Worker, 404)
    async def worker(name: str) -> dict[str, Any]:
        """One worker."""
        return rt.worker_object(runner_of(name))

    @get(
        f"{API_PREFIX}/workers/{{name}}/log",
        None,
        404,
        422,
        503,
        response_class=Response,
        responses_extra={200: _LOG_RESPONSE},
    )
    async def worker_log(
        name: str,
        response: Response,
        limit: Annotated[
            int, Query(ge=1, le=MAX_LOG_READ, description="at most this many bytes")
        ] = LOG_TAIL_BYTES,
        file: Annotated[
            str | None,
            Query(
                max_length=64,
                description=f"follow on from an earlier answer's {LOG_FILE_HEADER} "
                "(without it: the log's last `limit` bytes)",
            ),
        ] = None,
        offset: Annotated[
            int, Query(ge=0, description=f"with `file`: its {LOG_OFFSET_HEADER}")
        ] = 0,
    ) -> Response:
        """The worker's log file (its output, stdout and stderr): the last ``limit`` bytes, or,
        with ``file`` and ``offset`` from an earlier answer's headers, what came after them
        (across rotations); ``X-Log-Lost: 1`` when some of it is gone."""
        output = runner_of(name).output.file
        try:
            chunk = await anyio.to_thread.run_sync(
                functools.partial(output.read, limit, file, offset)
            )
        except OSError as exc:
            raise _problem(503, f"cannot read the log of {name}: {exc.strerror or exc}") from None
        headers = {LOG_FILE_HEADER: chunk.file, LOG_OFFSET_HEADER: str(chunk.offset)}
        if chunk.lost:
            headers[LOG_LOST_HEADER] = "1"
        return Response(chunk.data, media_type="text/plain; charset=utf-8", headers=headers)

    def worker_command(request: Request, name: str, command: Command) -> dict[str, Any]:
        runner = runner_of(name)
        refuse_while_stopping()
        if name in rt.removing:
            raise _problem(409, f"cannot {command} {name}: a reload is removing it")
        why = refusal(
            command,
            runner.state,
            stopping=runner.record.after_exit is lc.AfterExit.STOP,
            has_process=runner.record.pid is not None,
        )
        if why is not None:
            raise _problem(409, f"cannot {command} {name}: {why}")
        rt.submit(WorkerCommand(name, _event(command)))
        log.info("api.command", command=command, target=name, client=client_of(request))
        obj: dict[str, Any] = rt.worker_object(runner)
        return obj

    def group_command(request: Request, group: str, command: Command) -> dict[str, Any]:
        names = group_names(group)
        refuse_while_stopping()
        if names and all(n in rt.removing for n in names):
            raise _problem(409, f"cannot {command} group {group}: a reload is removing it")
        names = [n for n in names if n not in rt.removing]
        runners = [rt.runners[n] for n in names]
        why = group_refusal(
            command,
            [r.state for r in runners],
            stopping=[r.record.after_exit is lc.AfterExit.STOP for r in runners],
            has_process=[r.record.pid is not None for r in runners],
        )
        if why is not None:
            raise _problem(409, f"cannot {command} group {group}: {why}")
        rt.submit(WorkerCommand(group, _event(command)))
        log.info("api.command", command=command, target=group, client=client_of(request))
        return {
            "group": group,
            "command": command,
            "workers": [rt.worker_object(rt.runners[n]) for n in names],
        }

    def group_names(group: str) -> list[str]:
        if group not in rt.groups:
            raise _problem(404, f"unknown group {group!r}")
        return [n for n in rt.groups[group] if n in rt.runners]

    for command in COMMANDS:
        _add_command_routes(app, post, command, worker_command, group_command)

    def signal_of(value: str) -> signal.Signals:
        try:
            text = value.strip()
            name = parse_signal(int(text) if text.isdigit() else text)
        except ValueError as exc:
            raise _problem(422, f"signal: {exc} (got {value!r})") from None
        if not name:
            raise _problem(422, "signal: expected a signal name such as 'SIGUSR1' (got '')")
        return signal.Signals[name]

    def send(request: Request, runner: Any, sig: signal.Signals) -> int | None:
        pid: int | None = runner.send_signal(sig, reason="operator")
        if pid is not None:
            log.info(
                "api.command",
                command="signal",
                signal=sig.name,
                target=runner.name,
                client=client_of(request),
            )
        return pid

    @post(f"{API_PREFIX}/workers/{{name}}/signal", Worker, 200, 404, 409, 422)
    async def signal_worker(
        request: Request,
        name: str,
        signal: SignalQuery,
    ) -> dict[str, Any]:
        """Send a signal to one worker's process tree now (its process group, and descendants
        that left it), as ``supervisorctl signal``; 409 while it has no process."""
        runner = runner_of(name)
        sig = signal_of(signal)
        if send(request, runner, sig) is None:
            raise _problem(409, f"cannot signal {name}: it has no process ({runner.state})")
        obj: dict[str, Any] = rt.worker_object(runner)
        return obj

    @post(f"{API_PREFIX}/groups/{{group}}/signal", GroupAccepted, 200, 404, 409, 422)
    async def signal_group_workers(
        request: Request,
        group: str,
        signal: SignalQuery,
    ) -> dict[str, Any]:
        """Send a signal to every worker of a group that has a process now; 409 when none
        has."""
        names = group_names(group)
        sig = signal_of(signal)
        sent = [n for n in names if send(request, rt.runners[n], sig) is not None]
        if not sent:
            raise _problem(409, f"cannot signal group {group}: no worker of it has a process")
        return {
            "group": group,
            "command": "signal",
            "workers": [rt.worker_object(rt.runners[n]) for n in sent],
        }

    @post(f"{API_PREFIX}/groups/{{group}}/rolling-restart", RollingRestartAccepted, 202, 404, 409)
    async def rolling_restart(request: Request, group: str) -> dict[str, Any]:
        """Restart the group one worker at a time, each waiting for readiness."""
        names = group_names(group)
        refuse_while_stopping()
        if rt.settings.group(group) is None:
            raise _problem(409, f"group {group} is being removed by a reload")
        if group in rt.rolling:
            raise _problem(409, f"a {rt.rolling[group]} of group {group} is already running")
        # one a roll-out passes over (drained or stopped toward a stop, waiting for a GPU)
        # has nothing to restart either (regression: 202, then done with nothing restarted)
        running = [
            n for n in names if rt.runners[n].state not in _IDLE and not passed_over(rt.runners[n])
        ]
        if not running:
            raise _problem(
                409,
                f"group {group} has no running worker to restart (every worker is stopped, "
                "fatal, on its way to a stop, or waiting for a GPU)",
            )
        number = rt.request_rolling_restart(group)
        log.info("api.command", command="rolling-restart", target=group, client=client_of(request))
        return {
            "group": group,
            "command": "rolling-restart",
            "workers": [rt.worker_object(rt.runners[n]) for n in names],
            "request": number,
        }

    @post(f"{API_PREFIX}/reload", ReloadAccepted, 202, 409)
    async def reload(request: Request) -> dict[str, Any]:
        """Re-read the config file and apply it, as SIGHUP does. The outcome is in the journal
        (``/api/v1/events``): the first ``reload.done`` or ``reload.rejected`` whose
        ``request`` is at least the one returned here."""
        if rt.config_path is None:
            raise _problem(409, "the supervisor was not started from a config file")
        if rt.shutting_down:
            raise _problem(409, "the supervisor is stopping")
        n = rt.request_reload()
        log.info("api.command", command="reload", target="", client=client_of(request))
        return {"command": "reload", "request": n}

    # --- routing, targets ---

    @get(
        ROUTE_PATH,
        Route,
        404,
        422,
        503,
        responses_extra={
            429: {
                "model": ErrorBody,
                "description": "no ready worker has need_mb free; retry after the given delay",
                "headers": {
                    "Retry-After": {
                        "description": "seconds until the next sample",
                        "schema": {"type": "integer"},
                    }
                },
            }
        },
    )
    async def route(
        group: Annotated[str, Query(description="the worker group")],
        need_mb: Annotated[
            float | None,
            Query(
                ge=0,
                le=MAX_NEED_MB,
                allow_inf_nan=False,
                description="GPU memory the request needs",
            ),
        ] = None,
    ) -> dict[str, Any]:
        """The ready worker to send the next request to (most free GPU memory, lowest load)."""
        group_names(group)  # 404 for an unknown group
        status, body, headers = routed(group, need_mb)
        if status != 200:
            raise _problem(status, body["error"], headers)
        return body

    def ranking_of(group: str) -> Ranking:
        loads = _gpu_loads(rt)
        derated = rt.healer.state.derated
        settings = rt.settings.group(group)
        budget = settings.health.gpu_memory_limit_mb if settings is not None else 0.0
        sample = rt.sampler.last
        fresh = bool(loads) and rt.sampler.stuck() is None  # the workers' use is as old
        candidates = []
        for n in rt.groups[group]:
            r = rt.runners.get(n)
            if r is None:
                continue
            usage = sample.workers.get(n) if sample is not None and fresh else None
            known = usage is not None and usage.gpu_memory_mb is not None
            candidates.append(
                Candidate(
                    name=n,
                    port=r.spec.port,
                    state=r.state,
                    gpus=tuple(r.spec.gpus or ()),
                    derated=n in derated,
                    budget_mb=budget,
                    used_mb=usage.gpu_memory_by_gpu if usage is not None and known else None,
                )
            )
        return rank(candidates, loads)

    def routed(group: str, need_mb: float | None) -> tuple[int, dict[str, Any], dict[str, str]]:
        """``/route``'s answer for a known group: status, JSON body, headers (the FastAPI route
        and the fast path give the same). The group's ranking is made again only when the
        state can have changed (a sample, any worker change: ``state_key``)."""
        key = (state_key(rt), tuple(rt.groups[group]))
        cached = rankings.get(group)
        if cached is None:  # a group new here: those a reload removed since go (unbounded)
            for gone in [g for g in rankings if g not in rt.groups]:
                del rankings[gone]
                route_turns.pop(gone, None)
        if cached is None or cached[0] != key:
            cached = rankings[group] = (key, ranking_of(group))
        turn = route_turns.get(group, 0)
        route_turns[group] = turn + 1
        verdict = pick(cached[1], need_mb, turn)
        retry = {"Retry-After": str(max(1, math.ceil(rt.settings.supervisor.sample_interval_s)))}
        if isinstance(verdict, NoneReady):
            return 503, {"error": f"group {group}: {verdict.reason}"}, retry
        if isinstance(verdict, NoRoom):
            why = (
                f"group {group}: no ready worker has {_mib(verdict.need_mb)} MiB free "
                f"(most free: {_mib(verdict.best_free_mb)} MiB)"
            )
            return 429, {"error": why}, retry
        body = {
            "name": verdict.name,
            "port": verdict.port,
            "gpu": verdict.gpu,
            "free_mb": verdict.free_mb,
        }
        return 200, body, {}

    async def route_fast(query: bytes) -> tuple[int, bytes, Mapping[str, str]] | None:
        """``/route`` without the framework (a router may ask before every request) for the
        plain queries: ``group=G`` of a known group, maybe ``&need_mb=N`` with N a plain
        decimal in range; None for anything else, which the FastAPI route answers (its 404s
        and 422s)."""
        args = fast_route_query(query)
        if args is None or args[0] not in rt.groups:
            return None
        status, body, headers = routed(*args)
        return status, _json_bytes(body), headers

    @get(f"{API_PREFIX}/targets", list[Target])
    async def targets() -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery for the workers' own metrics endpoints."""
        out: list[dict[str, Any]] = []
        for group in rt.settings.workers:
            if not group.metrics_path:
                continue
            path, params = metrics_target(group.metrics_path)
            for n in rt.groups.get(group.name, []):
                runner = rt.runners.get(n)
                if runner is None or runner.spec.port is None:
                    continue
                labels = {"worker": n, "group": group.name}
                if path != "/metrics":
                    labels["__metrics_path__"] = path
                labels.update((f"__param_{k}", v) for k, v in params.items())
                out.append({"targets": [_target(runner.spec)], "labels": labels})
        return out

    # --- records ---

    @get(f"{API_PREFIX}/postmortems", list[PostmortemSummary], 503)
    async def postmortems(
        limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
    ) -> list[dict[str, Any]]:
        """Post-mortem summaries, newest first."""
        try:
            result: list[dict[str, Any]] = await anyio.to_thread.run_sync(
                rt.postmortems.summaries, limit
            )
        except OSError as exc:  # postmortems/ cannot be listed (EACCES, EIO): not a 500
            raise _problem(503, f"cannot list the post-mortems: {exc.strerror or exc}") from None
        return result

    @get(f"{API_PREFIX}/postmortems/{{id}}", dict[str, Any], 404, 503)
    async def postmortem(id: str) -> dict[str, Any]:
        """One post-mortem file's content."""
        try:
            doc: dict[str, Any] = await anyio.to_thread.run_sync(rt.postmortems.read, id)
        except (FileNotFoundError, ValueError):
            raise _problem(404, f"no post-mortem {id!r}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link planted in postmortems/: not one
                raise _problem(404, f"no post-mortem {id!r} ({exc.strerror})") from None
            raise _problem(503, f"cannot read post-mortem {id!r}: {exc.strerror or exc}") from None
        return doc

    run = f"{os.getpid()}-{int(rt.started_wall * 1000)}"

    @get(
        f"{API_PREFIX}/events",
        list[Event],
        422,
        responses_extra={
            200: {
                "headers": {
                    RUN_HEADER: {
                        "description": "this run of the supervisor: ``seq`` starts at 1 again "
                        "in another (a client polling ``since`` across a restart sees it change)",
                        "schema": {"type": "string"},
                    }
                }
            }
        },
    )
    async def events(
        response: Response,
        since: Annotated[int, Query(ge=0, description="only events with a greater seq")] = 0,
        limit: Annotated[int, Query(ge=1, le=JOURNAL_SIZE)] = JOURNAL_SIZE,
    ) -> list[dict[str, Any]]:
        """Recent lifecycle events, oldest first, with increasing ``seq``; the header
        ``X-Gpu-Supervisor-Run`` names the supervisor's run they are numbered in."""
        response.headers[RUN_HEADER] = run
        return [e.to_json() for e in rt.journal.since(since, limit)]

    # --- probes, metrics, schema ---

    def healthz_body() -> bytes:
        uptime = round(max(0.0, rt.clock.now() - rt.started_mono), 3)
        return json.dumps({"status": "ok", "version": __version__, "uptime_s": uptime}).encode()

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Response:
        """200 while the supervisor's event loop answers."""
        return Response(healthz_body(), media_type="application/json")

    @get(
        "/readyz",
        Readiness,
        responses_extra={503: {"model": Readiness, "description": "a group has no ready worker"}},
    )
    async def readyz() -> Response:
        """200 when every group has at least one ready worker, else 503 with the reasons."""
        body = _readiness(rt)
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @get(
        "/metrics",
        None,
        response_class=Response,
        responses_extra={
            200: {
                "description": "Prometheus text exposition",
                "content": {metrics.content_type: {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics_endpoint() -> Response:
        """Prometheus metrics (DESIGN.md section 9)."""
        return Response(await metrics.render_async(), media_type=metrics.content_type)

    @app.get("/openapi.json", include_in_schema=False, dependencies=read_deps)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    page = status_page()
    page_token = (token or "").encode()

    @app.get("/", include_in_schema=False)
    async def status(request: Request) -> Response:
        """The status page (HTML; it reads the API from the browser every 2 s).

        With ``auth_read``, 401 without the bearer token like every other read: JSON for an API
        client, and for a browser (``Accept: text/html``) the page itself, which holds no data
        and asks for the token (``/#token=...``, kept in the browser's localStorage).
        """
        headers = dict(page.headers)
        code = 200
        if auth_read:
            why = bearer_refusal(request.headers.get("authorization", ""), page_token)
            if why is not None:
                if "text/html" not in request.headers.get("accept", ""):
                    raise _problem(401, why, {"WWW-Authenticate": "Bearer"})
                code, headers["WWW-Authenticate"] = 401, "Bearer"
        return Response(page.body, code, headers, media_type="text/html")

    async def healthz_async() -> bytes:
        return healthz_body()

    async def workers_async() -> bytes:
        return workers_body.get()

    app.state.fast_routes = {
        "/healthz": FastRoute(False, healthz_async, "application/json"),
        "/metrics": FastRoute(auth_read, metrics.render_async, metrics.content_type),
        f"{API_PREFIX}/workers": FastRoute(auth_read, workers_async, "application/json"),
        ROUTE_PATH: FastRoute(auth_read, None, "application/json", answer=route_fast),
    }
    return app


_IDLE = frozenset({WorkerState.STOPPED, WorkerState.FATAL})


class _BodyCache:
    """A JSON body rebuilt only when its key changes."""

    def __init__(self, key: Callable[[], object], build: Callable[[], Any]) -> None:
        self._key_of = key
        self._build = build
        self._key: object = object()
        self._body = b""

    def get(self) -> bytes:
        key = self._key_of()
        if key != self._key:
            self._body = json.dumps(self._build(), separators=(",", ":")).encode()
            self._key = key
        return self._body


def _add_command_routes(
    app: FastAPI,
    post: Callable[..., Callable[[Any], Any]],
    command: Command,
    worker_command: Callable[[Request, str, Command], dict[str, Any]],
    group_command: Callable[[Request, str, Command], dict[str, Any]],
) -> None:
    """``POST /workers/{name}/<command>`` and ``POST /groups/{group}/<command>``."""
    what = {
        "drain": "take out of routing, wait for it to exit (drain_timeout_s), stay stopped",
        "restart": "stop, then start again",
        "stop": "stop and stay stopped",
        "start": "start (also clears fatal)",
    }[command]

    async def on_worker(request: Request, name: str) -> dict[str, Any]:
        return worker_command(request, name, command)

    async def on_group(request: Request, group: str) -> dict[str, Any]:
        return group_command(request, group, command)

    on_worker.__doc__ = f"{command.capitalize()} one worker: {what}."
    on_group.__doc__ = f"{command.capitalize()} every worker of a group: {what}."
    on_worker.__name__ = f"{command}_worker"
    on_group.__name__ = f"{command}_group"
    post(f"{API_PREFIX}/workers/{{name}}/{command}", Worker, 202, 404, 409)(on_worker)
    post(f"{API_PREFIX}/groups/{{group}}/{command}", GroupAccepted, 202, 404, 409)(on_group)


def _replacing(rt: Runtime) -> bool:
    """A worker is between its exit and its next spawn (the GPU-release barrier, placement)."""
    return any(r.state is WorkerState.STARTING and r.record.pid is None for r in rt.workers())


def _gpu_loads(rt: Runtime) -> dict[str, GpuLoad]:
    """What routing knows of each GPU. While an NVML call hangs (``stuck``: the API and the
    metrics report no telemetry then) the last readings are stale: figures unknown, as with
    NVML down, the health flags kept (regression: ranked and admitted on minutes-old figures
    for as long as the hang lasted)."""
    sample = rt.sampler.last
    if sample is None or not sample.nvml_available:
        return {}
    fresh = rt.sampler.stuck() is None
    return {
        d.uuid: GpuLoad(
            free_mb=d.memory_free_mb if fresh else None,
            utilization_percent=d.utilization_percent if fresh else None,
            healthy=d.healthy,
        )
        for d in sample.devices
    }


def _readiness(rt: Runtime) -> dict[str, Any]:
    reasons: list[str] = []
    groups: dict[str, dict[str, int]] = {}
    for group in rt.settings.workers:
        runners = [rt.runners[n] for n in rt.groups.get(group.name, []) if n in rt.runners]
        ready = sum(r.state is WorkerState.READY for r in runners)
        groups[group.name] = {"ready": ready, "workers": len(runners), "replicas": group.replicas}
        if group.replicas == 0 or ready:
            continue
        if not runners:
            reasons.append(f"group {group.name}: no worker started yet")
            continue
        counts: dict[str, int] = {}
        for r in runners:
            counts[r.state.value] = counts.get(r.state.value, 0) + 1
        states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        reasons.append(f"group {group.name}: no ready worker ({states})")
    if rt.stopped:
        reasons.append("supervisor has stopped")
    sample = rt.sampler.last
    quarantined = rt.healer.state.quarantined
    listed = sample.devices if sample is not None else ()
    unhealthy = [
        {"id": d.index, "uuid": d.uuid, "error": d.error or f"quarantined: {quarantined[d.uuid]}"}
        for d in listed
        if not d.healthy or d.uuid in quarantined
    ]
    # a quarantine holds while NVML does not answer (no devices sampled): still listed
    # (regression: [] for as long as NVML was down, as if the GPU had recovered)
    seen = {d.uuid for d in listed}
    index = {i.uuid: i.index for i in rt.sampler.identities}
    unhealthy += [
        {"id": index.get(u), "uuid": u, "error": f"quarantined: {why}"}
        for u, why in quarantined.items()
        if u not in seen
    ]
    return {
        "ready": not reasons,
        "error": "; ".join(reasons) if reasons else None,
        "reasons": reasons,
        "groups": groups,
        "gpus_unhealthy": unhealthy,
        "records": rt.write_health.problems(),
    }


# --- the server -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FastRoute:
    """A GET answered without the framework: ``body()`` is the whole answer; or, with
    ``answer``, that is given the query string and returns the status, body and headers, or
    None where the framework must answer (an unusual query: its validation errors)."""

    guarded: bool  # needs the bearer token
    body: Callable[[], Awaitable[bytes]] | None
    content_type: str
    answer: Callable[[bytes], Awaitable[tuple[int, bytes, Mapping[str, str]] | None]] | None = None


#: ``need_mb`` of ``/route`` at most (MiB).
MAX_NEED_MB = 1e9
_PLAIN_DECIMAL = re.compile(r"[0-9]{1,10}(?:\.[0-9]{1,6})?")


def fast_route_query(query: bytes) -> tuple[str, float | None] | None:
    """``group`` and ``need_mb`` of a plain ``/route`` query (``group=G[&need_mb=N]``, each
    once, N a plain decimal up to MAX_NEED_MB); None for anything else."""
    try:
        text = query.decode("ascii")
    except UnicodeDecodeError:
        return None
    group: str | None = None
    need: float | None = None
    for part in text.split("&"):
        key, sep, value = part.partition("=")
        if not sep:
            return None
        if key == "group" and group is None and value and "%" not in value and "+" not in value:
            group = value
        elif key == "need_mb" and need is None and _PLAIN_DECIMAL.fullmatch(value):
            need = float(value)
            if need > MAX_NEED_MB:
                return None
        else:
            return None
    return None if group is None else (group, need)


def _json_bytes(body: Any) -> bytes:
    """JSON as the framework's JSONResponse writes it."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class Front:
    """The ASGI app uvicorn serves: a fast path for the hot GETs, and a share of the loop.

    Fast path: ``GET /metrics``, ``/healthz`` and ``/api/v1/workers`` (scrapes, probes and
    dashboards, called in tight loops) are answered here with the same bodies the FastAPI routes
    give, without the framework's middleware, routing and validation (about ten times cheaper).

    Share of the loop: the API runs on the supervisor's own event loop. A client hammering it
    would otherwise keep the loop, and with it the GIL, busy all the time: the sampler and NVML
    threads then get the GIL only at switch intervals, a sampling tick takes hundreds of
    milliseconds instead of ten, and crash recovery (which waits for a fresh sample: the
    GPU-release barrier) slows down by the same. So requests are admitted one at a time (each
    until it first reads from or writes to its client, so a client that stops reading cannot
    hold the others back), and once the loop's thread has used ``share`` of the current
    ``period_s`` in CPU time (requests, HTTP parsing, everything), the next request waits for
    the next period: the loop sleeps in epoll and the threads run. While ``urgent()`` holds (a
    worker is being replaced: its GPU-release barrier waits for a sample), the share drops to
    ``urgent_share``. Requests that wait on something else (a post-mortem read in a thread, a
    cordon being applied) skip the queue and the count.
    """

    def __init__(
        self,
        app: Any,
        fast: Mapping[str, FastRoute],
        token: str | None,
        *,
        loopback_only: bool = False,
        allowed_hosts: Sequence[str] = (),
        share: float = 0.5,
        period_s: float = 0.02,
        exempt: Sequence[str] = (),
        urgent: Callable[[], bool] = lambda: False,
        urgent_share: float = 0.1,
        wall: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.thread_time,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self.app = app
        self._wall, self._cpu, self._sleep = wall, cpu, sleep
        self.urgent = urgent
        self.urgent_share = urgent_share
        self.fast = dict(fast)
        self._expected = (token or "").encode()
        #: the listener is a loopback address: refuse Host names that are not (browser_refusal)
        self.loopback_only = loopback_only
        self.allowed_hosts = tuple(allowed_hosts)
        self.share = share
        self.period_s = period_s
        self.exempt = tuple(exempt)
        self._turn = anyio.Semaphore(1)  # one request computes at a time
        self._window_at = 0.0
        self._window_cpu = 0.0
        self.waits = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            send = self._dated(send)
            why = browser_refusal(
                scope["method"], scope["headers"], self.loopback_only, self.allowed_hosts
            )
            if why is not None:
                await _refuse(send, 403, why)
                return
            if scope["method"] == "HEAD" and scope["path"] != ROUTE_PATH:
                # RFC 9110 9.1: a GET's head (`curl -I`, uptime checks); not for /route, whose
                # GET takes a turn (a HEAD must change nothing): 405 there
                scope = {**scope, "method": "GET"}
                send = _headless(send)
        if scope["type"] != "http" or scope["path"].startswith(self.exempt):
            await self.app(scope, receive, send)
            return
        # The turn is held while the request computes, not while it waits on its client: it is
        # given up at the first receive or send (either may wait as long as the client likes: a
        # client that stops reading its answers must not stall /healthz for everyone else).
        await self._turn.acquire()
        held = True

        def give_up() -> None:
            nonlocal held
            if held:
                held = False
                self._turn.release()

        async def receive_freely() -> Any:
            give_up()
            return await receive()

        async def send_freely(message: Any) -> None:
            give_up()
            await send(message)

        try:
            await self._admit()
            route = self.fast.get(scope["path"]) if scope["method"] == "GET" else None
            if route is None or not await self._answer(route, scope, send_freely):
                await self.app(scope, receive_freely, send_freely)
        finally:
            give_up()

    def _dated(self, send: Any) -> Any:
        """``send`` that adds the ``Date`` header (uvicorn's needs a timer every second)."""

        async def send_dated(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"date", _http_date())]
                message = {**message, "headers": headers}
            await send(message)

        return send_dated

    async def _admit(self) -> None:
        """Wait for the next period once the loop's thread used its share of this one."""
        now = self._wall()
        if now - self._window_at >= self.period_s:
            self._window_at, self._window_cpu = now, self._cpu()
        elif self._cpu() - self._window_cpu >= self._share() * self.period_s:
            self.waits += 1
            await self._sleep(self._window_at + self.period_s - now)
            self._window_at, self._window_cpu = self._wall(), self._cpu()

    def _share(self) -> float:
        return self.urgent_share if self.urgent() else self.share

    async def _answer(self, route: FastRoute, scope: Any, send: Any) -> bool:
        """Answer ``route``; False (nothing sent) where the framework must."""
        status, body, content_type = 200, b"", route.content_type
        headers: list[tuple[bytes, bytes]] = []
        if route.guarded:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            why = bearer_refusal(header.decode("latin-1"), self._expected)
            if why is not None:
                status, content_type = 401, "application/json"
                body = json.dumps({"error": why}).encode()
                headers.append((b"www-authenticate", b"Bearer"))
        if status == 200 and route.answer is not None:
            answered = await route.answer(scope.get("query_string", b""))
            if answered is None:
                return False
            status, body, extra = answered
            headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        elif status == 200 and route.body is not None:
            body = await route.body()
        headers += [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return True


def _headless(send: Any) -> Any:
    """``send`` for a HEAD answered as a GET: the headers (its Content-Length included), no
    body."""

    async def send_head(message: Any) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head


# --- connections ----------------------------------------------------------------------------

#: The answer to a connection over the limit while every open one is busy.
_REFUSAL_BODY = json.dumps({"error": "too many API connections, try again"}).encode()
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s"
    % (len(_REFUSAL_BODY), _REFUSAL_BODY)
)
#: A request line and headers longer than this (bytes) are refused with 431 and the connection
#: closed: the parser gathers a header's pieces by copying, so one endless header line (before
#: any token is checked) would keep the loop busy until the request deadline.
MAX_HEAD_BYTES = 64 * 1024
#: The response header of ``/api/v1/events`` that names the supervisor's run (its events are
#: numbered from 1 in each run).
RUN_HEADER = "X-Gpu-Supervisor-Run"
#: ``POST .../signal?signal=``: the query parameter, a signal this system has (its name, with
#: or without ``SIG``, or its number), as the schema says it.
_SIGNAL_PATTERN = "^(?:(?:SIG)?(?:{})|{})$".format(
    "|".join(sorted(name[3:] for name in signal.Signals.__members__)),
    "|".join(str(n) for n in sorted({s.value for s in signal.Signals})),
)
SignalQuery = Annotated[
    str,
    Query(description="a signal name (SIGUSR1, USR1) or number", pattern=_SIGNAL_PATTERN),
]
#: ``GET /api/v1/workers/{name}/log``: the bytes a tail gets, and the answer's headers.
LOG_TAIL_BYTES = 65536
LOG_FILE_HEADER = "X-Log-File"
LOG_OFFSET_HEADER = "X-Log-Offset"
LOG_LOST_HEADER = "X-Log-Lost"
_LOG_RESPONSE: dict[str, Any] = {
    "description": "the bytes of the log (as the worker wrote them)",
    "content": {"text/plain": {"schema": {"type": "string"}}},
    "headers": {
        LOG_FILE_HEADER: {
            "description": "the file these bytes are from (empty: no log yet); pass it back "
            "as `file` to follow the log",
            "schema": {"type": "string"},
        },
        LOG_OFFSET_HEADER: {
            "description": "where the next read in that file starts; pass it back as `offset`",
            "schema": {"type": "integer", "minimum": 0},
        },
        LOG_LOST_HEADER: {
            "description": "present (1) when the place asked for is gone (rotated past the "
            "last backup, emptied on a full disk): the bytes start at the oldest there is",
            "schema": {"type": "string", "enum": ["1"]},
        },
    },
}
_HEAD_BODY = json.dumps(
    {"error": f"request line and headers over {MAX_HEAD_BYTES // 1024} KiB"}
).encode()
_HEAD_REFUSAL = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_HEAD_BODY), _HEAD_BODY)
)
#: What a request the HTTP parser refuses (400) usually got wrong.
_BAD_REQUEST_HINT = (
    "the request line or a header does not parse as HTTP/1.1 (a path or query must be "
    "ASCII, anything else percent-encoded: a worker name such as gpen-\u00e4 as gpen-%C3%A4)"
)
#: The event of shed connections (at most once a minute, with running totals).
SHED_EVENT = "api.connections_shed"


def connection_limit(open_files: int | None = None) -> int:
    """How many API connections may be open: ``MAX_CONNECTIONS``, but no more than
    ``CONNECTIONS_SHARE_OF_FILES`` of the open-files soft limit (default: this process's)."""
    if open_files is None:
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if open_files == resource.RLIM_INFINITY or open_files < 0:
        return MAX_CONNECTIONS
    share = int(open_files * CONNECTIONS_SHARE_OF_FILES)
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, share))


class Connections:
    """The API's open connections: a limit on their number, and a deadline for each request.

    uvicorn has neither: a connection that never completes its request headers is held for
    ever (its ``timeout_keep_alive`` runs only between requests, and any byte resets it), and
    ``limit_concurrency`` is checked only once a request's headers are complete (so it does
    nothing about such connections, and its 503s would also refuse ``/healthz`` while idle
    connections fill the quota). Clients that open connections and send nothing, or a byte now
    and then, used up every descriptor: workers could not be restarted any more.

    * The limit is enforced as each connection is accepted. At ``limit`` open, the new one takes
      the place of the one that has waited longest for a request (idle keep-alive, headers or
      body still arriving, or an answer its client has not read for ``request_timeout_s``),
      which is closed. So a well-behaved client (a liveness probe sends its request at once)
      gets its answer however many idle connections there are. Only when every open connection
      is busy with a request is the new one refused: a 503, closed at once.
    * A request must arrive whole within ``request_timeout_s`` of its connection's opening or of
      the answer before it on the connection; an answer whose client stops reading is dropped
      ``request_timeout_s`` after the writes stalled. Either way the connection is closed at
      once (``abort``: its descriptor is released even with unsent data).
    * asyncio accepts at most ``accept_per_turn`` connections in one loop turn (uvicorn would
      let it take 2048), so at most ``limit`` plus a few turns of accepts are open at any time.

    Shed connections are counted (``evicted``, ``refused``, ``timed_out``) and logged as
    ``api.connections_shed`` at most once a minute.
    """

    def __init__(
        self,
        limit: int,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        limiter: RepeatLimiter | None = None,
        evict_idle_s: float = EVICT_IDLE_S,
    ) -> None:
        self.limit = limit
        self.evict_idle_s = evict_idle_s
        self.request_timeout_s = request_timeout_s
        self.open: dict[_GuardedHttp, None] = {}  # the longest-waiting first
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0
        self._limiter = limiter if limiter is not None else RepeatLimiter()

    @property
    def accept_per_turn(self) -> int:
        """Connections accepted in one loop turn at most. A connection's first bytes are read
        a few loop turns after its accept; the connections accepted meanwhile (two turns' worth:
        half the limit) each close the longest-waiting one, which leaves a client that sent its
        request at once (it is younger than the other three quarters) open until it is read."""
        return max(1, min(BACKLOG, self.limit // 4))

    def protocol(self) -> type[HttpToolsProtocol]:
        """The uvicorn HTTP protocol class whose connections this counts (``Config.http``)."""
        connections = self

        class Guarded(_GuardedHttp):
            gate = connections

        return Guarded

    def admit(self, conn: _GuardedHttp) -> bool:
        """A connection accepted: keep it (making room if need be) or refuse it."""
        if len(self.open) >= self.limit:
            now = conn.loop.time()
            victim = next((c for c in self.open if c.sheddable(now)), None) or next(
                (c for c in self.open if c.sheddable(now, pressed=True)), None
            )
            if victim is None:
                self.refused += 1
                self._shed("refused", conn.loop)
                return False
            del self.open[victim]
            victim.transport.abort()
            self.evicted += 1
            self._shed("evicted", conn.loop)
        self.open[conn] = None
        return True

    def waiting(self, conn: _GuardedHttp) -> None:
        """``conn`` answered its request: it waits for the next one from now (last in line)."""
        if conn in self.open:
            del self.open[conn]
            self.open[conn] = None

    def expire(self, conn: _GuardedHttp) -> None:
        """``conn`` is being closed: its request did not arrive in time, or its client stopped
        reading."""
        self.open.pop(conn, None)
        self.timed_out += 1
        self._shed("timed_out", conn.loop)

    def forget(self, conn: _GuardedHttp) -> None:
        self.open.pop(conn, None)

    def _shed(self, why: str, loop: asyncio.AbstractEventLoop) -> None:
        """One line per reason a minute at most, with the totals so far: a warning when the
        limit was reached, info for a timeout (a browser's unused preconnection does that)."""
        fields = {
            "reason": why,
            "limit": self.limit,
            "open": len(self.open),
            "evicted": self.evicted,
            "refused": self.refused,
            "timed_out": self.timed_out,
        }
        level = "info" if why == "timed_out" else "warning"
        self._limiter.log(f"{SHED_EVENT}|{why}", level, SHED_EVENT, fields, loop.call_later)


class _GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, counted and timed by ``gate`` (see ``Connections``)."""

    gate: Connections

    def connection_made(  # type: ignore[override]
        self, transport: asyncio.Transport
    ) -> None:
        self._in_head = True  # the bytes coming in are a request line or headers
        self._head_bytes = 0  # of the current request's head, so far
        self._head_tail = b""  # its last 3 bytes (the blank line may be cut between reads)
        self._head_refused = False
        self._held = b""  # bytes received and not parsed yet (see ``data_received``)
        super().connection_made(transport)
        self._since = self.loop.time()  # when the wait for the current request began
        self._served = 0  # requests answered on this connection
        self._stalled_at: float | None = None  # when writing to the client got stuck
        self._timer: asyncio.TimerHandle | None = None
        if self.gate.admit(self):
            self._arm()
        else:
            transport.write(_REFUSAL)
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()

    def data_received(self, data: bytes) -> None:
        """Parse ``data``, a piece at a time, while fewer than :data:`MAX_PIPELINED` requests
        wait for their turn; hold the rest, unread from then on, until an answer is sent."""
        if self._held:
            data, self._held = self._held + data, b""
        for start in range(0, len(data), FEED_PIECE):
            if self._head_refused or self.transport.is_closing():
                return
            if len(self.pipeline) >= MAX_PIPELINED:
                self._held = data[start:]
                self.flow.pause_reading()
                return
            self._parse(data[start : start + FEED_PIECE])

    def _parse(self, data: bytes) -> None:
        """Parse ``data``; refuse a request head over :data:`MAX_HEAD_BYTES` (431)."""
        if self._head_refused:
            return
        if self._in_head:  # counted before the parser sees it, up to the head's blank line
            seen = self._head_tail + data
            end = seen.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._head_tail))
            self._head_tail = seen[-3:]
            # (regression: only reads that left the head unfinished were counted, so a head
            # of any size whose last read finished it got through)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_refused = True
                if not self.transport.is_closing():
                    self.transport.write(_HEAD_REFUSAL)
                    self.transport.close()
                return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """A request the parser refuses: the JSON error every other refusal is (uvicorn's
        own is text/plain), and the connection closed."""
        body = json.dumps({"error": f"{msg.rstrip('.')}: {_BAD_REQUEST_HINT}"}).encode()
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._head_tail = False, 0, b""
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._head_tail = True, 0, b""

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.forget(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._served += 1
        self._since = self.loop.time()
        self.gate.waiting(self)
        self._arm()
        if self._held and not self.transport.is_closing():
            # a queued request was started: parse on (uvicorn resumed reading)
            self.data_received(b"")

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stalled_at = self.loop.time()
        self._arm()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stalled_at = None

    def _waiting(self) -> bool:
        """No request is being served: none yet, the last one answered, or one still arriving
        with none queued before it (regression: one cut by the bytes held unparsed behind
        ``MAX_PIPELINED`` queued ones counted as arriving: closed while they were served)."""
        cycle = self.cycle
        if self.pipeline:
            return False
        return cycle is None or cycle.response_complete or cycle.more_body

    def _due(self) -> float | None:
        """When this connection is to be shed (None: it is busy, and not stuck)."""
        if self._waiting():
            return self._since + self.gate.request_timeout_s
        if self._stalled_at is not None:
            return self._stalled_at + self.gate.request_timeout_s
        return None

    def sheddable(self, now: float, pressed: bool = False) -> bool:
        """It may make room for a new connection: stuck writing, or waiting for a request
        with nothing of one unread in its socket, and either idle for ``EVICT_IDLE_S`` or,
        when no such one is left (``pressed``), never served a request (a connection opened
        and left empty). A keep-alive client between two requests of a burst is never cut:
        its next request may be on the way (closing it then resets a request it sent)."""
        if self._stalled_at is not None and now >= self._stalled_at + self.gate.request_timeout_s:
            return True
        if not self._waiting() or _unread(self.transport):
            return False
        if now - self._since >= self.gate.evict_idle_s:
            return True
        return pressed and self._served == 0

    def _arm(self) -> None:
        """A timer for when this connection is due to be shed (none while it is busy).

        Lazy: a timer already set stays (a due time only ever moves later); when it fires
        early, ``_check`` sets the next one.
        """
        if self._timer is None:
            due = self._due()
            if due is not None:
                self._timer = self.loop.call_at(due, self._check)

    def _check(self) -> None:
        self._timer = None
        due = self._due()
        if due is None:
            return  # busy: armed again when it answers or its writes stall
        if self.loop.time() >= due:
            self.gate.expire(self)
            self.transport.abort()
        else:
            self._timer = self.loop.call_at(due, self._check)


def _unread(transport: asyncio.BaseTransport) -> bool:
    """Bytes wait unread in the connection's socket (a request on its way to us)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        peek = socket.socket(fileno=sock.fileno())
    except OSError:
        return False
    try:
        return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing there (EAGAIN), or the socket is gone
        return False
    finally:
        peek.detach()  # the descriptor stays the transport's


def server_for(app: Any, connections: Connections) -> uvicorn.Server:
    """A uvicorn server for ``app`` whose connections ``connections`` limits and times."""
    config = uvicorn.Config(
        app,
        http=connections.protocol(),
        lifespan="off",
        ws="none",  # no WebSocket routes: wsproto/websockets are never imported
        log_config=None,
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,  # Front adds it: no 1 s timer while idle
        proxy_headers=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        # how many connections asyncio accepts in one loop turn (and the listen backlog, set
        # back to BACKLOG by start_server): uvicorn's default, 2048, would let a burst hold
        # that many descriptors at once
        backlog=connections.accept_per_turn,
    )
    config.load()
    server = _QuietServer(config)
    server.lifespan = config.lifespan_class(config)
    return server


async def start_server(server: uvicorn.Server, sock: socket.socket) -> None:
    """Start ``server`` (from ``server_for``) on the listening socket ``sock``."""
    await server.startup(sockets=[sock])
    # asyncio listen()s again with the accepts per turn; the kernel's queue may hold more
    sock.listen(BACKLOG)


async def _shutdown(server: uvicorn.Server) -> None:
    """Stop serving; uvicorn's own shutdown sleeps 0.1 s even with no connection open."""
    state = server.server_state
    if state.connections or state.tasks:
        await server.shutdown()
        return
    for listener in server.servers:
        listener.close()
    for listener in server.servers:
        await listener.wait_closed()


_date_cache: tuple[int, bytes] = (0, b"")


def _http_date() -> bytes:
    """The current time as an HTTP ``Date`` value (formatted once per second)."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True).encode())
    return _date_cache[1]


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the runtime owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def _quiet_uvicorn_logging() -> None:
    """uvicorn's warnings and errors as ``api.server`` events, a message repeated (``Invalid
    HTTP request received.`` for each bad request) at most once a minute."""
    handler = RepeatLimitedHandler("api.server", RepeatLimiter())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
        logger.handlers = [handler]
    access = logging.getLogger("uvicorn.access")
    access.handlers = []
    access.propagate = False
    access.disabled = True


def _loopback_listener(listen: str) -> bool:
    """``api.listen`` is a loopback TCP address (not a unix socket, not another interface)."""
    kind, host, _ = parse_listen(listen)
    return kind == "tcp" and is_loopback(host)


async def _refuse(send: Any, status: int, why: str) -> None:
    """Answer a request with ``{"error": why}`` without reading it."""
    body = json.dumps({"error": why}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def serve(
    runtime: Runtime,
    *,
    bound: BoundApi,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API for ``runtime`` on ``bound`` until cancelled (via ``listen.serve_api``).

    ``bound``: the socket and token ``supervisor.listen.open_api`` opened before the runtime
    started.
    """
    api = runtime.settings.api
    sock, url, token = bound.sock, bound.url, bound.token
    metrics = Metrics(runtime)
    app = create_app(runtime, metrics, token)
    _quiet_uvicorn_logging()
    install_loop_exception_handler()  # runtime.run installs it too; this is a no-op then
    front = Front(
        app,
        app.state.fast_routes,
        token,
        loopback_only=_loopback_listener(api.listen),
        allowed_hosts=api.allowed_hosts,
        share=LOOP_SHARE,
        period_s=LOOP_PERIOD_S,
        exempt=(f"{API_PREFIX}/postmortems", f"{API_PREFIX}/gpus/"),
        urgent=lambda: _replacing(runtime),
        urgent_share=URGENT_SHARE,
    )
    server = server_for(front, Connections(connection_limit()))
    metrics.attach()
    try:
        await start_server(server, sock)
        structlog.get_logger().info(
            "api.listening", url=url, auth=token is not None, auth_read=api.auth_read
        )
        task_status.started()
        await server.on_tick(0)  # the default headers; no tick after that (Front dates answers)
        await anyio.sleep_forever()
    finally:
        metrics.detach()
        with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_GRACE_S + 1):
            if server.started:
                await _shutdown(server)
        bound.close()


__all__: Sequence[str] = (
    "Connections",
    "connection_limit",
    "create_app",
    "serve",
    "server_for",
    "start_server",
)
