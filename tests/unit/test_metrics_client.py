"""The metrics collector over a runtime's read model, and the client's pure helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.client import _duration, format_status, resolve, url_for
from supervisor.config import ApiSection
from supervisor.errors import ConfigError, UsageError
from supervisor.healing import HealState
from supervisor.journal import Journal
from supervisor.listen import load_token
from supervisor.metrics import Metrics
from supervisor.model import DeviceIdentity, DeviceSample, Sample
from supervisor.records import WriteHealth

if TYPE_CHECKING:
    from supervisor.runtime import Runtime

UUID0 = "GPU-0"
UUID1 = "GPU-1"


@dataclass
class FakeSampler:
    last: Sample | None
    identities: tuple[DeviceIdentity, ...] = (
        DeviceIdentity(0, UUID0, "Sim"),
        DeviceIdentity(1, UUID1, "Sim"),
    )
    stuck_s: float | None = None  # a backend call in flight that long, once it counts as stuck
    xids_unwatched: dict[str, str] = field(default_factory=dict)  # GPU UUID -> why

    def stuck(self) -> float | None:
        return self.stuck_s


@dataclass
class FakeRuntime:
    """The part of ``Runtime``'s read model that the collector reads (no workers)."""

    sampler: FakeSampler
    cordoned: set[str] = field(default_factory=set)
    xid_counts: dict[tuple[str, int], int] = field(default_factory=dict)
    restarts_total: dict[tuple[str, str], int] = field(default_factory=dict)
    actions_total: dict[tuple[str, str], int] = field(default_factory=dict)
    postmortems_total: dict[str, int] = field(default_factory=dict)
    last_reload: tuple[bool, float] = (True, 1_700_000_000.0)
    write_health: WriteHealth = field(default_factory=WriteHealth)
    journal: Journal = field(default_factory=Journal)
    runners: dict[str, object] = field(default_factory=dict)
    sample_listeners: list[object] = field(default_factory=list)
    loop_alive_at: float = 0.0
    healer: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(state=HealState()))

    def workers(self) -> list[object]:
        return []


def runtime_with(sample: Sample) -> Runtime:
    return cast("Runtime", FakeRuntime(FakeSampler(sample)))


def families(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = metrics.render().decode()
    return {
        f.name: [(dict(s.labels), s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
    }


def sample(t: float, **gpu1: object) -> Sample:
    return Sample(
        t=t,
        devices=(
            DeviceSample(
                0,
                UUID0,
                "Sim",
                memory_total_mb=100.0,
                memory_used_mb=25.0,
                utilization_percent=50.0,
                temperature_c=None,
                power_watts=None,
                clocks_event_reasons=0x1 | 0x40,
            ),
            DeviceSample(1, UUID1, "Sim", **gpu1),  # type: ignore[arg-type]
        ),
        workers={},
        nvml_available=True,
    )


def test_gpu_metrics_leave_unknown_values_out() -> None:
    rt = runtime_with(sample(1.0, healthy=False, error="GPU is lost"))
    rt.cordoned.add(UUID1)
    rt.xid_counts[(UUID0, 79)] = 2
    rt.xid_counts[("1", 13)] = 1
    m = families(Metrics(rt))
    mib = 1024 * 1024
    assert m["gpu_supervisor_gpu_memory_used_bytes"] == [
        ({"gpu": "0", "uuid": UUID0, "name": "Sim"}, 25 * mib)
    ]
    assert m["gpu_supervisor_gpu_utilization_percent"][0][1] == 50.0
    assert m["gpu_supervisor_gpu_temperature_celsius"] == []  # not supported: absent, never 0
    assert m["gpu_supervisor_gpu_power_watts"] == []
    throttle = {
        s["reason"]: v for s, v in m["gpu_supervisor_gpu_throttle_reason"] if s["gpu"] == "0"
    }
    assert throttle["hw_thermal_slowdown"] == 1 and throttle["sw_power_cap"] == 0
    assert "gpu_idle" not in throttle
    assert m["gpu_supervisor_gpu_throttled"] == [({"gpu": "0", "uuid": UUID0, "name": "Sim"}, 1.0)]
    assert [v for _, v in m["gpu_supervisor_gpu_healthy"]] == [1.0, 0.0]
    assert [v for _, v in m["gpu_supervisor_gpu_cordoned"]] == [0.0, 1.0]
    xids = {(s["gpu"], s["xid"]): v for s, v in m["gpu_supervisor_gpu_xid_errors"]}
    assert xids == {("0", "79"): 2.0, ("1", "13"): 1.0}
    assert m["gpu_supervisor_nvml_up"] == [({}, 1.0)]
    assert {s["file"] for s, _ in m["gpu_supervisor_records_writable"]} == {
        "state",
        "postmortem",
        "log",
    }


def test_render_is_cached_until_something_changes() -> None:
    rt = runtime_with(sample(1.0))
    metrics = Metrics(rt)
    first = metrics.render()
    assert metrics.render() is first and metrics.renders == 1
    rt.actions_total[("drain", "operator")] = 1
    assert b'gpu_supervisor_actions_total{action="drain",reason="operator"} 1.0' in metrics.render()
    assert metrics.renders == 2
    new = sample(2.0)
    rt.sampler.last = new
    metrics.observe(new)
    assert b"gpu_supervisor_sample_duration_seconds_count 1.0" in metrics.render()
    assert metrics.renders == 3


def test_nvml_down_means_no_gpu_series() -> None:
    rt = runtime_with(Sample(t=1.0, devices=(), workers={}, nvml_available=False, error="x"))
    m = families(Metrics(rt))
    assert m["gpu_supervisor_nvml_up"] == [({}, 0.0)]
    assert m["gpu_supervisor_gpu_healthy"] == []


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("127.0.0.1:9811", "http://127.0.0.1:9811"),
        ("0.0.0.0:80", "http://127.0.0.1:80"),
        ("[::]:9811", "http://[::1]:9811"),
        ("[::1]:9811", "http://[::1]:9811"),
        ("localhost:1", "http://localhost:1"),
        ("unix:/run/gs.sock", "unix:/run/gs.sock"),
        ("127.0.0.1:0", None),
        ("", None),
    ],
)
def test_url_for_listen(listen: str, url: str | None) -> None:
    assert url_for(listen) == url


def test_resolve_token_from_env_then_file(tmp_path: Path) -> None:
    token = tmp_path / "t"
    token.write_text("from-file\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[api]\nlisten = "unix:{tmp_path}/s"\ntoken_file = "{token}"\n'
        '[[workers]]\nname = "a"\ncommand = ["x"]\n'
    )
    assert resolve(None, str(cfg), {}) == (f"unix:{tmp_path}/s", "from-file")
    env = {"GPU_SUPERVISOR_API_TOKEN": "from-env"}
    assert resolve("http://h:1", str(cfg), env) == ("http://h:1", "from-env")
    assert resolve(None, None, {}) == ("http://127.0.0.1:9811", None)
    with pytest.raises(UsageError):
        resolve("h:1", None, {})


@pytest.mark.parametrize(
    ("variable", "value", "url"),
    [
        ("GPU_SUPERVISOR_API__LISTEN", "0.0.0.0:9900", "http://127.0.0.1:9900"),
        ("GPU_SUPERVISOR_API__AUTH_READ", "true", "http://127.0.0.1:9811"),
    ],
)
def test_a_client_without_a_config_finds_an_api_whose_token_file_only_the_file_names(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, url: str
) -> None:
    """A supervisor whose config file sets `api.token_file`, its environment the rest
    (`docker run -e GPU_SUPERVISOR_API__LISTEN=0.0.0.0:9900`): a client command run there
    without `-c` (`docker exec ... gpu-supervisor status`) asks it where it listens, its
    token from GPU_SUPERVISOR_API_TOKEN. Regression: the environment alone was held to the
    server's rules ("not a loopback address and no token_file is set", "auth_read: needs
    api.token_file"): exit 2, where the default address had been asked before."""
    monkeypatch.setenv(variable, value)
    assert resolve(None, None, {"GPU_SUPERVISOR_API_TOKEN": "tok"}) == (url, "tok")


def test_a_read_only_command_needs_no_token_it_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` and `health` only GET, which needs no token unless `auth_read`: an operator's
    shell (or a probe) that cannot read the service user's 0600 token file still gets them.
    Regression: "cannot read: Permission denied", exit 2 (status) or 1 (health)."""
    token = tmp_path / "t"
    token.write_text("tok\n")
    token.chmod(0o600)
    cfg = tmp_path / "c.toml"
    text = f'[api]\nlisten = "unix:{tmp_path}/s"\ntoken_file = "{token}"\n'
    cfg.write_text(text)
    real_access = os.access
    monkeypatch.setattr(  # this user may not read it (root may read anything)
        os, "access", lambda p, m: False if os.fspath(p) == str(token) else real_access(p, m)
    )
    assert resolve(None, str(cfg), {}, read_only=True) == (f"unix:{tmp_path}/s", None)
    cfg.write_text(text + "auth_read = true\n")  # GETs need it too: read it (or fail)
    assert resolve(None, str(cfg), {}, read_only=True)[1] == "tok"


@pytest.mark.parametrize(
    ("mode", "text", "error"),
    [
        (0o600, "tok\n", None),
        (0o400, "tok", None),
        (0o640, "tok", "mode 0640 lets group or others access the token"),
        (0o604, "tok", "mode 0604"),
        (0o600, "\n", "empty"),
        (0o600, "two words", "must be one token of printable ASCII"),
        (0o600, "tökén", "must be one token of printable ASCII"),
    ],
)
def test_token_file_checks(tmp_path: Path, mode: int, text: str, error: str | None) -> None:
    path = tmp_path / "token"
    path.write_text(text)
    os.chmod(path, mode)
    api = ApiSection(listen="127.0.0.1:0", token_file=path)
    if error is None:
        assert load_token(api) == "tok"
    else:
        with pytest.raises(ConfigError, match=error) as info:
            load_token(api)
        assert str(info.value).startswith(f"api.token_file {path}: ")
    missing = ApiSection(listen="127.0.0.1:0", token_file=tmp_path / "nope")
    with pytest.raises(ConfigError, match="file not found"):
        load_token(missing)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(11130.4, "3h05m"), (750, "12m30s"), (45.2, "45s"), (0.3, "<1s"), (0, "0s")],
)
def test_durations_in_the_status_footer(seconds: float, text: str) -> None:
    assert _duration(seconds) == text


def test_status_table() -> None:
    gpu = {
        "devices": [
            {
                "id": 0,
                "uuid": UUID0,
                "name": "Sim",
                "memory": {"used_mb": 10.0, "total_mb": 100.0, "free_mb": 90.0},
                "utilization_percent": None,
                "temperature_celsius": 40.0,
                "healthy": False,
                "error": "GPU is lost",
                "cordoned": True,
            }
        ]
    }
    workers: list[dict[str, Any]] = [
        {
            "name": "a-0",
            "state": "ready",
            "pid": 12,
            "gpus": [UUID0],
            "gpu_memory_mb": 10.0,
            "gpu_memory_in_use_mb": 7.25,
            "host_rss_mb": 5.5,
            "restarts": 2,
            "leak": {"slope_mb_per_min": 12.5, "suspected": True},
            "host_memory_enforcement": "rss_watch",
            "recycle_in_s": 11130.4,
        },
        {"name": "b-0", "state": "stopped", "pid": None, "gpus": None, "restarts": 0},
        {
            "name": "d-0",
            "state": "ready",
            "pid": 13,
            "gpus": [UUID0],
            "restarts": 0,
            "derated": True,
            "derated_reason": "GPU 0 is hot: temperature 86C",
            "recycle_in_s": 0.0,
            "liveness": {"url": "http://h:1/health", "failed": 2, "of": 3, "last": "HTTP 500"},
        },
        {
            "name": "c-0",
            "state": "fatal",
            "pid": None,
            "gpus": None,
            "restarts": 4,
            "reason": "4 failed starts within 60s (burst 3); last: exit code 3",
        },
        {
            "name": "e-0",
            "state": "starting",
            "pid": None,
            "gpus": None,
            "restarts": 0,
            "reason": "waiting its turn to start (max_starting = 1, 0 ahead)",
        },
        {"name": "e-1", "state": "starting", "pid": 14, "gpus": None, "reason": "start"},
    ]
    lines = format_status(gpu, workers).splitlines()
    assert lines[1].split() == [
        "0",
        UUID0,
        "Sim",
        "10/100",
        "n/a",
        "40C",
        "UNHEALTHY",
        "(GPU",
        "is",
        "lost)",
        "yes",
    ]
    assert lines[4].split() == [
        "a-0",
        "ready",
        "12",
        "0",
        "10",
        "MiB",
        "7",
        "MiB",
        "6",
        "MiB",
        "2",
        "+12.5",
        "!",
    ]
    assert lines[5].split() == ["b-0", "stopped", "-", "-", "-", "-", "-", "0", "-"]
    # why a worker does not serve, under the table (regression: only in --json)
    # a derated worker is ready but out of routing (regression: not listed)
    # (a worker about to start without a process says why: its turn, its GPU; regression: a
    # row "starting -" with no word, hundreds of them under max_starting)
    assert lines[10:15] == [
        "",
        "not serving:",
        "  d-0 derated: GPU 0 is hot: temperature 86C",
        "  c-0 fatal: 4 failed starts within 60s (burst 3); last: exit code 3",
        "  e-0 starting: waiting its turn to start (max_starting = 1, 0 ahead)",
    ]
    # when max_age_s recycles each worker next (a deferred one is due)
    assert lines[15:17] == [
        "",
        "next recycle (max_age_s): a-0 in 3h05m; d-0 due (waiting its turn)",
    ]
    # a ready worker whose liveness probes fail (not yet restarted)
    assert lines[17:20] == [
        "",
        "failing liveness probes:",
        "  d-0: 2 of 3 probes of http://h:1/health failed in a row (last: HTTP 500)",
    ]
    assert lines[21] == (
        "host memory budgets: the RSS watch only (no delegated cgroup v2 memory controller)"
    )
    hot = {"id": 1, "uuid": UUID1, "name": "Sim", "healthy": True, "hot": True}
    assert format_status({"devices": [hot]}, []).splitlines()[1].split()[-2:] == ["HOT", "no"]
    assert format_status({"devices": [], "error": "NVML missing"}, []).splitlines() == [
        "no GPU telemetry: NVML missing",
        "",
        "no workers",
    ]


async def test_async_render_formats_off_the_loop_and_serves_a_young_one_meanwhile() -> None:
    rt = runtime_with(sample(1.0))
    metrics = Metrics(rt)
    first = await metrics.render_async()
    assert first == metrics.render() and metrics.renders == 1
    rt.actions_total[("drain", "operator")] = 1
    fresh = await metrics.render_async()
    assert b'action="drain"' in fresh and metrics.renders == 2
    assert await metrics.render_async() is fresh  # unchanged: cached


def test_a_wait_on_the_journal_says_when_the_supervisor_restarted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``restart --rolling --wait`` and ``reload --wait`` follow the journal by ``seq``, which
    starts at 1 again in a new run of the supervisor. Regression: after a restart (systemd's
    Restart=) the wait polled ``since=N`` of the old run and got [] for ever. The events'
    run header changes, and the wait ends saying so (exit 1)."""
    import httpx

    from supervisor import client as client_module
    from supervisor.client import RUN_HEADER, Client, _wait_rollout

    monkeypatch.setattr(client_module, "ROLLOUT_POLL_S", 0.0)
    answers = iter(["run-a", "run-a", "run-b"])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=[], headers={RUN_HEADER: next(answers)})

    with Client("http://127.0.0.1:1", transport=httpx.MockTransport(handler)) as client:
        assert _wait_rollout(client, "g", 41) == 1
    assert "the supervisor restarted meanwhile" in capsys.readouterr().err


def test_status_says_a_suspect_gpu_is_not_placed_on() -> None:
    """Regression: a GPU marked suspect (an exited worker's processes still hold memory on it
    after the GPU-release barrier: nothing is placed on it) showed HEALTH ``ok`` in
    ``gpu-supervisor status``, the one place an operator looks when a worker does not start
    again there."""
    suspect = {"id": 0, "uuid": UUID0, "name": "Sim", "healthy": True, "suspect": True}
    row = format_status({"devices": [suspect]}, []).splitlines()[1]
    assert "ok" not in row.split(), row
    assert "SUSPECT" in row, row


def test_a_socket_this_user_may_not_open_is_not_said_to_be_down() -> None:
    """Regression: a unix socket the user may not open (the supervisor runs; its socket is
    the service user's, mode 0660) read "cannot reach ...: is it running? ([Errno 13]
    Permission denied)", which sent the operator to look for a supervisor that runs. It says
    permission denied and whose socket to use; a socket nobody listens on is still "is it
    running?"."""
    import httpx

    from supervisor.client import Client
    from supervisor.errors import ApiClientError

    for errno_text, said in (
        ("[Errno 13] Permission denied", "permission denied (run as a user who may open"),
        ("[Errno 111] Connection refused", "is it running? (connection refused)"),
    ):

        def handler(request: httpx.Request, text: str = errno_text) -> httpx.Response:
            raise httpx.ConnectError(text, request=request)

        with (
            Client("http://127.0.0.1:1", transport=httpx.MockTransport(handler)) as client,
            pytest.raises(ApiClientError) as caught,
        ):
            client.json("/api/v1/workers")
        assert said in str(caught.value), caught.value


def test_logs_follow_shows_what_was_held_back_when_the_follow_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``logs -f`` on a terminal holds back a carriage return at the end of a read
    (a CRLF's, if a newline follows) and the bytes of a character cut by the read; when the
    follow ended (the supervisor stopped, the worker was removed) they were never shown. They
    are shown as they are once nothing follows."""
    from supervisor import client as client_module
    from supervisor.client import _LogOut, _rest_of_log

    shown: list[bytes] = []
    monkeypatch.setattr(client_module, "_out", shown.append)
    for tail, expected in ((b"\r", "\\x0d"), ("é".encode()[:1], "\\xc3")):
        shown.clear()
        out = _LogOut(terminal=True)
        out.write(b"done" + tail)
        assert b"".join(shown).decode() == "done"
        _rest_of_log(None, "", 0, out)
        assert b"".join(shown).decode() == "done" + expected, shown
