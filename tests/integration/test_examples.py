"""The README's first command: ``make demo`` runs examples/demo.toml. It must start, do what its
comments say, and stop cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SupervisorFactory
from tests.harness import ROOT


# its workers bind 8001, 8101 and 8201, the ports groups without port_base start from: a
# test that binds automatic ports must join this xdist group (`make test` runs two at a time)
@pytest.mark.xdist_group("auto_ports")
def test_the_demo_starts_breaks_its_flaky_workers_and_stops_on_ctrl_c(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    config: dict[str, Any] = tomllib.loads((ROOT / "examples" / "demo.toml").read_text())
    config["gpu"]["sim_dir"] = str(tmp_path / "sim")  # not ./sim in the checkout
    flaky = next(g for g in config["workers"] if g["name"] == "flaky")
    flaky["command"] = [*flaky["command"][:2], "0.3", "0.6"]  # break soon: the test waits
    sup = supervisor(config)
    for worker in ("gpen-0", "gpen-1", "gpen-2", "flaky-0", "flaky-1", "web-0"):
        sup.ready(worker, timeout=30)
    with sup.api() as api:
        workers = {w["name"]: w for w in api.get("/api/v1/workers").json()}
    assert {workers[f"gpen-{i}"]["gpus"][0] for i in range(3)} == {
        "GPU-00000000-0000-0000-0000-000000000000",
        "GPU-00000000-0000-0000-0000-000000000001",
    }  # spread over both GPUs
    # the flaky ones break: a crash (exit) or a sticky CUDA error (log_pattern), replaced
    death = sup.wait_event(
        event="records.postmortem", worker=lambda w: str(w).startswith("flaky-"), timeout=15
    )
    assert death["reason"] in ("exit", "log_pattern"), death
    sup.signal(signal.SIGINT)
    assert sup.wait_exit() == 0


@pytest.mark.parametrize("config", sorted(ROOT.glob("examples/*.toml")), ids=lambda p: p.name)
def test_every_example_config_passes_check_config_without_a_warning(
    config: Path, tmp_path: Path
) -> None:
    """The README and each example's comments tell a new user to run it as it is
    (`make demo`, `gpu-supervisor run -c examples/torch.toml`): each must pass
    `check-config`, on simulated GPUs (the machine's own would vary), with nothing to warn
    about: no unknown key, no program that cannot be run from the checkout, no plan warning."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SUPERVISOR_")}
    env |= {"GPU_SUPERVISOR_GPU__BACKEND": "sim", "GPU_SUPERVISOR_GPU__SIM_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "check-config", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("config ok: "), result.stdout
    assert "warning" not in result.stderr, result.stderr
