"""Two supervisors on one machine, each with its own state_dir, sharing the same (simulated)
GPUs: what one does to the other's workers and believes about them."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Supervisor, worker_cmd

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-00000000-0000-0000-0000-000000000001"


def config(world: Path, *groups: dict[str, Any]) -> dict[str, Any]:
    return {
        "supervisor": {"sample_interval_s": 0.1},
        "gpu": {"backend": "sim", "sim_dir": str(world), "sim_devices": 2},
        "workers": [{"log_passthrough": True, "stop_timeout_s": 2, **g} for g in groups],
    }


@pytest.fixture
def two(tmp_path: Path) -> Iterator[list[Supervisor]]:
    """Room for two supervisors (``a`` and ``b`` under ``tmp_path``), each with its own
    state_dir; all are stopped and checked afterwards."""
    started: list[Supervisor] = []
    yield started
    survivors: list[int] = []
    for sup in started:
        survivors += sup.close()
    assert not survivors, f"processes outlived their supervisor: {survivors}"


def start(two: list[Supervisor], tmp_path: Path, name: str, cfg: dict[str, Any]) -> Supervisor:
    (tmp_path / name).mkdir()
    sup = Supervisor(tmp_path / name, cfg, log_level="debug")
    two.append(sup)
    return sup.start()


def test_budgets_are_placed_beside_the_other_supervisors_memory(
    two: list[Supervisor], tmp_path: Path
) -> None:
    """Regression: a supervisor fitted its workers' budgets under each GPU's total less
    reserve_mb, blind to the memory another supervisor's workers held there: its second
    worker (30 GiB budget) went onto GPU 0, where the other's worker held 60 of 80 GiB (to die
    of CUDA OOM at every start), though GPU 1 had room for both."""
    world = tmp_path / "sim"
    other = start(
        two,
        tmp_path,
        "b",
        config(world, {"name": "b", "gpus": [0], "command": worker_cmd("gpu_user", "60000")}),
    )
    other.ready("b-0")  # (its memory is claimed before it says READY=1)
    group = {
        "name": "a",
        "replicas": 2,
        "command": worker_cmd("gpu_user", "100"),
        "health": {"gpu_memory_limit_mb": 30000},
    }
    sup = start(two, tmp_path, "a", config(world, group))
    sup.ready("a-0")
    sup.ready("a-1")
    assert sup.wait_line("[a-0] ", endswith=f"ready on {UUID1}")
    assert sup.wait_line("[a-1] ", endswith=f"ready on {UUID1}")
    for s in (sup, other):  # both at once
        s.signal(signal.SIGTERM)
    assert sup.wait_exit() == 0
    assert other.wait_exit() == 0


def test_a_start_beside_another_supervisor_leaves_its_workers_and_their_memory_alone(
    two: list[Supervisor], tmp_path: Path
) -> None:
    """Pins: a supervisor starting (reclaim of a predecessor's orphans, by its state.json and
    by its state_dir's id in the environment) beside another one that serves on the same GPU
    ends none of the other's workers, and its own worker there is measured by its own
    processes only (the other's 60000 MiB are not its)."""
    world = tmp_path / "sim"
    other = start(
        two,
        tmp_path,
        "b",
        config(world, {"name": "g", "gpus": [0], "command": worker_cmd("gpu_user", "60000")}),
    )
    pid = other.ready("g-0")["pid"]
    sup = start(
        two,
        tmp_path,
        "a",
        config(world, {"name": "g", "gpus": [0], "command": worker_cmd("gpu_user", "100")}),
    )
    sup.ready("g-0")
    sample = sup.wait_event(
        event="gpu.sample",
        workers=lambda w: isinstance(w, dict) and w.get("g-0", {}).get("gpu_mb") == 100.0,
    )
    assert sample["workers"]["g-0"]["by_gpu"] == {UUID0: 100.0}
    assert sample["devices"][UUID0]["used_mb"] == 60100.0
    assert not sup.find(event="supervisor.reclaimed_orphan")
    with other.api() as http:
        w = http.get("/api/v1/workers/g-0").json()
    assert (w["pid"], w["restarts"], w["state"]) == (pid, 0, "ready")
    for s in (sup, other):  # both at once
        s.signal(signal.SIGTERM)
    assert sup.wait_exit() == 0
    assert other.wait_exit() == 0
