"""``[workers.health] liveness_url``: while a worker is ready the supervisor asks it every
``liveness_interval_s``; ``liveness_failures`` answers in a row that are no 2xx (an error
status, no answer in time) make it hung, restarted as a missing heartbeat is (reason ``hang``,
a post-mortem saying why). For HTTP servers that do not speak sd_notify and whose engine can
die behind a live HTTP front (its /health answers 500 while the process runs on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SupervisorFactory
from tests.harness import Supervisor, worker_cmd

URL = "http://127.0.0.1:{port}/health"


def web(tmp_path: Path, port: int, *flags: str, **health: Any) -> dict[str, Any]:
    return {
        "name": "web",
        "command": worker_cmd("http_ready", "0", *flags),
        "ready": URL,
        "port_base": port,
        "log_passthrough": True,
        "stop_timeout_s": 2,
        "restart": {"stable_s": 0.5},
        "health": health,
    }


def fast(**more: Any) -> dict[str, Any]:
    return {
        "liveness_url": URL,
        "liveness_interval_s": 0.2,
        "liveness_timeout_s": 0.5,
        "liveness_failures": 3,
        **more,
    }


def postmortem(sup: Supervisor, worker: str) -> dict[str, Any]:
    event = sup.wait_event(event="records.postmortem", worker=worker)
    doc: dict[str, Any] = json.loads(
        (sup.state_dir / "postmortems" / f"{event['id']}.json").read_text()
    )
    return doc


@pytest.mark.parametrize(("flag", "answer"), [("--sick-when", "HTTP 500"), ("--stall-when", "")])
def test_a_worker_whose_health_url_fails_is_restarted_as_hung(
    supervisor: SupervisorFactory, tmp_path: Path, flag: str, answer: str
) -> None:
    sick = tmp_path / "sick"
    sup = supervisor({"workers": [web(tmp_path, 18961, flag, str(sick), **fast())]})
    first = sup.ready("web-0")["pid"]
    mark = sup.mark()
    sick.touch()  # its engine died: /health says 500 (or nothing) while the process runs
    failed = sup.wait_event(event="worker.liveness_failed", worker="web-0", after=mark)
    sick.unlink()  # the next process is well
    assert failed["failures"] == 3 and failed["url"] == "http://127.0.0.1:18961/health"
    assert failed["last"] == (answer or "timed out after 0.5 s")
    probes = sup.find(event="worker.liveness_probe", worker="web-0", after=mark)
    assert [p["failed"] for p in probes] == [1, 2, 3]
    exited = sup.wait_event(event="worker.exited", worker="web-0", pid=first)
    assert (exited["reason"], exited["failure"]) == ("hang", False)  # it had served stable_s
    action = sup.wait_event(event="heal.action", worker="web-0", reason="hang", after=mark)
    assert action["action"] == "restart"
    assert action["message"].startswith("3 liveness probes in a row failed (")
    doc = postmortem(sup, "web-0")
    assert doc["reason"] == "hang"
    assert action["message"].startswith(doc["evidence"]["liveness_failed"])
    assert doc["evidence"]["liveness_failed"].endswith(f"last: {failed['last']})")
    assert doc["evidence"]["watchdog_trigger"] is False
    sup.ready("web-0", after=mark)
    assert sup.stop() == 0


def test_a_healthy_worker_is_only_asked(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """Probes that pass (and one failure among them, less than liveness_failures in a row)
    restart nothing; a worker that is not ready (loading) is not asked."""
    flaky = tmp_path / "flaky"
    sup = supervisor(
        {"workers": [web(tmp_path, 18962, "--sick-when", str(flaky), **fast(liveness_failures=2))]}
    )
    sup.ready("web-0")
    for _ in range(2):  # a failure, then one that passes: the next failure counts from 1
        mark = sup.mark()
        flaky.touch()
        sup.wait_event(event="worker.liveness_probe", worker="web-0", failed=1, after=mark)
        flaky.unlink()
        seen = len(sup.stdout)
        passed = sup.wait_line("[web-0] ", endswith="answered 200", after=seen)
        sup.wait_line("[web-0] ", endswith="answered 200", after=sup.stdout.index(passed, seen) + 1)
    assert not sup.find(event="worker.liveness_failed")
    assert len(sup.find(event="worker.spawned", worker="web-0")) == 1
    assert sup.stop() == 0


def test_a_reload_that_adds_a_liveness_url_applies_to_the_running_worker(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sick = tmp_path / "sick"
    cfg = {"workers": [web(tmp_path, 18963, "--sick-when", str(sick))]}
    sup = supervisor(cfg)
    first = sup.ready("web-0")["pid"]
    mark = sup.mark()
    sup.write_config({"workers": [web(tmp_path, 18963, "--sick-when", str(sick), **fast())]})
    with sup.api() as http:
        assert http.post("/api/v1/reload").status_code == 202
    sup.wait_event(event="supervisor.reload_done", after=mark, halted=[])
    assert not sup.find(event="worker.spawned", worker="web-0", after=mark)  # in place
    sick.touch()
    sup.wait_event(event="worker.liveness_failed", worker="web-0", pid=first, after=mark)
    sick.unlink()
    sup.ready("web-0", after=mark)
    assert sup.stop() == 0
