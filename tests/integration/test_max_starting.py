"""``[supervisor] max_starting``: at most that many workers starting (spawned, not yet ready) at
once; the others wait their turn, first come first, and are spawned after it (their
``start_timeout_s`` runs from then). Counted from the supervisor's own events."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from tests.conftest import SupervisorFactory
from tests.harness import Supervisor, crash_into_barrier, stuck_holder, wait_dead, worker_cmd


def most_starting_at_once(sup: Supervisor) -> int:
    """The most workers that were spawned and not yet ready (nor gone) at any one time."""
    starting: set[str] = set()
    most = 0
    for e in sup.events:
        if e.get("event") == "worker.spawned":
            starting.add(e["worker"])
        elif e.get("event") == "worker.state" and e.get("new") != "starting":
            starting.discard(e["worker"])
        most = max(most, len(starting))
    return most


def test_workers_start_two_at_a_time_in_their_turn(supervisor: SupervisorFactory) -> None:
    # loads of 0.4, 1.4, 2.4 s by index: turns free up one at a time, so the spawns of those
    # that waited come in the order their turns were given (two freed in the same instant let
    # two go at once, and their spawns may come in either order)
    late = worker_cmd("notify_ready_late", "{index}.4")
    sup = supervisor(
        {
            "supervisor": {"max_starting": 2},
            "workers": [
                {"name": "a", "replicas": 3, "command": late, "stop_timeout_s": 2},
                {"name": "b", "replicas": 2, "command": late, "stop_timeout_s": 2},
            ],
        }
    )
    for name in ("a-0", "a-1", "a-2", "b-0", "b-1"):
        sup.ready(name, timeout=30)
    assert most_starting_at_once(sup) == 2
    waits = sup.find(event="worker.waiting_start")
    assert len(waits) == 3  # two started at once, three waited their turn
    for e in waits:
        assert e["max_starting"] == 2 and len(e["starting"]) == 2
    # first come, first served: those that waited were spawned in the order they came
    spawned = [e["worker"] for e in sup.find(event="worker.spawned")]
    queued = [e["worker"] for e in waits]
    assert [w for w in spawned if w in queued] == queued
    assert [e["ahead"] for e in waits] == [0, 1, 2]
    assert sup.stop() == 0


def test_a_worker_that_never_gets_ready_holds_its_turn_only_until_its_start_timeout(
    supervisor: SupervisorFactory,
) -> None:
    group: dict[str, Any] = {"stop_timeout_s": 2, "restart": {"backoff_initial_s": 30}}
    sup = supervisor(
        {
            "supervisor": {"max_starting": 1},
            "workers": [
                {"name": "n", "command": worker_cmd("never_ready"), "start_timeout_s": 1, **group},
                {"name": "r", "command": worker_cmd("ready_then_sleep"), **group},
            ],
        }
    )
    sup.ready("r-0", timeout=20)
    # r-0 went once n-0's start timed out (it is stopped: no longer loading), not before
    timed_out = sup.find(event="worker.state", worker="n-0", old="starting")
    assert timed_out and timed_out[0]["reason"] == "start_timeout"
    assert sup.events.index(timed_out[0]) < sup.events.index(
        sup.find(event="worker.spawned", worker="r-0")[0]
    )
    assert most_starting_at_once(sup) == 1
    assert sup.stop() == 0


def test_a_reload_that_raises_max_starting_lets_the_next_ones_go(
    supervisor: SupervisorFactory,
) -> None:
    slow = worker_cmd("notify_ready_late", "600")
    config: dict[str, Any] = {
        "supervisor": {"max_starting": 1},
        "workers": [{"name": "s", "replicas": 3, "command": slow, "stop_timeout_s": 2}],
    }
    sup = supervisor(config)
    sup.wait_event(event="worker.waiting_start", worker="s-2")
    assert [e["worker"] for e in sup.find(event="worker.spawned")] == ["s-0"]
    with sup.api() as api:  # told apart from a start under way
        waiting = api.get("/api/v1/workers/s-2").json()
        assert (waiting["state"], waiting["pid"]) == ("starting", None)
        assert waiting["reason"] == "waiting its turn to start (max_starting = 1, 1 ahead)"
        refused = api.post("/api/v1/workers/s-2/restart")  # nothing to restart: it starts
        assert refused.status_code == 409
        assert refused.json() == {
            "error": "cannot restart s-2: worker has no process yet: it is about to start"
        }
    mark = sup.mark()
    sup.write_config({**config, "supervisor": {"max_starting": 3}})
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="worker.spawned", worker="s-1", after=mark)
    sup.wait_event(event="worker.spawned", worker="s-2", after=mark)
    assert sup.stop() == 0


def test_a_roll_out_waits_for_a_worker_in_line_without_its_start_timeout_running(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    # fast's roll-out gives a worker about 8 s (drain, stop, a kill's wait, its 2.5 s start
    # timeout), less than slow's 9.5 s load at its restart: a reload rolling fast out while its
    # workers wait behind slow must not halt on them (they are not spawned yet). (2.5 s, not
    # 1: a Python start took over 1 s on a loaded machine, and the roll-out halted on a fast
    # worker that was spawned, out of line, but slow to start.)
    loads = tmp_path / "loads"  # once it exists, slow loads for 9.5 s
    py, script = worker_cmd("notify_ready_late")
    slow = ["sh", "-c", f'if [ -e {loads} ]; then t=9.5; else t=0.1; fi; exec {py} {script} "$t"']
    fast = worker_cmd("notify_ready_late", "0.2")
    quick = {
        "start_timeout_s": 2.5,
        "stop_timeout_s": 0.3,
        "drain_timeout_s": 0.2,
        "restart": {"stable_s": 0.1, "backoff_initial_s": 0.5, "backoff_max_s": 1},
    }
    config: dict[str, Any] = {
        "supervisor": {"max_starting": 1},
        "workers": [
            {"name": "slow", "command": slow, "stop_timeout_s": 1},
            {"name": "fast", "replicas": 2, "command": fast, **quick},
        ],
    }
    sup = supervisor(config)
    for name in ("slow-0", "fast-0", "fast-1"):
        sup.ready(name, timeout=30)
    loads.touch()
    mark = sup.mark()
    with sup.api() as api:
        assert api.post("/api/v1/workers/slow-0/restart").status_code == 202
    sup.wait_event(event="worker.spawned", worker="slow-0", after=mark)
    changed = [*fast, "--changed"]
    sup.write_config(
        {**config, "workers": [config["workers"][0], {**config["workers"][1], "command": changed}]}
    )
    sup.signal(signal.SIGHUP)
    done = sup.wait_event(event="supervisor.reload_done", after=mark, timeout=60)
    assert done["halted"] == []
    for name in ("fast-0", "fast-1"):
        spawned = sup.find(event="worker.spawned", worker=name, after=mark)
        assert spawned and spawned[-1]["argv"] == changed
    assert sup.stop() == 0


def test_a_worker_held_at_the_gpu_release_barrier_does_not_hold_a_turn(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """b-0's restart waits at the GPU-release barrier (a process of its old tree, stuck in the
    kernel, still holds memory on its GPU): it is loading nothing, so c-0, which crashes
    meanwhile, starts at once. Regression: b-0 took the only turn before the barrier, and c-0
    waited up to ``release_timeout_s`` and then for b-0's whole load."""
    quick = {"log_passthrough": True, "stop_timeout_s": 2, "restart": {"stable_s": 0.1}}
    sup = supervisor(
        {
            "supervisor": {"max_starting": 1, "sample_interval_s": 0.1},
            "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim"), "release_timeout_s": 30},
            "workers": [
                {"name": "b", "command": worker_cmd("gpu_user", "100", "--holder", "60"), **quick},
                {"name": "c", "command": worker_cmd("gpu_user", "100"), **quick},
            ],
        },
        log_level="debug",
    )
    leader = sup.ready("b-0")["pid"]
    crashing = sup.ready("c-0")["pid"]
    with stuck_holder(sup, "b-0", tmp_path) as holder:
        mark = sup.mark()
        crash_into_barrier(sup, "b-0", leader, mark)
        os.kill(crashing, signal.SIGKILL)
        sup.ready("c-0", after=mark)
        # b-0 is still at the barrier: not spawned again, nor given up on it
        assert not sup.find(event="worker.spawned", worker="b-0", after=mark)
        assert not sup.find(event="gpu.suspect")
    assert not sup.find(event="worker.waiting_start", worker="c-0", after=mark)
    assert wait_dead([holder]) == []
    sup.ready("b-0", after=mark)
    assert sup.stop() == 0


def test_a_worker_stopped_while_in_line_is_not_placed_again(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """b-0 waits its turn to restart (a-0 is loading) and its GPU is cordoned: an operator
    stops it meanwhile. Nothing starts, so nothing is placed: no `worker.moved` to another
    GPU for a start that never comes. Regression (found in review): it was moved all the
    same once it left the line."""
    slow = tmp_path / "slow"  # once it exists, a start of a-0 loads for 60 s
    py, script = worker_cmd("notify_ready_late")
    load = f'if [ -e {slow} ]; then t=60; else t=0.1; fi; exec {py} {script} "$t"'
    quick = {"stop_timeout_s": 2, "restart": {"stable_s": 0.1}}
    sup = supervisor(
        {
            "supervisor": {"max_starting": 1, "sample_interval_s": 0.1},
            "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim")},
            "workers": [
                {"name": "a", "command": ["sh", "-c", load], **quick},
                {"name": "b", "command": worker_cmd("gpu_user", "100"), **quick},
            ],
        }
    )
    sup.ready("a-0")
    sup.ready("b-0")
    slow.touch()
    mark = sup.mark()
    with sup.api() as api:
        assert api.post("/api/v1/workers/a-0/restart").status_code == 202
        sup.wait_event(event="worker.spawned", worker="a-0", after=mark)
        gpu = api.get("/api/v1/workers/b-0").json()["gpus"][0]
        assert api.post(f"/api/v1/gpus/{gpu}/cordon").status_code == 200
        assert api.post("/api/v1/workers/b-0/restart").status_code == 202
        sup.wait_event(event="worker.waiting_start", worker="b-0", after=mark)
        assert api.post("/api/v1/workers/b-0/stop").status_code == 202
        sup.wait_event(event="worker.state", worker="b-0", new="stopped", after=mark)
    assert sup.stop() == 0  # (b-0 has left the line by then, at the latest)
    assert not sup.find(event="worker.moved", worker="b-0", after=mark)
    assert not sup.find(event="worker.spawned", worker="b-0", after=mark)
