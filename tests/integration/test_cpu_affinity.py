"""``cpu_affinity``: workers pinned to the CPUs close to their GPUs (as the backend reports
them: the sim world's ``cpus`` key, read directly and through the real pynvml and the fake
``libnvidia-ml.so.1``'s ``nvmlDeviceGetCpuAffinity``), or to a CPU list; read back from the
kernel. A move to another GPU pins the new process to that GPU's CPUs. CPUs the supervisor
cannot give fail the start saying why; ``check-config`` shows and warns. Pure parts:
tests/unit/test_cpus.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.backends.sim import SimBackend, parse_kv, write_atomic
from tests.conftest import SupervisorFactory
from tests.harness import ROOT, worker_cmd
from tests.tomlw import dumps

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-00000000-0000-0000-0000-000000000001"
MINE = os.sched_getaffinity(0)

pytestmark = pytest.mark.skipif(
    not {0, 1} <= MINE, reason=f"needs CPUs 0 and 1 to pin workers to (this process: {MINE})"
)


def make_world(world: Path, cpus: dict[int, str]) -> None:
    SimBackend(world, 2).open()
    for index, cpulist in cpus.items():
        path = world / "gpus" / str(index)
        keys = {**parse_kv(path.read_text()), "cpus": cpulist}
        write_atomic(path, "".join(f"{k} {v}\n" for k, v in keys.items()))


@pytest.fixture(params=["sim", "nvml"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    world = tmp_path / "sim"
    make_world(world, {0: "0", 1: "1"})
    env = {"GPU_SUPERVISOR_SIM_DIR": str(world)}
    if request.param == "nvml":
        env["LD_LIBRARY_PATH"] = str(request.getfixturevalue("fake_nvml_libdir"))
    return request.param, env


def config(tmp_path: Path, backend: str, *groups: dict[str, Any], **gpu: Any) -> dict[str, Any]:
    return {
        "supervisor": {"sample_interval_s": 0.05},
        "gpu": {"backend": backend, "sim_dir": str(tmp_path / "sim"), **gpu},
        "workers": [{"stop_timeout_s": 2, "restart": {"stable_s": 0.1}, **g} for g in groups],
    }


def test_workers_run_on_the_cpus_close_to_their_gpus_or_on_the_ones_listed(
    supervisor: SupervisorFactory, tmp_path: Path, backend: tuple[str, dict[str, str]]
) -> None:
    name, env = backend
    ready = worker_cmd("ready_then_sleep")
    sup = supervisor(
        config(
            tmp_path,
            name,
            {
                "name": "g",
                "replicas": 2,
                "max_workers_per_gpu": 1,
                "cpu_affinity": "gpu",
                "command": worker_cmd("sim_worker", "100"),
            },
            {"name": "e", "gpus": "none", "cpu_affinity": "1", "command": ready},
            {"name": "p", "gpus": "none", "command": ready},
        ),
        env=env,
    )
    close = {UUID0: {0}, UUID1: {1}}
    with sup.api() as api:
        for w in ("g-0", "g-1"):
            pid = sup.ready(w)["pid"]
            gpus = api.get(f"/api/v1/workers/{w}").json()["gpus"]
            assert os.sched_getaffinity(pid) == close[gpus[0]], (w, gpus)
        devices = api.get("/api/v1/gpu/status").json()["devices"]
        assert [d["cpu_affinity"] for d in devices] == ["0", "1"]
    assert os.sched_getaffinity(sup.ready("e-0")["pid"]) == {1}
    assert os.sched_getaffinity(sup.ready("p-0")["pid"]) == os.sched_getaffinity(sup.pid)
    assert not sup.find(event="plan.warning")
    assert sup.stop() == 0


@pytest.mark.parametrize("gpu1_cpus", ["1", None])
def test_a_worker_moved_to_another_gpu_runs_on_that_gpus_cpus(
    supervisor: SupervisorFactory, tmp_path: Path, gpu1_cpus: str | None
) -> None:
    """... or, where the backend cannot tell which CPUs are close to that GPU, on the
    supervisor's, saying so at the move (``worker.unpinned``)."""
    make_world(tmp_path / "sim", {0: "0"} if gpu1_cpus is None else {0: "0", 1: gpu1_cpus})
    sup = supervisor(
        config(
            tmp_path,
            "sim",
            {
                "name": "m",
                "cpu_affinity": "gpu",
                "command": worker_cmd("sim_worker", "100"),
                "drain_timeout_s": 0.2,
                "health": {"on_thermal": "migrate"},
            },
            thermal_sustain_s=0.3,
            thermal_clear_s=0.3,
            release_timeout_s=2,
        )
    )
    first = sup.ready("m-0")
    assert os.sched_getaffinity(first["pid"]) == {0}  # GPU 0: the most free, first
    mark = sup.mark()
    gpu0 = tmp_path / "sim" / "gpus" / "0"
    keys = {**parse_kv(gpu0.read_text()), "temperature_c": "84"}  # within 5 C of slowdown
    write_atomic(gpu0, "".join(f"{k} {v}\n" for k, v in keys.items()))
    moved = sup.wait_event(event="worker.moved", worker="m-0", after=mark, timeout=20)
    assert moved["new_gpus"] == [UUID1]
    pid = sup.ready("m-0", after=mark)["pid"]
    if gpu1_cpus is None:
        assert os.sched_getaffinity(pid) == os.sched_getaffinity(sup.pid)
        unpinned = sup.wait_event(event="worker.unpinned", worker="m-0", after=mark)
        assert unpinned["gpus"] == [UUID1]
        assert unpinned["reason"] == (
            f'cpu_affinity = "gpu" pins nothing: the backend does not say which CPUs are '
            f"close to {UUID1}"
        )
    else:
        assert os.sched_getaffinity(pid) == {1}
        assert not sup.find(event="worker.unpinned")
    assert sup.stop() == 0


def test_cpus_that_cannot_be_had_fail_the_start_and_check_config_says_so(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    make_world(tmp_path / "sim", {0: "0"})  # GPU 1's CPUs are not known
    ready = worker_cmd("ready_then_sleep")
    groups = (
        {"name": "x", "gpus": "none", "cpu_affinity": "4000-4001", "command": ready},
        {"name": "u", "gpus": [1], "cpu_affinity": "gpu", "command": ready},
        {"name": "r", "gpus": [0], "cpu_affinity": "gpu", "command": ready},
    )
    sup = supervisor(config(tmp_path, "sim", *groups))
    failed = sup.wait_event(event="worker.spawn_failed", worker="x-0")
    assert (
        "cpu_affinity: CPUs 4000-4001 are not among those this supervisor may use"
        in (failed["error"])
    )
    # GPU 1's CPUs unknown: said, and the worker runs on the supervisor's
    warning = sup.wait_event(event="plan.warning")
    assert warning["message"] == (
        'group u: cpu_affinity = "gpu" pins nothing: the backend does not say which CPUs are '
        f"close to {UUID1}; its workers run on the supervisor's CPUs"
    )
    assert os.sched_getaffinity(sup.ready("u-0")["pid"]) == os.sched_getaffinity(sup.pid)
    assert os.sched_getaffinity(sup.ready("r-0")["pid"]) == {0}
    assert sup.stop() == 0

    path = tmp_path / "c.toml"
    checked = config(tmp_path, "sim", *groups)
    checked["supervisor"]["state_dir"] = str(tmp_path / "s")
    path.write_text(dumps(checked))
    argv = [sys.executable, "-m", "supervisor", "check-config", "-c", str(path)]
    text = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert rows["WORKER"][:4] == ["WORKER", "PORT", "GPUS", "CPUS"]
    assert rows["x-0"][3] == "4000-4001" and rows["u-0"][3] == "-" and rows["r-0"][3] == "0"
    assert "warning: group x: cpu_affinity: CPUs 4000-4001 are not among" in text
    assert 'warning: group u: cpu_affinity = "gpu" pins nothing' in text
    report = json.loads(
        subprocess.run([*argv, "--json"], capture_output=True, text=True, check=True).stdout
    )
    assert {w["name"]: w["cpus"] for w in report["workers"]} == {
        "x-0": "4000-4001",
        "u-0": None,
        "r-0": "0",
    }


def test_a_gpu_pin_is_taken_again_at_a_restart_within_the_supervisors_cpus_of_then(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    make_world(tmp_path / "sim", {0: "0", 1: "1"})
    group = {"name": "g", "gpus": [1], "cpu_affinity": "gpu"}
    sup = supervisor(config(tmp_path, "sim", {**group, "command": worker_cmd("ready_then_sleep")}))
    first = sup.ready("g-0")["pid"]
    assert os.sched_getaffinity(first) == {1}

    def pin_supervisor(cpus: set[int]) -> None:  # every thread, as a cpuset change would
        for tid in os.listdir(f"/proc/{sup.pid}/task"):
            os.sched_setaffinity(int(tid), cpus)

    try:
        pin_supervisor({0})  # the CPUs close to GPU 1 are no longer the supervisor's
        mark = sup.mark()
        os.kill(first, 9)
        again = sup.ready("g-0", after=mark)["pid"]  # not a start refused at every try
        assert not sup.find(event="worker.spawn_failed", after=mark)
        assert os.sched_getaffinity(again) == {0}
        pin_supervisor(MINE)
        mark = sup.mark()
        os.kill(again, 9)
        assert os.sched_getaffinity(sup.ready("g-0", after=mark)["pid"]) == {1}
    finally:
        pin_supervisor(MINE)
    assert sup.stop() == 0


def test_a_reload_says_where_gpu_pins_nothing_for_the_groups_it_rolls_out(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    make_world(tmp_path / "sim", {0: "0"})  # GPU 1's CPUs are not known
    ready = worker_cmd("ready_then_sleep")
    keep = {"name": "k", "gpus": [0], "cpu_affinity": "gpu", "command": ready}
    sup = supervisor(config(tmp_path, "sim", keep))
    sup.ready("k-0")
    assert not sup.find(event="plan.warning")
    mark = sup.mark()
    added = {"name": "u", "gpus": [1], "cpu_affinity": "gpu", "command": ready}
    sup.write_config(config(tmp_path, "sim", keep, added))
    sup.signal(signal.SIGHUP)
    warning = sup.wait_event(event="plan.warning", after=mark)
    assert warning["message"].startswith('group u: cpu_affinity = "gpu" pins nothing')
    sup.ready("u-0", after=mark)
    assert len(sup.find(event="plan.warning")) == 1  # not for the group left as it was
    assert sup.stop() == 0
