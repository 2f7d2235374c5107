"""The client commands end to end: ``status``, ``drain``, ``restart [--rolling]``, ``stop``,
``start``, ``cordon``, ``uncordon`` against a running supervisor (API on a unix socket, with a
token), with their exit codes."""

from __future__ import annotations

import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from supervisor import client as client_module
from supervisor.cli import main
from tests.conftest import SupervisorFactory
from tests.harness import Supervisor, serving, worker_cmd
from tests.harness import client as cli_client
from tests.harness import run_cli as cli

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
TOKEN = "cli-token"  # noqa: S105 - test data


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_client_commands(
    supervisor: SupervisorFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    socket_path = tmp_path / "api.sock"
    config: dict[str, Any] = {
        "supervisor": {"sample_interval_s": 0.1},
        "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim"), "release_timeout_s": 1},
        "api": {"listen": f"unix:{socket_path}", "token_file": str(token_file)},
        "workers": [
            {
                "name": "g",
                "replicas": 2,
                "command": worker_cmd("gpu_user", "100"),
                "drain_timeout_s": 0.2,
                "stop_timeout_s": 2,
                "restart": {"stable_s": 0.2},  # a rolling restart waits this long a worker
            },
            {"name": "c", "gpus": "none", "command": worker_cmd("ready_then_sleep")},
        ],
    }
    sup = supervisor(config, log_level="debug")
    cfg = str(sup.config_path)
    assert sup.api_url() == f"unix:{socket_path}"
    for w in ("g-0", "g-1", "c-0"):
        sup.ready(w)
    sup.wait_event(event="gpu.sample", workers=lambda w: w.get("g-1", {}).get("gpu_mb") == 100.0)
    monkeypatch.delenv("GPU_SUPERVISOR_API_TOKEN", raising=False)

    # status, in a real child process: the table, GPUs first
    out = cli("status", "-c", cfg)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["GPU", "UUID", "NAME"]
    assert "CORDONED" in lines[0]
    assert lines[1].split()[:2] == ["0", UUID0]
    header = next(i for i, line in enumerate(lines) if line.startswith("WORKER"))
    assert header > 2
    assert lines[header].split() == [
        "WORKER",
        "STATE",
        "PID",
        "GPU",
        "GPU",
        "MEM",
        "IN",
        "USE",
        "RSS",
        "RESTARTS",
        "LEAK",
        "(MiB/min)",
    ]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 :]}
    assert rows["g-0"][1] == "ready" and rows["g-0"][3] == "0"
    assert rows["g-1"][3] == "1" and rows["g-1"][4:6] == ["100", "MiB"]
    assert rows["c-0"][3] == "-"

    code, text, _ = run(capsys, "status", "-c", cfg, "--json")
    assert code == 0
    raw = json.loads(text)
    assert [w["name"] for w in raw["workers"]] == ["g-0", "g-1", "c-0"]
    assert raw["gpu"]["devices"][0]["uuid"] == UUID0

    # commands on workers: 0 ok, 1 impossible now (409), 2 unknown name (404)
    mark = sup.mark()
    code, text, err = run(capsys, "drain", "g-0", "-c", cfg)
    assert (code, text.strip()) == (0, "g-0: drain requested (was ready)"), err
    sup.wait_event(event="worker.state", worker="g-0", new="stopped", after=mark)
    code, _, err = run(capsys, "drain", "g-0", "-c", cfg)
    assert code == 1
    assert err.strip() == (
        "gpu-supervisor: cannot drain g-0: only a ready worker can be drained "
        "(worker is stopped) (HTTP 409)"
    )
    mark = sup.mark()
    assert run(capsys, "start", "g-0", "-c", cfg)[0] == 0
    sup.ready("g-0", after=mark)
    code, _, err = run(capsys, "stop", "nope", "-c", cfg)
    assert (code, err.strip()) == (2, "gpu-supervisor: unknown worker or group 'nope'")
    mark = sup.mark()
    assert run(capsys, "restart", "g-1", "-c", cfg)[0] == 0
    sup.wait_event(event="worker.spawned", worker="g-1", after=mark)

    # a group name acts on every worker of the group
    mark = sup.mark()
    code, text, _ = run(capsys, "stop", "c", "-c", cfg)
    assert (code, text.strip()) == (0, "c: stop requested for 1 workers (c-0)")
    sup.wait_event(event="worker.state", worker="c-0", new="stopped", after=mark)
    mark = sup.mark()
    assert run(capsys, "start", "c", "-c", cfg)[0] == 0
    sup.ready("c-0", after=mark)
    mark = sup.mark()
    code, text, _ = run(capsys, "restart", "--rolling", "g", "-c", cfg)
    assert code == 0 and "rolling restart started" in text
    sup.wait_event(event="supervisor.rolling_restart_done", group="g", after=mark)
    # --wait returns when it is done (the journal's rollout.done), for deploy scripts
    mark = sup.mark()
    code, text, _ = run(capsys, "restart", "--rolling", "--wait", "g", "-c", cfg)
    assert code == 0 and text.strip().endswith("g: rolling restart done"), text
    # (waited for: the CLI read the verdict from the API's journal, which can be ahead of
    # this process reading the supervisor's log)
    sup.wait_event(event="supervisor.rolling_restart_done", group="g", after=mark)
    assert run(capsys, "restart", "--wait", "g-0", "-c", cfg)[0] == 2  # --wait needs --rolling
    assert run(capsys, "restart", "--rolling", "nope", "-c", cfg)[0] == 2

    # GPUs
    code, text, _ = run(capsys, "cordon", "0", "-c", cfg)
    assert (code, text.strip()) == (0, f"GPU 0 ({UUID0}) cordoned")
    assert run(capsys, "uncordon", UUID0, "-c", cfg)[1].strip() == f"GPU 0 ({UUID0}) uncordoned"
    code, _, err = run(capsys, "cordon", "5", "-c", cfg)
    assert code == 2 and "unknown GPU '5'" in err

    # the token: the environment wins over the config's token_file
    monkeypatch.setenv("GPU_SUPERVISOR_API_TOKEN", "wrong")
    code, _, err = run(capsys, "stop", "g-0", "-c", cfg)
    assert code == 2 and "invalid bearer token" in err
    monkeypatch.setenv("GPU_SUPERVISOR_API_TOKEN", TOKEN)
    assert run(capsys, "status", "--url", f"unix:{socket_path}")[0] == 0
    # a mistake in the file outside [api]/[supervisor]/[gpu] (a group being edited) is a
    # warning for the client commands, not an error: status is needed most just then
    text = Path(cfg).read_text()
    Path(cfg).write_text(text.replace("replicas = 2", 'replicas = "3"'))
    code, shown, err = run(capsys, "status", "-c", cfg)
    assert code == 0 and "g-1" in shown
    assert err.startswith("gpu-supervisor: warning: ") and "replicas" in err
    assert run(capsys, "postmortem", "list", "-c", cfg)[0] == 0
    Path(cfg).write_text(text.replace('listen = "unix:', 'listen = "nix:'))  # its own section
    assert run(capsys, "status", "-c", cfg)[0] == 2
    Path(cfg).write_text(text)
    # a proxy in the environment is for the outside world (regression: it was used)
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    assert run(capsys, "status", "--url", f"unix:{socket_path}")[0] == 0

    assert sup.stop() == 0
    out = cli("status", "-c", cfg)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"gpu-supervisor: cannot reach the supervisor at unix:{socket_path}: is it running? "
        "(no such socket)"
    )


def test_client_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad use answers exit code 2 without a request; a closed port is exit code 1."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[api]\nlisten = "127.0.0.1:0"\n[[workers]]\nname = "a"\ncommand = ["x"]\n')
    code, _, err = run(capsys, "status", "-c", str(cfg))
    assert code == 2 and "picks a free port: pass --url" in err
    cfg.write_text('[api]\nlisten = ""\n[[workers]]\nname = "a"\ncommand = ["x"]\n')
    code, _, err = run(capsys, "status", "-c", str(cfg))
    assert code == 2 and "the API is off" in err
    code, _, err = run(capsys, "status", "--url", "ftp://x")
    assert code == 2 and "expected http://HOST:PORT" in err
    for url in ("http://127.0.0.1:99999", "http://"):  # regression: asked, exit 1
        code, _, err = run(capsys, "status", "--url", url)
        assert code == 2 and "expected http://HOST:PORT" in err, (url, err)
    # regression: a bad level was taken as info; a config file without end was read on
    code, _, err = run(capsys, "run", "-c", str(cfg), "--log-level", "bogus")
    assert code == 2 and "invalid choice: 'bogus'" in err
    code, _, err = run(capsys, "check-config", "-c", "/dev/zero")
    assert code == 2 and "larger than 16 MiB: not a config file" in err
    assert run(capsys, "drain")[0] == 2
    code, _, err = run(capsys, "status", "--url", "http://127.0.0.1:1", "--timeout", "2")
    assert code == 1 and "is it running? (connection refused)" in err


def test_health_follows_the_config_and_exits_1_for_every_failure(
    supervisor: SupervisorFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`health` (a container HEALTHCHECK) finds the API through -c as the other client
    commands do (the image's check was tied to 127.0.0.1:9811), with the config's env
    overrides; `--ready` also fails while a group has no ready worker. Unhealthy is exit 1,
    whatever the cause (Docker reserves 2): not running, a bad config, a bad flag value."""
    socket_path = tmp_path / "api.sock"
    up = {"name": "up", "gpus": "none", "command": worker_cmd("ready_then_sleep")}
    never = {"name": "never", "gpus": "none", "command": worker_cmd("never_ready")}
    cfg_doc: dict[str, Any] = {"api": {"listen": f"unix:{socket_path}"}, "workers": [up, never]}
    sup = supervisor(cfg_doc)
    sup.ready("up-0")
    cfg = str(sup.config_path)
    code, out, err = run(capsys, "health", "-c", cfg)
    assert code == 0 and out.startswith("ok: gpu-supervisor "), (out, err)
    code, out, _ = run(capsys, "health", "-c", cfg, "--ready")
    assert code == 1
    assert out.strip() == "not ready: group never: no ready worker (1 starting)"
    sup.write_config({**cfg_doc, "workers": [up]})
    code, out, _ = run(capsys, "reload", "-c", cfg)
    assert code == 0, out
    sup.wait_event(event="worker.state", worker="never-0", new="stopped")
    code, out, _ = run(capsys, "health", "-c", cfg, "--ready")
    assert (code, out.strip()) == (0, "ready: 1/1 workers ready")
    assert sup.stop() == 0
    # in a child: httpcore 1.0.9 leaves the socket of a refused unix connection unclosed
    # (a ResourceWarning in this process; the command's process just exits)
    down = cli("health", "-c", cfg)
    assert down.returncode == 1 and "is it running?" in down.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[api]\nlisten = "nowhere"\n')
    code, _, err = run(capsys, "health", "-c", str(bad))
    assert code == 1 and "api.listen" in err and err.count("\n") == 1
    assert run(capsys, "health", "--url", "http://127.0.0.1:1", "--timeout", "0")[0] == 1
    assert run(capsys, "status", "--url", "http://127.0.0.1:1", "--timeout", "0")[0] == 2


def test_health_needs_no_token_file_with_auth_read(
    supervisor: SupervisorFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``/healthz`` answers without a token, ``auth_read`` or not. Regression: with
    ``auth_read = true`` and a token file this user could not read (the service user's 0600
    file, read by a probe or an operator's shell; here: gone), ``health`` failed (exit 1) on
    a supervisor that answered. ``health --ready`` (``/readyz``, behind ``auth_read``) and
    ``status`` still need it."""
    token = tmp_path / "token"
    token.write_text("t" * 40 + "\n")
    token.chmod(0o600)
    cfg_doc: dict[str, Any] = {
        "api": {
            "listen": f"unix:{tmp_path}/api.sock",
            "token_file": str(token),
            "auth_read": True,
        },
        "workers": [{"name": "up", "gpus": "none", "command": worker_cmd("ready_then_sleep")}],
    }
    sup = supervisor(cfg_doc)
    sup.ready("up-0")
    cfg = str(sup.config_path)
    token.unlink()
    code, out, err = run(capsys, "health", "-c", cfg)
    assert code == 0 and out.startswith("ok: gpu-supervisor "), (out, err)
    code, _, err = run(capsys, "health", "-c", cfg, "--ready")
    assert code == 1 and "api.token_file" in err, err
    assert sup.stop() == 0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("status", "--timeout", "-1"), "argument --timeout: expected seconds > 0"),
        (("status", "--timeout", "nan"), "(got 'nan')"),
        (("status", "--timeout", "inf"), "(got 'inf')"),
        (("status", "--url", "http://x:abc"), "--url 'http://x:abc': expected http://HOST:PORT"),
        (("restart", "a-0", "--url", "http://[::1"), "--url 'http://[::1'"),
        (("stop", "."), "worker or group '.': no such name can exist"),
        (("restart", ""), "worker or group '': no such name"),
        (("drain", "a/b"), "worker or group 'a/b': no such name"),
        (("cordon", ".."), "GPU '..': no such name"),
    ],
)
def test_bad_client_arguments_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], said: str
) -> None:
    """Regression: a bad --timeout or --url was a traceback (exit 1); '.', '' or 'a/b' asked
    the server and got back a 404 or 405 that named no value."""
    url = () if "--url" in args else ("--url", "http://127.0.0.1:1")  # never asked
    code, _, err = run(capsys, *args, *url)
    assert code == 2 and said in err and err.count("\n") <= 1, err


def test_reload_command_says_what_became_of_the_file(
    supervisor: SupervisorFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``reload`` asks for what SIGHUP does and answers with the verdict from the journal:
    exit 0 and what changed, exit 2 and the config's error when the file was rejected (nothing
    changed); ``--wait`` also waits for the roll-outs it started."""
    socket_path = tmp_path / "api.sock"
    api = {"listen": f"unix:{socket_path}"}

    def config(*groups: dict[str, Any]) -> dict[str, Any]:
        return {"supervisor": {"sample_interval_s": 0.1}, "api": api, "workers": list(groups)}

    keep = {"name": "keep", "gpus": "none", "command": worker_cmd("ready_then_sleep")}
    sup = supervisor(config(keep))
    cfg = str(sup.config_path)
    sup.ready("keep-0")

    extra = {**keep, "name": "extra", "restart": {"stable_s": 0.1}}
    sup.write_config(config(keep, extra))
    code, text, err = run(capsys, "reload", "-c", cfg)
    assert (code, text.strip()) == (0, "reload accepted: added extra"), err
    sup.ready("extra-0")

    mark = sup.mark()
    good = Path(cfg).read_text()
    Path(cfg).write_text(good.replace('name = "extra"', 'name = "extra"\nreplicas = -1'))
    code, text, err = run(capsys, "reload", "-c", cfg)
    assert code == 2 and text == "", (text, err)
    assert err.startswith("gpu-supervisor: reload rejected (bad config: "), err
    assert "replicas" in err and err.count("\n") == 1, err
    assert err.strip().endswith("nothing changed"), err
    assert not sup.find(event="worker.state", new="stopping", after=mark)

    # a program the supervisor cannot execute (regression: accepted, and the roll-out left
    # the first worker in backoff, spawn_failed)
    sup.write_config(config(keep, {**extra, "command": ["/nonexistent/prog"]}))
    code, text, err = run(capsys, "reload", "-c", cfg)
    assert code == 2 and err.startswith("gpu-supervisor: reload rejected (command: group extra:")
    assert "'/nonexistent/prog'" in err and err.strip().endswith("nothing changed"), err
    assert not sup.find(event="worker.state", new="stopping", after=mark)

    sup.write_config(config(keep, {**extra, "replicas": 2}))
    code, text, err = run(capsys, "reload", "--wait", "-c", cfg)
    assert code == 0, err
    assert text.splitlines() == [
        "reload accepted: scaled extra",
        "reload done: every roll-out completed",
    ]
    # (waited for: a scale is no roll-out, so the reload is done once extra-1 is started;
    # its READY=1 may come later, on a loaded machine)
    sup.ready("extra-1")
    assert sup.stop() == 0


def two_slow_to_roll(
    supervisor: SupervisorFactory, tmp_path: Path
) -> tuple[Supervisor, dict[str, Any], dict[str, Any]]:
    """A supervisor (its API on a unix socket) with group ``a``'s two workers ready, whose
    roll-outs wait 30 s for each replaced worker to stay ready; and its config and group."""
    group = {
        "name": "a",
        "replicas": 2,
        "gpus": "none",
        "command": worker_cmd("ready_then_sleep"),
        "restart": {"stable_s": 30},  # each replaced worker must stay ready this long
    }
    config = {"api": {"listen": f"unix:{tmp_path / 'api.sock'}"}, "workers": [group]}
    sup = supervisor(config)
    sup.ready("a-0")
    sup.ready("a-1")
    return sup, config, group


def test_reload_wait_says_when_the_supervisor_stops_during_the_roll_outs(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: the client said "cannot reach the supervisor ... is it running?" about a
    supervisor that had accepted the reload and was stopping."""
    sup, config, group = two_slow_to_roll(supervisor, tmp_path)
    sup.write_config({**config, "workers": [{**group, "env": {"X": "1"}}]})
    client = cli_client("reload", "--wait", "-c", str(sup.config_path))
    try:
        assert client.stdout is not None
        first = client.stdout.readline()  # the client has the verdict: the roll-out goes on
        assert sup.stop() == 0
        out, err = client.communicate(timeout=30)
        out = first + out
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
    assert client.returncode == 1, (out, err)
    assert out.startswith("reload accepted: changed a"), out
    assert "stopped before the reload's roll-outs finished" in err and "is it running" not in err


def test_a_later_reload_supersedes_a_roll_out_in_progress(
    supervisor: SupervisorFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file reloaded while the roll-out of the one before is still going (a typo fixed, the
    next deploy) is rolled out from where that one is: the worker already on the superseded
    file is replaced first, no other worker ever runs it, and the first ``reload --wait``
    says so (exit 1). Regression: each superseded file was rolled onto every worker first,
    each waiting out its start and ``stable_s`` (30 s here)."""
    socket_path = tmp_path / "api.sock"
    group = {
        "name": "a",
        "replicas": 2,
        "gpus": "none",
        "command": worker_cmd("ready_then_sleep", "v1"),
        "restart": {"stable_s": 30},
    }
    config = {"api": {"listen": f"unix:{socket_path}"}, "workers": [group]}
    sup = supervisor(config)
    sup.ready("a-0")
    sup.ready("a-1")
    mark = sup.mark()
    sup.write_config(
        {**config, "workers": [{**group, "command": worker_cmd("ready_then_sleep", "v2")}]}
    )
    client = cli_client("reload", "--wait", "-c", str(sup.config_path))
    try:
        assert client.stdout is not None
        assert client.stdout.readline().startswith("reload accepted: changed a")
        first = sup.ready("a-0", after=mark)  # on v2; the roll-out waits 30 s for it
        v3 = {
            **group,
            "command": worker_cmd("ready_then_sleep", "v3"),
            "restart": {"stable_s": 0.2},
        }
        sup.write_config({**config, "workers": [v3]})
        code, text, err = run(capsys, "reload", "--wait", "-c", str(sup.config_path))
        out, err1 = client.communicate(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
    assert (code, text.splitlines()) == (
        0,
        ["reload accepted: changed a", "reload done: every roll-out completed"],
    ), err
    assert client.returncode == 1, (out, err1)
    assert out.startswith("roll-out superseded for a: a later reload"), out
    spawned = [e for e in sup.events[mark:] if e.get("event") == "worker.spawned"]
    assert [(e["worker"], e["argv"][-1]) for e in spawned] == [
        ("a-0", "v2"),
        ("a-0", "v3"),
        ("a-1", "v3"),
    ], spawned
    assert first["pid"] != spawned[1]["pid"]
    with sup.api() as http:
        done = [e for e in http.get("/api/v1/events").json() if e["type"] == "reload.done"]
    assert [(e["halted"], e["superseded"]) for e in done] == [([], ["a"]), ([], [])], done
    assert sup.stop() == 0


def test_postmortem_commands_take_odd_state_dirs_and_files_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a state_dir that is a file was a traceback, one that does not exist listed
    "no post-mortems" (exit 0); a post-mortem written by hand whose parts are of other types,
    or a directory by a post-mortem's name, were tracebacks."""
    code, _, err = run(capsys, "postmortem", "list", "--state-dir", "/etc/passwd")
    assert code == 2 and "'/etc/passwd': not a directory" in err
    code, _, err = run(capsys, "postmortem", "list", "--state-dir", str(tmp_path / "nope"))
    assert code == 2 and "no such directory" in err
    pms = tmp_path / "postmortems"
    pms.mkdir()
    odd = "20261206T010101.000000Z-w-0-exit"
    (pms / f"{odd}.json").write_text(
        json.dumps({"id": odd, "worker": "w-0", "samples": [1], "devices": {}, "log_tail": "x"})
    )
    (pms / "20261206T010102.000000Z-w-0-exit.json").mkdir()
    code, out, _ = run(capsys, "postmortem", "list", "--state-dir", str(tmp_path))
    assert code == 0 and odd in out
    code, out, _ = run(capsys, "postmortem", "show", odd, "--state-dir", str(tmp_path))
    assert code == 0 and f"post-mortem {odd}" in out
    code, _, err = run(
        capsys, "postmortem", "show", "20261206T010102", "--state-dir", str(tmp_path)
    )
    assert code == 2 and "cannot read it" in err and err.count("\n") <= 1, err


def test_postmortem_list_of_a_directory_it_cannot_read_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``postmortem list`` by an operator who may not read state_dir/postmortems
    (not in the service's group; here a link that loops, which root meets too) was a
    traceback (PermissionError); ``show`` said it in one line already."""
    (tmp_path / "postmortems").symlink_to("postmortems")
    code, out, err = run(capsys, "postmortem", "list", "--state-dir", str(tmp_path))
    assert code == 2 and not out, out
    assert str(tmp_path / "postmortems") in err and "cannot read it" in err, err
    assert err.count("\n") <= 1, err


@pytest.mark.parametrize(
    ("content", "said"),
    [(b'{"id": "x", "worker": {', "not JSON (Expecting"), (b'{"id": "\xff"}', "not UTF-8")],
)
def test_postmortem_show_of_a_torn_file_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, said: str
) -> None:
    """A post-mortem cut short (a disk error, a copy interrupted) or not text: one line that
    names the file. Regression: the JSON parser's message alone ("Expecting value: line 1
    column 5"), without saying which file."""
    pms = tmp_path / "postmortems"
    pms.mkdir()
    torn = pms / "20261206T010101.000000Z-w-0-exit.json"
    torn.write_bytes(content)
    code, _, err = run(capsys, "postmortem", "show", "20261206T0101", "--state-dir", str(tmp_path))
    assert code == 2 and str(torn) in err and said in err and err.count("\n") <= 1, err


@pytest.mark.parametrize("exit_", ["killed", [3], 3])
def test_postmortem_list_takes_an_exit_of_another_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], exit_: object
) -> None:
    """Regression: a post-mortem whose ``exit`` is not an object (written by hand, by another
    version) made ``postmortem list`` a traceback (AttributeError), for every post-mortem."""
    pms = tmp_path / "postmortems"
    pms.mkdir()
    odd = "20261206T010101.000000Z-w-0-exit"
    (pms / f"{odd}.json").write_text(json.dumps({"id": odd, "worker": {}, "exit": exit_}))
    code, out, err = run(capsys, "postmortem", "list", "--state-dir", str(tmp_path))
    assert code == 0 and odd in out and not err, err


def test_postmortem_show_of_another_schema_version_shows_what_it_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``postmortem show`` of a post-mortem whose figures are not numbers (a
    newer version's ``schema_version`` 2 file, left in state_dir by a rolled-back upgrade: GPU
    memory per GPU, a figure as a string) was a traceback (TypeError in the number format),
    though the same file was listed and served by the API. Its values are shown as written."""
    pms = tmp_path / "postmortems"
    pms.mkdir()
    newer = "20261206T010101.000000Z-w-0-exit"
    doc = {
        "schema_version": 2,
        "id": newer,
        "worker": {"name": "w-0", "uptime_s": "12.5"},
        "exit": {"code": 1, "signal": None, "signal_name": None},
        "reason": "exit",
        "samples": [
            {
                "t": "2026-12-06T01:01:00Z",
                "gpu_memory_mb": {"GPU-a": 100},
                "host_rss_mb": "5",
                "cpu_percent": 10**400,
            }
        ],
        "devices": [{"id": 0, "uuid": "GPU-a", "memory": {"used_mb": "1", "total_mb": [2]}}],
        "log_tail": ["boom"],
    }
    (pms / f"{newer}.json").write_text(json.dumps(doc))
    code, out, err = run(capsys, "postmortem", "show", newer, "--state-dir", str(tmp_path))
    assert code == 0 and not err, err
    assert '{"GPU-a": 100} MiB' in out and "rss 5 MiB" in out and "boom" in out, out
    assert f"cpu {10**400}%" in out, out


def test_a_server_that_is_not_a_supervisor_is_said_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Regression: ``status``/``health`` with --url at another server (its own JSON, or text)
    were tracebacks (AttributeError, TypeError, JSONDecodeError)."""

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"ok" if self.path == "/healthz" else b'[{"x": 1}]'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Other) as url:
        for argv in (("status",), ("health",), ("status", "--json")):
            code, _, err = run(capsys, *argv, "--url", url)
            assert code == 1 and "is not a gpu-supervisor's" in err, (argv, err)
            assert err.count("\n") <= 1, err


def test_an_answer_that_cannot_be_decoded_is_said_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A server (a proxy in front of the supervisor) that says ``Content-Encoding: gzip`` of a
    body that is not gzip. Regression: httpx's DecodingError, which is no transport error,
    went out of every client command as a traceback."""

    class Garbled(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"this is not gzip"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Garbled) as url:
        for argv in (("status",), ("status", "--json"), ("health",), ("logs", "w-0")):
            code, out, err = run(capsys, *argv, "--url", url)
            assert code == 1 and not out, (argv, out)
            assert "cannot be read" in err and err.count("\n") <= 1, (argv, err)


def test_postmortem_show_escapes_what_a_terminal_would_act_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A post-mortem's log tail is the worker's output. Regression: ``postmortem show`` printed
    it as it was, so a dying worker could clear the operator's screen, write the clipboard
    (OSC 52) or overwrite a line with a fake one (a carriage return)."""
    pms = tmp_path / "postmortems"
    pms.mkdir()
    pm_id = "20261206T010101.000000Z-w-0-exit"
    tail = ["caf\u00e9\tok", "\x1b[2J\x1b]52;c;cHduZWQ=\x07 \x9b31m 10%\rgpu-supervisor: all fine"]
    (pms / f"{pm_id}.json").write_text(
        json.dumps({"id": pm_id, "worker": {"name": "w-0"}, "log_tail": tail})
    )
    code, out, _ = run(capsys, "postmortem", "show", pm_id, "--state-dir", str(tmp_path))
    assert code == 0
    assert "  caf\u00e9\tok\n" in out
    assert "  \\x1b[2J\\x1b]52;c;cHduZWQ=\\x07 \\x9b31m 10%\\x0dgpu-supervisor: all fine" in out
    assert not {"\x1b", "\x07", "\x9b", "\r"} & set(out), out
    code, out, _ = run(capsys, "postmortem", "show", pm_id, "--state-dir", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["log_tail"] == tail  # the JSON: as it is


def test_a_rolling_restart_waited_for_says_the_supervisor_stopped(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """``restart --rolling --wait`` while the supervisor is stopped (a node drained, a
    deploy): regression: it said "cannot reach the supervisor ... connection refused", as if
    the address were wrong, where ``reload --wait`` says the supervisor stopped first. It says
    that too (exit 1)."""
    sup, _, _ = two_slow_to_roll(supervisor, tmp_path)
    mark = sup.mark()
    client = cli_client("restart", "--rolling", "--wait", "a", "-c", str(sup.config_path))
    try:
        sup.ready("a-0", after=mark)  # replaced; the roll-out waits 30 s for it to stay ready
        assert sup.stop() == 0
        out, err = client.communicate(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
    assert client.returncode == 1, (out, err)
    assert "the supervisor stopped before the rolling restart of a finished" in err, (out, err)
    assert "cannot reach" not in err, err


def test_a_rolling_restart_waited_for_reports_its_own_roll_out(
    supervisor: SupervisorFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``restart --rolling --wait`` took the first ``rollout.done`` /
    ``rollout.halted`` of the group after the journal position it read before asking, so
    another operator's roll-out that ended in between (or a second request refused at once
    because the first one was running) was reported as its own: "done" while its own roll-out
    had only started. The 202 now names the request, and its verdict carries it."""
    sup = supervisor(
        {
            "workers": [
                {
                    "name": "g",
                    "replicas": 2,
                    "command": worker_cmd("ready_then_sleep"),
                    "restart": {"stable_s": 0.2},
                }
            ]
        }
    )
    sup.ready("g-0")
    sup.ready("g-1")
    api = sup.api()
    first = api.post("/api/v1/groups/g/rolling-restart")
    assert first.status_code == 202, first.text
    last_seq = client_module._last_seq

    def seq_then_first_done(client: Any) -> int:
        seen = last_seq(client)  # the other roll-out is still running here
        sup.wait_event(event="supervisor.rolling_restart_done", group="g")
        return seen

    monkeypatch.setattr(client_module, "_last_seq", seq_then_first_done)
    code, out, _ = run(capsys, "restart", "--rolling", "--wait", "g", "--url", sup.api_url())
    done = [
        e
        for e in api.get("/api/v1/events").json()
        if e["type"] == "rollout.done" and e.get("kind") == "rolling_restart"
    ]
    assert code == 0 and out.strip().endswith("g: rolling restart done"), out
    assert len(done) == 2, "it returned before its own roll-out was done"
    api.close()


def test_client_commands_without_a_config_follow_the_environment(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A supervisor configured through the environment (a container's `-e
    GPU_SUPERVISOR_API__LISTEN=...`, which `docker exec` passes on to the commands run in it):
    `status` and `health` without `-c` find its API there, and `gpus` without `-c` reads the
    GPUs the environment's `[gpu]` names. Regression: they asked 127.0.0.1:9811 (not running:
    exit 1) and the default backend, whatever the environment said."""
    socket_path = tmp_path / "api.sock"
    env = {
        "GPU_SUPERVISOR_API__LISTEN": f"unix:{socket_path}",
        "GPU_SUPERVISOR_GPU__BACKEND": "sim",
        "GPU_SUPERVISOR_GPU__SIM_DIR": str(tmp_path / "sim"),
    }
    config = {"workers": [{"name": "c", "gpus": "none", "command": worker_cmd("ready_then_sleep")}]}
    sup = supervisor(config, env=env)
    assert sup.api_url() == f"unix:{socket_path}"
    sup.ready("c-0")
    shell = {**sup.env, "GPU_SUPERVISOR_API_TOKEN": ""}
    out = cli("status", env=shell)
    assert out.returncode == 0, out.stderr
    assert any(line.split()[:2] == ["c-0", "ready"] for line in out.stdout.splitlines()), out.stdout
    assert cli("health", "--ready", env=shell).returncode == 0
    gpus = cli("gpus", "--json", env=shell)
    assert gpus.returncode == 0, gpus.stderr
    assert [d["uuid"] for d in json.loads(gpus.stdout)["devices"]][:1] == [UUID0], gpus.stdout
    bad = cli("status", env={**shell, "GPU_SUPERVISOR_API__LISTEN": "nowhere"})
    assert bad.returncode == 2 and "GPU_SUPERVISOR_API__LISTEN" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    assert sup.stop() == 0


def test_logs_follow_prints_the_last_words_when_the_supervisor_stops(
    supervisor: SupervisorFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``logs -f`` during a stop of the supervisor (``systemctl stop``, a deploy)
    lost what the worker wrote after its last poll: its shutdown output and the
    ``--- gpu-supervisor: exited ... ---`` line, the very lines an operator follows a log
    for, since the API was gone at the next poll. What is left is read from the log files
    (this machine's, where the client may read them) before exit 1."""
    config = {
        "workers": [{"name": "w", "gpus": "none", "command": worker_cmd("ready_then_sleep")}],
    }
    sup = supervisor(config)
    sup.ready("w-0")
    url = sup.api_url()
    stopped: list[int] = []

    def stop_between_polls(_: float) -> None:
        if not stopped:
            stopped.append(sup.stop())

    monkeypatch.setattr(
        client_module, "logs", functools.partial(client_module.logs, sleep=stop_between_polls)
    )
    argv = ("logs", "-f", "-n", "1", "w-0", "--url", url, "-c", str(sup.config_path))
    code, out, err = run(capsys, *argv)
    assert stopped == [0]
    assert code == 1, (out, err)
    assert out.startswith("w-0 ") and out.rstrip().endswith(
        "--- gpu-supervisor: exited: killed by SIGTERM (reason shutdown) ---"
    ), out
    assert "Traceback" not in err


def test_logs_follow_prints_the_last_words_of_a_worker_a_reload_removes(
    supervisor: SupervisorFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``logs -f`` of a worker a reload removes (a scale-down) ended with "is gone"
    without what the worker wrote after the last poll (its ``exited ... (reason reload)``
    line): the API knows no such worker any more. It is read from the log files first."""
    keep = {"name": "k", "gpus": "none", "command": worker_cmd("ready_then_sleep")}
    gone = {**keep, "name": "w"}
    sup = supervisor({"workers": [keep, gone]})
    sup.ready("w-0")
    url = sup.api_url()
    removed: list[bool] = []

    def reload_between_polls(_: float) -> None:
        if not removed:
            mark = sup.mark()
            sup.write_config({"workers": [keep]})
            sup.signal(signal.SIGHUP)
            sup.wait_event(event="supervisor.reload_done", after=mark, timeout=30)
            removed.append(True)

    monkeypatch.setattr(
        client_module, "logs", functools.partial(client_module.logs, sleep=reload_between_polls)
    )
    argv = ("logs", "-f", "-n", "1", "w-0", "--url", url, "-c", str(sup.config_path))
    code, out, err = run(capsys, *argv)
    assert removed and code == 1, (out, err)
    assert out.startswith("w-0 ") and out.rstrip().endswith(
        "--- gpu-supervisor: exited: killed by SIGTERM (reason reload) ---"
    ), out
    assert err.strip() == "gpu-supervisor: w-0 is gone (a reload removed it)", err
    assert sup.stop() == 0


def test_check_config_with_a_long_state_dir_leaves_no_temporary_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: where ``state_dir/notify.sock`` is too long for a socket path (over 107
    bytes), ``check-config`` made the private temporary directory ``run`` binds it in instead
    (``/tmp/gpu-supervisor-XXXX``), and left it behind at every check."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    state_dir = tmp_path / ("s" * 110)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[supervisor]\nstate_dir = {json.dumps(str(state_dir))}\n[gpu]\nbackend = "none"\n'
        '[[workers]]\nname = "a"\ncommand = ["/bin/true"]\ngpus = "none"\n'
    )
    code, out, err = run(capsys, "check-config", "-c", str(cfg))
    assert code == 0, err
    assert "config ok" in out
    assert list(temp.iterdir()) == []


def test_check_config_writes_a_state_dir_that_is_no_utf8_as_its_bytes(tmp_path: Path) -> None:
    """Regression: with a UTF-8 locale (standard output's errors ``strict``), ``check-config``
    of a ``state_dir`` whose name is no UTF-8 (given through the environment: a TOML file is
    UTF-8) ended in a UnicodeEncodeError traceback; it prints the name's bytes as they are."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[gpu]\nbackend = "none"\n[[workers]]\nname = "a"\ncommand = ["/bin/true"]\ngpus = "none"\n'
    )
    state_dir = os.fsencode(tmp_path) + b"/state-\xff"
    env = {
        **os.environ,
        "PYTHONIOENCODING": "utf-8:strict",
        "GPU_SUPERVISOR_SUPERVISOR__STATE_DIR": os.fsdecode(state_dir),
    }
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "check-config", "-c", str(cfg)],
        capture_output=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    assert state_dir in done.stdout


_IMPORTS_PROBE = """
import json, sys
from supervisor.cli import build_parser, main

build_parser().parse_args(["run", "-c", "unused.toml"])
parsed = sorted(sys.modules)
code = main(["status", "--url", "unix:" + sys.argv[1]])
print(json.dumps({"parsed": parsed, "status": sorted(sys.modules), "code": code}))
"""

#: What ``run`` (and ``check-config``) needs and a client command does not: imported by them
#: where they start, never by the CLI module itself.
_RUN_ONLY = (
    "fastapi",
    "uvicorn",
    "starlette",
    "structlog",
    "psutil",
    "prometheus_client",
    "supervisor.runtime",
    "supervisor.api",
    "supervisor.metrics",
    "supervisor.listen",
    "supervisor.processes",
    "supervisor.backends",
    "supervisor.records",
)


def _under(modules: list[str], roots: tuple[str, ...]) -> list[str]:
    return [m for m in modules if m in roots or m.startswith(tuple(f"{r}." for r in roots))]


def test_client_commands_import_neither_the_runtime_nor_the_server(tmp_path: Path) -> None:
    """Start-up cost, guarded without timing it: the CLI module and any command's parser import
    none of the runtime, the server, pydantic or the client (``--help``, ``--version``, a usage
    error and ``run``'s parsing stay cheap; ``run`` never loads the client), and a client command
    (``status``, here against no supervisor: exit 1) loads the client and its config models but
    nothing of what only ``run`` needs (~0.45 s per command before)."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_PROBE, str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["code"] == 1
    assert "cannot reach the supervisor" in done.stderr
    parsed = seen["parsed"]
    assert _under(parsed, (*_RUN_ONLY, "pydantic", "pydantic_settings", "httpx")) == []
    assert _under(parsed, ("supervisor.client", "supervisor.config")) == []
    status = seen["status"]
    assert "supervisor.client" in status  # (the probe did reach the client)
    assert _under(status, _RUN_ONLY) == []
