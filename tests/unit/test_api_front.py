"""The API's front: fast-path answers and the loop-share limit (ASGI calls, no server)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from supervisor.api import FastRoute, Front, browser_refusal, fast_route_query
from supervisor.config import token_problem


async def call(
    front: Front, path: str, headers: list[tuple[bytes, bytes]] | None = None
) -> dict[str, Any]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "query_string": query.encode(),
        "headers": headers or [],
    }
    await front(scope, receive, send)
    start, body = sent
    return {"status": start["status"], "headers": dict(start["headers"]), "body": body["body"]}


async def slow_app(scope: Any, receive: Any, send: Any) -> None:
    end = time.thread_time() + 0.004  # 4 ms of CPU per request
    while time.thread_time() < end:
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"slow"})


async def ok_body() -> bytes:
    return b'{"ok":true}'


async def secret_body() -> bytes:
    return b"secret"


FAST = {
    "/open": FastRoute(False, ok_body, "application/json"),
    "/guarded": FastRoute(True, secret_body, "text/plain"),
}


async def test_fast_routes_and_their_auth() -> None:
    front = Front(slow_app, FAST, "tok")
    answer = await call(front, "/open")
    assert answer["status"] == 200 and json.loads(answer["body"]) == {"ok": True}
    assert answer["headers"][b"content-length"] == b"11"
    denied = await call(front, "/guarded")
    assert denied["status"] == 401 and denied["headers"][b"www-authenticate"] == b"Bearer"
    assert json.loads(denied["body"])["error"].startswith("missing bearer token")
    wrong = await call(front, "/guarded", [(b"authorization", b"Bearer nope")])
    assert json.loads(wrong["body"]) == {"error": "invalid bearer token"}
    right = await call(front, "/guarded", [(b"authorization", b"Bearer tok")])
    assert (right["status"], right["body"]) == (200, b"secret")
    assert (await call(front, "/other"))["body"] == b"slow"  # everything else: the app


async def test_a_fast_route_with_a_query_answers_or_leaves_it_to_the_app() -> None:
    """``/route`` is answered here for the plain queries (a router may ask before every
    request); anything else goes to the framework, whose validation answers it."""
    asked: list[bytes] = []

    async def answer(query: bytes) -> tuple[int, bytes, dict[str, str]] | None:
        asked.append(query)
        if query == b"group=full":
            return 429, b'{"error":"full"}', {"Retry-After": "1"}
        return (200, b'{"name":"a-0"}', {}) if query == b"group=a" else None

    front = Front(slow_app, {"/r": FastRoute(True, None, "application/json", answer)}, "tok")
    auth = [(b"authorization", b"Bearer tok")]
    assert (await call(front, "/r?group=a", auth))["body"] == b'{"name":"a-0"}'
    full = await call(front, "/r?group=full", auth)
    assert full["status"] == 429 and full["headers"][b"retry-after"] == b"1"
    assert (await call(front, "/r?group=zz", auth))["body"] == b"slow"  # the app's answer
    assert (await call(front, "/r?group=a"))["status"] == 401
    assert asked == [b"group=a", b"group=full", b"group=zz"]  # not asked without the token


@pytest.mark.parametrize(
    ("query", "parsed"),
    [
        (b"group=g", ("g", None)),
        (b"group=g-1&need_mb=1500", ("g-1", 1500.0)),
        (b"need_mb=0.5&group=g", ("g", 0.5)),
        (b"need_mb=1000000000&group=g", ("g", 1e9)),
        # everything else is the framework's (its 404 and 422 answers, its decoding)
        (b"", None),
        (b"group=", None),
        (b"need_mb=5", None),
        (b"group=g&group=h", None),
        (b"group=g&need_mb=5&need_mb=6", None),
        (b"group=g&need_mb=-1", None),
        (b"group=g&need_mb=nan", None),
        (b"group=g&need_mb=1e3", None),
        (b"group=g&need_mb=1_000", None),
        (b"group=g&need_mb=1000000001", None),
        (b"group=g&need_mb=", None),
        (b"group=g&x=1", None),
        (b"group=g&", None),
        (b"group=%67", None),
        (b"group=a+b", None),
        (b"group=\xc3\xa9", None),
    ],
)
def test_the_plain_route_queries(query: bytes, parsed: tuple[str, float | None] | None) -> None:
    assert fast_route_query(query) == parsed


class FakeTimes:
    """Wall-clock and CPU time that move only when the test says (a request burns CPU)."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0
        self.slept = 0.0

    def burn(self, seconds: float) -> None:
        self.wall += seconds
        self.cpu += seconds

    async def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.wall += seconds


async def test_requests_past_the_share_wait_for_the_next_period() -> None:
    t = FakeTimes()

    async def burning_app(scope: Any, receive: Any, send: Any) -> None:
        t.burn(0.004)  # 4 ms of CPU per request
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"slow"})

    front = Front(
        burning_app,
        {},
        None,
        share=0.5,
        period_s=0.02,
        wall=lambda: t.wall,
        cpu=lambda: t.cpu,
        sleep=t.sleep,
    )
    for _ in range(10):
        await call(front, "/x")
    # 10 ms of CPU per 20 ms period: three requests fit, the fourth waits for the next period
    assert front.waits == 3
    assert t.slept == pytest.approx(3 * 0.008)
    urgent = Front(
        burning_app,
        {},
        None,
        share=0.5,
        period_s=0.02,
        urgent=lambda: True,
        urgent_share=0.1,
        wall=lambda: t.wall,
        cpu=lambda: t.cpu,
        sleep=t.sleep,
    )
    for _ in range(4):
        await call(urgent, "/x")
    assert urgent.waits == 3  # 2 ms a period while a worker is being replaced: one each
    exempt = Front(slow_app, {}, None, share=0.5, period_s=0.02, exempt=("/x",))
    for _ in range(10):
        await call(exempt, "/x")
    assert exempt.waits == 0


async def test_every_answer_is_dated() -> None:
    from email.utils import parsedate_to_datetime

    front = Front(slow_app, FAST, None)
    for path in ("/open", "/anything-else"):
        answer = await call(front, path)
        stamp = parsedate_to_datetime(answer["headers"][b"date"].decode()).timestamp()
        assert abs(stamp - time.time()) < 2


async def test_a_client_that_stops_reading_holds_no_one_back() -> None:
    """A request whose answer the client does not read (uvicorn's ``send`` waits while the
    socket's buffer is full) or whose body it does not send gives up its turn."""
    import anyio

    front = Front(slow_app, FAST, None)
    never, all_stuck = anyio.Event(), anyio.Event()
    stuck_at: list[str] = []

    def note(where: str) -> None:
        stuck_at.append(where)
        if len(stuck_at) == 3:
            all_stuck.set()

    async def stuck_send(message: dict[str, Any]) -> None:
        note(message["type"])
        await never.wait()

    async def stuck_receive() -> dict[str, Any]:
        note("receive")
        await never.wait()
        raise AssertionError("unreachable")

    async def reading_app(scope: Any, receive: Any, send: Any) -> None:
        await receive()

    async def nothing() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    stuck = {"type": "http", "method": "GET", "headers": []}
    reader = Front(reading_app, {}, None)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(front, {**stuck, "path": "/open"}, nothing, stuck_send)
            tg.start_soon(front, {**stuck, "path": "/other"}, nothing, stuck_send)
            tg.start_soon(reader, {**stuck, "path": "/post"}, stuck_receive, stuck_send)
            await all_stuck.wait()
            assert (await call(front, "/open"))["status"] == 200
            assert (await call(front, "/other"))["body"] == b"slow"
            tg.cancel_scope.cancel()
    assert sorted(stuck_at) == ["http.response.start", "http.response.start", "receive"]


H = list[tuple[bytes, bytes]]


@pytest.mark.parametrize(
    ("method", "headers", "loopback", "refused"),
    [
        # programs (curl, the CLI, Prometheus): no Origin, a loopback Host
        ("POST", [(b"host", b"127.0.0.1:9811")], True, None),
        ("GET", [(b"host", b"localhost:9811")], True, None),
        ("GET", [(b"host", b"[::1]:9811")], True, None),
        ("GET", [(b"host", b"app.localhost")], True, None),
        ("GET", [], True, None),  # HTTP/1.0 without Host
        # the status page: same origin
        ("POST", [(b"host", b"127.0.0.1:9811"), (b"origin", b"http://127.0.0.1:9811")], True, None),
        # a page elsewhere: cross-site POST ("simple" request, no preflight)
        (
            "POST",
            [(b"host", b"127.0.0.1:9811"), (b"origin", b"http://evil.example")],
            True,
            "Origin",
        ),
        ("POST", [(b"host", b"127.0.0.1:9811"), (b"origin", b"null")], True, "Origin"),
        ("POST", [(b"host", b"127.0.0.1:9811"), (b"sec-fetch-site", b"cross-site")], True, "Sec"),
        # reading cross-site is the browser's to refuse (no CORS headers): GET goes through
        ("GET", [(b"host", b"127.0.0.1:9811"), (b"origin", b"http://evil.example")], True, None),
        # DNS rebinding: a foreign name resolved to 127.0.0.1 is same-origin with itself
        ("GET", [(b"host", b"evil.example:9811")], True, "loopback"),
        # two Hosts: which is meant? (the check read the last, a proxy may route by the first)
        ("GET", [(b"host", b"evil.example"), (b"host", b"127.0.0.1")], True, "more than one"),
        ("POST", [(b"host", b"evil.example"), (b"origin", b"http://evil.example")], True, "Host"),
        # a listener on another interface is reached by any name; cross-site POSTs still not
        ("GET", [(b"host", b"sup.internal:9811")], False, None),
        (
            "POST",
            [(b"host", b"sup.internal"), (b"origin", b"http://evil.example")],
            False,
            "Origin",
        ),
    ],
)
def test_browser_refusal(method: str, headers: H, loopback: bool, refused: str | None) -> None:
    """Regression: with no token (the default), any web page open on the operator's machine
    could stop workers through a cross-site POST, and read the API through DNS rebinding."""
    why = browser_refusal(method, headers, loopback)
    assert (why is None) == (refused is None), why
    assert refused is None or refused in str(why)


@pytest.mark.parametrize(
    ("token", "ok"),
    [
        ("s3cr3t-TOKEN_~+/=", True),
        ("", False),
        ("two words", False),
        ("tökén", False),
        ("a\n", False),
    ],
)
def test_token_problem(token: str, ok: bool) -> None:
    """Regression: a non-ASCII token was accepted but could never match (headers are latin-1)
    and the client failed on it with a traceback."""
    problem = token_problem(token)
    assert (problem is None) == ok
    assert problem is None or token not in problem or not token


@pytest.mark.parametrize(
    "host",
    [
        b"localhost.localdomain:9811",
        b"LOCALHOST:9811",
        b"localhost.:9811",
        b"ip6-localhost",
        b"localhost4",
        b"[::ffff:127.0.0.1]:9811",
        b"127.1.2.3",
        b"",  # RFC 9112 allows an empty Host
    ],
)
def test_loopback_names_pass_the_host_check(host: bytes) -> None:
    """Regression: the usual /etc/hosts aliases of the loopback interface, a trailing dot, an
    IPv4-mapped loopback address and an empty Host were refused."""
    assert browser_refusal("GET", [(b"host", host)], True) is None


def test_allowed_hosts_let_a_local_reverse_proxy_through() -> None:
    """A proxy on this machine forwarding its own name (nginx ``proxy_set_header Host $host``)
    to a loopback listener: refused unless the name is in api.allowed_hosts."""
    headers = [(b"host", b"Sup.Example.com")]
    assert "api.allowed_hosts" in str(browser_refusal("GET", headers, True))
    assert browser_refusal("GET", headers, True, ("sup.example.com",)) is None
    assert browser_refusal("GET", [(b"host", b"other.example.com")], True, ("sup.example.com",))


async def test_healthz_uptime_is_not_moved_by_the_wall_clock() -> None:
    """Regression: /healthz's uptime_s was wall time since the start: an NTP step back made
    it 0 (the status page then took the supervisor for restarted and dropped its history)."""
    import httpx

    from supervisor.api import create_app
    from supervisor.clock import FakeClock
    from supervisor.config import Settings
    from supervisor.metrics import Metrics
    from tests.unit.test_metrics_client import FakeRuntime, FakeSampler

    clock = FakeClock()
    rt: Any = FakeRuntime(FakeSampler(None))
    rt.settings, rt.clock = Settings(), clock
    rt.started_wall, rt.started_mono = clock.wall(), clock.now()
    app = create_app(rt, Metrics(rt))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        clock.advance(5.0)
        clock._wall_offset -= 3600.0  # the wall clock stepped back an hour
        assert (await client.get("/healthz")).json()["uptime_s"] == 5.0


def test_the_token_check_resolves_its_annotations_where_older_fastapi_looks() -> None:
    """Regression: the bearer-token check was an instance with ``__call__``. FastAPI before
    0.123.7 resolves a dependency's string annotations (supervisor/api.py has ``from __future__
    import annotations``) through the callable's ``__globals__``, which an instance lacks:
    ``Request`` went unresolved, and with api.token_file set the API never started
    (``PydanticUndefinedAnnotation: name 'Request' is not defined``)."""
    import inspect

    from fastapi import Request

    from supervisor.api import _auth_dependencies

    check = _auth_dependencies("s3cret")[-1].dependency
    assert check is not None
    globalns = getattr(check, "__globals__", {})
    (param,) = inspect.signature(check).parameters.values()
    assert eval(param.annotation, globalns) is Request  # noqa: S307 (what FastAPI does)


async def test_a_token_guards_the_api_built_by_create_app() -> None:
    """The app built with a token (and auth_read) answers 401 without it, 200 with it."""
    import httpx

    from supervisor.api import create_app
    from supervisor.clock import FakeClock
    from supervisor.config import Settings
    from supervisor.metrics import Metrics
    from tests.unit.test_metrics_client import FakeRuntime, FakeSampler

    rt: Any = FakeRuntime(FakeSampler(None))
    settings = Settings()
    rt.settings = settings.model_copy(
        update={"api": settings.api.model_copy(update={"auth_read": True})}
    )
    rt.clock = FakeClock()
    rt.started_wall, rt.started_mono = rt.clock.wall(), rt.clock.now()
    app = create_app(rt, Metrics(rt), "s3cret")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        assert (await client.get("/openapi.json")).status_code == 401
        good = {"authorization": "Bearer s3cret"}
        assert (await client.get("/openapi.json", headers=good)).status_code == 200


async def test_route_keeps_nothing_for_groups_a_reload_removed() -> None:
    """Regression: ``/route`` kept a cached ranking and a turn counter for every group it was
    ever asked about; a group a reload removed (or renamed: ``llm-v1`` -> ``llm-v2``) kept
    both for the rest of the run, one more of each per group a reload took away."""
    from supervisor.api import ROUTE_PATH, create_app
    from supervisor.clock import FakeClock
    from supervisor.config import Settings
    from supervisor.metrics import Metrics
    from tests.unit.test_metrics_client import FakeRuntime, FakeSampler

    rt: Any = FakeRuntime(FakeSampler(None))
    rt.settings, rt.clock = Settings(), FakeClock()
    rt.started_wall, rt.started_mono = rt.clock.wall(), rt.clock.now()
    app = create_app(rt, Metrics(rt))
    answer = app.state.fast_routes[ROUTE_PATH].answer
    for i in range(50):
        rt.groups = {f"llm-v{i}": []}  # each reload renames the group
        got = await answer(f"group=llm-v{i}".encode())
        assert got is not None and got[0] == 503  # no worker is ready in it
    routed = _closed_over(answer)["routed"]
    kept = _closed_over(routed)
    assert set(kept["rankings"]) <= {"llm-v49"}
    assert set(kept["route_turns"]) <= {"llm-v49"}


def _closed_over(fn: Any) -> dict[str, Any]:
    """The variables ``fn`` closes over, by name."""
    cells = zip(fn.__code__.co_freevars, fn.__closure__, strict=True)
    return {name: cell.cell_contents for name, cell in cells}
