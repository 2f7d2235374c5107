"""Self-healing end to end on simulated GPUs with real workers (``tests/workers/sim_worker.py``).

Each test drives the sim world (memory claims, clock-event reasons, XID lines) and waits for
the supervisor's own log events and API answers: no sleeping.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor import procfs
from tests.conftest import SupervisorFactory
from tests.harness import Supervisor, most_not_ready, worker_cmd
from tests.schemas import validate_file

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-00000000-0000-0000-0000-000000000001"

#: Leak detection scaled down: a 12 s window (floor buckets of 0.1 s), no warm-up.
FAST_LEAK = {"leak_warmup_s": 0, "leak_window_s": 12, "leak_min_mb_per_min": 10}


def config(tmp_path: Path, *groups: dict[str, Any], **gpu: Any) -> dict[str, Any]:
    return {
        "supervisor": {"sample_interval_s": 0.05},
        "gpu": {
            "backend": "sim",
            "sim_dir": str(tmp_path / "sim"),
            "thermal_sustain_s": 0.3,
            "thermal_clear_s": 0.3,
            "release_timeout_s": 2,
            **gpu,
        },
        "workers": [
            {
                "log_passthrough": True,
                "stop_timeout_s": 2,
                "drain_timeout_s": 0.2,
                "restart": {"delay_s": 0, "stable_s": 0.1},
                **g,
            }
            for g in groups
        ],
    }


def sim(*args: str) -> list[str]:
    return worker_cmd("sim_worker", *args)


def set_gpu(tmp_path: Path, index: int, **keys: object) -> None:
    """Rewrite keys of a simulated GPU (atomically, as the sim world requires)."""
    path = tmp_path / "sim" / "gpus" / str(index)
    lines = dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)
    lines.update({k: str(v) for k, v in keys.items()})
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{k} {v}\n" for k, v in lines.items()))
    tmp.replace(path)


def xid(tmp_path: Path, index: int, code: int) -> None:
    with open(tmp_path / "sim" / "events", "a") as fh:
        fh.write(f"{index} {code}\n")


def postmortem(sup: Supervisor, reason: str) -> dict[str, Any]:
    event = sup.wait_event(event="records.postmortem", reason=reason)
    path = sup.state_dir / "postmortems" / f"{event['id']}.json"
    validate_file(path)
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def begin_roll_out(sup: Supervisor, tmp_path: Path, how: str, group: dict[str, Any]) -> None:
    """Roll ``group`` out: a reload that changes its environment, or a rolling restart."""
    if how == "reload":
        sup.write_config(config(tmp_path, {**group, "env": {"V": "2"}}))
        sup.signal(signal.SIGHUP)
    else:
        with sup.api() as api:
            path = f"/api/v1/groups/{group['name']}/rolling-restart"
            assert api.post(path).status_code == 202


def rolled_out(sup: Supervisor, how: str, mark: int, timeout: float) -> None:
    """The roll-out (``how``: a reload or a rolling restart) begun after ``mark`` ends, done
    (not halted)."""
    done = "supervisor.reload_done" if how == "reload" else "supervisor.rolling_restart_done"

    def over() -> bool:
        return bool(
            sup.find(event=done, after=mark)
            or sup.find(event="supervisor.rollout_halted", after=mark)
        )

    sup.wait_until(over, "the roll-out to end", timeout=timeout)
    assert not sup.find(event="supervisor.rollout_halted", after=mark)


def test_leaking_worker_is_drained_and_restarted_before_its_budget(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "leaky",
                "command": sim("500", "--leak", "12"),  # 720 MiB/min
                "health": {**FAST_LEAK, "gpu_memory_limit_mb": 1500},
            },
        )
    )
    sup.ready("leaky-0")
    action = sup.wait_event(event="heal.action", worker="leaky-0", timeout=30)
    assert (action["action"], action["reason"]) == ("drain", "leak")
    assert action["evidence"]["memory"] == "gpu"
    assert action["evidence"]["slope_mb_per_min"] > 100
    assert action["evidence"]["projected_oom_s"] <= 300
    assert action["evidence"]["used_mb"] < 1500  # acted on before the budget
    doc = postmortem(sup, "leak")
    assert doc["worker"]["name"] == "leaky-0"
    assert doc["evidence"]["action"] == "drain"
    assert doc["evidence"]["slope_mb_per_min"] == action["evidence"]["slope_mb_per_min"]
    sup.wait_events(2, event="worker.spawned", worker="leaky-0")
    assert not sup.find(event="heal.action", reason="gpu_memory_limit")
    assert sup.stop() == 0


def test_a_leak_hidden_in_the_cache_is_found_by_the_workers_own_reports(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """NVML sees a flat 800 MiB (the allocator's cache); the worker reports what it holds,
    growing 720 MiB/min: it is drained for a leak judged on its reports, before its budget."""
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "cached",
                "command": sim("800", "--in-use", "300", "--in-use-leak", "12"),
                "health": {**FAST_LEAK, "gpu_memory_limit_mb": 1500},
            },
            {"name": "plain", "command": sim("500")},
        )
    )
    sup.ready("cached-0")
    sup.ready("plain-0")
    action = sup.wait_event(event="heal.action", worker="cached-0", timeout=30)
    assert (action["action"], action["reason"]) == ("drain", "leak")
    evidence = action["evidence"]
    assert evidence["source"] == "worker"
    assert evidence["slope_mb_per_min"] > 100
    assert evidence["used_mb"] == 800  # NVML's figure did not move
    assert 300 < evidence["in_use_mb"] < 800
    doc = postmortem(sup, "leak")
    assert doc["evidence"]["source"] == "worker"
    sup.wait_events(2, event="worker.spawned", worker="cached-0")
    with sup.api() as api:
        plain = api.get("/api/v1/workers/plain-0").json()
    assert plain["gpu_memory_in_use_mb"] is None
    assert plain["leak"]["source"] == "nvml"
    assert not sup.find(event="heal.action", worker="plain-0")
    assert sup.stop() == 0


def test_bad_in_use_reports_are_ignored_and_logged_once(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "odd",
                "command": sim("500", "--in-use", "lots"),
                "health": FAST_LEAK,
            },
        )
    )
    sup.ready("odd-0")
    event = sup.wait_event(event="heal.bad_report", worker="odd-0")
    assert (event["field"], event["value"]) == ("X_GPU_MEMORY_IN_USE_MB", "lots")
    with sup.api() as api:
        obj = api.get("/api/v1/workers/odd-0").json()
    assert obj["gpu_memory_in_use_mb"] is None
    assert obj["leak"]["source"] == "nvml"
    assert obj["state"] == "ready"
    assert len(sup.find(event="heal.bad_report")) == 1
    assert sup.stop() == 0


FAKE_TORCH = str(Path(__file__).resolve().parents[1] / "fake_torch")


def test_unmodified_torch_workers_report_through_the_injected_reporter(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """``in_use_reporter = "torch"``: workers that send no reports themselves (they only hold
    tensors, in tests/fake_torch) are judged on what torch holds, summed over their processes;
    the user's own sitecustomize still runs; without the key nothing is reported."""
    usersite = tmp_path / "usersite"
    usersite.mkdir()
    (usersite / "sitecustomize.py").write_text("print('user sitecustomize ran', flush=True)\n")
    torch_env = {"PYTHONPATH": f"{usersite}:{FAKE_TORCH}"}
    reporter = {"in_use_reporter": "torch"}
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "cached",
                "command": sim("800", "--torch", "--in-use", "300", "--in-use-leak", "12"),
                "env": torch_env,
                "health": {**FAST_LEAK, **reporter, "gpu_memory_limit_mb": 1500},
            },
            {
                "name": "ranks",
                "command": sim("500", "--torch", "--in-use", "200", "--children", "2"),
                "env": torch_env,
                "health": reporter,
            },
            {
                "name": "off",
                "command": sim("500", "--torch", "--in-use", "200"),
                "env": torch_env,
            },
        )
    )
    assert sup.wait_line("[cached-0] ", contains="user sitecustomize ran")
    action = sup.wait_event(event="heal.action", worker="cached-0", timeout=30)
    assert (action["action"], action["reason"]) == ("drain", "leak")
    evidence = action["evidence"]
    assert evidence["source"] == "worker"
    assert evidence["used_mb"] == 800  # NVML's figure did not move
    assert 300 < evidence["in_use_mb"] < 800
    # three processes hold 200 MiB each: the worker holds their sum
    ranks = sup.wait_api(
        "/api/v1/workers/ranks-0",
        lambda w: w["gpu_memory_in_use_mb"] == 600 and w["leak"]["source"] == "worker",
    )
    assert ranks["state"] == "ready" and ranks["gpu_memory_mb"] == 500
    # a rank that exits takes its memory with it (not held until its report goes stale)
    rank = psutil.Process(ranks["pid"]).children()[0]
    rank.kill()
    sup.wait_api("/api/v1/workers/ranks-0", lambda w: w["gpu_memory_in_use_mb"] == 400)
    with sup.api() as api:
        off = api.get("/api/v1/workers/off-0").json()
    assert off["state"] == "ready"
    assert off["gpu_memory_in_use_mb"] is None
    assert off["leak"]["source"] == "nvml"
    assert not sup.find(event="heal.action", worker="ranks-0")
    assert sup.stop() == 0


def test_over_gpu_and_host_budget_restarts(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "big",
                "command": sim("3000"),
                "health": {"gpu_memory_limit_mb": 2000},
            },
            {
                "name": "fat",
                "command": sim("100", "--host-mb", "150"),
                "health": {"host_memory_limit_mb": 100},
            },
        )
    )
    env_line = sup.wait_line("[big-0] ", contains="ready on")
    assert env_line
    big = sup.wait_event(event="heal.action", worker="big-0", timeout=20)
    assert (big["action"], big["reason"]) == ("restart", "gpu_memory_limit")
    assert big["evidence"]["used_mb"] == 3000 and big["evidence"]["limit_mb"] == 2000
    fat = sup.wait_event(event="heal.action", worker="fat-0", timeout=20)
    assert (fat["action"], fat["reason"]) == ("restart", "host_memory_limit")
    assert fat["evidence"]["used_mb"] > 100
    assert postmortem(sup, "gpu_memory_limit")["worker"]["name"] == "big-0"
    assert postmortem(sup, "host_memory_limit")["worker"]["name"] == "fat-0"
    mode = sup.wait_event(event="cgroup.mode")  # how the host budget is enforced, and why
    assert mode["mode"] in ("memory.max", "rss_watch") and mode["reason"]
    with sup.api() as api:
        workers = {w["name"]: w for w in api.get("/api/v1/workers").json()}
    assert workers["fat-0"]["host_memory_enforcement"] == mode["mode"]
    assert workers["big-0"]["host_memory_enforcement"] is None
    assert sup.stop() == 0


def test_a_worker_over_its_budget_from_the_start_backs_off_then_goes_fatal(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Every replacement is over its budget again at once: each healing restart of a worker
    that was not stable counts as a failed start (backoff, then fatal), as a crash would.
    Regression: it restarted at once, forever (28 post-mortems in 14 s, never fatal)."""
    restart = {"delay_s": 0, "stable_s": 30, "backoff_initial_s": 0.2, "burst": 2}
    group = {
        "name": "big",
        "command": sim("800"),
        "restart": restart,
        "health": {"gpu_memory_limit_mb": 500},
    }
    sup = supervisor(config(tmp_path, group))
    fatal = sup.wait_event(event="worker.state", worker="big-0", new="fatal", timeout=30)
    assert "gpu_memory_limit" in fatal["reason"], fatal
    actions = sup.find(event="heal.action", worker="big-0")
    assert len(actions) == 3 and {a["reason"] for a in actions} == {"gpu_memory_limit"}
    backoffs = sup.find(event="worker.state", worker="big-0", new="backoff")
    assert len(backoffs) == 2
    written = sup.wait_events(3, event="records.postmortem", worker="big-0")
    docs = [
        json.loads((sup.state_dir / "postmortems" / f"{e['id']}.json").read_text()) for e in written
    ]
    assert all(d["evidence"]["counted_as_failure"] for d in docs), docs[0]["evidence"]
    assert sup.stop() == 0


def test_hot_gpu_derates_its_workers_then_restores_them(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor(config(tmp_path, {"name": "g", "replicas": 2, "command": sim("100")}))
    sup.ready("g-0")
    sup.ready("g-1")
    set_gpu(tmp_path, 0, clocks_event_reasons=0x20)  # SW thermal slowdown
    derate = sup.wait_event(event="heal.action", action="derate", timeout=20)
    assert (derate["worker"], derate["reason"], derate["gpu"]) == ("g-0", "thermal", UUID0)
    with sup.api() as api:
        workers = {w["name"]: w for w in api.get("/api/v1/workers").json()}
        assert workers["g-0"]["derated"] is True and workers["g-1"]["derated"] is False
        for _ in range(3):  # routing avoids the derated worker
            assert api.get("/api/v1/route", params={"group": "g"}).json()["name"] == "g-1"
        gpu0 = api.get("/api/v1/gpu/status").json()["devices"][0]
        assert gpu0["hot"] is True
        scrape = api.get("/metrics").text  # regression: no metric said it (alerts could not)
        assert 'gpu_supervisor_worker_derated{group="g",worker="g-0"} 1.0' in scrape
        assert 'gpu_supervisor_worker_derated{group="g",worker="g-1"} 0.0' in scrape
        mark = sup.mark()
        set_gpu(tmp_path, 0, clocks_event_reasons=0)
        sup.wait_event(event="heal.action", action="restore", worker="g-0", after=mark)
        assert api.get("/api/v1/workers/g-0").json()["derated"] is False
        scrape = api.get("/metrics").text
        assert 'gpu_supervisor_worker_derated{group="g",worker="g-0"} 0.0' in scrape
    assert not sup.find(event="worker.exited")  # never a plain restart
    assert sup.stop() == 0


def test_a_reload_that_turns_derating_off_routes_the_derated_workers_at_once(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: a reload that changed ``on_thermal`` from ``derate`` to ``none`` left g-0
    derated (out of routing, ``derated`` in the API, ``worker_derated`` 1) until its GPU
    cooled. It is restored at once, said as a ``restore``, and keeps running."""
    g = {"name": "g", "command": sim("100"), "gpus": [0]}
    sup = supervisor(config(tmp_path, g))
    sup.ready("g-0")
    set_gpu(tmp_path, 0, clocks_event_reasons=0x20)  # SW thermal slowdown
    sup.wait_event(event="heal.action", action="derate", worker="g-0", timeout=20)
    mark = sup.mark()
    sup.write_config(config(tmp_path, {**g, "health": {"on_thermal": "none"}}))
    sup.signal(signal.SIGHUP)
    restore = sup.wait_event(event="heal.action", action="restore", worker="g-0", after=mark)
    assert "on_thermal" in restore["message"]
    with sup.api() as api:
        assert api.get("/api/v1/workers/g-0").json()["derated"] is False
        assert api.get("/api/v1/route", params={"group": "g"}).json()["name"] == "g-0"
        assert (
            'gpu_supervisor_worker_derated{group="g",worker="g-0"} 0.0' in api.get("/metrics").text
        )
    assert not sup.find(event="worker.exited")
    assert sup.stop() == 0


def test_a_stopped_worker_on_a_hot_gpu_is_not_derated(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: a derated worker an operator stopped stayed derated (the API and
    ``worker_derated`` said 1 for a worker with no process). Started again on the GPU, still
    hot, it is derated at its start."""
    sup = supervisor(config(tmp_path, {"name": "g", "command": sim("100"), "gpus": [0]}))
    sup.ready("g-0")
    set_gpu(tmp_path, 0, clocks_event_reasons=0x20)  # SW thermal slowdown
    sup.wait_event(event="heal.action", action="derate", worker="g-0", timeout=20)
    with sup.api() as api:
        assert api.post("/api/v1/workers/g-0/stop").status_code == 202
        sup.wait_event(event="worker.state", worker="g-0", new="stopped")
        worker = api.get("/api/v1/workers/g-0").json()
        assert worker["state"] == "stopped" and worker["derated"] is False, worker
        assert (
            'gpu_supervisor_worker_derated{group="g",worker="g-0"} 0.0' in api.get("/metrics").text
        )
        mark = sup.mark()
        assert api.post("/api/v1/workers/g-0/start").status_code == 202
        derate = sup.wait_event(event="heal.action", action="derate", worker="g-0", after=mark)
        assert "started on a hot GPU" in derate["message"]
        assert api.get("/api/v1/workers/g-0").json()["derated"] is True
    assert sup.stop() == 0


def test_a_worker_removed_by_a_reload_leaves_nothing_to_one_of_its_name_added_later(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: the healer kept what it knew of a worker a reload removed (its leak
    watch, findings, cooldowns, ``derated``) for the rest of the run: a supervisor whose
    reloads add and remove groups grew without bound, and a worker of the same name added
    later inherited it: g-0, removed while derated, came back (on a GPU that is not hot) with
    a ``restore`` action, logged, journaled and counted, for a worker never derated."""
    g = {"name": "g", "command": sim("100"), "gpus": [0]}
    k = {"name": "k", "command": sim("100"), "gpus": [1]}
    sup = supervisor(config(tmp_path, g, k))
    sup.ready("g-0")
    set_gpu(tmp_path, 0, clocks_event_reasons=0x20)  # SW thermal slowdown
    sup.wait_event(event="heal.action", action="derate", worker="g-0", timeout=20)
    mark = sup.mark()
    sup.write_config(config(tmp_path, k))
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="supervisor.reload_done", after=mark, timeout=20)
    set_gpu(tmp_path, 0, clocks_event_reasons=0)
    sup.wait_api("/api/v1/gpu/status", lambda s: not s["devices"][0]["hot"])
    mark = sup.mark()
    sup.write_config(config(tmp_path, g, k))
    sup.signal(signal.SIGHUP)
    sup.ready("g-0", after=mark)
    sup.wait_event(event="supervisor.reload_done", after=mark, timeout=20)
    assert not sup.find(event="heal.action", worker="g-0", after=mark)
    with sup.api() as api:
        assert api.get("/api/v1/workers/g-0").json()["derated"] is False
        scrape = api.get("/metrics").text
    assert 'gpu_supervisor_actions_total{action="restore",reason="thermal"}' not in scrape
    assert sup.stop() == 0


def test_migrate_moves_a_worker_to_the_cooler_gpu(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor(
        config(
            tmp_path,
            {"name": "m", "command": sim("100"), "health": {"on_thermal": "migrate"}},
        )
    )
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID0}")
    mark = sup.mark()
    set_gpu(tmp_path, 0, temperature_c=84, temperature_slowdown_c=87)  # within the 5 C margin
    action = sup.wait_event(event="heal.action", action="migrate", after=mark, timeout=20)
    assert action["reason"] == "thermal"
    moved = sup.wait_event(event="worker.moved", worker="m-0", after=mark)
    assert moved["new_gpus"] == [UUID1]
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID1}")
    assert postmortem(sup, "thermal")["evidence"]["action"] == "migrate"
    assert sup.stop() == 0


def test_migrate_does_not_move_a_worker_onto_a_gpu_that_was_hot_a_moment_ago(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """GPU 1 is hot, then cool again; GPU 0 turns hot at once: m-0 stays on GPU 0 (an alert
    says why) and moves to GPU 1 only once GPU 1 has been cool for the window
    (2 x (thermal_sustain_s + thermal_clear_s)). Regression: m-0 moved at once onto GPU 1,
    which had been hot a moment before: with GPUs that heat in turn (a hot chassis) a worker
    ping-ponged between them, bounded only by the 60 s cooldown of an action."""
    group = {"name": "m", "command": sim("100"), "health": {"on_thermal": "migrate"}}
    # a window of 1.2 s; GPU 1 clears 0.2 s after it cools, GPU 0 is hot 0.4 s after it heats
    cfg = config(tmp_path, group, thermal_sustain_s=0.4, thermal_clear_s=0.2)
    sup = supervisor(cfg)
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID0}")
    mark = sup.mark()
    set_gpu(tmp_path, 1, temperature_c=86, temperature_slowdown_c=87)
    sup.wait_api("/api/v1/gpu/status", lambda s: s["devices"][1]["hot"])
    # GPU 1 cools as GPU 0 heats: counted in the same samples, GPU 1 is cool again (hot at
    # its last sample) 0.2 s before GPU 0 turns hot, however late either write is seen;
    # the test may lag up to 1 s between the two writes. (Regression, flaky: GPU 0 heated
    # only once the API had said GPU 1 cool; a test lag of 0.4 s there let GPU 1's window
    # pass first, and m-0 rightly migrated at once.)
    set_gpu(tmp_path, 1, temperature_c=40)
    set_gpu(tmp_path, 0, temperature_c=86, temperature_slowdown_c=87)
    first = sup.wait_event(event="heal.action", worker="m-0", after=mark)
    assert first["action"] == "alert", first
    assert "GPU 1 was hot" in first["evidence"]["migrate"], first
    action = sup.wait_event(event="heal.action", action="migrate", after=mark, timeout=20)
    assert action["worker"] == "m-0"
    assert sup.wait_event(event="worker.moved", worker="m-0", after=mark)["new_gpus"] == [UUID1]
    assert sup.stop() == 0


def test_a_migrate_worker_is_not_started_on_a_gpu_already_near_its_slowdown_temperature(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The supervisor (re)starts while GPU 0 is within the thermal margin (heat is not kept
    across a restart, and thermal_sustain_s is not over yet): m-0 starts on GPU 1.
    Regression: it started on GPU 0, to be drained and moved (a model load wasted) as soon
    as GPU 0 had been hot for thermal_sustain_s."""
    gpus = tmp_path / "sim" / "gpus"
    gpus.mkdir(parents=True)
    (gpus / "0").write_text(f"uuid {UUID0}\ntemperature_c 86\ntemperature_slowdown_c 87\n")
    # GPU 0 has the most free memory: placement by memory alone prefers it
    (gpus / "1").write_text(f"uuid {UUID1}\ntemperature_c 40\nmemory_base_mib 1000\n")
    group = {"name": "m", "command": sim("100"), "health": {"on_thermal": "migrate"}}
    sup = supervisor(config(tmp_path, group, thermal_sustain_s=60))
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID1}")
    assert sup.stop() == 0


def test_migrate_waits_for_a_cooler_gpu_and_never_places_onto_a_hot_one(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Both GPUs hot: no cooler GPU has room (alerted). GPU 1 cools: the worker moves there.
    A worker added by a reload while GPU 0 is hot goes to GPU 1, not to the hot GPU 0 with the
    most free memory. Regressions: the worker stayed on the hot GPU for good once the alert
    was sent, and one placed after the GPU turned hot stayed there, neither moved nor
    derated."""
    group = {"name": "m", "command": sim("100"), "health": {"on_thermal": "migrate"}}
    sup = supervisor(config(tmp_path, group))
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID0}")
    mark = sup.mark()
    # GPU 1 hot first, as the supervisor sees it. Regression (flaky): both heated one after
    # the other, a sample taken between the two writes saw GPU 0 hot one sample before GPU 1,
    # which was then still cool (its thermal_sustain_s not over): m-0 rightly migrated, and
    # started on GPU 0 again as GPU 1 turned hot while it drained (worker.gpu_hot), no alert
    set_gpu(tmp_path, 1, temperature_c=86, temperature_slowdown_c=87)
    sup.wait_api("/api/v1/gpu/status", lambda s: s["devices"][1]["hot"])
    set_gpu(tmp_path, 0, temperature_c=86, temperature_slowdown_c=87)
    alert = sup.wait_event(event="heal.action", action="alert", worker="m-0", after=mark)
    assert alert["evidence"]["migrate"] == "no cooler GPU has room", alert
    set_gpu(tmp_path, 1, temperature_c=40)
    action = sup.wait_event(event="heal.action", action="migrate", after=mark, timeout=20)
    assert (action["worker"], action["reason"]) == ("m-0", "thermal")
    assert sup.wait_event(event="worker.moved", worker="m-0", after=mark)["new_gpus"] == [UUID1]
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID1}")
    exited = sup.wait_event(event="worker.exited", worker="m-0", after=mark)
    assert exited["failure"] is False  # the GPU's doing: no failed start toward fatal
    mark = sup.mark()
    sup.write_config(config(tmp_path, {**group, "replicas": 2}))
    sup.signal(signal.SIGHUP)
    assert sup.wait_line("[m-1] ", endswith=f"ready on {UUID1}")
    assert not sup.find(event="heal.action", worker="m-1", after=mark)
    assert sup.stop() == 0


def test_a_migration_whose_target_turned_hot_while_it_drained_is_said(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """GPU 0 turns hot, m-0 is to move to GPU 1; GPU 1 turns hot too while m-0 drains: m-0
    starts on GPU 0 again (no cooler GPU has room) and an alert says so. Regression: only a
    log line (worker.gpu_hot): the operator saw a migrate and never learned that the worker
    stayed."""
    group = {
        "name": "m",
        "command": sim("100"),
        "drain_timeout_s": 3,  # it does not exit by itself: GPU 1 turns hot meanwhile
        "health": {"on_thermal": "migrate"},
    }
    sup = supervisor(config(tmp_path, group))
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID0}")
    mark = sup.mark()
    set_gpu(tmp_path, 0, temperature_c=86, temperature_slowdown_c=87)
    sup.wait_event(event="heal.action", action="migrate", worker="m-0", after=mark)
    set_gpu(tmp_path, 1, temperature_c=86, temperature_slowdown_c=87)
    sup.wait_api("/api/v1/gpu/status", lambda s: s["devices"][1]["hot"])
    stayed = sup.wait_event(event="worker.gpu_hot", worker="m-0", after=mark, timeout=15)
    assert stayed["gpus"] == [UUID0]
    alert = sup.wait_event(event="heal.action", action="alert", worker="m-0", after=mark)
    assert (alert["reason"], alert["gpu"]) == ("thermal", UUID0), alert
    assert "could not move off its hot GPU" in alert["message"], alert
    sup.ready("m-0", after=mark)
    assert sup.stop() == 0


def test_a_migration_whose_gpu_cooled_while_it_drained_stays_without_an_alert(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """GPU 0 turns hot, m-0 is to move to GPU 1; while m-0 drains GPU 0 cools and GPU 1
    turns hot: m-0 starts on GPU 0 again, which is cool now, and nothing says otherwise.
    Regression: the migration still avoided GPU 0 as if it were hot, found no cooler GPU,
    and alerted "could not move off its hot GPU" (worker.gpu_hot) for a GPU that was cool."""
    group = {
        "name": "m",
        "command": sim("100"),
        "drain_timeout_s": 1.5,  # it does not exit by itself: the GPUs change meanwhile
        "health": {"on_thermal": "migrate"},
    }
    sup = supervisor(config(tmp_path, group))
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID0}")
    mark = sup.mark()
    set_gpu(tmp_path, 0, temperature_c=86, temperature_slowdown_c=87)
    sup.wait_event(event="heal.action", action="migrate", worker="m-0", after=mark)
    set_gpu(tmp_path, 1, temperature_c=86, temperature_slowdown_c=87)
    set_gpu(tmp_path, 0, temperature_c=40)
    sup.wait_api(
        "/api/v1/gpu/status", lambda s: s["devices"][1]["hot"] and not s["devices"][0]["hot"]
    )
    assert not sup.find(event="worker.exited", worker="m-0", after=mark), "drained too soon"
    sup.ready("m-0", after=mark)
    with sup.api() as api:
        assert api.get("/api/v1/workers/m-0").json()["gpus"] == [UUID0]
    assert not sup.find(event="worker.gpu_hot", after=mark)
    assert not sup.find(event="heal.action", action="alert", worker="m-0", after=mark)
    assert sup.stop() == 0


def test_a_migrate_worker_on_a_hot_cordoned_gpu_restarts_there_when_nothing_else_fits(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """GPU 0 hot and cordoned, GPU 1 full (max_workers_per_gpu 1): m-0, restarted, starts on
    GPU 0 again (a cordon lets a worker restart where it was when nothing else fits).
    Regression: it waited for a GPU while GPU 0 stayed hot."""
    group = {
        "name": "m",
        "replicas": 2,
        "max_workers_per_gpu": 1,
        "command": sim("100"),
        "health": {"on_thermal": "migrate"},
    }
    sup = supervisor(config(tmp_path, group))
    assert sup.wait_line("[m-0] ", endswith=f"ready on {UUID0}")
    sup.ready("m-1")
    mark = sup.mark()
    set_gpu(tmp_path, 0, clocks_event_reasons=0x40)  # hardware thermal slowdown
    alert = sup.wait_event(event="heal.action", action="alert", worker="m-0", after=mark)
    assert alert["evidence"]["migrate"] == "no cooler GPU has room", alert
    with sup.api() as api:
        assert api.post("/api/v1/gpus/0/cordon").status_code == 200
        assert api.post("/api/v1/workers/m-0/restart").status_code == 202
        sup.ready("m-0", after=mark)
        assert api.get("/api/v1/workers/m-0").json()["gpus"] == [UUID0]
    assert not sup.find(event="worker.waiting_gpu", after=mark)
    assert sup.stop() == 0


def test_xid_13_restarts_only_the_worker_on_that_gpu(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor(config(tmp_path, {"name": "g", "replicas": 2, "command": sim("100")}))
    g0 = sup.ready("g-0")
    sup.ready("g-1")
    xid(tmp_path, 0, 13)
    action = sup.wait_event(event="heal.action", reason="xid", timeout=20)
    assert (action["action"], action["worker"]) == ("restart", "g-0")
    sup.wait_events(2, event="worker.spawned", worker="g-0")
    assert postmortem(sup, "xid")["evidence"]["xid"] == 13
    assert len(sup.find(event="worker.spawned", worker="g-1")) == 1
    assert not sup.find(event="heal.action", worker="g-1")
    assert g0
    assert sup.stop() == 0


def test_a_worker_fatal_xid_on_a_shared_gpu_never_takes_the_whole_group_down(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: XID 13 on a GPU shared by both workers of a group (max_unavailable 1):
    the first was restarted, and at the next sample, while it waited out its backoff with no
    process, the second counted as the only worker on the GPU (the XID "its own") and was
    restarted too: the whole group down at once. Now the second waits for the first."""
    restart = {"delay_s": 0, "stable_s": 30, "backoff_initial_s": 0.5, "backoff_max_s": 0.5}
    group = {"name": "g", "replicas": 2, "command": sim("100"), "restart": restart}
    sup = supervisor(config(tmp_path, group, sim_devices=1))
    sup.ready("g-0")
    sup.ready("g-1")
    mark = sup.mark()
    xid(tmp_path, 0, 13)
    first = sup.wait_event(event="heal.action", reason="xid", after=mark, timeout=20)
    other = "g-1" if first["worker"] == "g-0" else "g-0"
    sup.wait_event(event="worker.state", worker=other, new="stopping", reason="xid", after=mark)
    assert most_not_ready(sup.find(event="worker.state", after=mark)) == 1
    assert sup.stop() == 0


def test_a_worker_fatal_xid_cuts_an_operators_drain_short(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A worker being drained by an operator gets XID 13: it is stopped at once (not after its
    30 s drain) and stays stopped, and the action is logged as the stop it is, with an `xid`
    post-mortem. Regressions: the XID was dropped; then it was logged as a "restart" and the
    post-mortem blamed a drain that ran out of time."""
    sup = supervisor(
        config(tmp_path, {"name": "g", "command": sim("100"), "drain_timeout_s": 30}, sim_devices=1)
    )
    sup.ready("g-0")
    with sup.api() as api:
        mark = sup.mark()
        assert api.post("/api/v1/workers/g-0/drain").status_code == 202
        sup.wait_event(event="worker.state", worker="g-0", new="draining", after=mark)
        xid(tmp_path, 0, 13)
        action = sup.wait_event(event="heal.action", reason="xid", after=mark, timeout=20)
        assert (action["action"], action["worker"]) == ("stop", "g-0")
        sup.wait_event(event="worker.state", worker="g-0", new="stopped", after=mark)
        assert api.get("/api/v1/workers/g-0").json()["state"] == "stopped"
        doc = postmortem(sup, "xid")
        assert doc["evidence"]["xid"] == 13 and doc["evidence"]["action"] == "stop", doc
    assert len(sup.find(event="worker.spawned", worker="g-0")) == 1
    assert not sup.find(event="records.postmortem", reason="drain")
    assert sup.stop() == 0


def test_xid_79_quarantines_the_gpu_and_moves_its_workers(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor(config(tmp_path, {"name": "g", "replicas": 2, "command": sim("100")}))
    sup.ready("g-0")
    sup.ready("g-1")
    mark = sup.mark()
    xid(tmp_path, 0, 79)
    sup.wait_event(event="heal.action", action="quarantine", gpu=UUID0, after=mark, timeout=20)
    drain = sup.wait_event(event="heal.action", action="drain", after=mark)
    assert drain["worker"] == "g-0"
    moved = sup.wait_event(event="worker.moved", worker="g-0", after=mark)
    assert moved["new_gpus"] == [UUID1]
    with sup.api() as api:
        gpu0 = api.get("/api/v1/gpu/status").json()["devices"][0]
        assert (gpu0["healthy"], gpu0["quarantined"]) == (False, True)
        ready = api.get("/readyz").json()
        assert [g["uuid"] for g in ready["gpus_unhealthy"]] == [UUID0]
        assert 'gpu_supervisor_gpu_healthy{gpu="0"' in api.get("/metrics").text
    assert sup.stop() == 0


def test_a_quarantine_outlives_a_restart_of_the_supervisor_until_lifted(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """XID 79 quarantines GPU 0; the supervisor is restarted (an upgrade, a crash) in the same
    boot: GPU 0 is still quarantined, and g-0 starts on GPU 1. Regression: every quarantine
    was lifted by the restart, and workers were placed on the GPU that had failed (on real
    hardware: a crash loop until someone reset it). An operator's lift ends it for good."""
    cfg = config(tmp_path, {"name": "g", "command": sim("100")})
    sup = supervisor(cfg)
    sup.ready("g-0")
    mark = sup.mark()
    xid(tmp_path, 0, 79)
    sup.wait_event(event="heal.action", action="quarantine", gpu=UUID0, after=mark, timeout=20)
    sup.ready("g-0", after=mark)
    saved = json.loads((sup.state_dir / "quarantine").read_text())
    assert saved["boot_id"] == procfs.boot_id() and list(saved["gpus"]) == [UUID0], saved
    assert sup.stop() == 0

    again = supervisor(cfg)
    kept = again.wait_event(event="gpu.quarantines_kept")
    assert list(kept["gpus"]) == [UUID0] and "79" in kept["gpus"][UUID0], kept
    again.ready("g-0")
    with again.api() as api:
        assert api.get("/api/v1/workers/g-0").json()["gpus"] == [UUID1]
        gpu0 = api.get("/api/v1/gpu/status").json()["devices"][0]
        assert (gpu0["healthy"], gpu0["quarantined"]) == (False, True), gpu0
        lifted = api.post("/api/v1/gpus/0/uncordon", params={"lift_quarantine": "true"})
        assert lifted.json()["quarantined"] is False, lifted.text
    assert not (again.state_dir / "quarantine").exists()
    assert again.stop() == 0


def test_a_quarantine_file_that_cannot_be_written_is_said_once(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """state_dir/quarantine cannot be written (a directory in its place) while state.json can:
    the failure is said once, and the file is tried again after state writes, quietly.
    Regression: it was tried again at every sample, each failure undoing the recovery the
    next state.json write logged: records.write_failed and write_recovered in turn, twice a
    second for ever."""
    (tmp_path / "state" / "quarantine").mkdir(parents=True)
    sup = supervisor(config(tmp_path, {"name": "g", "command": sim("100")}), log_level="debug")
    sup.ready("g-0")
    mark = sup.mark()
    xid(tmp_path, 0, 79)
    sup.wait_event(event="heal.action", action="quarantine", gpu=UUID0, after=mark, timeout=20)
    sup.ready("g-0", after=mark)
    sup.wait_events(20, event="gpu.sample", after=sup.mark(), timeout=20)
    assert len(sup.find(event="records.write_failed", after=mark)) == 1
    assert len(sup.find(event="records.write_recovered", after=mark)) <= 1
    assert sup.stop() == 0


def test_a_quarantine_of_an_earlier_boot_is_dropped(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """state_dir/quarantine was written before the machine rebooted (another boot id): the
    reboot reset the GPUs, so GPU 0 is usable again (said, `gpu.quarantines_dropped`) and the
    file goes."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "quarantine").write_text(
        json.dumps({"boot_id": "an-earlier-boot", "gpus": {UUID0: "XID 79"}})
    )
    sup = supervisor(config(tmp_path, {"name": "g", "command": sim("100")}))
    assert sup.wait_event(event="gpu.quarantines_dropped")["gpus"] == {UUID0: "XID 79"}
    sup.ready("g-0")
    with sup.api() as api:
        assert api.get("/api/v1/gpu/status").json()["devices"][0]["quarantined"] is False
    assert not sup.find(event="gpu.quarantines_kept")
    assert not (state / "quarantine").exists()
    assert sup.stop() == 0


def test_lifts_alone_of_an_earlier_boot_are_dropped_with_the_file(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """state_dir/quarantine of an earlier boot holding lifts only (no GPU quarantined): the
    file goes at the start. Regression: it was kept as it was (nothing quarantined, nothing
    to write), so a later start that cannot read the boot id honoured a lift from before
    the reboot."""
    state = tmp_path / "state"
    state.mkdir()
    doc = {"boot_id": "an-earlier-boot", "gpus": {}, "lifted": {UUID0: {"recovery_action": 1}}}
    (state / "quarantine").write_text(json.dumps(doc))
    sup = supervisor(config(tmp_path, {"name": "g", "command": sim("100")}))
    sup.ready("g-0")
    sup.wait_until(lambda: not (state / "quarantine").exists(), "the file removed")
    assert sup.stop() == 0


def test_a_row_remap_failure_while_running_moves_the_worker_with_a_postmortem(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """GPU 0's row remapper reports a failed remap while g-0 serves there: the GPU is
    quarantined and g-0 drained and started on GPU 1 (reason ``row_remap_failure``, its
    post-mortem with the remapper's figures); /readyz names the GPU. A pending remap on GPU 1
    meanwhile is an alert only: g-0 starts and stays there."""
    sup = supervisor(config(tmp_path, {"name": "g", "command": sim("100")}))
    sup.ready("g-0")
    mark = sup.mark()
    set_gpu(tmp_path, 1, remapped_rows_pending=1)
    alert = sup.wait_event(event="heal.action", action="alert", after=mark)
    assert (alert["gpu"], alert["reason"]) == (UUID1, "row_remap_pending")
    set_gpu(tmp_path, 0, remapped_rows_uncorrectable=3, remapped_rows_failure=1)
    sup.wait_event(event="heal.action", action="quarantine", gpu=UUID0, after=mark)
    drain = sup.wait_event(event="heal.action", action="drain", after=mark)
    assert (drain["worker"], drain["reason"]) == ("g-0", "row_remap_failure")
    moved = sup.wait_event(event="worker.moved", worker="g-0", after=mark)
    assert moved["new_gpus"] == [UUID1]
    doc = postmortem(sup, "row_remap_failure")
    assert doc["evidence"]["remapped_rows"] == {
        "correctable": 0,
        "uncorrectable": 3,
        "pending": False,
        "failure": True,
    }, doc
    sup.ready("g-0", after=mark)
    with sup.api() as api:
        ready = api.get("/readyz").json()
        assert [g["uuid"] for g in ready["gpus_unhealthy"]] == [UUID0]
        assert "row remap failed" in ready["gpus_unhealthy"][0]["error"]
    assert len(sup.find(event="heal.action", after=mark)) == 3  # alert, quarantine, drain
    assert sup.stop() == 0


def test_a_recovery_action_of_a_reset_moves_the_worker_off_the_gpu(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The driver says GPU 0 needs a reset (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, after an
    XID 154 say): the GPU is quarantined and g-0 drained and started on GPU 1 (reason
    ``recovery_action``, its post-mortem naming the action); the metric names it."""
    sup = supervisor(config(tmp_path, {"name": "g", "command": sim("100")}))
    sup.ready("g-0")
    mark = sup.mark()
    set_gpu(tmp_path, 0, recovery_action=1)
    sup.wait_event(event="heal.action", action="quarantine", gpu=UUID0, after=mark)
    moved = sup.wait_event(event="worker.moved", worker="g-0", after=mark)
    assert moved["new_gpus"] == [UUID1]
    doc = postmortem(sup, "recovery_action")
    assert doc["evidence"]["recovery_action"] == "gpu_reset", doc
    sup.ready("g-0", after=mark)
    with sup.api() as api:
        gpu0 = api.get("/api/v1/gpu/status").json()["devices"][0]
        metrics = api.get("/metrics").text
    assert (gpu0["recovery_action"], gpu0["quarantined"]) == ("gpu_reset", True), gpu0
    actions = {
        s.labels["action"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "gpu_supervisor_gpu_recovery_action" and s.labels["gpu"] == "0"
    }
    assert actions["gpu_reset"] == 1.0 and actions["none"] == 0.0, actions
    assert sup.stop() == 0


def test_a_worker_moved_off_a_gpu_needing_a_reset_moves_again_when_its_new_one_does(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """The driver says g-0's GPU needs a reset: g-0 moves to another GPU; seconds later the
    driver says that one needs a reset too (an error reaching the GPUs one by one): g-0 moves
    again, to the third. Regression: the drain of g-0 for ``recovery_action`` a minute ago held
    back this one (a cooldown about the process before), and g-0 stayed on a quarantined GPU."""
    sup = supervisor(config(tmp_path, {"name": "g", "command": sim("100")}, sim_devices=3))
    sup.ready("g-0")
    seen: set[str] = set()
    for _ in range(2):
        with sup.api() as api:
            (gpu,) = api.get("/api/v1/workers/g-0").json()["gpus"]
        seen.add(gpu)
        mark = sup.mark()
        set_gpu(tmp_path, int(gpu[-1]), recovery_action=1)
        sup.wait_event(event="heal.action", action="quarantine", gpu=gpu, after=mark)
        drain = sup.wait_event(event="heal.action", action="drain", after=mark)
        assert (drain["worker"], drain["gpu"]) == ("g-0", gpu)
        moved = sup.wait_event(event="worker.moved", worker="g-0", after=mark)
        assert moved["new_gpus"][0] not in seen, moved
        sup.ready("g-0", after=mark)
    assert sup.stop() == 0


def test_a_worker_listed_on_a_quarantined_gpu_waits_for_it(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """`gpus = [0]` and XID 79 on GPU 0: the worker is drained and waits for its GPU (state
    backoff, "waiting for a GPU"), never a failed start. Regression: it started on the
    quarantined GPU again ("explicit GPU list: starting there anyway"): on real hardware a
    crash loop, then fatal."""
    group = {"name": "p", "command": sim("100"), "gpus": [0]}
    sup = supervisor(config(tmp_path, group))
    sup.ready("p-0")
    mark = sup.mark()
    xid(tmp_path, 0, 79)
    sup.wait_event(event="heal.action", action="drain", worker="p-0", after=mark, timeout=20)
    waiting = sup.wait_event(event="worker.waiting_gpu", worker="p-0", after=mark)
    assert "GPU 0 is quarantined" in waiting["error"], waiting
    assert len(sup.find(event="worker.spawned", worker="p-0")) == 1
    assert not sup.find(event="worker.gpu_unusable", after=mark)
    with sup.api() as api:
        worker = api.get("/api/v1/workers/p-0").json()
        assert worker["state"] == "backoff" and "waiting for a GPU" in worker["reason"], worker
    assert sup.stop() == 0


@pytest.mark.parametrize("down", ["draining", "crashed"])
@pytest.mark.parametrize("how", ["rolling-restart", "reload"])
def test_a_roll_out_passes_over_a_worker_whose_healing_drain_ends_waiting_for_a_gpu(
    supervisor: SupervisorFactory, tmp_path: Path, how: str, down: str
) -> None:
    """XID 79 on GPU 0 drains p-0 (or p-0 crashed just before, as a device-fatal XID's CUDA
    error often makes it, and is in backoff), which then waits for a GPU (GPU 1 has p-1, one
    worker a GPU); a roll-out of the group reaches it then. It comes back waiting for a GPU,
    as one waiting already would be: passed over, and the roll-out goes on to p-1 (which
    keeps its GPU) and completes. Regression: it halted at p-0 ("did not become ready"), p-1
    never rolled."""
    group: dict[str, Any] = {
        "name": "p",
        "replicas": 2,
        "command": sim("100"),
        "max_workers_per_gpu": 1,
        "restart": {"stable_s": 0.1},
    }
    # p-0 must still be down (not waiting for a GPU yet) when the roll-out reaches it, and
    # nothing but the roll-out may end that: a backoff, or a drain (no drain_signal: the
    # worker does not react to it), that outlasts the test by far. (A 0.2 s, then 2 s drain
    # timeout and a 5 s backoff were missed under load: p-0 was waiting for a GPU already,
    # passed over without a word, and the test timed out on supervisor.rollout_passed_over.)
    if down == "crashed":
        # (delay_s too: a kill that lands stable_s after ready is a stable run's end, restarted
        # after delay_s, not a failure: seen in CI, where the kill came late)
        group["restart"] = {
            "stable_s": 0.1,
            "delay_s": 60,
            "backoff_initial_s": 60,
            "backoff_max_s": 60,
        }
    else:
        group["drain_timeout_s"] = 60
    sup = supervisor(config(tmp_path, group))
    pid = sup.ready("p-0")["pid"]
    sup.ready("p-1")
    mark = sup.mark()
    if down == "crashed":
        os.kill(pid, signal.SIGKILL)
        sup.wait_event(event="worker.state", worker="p-0", new="backoff", after=mark)
    xid(tmp_path, 0, 79)
    if down == "crashed":
        sup.wait_event(event="heal.action", action="quarantine", after=mark, timeout=20)
    else:
        sup.wait_event(event="heal.action", action="drain", worker="p-0", after=mark, timeout=20)
        sup.wait_event(event="worker.state", worker="p-0", new="draining", after=mark)
    begin_roll_out(sup, tmp_path, how, group)
    passed = sup.wait_event(event="supervisor.rollout_passed_over", after=mark, timeout=15)
    assert passed["worker"] == "p-0", passed
    done = "supervisor.reload_done" if how == "reload" else "supervisor.rolling_restart_done"
    sup.wait_event(event=done, after=mark, timeout=15)
    assert not sup.find(event="supervisor.rollout_halted", after=mark)
    assert sup.find(event="worker.state", worker="p-1", new="stopping", after=mark)
    assert sup.find(event="worker.state", worker="p-1", new="ready", after=mark)
    assert sup.wait_line("[p-1] ", endswith=f"ready on {UUID1}")
    with sup.api() as api:
        p0 = api.get("/api/v1/workers/p-0").json()
    assert p0["state"] == "backoff" and "waiting for a GPU" in p0["reason"], p0
    assert sup.stop() == 0


def test_a_reload_that_gives_a_waiting_worker_a_gpu_starts_it_at_once(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """`gpus = [1]` and GPU 1 lost: the worker waits (its next look in 30 s). A reload to
    `gpus = [0]` starts it now. Regression: it waited for its next look (up to a minute)
    while `reload --wait` said done."""
    restart = {"delay_s": 0, "stable_s": 0.1, "backoff_initial_s": 30}
    group: dict[str, Any] = {"name": "p", "command": sim("100"), "gpus": [1], "restart": restart}
    sup = supervisor(config(tmp_path, group))
    sup.ready("p-0")
    mark = sup.mark()
    set_gpu(tmp_path, 1, lost=1)
    sup.wait_event(event="worker.waiting_gpu", worker="p-0", after=mark, timeout=20)
    mark = sup.mark()
    sup.write_config(config(tmp_path, {**group, "gpus": [0]}))
    sup.signal(signal.SIGHUP)
    assert sup.wait_line("[p-0] ", endswith=f"ready on {UUID0}", timeout=10)
    assert sup.stop() == 0


@pytest.mark.parametrize("before", ["RuntimeError: ", "z" * 20_000 + " "], ids=["line", "long"])
def test_sticky_cuda_error_line_restarts_the_worker(
    supervisor: SupervisorFactory, tmp_path: Path, before: str
) -> None:
    """A sticky CUDA error in the worker's output restarts it (``log_pattern``), with the line
    as evidence. Regression (``long``): the patterns saw only a long line's first 16 KiB, so a
    worker that printed its sticky CUDA error at the end of one long line (a JSON log record
    holding the whole traceback) was never restarted. Now the line's end is matched too, and
    the evidence shows the part of the line where the match is."""
    error = "CUDA error: an illegal memory access was encountered"
    line = before + error
    sup = supervisor(
        config(tmp_path, {"name": "s", "command": sim("100", "--say-after", "0.2", line)})
    )
    sup.ready("s-0")
    action = sup.wait_event(event="heal.action", worker="s-0", timeout=20)
    assert (action["action"], action["reason"]) == ("restart", "log_pattern")
    doc = postmortem(sup, "log_pattern")
    shown = doc["evidence"]["log_line"]
    assert shown == line if len(line) <= 2000 else shown.endswith(error) and shown in line
    assert doc["evidence"]["pattern"] == "CUDA error: an illegal memory access"
    assert sup.stop() == 0


def test_max_unavailable_holds_when_several_workers_leak(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Three workers leak at once: they are restarted one at a time, each after the previous
    one is ready again, so the group never has more than one worker down."""
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "l",
                "replicas": 3,
                "gpus": [0],
                "command": sim("500", "--leak", "12"),
                # Longer than the spacing of the judgements (they are spread over the ticks),
                # so the next worker is found leaking while the first is still down.
                "drain_timeout_s": 1.5,
                "health": {
                    **FAST_LEAK,
                    "gpu_memory_limit_mb": 1500,
                    "on_leak": "drain",
                    "max_unavailable": 1,
                },
            },
        )
    )
    for w in ("l-0", "l-1", "l-2"):
        sup.ready(w)
    sup.wait_events(3, event="heal.action", reason="leak", timeout=60)
    sup.wait_event(event="heal.deferred")
    assert most_not_ready(sup.find(event="worker.state")) == 1
    assert sup.stop() == 0


def test_workers_ready_for_max_age_are_recycled_one_at_a_time(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """``max_age_s``: each worker is drained and restarted once it has been ready that long,
    one at a time (max_unavailable 1); a recycle is no death (no post-mortem, no failed
    start) and is counted under its reason."""
    sup = supervisor(
        config(
            tmp_path,
            {
                "name": "m",
                "replicas": 2,
                "command": sim("100"),
                "health": {"max_age_s": 1.5, "max_age_jitter_s": 0.5},
            },
        )
    )
    first = {w: sup.ready(w)["pid"] for w in ("m-0", "m-1")}
    with sup.api() as http:
        due = http.get("/api/v1/workers/m-0").json()["recycle_in_s"]
        assert due is not None and 0 <= due <= 2.0
    for w in ("m-0", "m-1"):
        action = sup.wait_event(event="heal.action", worker=w, reason="max_age", timeout=20)
        assert action["action"] == "drain" and action["level"] == "info"
        assert 1.5 <= action["evidence"]["due_after_s"] <= 2.0
        assert action["evidence"]["ready_for_s"] >= action["evidence"]["due_after_s"]
        exited = sup.wait_event(event="worker.exited", worker=w, pid=first[w])
        assert (exited["reason"], exited["failure"]) == ("max_age", False)
        sup.wait_event(
            event="worker.state", worker=w, new="ready", pid=lambda p: p not in first.values()
        )
    assert most_not_ready(sup.find(event="worker.state")) <= 1
    with sup.api() as http:
        text = http.get("/metrics").text
    counted = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for w in ("m-0", "m-1"):
        labels = (("group", "m"), ("reason", "max_age"), ("worker", w))
        assert counted[("gpu_supervisor_worker_restarts_total", labels)] >= 1
    drains = (("action", "drain"), ("reason", "max_age"))
    assert counted[("gpu_supervisor_actions_total", drains)] >= 2
    assert sup.stop() == 0
    assert not sup.find(event="records.postmortem")


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list[dict[str, Any]]
    got: threading.Event

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        type(self).got.set()
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[type[_Hook]]:
    hook = type("Hook", (_Hook,), {"received": [], "got": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hook.url = f"http://127.0.0.1:{server.server_address[1]}/hook"  # type: ignore[attr-defined]
    try:
        yield hook
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_webhook_receives_the_action(
    supervisor: SupervisorFactory, tmp_path: Path, webhook: type[_Hook]
) -> None:
    cfg = config(
        tmp_path,
        {"name": "big", "command": sim("3000"), "health": {"gpu_memory_limit_mb": 2000}},
    )
    cfg["alerts"] = {"webhook_url": webhook.url}  # type: ignore[attr-defined]
    sup = supervisor(cfg)
    sup.wait_event(event="heal.action", worker="big-0", timeout=20)
    assert webhook.got.wait(10)
    doc = webhook.received[0]
    assert doc["schema_version"] == 1
    assert (doc["kind"], doc["action"], doc["reason"]) == ("action", "restart", "gpu_memory_limit")
    assert (doc["worker"], doc["group"], doc["gpu"]) == ("big-0", "big", None)
    assert doc["evidence"]["limit_mb"] == 2000
    assert doc["at"].endswith("Z")
    assert sup.stop() == 0


def test_a_worker_waiting_for_a_gpu_is_alerted_once(
    supervisor: SupervisorFactory, tmp_path: Path, webhook: type[_Hook]
) -> None:
    """A worker that finds no GPU to start on waits for one: the webhook hears of it once,
    with the reason placement gave."""
    cfg = config(
        tmp_path,
        {"name": "w", "replicas": 2, "max_workers_per_gpu": 1, "command": sim("100")},
        sim_devices=1,
    )
    cfg["alerts"] = {"webhook_url": webhook.url}  # type: ignore[attr-defined]
    sup = supervisor(cfg)
    sup.ready("w-0")
    sup.wait_event(event="worker.waiting_gpu", worker="w-1")
    assert webhook.got.wait(10)
    doc = webhook.received[0]
    assert (doc["kind"], doc["action"], doc["reason"]) == ("alert", None, "no_gpu")
    assert doc["worker"] == "w-1" and doc["message"].startswith("w-1 is waiting for a GPU: ")
    assert "max_workers_per_gpu" in doc["evidence"]["why"]
    assert sup.stop() == 0
    assert len(webhook.received) == 1


def test_a_webhook_url_set_by_a_reload_is_used(
    supervisor: SupervisorFactory, tmp_path: Path, webhook: type[_Hook]
) -> None:
    """No webhook at start; a reload sets one (and a budget the worker is over): the action
    the budget causes reaches it."""
    cfg = config(tmp_path, {"name": "big", "command": sim("3000")})
    sup = supervisor(cfg)
    sup.ready("big-0")
    cfg = config(
        tmp_path,
        {"name": "big", "command": sim("3000"), "health": {"gpu_memory_limit_mb": 2000}},
    )
    cfg["alerts"] = {"webhook_url": webhook.url}  # type: ignore[attr-defined]
    sup.write_config(cfg)
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="heal.action", worker="big-0", reason="gpu_memory_limit", timeout=20)
    assert webhook.got.wait(10)
    assert webhook.received[0]["reason"] == "gpu_memory_limit"
    assert sup.stop() == 0


def test_a_webhook_set_by_a_reload_with_an_unusable_proxy_in_the_environment_keeps_running(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: with a proxy in the environment that httpx cannot use (``ALL_PROXY`` of
    a scheme it does not know, or ``socks5://`` without its extra installed), a reload that
    set a webhook URL raised out of the alerter's start: the supervisor crashed and took
    every worker down with it. Now it says so and delivers without the proxy."""
    cfg = config(tmp_path, {"name": "a", "command": sim("100")})
    sup = supervisor(cfg, env={"ALL_PROXY": "ftp://proxy.invalid:21"})
    pid = sup.ready("a-0")["pid"]
    mark = sup.mark()
    cfg["alerts"] = {"webhook_url": "http://127.0.0.1:9/hook"}
    sup.write_config(cfg)
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="alerts.proxy_unusable", after=mark)
    sup.wait_event(event="supervisor.reload_done", after=mark)
    assert sup.proc.poll() is None and psutil.Process(pid).is_running()
    assert sup.stop() == 0


def test_an_operator_cordon_outlives_the_heat_cordon(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """on_thermal = cordon: a hot GPU is cordoned and uncordoned when it cools, unless the
    operator cordoned it too meanwhile: then it stays cordoned."""
    sup = supervisor(
        config(tmp_path, {"name": "c", "command": sim("100"), "health": {"on_thermal": "cordon"}})
    )
    sup.ready("c-0")
    set_gpu(tmp_path, 0, clocks_event_reasons=0x20)
    sup.wait_event(event="heal.action", action="cordon", gpu=UUID0, timeout=20)
    with sup.api() as api:
        assert api.post("/api/v1/gpus/0/cordon").status_code == 200
        set_gpu(tmp_path, 0, clocks_event_reasons=0)
        # the sample that finds it cool also takes (or not) the uncordon: no later look needed
        cool = sup.wait_api("/api/v1/gpu/status", lambda s: not s["devices"][0]["hot"])
        assert cool["devices"][0]["cordoned"] is True
    assert not sup.find(event="heal.action", action="uncordon")
    # and it is the operator's now, kept across a restart (regression: not written, as the GPU
    # was cordoned already)
    assert (sup.state_dir / "cordons").read_text() == f"{UUID0}\n"
    # said as the operator's cordon it is (regression: nothing in the log, the journal or
    # actions_total, the GPU being cordoned already, for heat)
    assert sup.find(event="gpu.cordon", gpu=UUID0, reason="operator")
    with sup.api() as api:
        events = api.get("/api/v1/events").json()
        metrics = api.get("/metrics").text
    assert [e for e in events if e["type"] == "gpu.cordon" and e["gpu"] == UUID0]
    assert 'gpu_supervisor_actions_total{action="cordon",reason="operator"} 1.0' in metrics
    assert sup.stop() == 0


@pytest.mark.parametrize("how", ["rolling-restart", "reload"])
def test_a_recycle_never_halts_a_roll_out_of_its_group(
    supervisor: SupervisorFactory, tmp_path: Path, how: str
) -> None:
    """``max_age_s`` 0.5 and ``stable_s`` 1.5: a roll-out goes on once the worker it replaced
    has been ready for 1.5 s. The recycles wait for the roll-out (it replaces every worker anyway),
    which completes; they go on after it. Regression: the replaced worker was due 0.5 s after its
    new readiness and recycled while the roll-out held for it: "replaced worker did not stay
    ready for stable_s" halted the roll-out (a reload's: the rest kept the old config) every
    time a roll-out took longer than max_age_s."""
    group: dict[str, Any] = {
        "name": "m",
        "replicas": 2,
        "command": sim("100"),
        "restart": {"delay_s": 0, "stable_s": 1.5},
        "health": {"max_age_s": 0.5},
    }
    sup = supervisor(config(tmp_path, group))
    sup.ready("m-0")
    sup.ready("m-1")
    mark = sup.mark()
    begin_roll_out(sup, tmp_path, how, group)
    rolled_out(sup, how, mark, timeout=40)
    sup.wait_event(event="heal.action", reason="max_age", after=mark, timeout=20)
    assert most_not_ready(sup.find(event="worker.state", after=mark)) <= 1
    assert sup.stop() == 0


UUID2 = "GPU-00000000-0000-0000-0000-000000000002"


def test_a_worker_on_two_gpus_migrates_off_its_hot_one(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A tensor-parallel worker (gpus_per_worker = 2) with 30000 MiB on each of GPUs 0 and 1;
    GPU 0 turns hot; GPU 1 has 21920 MiB free besides the worker's, GPU 2 41920: the worker
    moves to GPUs 1 and 2. Regressions: each target GPU had to have the 60000 MiB it held on
    its two GPUs together free, and GPU 1 its 30000 free besides what it held there itself, so
    it never moved ("no cooler GPU has room")."""
    group = {
        "name": "tp",
        "gpus_per_worker": 2,
        "command": sim("30000"),
        "health": {"on_thermal": "migrate"},
    }
    sup = supervisor(config(tmp_path, group, sim_devices=3))
    assert sup.wait_line("[tp-0] ", endswith=f"ready on {UUID0},{UUID1}")
    set_gpu(tmp_path, 1, memory_base_mib=30000)
    set_gpu(tmp_path, 2, memory_base_mib=40000)
    sup.wait_api(
        "/api/v1/workers/tp-0", lambda w: w["gpu_memory_by_gpu"] == {UUID0: 30000, UUID1: 30000}
    )
    sup.wait_api("/api/v1/gpu/status", lambda s: s["devices"][2]["memory"]["free_mb"] < 42000)
    mark = sup.mark()
    set_gpu(tmp_path, 0, temperature_c=86, temperature_slowdown_c=87)
    action = sup.wait_event(event="heal.action", reason="thermal", worker="tp-0", after=mark)
    assert action["action"] == "migrate", action
    moved = sup.wait_event(event="worker.moved", worker="tp-0", after=mark)
    assert sorted(moved["new_gpus"]) == [UUID1, UUID2]
    sup.ready("tp-0", after=mark)
    assert sup.stop() == 0


@pytest.mark.parametrize("fault", ["xid_79", "hot", "lost"])
@pytest.mark.parametrize("how", ["rolling-restart", "reload"])
def test_a_roll_out_waits_for_a_replaced_worker_healing_moves_off_its_gpu(
    supervisor: SupervisorFactory, tmp_path: Path, how: str, fault: str
) -> None:
    """A roll-out has replaced g-0 and holds for its ``stable_s`` when g-0's GPU fails (XID
    79, lost) or turns hot (``on_thermal = "migrate"``): healing moves g-0 to another GPU, the
    roll-out waits for it to be ready there, then goes on to g-1 and completes. Regression:
    it halted at once ("replaced worker did not stay ready for stable_s"; a reload's rest kept
    the old config), blaming the definition for its GPU's fault."""
    group: dict[str, Any] = {
        "name": "g",
        "replicas": 2,
        "command": sim("100"),
        "restart": {"delay_s": 0, "stable_s": 1},
        "health": {"on_thermal": "migrate"},
    }
    sup = supervisor(config(tmp_path, group, sim_devices=3))
    sup.ready("g-0")
    sup.ready("g-1")
    mark = sup.mark()
    if how == "reload":
        sup.write_config(config(tmp_path, {**group, "env": {"V": "2"}}, sim_devices=3))
        sup.signal(signal.SIGHUP)
    else:
        with sup.api() as api:
            assert api.post("/api/v1/groups/g/rolling-restart").status_code == 202
    sup.ready("g-0", after=mark)
    with sup.api() as api:
        (gpu,) = api.get("/api/v1/workers/g-0").json()["gpus"]
    if fault == "xid_79":
        xid(tmp_path, int(gpu[-1]), 79)
    elif fault == "hot":
        set_gpu(tmp_path, int(gpu[-1]), temperature_c=86, temperature_slowdown_c=87)
    else:
        set_gpu(tmp_path, int(gpu[-1]), lost=1)
    moved = sup.wait_event(event="worker.moved", worker="g-0", after=mark, timeout=20)
    assert gpu not in moved["new_gpus"], moved
    rolled_out(sup, how, mark, timeout=20)
    assert sup.find(event="worker.state", worker="g-1", new="stopping", after=mark)
    with sup.api() as api:
        events = api.get("/api/v1/events").json()
        workers = {w["name"]: w for w in api.get("/api/v1/workers").json()}
    assert [e["type"] for e in events if e["type"].startswith("rollout.")][-1] == "rollout.done"
    assert workers["g-0"]["gpus"] != [gpu] and workers["g-1"]["gpus"] != [gpu], workers
    assert sup.stop() == 0


@pytest.mark.parametrize("case", ["shared", "shared-twice", "alone"])
def test_a_roll_out_blames_a_new_replica_only_for_a_worker_fatal_xid_that_was_its_own(
    supervisor: SupervisorFactory, tmp_path: Path, case: str
) -> None:
    """A rolling restart has replaced g-0 and holds for its ``stable_s`` when XID 13 (worker-
    fatal) comes from g-0's GPU. ``shared``: g-1 runs there too, NVML does not say whose the
    XID is: healing restarts g-0, the roll-out waits for it, proves it again and completes.
    Regression: it halted ("replaced worker did not stay ready for stable_s"), blaming the
    new definition for what may have been the other process's XID. ``shared-twice``: a
    second one in its new stable window: the definition's (halted). ``alone``: g-0 is the
    only process on its GPU, the XID is its own: halted at once, as before."""
    group: dict[str, Any] = {
        "name": "g",
        "replicas": 2,
        "command": sim("100"),
        "restart": {"delay_s": 0, "stable_s": 1.5},
    }
    if case == "alone":
        group["max_workers_per_gpu"] = 1
    sup = supervisor(config(tmp_path, group, sim_devices=1 if case != "alone" else 2))
    sup.ready("g-0")
    sup.ready("g-1")
    mark = sup.mark()
    begin_roll_out(sup, tmp_path, "rolling-restart", group)
    sup.ready("g-0", after=mark)
    with sup.api() as api:
        (gpu,) = api.get("/api/v1/workers/g-0").json()["gpus"]
    again = sup.mark()
    xid(tmp_path, int(gpu[-1]), 13)
    action = sup.wait_event(event="heal.action", reason="xid", worker="g-0", after=again)
    assert action["action"] == "restart", action
    if case == "shared-twice":
        back = sup.mark()
        sup.ready("g-0", after=back)
        xid(tmp_path, 0, 13)
        sup.wait_event(event="heal.action", reason="xid", worker="g-0", after=back)
    if case == "shared":
        rolled_out(sup, "rolling-restart", mark, timeout=20)
        assert sup.find(event="worker.state", worker="g-1", new="stopping", after=mark)
    else:
        halted = sup.wait_event(event="supervisor.rollout_halted", after=mark, timeout=20)
        assert halted["worker"] == "g-0" and "did not stay ready" in halted["reason"], halted
    pm = postmortem(sup, "xid")
    assert pm["evidence"]["only_worker_on_gpu"] is (case == "alone"), pm["evidence"]
    assert sup.stop() == 0


@pytest.mark.parametrize("how", ["rolling-restart", "reload"])
def test_a_roll_out_waits_again_for_a_new_replica_restarted_for_a_shared_xid_while_it_loads(
    supervisor: SupervisorFactory, tmp_path: Path, how: str
) -> None:
    """A roll-out replaces g-0 (loading) on the GPU it shares with g-1 when XID 13
    comes from that GPU: healing restarts g-0, whose XID it may not be. The roll-out waits for
    it to load again, and completes. Regression: it halted ("did not become ready"; a reload's
    g-1 kept the old config)."""
    # a start loads for 0.5 s once `hold` is gone: the roll-out's g-0 loads until the XID is
    # acted on, however late (regression, flaky: a load of 1 s could be over before the XID
    # was seen on a loaded machine: a ready g-0, restarted, another path)
    hold = tmp_path / "hold"
    group: dict[str, Any] = {
        "name": "g",
        "replicas": 2,
        "command": worker_cmd("notify_ready_late", "0.5", "--hold", str(hold)),
        "restart": {"delay_s": 0, "stable_s": 0.3},
    }
    sup = supervisor(config(tmp_path, group, sim_devices=1))
    sup.ready("g-0")
    sup.ready("g-1")
    mark = sup.mark()
    hold.touch()
    begin_roll_out(sup, tmp_path, how, group)
    sup.wait_event(event="worker.spawned", worker="g-0", after=mark)
    xid(tmp_path, 0, 13)
    sup.wait_event(event="heal.action", reason="xid", worker="g-0", after=mark)
    assert not sup.find(event="worker.state", worker="g-0", new="ready", after=mark)
    hold.unlink()
    rolled_out(sup, how, mark, timeout=20)
    assert sup.find(event="worker.state", worker="g-1", new="stopping", after=mark)
    assert sup.stop() == 0


@pytest.mark.parametrize("how", ["rolling-restart", "reload"])
def test_a_roll_out_passes_over_a_replaced_worker_whose_gpu_fails_while_it_loads(
    supervisor: SupervisorFactory, tmp_path: Path, how: str
) -> None:
    """A roll-out replaces p-0 (one worker a GPU, p-1 on GPU 1); XID 79 on GPU 0 while the
    new p-0 loads: healing drains it and it waits for a GPU. The roll-out passes over it, as
    one that was down already when reached is, rolls p-1 and completes. Regression: it halted
    at p-0 ("did not become ready"; a reload's p-1 kept the old config), blaming the
    definition for its GPU's fault."""
    group: dict[str, Any] = {
        "name": "p",
        "replicas": 2,
        "max_workers_per_gpu": 1,
        "command": worker_cmd("notify_ready_late", "1"),
        "restart": {"delay_s": 0, "stable_s": 0.2},
    }
    sup = supervisor(config(tmp_path, group))
    sup.ready("p-0")
    sup.ready("p-1")
    mark = sup.mark()
    begin_roll_out(sup, tmp_path, how, group)
    sup.wait_event(event="worker.spawned", worker="p-0", after=mark)
    xid(tmp_path, 0, 79)
    sup.wait_event(event="worker.waiting_gpu", worker="p-0", after=mark, timeout=20)
    rolled_out(sup, how, mark, timeout=20)
    passed = sup.find(event="supervisor.rollout_passed_over", after=mark)
    assert [e["worker"] for e in passed] == ["p-0"], passed
    assert sup.find(event="worker.state", worker="p-1", new="stopping", after=mark)
    with sup.api() as api:
        p0 = api.get("/api/v1/workers/p-0").json()
        p1 = api.get("/api/v1/workers/p-1").json()
    assert p0["state"] == "backoff" and "waiting for a GPU" in p0["reason"], p0
    assert (p1["state"], p1["gpus"]) == ("ready", [UUID1]), p1
    assert sup.stop() == 0


@pytest.mark.parametrize(
    "change",
    [{"gpus": [0]}, {"gpus": [0, 1], "gpus_per_worker": 2}],
    ids=["list", "two-gpus"],
)
def test_a_reload_listing_a_quarantined_gpu_is_rejected_and_keeps_the_group_serving(
    supervisor: SupervisorFactory, tmp_path: Path, change: dict[str, Any]
) -> None:
    """XID 79 quarantines GPU 0 and g-0 moves to GPU 1; a reload then lists GPU 0 for the
    group: rejected ("placement", as a reload whose automatic placement does not fit the
    GPUs of the moment is), g-0 serves on on GPU 1. Regression: accepted, g-0 was taken down
    and waited for GPU 0 until the quarantine was lifted (the group served nothing), while the
    halted roll-out said the old config was in force."""
    group: dict[str, Any] = {"name": "g", "command": sim("100")}
    sup = supervisor(config(tmp_path, group))
    sup.ready("g-0")
    mark = sup.mark()
    xid(tmp_path, 0, 79)
    sup.wait_event(event="heal.action", action="quarantine", after=mark, timeout=20)
    pid = sup.ready("g-0", after=mark)["pid"]
    rejected = sup.reload_rejected(config(tmp_path, {**group, **change}))
    assert rejected["reason"] == "placement", rejected
    assert "GPU 0 is quarantined" in rejected["error"], rejected
    with sup.api() as api:
        g0 = api.get("/api/v1/workers/g-0").json()
        events = api.get("/api/v1/events").json()
    assert (g0["state"], g0["pid"], g0["gpus"]) == ("ready", pid, [UUID1]), g0
    assert events[-1]["type"] == "reload.rejected", events[-1]
    assert sup.stop() == 0


@pytest.mark.parametrize(
    "flag", [{"recovery_action": 1}, {"remapped_rows_failure": 1}], ids=["recovery", "row_remap"]
)
def test_a_lift_of_a_quarantine_outlives_a_restart_while_the_gpus_flag_stays_on(
    supervisor: SupervisorFactory, tmp_path: Path, flag: dict[str, int]
) -> None:
    """GPU 0 is quarantined for a flag that stays on (the driver's recovery action, a failed
    row remap); the operator lifts the quarantine to use it anyway (the lift holds while
    the flag stays on), then the supervisor is restarted. Regression: the next supervisor
    found the flag on at its first sample and quarantined GPU 0 again, its workers drained
    off it: an operator's lift was undone by every restart."""
    cfg = config(tmp_path, {"name": "g", "command": sim("100")})
    sup = supervisor(cfg)
    sup.ready("g-0")
    mark = sup.mark()
    set_gpu(tmp_path, 0, **flag)
    sup.wait_event(event="heal.action", action="quarantine", gpu=UUID0, after=mark)
    with sup.api() as api:
        lifted = api.post("/api/v1/gpus/0/uncordon", params={"lift_quarantine": "true"})
        assert lifted.json()["quarantined"] is False, lifted.text
    assert sup.stop() == 0

    again = supervisor(cfg)
    again.ready("g-0")
    first = again.wait_api("/api/v1/gpu/status", lambda doc: doc["nvml_available"])
    # samples after the one g-0 became ready with (a quarantine would be acted on there)
    gpu0 = again.wait_api("/api/v1/gpu/status", lambda doc: doc["timestamp"] > first["timestamp"])[
        "devices"
    ][0]
    assert not again.find(event="heal.action", action="quarantine"), gpu0
    assert gpu0["quarantined"] is False and gpu0["healthy"] is True, gpu0
    with again.api() as api:
        assert api.get("/api/v1/workers/g-0").json()["gpus"] == [UUID0]
    saved = json.loads((again.state_dir / "quarantine").read_text())
    assert (saved["gpus"], list(saved["lifted"])) == ({}, [UUID0]), saved
    set_gpu(tmp_path, 0, **dict.fromkeys(flag, 0))  # reset: the lift is over, and so the file
    again.wait_until(lambda: not (again.state_dir / "quarantine").exists(), "the file removed")
    assert again.stop() == 0


def test_a_worker_a_roll_out_has_not_reached_keeps_its_definition_when_healing_moves_it(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A reload rolls a failing definition (a worker that never becomes ready) onto ``m``;
    while the new m-0 loads, XID 79 on m-1's GPU moves m-1 to another GPU. Regression
    (bench/chaos.py --mix rollout): m-1 was planned again on its new GPU from the definition
    in force, the one being rolled out: it started on the failing definition, outside the
    roll-out (which then halted at m-0, "the rest keep the old config"), and the group had
    no worker left serving. A worker healing moves keeps the definition it runs."""
    group: dict[str, Any] = {
        "name": "m",
        "replicas": 2,
        "max_workers_per_gpu": 1,
        "command": sim("100"),
        "start_timeout_s": 3,
        "restart": {"delay_s": 0, "stable_s": 0.5},
    }
    sup = supervisor(config(tmp_path, group, sim_devices=3))
    sup.ready("m-0")
    sup.ready("m-1")
    with sup.api() as api:
        (gpu,) = api.get("/api/v1/workers/m-1").json()["gpus"]
    mark = sup.mark()
    failing = {**group, "command": worker_cmd("never_ready")}
    sup.write_config(config(tmp_path, failing, sim_devices=3))
    sup.signal(signal.SIGHUP)
    new_m0 = sup.wait_event(event="worker.spawned", worker="m-0", after=mark)
    assert new_m0["argv"][1].endswith("never_ready.py")
    xid(tmp_path, int(gpu[-1]), 79)
    moved = sup.wait_event(event="worker.moved", worker="m-1", after=mark, timeout=20)
    assert gpu not in moved["new_gpus"], moved
    spawned = sup.wait_event(event="worker.spawned", worker="m-1", after=mark)
    assert spawned["argv"][1].endswith("sim_worker.py"), spawned["argv"]
    sup.ready("m-1", after=mark)
    done = sup.wait_event(event="supervisor.reload_done", after=mark, timeout=20)
    assert done["halted"] == ["m"], done
    assert sup.find(event="worker.state", worker="m-1", new="ready", after=mark)
    assert sup.stop() == 0


def test_workers_moved_together_onto_a_gpu_with_room_for_one_take_it_one(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: XID 79 on GPU 0 and GPU 1 at once quarantines both; g-0 and g-1 (one
    worker a GPU, max_workers_per_gpu 1) are drained off them and their restarts wait for
    the same sample to see their old processes' memory let go. Each was then placed without
    seeing the other's choice (made, not yet started): both started on GPU 2, two workers on
    a GPU meant for one. One starts there; the other waits for a GPU."""
    group: dict[str, Any] = {
        "name": "g",
        "replicas": 2,
        "max_workers_per_gpu": 1,
        "command": sim("100"),
    }
    sup = supervisor(config(tmp_path, group, sim_devices=3))
    sup.ready("g-0")
    sup.ready("g-1")
    with sup.api() as api:
        on = {w: api.get(f"/api/v1/workers/{w}").json()["gpus"] for w in ("g-0", "g-1")}
    assert sorted(on.values()) == [[UUID0], [UUID1]], on
    mark = sup.mark()
    with open(tmp_path / "sim" / "events", "a") as fh:
        fh.write("0 79\n1 79\n")

    def settled() -> bool:
        spawned = {e["worker"] for e in sup.find(event="worker.spawned", after=mark)}
        waiting = {e["worker"] for e in sup.find(event="worker.waiting_gpu", after=mark)}
        return len(spawned) == 2 or (len(spawned) == 1 and len(waiting) == 1)

    sup.wait_until(settled, "one worker started on GPU 2, the other waiting", timeout=10)
    spawned = sup.find(event="worker.spawned", after=mark)
    assert len(spawned) == 1, spawned
    assert sup.stop() == 0
