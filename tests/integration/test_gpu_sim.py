"""The GPU seam end to end on simulated GPUs: placement, attribution, health, the barrier."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import SupervisorFactory
from tests.harness import (
    Supervisor,
    crash_into_barrier,
    sampled_in_tree,
    stuck,
    stuck_holder,
    wait_dead,
    worker_cmd,
)

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-00000000-0000-0000-0000-000000000001"


def config(tmp_path: Path, *groups: dict[str, Any], **gpu: Any) -> dict[str, Any]:
    return {
        "supervisor": {"sample_interval_s": 0.1},
        "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim"), **gpu},
        "workers": [{"log_passthrough": True, "stop_timeout_s": 2, **g} for g in groups],
    }


def reload_env(sup: Supervisor, cfg: dict[str, Any], version: str) -> None:
    """Rewrite the config with the first group's env ``V=version`` and ask for a reload."""
    sup.write_config({**cfg, "workers": [{**cfg["workers"][0], "env": {"V": version}}]})
    with sup.api() as http:
        assert http.post("/api/v1/reload").status_code == 202


def worker_mb(sup: Supervisor, worker: str, mb: float, after: int = 0) -> dict[str, Any]:
    """Wait for a sample in which ``worker`` holds ``mb`` MiB."""
    event = sup.wait_event(
        event="gpu.sample",
        after=after,
        workers=lambda w: isinstance(w, dict) and w.get(worker, {}).get("gpu_mb") == mb,
    )
    return dict(event["workers"][worker])


def test_placement_uuids_and_per_worker_memory(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Workers get planned UUIDs in CUDA_VISIBLE_DEVICES and their memory shows up per worker."""
    sup = supervisor(
        config(
            tmp_path,
            {"name": "g", "replicas": 3, "command": worker_cmd("gpu_user", "1500")},
            {"name": "cpu", "gpus": "none", "command": worker_cmd("ready_then_sleep")},
        ),
        log_level="debug",
    )
    for w in ("g-0", "g-1", "g-2", "cpu-0"):
        sup.ready(w)
    assert sup.wait_line("[g-0] ", endswith=f"ready on {UUID0}")
    assert sup.wait_line("[g-1] ", endswith=f"ready on {UUID1}")
    assert sup.wait_line("[g-2] ", endswith=f"ready on {UUID0}")
    cpu_env = json.loads(sup.wait_line("[cpu-0] ", contains=" env ").split(" env ", 1)[1])
    assert cpu_env["CUDA_VISIBLE_DEVICES"] == ""
    for w, uuid in (("g-0", UUID0), ("g-1", UUID1), ("g-2", UUID0)):
        usage = worker_mb(sup, w, 1500.0)
        assert usage["by_gpu"] == {uuid: 1500.0}
        assert usage["attribution"] == "pid"
    sample = sup.wait_event(
        event="gpu.sample",
        devices=lambda d: d[UUID0]["used_mb"] == 3000.0 and d[UUID1]["used_mb"] == 1500.0,
    )
    assert sample["workers"]["cpu-0"]["attribution"] == "none"
    assert sup.stop() == 0


@pytest.mark.parametrize("how", ["lost", "unlisted"])
def test_lost_gpu_is_unhealthy_and_supervision_goes_on(
    supervisor: SupervisorFactory, tmp_path: Path, how: str
) -> None:
    """A GPU that reports itself lost, or that the driver no longer lists at all (fallen off
    the bus: regression, it was simply forgotten and its worker stayed ready on it)."""
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "g",
                "replicas": 2,
                "command": worker_cmd("gpu_user", "100"),
                "drain_timeout_s": 0.2,
            },
        ),
        log_level="debug",
    )
    sup.ready("g-0")
    sup.ready("g-1")
    worker_mb(sup, "g-0", 100.0)  # measured before (a first sample may not have it yet)
    gpu1 = tmp_path / "sim" / "gpus" / "1"
    mark = sup.mark()
    if how == "lost":
        gpu1.write_text(gpu1.read_text().replace("lost 0", "lost 1"))
    else:
        gpu1.rename(tmp_path / "gone")
    # the lost GPU is unhealthy, the other is not, and its worker is still measured (seen
    # twice in CI: the first such sample said 0.0 MiB for g-0; a sample taken as the world
    # changed under it: the next ones are judged)
    sample = sup.wait_event(
        event="gpu.sample",
        after=mark,
        devices=lambda d: d[UUID1]["healthy"] is False and d[UUID0]["healthy"] is True,
        workers=lambda w: w.get("g-0", {}).get("gpu_mb") == 100.0,
    )
    assert sample["devices"][UUID0]["healthy"] is True
    # supervision goes on: the lost GPU is quarantined, its worker moved, the other untouched
    moved = sup.wait_event(event="worker.moved", worker="g-1", after=mark)
    assert moved["new_gpus"] == [UUID0]
    assert sup.find(event="heal.action", action="quarantine")[0]["reason"] == "gpu_lost"
    assert not sup.find(event="worker.exited", worker="g-0")
    assert sup.stop() == 0


def test_not_supported_fields_are_null(tmp_path: Path) -> None:
    import subprocess
    import sys

    world = tmp_path / "sim"
    (world / "gpus").mkdir(parents=True)
    (world / "gpus" / "0").write_text(
        f"uuid {UUID0}\nrc_nvmlDeviceGetPowerUsage 3\nrc_nvmlDeviceGetTemperature 3\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor",
            "gpus",  # --sim-dir alone means the sim backend (regression: ignored, no GPUs)
            "--sim-dir",
            str(world),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    dev = json.loads(out.stdout)["devices"][0]
    assert dev["power_watts"] is None
    assert dev["temperature_celsius"] is None
    assert dev["utilization_percent"] == 0.0
    assert dev["memory"]["total_mb"] == 81920.0
    clash = subprocess.run(
        [sys.executable, "-m", "supervisor", "gpus", "--backend", "nvml", "--sim-dir", str(world)],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert clash.returncode == 2 and "--sim-dir goes with --backend sim" in clash.stderr
    # without telemetry the error says so, as the API does (regression: null)
    none = subprocess.run(
        [sys.executable, "-m", "supervisor", "gpus", "--backend", "none", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert json.loads(none.stdout) == {
        "backend": "none",
        "nvml_available": False,
        "error": "no GPU telemetry (backend none)",
        "devices": [],
    }


def test_barrier_waits_for_release_then_restarts_in_place(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A process of the crashed worker that cannot die at once (stuck in the kernel) still holds
    memory on its GPU: the replacement waits for it to let go, then starts on the same GPU. (The
    other outcome, still held after release_timeout_s, is in test_gpu_backends.py.)"""
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "b",
                "command": worker_cmd("gpu_user", "500", "--holder", "30"),
                "restart": {"stable_s": 0.1},
            },
            release_timeout_s=10,
        ),
        log_level="debug",
    )
    leader = sup.ready("b-0")["pid"]
    with stuck_holder(sup, "b-0", tmp_path) as holder:
        mark = sup.mark()
        os.kill(leader, signal.SIGKILL)
        assert sup.wait_event(event="worker.killed_leftovers", worker="b-0")["pids"] == [holder]
        # killed, but alive: still listed on the GPU with its 100 MiB, so the barrier waits
        sup.wait_event(
            event="gpu.sample",
            after=mark,
            devices=lambda d: d[UUID0]["used_mb"] == 100.0 and d[UUID0]["processes"] == 1,
        )
        assert len(sup.find(event="worker.spawned", worker="b-0")) == 1
        thawed = time.time()
    assert wait_dead([holder]) == []
    respawn = sup.wait_events(2, event="worker.spawned", worker="b-0")[1]
    assert datetime.fromisoformat(respawn["timestamp"]).timestamp() >= thawed
    assert not sup.find(event="gpu.suspect")
    assert sup.wait_line("[b-0] ", endswith=f"ready on {UUID0}", after=0)
    assert sup.stop() == 0


def test_roll_outs_pass_over_a_worker_waiting_for_a_gpu(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """g-1 waits for a GPU (one GPU, one worker a GPU). A rolling restart, then a reload of
    a new env, replace g-0 and pass over g-1 (no process to replace; it starts on the new
    plan when it can). Regression: both halted at g-1 (its start found no GPU: "did not
    become ready"), for good."""
    g = {
        "name": "g",
        "replicas": 2,
        "max_workers_per_gpu": 1,
        "command": worker_cmd("gpu_user", "100"),
        "restart": {"stable_s": 0.1},
    }
    cfg = config(tmp_path, g, sim_devices=1)
    sup = supervisor(cfg)
    sup.ready("g-0")
    sup.wait_event(event="worker.waiting_gpu", worker="g-1")
    mark = sup.mark()
    argv = ["restart", "--rolling", "g", "--wait", "--url", sup.api_url()]
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (out.returncode, out.stdout.strip().splitlines()[-1]) == (
        0,
        "g: rolling restart done",
    ), out
    sup.ready("g-0", after=mark)
    mark = sup.mark()
    reload_env(sup, cfg, "2")
    sup.wait_event(event="supervisor.reload_done", halted=[], after=mark, timeout=30)
    sup.ready("g-0", after=mark)
    assert not sup.find(event="worker.spawned", worker="g-1")
    assert sup.stop() == 0


def test_a_reload_while_a_restart_waits_for_the_gpu_release_starts_the_new_plan(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A reload changes the group while its worker's restart waits at the GPU-release barrier
    (a process of its old tree stuck in the kernel): the process that starts once the GPU is
    released runs the new plan. Regression: it ran the old one, counted as the new (the
    reload said done; every later restart and reload kept the old plan)."""
    b = {
        "name": "b",
        "command": worker_cmd("gpu_user", "500", "--holder", "30"),
        "env": {"V": "1"},
        "restart": {"stable_s": 0.1},
    }
    cfg = config(tmp_path, b, release_timeout_s=10)
    sup = supervisor(cfg, log_level="debug")
    leader = sup.ready("b-0")["pid"]
    with stuck_holder(sup, "b-0", tmp_path) as holder:
        mark = sup.mark()
        crash_into_barrier(sup, "b-0", leader, mark)  # there for as long as it is stuck
        reload_env(sup, cfg, "2")
        sup.wait_event(event="supervisor.reload", changed=["b"], after=mark)
        assert len(sup.find(event="worker.spawned", worker="b-0")) == 1
    assert wait_dead([holder]) == []
    sup.wait_event(event="supervisor.reload_done", halted=[], after=mark, timeout=20)
    (respawn,) = sup.find(event="worker.spawned", worker="b-0", after=mark)
    assert psutil.Process(respawn["pid"]).environ()["V"] == "2"
    assert sup.stop() == 0


def test_a_reload_of_a_new_command_keeps_each_worker_on_its_gpu(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Since g-0 (GPU 0) and g-1 (GPU 1) started, another process took 5 GiB of GPU 0. A
    reload that changes the group's env rolls each worker where it is. Regression: the group
    was placed afresh (the most free memory first) and its workers swapped GPUs."""
    g = {"name": "g", "replicas": 2, "command": worker_cmd("gpu_user", "100"), "env": {"V": "1"}}
    cfg = config(tmp_path, {**g, "restart": {"stable_s": 0.1}})
    sup = supervisor(cfg)
    sup.ready("g-0")
    sup.ready("g-1")
    with sup.api() as http:
        before = {w["name"]: w["gpus"] for w in http.get("/api/v1/workers").json()}
    assert before == {"g-0": [UUID0], "g-1": [UUID1]}
    other = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "sim" / "procs" / str(other.pid)).write_text("0 5000\n")
        with sup.api() as http:

            def seen() -> bool:
                devices = http.get("/api/v1/gpu/status").json()["devices"]
                return bool(devices) and devices[0]["memory"]["used_mb"] >= 5000

            sup.wait_until(seen, what="the other process's 5 GiB on GPU 0")
        mark = sup.mark()
        reload_env(sup, cfg, "2")
        sup.wait_event(event="supervisor.reload_done", halted=[], after=mark, timeout=20)
        with sup.api() as http:
            after = {w["name"]: w["gpus"] for w in http.get("/api/v1/workers").json()}
        assert after == before
        assert len(sup.find(event="worker.spawned", after=mark)) == 2
    finally:
        other.kill()
        other.wait()
    assert sup.stop() == 0


def test_a_reload_that_swaps_two_groups_gpus_rolls_both_out_at_once(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """a runs on GPU 0 and b on GPU 1, one worker a GPU; a reload swaps their GPU lists: each
    group's new worker goes where the other group's old one is. Both roll out at the same
    time (b-0 goes down before the new a-0 is ready) and neither waits for the other nor
    halts: each ends on the other's GPU."""

    def group(name: str, gpu: int) -> dict[str, Any]:
        return {
            "name": name,
            "gpus": [gpu],
            "max_workers_per_gpu": 1,
            "command": worker_cmd("gpu_user", "100"),
            "restart": {"stable_s": 0.1},
        }

    sup = supervisor(config(tmp_path, group("a", 0), group("b", 1)))
    sup.ready("a-0")
    sup.ready("b-0")
    mark = sup.mark()
    sup.write_config(config(tmp_path, group("a", 1), group("b", 0)))
    sup.signal(signal.SIGHUP)
    assert sup.wait_event(event="supervisor.reload", after=mark)["changed"] == ["a", "b"]
    done = sup.wait_event(event="supervisor.reload_done", after=mark, timeout=30)
    assert (done["halted"], done["superseded"]) == ([], [])

    def at(worker: str, new: str) -> int:
        event = sup.wait_event(event="worker.state", worker=worker, new=new, after=mark)
        return sup.events.index(event)

    assert at("b-0", "stopping") < at("a-0", "ready")
    assert at("a-0", "stopping") < at("b-0", "ready")
    with sup.api() as http:
        gpus = {w["name"]: w["gpus"] for w in http.get("/api/v1/workers").json()}
    assert gpus == {"a-0": [UUID1], "b-0": [UUID0]}
    assert sup.wait_line("[a-0] ", endswith=f"ready on {UUID1}")
    assert sup.wait_line("[b-0] ", endswith=f"ready on {UUID0}")
    assert sup.stop() == 0


def two_of_g(
    supervisor: SupervisorFactory, tmp_path: Path, **extra: Any
) -> tuple[Supervisor, dict[str, Any], int, int]:
    """A supervisor with g-0 and g-1 ready (env V=1, stable_s 3, plus ``extra``): it, its
    config, g-1's pid and the mark after both are ready."""
    g = {
        "name": "g",
        "replicas": 2,
        "command": worker_cmd("gpu_user", "100"),
        "env": {"V": "1"},
        "restart": {"stable_s": 3},
        **extra,
    }
    cfg = config(tmp_path, g)
    sup = supervisor(cfg)
    sup.ready("g-0")
    g1 = int(sup.ready("g-1")["pid"])
    return sup, cfg, g1, sup.mark()


def assert_workers_after_the_reload(sup: Supervisor, names: list[str]) -> None:
    """The supervisor lived through the reload, has just ``names``, and stops cleanly."""
    assert not sup.find(event="supervisor.crashed")
    with sup.api() as http:
        assert [w["name"] for w in http.get("/api/v1/workers").json()] == names
    assert sup.stop() == 0


def test_a_worker_a_reload_removes_restarts_off_a_cordoned_gpu_during_the_roll_out(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A reload scales g from 2 to 1 and changes its env: g-1 runs on until the roll-out has
    replaced g-0 (ready for stable_s), then goes. Meanwhile GPU 1 is cordoned and g-1
    restarted: it is placed as any worker (no other GPU has room: it restarts on its cordoned
    one), and the roll-out ends as it should. Regression: its placement left it out (the new
    plan has no g-1): KeyError, and the supervisor crashed with every worker."""
    sup, cfg, g1, mark = two_of_g(supervisor, tmp_path, max_workers_per_gpu=1)
    sup.write_config({**cfg, "workers": [{**cfg["workers"][0], "replicas": 1, "env": {"V": "2"}}]})
    sup.signal(signal.SIGHUP)
    sup.ready("g-0", after=mark)  # replaced: the roll-out waits stable_s before g-1 goes
    with sup.api() as http:
        assert http.post("/api/v1/gpus/1/cordon").status_code == 200
        assert http.post("/api/v1/workers/g-1/restart").status_code == 202
    sup.wait_event(event="worker.gpu_cordoned", worker="g-1", after=mark)
    again = sup.ready("g-1", after=mark)
    assert again["pid"] != g1
    sup.wait_event(event="supervisor.reload_done", halted=[], after=mark, timeout=20)
    sup.wait_event(event="worker.state", worker="g-1", new="stopped", after=mark)
    assert_workers_after_the_reload(sup, ["g-0"])


def test_a_worker_waiting_its_turn_when_a_reload_removes_its_group_is_not_placed_by_it(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """max_starting = 1: a-0, restarted while slow-0 loads, waits its turn, its GPU cordoned
    meanwhile. A reload removes b and a and raises max_starting: a-0's turn comes while the
    reload still stops b (it ignores SIGTERM). Regression: a-0 was then placed by its group's
    definition read before the wait, which the plan in force no longer had: KeyError, and the
    supervisor crashed with every worker; now it is left where it is, and a stops with b."""
    b = {"name": "b", "command": worker_cmd("ignore_sigterm"), "gpus": "none"}
    a = {"name": "a", "command": worker_cmd("gpu_user", "100")}
    slow = {"name": "slow", "command": worker_cmd("notify_ready_late", "60"), "gpus": "none"}
    cfg = config(tmp_path, b, a, slow)
    cfg["supervisor"]["max_starting"] = 1
    sup = supervisor(cfg)
    sup.ready("b-0")
    sup.ready("a-0")
    sup.wait_event(event="worker.spawned", worker="slow-0")  # it holds the one turn
    mark = sup.mark()
    with sup.api() as http:
        gpu = http.get("/api/v1/workers/a-0").json()["gpus"][0]
        assert http.post(f"/api/v1/gpus/{gpu}/cordon").status_code == 200
        assert http.post("/api/v1/workers/a-0/restart").status_code == 202
    sup.wait_event(event="worker.waiting_start", worker="a-0", after=mark)
    sup.write_config(
        {
            **cfg,
            "supervisor": {**cfg["supervisor"], "max_starting": 2},
            "workers": [cfg["workers"][2]],
        }
    )
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="supervisor.reload", removed=["b", "a"], after=mark)
    sup.wait_event(event="supervisor.reload_done", halted=[], after=mark, timeout=20)
    assert_workers_after_the_reload(sup, ["slow-0"])


def test_rolling_back_a_superseded_roll_out_that_moved_a_worker_onto_a_gpu_moves_it_back(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """g runs without GPUs (gpus = "none"). A reload of gpus = "auto" and a new env replaces
    g-0 (now on a GPU), and the old file, reloaded while the roll-out waits stable_s,
    supersedes it: g-0 is rolled back without a GPU, as its group says, and g-1 (never
    reached) is left alone. Regression: the two files' placement settings were the same, so
    g-0 kept the GPU the superseded roll-out had given it: CUDA_VISIBLE_DEVICES set for a group
    of gpus = "none" (likewise a halted roll-out of another GPU list, rolled back)."""
    sup, cfg, g1, mark = two_of_g(supervisor, tmp_path, gpus="none")
    on_gpus = {**cfg["workers"][0], "gpus": "auto", "env": {"V": "2"}}
    sup.write_config({**cfg, "workers": [on_gpus]})
    sup.signal(signal.SIGHUP)
    sup.ready("g-0", after=mark)
    with sup.api() as http:
        assert http.get("/api/v1/workers/g-0").json()["gpus"]  # moved onto a GPU
    back = sup.mark()
    sup.write_config(cfg)
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="supervisor.rollout_superseded", group="g", after=back)
    sup.wait_event(event="supervisor.reload_done", halted=[], superseded=[], after=back)
    with sup.api() as http:
        workers = {w["name"]: w for w in http.get("/api/v1/workers").json()}
    assert {n: w["gpus"] for n, w in workers.items()} == {"g-0": [], "g-1": []}
    assert workers["g-1"]["pid"] == g1
    env = psutil.Process(workers["g-0"]["pid"]).environ()
    assert env.get("CUDA_VISIBLE_DEVICES") == "" and env.get("V") == "1"
    assert sup.stop() == 0


UNSHARE = shutil.which("unshare")


def _pid_namespaces_work() -> bool:
    if UNSHARE is None:
        return False
    probe = [UNSHARE, "--pid", "--fork", "true"]
    return subprocess.run(probe, check=False, capture_output=True).returncode == 0


@pytest.mark.skipif(not _pid_namespaces_work(), reason="unshare --pid --fork not permitted here")
def test_a_worker_in_its_own_pid_namespace_is_attributed_through_nspid(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The worker claims memory under its pid in a namespace of its own (pid 1 there), as some
    drivers list it; the supervisor maps it to the worker through ``NSpid``."""
    assert UNSHARE is not None
    sup = supervisor(
        config(
            tmp_path,
            {"name": "ns", "command": [UNSHARE, "--pid", "--fork", *worker_cmd("gpu_user", "700")]},
        ),
        log_level="debug",
    )
    sup.ready("ns-0")
    assert (tmp_path / "sim" / "procs" / "1").exists()  # its own pid, as it sees it
    usage = worker_mb(sup, "ns-0", 700.0)
    assert usage["by_gpu"] == {UUID0: 700.0}
    assert usage["attribution"] == "pid"
    with sup.api() as http:  # the GPU's process list names the worker too
        devices = http.get("/api/v1/gpu/status").json()["devices"]
        (device,) = [d for d in devices if d["uuid"] == UUID0]
        assert {p["pid"]: p["worker"] for p in device["processes"]} == {1: "ns-0"}
    assert sup.stop() == 0


def test_the_release_barrier_waits_for_a_process_listed_under_its_namespace_pid(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The old process of a worker in a PID namespace of its own is listed (pid 1 there) and
    cannot be ended (stuck in the kernel): the restart waits for its memory, then marks the GPU
    suspect (and starts there again: GPU 1 is cordoned, as the simulated world files a process
    by its pid, and the replacement, pid 1 of a namespace of its own too, on GPU 1 would take
    the stuck one's place in it). Regression: the barrier compared NVML's pids with ours only,
    and the replacement started at once next to the memory still held."""
    assert UNSHARE is not None
    state = tmp_path / "state"
    state.mkdir()
    (state / "cordons").write_text(f"{UUID1}\n")
    sup = supervisor(
        config(
            tmp_path,
            {"name": "ns", "command": [UNSHARE, "--pid", "--fork", *worker_cmd("gpu_user", "700")]},
            release_timeout_s=1,
        ),
        log_level="debug",
    )
    leader = sup.ready("ns-0")["pid"]
    worker_mb(sup, "ns-0", 700.0)
    (inner,) = psutil.Process(leader).children()  # pid 1 in its namespace
    with stuck(inner.pid, f"gpu-supervisor-test-{os.getpid()}-{tmp_path.name}"):
        with sup.api() as http:
            assert http.post("/api/v1/workers/ns-0/restart").status_code == 202
        said = sup.wait_event(event="gpu.suspect", worker="ns-0", timeout=20)
        assert said["gpu"] == UUID0
        # it stays suspect while its memory is held (regression: released at the next
        # sample, which lists the process under its namespace pid, not ours)
        sup.ready("ns-0", after=sup.events.index(said))
        sup.wait_events(3, event="gpu.sample", after=sup.mark())
        assert not sup.find(event="gpu.released")
        with sup.api() as http:
            (gpu0,) = [
                d for d in http.get("/api/v1/gpu/status").json()["devices"] if d["uuid"] == UUID0
            ]
            assert gpu0["suspect"] is True, gpu0
    assert wait_dead([inner.pid]) == []
    sup.wait_event(event="gpu.released", gpu=UUID0)
    assert sup.stop() == 0


def test_an_http_ready_worker_on_a_gpu_is_ready_again_after_a_restart(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A start on a GPU goes through the pre-start hook (GPU-release barrier); the health probe
    it starts must wait for the new pid to be recorded. Regression: the probe ended at once,
    so every start after the first timed out (start_timeout, backoff, fatal)."""
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "web",
                "command": worker_cmd("http_ready", "0"),
                "ready": "http://127.0.0.1:{port}/health",
                "port_base": 18951,
                "gpus": [0],
                "start_timeout_s": 20,
            },
        )
    )
    sup.ready("web-0")
    with sup.api() as http:
        for _ in range(3):
            mark = sup.mark()
            assert http.post("/api/v1/workers/web-0/restart").status_code == 202
            sup.ready("web-0", after=mark)
    assert not sup.find(event="worker.state", reason="start_timeout")
    assert sup.stop() == 0


def test_scaling_an_auto_group_leaves_its_workers_where_they_are(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """replicas 1 -> 2 of a ``gpus = "auto"`` group: the running worker keeps its process and
    its GPU, the new one is placed around it. Regression: the group was placed afresh, the
    running worker's own memory made its GPU look full, and it was moved (restarted)."""
    group = {"name": "c", "command": worker_cmd("gpu_user", "2000"), "restart": {"stable_s": 0.2}}
    sup = supervisor(config(tmp_path, group), log_level="debug")  # gpu.sample is debug
    pid = sup.ready("c-0")["pid"]
    worker_mb(sup, "c-0", 2000)  # its memory is in the sample the next placement sees
    with sup.api() as http:
        gpus = http.get("/api/v1/workers/c-0").json()["gpus"]
        mark = sup.mark()
        sup.write_config(config(tmp_path, {**group, "replicas": 2}))
        sup.signal(signal.SIGHUP)
        sup.ready("c-1", after=mark)
        assert sup.wait_event(event="supervisor.reload", after=mark)["scaled"] == ["c"]
        assert http.get("/api/v1/workers/c-0").json()["gpus"] == gpus
    assert not sup.find(event="worker.spawned", worker="c-0", after=mark)
    assert sup.find(event="worker.spawned", worker="c-0")[-1]["pid"] == pid
    assert sup.stop() == 0


def test_a_cordons_file_that_cannot_be_read_is_said(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """state_dir/cordons is there but not text (a disk error, a hand edit): the operator's
    cordons from before are not known, and the start says so; the next cordon writes the file
    anew. Regression: it was read as "no cordon" without a word (a maintenance cordon lost)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "cordons").write_bytes(b"GPU-\xff\xfe\n")
    sup = supervisor(config(tmp_path, {"name": "g", "command": worker_cmd("gpu_user", "100")}))
    said = sup.wait_event(event="records.cordons_unreadable")
    assert said["error"] == "not text (UTF-8)" and said["path"] == str(state / "cordons")
    assert not sup.find(event="gpu.cordons_kept")
    sup.ready("g-0")
    with sup.api() as http:
        assert http.post("/api/v1/gpus/1/cordon").status_code == 200
    assert (state / "cordons").read_text() == f"{UUID1}\n"
    assert sup.stop() == 0


def test_a_cordons_file_that_is_a_link_is_not_followed(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: state_dir/cordons was read through a symbolic link, so a link planted there
    to any file holding a GPU's UUID cordoned that GPU at start. The link is not followed: one
    warning, and the start goes on with no cordon from before."""
    planted = tmp_path / "planted"
    planted.write_text(f"{UUID1}\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "cordons").symlink_to(planted)
    sup = supervisor(config(tmp_path, {"name": "g", "command": worker_cmd("gpu_user", "100")}))
    said = sup.wait_event(event="records.cordons_unreadable")
    assert "symbolic link" in said["error"] and said["path"] == str(state / "cordons")
    assert not sup.find(event="gpu.cordons_kept")
    sup.ready("g-0")
    with sup.api() as http:
        devices = {d["uuid"]: d for d in http.get("/api/v1/gpu/status").json()["devices"]}
        assert devices[UUID1]["cordoned"] is False
    assert planted.read_text() == f"{UUID1}\n"
    assert sup.stop() == 0


def test_fifos_in_place_of_the_records_do_not_hang_the_start(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """FIFOs named state.json, instance and cordons in state_dir (a hand's mkfifo, a restore
    that kept special files): each is said or replaced, and the supervisor starts. Regression:
    open() of a FIFO waits for a writer, and the start hung before any worker ran."""
    state = tmp_path / "state"
    state.mkdir()
    for name in ("state.json", "instance", "cordons"):
        os.mkfifo(state / name)
    sup = supervisor(config(tmp_path, {"name": "g", "command": worker_cmd("gpu_user", "100")}))
    said = sup.wait_event(event="records.cordons_unreadable")
    assert said["error"] == "not a regular file"
    assert sup.wait_event(event="records.previous_state_unreadable")["path"] == str(
        state / "state.json"
    )
    sup.ready("g-0")
    with sup.api() as http:
        assert http.post("/api/v1/gpus/1/cordon").status_code == 200
    assert (state / "cordons").read_text() == f"{UUID1}\n"  # the FIFO replaced by a file
    assert len((state / "instance").read_text().strip()) == 32
    assert sup.stop() == 0


def test_an_operator_cordon_outlives_a_restart_of_the_supervisor(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A GPU cordoned for maintenance stays cordoned when the supervisor restarts (a crash, an
    upgrade): the next one places nothing there. Regression: the cordon was forgotten and
    workers went back onto the GPU."""
    cfg = config(tmp_path, {"name": "g", "replicas": 2, "command": worker_cmd("gpu_user", "100")})
    first = supervisor(cfg)
    first.ready("g-0")
    first.ready("g-1")
    with first.api() as http:
        assert http.post("/api/v1/gpus/1/cordon").status_code == 200
    assert (first.state_dir / "cordons").read_text() == f"{UUID1}\n"
    # state_dir removed while running (`rm -rf`): the cordon is written again with it
    # (regression: it went with the directory, and the next supervisor forgot it)
    gone = first.state_dir.with_name("removed")
    first.state_dir.rename(gone)
    shutil.rmtree(gone)
    first.wait_event(event="records.state_dir_recreated", timeout=15)
    first.wait_event(event="notify.rebound")  # said after the cordons are written again
    assert (first.state_dir / "cordons").read_text() == f"{UUID1}\n"
    assert first.stop() == 0
    second = supervisor(cfg)
    assert second.wait_event(event="gpu.cordons_kept")["gpus"] == [UUID1]
    second.ready("g-0")
    second.ready("g-1")
    with second.api() as http:
        devices = {d["uuid"]: d for d in http.get("/api/v1/gpu/status").json()["devices"]}
        assert devices[UUID1]["cordoned"] is True
        workers = http.get("/api/v1/workers").json()
        assert all(w["gpus"] == [UUID0] for w in workers)
        assert http.post("/api/v1/gpus/1/uncordon").status_code == 200
    assert (second.state_dir / "cordons").read_text() == ""
    assert second.stop() == 0


def test_a_restart_on_a_cordoned_gpu_with_nowhere_else_to_go(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A cordon stops new placements only: a worker restarted on its cordoned GPU moves if
    another GPU fits, else starts there again (it failed to start, and went fatal). A GPU it
    cannot use at all (quarantined) makes it wait for a GPU, and the log says why."""
    sup = supervisor(
        config(
            tmp_path,
            {"name": "g", "command": worker_cmd("gpu_user", "100"), "drain_timeout_s": 0.2},
            sim_devices=1,
        )
    )
    sup.ready("g-0")
    with sup.api() as http:
        assert http.post("/api/v1/gpus/0/cordon").status_code == 200
        mark = sup.mark()
        assert http.post("/api/v1/workers/g-0/restart").status_code == 202
        cordoned = sup.wait_event(event="worker.gpu_cordoned", worker="g-0", after=mark)
        assert cordoned["gpus"] == [UUID0]
        sup.ready("g-0", after=mark)
        assert http.get("/api/v1/workers/g-0").json()["gpus"] == [UUID0]
        mark = sup.mark()
        with open(tmp_path / "sim" / "events", "a") as fh:
            fh.write("0 79\n")  # device-fatal: quarantined, its worker has nowhere to go
        waiting = sup.wait_event(event="worker.waiting_gpu", worker="g-0", after=mark)
        assert "GPU 0 is quarantined" in waiting["error"]
        # no process was started: the state change names none (regression: the last one's pid)
        backoff = sup.wait_event(
            event="worker.state",
            worker="g-0",
            new="backoff",
            reason=lambda r: r.startswith("waiting for a GPU: "),
            after=mark,
        )
        assert backoff["pid"] is None
        assert not sup.find(event="worker.spawn_failed", after=mark)
    # uncordon lifts the cordon, not the quarantine: the CLI says so
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "uncordon", "0", "--url", sup.api_url()],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert out.startswith(f"GPU 0 ({UUID0}) uncordoned, but still quarantined")
    assert "--lift-quarantine" in out
    # once the GPU has been reset, the operator lifts the quarantine: g-0 starts there again
    # (before, only a restart of the supervisor, and of every worker with it, did)
    mark = sup.mark()
    url = sup.api_url()
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "uncordon", "0", "--lift-quarantine", "--url", url],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert out.strip() == f"GPU 0 ({UUID0}) uncordoned, out of quarantine", out
    lifted = sup.wait_event(event="gpu.quarantine_lifted", after=mark)
    assert lifted["gpu"] == UUID0 and "XID 79" in lifted["was"], lifted
    sup.ready("g-0", after=mark)
    with sup.api() as http:
        dev = http.get("/api/v1/gpu/status").json()["devices"][0]
        assert dev["healthy"] is True and not dev["quarantined"], dev
        assert http.get("/api/v1/workers/g-0").json()["gpus"] == [UUID0]
        # a GPU that does not answer keeps its quarantine (409: reset it first; regression:
        # "out of quarantine", then quarantined again at the next sample, with a new alert)
        mark = sup.mark()
        gpu0 = tmp_path / "sim" / "gpus" / "0"
        gpu0.write_text(gpu0.read_text() + "lost 1\n")
        sup.wait_event(event="heal.action", action="quarantine", after=mark)
        mark = sup.mark()
        refused = http.post("/api/v1/gpus/0/uncordon", params={"lift_quarantine": "true"})
        assert refused.status_code == 409 and "does not answer" in refused.text, refused.text
        assert http.get("/api/v1/gpu/status").json()["devices"][0]["quarantined"]
        assert not sup.find(event="gpu.quarantine_lifted", after=mark)
        bad = http.post("/api/v1/gpus/0/uncordon", params={"lift_quarantine": "maybe"})
        assert bad.status_code == 422 and "lift_quarantine" in bad.text, bad.text
    assert sup.stop() == 0


def test_a_worker_with_no_gpu_to_go_to_waits_and_starts_once_one_fits(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """One GPU that takes one worker, held by o-0: g-0 waits (state backoff, "waiting for a
    GPU"), is never failed nor fatal however long that takes (burst 1 here), and starts as
    soon as a reload removes group o. Regression: every look for a GPU counted as a failed
    start and the worker went fatal after `burst` of them (for good: until an operator start).
    Its looks again that find the same are at debug (regression: two worker.state lines at
    info a look, for as long as it waited)."""
    one = {"max_workers_per_gpu": 1, "command": worker_cmd("gpu_user", "100")}
    held = {"name": "o", **one}
    waiter = {
        "name": "g",
        **one,
        "restart": {"backoff_initial_s": 3, "backoff_max_s": 3, "burst": 1},
    }
    cfg = config(tmp_path, held, waiter, sim_devices=1)
    sup = supervisor(cfg, log_level="debug")
    sup.ready("o-0")
    sup.wait_event(event="worker.unplaced", worker="g-0")
    first = sup.wait_event(event="worker.waiting_gpu", worker="g-0")
    assert "cannot place g-0" in first["error"]
    # it looks again 3 s later (backoff_max_s), and says so once
    looked = sup.wait_event(
        event="worker.state", worker="g-0", reason="backoff elapsed", new="starting"
    )
    again = sup.wait_event(
        event="worker.state", worker="g-0", new="backoff", after=sup.events.index(looked)
    )
    waits = sup.find(event="worker.state", worker="g-0", new="backoff")
    assert waits[0]["level"] == "info" and waits[0]["reason"] == again["reason"], waits
    assert looked["level"] == again["level"] == "debug", (looked, again)
    assert len(sup.find(event="worker.waiting_gpu", worker="g-0", level="warning")) == 1
    with sup.api() as http:
        shown = http.get("/api/v1/workers/g-0").json()
        assert shown["state"] == "backoff", shown
        assert shown["reason"].startswith("waiting for a GPU: cannot place g-0"), shown
        mark = sup.mark()
        sup.write_config({**cfg, "workers": [cfg["workers"][1]]})
        assert http.post("/api/v1/reload").status_code == 202
        woken = sup.wait_event(event="worker.state", worker="g-0", new="starting", after=mark)
        assert woken["reason"] == "a GPU became usable"  # not its next look, 3 s away
        assert woken["level"] == "info", woken
        sup.ready("g-0", after=mark)
        assert http.get("/api/v1/workers/g-0").json()["gpus"] == [UUID0]
    assert not sup.find(event="worker.state", new="fatal")
    assert not sup.find(event="worker.spawn_failed")
    assert not sup.find(event="records.postmortem", worker="g-0")
    assert sup.stop() == 0


def test_a_roll_out_waits_for_a_replica_held_at_the_gpu_release_barrier(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A rolling restart has replaced b-0 when b-2 crashes, and b-2's replacement waits at
    the GPU-release barrier (a process of its old tree, stuck in the kernel, still holds
    memory on its GPU). The roll-out waits for b-2 to be back before it takes b-1 down.
    Regression: a worker at the barrier (starting, no process yet) did not count as on its
    way back: b-1 went at once, and b-0 alone served until both had loaded again."""
    group = {
        "name": "b",
        "replicas": 3,
        "restart": {"stable_s": 1.0},  # b-2 crashes while the roll-out waits on b-0
        "command": worker_cmd("gpu_user", "100", "--holder", "30"),
    }
    sup = supervisor(config(tmp_path, group, release_timeout_s=1.5), log_level="debug")
    for w in ("b-0", "b-1"):
        sup.ready(w)
    leader = sup.ready("b-2")["pid"]
    with stuck_holder(sup, "b-2", tmp_path) as holder:
        mark = sup.mark()
        with sup.api() as api:
            assert api.post("/api/v1/groups/b/rolling-restart").status_code == 202
        sup.ready("b-0", after=mark)
        os.kill(leader, signal.SIGKILL)
        sup.wait_event(event="gpu.suspect", worker="b-2", after=mark)
        back = sup.ready("b-2", after=mark)
        down = sup.wait_event(event="worker.state", worker="b-1", new="stopping", after=mark)
        assert sup.events.index(down) > sup.events.index(back)
        sup.wait_event(event="supervisor.rolling_restart_done", after=mark, timeout=15)
    assert wait_dead([holder]) == []
    assert sup.stop() == 0


def test_a_gpu_that_appears_in_the_world_can_be_cordoned(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A GPU added to the world while the supervisor runs is placed on (the sample lists it):
    the operator can cordon it, by index or UUID, and the answer names it; an index goes to
    the GPU listed at that index now (not one no longer listed that had it when the backend
    opened). Regression: 404 "unknown GPU '1' (known: 0)" for the new GPU, and after a
    renumbering `cordon 0` cordoned the GPU gone from the world."""
    one = {"max_workers_per_gpu": 1, "command": worker_cmd("gpu_user", "100")}
    sup = supervisor(config(tmp_path, {"name": "g", "replicas": 2, **one}, sim_devices=1))
    sup.ready("g-0")
    sup.wait_event(event="worker.waiting_gpu", worker="g-1")
    uuid9 = "GPU-00000000-0000-0000-0000-000000000009"
    gpus = tmp_path / "sim" / "gpus"
    text = (gpus / "0").read_text().replace(UUID0, uuid9)
    (gpus / ".new").write_text(text)
    (gpus / ".new").rename(gpus / "1")
    sup.ready("g-1")
    with sup.api() as http:
        assert http.get("/api/v1/workers/g-1").json()["gpus"] == [uuid9]
        cordoned = http.post("/api/v1/gpus/1/cordon")
        assert cordoned.status_code == 200, cordoned.text
        assert cordoned.json() == {"id": 1, "uuid": uuid9, "cordoned": True, "quarantined": False}
        devices = {d["uuid"]: d for d in http.get("/api/v1/gpu/status").json()["devices"]}
        assert devices[uuid9]["cordoned"] is True
        assert http.post(f"/api/v1/gpus/{uuid9}/uncordon").json()["cordoned"] is False
        # GPU 0 leaves the world, the new one is renumbered 0: index 0 is the new one now
        mark = sup.mark()
        (gpus / "0").unlink()
        (gpus / "1").rename(gpus / "0")
        sup.wait_event(event="heal.action", action="quarantine", gpu=UUID0, after=mark)
        cordoned = http.post("/api/v1/gpus/0/cordon")
        assert cordoned.status_code == 200, cordoned.text
        assert cordoned.json()["uuid"] == uuid9
    assert sup.stop() == 0


def test_a_gpu_suspect_for_two_workers_stays_suspect_until_both_let_go(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """b-0 and b-1 share GPU 0 (GPU 1 cordoned) and each leaves a process stuck holding memory
    there when it dies (as after an XID): the GPU stays suspect until both have let go.
    Regression: the second worker's stuck pids replaced the first's, the GPU was said released
    (``gpu.released``, ``suspect: false``) as soon as the second's went, while the first's
    still held memory there."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "cordons").write_text(f"{UUID1}\n")
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "b",
                "replicas": 2,
                "command": worker_cmd("gpu_user", "500", "--holder", "30"),
                "restart": {"stable_s": 0.1},
            },
            release_timeout_s=0.5,
        ),
        log_level="debug",
    )
    leaders = [sup.ready(f"b-{i}")["pid"] for i in range(2)]
    holders = [int(sup.wait_line(f"[b-{i}] ", endswith=" holder").split()[2]) for i in range(2)]
    for i, holder in enumerate(holders):
        sampled_in_tree(sup, f"b-{i}", holder)
    name = f"gpu-supervisor-test-{os.getpid()}-{tmp_path.name}"
    with stuck(holders[0], f"{name}-0"):
        with stuck(holders[1], f"{name}-1"):
            for i in range(2):
                mark = sup.mark()
                os.kill(leaders[i], signal.SIGKILL)
                said = sup.wait_event(event="gpu.suspect", worker=f"b-{i}", after=mark)
                assert said["pids"] == [holders[i]]
                sup.ready(f"b-{i}", after=mark)  # on its own suspect GPU: nowhere else
        mark = sup.mark()
        # b-1's stuck process is gone; b-0's still holds its memory on GPU 0
        sup.wait_event(
            event="gpu.sample",
            after=mark,
            devices=lambda d: d[UUID0]["processes"] == 5,  # b-0 and b-1 and b-0's stuck one
        )
        with sup.api() as http:
            gpu0 = http.get("/api/v1/gpu/status").json()["devices"][0]
            assert gpu0["suspect"] is True, gpu0
        assert not sup.find(event="gpu.released")
    assert wait_dead(holders) == []
    sup.wait_event(event="gpu.released", gpu=UUID0)
    assert sup.stop() == 0


def test_a_workers_double_forked_server_is_the_workers(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A launcher whose GPU server double-forks: the server is re-parented to the supervisor
    (its child subreaper) while the launcher, the worker's main process, waits. Regression:
    the server was no worker's: its READY=1 was dropped (the worker never became ready) and
    its GPU memory was no worker's (a foreign process on the GPU, a full scan of /proc at
    every sample). It goes with its worker."""
    sup = supervisor(
        config(
            tmp_path,
            {"name": "d", "gpus": [0], "command": worker_cmd("gpu_user", "700", "--daemon")},
            {"name": "s", "gpus": [1], "command": worker_cmd("gpu_user", "900", "--daemon-setsid")},
        ),
        log_level="debug",
    )
    servers = {}
    for worker, mb in (("d-0", 700.0), ("s-0", 900.0)):
        sup.ready(worker)
        servers[worker] = int(sup.wait_line(f"[{worker}] ", endswith="daemon ready").split()[2])
        assert worker_mb(sup, worker, mb)["attribution"] == "pid"
    assert sup.stop() == 0
    assert wait_dead(list(servers.values())) == []


def test_a_stop_and_start_during_the_gpu_release_barrier_still_waits_for_the_release(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: an operator's stop, then start, of a worker whose restart waited at the
    GPU-release barrier (a process of its old tree stuck in the kernel, holding its memory)
    started the new process at once on that GPU: the abandoned wait had already taken the old
    tree, so the new start had none to wait for, and its GPU was not judged suspect first."""
    b = {
        "name": "b",
        "command": worker_cmd("gpu_user", "500", "--holder", "30"),
        "restart": {"stable_s": 0.1},
    }
    sup = supervisor(config(tmp_path, b, release_timeout_s=0.5), log_level="debug")
    leader = sup.ready("b-0")["pid"]
    with stuck_holder(sup, "b-0", tmp_path):
        mark = sup.mark()
        crash_into_barrier(sup, "b-0", leader, mark)
        with sup.api() as http:
            assert http.post("/api/v1/workers/b-0/stop").status_code == 202
            sup.wait_event(event="worker.state", worker="b-0", new="stopped", after=mark)
            assert http.post("/api/v1/workers/b-0/start").status_code == 202
        spawned = sup.wait_event(event="worker.spawned", worker="b-0", after=mark)
        # the start waited out the barrier: the GPU still held was judged first
        suspect = sup.find(event="gpu.suspect", worker="b-0", after=mark)
        assert suspect and sup.events.index(suspect[0]) < sup.events.index(spawned)
    assert sup.stop() == 0


def test_a_budget_is_not_placed_where_a_worker_of_ours_without_one_fills_the_gpu(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """One GPU of 81920 MiB; a-0 (no ``gpu_memory_limit_mb``) holds 70000 MiB of it. A reload
    adds group b with a 20000 MiB budget: it does not fit there, and the reload is refused
    (placement) with the room left. Regression: only budgets and memory of processes that are
    no workers of ours counted, so a-0's 70000 MiB were left out and b was placed there, to run
    out of memory beside it."""
    a = {"name": "a", "command": worker_cmd("gpu_user", "70000")}
    sup = supervisor(config(tmp_path, a, sim_devices=1), log_level="debug")
    sup.ready("a-0")
    worker_mb(sup, "a-0", 70000.0)
    b = {
        "name": "b",
        "command": worker_cmd("ready_then_sleep"),
        "health": {"gpu_memory_limit_mb": 20000},
    }
    mark = sup.mark()
    sup.write_config(config(tmp_path, a, b, sim_devices=1))
    sup.signal(signal.SIGHUP)
    rejected = sup.wait_event(event="supervisor.reload_rejected", after=mark)
    assert "MB left for budgets, needs 20000" in rejected["error"], rejected
    assert not sup.find(event="worker.spawned", worker="b-0")
    assert sup.stop() == 0
