"""``[supervisor] max_starting``: at most that many workers starting (spawned, not yet ready) at
once; the others wait their turn, first come first, and are spawned after it (their
``start_timeout_s`` runs from then). Counted from the supervisor's own events."""

from __future__ import annotations

import signal
from typing import Any

from tests.conftest import SupervisorFactory
from tests.harness import Supervisor, worker_cmd


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
    late = worker_cmd("notify_ready_late", "0.4")
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
    waited = {e["worker"] for e in sup.find(event="worker.waiting_start")}
    assert waited == {"a-2", "b-0", "b-1"}
    first = sup.find(event="worker.waiting_start", worker="a-2")[0]
    assert (first["max_starting"], first["starting"], first["ahead"]) == (2, ["a-0", "a-1"], 0)
    # first come, first served: in config order
    spawned = [e["worker"] for e in sup.find(event="worker.spawned")]
    assert spawned == ["a-0", "a-1", "a-2", "b-0", "b-1"]
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
    mark = sup.mark()
    sup.write_config({**config, "supervisor": {"max_starting": 3}})
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="worker.spawned", worker="s-1", after=mark)
    sup.wait_event(event="worker.spawned", worker="s-2", after=mark)
    assert sup.stop() == 0
