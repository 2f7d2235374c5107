"""Configuration: every bad case is one line naming file, key path and value."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from supervisor.config import load_settings, parse_settings
from supervisor.errors import ConfigError

W = {"name": "gpen", "command": ["python", "-m", "app", "--port", "{port}"]}


def bad(data: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_settings(data, "c.toml")
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"workers": [{**W, "replica": 3}]}, "c.toml: workers[0].replica: unknown key (got 3)"),
        ({"supervisor": {"state_dri": "/x"}}, "c.toml: supervisor.state_dri: unknown key"),
        (
            {"workers": [{**W, "replicas": "three"}]},
            "workers[0].replicas: Input should be a valid integer",
        ),
        (
            {"gpu": {"xid_worker_fatal": [13], "xid_device_fatal": [13]}},
            "c.toml: gpu: xid_worker_fatal and xid_device_fatal both list 13",  # no (got {...})
        ),
        ({"gpu": {"xid_worker_fatal": [-5]}}, "gpu.xid_worker_fatal[0]: Input should be greater"),
        ({"supervisor": {"state_dir": ""}}, "supervisor.state_dir: an empty path"),
        ({"workers": [{**W, "replicas": "3"}]}, "workers[0].replicas: Input should be a valid"),
        ({"workers": [{**W, "replicas": 2.0}]}, "workers[0].replicas: Input should be a valid"),
        ({"workers": [{**W, "replicas": True}]}, "workers[0].replicas: expected a number, not"),
        ({"supervisor": {"postmortem_keep": True}}, "supervisor.postmortem_keep: expected a num"),
        ({"workers": [{**W, "stop_timeout_s": False}]}, "stop_timeout_s: expected a number, not"),
        (
            {"workers": [{**W, "health": {"watchdog_s": float("inf")}}]},
            "workers[0].health.watchdog_s: Input should be a finite number (got inf)",
        ),
        (
            {"supervisor": {"shutdown_timeout_s": float("nan")}},
            "supervisor.shutdown_timeout_s: Input should be a finite number (got nan)",
        ),
        (
            {"workers": [{**W, "command": ["x", "a\0b"]}]},
            "workers[0].command: an argument contains a NUL character",
        ),
        (
            {"workers": [{**W, "env": {"A": "a\0b"}}]},
            "workers[0].env: the value of A contains a NUL character",
        ),
        ({"supervisor": {"state_dir": "/a\0b"}}, "supervisor.state_dir: contains a NUL"),
        ({"gpu": {"sim_dir": "a\0b"}}, "gpu.sim_dir: contains a NUL character"),
        ({"api": {"token_file": "/t\0k"}}, "api.token_file: contains a NUL character"),
        (
            {"workers": [{**W, "stop_timeout_s": -1}]},
            "workers[0].stop_timeout_s: Input should be greater than or equal to 0 (got -1)",
        ),
        (
            {"supervisor": {"shutdown_timeout_s": 0}},
            "supervisor.shutdown_timeout_s: Input should be greater than 0 (got 0)",
        ),
        (
            {"workers": [{**W, "command": []}]},
            "workers[0].command: List should have at least 1 item",
        ),
        (
            {"workers": [{**W, "command": [""]}]},
            "workers[0].command: Value error"
            if False
            else "workers[0].command: the program (first element) is empty",
        ),
        (
            {"workers": [W, {**W, "command": ["y"]}]},
            "workers[1].name: duplicate group name 'gpen' (also workers[0])",
        ),
        (
            {
                "workers": [
                    {**W, "port_base": 9000, "replicas": 4},
                    {"name": "b", "command": ["y"], "port_base": 9003},
                ]
            },
            "workers[1].port_base: ports 9003-9003 of group 'b' overlap ports 9000-9003 of group 'gpen'",
        ),
        (
            {"workers": [{**W, "command": ["x", "--gpu={gpu}"]}]},
            "workers[0].command[1]: unknown placeholder {gpu}",
        ),
        (
            {"workers": [{**W, "env": {"A": "{nope}"}}]},
            "workers[0].env.A: unknown placeholder {nope}",
        ),
        (
            {"workers": [{**W, "cwd": "/srv/{model}"}]},
            "workers[0].cwd: unknown placeholder {model}",
        ),
        (
            {"workers": [{**W, "command": ["x", "{port"]}]},
            "workers[0].command[1]: bad placeholder syntax",
        ),
        (
            {"workers": [{**W, "stop_signal": "SIGNOPE"}]},
            "workers[0].stop_signal: unknown signal 'SIGNOPE'",
        ),
        ({"workers": [{**W, "gpus": "all"}]}, 'workers[0].gpus: expected "auto", "none" or a list'),
        ({"workers": [{**W, "gpus": [0, 0]}]}, "workers[0].gpus: duplicate GPU"),
        (
            {"workers": [{**W, "ready": "tcp://x"}]},
            'workers[0].ready: expected "notify", "none" or an http:// (or https://) health URL',
        ),
        (
            {"workers": [{**W, "health": {"liveness_url": "127.0.0.1:{port}/health"}}]},
            'workers[0].health.liveness_url: expected "" (off) or an http:// (or https://) '
            "health URL",
        ),
        (
            {"workers": [{**W, "health": {"liveness_url": "http://127.0.0.1:{prot}/health"}}]},
            "workers[0].health.liveness_url: unknown placeholder {prot}",
        ),
        (
            {"workers": [{**W, "health": {"liveness_failures": 0}}]},
            "workers[0].health.liveness_failures: Input should be greater than or equal to 1",
        ),
        ({"gpu": {"sim_dir": " "}}, "gpu.sim_dir: an empty path"),
        (  # regression: a traceback (OverflowError) from check-config and run
            {"workers": [{**W, "health": {"watchdog_s": 1e308}}]},
            "workers[0].health.watchdog_s: Input should be less than or equal to 1000000000",
        ),
        (  # regression: WATCHDOG_USEC=0, and the worker killed as hung at every start
            {"workers": [{**W, "health": {"watchdog_s": 1e-9}}]},
            "workers[0].health.watchdog_s: 0 (off) or at least 0.001 s (got 1e-09)",
        ),
        *(  # regression: these passed, then crashed `run` at the first probe (every worker)
            (
                {"workers": [{**W, "ready": url}]},
                f'workers[0].ready: expected "notify", "none" or an http:// (or https://) '
                f"health URL with a host (and a valid port) (got {url!r})",
            )
            for url in ("http://127.0.0.1:99999/", "http://127.0.0.1:abc/", "https://[::1")
        ),
        (
            {"workers": [{**W, "restart": {"backoff_initial_s": 10, "backoff_max_s": 1}}]},
            "workers[0].restart: backoff_max_s (1) is below backoff_initial_s (10)",
        ),
        ({"workers": [{**W, "name": "gpen-1"}]}, "workers[0].name: group names are letters"),
        # a URL with a "1" for each placeholder, but no worker's (every probe failed at run)
        (
            {"workers": [{**W, "ready": "http://127.0.0.1:{port}{port}/"}]},
            "workers[0].ready: 'http://127.0.0.1:80018001/' (worker gpen-0) is no http(s) URL",
        ),
        (
            {"workers": [{**W, "health": {"liveness_url": "http://h:{port}{index}/"}}]},
            "workers[0].health.liveness_url: 'http://h:80010/' (worker gpen-0) is no http(s)",
        ),
        # `$` matched before a trailing newline: the name went into file names and labels
        ({"workers": [{**W, "name": "gpen\n"}]}, "workers[0].name: group names are letters"),
        ({"workers": [{"command": ["x"]}]}, "workers[0].name: required key is missing"),
        (
            {"workers": [{**W, "port_base": 65535, "replicas": 2}]},
            "workers[0].port_base: ports 65535-65536 go past 65535",
        ),
        (
            {"workers": [{**W, "health": {"on_leak": "reboot"}}]},
            "workers[0].health.on_leak: Input should be 'drain', 'restart' or 'alert' (got 'reboot')",
        ),
        (
            {"workers": [{**W, "health": {"on_thermal": "restart"}}]},
            "workers[0].health.on_thermal:",
        ),
        (
            {"workers": [{**W, "health": {"log_restart_patterns": ["ok", " "]}}]},
            "workers[0].health.log_restart_patterns: entry 1 is empty",
        ),
        ({"workers": [{**W, "health": {"max_unavailable": 0}}]}, "health.max_unavailable:"),
        ({"workers": [{**W, "health": {"leak_window_s": 1}}]}, "health.leak_window_s:"),
        ({"workers": [{**W, "health": {"host_memory_limit_mb": -1}}]}, "host_memory_limit_mb"),
        # a byte count past a float's range: memory.max could not be written (OverflowError)
        (
            {"workers": [{**W, "health": {"host_memory_limit_mb": 1e303}}]},
            "workers[0].health.host_memory_limit_mb: Input should be less than or equal to",
        ),
        (
            {"gpu": {"xid_worker_fatal": [13, 79]}},
            "gpu: xid_worker_fatal and xid_device_fatal both list 79",
        ),
    ],
)
def test_bad_values(data: dict[str, object], expected: str) -> None:
    assert expected in bad(data)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: config file not found$"):
        load_settings(tmp_path / "nope.toml")


def test_toml_syntax_error(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[supervisor]\nstate_dir = \n")
    with pytest.raises(ConfigError, match=r"c\.toml: TOML syntax error: .*line 2"):
        load_settings(p)


def test_env_overrides_file_and_is_named_in_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[supervisor]\nstate_dir = "/a"\nshutdown_timeout_s = 5\n')
    monkeypatch.setenv("GPU_SUPERVISOR_SUPERVISOR__STATE_DIR", "/b")
    s = load_settings(p)
    assert str(s.supervisor.state_dir) == "/b" and s.supervisor.shutdown_timeout_s == 5
    monkeypatch.setenv("GPU_SUPERVISOR_SUPERVISOR__SHUTDOWN_TIMEOUT_S", "soon")
    with pytest.raises(
        ConfigError, match=r"\[from GPU_SUPERVISOR_SUPERVISOR__SHUTDOWN_TIMEOUT_S\]"
    ):
        load_settings(p)


def test_unrelated_prefixed_env_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_SUPERVISOR_API_TOKEN", "secret")
    monkeypatch.setenv("GPU_SUPERVISOR_SIM_DIR", "/tmp/x")
    assert parse_settings({"workers": [W]}).workers[0].name == "gpen"


def test_ports_are_assigned_without_overlap() -> None:
    s = parse_settings(
        {
            "workers": [
                {**W, "replicas": 3},
                {"name": "b", "command": ["y"], "port_base": 8004, "replicas": 2},
                {"name": "c", "command": ["z"], "replicas": 2},
            ]
        }
    )
    assert [g.port_base for g in s.workers] == [8001, 8004, 8006]


def test_defaults_match_the_design() -> None:
    g = parse_settings({"workers": [W]}).workers[0]
    assert (g.replicas, g.gpus, g.ready, g.start_timeout_s, g.stop_signal) == (
        1,
        "auto",
        "notify",
        120,
        "SIGTERM",
    )
    assert (g.restart.backoff_initial_s, g.restart.backoff_max_s, g.restart.burst) == (1, 60, 5)
    assert (g.restart.stable_s, g.restart.interval_s, g.restart.delay_s) == (10, 120, 0)
    h = g.health
    assert (h.gpu_memory_limit_mb, h.host_memory_limit_mb, h.watchdog_s) == (0, 0, 0)
    assert (h.leak_warmup_s, h.leak_window_s, h.leak_min_mb_per_min, h.oom_horizon_s) == (
        60,
        600,
        10,
        300,
    )
    assert (h.on_leak, h.on_over_budget, h.on_thermal, h.max_unavailable) == (
        "drain",
        "restart",
        "derate",
        1,
    )
    assert h.log_restart_patterns == (
        "CUDA error: an illegal memory access",
        "device-side assert triggered",
    )


@pytest.mark.parametrize(
    ("api", "expected"),
    [
        ({"listen": "0.0.0.0:9811"}, "is not a loopback address"),
        ({"listen": "10.1.2.3:80"}, "no token_file is set"),
        ({"listen": "gpu.localhost:9811"}, "no token_file is set"),  # resolved at bind time
        ({"listen": "9811"}, 'api.listen: expected "HOST:PORT" or "unix:/path"'),
        ({"listen": "127.0.0.1:70000"}, "api.listen: expected"),
        # digits of other scripts: int() took "٠٩" for 9, and "²" was a traceback's message
        ({"listen": "127.0.0.1:\u0660\u0669"}, 'api.listen: expected "HOST:PORT"'),
        ({"listen": "127.0.0.1:\u00b2"}, 'api.listen: expected "HOST:PORT"'),
        ({"listen": ":9811"}, "api.listen: missing host"),
        ({"listen": "unix:relative.sock"}, "api.listen: unix socket path must be absolute"),
        ({"auth_read": True}, "auth_read: needs api.token_file"),
        ({"lisen": "x"}, "api.lisen: unknown key"),
        ({"allowed_hosts": ["sup.example.com:443"]}, "not a host name without port"),
        ({"allowed_hosts": [""]}, "not a host name without port"),
    ],
)
def test_bad_api_section(api: dict[str, object], expected: str) -> None:
    assert expected in bad({"api": api})


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:9811", "127.0.0.1:0", "[::1]:9811", "localhost:1", "unix:/run/x.sock", ""]
)
def test_good_listen_values(listen: str) -> None:
    assert parse_settings({"api": {"listen": listen}}).api.listen == listen


@pytest.mark.parametrize(
    "listen",
    ["http://127.0.0.1:9811", "[::1:9811", "::1]:9811", "[::1]]:9811", "my host:9811", "[a/b]:1"],
)
def test_a_listen_host_that_no_address_can_be_is_refused(tmp_path: Path, listen: str) -> None:
    """Regression: an ``api.listen`` whose host can be no address (a URL written for it, an
    IPv6 literal with one bracket) passed the config check (``check-config`` said 0) and only
    ``run`` failed, exit 1, with "cannot resolve 'http://127.0.0.1'" (and without a token the
    check said it was "not a loopback address", which sent the operator after the token)."""
    token = str(tmp_path / "t")
    for api in ({"listen": listen, "token_file": token}, {"listen": listen}):
        msg = bad({"api": api})
        assert msg.startswith('c.toml: api.listen: expected "HOST:PORT" or "unix:/path"'), msg
        assert repr(listen) in msg


def test_non_loopback_listen_is_fine_with_a_token(tmp_path: Path) -> None:
    settings = parse_settings(
        {"api": {"listen": "0.0.0.0:9811", "token_file": str(tmp_path / "t")}}
    )
    assert settings.api.token_file == tmp_path / "t"


def test_bad_alerts_and_metrics_path() -> None:
    assert "alerts.webhook_url: expected an http" in bad({"alerts": {"webhook_url": "ftp://x"}})
    assert "workers[0].metrics_path: expected an absolute URL path" in bad(
        {"workers": [{**W, "metrics_path": "metrics"}]}
    )
    assert "supervisor.postmortem_keep" in bad({"supervisor": {"postmortem_keep": 0}})
    # a query goes to Prometheus as __param_<name> labels: names it cannot take are refused
    assert "query parameter 'name[]': Prometheus takes only names" in bad(
        {"workers": [{**W, "metrics_path": "/metrics?name[]=x"}]}
    )
    assert "metrics_path: a URL path has no fragment" in bad(
        {"workers": [{**W, "metrics_path": "/metrics#x"}]}
    )
    assert (
        parse_settings({"workers": [{**W, "metrics_path": "/metrics?format=prometheus"}]})
        .workers[0]
        .metrics_path
        == "/metrics?format=prometheus"
    )


@pytest.mark.parametrize(("name", "value"), [("WORKERS", "not json"), ("GPU", "{bad")])
def test_an_environment_override_that_is_not_json(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(f"GPU_SUPERVISOR_{name}", value)
    msg = bad({"workers": [W]})
    assert msg.startswith(f"c.toml: environment variable GPU_SUPERVISOR_{name}: not valid JSON")
    assert msg.endswith(f"(got {value!r})")


def test_worker_ports_and_the_api_port() -> None:
    """Regression: a group could be given the API's own port; its worker could never bind it."""
    api = {"listen": "127.0.0.1:8001"}
    msg = bad({"api": api, "workers": [{**W, "port_base": 8000, "replicas": 2}]})
    assert msg == (
        "c.toml: workers[0].port_base: ports 8000-8001 of group 'gpen' include the API's "
        "port 8001 (api.listen)"
    )
    auto = parse_settings({"api": api, "workers": [{**W, "replicas": 2}]})
    assert auto.workers[0].port_base == 8002  # handed-out ports go around it
    assert parse_settings({"api": {"listen": "127.0.0.1:0"}, "workers": [W]}).workers[0].port_base


def test_a_check_of_several_keys_does_not_print_the_whole_section() -> None:
    gpu = {"xid_worker_fatal": [13], "xid_device_fatal": [13]}
    assert bad({"gpu": gpu}) == "c.toml: gpu: xid_worker_fatal and xid_device_fatal both list 13"


def test_handed_out_ports_go_around_the_default_api_port() -> None:
    """With [api] not written, the API listens on 127.0.0.1:9811: a range across it skips it."""
    s = parse_settings({"workers": [{**W, "replicas": 2000}]})
    base = s.workers[0].port_base
    assert base is not None and 9811 not in range(base, base + 2000)


def test_a_boolean_for_an_optional_number() -> None:
    assert bad({"workers": [{**W, "port_base": True}]}).startswith(
        "c.toml: workers[0].port_base: expected a number, not a boolean"
    )


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        (
            '[supervisor]\nshutdown_timeout_s = "30"\n',
            "supervisor.shutdown_timeout_s: expected a number, not a string (got '30')",
        ),
        ("[api]\nauth_read = 1\n", "api.auth_read: expected true or false (got 1)"),
        (
            '[[workers]]\nname = "a"\ncommand = ["x"]\nlog_passthrough = "yes"\n',
            "workers[0].log_passthrough: expected true or false (got 'yes')",
        ),
        (
            '[[workers]]\nname = "a"\ncommand = ["x"]\n[workers.health]\nleak_window_s = "600"\n',
            "workers[0].health.leak_window_s: expected a number, not a string (got '600')",
        ),
    ],
)
def test_toml_values_of_the_wrong_type_are_refused(
    tmp_path: Path, toml: str, expected: str
) -> None:
    """In the file, TOML's types count (environment overrides, all strings, are converted)."""
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(info.value) == f"{path}: {expected}"


def test_environment_overrides_are_still_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_SUPERVISOR_SUPERVISOR__SHUTDOWN_TIMEOUT_S", "30")
    monkeypatch.setenv("GPU_SUPERVISOR_SUPERVISOR__MAX_STARTING", "2")  # was refused: strict
    path = tmp_path / "c.toml"
    path.write_text("")
    settings = load_settings(path)
    assert settings.supervisor.shutdown_timeout_s == 30
    assert settings.supervisor.max_starting == 2


def test_a_bad_webhook_url_is_named_without_its_secret() -> None:
    """Regression: a typo in the scheme printed (and on a reload logged) the whole URL."""
    url = "htps://hooks.example.com/services/T0/B0/SECRETTOKEN?key=ALSOSECRET"
    msg = bad({"alerts": {"webhook_url": url}})
    assert msg == (
        "c.toml: alerts.webhook_url: expected an http:// or https:// URL with a host (and a "
        "valid port) (got 'htps://hooks.example.com')"
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("GPU_SUPERVISOR_SUPERVISR__STATE_DIR", "unknown section 'supervisr'"),
        (
            "GPU_SUPERVISOR_SUPERVISOR_STATE_DIR",
            "did you mean GPU_SUPERVISOR_SUPERVISOR__STATE_DIR?",
        ),
        ("gpu_supervisor_api_listen", "did you mean GPU_SUPERVISOR_API__LISTEN?"),
    ],
)
def test_a_misspelled_environment_override_is_an_error(
    monkeypatch: pytest.MonkeyPatch, name: str, message: str
) -> None:
    """An override that would be silently ignored is refused, as an unknown key is; the
    workers' own variables and the API token are not overrides."""
    for ok in (
        "GPU_SUPERVISOR_API_TOKEN",
        "GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB",
        "GPU_SUPERVISOR_WORKER",
        "GPU_SUPERVISOR_SIM_DIR",
        "GPU_SUPERVISOR_INSTANCE",
    ):
        monkeypatch.setenv(ok, "1")
    parse_settings({})  # fine
    monkeypatch.setenv(name, "/x")
    with pytest.raises(ConfigError) as err:
        parse_settings({}, "cfg.toml")
    assert str(err.value).startswith(f"cfg.toml: environment variable {name}: ")
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        # regression: named GPU_SUPERVISOR_API and "got None", not the variable and its value
        ("GPU_SUPERVISOR_API__ALLOWED_HOSTS", "notjson", "not valid JSON (Expecting value"),
        # regression: "workers: Input should be a valid list", the variable never named
        ("GPU_SUPERVISOR_WORKERS__0__REPLICAS", "5", "the worker groups are a list"),
    ],
)
def test_a_bad_override_names_its_variable_and_value(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        parse_settings({}, "cfg.toml")
    assert str(err.value).startswith(f"cfg.toml: environment variable {name}: ")
    assert message in str(err.value)
    if "JSON" in message:
        assert str(err.value).endswith(f"(got {value!r})")


@pytest.mark.parametrize(
    ("running", "toml"),
    [
        ("None", "[[workers]]\ncommand = ['x']\n"),
        ("True", "[[workers]]\nname = true\ncommand = ['x']\n"),
        ("inf", "[[workers]]\nname = inf\ncommand = ['x']\n"),
    ],
)
def test_a_reload_with_a_name_that_is_no_string_is_one_line(
    tmp_path: Path, running: str, toml: str
) -> None:
    """The ports kept on a reload are looked up by the groups' names as written: a missing
    name, or one that is no string, is the validation's to report (regression: KeyError)."""
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError, match=r"c\.toml: workers\[0\]\.name: "):
        load_settings(p, {running: range(8001, 8002)})


@pytest.mark.parametrize("keep", [False, True])
def test_a_huge_replicas_with_a_port_base_is_refused_not_a_hang(tmp_path: Path, keep: bool) -> None:
    """Ports are handed out from 8001 past the ranges the file already claims: a group with
    ``port_base`` and a typo'd ``replicas`` claimed billions, and the search for the next
    group's range never ended (``check-config``, ``run`` and a reload hung)."""
    p = tmp_path / "c.toml"
    p.write_text(
        "[[workers]]\nname = 'a'\ncommand = ['x']\nport_base = 8001\nreplicas = 10000000000\n"
        "[[workers]]\nname = 'b'\ncommand = ['x']\n"
    )
    result: list[BaseException] = []
    done = threading.Event()

    def load() -> None:
        try:
            load_settings(p, {"b": range(9000, 9001)} if keep else None)
        except BaseException as exc:
            result.append(exc)
        done.set()

    threading.Thread(target=load, daemon=True).start()
    assert done.wait(10), "load_settings did not return"
    assert isinstance(result[0], ConfigError)
    assert "c.toml: workers[0].replicas: Input should be less than or equal to 4096" in str(
        result[0]
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GPU_SUPERVISOR_API__LISTEN", "127.0.0.1:8002"),
        ("GPU_SUPERVISOR_API", '{"listen": "127.0.0.1:8002"}'),
    ],
)
def test_a_reload_keeps_automatic_ports_off_an_api_port_set_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """Regression: a reload that grew a group with automatic ports kept the group's range by
    the file's ``api.listen``, not the environment's: with the API's port set by
    ``GPU_SUPERVISOR_API__LISTEN`` the range was kept onto it and the reload rejected ("include
    the API's port"), where the same listen in the file moved the group to a free range."""
    p = tmp_path / "c.toml"
    p.write_text("[[workers]]\nname = 'w'\ncommand = ['x']\nreplicas = 2\n")
    monkeypatch.setenv(name, value)
    s = load_settings(p, {"w": range(8001, 8002)})
    assert s.api.listen == "127.0.0.1:8002"
    assert s.workers[0].port_base == 8003


@pytest.mark.parametrize(
    "name",
    [
        "GPU_SUPERVISOR_GPU__BACKEND__X",
        "GPU_SUPERVISOR_API__ALLOWED_HOSTS__0",
        "GPU_SUPERVISOR_SUPERVISOR__STATE_DIR__X",
    ],
)
def test_an_override_nested_too_deep_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Regression: an override with a key path below a key (``GPU_SUPERVISOR_GPU__BACKEND__X``,
    a list item as ``..._ALLOWED_HOSTS__0``) was reported as the key's own mistake
    (``c.toml: gpu.backend: Input should be 'auto', ...``) without naming the variable: the
    user looked for it in a file that did not have it."""
    monkeypatch.setenv(name, "x")
    assert bad({}).endswith(f"[from {name}]")
    monkeypatch.delenv(name)
    monkeypatch.setenv("GPU_SUPERVISOR_GPU__RESERVE_MB", "100")  # not the one at fault
    assert "[from" not in bad({"gpu": {"backend": "x"}})


def test_a_check_of_several_keys_names_the_sections_environment_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``xid_worker_fatal`` from the environment overlapping the file's
    ``xid_device_fatal`` was reported as ``c.toml: gpu: ... both list 46``, naming no
    variable: the user looked for the overlap in a file that did not have it."""
    monkeypatch.setenv("GPU_SUPERVISOR_GPU__XID_WORKER_FATAL", "[46]")
    line = bad({"gpu": {"xid_device_fatal": [46, 79]}})
    assert "both list 46" in line, line
    assert line.endswith("[the environment sets GPU_SUPERVISOR_GPU__XID_WORKER_FATAL]"), line
    monkeypatch.delenv("GPU_SUPERVISOR_GPU__XID_WORKER_FATAL")
    line = bad({"gpu": {"xid_device_fatal": [46], "xid_worker_fatal": [46]}})
    assert "environment" not in line, line  # all from the file: nothing more said


def test_a_reload_of_an_empty_file_says_why_where_the_environment_names_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty file is refused on a reload (a write cut short). Where
    ``GPU_SUPERVISOR_WORKERS`` names the workers, it would not stop them, and the refusal
    said it would (regression); it says what it would do: reset what the file sets."""
    p = tmp_path / "c.toml"
    p.write_text("\n")
    with pytest.raises(ConfigError, match="would stop every worker"):
        load_settings(p, refuse_empty=True)
    monkeypatch.setenv("GPU_SUPERVISOR_WORKERS", '[{"name": "a", "command": ["x"]}]')
    with pytest.raises(ConfigError) as err:
        load_settings(p, refuse_empty=True)
    assert "would set every key the file sets to its default" in str(err.value)
    assert "stop every worker" not in str(err.value)
    assert [g.name for g in load_settings(p).workers] == ["a"]  # at the start: taken


@pytest.mark.parametrize(
    "name", ["qwen2-7b", "llama-3.1-8b", "gpt-4o", "sd-1.5", "7b-chat", "a-1-b", "x_2-3d"]
)
def test_model_names_with_digits_after_a_dash_are_group_names(name: str) -> None:
    """Regression: a group name with a digit first or right after a dash (``qwen2-7b``,
    ``llama-3.1-8b``, ``7b-chat``: the usual model names) was refused, with a message that
    says group names are letters, digits, '_', '.' and '-' (not ending in -<number>)."""
    settings = parse_settings({"workers": [{**W, "name": name}]}, "c.toml")
    assert settings.workers[0].worker_names() == [f"{name}-0"]


@pytest.mark.parametrize("name", ["gpen-1", "a-b-12", "a-", "-a", "a--b", ".a", "a b", "gpü"])
def test_names_that_end_in_a_number_or_are_no_words_are_still_refused(name: str) -> None:
    """A name ending in -<number> reads as a worker of another group; the rest are no names
    for files, labels and URLs."""
    assert "workers[0].name: group names are letters" in bad({"workers": [{**W, "name": name}]})


@pytest.mark.parametrize(
    "user", ["svc-gpu@corp.example.com", "svc@ad.example.com:ml@ad.example.com"]
)
def test_a_fully_qualified_directory_user_is_a_user(user: str) -> None:
    """Regression: ``user = "svc-gpu@corp.example.com"``, the name an SSSD (Active Directory,
    LDAP) host gives its accounts with ``use_fully_qualified_names``, was refused (exit 2): no
    such name was said to be a user name."""
    settings = parse_settings({"workers": [{**W, "user": user}]}, "c.toml")
    assert settings.workers[0].user == user


@pytest.mark.parametrize("user", ["@corp.example.com", "a b", "a:b:c", "ü"])
def test_what_is_no_user_name_is_still_refused(user: str) -> None:
    assert "workers[0].user: expected" in bad({"workers": [{**W, "user": user}]})
