"""Alert webhooks: self-healing actions and FATAL states POSTed as JSON, off the supervision path.

``Alerter.send`` (sync, O(1), never raises) puts a document in a bounded in-memory queue;
``Alerter.serve``, a task of its own, POSTs the documents one at a time with retries and
exponential backoff. A webhook that is down, slow or refusing costs the supervisor nothing but a
full queue: when it is full the oldest alert is dropped (and counted). Repeated alerts about the
same thing are rate-limited per key. URLs are logged as ``scheme://host[:port]`` only, because
webhook URLs carry their tokens in the userinfo, the path or the query.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import math
import socket
import ssl
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import structlog

from supervisor._version import __version__
from supervisor.config import redact_url
from supervisor.journal import rfc3339
from supervisor.model import finite
from supervisor.policy.ratelimit import RateLimit

if TYPE_CHECKING:
    import httpx

ALERT_SCHEMA_VERSION = 1
ALERT_KINDS = ("action", "fatal", "recovered", "alert")
USER_AGENT = f"gpu-supervisor/{__version__}"
#: A server's ``Retry-After`` is honoured up to this many seconds.
RETRY_AFTER_CAP_S = 30.0
#: Statuses worth another attempt besides 5xx: the server is busy, not refusing this alert.
_RETRY_STATUSES = frozenset({408, 429})
#: Statuses whose ``Retry-After`` is honoured.
_RETRY_AFTER_STATUSES = frozenset({429, 503})

Verdict = Literal["delivered", "retry", "give_up"]


def alert_doc(
    *,
    kind: str,
    reason: str,
    message: str,
    at: float,
    worker: str | None = None,
    group: str | None = None,
    gpu: str | None = None,
    action: str | None = None,
    evidence: Mapping[str, Any] | None = None,
    host: str,
    supervisor_pid: int,
) -> dict[str, Any]:
    """The JSON body of one alert (``at`` is wall-clock seconds since the epoch)."""
    if kind not in ALERT_KINDS:
        raise ValueError(f"alert kind must be one of {', '.join(ALERT_KINDS)}: {kind!r}")
    return {
        "schema_version": ALERT_SCHEMA_VERSION,
        "kind": kind,
        "action": action or None,
        "reason": reason,
        "worker": worker,
        "group": group,
        "gpu": gpu,
        "message": message,
        "evidence": dict(evidence or {}),
        "at": rfc3339(at),
        "host": host,
        "supervisor_pid": supervisor_pid,
    }


def verdict(status: int) -> Verdict:
    """What an HTTP status means for an alert: 2xx delivered, 408/429/5xx retry, else give up."""
    if 200 <= status < 300:
        return "delivered"
    if status >= 500 or status in _RETRY_STATUSES:
        return "retry"
    return "give_up"


def retry_after_s(value: str | None, cap_s: float = RETRY_AFTER_CAP_S) -> float | None:
    """Seconds from a ``Retry-After`` header's delay-seconds form, capped at ``cap_s``.

    None when absent, negative, not a number, or an HTTP date (the backoff applies then).
    """
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, cap_s)


def retry_delay(attempt: int, backoff_s: float, retry_after: float | None = None) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): the server's ``Retry-After``
    if it gave one, else ``backoff_s`` doubled per attempt (1x, 2x, 4x...)."""
    if retry_after is not None:
        return retry_after
    return backoff_s * 2.0 ** (attempt - 1)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every client (loading the CA bundle takes tens of ms)."""
    import httpx  # imported when alerts are sent, not at start-up (~30 ms)

    return httpx.create_ssl_context()


def encode(doc: Mapping[str, Any]) -> bytes:
    """Strict JSON for an alert; values JSON lacks become strings, non-finite numbers null.

    Raises TypeError, ValueError or RecursionError for a document that cannot be encoded at all.
    """
    try:
        text = json.dumps(doc, allow_nan=False, default=str, separators=(",", ":"))
    except ValueError:
        text = json.dumps(finite(doc), allow_nan=False, default=str, separators=(",", ":"))
    return text.encode()


@dataclass(frozen=True, slots=True)
class Attempt:
    """The outcome of one POST: a status (and its ``Retry-After``), or an error."""

    status: int | None = None
    error: str | None = None
    retry_after: float | None = None
    retryable: bool = True  # for an error: False when another attempt cannot help

    @property
    def verdict(self) -> Verdict:
        """A status by :func:`verdict`; network errors and timeouts are retried."""
        if self.status is not None:
            return verdict(self.status)
        return "retry" if self.retryable else "give_up"


class Alerter:
    """Delivers alert documents to one webhook in the background.

    ``send`` queues (from the event loop's thread; it is not thread-safe); ``serve`` delivers
    until cancelled. Counters: ``sent``, ``failed`` (given up on), ``dropped`` (pushed out of a
    full queue), ``rate_limited`` (refused by ``send``).
    """

    def __init__(
        self,
        url: str,
        *,
        queue_size: int = 100,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        rate: RateLimit | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1: {queue_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive: {timeout_s}")
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries and backoff_s must not be negative: {retries}, {backoff_s}")
        self.url = url  # may be changed (a reload); the next POST uses the new one
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.rate = rate if rate is not None else RateLimit()
        self._transport = transport
        self._clock = clock
        self._queue: deque[dict[str, Any]] = deque(maxlen=queue_size)
        self._current: dict[str, Any] | None = None  # being delivered
        self._names: _NameGate | None = None  # while serving
        self._wake: anyio.Event | None = None  # set by send while serve waits
        self._overflowing = False  # queue_full logged; reset once the queue drains
        self._failures = 0  # alerts given up on since the last delivery
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.rate_limited = 0
        self._log = structlog.get_logger()

    @property
    def log_url(self) -> str:
        """The URL as logged: ``scheme://host[:port]``."""
        return redact_url(self.url) if self.url else ""

    def pending(self) -> int:
        """Alerts queued or being delivered."""
        return len(self._queue) + (self._current is not None)

    def forget(self) -> int:
        """The URL was removed by a reload: drop what is queued, and stop retrying the alert
        being delivered (its POST in flight ends on its own); how many were dropped."""
        count = len(self._queue)
        self._queue.clear()
        if count:
            self._log.info(
                "alerts.pending_dropped",
                url=self.log_url,
                count=count,
                reason="webhook_url removed by a reload",
            )
        self.url = ""
        return count

    def send(self, doc: dict[str, Any], key: tuple[str, ...] | None = None) -> bool:
        """Queue ``doc``; never blocks, never raises.

        False when there is no URL, or ``key`` was sent within the rate limit's interval. When
        the queue is full the oldest queued alert is dropped to make room.
        """
        try:
            return self._send(doc, key)
        except Exception:
            self._log.exception("alerts.send_failed", url=self.log_url)
            return False

    def _send(self, doc: dict[str, Any], key: tuple[str, ...] | None) -> bool:
        if not self.url:
            return False
        if key is not None and not self.rate.allow(key, self._clock()):
            self.rate_limited += 1
            return False
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1  # append pushes out the oldest
            if not self._overflowing:
                self._overflowing = True
                self._log.warning(
                    "alerts.queue_full",
                    url=self.log_url,
                    size=self._queue.maxlen,
                    reason="the webhook is slower than alerts arrive; the oldest are dropped",
                )
        self._queue.append(doc)
        if self._wake is not None:
            self._wake.set()
        return True

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver queued alerts until cancelled; on cancellation the undelivered are dropped."""
        try:
            tls = await self._tls()
            async with anyio.create_task_group() as tg, self._client(tls) as client:
                self._names = _NameGate(tg, time.monotonic)
                task_status.started()
                while True:
                    self._current = await self._next()
                    try:
                        await self._deliver(client, self._current)
                    except Exception:  # a bug must not end alerting; cancellation passes
                        self.failed += 1
                        self._log.exception("alerts.delivery_crashed", url=self.log_url)
                    self._current = None
        finally:
            self._names = None
            self._discard()

    def _client(self, tls: ssl.SSLContext) -> httpx.AsyncClient:
        """The client the alerts are posted with: through the proxy the environment names
        (``HTTPS_PROXY``, ``ALL_PROXY``...), or, where httpx cannot use that one (a scheme it
        does not know, ``socks5://`` without its extra installed, a malformed URL), without
        one, said (regression: the error ended the supervisor, its workers with it)."""
        import httpx  # imported when a webhook is configured, not at start-up (~30 ms)

        def make(trust_env: bool) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                transport=self._transport,
                verify=tls,
                timeout=self.timeout_s,
                headers={
                    "User-Agent": USER_AGENT,
                    "Content-Type": "application/json",
                    "Accept-Encoding": "identity",  # the answer's body is not read anyway
                },
                follow_redirects=False,
                trust_env=trust_env,
            )

        try:
            return make(True)
        except Exception as exc:  # ImportError, ValueError, httpx.InvalidURL
            self._log.error(
                "alerts.proxy_unusable",
                url=self.log_url,
                error=f"{type(exc).__name__}: {exc}",
                reason="the proxy the environment names cannot be used: posting without one",
            )
            return make(False)

    async def _tls(self) -> ssl.SSLContext:
        """The TLS context, loaded off the loop; the system's CAs if the configured ones fail."""
        try:
            return await anyio.to_thread.run_sync(_tls_context)
        except (OSError, ssl.SSLError) as exc:
            self._log.error("alerts.tls_context_failed", error=str(exc), fallback="system CAs")
            return ssl.create_default_context()

    async def _next(self) -> dict[str, Any]:
        """The oldest queued alert, waiting for one."""
        while not self._queue:
            self._overflowing = False
            self._wake = anyio.Event()
            await self._wake.wait()
        self._wake = None
        return self._queue.popleft()

    def _discard(self) -> None:
        """Drop what is left at shutdown (delivering it could block the shutdown)."""
        left = self.pending()
        self._queue.clear()
        self._current = None
        self._wake = None
        if left:
            self._log.info("alerts.pending_dropped", url=self.log_url, count=left)

    async def _deliver(self, client: httpx.AsyncClient, doc: dict[str, Any]) -> None:
        """POST ``doc`` until delivered, refused, or out of retries."""
        try:
            body = encode(doc)
        except (TypeError, ValueError, RecursionError) as exc:
            self._gave_up(doc, Attempt(error=f"not JSON: {exc}"), attempts=0)
            return
        attempts = 0
        while self.url:  # a reload that removes the URL ends the retries too
            attempts += 1
            attempt = await self._post(client, body)
            outcome = attempt.verdict
            if outcome == "delivered":
                self._delivered(attempts)
                return
            if outcome == "give_up" or attempts > self.retries:
                self._gave_up(doc, attempt, attempts)
                return
            await anyio.sleep(retry_delay(attempts, self.backoff_s, attempt.retry_after))

    async def _post(self, client: httpx.AsyncClient, body: bytes) -> Attempt:
        """One POST under an overall deadline (httpx's timeouts are per phase)."""
        import httpx

        try:
            with anyio.fail_after(self.timeout_s):
                if self._names is not None:
                    await self._names.wait(self.url)
                # streamed, and closed unread: only the status and Retry-After count, and an
                # answer of any size (or a compressed bomb) must not land in our memory
                request = client.build_request("POST", self.url, content=body)
                response = await client.send(request, stream=True)
                await response.aclose()
        except (TimeoutError, httpx.TimeoutException):
            return Attempt(error="timeout")
        except (httpx.HTTPError, OSError) as exc:
            return Attempt(error=self._error_text(exc))
        except Exception as exc:  # an invalid URL, a bug in a transport: not worth retrying
            return Attempt(error=self._error_text(exc), retryable=False)
        header = None
        if response.status_code in _RETRY_AFTER_STATUSES:
            header = response.headers.get("retry-after")
        return Attempt(status=response.status_code, retry_after=retry_after_s(header))

    def _error_text(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return text.replace(self.url, self.log_url)

    def _delivered(self, attempts: int) -> None:
        self.sent += 1
        if self._failures:
            self._log.info(
                "alerts.delivery_recovered",
                url=self.log_url,
                failed_alerts=self._failures,
                attempts=attempts,
            )
            self._failures = 0

    def _gave_up(self, doc: dict[str, Any], attempt: Attempt, attempts: int) -> None:
        self.failed += 1
        self._failures += 1
        outcome: dict[str, Any] = {}
        if attempt.status is not None:
            outcome["status"] = attempt.status
        if attempt.error is not None:
            outcome["error"] = attempt.error
        self._log.warning(
            "alerts.delivery_failed",
            url=self.log_url,
            attempts=attempts,
            **outcome,
            kind=doc.get("kind"),
            alert_reason=doc.get("reason"),
            worker=doc.get("worker"),
        )


#: How long a name lookup of the webhook's host lets the next attempts go without another.
NAME_FRESH_S = 30.0


@dataclass
class _Lookup:
    """One name lookup of the host an attempt connects to, running or done."""

    host: str
    done: anyio.Event = field(default_factory=anyio.Event)
    ended_at: float = -math.inf


class _NameGate:
    """Holds an attempt back while the name of the host it connects to (the webhook's, or its
    proxy's) does not resolve in time: looked up first, in a thread of our own, one at a time.

    Regression: a webhook whose DNS hung had each attempt's lookup (httpx's, in the event
    loop's few shared threads, beyond cancelling) left running when the attempt timed out;
    retries and further alerts filled those threads, and the supervisor's other lookups (a
    probe of ``http://localhost:PORT/health``) waited behind them: healthy workers' liveness
    probes timed out and they were restarted as hung. Now a hung lookup holds one thread of
    ours, and no attempt (so no lookup of httpx's) starts until it answers. Whatever the
    answer, httpx then connects as usual (its own lookup is answered at once)."""

    def __init__(self, tg: anyio.abc.TaskGroup, clock: Callable[[], float]) -> None:
        self._tg = tg
        self._clock = clock
        self._limiter = anyio.CapacityLimiter(1)
        self._last: _Lookup | None = None

    async def wait(self, url: str) -> None:
        """Return once the host ``url`` connects to resolves (or fails to: httpx says why),
        at once for an address, or one that resolved lately."""
        host, port = _connects_to(url)
        if host is None:
            return
        last = self._last
        if last is not None and last.host == host:
            if not last.done.is_set():
                await last.done.wait()  # under the attempt's deadline
                return
            if self._clock() - last.ended_at < NAME_FRESH_S:
                return
        lookup = self._last = _Lookup(host)
        self._tg.start_soon(self._look_up, lookup, port)
        await lookup.done.wait()

    async def _look_up(self, lookup: _Lookup, port: int) -> None:
        try:
            await anyio.to_thread.run_sync(
                functools.partial(socket.getaddrinfo, lookup.host, port, type=socket.SOCK_STREAM),
                abandon_on_cancel=True,  # at shutdown: the thread ends when the lookup does
                limiter=self._limiter,  # one at a time: a hung one holds one thread, no more
            )
        except Exception:  # noqa: S110 - no such name, no thread: httpx's attempt says why
            pass
        finally:
            lookup.ended_at = self._clock()
            lookup.done.set()


def _connects_to(url: str) -> tuple[str | None, int]:
    """The host name (None for an address) and port an attempt at ``url`` connects to: its
    proxy's where the environment names one for it (``<scheme>_proxy``, else ``all_proxy``,
    as httpx takes it from there)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    proxies = {} if urllib.request.proxy_bypass(host) else urllib.request.getproxies()
    # the scheme's own proxy, else ALL_PROXY's (httpx sends every scheme through that one)
    proxy = proxies.get(parts.scheme) or proxies.get("all", "")
    target = urllib.parse.urlsplit(proxy if "://" in proxy else f"//{proxy}") if proxy else parts
    name = target.hostname or ""
    try:
        port = target.port or (443 if (target.scheme or parts.scheme) == "https" else 80)
    except ValueError:
        port = 80
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return (name or None), port
    return None, port
