"""The HTTP API end to end: real HTTP against a running supervisor on simulated GPUs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.backends.sim import default_device_text
from tests.conftest import SupervisorFactory
from tests.harness import ROOT, Supervisor, another_user, worker_cmd
from tests.tomlw import dumps

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-00000000-0000-0000-0000-000000000001"

DEVICE_KEYS = {
    "id",
    "uuid",
    "name",
    "temperature_celsius",
    "utilization_percent",
    "memory",
    "power_watts",
    "encoder_util_percent",
    "decoder_util_percent",
    "throttle_reasons",
    "healthy",
    "cordoned",
    "processes",
}
WORKER_KEYS = {
    "name",
    "group",
    "index",
    "state",
    "pid",
    "gpus",
    "port",
    "restarts",
    "uptime_s",
    "ready",
    "gpu_memory_mb",
    "host_rss_mb",
    "leak",
    "last_exit",
}
METRICS = {
    # GPU
    "gpu_supervisor_gpu_utilization_percent",
    "gpu_supervisor_gpu_memory_used_bytes",
    "gpu_supervisor_gpu_memory_total_bytes",
    "gpu_supervisor_gpu_temperature_celsius",
    "gpu_supervisor_gpu_power_watts",
    "gpu_supervisor_gpu_throttled",
    "gpu_supervisor_gpu_throttle_reason",
    "gpu_supervisor_gpu_healthy",
    "gpu_supervisor_gpu_cordoned",
    "gpu_supervisor_gpu_xid_errors",
    # workers
    "gpu_supervisor_worker_up",
    "gpu_supervisor_worker_ready",
    "gpu_supervisor_worker_derated",
    "gpu_supervisor_worker_state",
    "gpu_supervisor_worker_restarts",
    "gpu_supervisor_worker_gpu_memory_bytes",
    "gpu_supervisor_worker_host_rss_bytes",
    "gpu_supervisor_worker_leak_slope_bytes_per_second",
    "gpu_supervisor_worker_projected_oom_seconds",
    # supervisor
    "gpu_supervisor_nvml_up",
    "gpu_supervisor_sample_duration_seconds",
    "gpu_supervisor_actions",
    "gpu_supervisor_postmortems",
    "gpu_supervisor_record_write_errors",
    "gpu_supervisor_records_writable",
}


def sim_config(tmp_path: Path, *groups: dict[str, Any]) -> dict[str, Any]:
    return {
        "supervisor": {"sample_interval_s": 0.1},
        "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim"), "release_timeout_s": 1},
        "workers": [{"stop_timeout_s": 2, "log_passthrough": True, **g} for g in groups],
    }


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{family name: [(labels, value), ...]}`` of a text exposition."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = [(dict(s.labels), s.value) for s in family.samples]
    return out


def value_of(
    samples: dict[str, list[tuple[dict[str, str], float]]], family: str, **labels: str
) -> float | None:
    for have, value in samples.get(family, []):
        if all(have.get(k) == v for k, v in labels.items()):
            return value
    return None


def assert_error(response: httpx.Response, status: int, words: str = "") -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    assert words in body["error"]
    return str(body["error"])


def memory_seen(sup: Supervisor, **mb: float) -> None:
    """Wait for a sample in which each named worker holds the given MiB."""
    sup.wait_event(
        event="gpu.sample",
        workers=lambda w: all(w.get(n, {}).get("gpu_mb") == v for n, v in mb.items()),
    )


def test_read_endpoints_on_simulated_gpus(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """Every GET of DESIGN.md section 6 answers with its documented shape."""
    sup = supervisor(
        sim_config(
            tmp_path,
            {
                "name": "g",
                "replicas": 2,
                "command": worker_cmd("gpu_user", "500"),
                "metrics_path": "/metrics",
                "restart": {"stable_s": 0.1},
            },
            {"name": "c", "gpus": "none", "command": worker_cmd("ready_then_sleep")},
        ),
        log_level="debug",
    )
    for w in ("g-0", "g-1", "c-0"):
        sup.ready(w)
    memory_seen(sup, **{"g-0": 500.0, "g-1": 500.0})
    with sup.api() as http:
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        ready = http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["ready"] is True
        assert ready.json()["groups"]["g"] == {"ready": 2, "workers": 2, "replicas": 2}

        gpu = http.get("/api/v1/gpu/status").json()
        assert gpu["nvml_available"] is True and gpu["error"] is None
        assert datetime.fromisoformat(gpu["timestamp"]).utcoffset() is not None
        assert gpu["timestamp"].endswith("Z")
        assert [d["uuid"] for d in gpu["devices"]] == [UUID0, UUID1]
        for d in gpu["devices"]:
            assert set(d) >= DEVICE_KEYS
            assert set(d["memory"]) == {"used_mb", "total_mb", "free_mb"}
            assert d["cordoned"] is False and d["healthy"] is True
        assert {p["worker"] for d in gpu["devices"] for p in d["processes"]} == {"g-0", "g-1"}

        workers = http.get("/api/v1/workers").json()
        assert [w["name"] for w in workers] == ["g-0", "g-1", "c-0"]
        for w in workers:
            assert set(w) >= WORKER_KEYS
            assert w["state"] == "ready" and w["ready"] is True
            assert set(w["leak"]) >= {"slope_mb_per_min", "suspected", "projected_oom_s"}
        g0 = http.get("/api/v1/workers/g-0").json()
        assert g0["gpus"] == [UUID0] and g0["gpu_memory_mb"] == 500.0
        assert g0["last_exit"] is None and isinstance(g0["pid"], int)
        assert_error(http.get("/api/v1/workers/nope"), 404, "unknown worker 'nope'")

        ports = {w["name"]: w["port"] for w in workers}
        assert http.get("/api/v1/targets").json() == [
            {"targets": [f"127.0.0.1:{ports['g-0']}"], "labels": {"worker": "g-0", "group": "g"}},
            {"targets": [f"127.0.0.1:{ports['g-1']}"], "labels": {"worker": "g-1", "group": "g"}},
        ]

        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        samples = metric_samples(metrics.text)
        missing = METRICS - set(samples) - {"gpu_supervisor_gpu_xid_errors"}
        missing -= {"gpu_supervisor_worker_leak_slope_bytes_per_second"}  # null until judged
        missing -= {"gpu_supervisor_worker_projected_oom_seconds"}
        missing -= {"gpu_supervisor_worker_restarts", "gpu_supervisor_actions"}  # none yet
        missing -= {"gpu_supervisor_postmortems", "gpu_supervisor_record_write_errors"}
        assert not missing
        assert value_of(samples, "gpu_supervisor_nvml_up") == 1
        gib = 1024 * 1024
        assert value_of(samples, "gpu_supervisor_gpu_memory_used_bytes", gpu="0") == 500 * gib
        assert value_of(samples, "gpu_supervisor_worker_gpu_memory_bytes", worker="g-0") == (
            500 * gib
        )
        assert value_of(samples, "gpu_supervisor_worker_state", worker="c-0", state="ready") == 1
        assert value_of(samples, "gpu_supervisor_worker_state", worker="c-0", state="fatal") == 0
        assert value_of(samples, "gpu_supervisor_worker_up", worker="c-0", group="c") == 1
        assert value_of(samples, "gpu_supervisor_records_writable", file="state") == 1
        # a worker without GPUs has no GPU memory series, not a zero
        assert value_of(samples, "gpu_supervisor_worker_gpu_memory_bytes", worker="c-0") is None

        # a death: post-mortem, events, counters
        killed = sup.mark()
        os.kill(g0["pid"], signal.SIGKILL)
        written = sup.wait_event(event="records.postmortem", worker="g-0")
        listed = http.get("/api/v1/postmortems").json()
        assert listed[0]["id"] == written["id"] and listed[0]["worker"] == "g-0"
        assert listed[0]["reason"] == "signal"
        doc = http.get(f"/api/v1/postmortems/{written['id']}").json()
        assert doc["id"] == written["id"] and doc["exit"]["signal_name"] == "SIGKILL"
        assert_error(http.get("/api/v1/postmortems/nope"), 404, "no post-mortem")
        assert_error(http.get("/api/v1/postmortems/..%2F..%2Fstate"), 404)
        # (after the kill: the post-mortem is written after the replacement's spawn, and its
        # event may come after the replacement's ready)
        sup.ready("g-0", after=killed)
        samples = metric_samples(http.get("/metrics").text)
        assert value_of(samples, "gpu_supervisor_postmortems", reason="signal") == 1
        assert value_of(samples, "gpu_supervisor_worker_restarts", worker="g-0") == 1

        events = http.get("/api/v1/events").json()
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert any(e["type"] == "postmortem" and e["worker"] == "g-0" for e in events)
        tail = http.get("/api/v1/events", params={"since": seqs[-3]}).json()
        assert [e["seq"] for e in tail] == seqs[-2:]
        assert http.get("/api/v1/events", params={"since": seqs[-1] + 100}).json() == []
        # the run they are numbered in (seq starts at 1 again in another): pid and start
        run = http.get("/api/v1/events").headers["X-Gpu-Supervisor-Run"]
        assert run.split("-")[0] == str(sup.pid) and run.split("-")[1].isdigit()
        assert http.get("/api/v1/events", params={"since": 0, "limit": 2}).json() == events[:2]
        assert_error(http.get("/api/v1/events", params={"since": -1}), 422, "since")
        assert_error(http.get("/api/v1/events", params={"since": "abc"}), 422, "since")
    assert sup.stop() == 0


def test_commands_conflicts_and_cordon(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """POSTs answer 202 + the worker, 404 for unknown names, 409 when impossible now."""
    sup = supervisor(
        sim_config(
            tmp_path,
            {
                "name": "g",
                "replicas": 2,
                "command": worker_cmd("gpu_user", "100"),
                "drain_timeout_s": 0.2,
                "restart": {"stable_s": 0.2},  # a rolling restart waits this long a worker
            },
            {"name": "c", "gpus": "none", "command": worker_cmd("ready_then_sleep")},
        )
    )
    for w in ("g-0", "g-1", "c-0"):
        sup.ready(w)
    with sup.api() as http:
        mark = sup.mark()
        drained = http.post("/api/v1/workers/g-0/drain")
        assert drained.status_code == 202
        assert drained.json()["name"] == "g-0"
        sup.wait_event(event="worker.state", worker="g-0", new="stopped", after=mark)
        assert http.get("/api/v1/workers/g-0").json()["state"] == "stopped"
        assert_error(http.post("/api/v1/workers/g-0/drain"), 409, "only a ready worker")
        assert_error(http.post("/api/v1/workers/g-0/stop"), 409, "already stopped")
        mark = sup.mark()
        assert http.post("/api/v1/workers/g-0/start").status_code == 202
        sup.ready("g-0", after=mark)
        assert_error(http.post("/api/v1/workers/g-0/start"), 409, "already ready")
        assert_error(http.post("/api/v1/workers/nope/restart"), 404, "unknown worker")

        old = http.get("/api/v1/workers/g-1").json()["pid"]
        mark = sup.mark()
        assert http.post("/api/v1/workers/g-1/restart").status_code == 202
        sup.wait_event(event="worker.spawned", worker="g-1", pid=lambda p: p != old, after=mark)

        # groups
        mark = sup.mark()
        stopped = http.post("/api/v1/groups/c/stop")
        assert stopped.status_code == 202
        assert [w["name"] for w in stopped.json()["workers"]] == ["c-0"]
        sup.wait_event(event="worker.state", worker="c-0", new="stopped", after=mark)
        assert_error(http.post("/api/v1/groups/c/stop"), 409, "every worker")
        assert_error(http.post("/api/v1/groups/nope/start"), 404, "unknown group")
        assert_error(http.post("/api/v1/groups/c/rolling-restart"), 409, "no running worker")
        mark = sup.mark()
        assert http.post("/api/v1/groups/c/start").status_code == 202
        sup.ready("c-0", after=mark)
        mark = sup.mark()
        rolling = http.post("/api/v1/groups/g/rolling-restart")
        assert rolling.status_code == 202 and rolling.json()["command"] == "rolling-restart"
        sup.wait_event(event="supervisor.rolling_restart_done", group="g", after=mark)
        assert_error(http.post("/api/v1/groups/nope/rolling-restart"), 404, "unknown group")

        # cordon by index, uncordon by UUID
        cordoned = http.post("/api/v1/gpus/0/cordon")
        assert cordoned.status_code == 200
        assert cordoned.json() == {"id": 0, "uuid": UUID0, "cordoned": True, "quarantined": False}
        devices = http.get("/api/v1/gpu/status").json()["devices"]
        assert [d["cordoned"] for d in devices] == [True, False]
        samples = metric_samples(http.get("/metrics").text)
        assert value_of(samples, "gpu_supervisor_gpu_cordoned", gpu="0") == 1
        assert value_of(samples, "gpu_supervisor_actions", action="cordon") == 1
        assert value_of(samples, "gpu_supervisor_actions", action="drain") == 1
        assert value_of(samples, "gpu_supervisor_actions", action="rolling_restart") == 1
        # a cordon stops placement only: the workers already on the GPUs keep serving
        assert http.post("/api/v1/gpus/1/cordon").status_code == 200
        assert http.get("/api/v1/route", params={"group": "g"}).status_code == 200
        assert http.post("/api/v1/gpus/1/uncordon").status_code == 200
        assert http.post(f"/api/v1/gpus/{UUID0}/uncordon").json()["cordoned"] is False
        assert_error(http.post("/api/v1/gpus/7/cordon"), 404, "unknown GPU '7'")

        # bad input is a JSON 4xx, never a 500
        assert_error(http.get("/no/such/path"), 404)
        assert_error(http.get("/api/v1/workers/g-0/drain"), 405)
        assert_error(http.post("/api/v1/workers"), 405)
    assert sup.stop() == 0


def test_a_worker_stopped_while_a_rolling_restart_replaces_it_is_passed_over(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The operator stops the worker a rolling restart is replacing (it is loading): it stays
    stopped and the roll-out goes on with the rest at once (regression: the roll-out waited
    out the worker's whole start_timeout_s for a start that never came, then halted there
    saying it "did not become ready")."""
    # once it exists, g-0 loads for 60 s: still loading when stopped, however late the stop
    # (a 0.5 s load could be over by then under load: ready, no longer a start to pass over)
    slow = tmp_path / "slow"
    py, script = worker_cmd("notify_ready_late")
    load = (
        f'if [ -e {slow} ] && [ {{index}} = 0 ]; then t=60; else t=0.5; fi; exec {py} {script} "$t"'
    )
    sup = supervisor(
        {
            "gpu": {"backend": "none"},
            "workers": [
                {
                    "name": "g",
                    "replicas": 2,
                    "command": ["sh", "-c", load],
                    "start_timeout_s": 60,
                    "stop_timeout_s": 2,
                    "restart": {"stable_s": 0.1},
                }
            ],
        }
    )
    sup.ready("g-0")
    sup.ready("g-1")
    slow.touch()
    with sup.api() as http:
        mark = sup.mark()
        assert http.post("/api/v1/groups/g/rolling-restart").status_code == 202
        sup.wait_event(event="worker.spawned", worker="g-0", after=mark)
        assert http.post("/api/v1/workers/g-0/stop").status_code == 202
        sup.wait_event(event="supervisor.rolling_restart_done", group="g", after=mark, timeout=20)
        passed = sup.wait_event(event="supervisor.rollout_passed_over", worker="g-0", after=mark)
        assert "stopped" in passed["reason"]
        assert sup.find(event="worker.spawned", worker="g-1", after=mark)
        assert http.get("/api/v1/workers/g-0").json()["state"] == "stopped"
        assert http.get("/api/v1/workers/g-1").json()["state"] == "ready"
        events = http.get("/api/v1/events").json()
        assert [e["group"] for e in events if e["type"] == "rollout.done"] == ["g"], events
    assert sup.stop() == 0


@pytest.mark.parametrize("command", ["stop", "restart"])
@pytest.mark.parametrize("how", ["rolling-restart", "reload"])
def test_an_operator_command_on_a_worker_a_roll_out_is_proving_halts_nothing(
    supervisor: SupervisorFactory, how: str, command: str
) -> None:
    """Regression: the operator stops or restarts the worker a roll-out (a rolling restart, a
    reload's) has just replaced while the roll-out waits for it to stay ready for stable_s:
    the roll-out halted there ("did not stay ready for stable_s"), blaming the new process,
    and the rest were never restarted (a reload's kept the old config). A stopped one is
    passed over, as one stopped while it loads is; a restarted one is waited for and proven
    again; either way the roll-out goes on with the rest."""
    group = {
        "name": "g",
        "replicas": 2,
        "command": worker_cmd("ready_then_sleep"),
        "stop_timeout_s": 2,
        "restart": {"stable_s": 1},
    }
    sup = supervisor({"gpu": {"backend": "none"}, "workers": [group]})
    sup.ready("g-0")
    sup.ready("g-1")
    end = ("supervisor.rolling_restart_done", "supervisor.reload_done")

    def at(after: int, **match: Any) -> int:
        """The position of the first event from ``after`` on that matches (waited for)."""
        return sup.events.index(sup.wait_event(after=after, **match))

    with sup.api() as http:
        # The command must land while the roll-out proves ``first`` (stable_s, 1 s, from its
        # READY): a test held off the CPU that long after the READY (a loaded machine) sent
        # it once the roll-out had gone on to ``other``, a case this test is not about
        # (regression, flaky: ``other`` was spawned before it). Said by the supervisor's
        # own order of events (the roll-out's stop of ``other`` came first); then the
        # roll-out is done, ``first`` serves again, and another roll-out is tried.
        for attempt in range(3):
            mark = sup.mark()
            if how == "reload":
                env = {"V": str(2 + attempt)}
                sup.write_config({"gpu": {"backend": "none"}, "workers": [{**group, "env": env}]})
                assert http.post("/api/v1/reload").status_code == 202
            else:
                assert http.post("/api/v1/groups/g/rolling-restart").status_code == 202
            first = sup.wait_event(event="worker.spawned", after=mark)["worker"]
            other = "g-1" if first == "g-0" else "g-0"
            sup.ready(first, after=mark)
            again = sup.mark()
            assert http.post(f"/api/v1/workers/{first}/{command}").status_code == 202
            done = sup.wait_event(event=lambda e: e in end, after=mark, timeout=20)
            taken = at(again, event="worker.state", worker=first, new="stopping")
            if at(mark, event="worker.state", worker=other, new="stopping") > taken:
                break  # the command came while the roll-out proved ``first``
            back = sup.mark()
            if command == "stop":
                assert http.post(f"/api/v1/workers/{first}/start").status_code == 202
            sup.ready(first, after=back if command == "stop" else again)
        assert done.get("halted", []) == []
        assert not sup.find(event="supervisor.rollout_halted", after=mark)
        assert sup.find(event="worker.spawned", worker=other, after=again)
        passed = sup.find(event="supervisor.rollout_passed_over", worker=first, after=mark)
        if command == "stop":
            assert passed and "stopped" in passed[0]["reason"]
            assert http.get(f"/api/v1/workers/{first}").json()["state"] == "stopped"
        else:
            assert not passed
            assert sup.find(event="worker.spawned", worker=first, after=again)
            assert http.get(f"/api/v1/workers/{first}").json()["state"] == "ready"
        events = http.get("/api/v1/events").json()
        rolled = [e["group"] for e in events if e["type"] == "rollout.done"]
        assert rolled == ["g"] * (attempt + 1), events
    assert sup.stop() == 0


def test_a_cordon_during_the_stop_is_refused(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """A cordon (or uncordon) asked for while the supervisor stops is a 409, as every other
    command is then. Regression: it was dropped, and answered 200 after 2 s with
    ``cordoned: false`` (the CLI printed "uncordoned" and exited 0 for a cordon)."""
    slow = {"name": "s", "gpus": "none", "command": worker_cmd("ignore_sigterm")}
    sup = supervisor(sim_config(tmp_path, {**slow, "stop_timeout_s": 1.5}))
    sup.ready("s-0")
    with sup.api() as http:
        mark = sup.mark()
        sup.signal(signal.SIGTERM)  # s-0 takes 1.5 s to stop
        sup.wait_event(event="supervisor.stopping", after=mark)
        for verb in ("cordon", "uncordon"):
            assert_error(http.post(f"/api/v1/gpus/0/{verb}"), 409, "the supervisor is stopping")
        assert not sup.find(event="gpu.cordon", after=mark)
    assert sup.wait_exit() == 0


def test_a_rolling_restart_of_a_group_being_drained_to_a_stop_is_refused(
    supervisor: SupervisorFactory,
) -> None:
    """Every worker of the group is on its way to a stop the operator asked for (a drain):
    a rolling restart has nothing to restart, and says so with a 409 as for a stopped group.
    Regression: 202, then ``rollout.done`` at once with nothing restarted."""
    sup = supervisor(
        {
            "gpu": {"backend": "none"},
            "workers": [
                {"name": "d", "command": worker_cmd("ready_then_sleep"), "drain_timeout_s": 30}
            ],
        }
    )
    sup.ready("d-0")
    with sup.api() as http:
        mark = sup.mark()
        assert http.post("/api/v1/workers/d-0/drain").status_code == 202
        sup.wait_event(event="worker.state", worker="d-0", new="draining", after=mark)
        assert_error(http.post("/api/v1/groups/d/rolling-restart"), 409, "no running worker")
        assert not sup.find(event="supervisor.rolling_restart", after=mark)
    assert sup.stop() == 0


def test_readyz_flips_to_503_when_a_group_has_no_ready_worker(
    supervisor: SupervisorFactory,
) -> None:
    sup = supervisor(
        {
            "gpu": {"backend": "none"},
            "workers": [
                {"name": "a", "command": worker_cmd("ready_then_sleep")},
                {"name": "b", "command": worker_cmd("ready_then_sleep"), "stop_timeout_s": 2},
            ],
        }
    )
    sup.ready("a-0")
    sup.ready("b-0")
    with sup.api() as http:
        assert http.get("/readyz").status_code == 200
        mark = sup.mark()
        assert http.post("/api/v1/workers/b-0/stop").status_code == 202
        sup.wait_event(event="worker.state", worker="b-0", new="stopped", after=mark)
        ready = http.get("/readyz")
        assert ready.status_code == 503
        body = ready.json()
        assert body["ready"] is False
        assert body["error"] == "group b: no ready worker (1 stopped)"
        assert body["groups"]["a"]["ready"] == 1
        mark = sup.mark()
        assert http.post("/api/v1/workers/b-0/start").status_code == 202
        sup.ready("b-0", after=mark)
        assert http.get("/readyz").status_code == 200
    assert sup.stop() == 0


def test_route_takes_turns_between_workers_that_tie(supervisor: SupervisorFactory) -> None:
    """Two identical workers without GPUs: the route answer alternates between them (regression:
    the first in config order took every request)."""
    sup = supervisor(
        {
            "workers": [
                {
                    "name": "t",
                    "replicas": 2,
                    "gpus": "none",
                    "command": worker_cmd("ready_then_sleep"),
                }
            ]
        }
    )
    sup.ready("t-0")
    sup.ready("t-1")
    with sup.api() as http:
        names = [http.get("/api/v1/route", params={"group": "t"}).json()["name"] for _ in range(4)]
    assert names == ["t-0", "t-1", "t-0", "t-1"]
    assert sup.stop() == 0


def test_route_by_free_memory_429_and_503(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """The route answer follows free memory; 429 + Retry-After when nothing fits; 503 when none
    is ready."""
    world = tmp_path / "sim"
    (world / "gpus").mkdir(parents=True)
    for index, total in ((0, 10000), (1, 20000)):
        (world / "gpus" / str(index)).write_text(default_device_text(index, total))
    sup = supervisor(
        sim_config(
            tmp_path,
            {
                "name": "r",
                "replicas": 2,
                "command": worker_cmd("gpu_user", "1000"),
                "drain_timeout_s": 0.2,
            },
        ),
        log_level="debug",
    )
    sup.ready("r-0")
    sup.ready("r-1")
    memory_seen(sup, **{"r-0": 1000.0, "r-1": 1000.0})
    with sup.api() as http:
        devices = {d["uuid"]: d for d in http.get("/api/v1/gpu/status").json()["devices"]}
        on = {w["name"]: w["gpus"][0] for w in http.get("/api/v1/workers").json()}
        best = max(on, key=lambda n: devices[on[n]]["memory"]["free_mb"])
        other = next(n for n in on if n != best)
        answer = http.get("/api/v1/route", params={"group": "r"})
        assert answer.status_code == 200
        assert answer.json() == {
            "name": best,
            "port": http.get(f"/api/v1/workers/{best}").json()["port"],
            "gpu": on[best],
            "free_mb": devices[on[best]]["memory"]["free_mb"],
        }
        fits_one = http.get("/api/v1/route", params={"group": "r", "need_mb": 15000})
        assert fits_one.json()["name"] == best
        full = http.get("/api/v1/route", params={"group": "r", "need_mb": 50000})
        assert_error(full, 429, "50000 MiB")
        assert full.headers["retry-after"] == "1"
        huge = http.get("/api/v1/route", params={"group": "r", "need_mb": 123456789})
        assert_error(huge, 429, "has 123456789 MiB free")  # not 1.23457e+08
        assert_error(http.get("/api/v1/route", params={"group": "x"}), 404, "unknown group")
        assert_error(http.get("/api/v1/route", params={"group": "r", "need_mb": -1}), 422)
        assert_error(http.get("/api/v1/route", params={"group": "r", "need_mb": "nan"}), 422)
        assert_error(http.get("/api/v1/route"), 422, "group")

        mark = sup.mark()
        assert http.post(f"/api/v1/workers/{best}/drain").status_code == 202
        assert http.get("/api/v1/route", params={"group": "r"}).json()["name"] == other
        assert http.post(f"/api/v1/workers/{other}/stop").status_code == 202
        for name in (best, other):
            sup.wait_event(event="worker.state", worker=name, new="stopped", after=mark)
        assert_error(http.get("/api/v1/route", params={"group": "r"}), 503, "no ready worker")
    assert sup.stop() == 0


def test_route_admits_on_the_headroom_under_the_gpu_budget(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: ``need_mb`` was judged on the device's free memory alone, so a worker
    holding 1000 MiB of its 1200 MiB budget on a GPU with 9000 MiB free was sent a request
    needing 500 MiB (it would go over budget and be restarted); ``free_mb`` said 9000."""
    world = tmp_path / "sim"
    (world / "gpus").mkdir(parents=True)
    (world / "gpus" / "0").write_text(default_device_text(0, 10000))
    sup = supervisor(
        sim_config(
            tmp_path,
            {
                "name": "b",
                "command": worker_cmd("gpu_user", "1000"),
                "health": {"gpu_memory_limit_mb": 1200},
            },
        ),
        log_level="debug",
    )
    sup.ready("b-0")
    memory_seen(sup, **{"b-0": 1000.0})
    with sup.api() as http:
        answer = http.get("/api/v1/route", params={"group": "b"})
        assert answer.json() == {
            "name": "b-0",
            "port": answer.json()["port"],
            "gpu": UUID0,
            "free_mb": 200.0,
        }
        fits = http.get("/api/v1/route", params={"group": "b", "need_mb": 150})
        assert fits.status_code == 200, fits.text
        over = http.get("/api/v1/route", params={"group": "b", "need_mb": 500})
        assert_error(over, 429, "most free: 200 MiB")
    assert sup.stop() == 0


def test_gpu_status_when_nvml_is_down(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """No NVML library: 200 with no devices and the error; supervision and the API go on."""
    libdir = tmp_path / "lib"
    libdir.mkdir()
    sup = supervisor(
        {
            "gpu": {"backend": "nvml"},
            "workers": [{"name": "c", "command": worker_cmd("ready_then_sleep")}],
        },
        env={"LD_LIBRARY_PATH": str(libdir)},
    )
    sup.wait_event(event="gpu.unavailable")
    sup.ready("c-0")
    with sup.api() as http:
        answer = http.get("/api/v1/gpu/status")
        assert answer.status_code == 200
        body = answer.json()
        assert body["devices"] == [] and body["nvml_available"] is False
        assert isinstance(body["error"], str) and body["error"]
        samples = metric_samples(http.get("/metrics").text)
        assert value_of(samples, "gpu_supervisor_nvml_up") == 0
        assert (
            "gpu_supervisor_gpu_utilization_percent" not in samples
            or not samples["gpu_supervisor_gpu_utilization_percent"]
        )
        assert http.get("/api/v1/workers/c-0").json()["state"] == "ready"
        assert_error(http.post("/api/v1/gpus/0/cordon"), 404, "unknown GPU")
        assert http.get("/readyz").status_code == 200
    assert sup.stop() == 0


def run_once(tmp_path: Path, config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``gpu-supervisor run`` that is expected to fail at start."""
    cfg = {"supervisor": {"state_dir": str(tmp_path / "state")}, **config}
    path = tmp_path / "fail.toml"
    path.write_text(dumps(cfg))
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "run", "-c", str(path), "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )


def test_start_refused_when_the_address_is_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_once(
            tmp_path,
            {
                "api": {"listen": f"127.0.0.1:{port}"},
                "workers": [{"name": "c", "command": worker_cmd("ready_then_sleep")}],
            },
        )
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"gpu-supervisor: api.listen 127.0.0.1:{port}: address already in use"
    assert "worker.spawned" not in out.stderr


def test_start_refused_with_a_readable_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o644)
    out = run_once(
        tmp_path,
        {
            "api": {"listen": "127.0.0.1:0", "token_file": str(token)},
            "workers": [{"name": "c", "command": worker_cmd("ready_then_sleep")}],
        },
    )
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    config = tmp_path / "fail.toml"
    assert last.startswith(f"gpu-supervisor: {config}: api.token_file {token}: mode 0644")
    assert "Traceback" not in out.stderr


def test_a_worker_added_again_by_a_reload_counts_restarts_from_zero(
    supervisor: SupervisorFactory,
) -> None:
    """Regression: the restart counter of a worker removed by a reload came back, at its old
    value, when a later reload added a worker of the same name (its `restarts` said 0)."""
    group = {"name": "c", "command": worker_cmd("ready_then_sleep"), "replicas": 2}
    sup = supervisor({"workers": [group]})
    sup.ready("c-1")
    with sup.api() as http:
        mark = sup.mark()
        assert http.post("/api/v1/workers/c-1/restart").status_code == 202
        sup.ready("c-1", after=mark)

        def restarts() -> list[tuple[dict[str, str], float]]:
            samples = metric_samples(http.get("/metrics").text)
            series = samples.get("gpu_supervisor_worker_restarts", [])  # family: no _total
            return [(labels, v) for labels, v in series if labels["worker"] == "c-1"]

        assert [v for _, v in restarts()] == [1]
        for replicas in (1, 2):
            mark = sup.mark()
            sup.write_config({"workers": [{**group, "replicas": replicas}]})
            sup.signal(signal.SIGHUP)
            sup.wait_event(event="supervisor.reload", after=mark)
            if replicas == 1:  # a scale: c-0 is left alone, c-1 removed
                sup.wait_event(event="worker.state", worker="c-1", new="stopped", after=mark)
        sup.ready("c-1", after=mark)
        assert http.get("/api/v1/workers/c-1").json()["restarts"] == 0
        assert restarts() == []
    assert sup.stop() == 0


def test_head_is_answered_as_a_get_without_its_body(supervisor: SupervisorFactory) -> None:
    """`curl -I` and uptime checkers send HEAD (RFC 9110 9.1: a general-purpose server
    supports it). Regression: 405 on every endpoint, which reads as "down"."""
    sup = supervisor({"workers": [{"name": "c", "command": worker_cmd("ready_then_sleep")}]})
    sup.ready("c-0")
    with sup.api() as http:
        for path in ("/healthz", "/metrics", "/api/v1/workers", "/api/v1/workers/c-0", "/"):
            get, head = http.get(path), http.head(path)
            assert head.status_code == get.status_code == 200, (path, head.status_code)
            assert head.content == b"", path
            assert head.headers["content-type"] == get.headers["content-type"], path
            assert int(head.headers["content-length"]) > 0, path
        assert http.head("/api/v1/workers/nope").status_code == 404
        # a routing decision takes a turn: a HEAD must change nothing, so it is no GET there
        assert http.head("/api/v1/route", params={"group": "c"}).status_code == 405
    assert sup.stop() == 0


def test_a_post_mortem_file_of_another_shape_does_not_break_the_list(
    supervisor: SupervisorFactory,
) -> None:
    """Regression: one file in postmortems/ written by hand or by another tool, whose fields
    had other types (`"exit": 3`, a number for the worker's name), made `GET
    /api/v1/postmortems` answer 500 for every file; `postmortem list` showed it."""
    sup = supervisor({"workers": [{"name": "c", "command": worker_cmd("ready_then_sleep")}]})
    sup.ready("c-0")
    odd = "20260101T000000.000000Z-x-exit"
    (sup.state_dir / "postmortems" / f"{odd}.json").write_text(
        '{"worker": {"name": 5, "group": ["g"], "ended_at": 7}, "exit": 3, "reason": {"a": 1}}'
    )
    with sup.api() as http:
        answer = http.get("/api/v1/postmortems")
        assert answer.status_code == 200, answer.text
        assert answer.json() == [
            {
                "id": odd,
                "worker": None,
                "group": None,
                "reason": None,
                "ended_at": None,
                "exit": None,
            }
        ]
        assert http.get(f"/api/v1/postmortems/{odd}").json()["exit"] == 3  # the file as it is
    assert not sup.find(event="api.error")
    assert sup.stop() == 0


def test_a_post_mortem_that_is_a_link_is_not_followed(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: a symbolic link planted in postmortems/, named like a post-mortem, was
    followed: the API and `postmortem show` served whatever JSON file it named (one only root
    may read, read by a root supervisor). It is taken for no post-mortem now: left out of the
    list, a 404 for the API, and a one-line error (exit 2) for the CLI."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "s3cret"}')
    sup = supervisor({"workers": [{"name": "c", "command": worker_cmd("ready_then_sleep")}]})
    sup.ready("c-0")
    planted = "20260101T000000.000000Z-x-exit"
    (sup.state_dir / "postmortems" / f"{planted}.json").symlink_to(secret)
    with sup.api() as http:
        answer = http.get("/api/v1/postmortems")
        assert answer.status_code == 200 and answer.json() == [], answer.text
        one = http.get(f"/api/v1/postmortems/{planted}")
        assert_error(one, 404, "no post-mortem")
        assert "s3cret" not in one.text
    cli = [sys.executable, "-m", "supervisor", "postmortem", "show", planted]
    shown = subprocess.run(
        [*cli, "--state-dir", str(sup.state_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 2 and "symbolic link" in shown.stderr, shown
    assert shown.stderr.count("\n") == 1 and "s3cret" not in shown.stdout + shown.stderr
    assert sup.stop() == 0


def test_a_post_mortem_directory_that_cannot_be_listed_is_a_503(
    supervisor: SupervisorFactory,
) -> None:
    """Regression: `GET /api/v1/postmortems` answered 500 "internal error" when postmortems/
    could not be listed (EACCES: its mode changed under a supervisor that does not run as
    root; here a link that loops, which root meets too); it says why now, as the answer for
    one post-mortem does."""
    sup = supervisor({"workers": [{"name": "c", "command": worker_cmd("ready_then_sleep")}]})
    sup.ready("c-0")
    pms = sup.state_dir / "postmortems"
    pms.rmdir()
    pms.symlink_to("postmortems")
    with sup.api() as http:
        assert_error(http.get("/api/v1/postmortems"), 503, "cannot list the post-mortems")
    assert not sup.find(event="api.error")
    pms.unlink()
    assert sup.stop() == 0


def test_targets_pass_a_metrics_path_query_as_params(supervisor: SupervisorFactory) -> None:
    """Regression: `metrics_path = "/metrics?format=prometheus"` went into `__metrics_path__`
    whole: Prometheus puts that label in the URL's path (escaping the `?`), so every scrape of
    the workers asked for `/metrics%3Fformat=prometheus` and got a 404. The query goes in
    `__param_<name>` labels, as Prometheus's HTTP service discovery takes them."""
    sup = supervisor(
        {
            "workers": [
                {
                    "name": "c",
                    "command": worker_cmd("ready_then_sleep"),
                    "metrics_path": "/stats/prometheus?format=prometheus&usedonly",
                }
            ]
        }
    )
    sup.ready("c-0")
    with sup.api() as http:
        [target] = http.get("/api/v1/targets").json()
    assert target["labels"] == {
        "worker": "c-0",
        "group": "c",
        "__metrics_path__": "/stats/prometheus",
        "__param_format": "prometheus",
        "__param_usedonly": "",
    }
    assert sup.stop() == 0


#: Binds ``api.listen`` as another user (argv: the listen value, uid, gid).
BIND_AS = """
import encodings.ascii, os, sys  # imported while they can be read
from supervisor.errors import ListenError
from supervisor.listen import bind
os.setgroups([])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[2]))
try:
    bind(sys.argv[1])
except ListenError as exc:
    print(f"ListenError: {exc}")
"""


@pytest.mark.parametrize("live", [False, True], ids=["stale", "live"])
def test_a_unix_socket_of_another_user_is_a_one_line_error(live: bool) -> None:
    """Regression: a supervisor run as an ordinary user whose ``api.listen`` unix socket path
    held another user's socket (one a supervisor run as root left in a sticky directory such
    as /tmp, or still serves there) took it for a stale one, as it could not connect to it,
    and failed to remove it: a PermissionError traceback instead of the one-line error."""
    nobody = another_user("the socket must belong to another user than the supervisor's")
    shared = Path(tempfile.mkdtemp(prefix="gsv-sticky-"))  # one "nobody" may reach, as /tmp
    try:
        shared.chmod(0o1777)
        path = shared / "api.sock"
        theirs = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.bind(str(path))
        path.chmod(0o660)
        if live:
            theirs.listen()
        else:
            theirs.close()
        out = subprocess.run(
            [sys.executable, "-c", BIND_AS, f"unix:{path}", str(nobody.pw_uid), str(nobody.pw_gid)],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
            cwd=ROOT,
        )
        theirs.close()
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"ListenError: api.listen unix:{path}: "), out.stdout
        assert "may not connect" in out.stdout and len(out.stdout.splitlines()) == 1
        assert path.exists()  # never removed
    finally:
        shutil.rmtree(shared, ignore_errors=True)
