"""``[workers.health] liveness_url``: while a worker is ready the supervisor asks it every
``liveness_interval_s``; ``liveness_failures`` answers in a row that are no 2xx (an error
status, no answer in time) make it hung, restarted as a missing heartbeat is (reason ``hang``,
a post-mortem saying why). For HTTP servers that do not speak sd_notify and whose engine can
die behind a live HTTP front (its /health answers 500 while the process runs on)."""

from __future__ import annotations

import json
import shutil
import subprocess
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


# a port of its own for each case: cases of one test run side by side under xdist (one that
# found its port taken crashed, or was answered by the other case's server)
@pytest.mark.parametrize(
    ("flag", "answer", "port"),
    [("--sick-when", "HTTP 500", 18961), ("--stall-when", "", 18967)],
    ids=["--sick-when-HTTP 500", "--stall-when-"],  # (as they were named before the ports)
)
def test_a_worker_whose_health_url_fails_is_restarted_as_hung(
    supervisor: SupervisorFactory, tmp_path: Path, flag: str, answer: str, port: int
) -> None:
    sick = tmp_path / "sick"
    group = web(tmp_path, port, flag, str(sick), **fast())
    # its 3 failed probes (0.2 s apart, each asked while it is ready) take at least 0.4 s
    # from its ready: a stable_s under that makes it a stable run whatever the probes' phase
    # (0.5 s was missed when a probe fell just after the ready)
    group["restart"] = {"stable_s": 0.2}
    sup = supervisor({"workers": [group]})
    first = sup.ready("web-0")["pid"]
    mark = sup.mark()
    sick.touch()  # its engine died: /health says 500 (or nothing) while the process runs
    failed = sup.wait_event(event="worker.liveness_failed", worker="web-0", after=mark)
    sick.unlink()  # the next process is well
    assert failed["failures"] == 3 and failed["url"] == f"http://127.0.0.1:{port}/health"
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
    assert "silent_for_s" not in doc["evidence"]  # (a heartbeat's figure: none here)
    sup.ready("web-0", after=mark)
    assert sup.stop() == 0


def test_a_healthy_worker_is_only_asked(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """Probes that pass (and one failure among them, less than liveness_failures in a row)
    restart nothing; a worker that is not ready (loading) is not asked."""
    # the worker answers 500 once and removes the file itself (removed by the test once it
    # saw the failure, it could still be there at the next probe 0.2 s later on a loaded
    # machine: two failures in a row, a restart)
    flaky = tmp_path / "flaky"
    sup = supervisor(
        {"workers": [web(tmp_path, 18962, "--sick-once", str(flaky), **fast(liveness_failures=2))]}
    )
    sup.ready("web-0")
    url = "http://127.0.0.1:18962/health"
    with sup.api() as http:
        for _ in range(2):  # a failure, then one that passes: the next failure counts from 1
            mark = sup.mark()
            flaky.touch()
            sup.wait_event(event="worker.liveness_probe", worker="web-0", failed=1, after=mark)
            assert not flaky.exists()
            # the worker object says so until a probe passes
            live = http.get("/api/v1/workers/web-0").json()["liveness"]
            assert live in (
                {"url": url, "failed": 1, "of": 2, "last": "HTTP 500"},
                {"url": url, "failed": 0, "of": 2, "last": None},
            )
            seen = len(sup.stdout)
            passed = sup.wait_line("[web-0] ", endswith="answered 200", after=seen)
            again = sup.stdout.index(passed, seen) + 1
            sup.wait_line("[web-0] ", endswith="answered 200", after=again)
            live = http.get("/api/v1/workers/web-0").json()["liveness"]
            assert live == {"url": url, "failed": 0, "of": 2, "last": None}
    assert not sup.find(event="worker.liveness_failed")
    assert len(sup.find(event="worker.spawned", worker="web-0")) == 1
    assert sup.stop() == 0


def test_a_reload_mid_probe_judges_the_answer_by_the_new_settings(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A reload that raises liveness_failures while a probe is in flight (a slow /health: the
    operator loosens the check after a failure): the answer is judged by the new settings
    (regression: by the ones it was sent under, and the worker was restarted as hung)."""
    stall = tmp_path / "stall"
    slow = fast(liveness_timeout_s=3, liveness_failures=2)
    cfg = {"workers": [web(tmp_path, 18964, "--stall-when", str(stall), **slow)]}
    sup = supervisor(cfg)
    first = sup.ready("web-0")["pid"]
    mark = sup.mark()
    stall.touch()  # no answer: each probe takes liveness_timeout_s
    sup.wait_event(event="worker.liveness_probe", worker="web-0", failed=1, after=mark)
    # the next probe is in flight (3 s): loosen the check meanwhile
    looser = fast(liveness_timeout_s=3, liveness_failures=10)
    sup.write_config({"workers": [web(tmp_path, 18964, "--stall-when", str(stall), **looser)]})
    reload_mark = sup.mark()
    with sup.api() as http:
        assert http.post("/api/v1/reload").status_code == 202
    sup.wait_event(event="supervisor.reload_done", after=reload_mark, halted=[])
    second = sup.wait_event(event="worker.liveness_probe", worker="web-0", failed=2, after=mark)
    stall.unlink()
    assert second["of"] == 10
    assert not sup.find(event="worker.liveness_failed")
    assert sup.find(event="worker.state", worker="web-0", new="ready")[-1]["pid"] == first
    assert sup.stop() == 0


@pytest.mark.parametrize(
    ("before", "port"),
    [({}, 18963), ({**fast(), "liveness_interval_s": 600}, 18968)],  # a port each (see above)
    ids=["added", "interval_shortened"],
)
def test_a_reload_of_the_liveness_settings_applies_to_the_running_worker_at_once(
    supervisor: SupervisorFactory, tmp_path: Path, before: dict[str, Any], port: int
) -> None:
    """A reload that adds a liveness URL (or lowers its interval) applies to the process that
    runs, without a restart, and at once: the next probe is due by the new interval, not
    after the old one has run out (regression: a 10-minute interval lowered to 0.2 s was
    asked again 10 minutes later)."""
    sick = tmp_path / "sick"
    sup = supervisor({"workers": [web(tmp_path, port, "--sick-when", str(sick), **before)]})
    first = sup.ready("web-0")["pid"]
    mark = sup.mark()
    sup.write_config({"workers": [web(tmp_path, port, "--sick-when", str(sick), **fast())]})
    with sup.api() as http:
        assert http.post("/api/v1/reload").status_code == 202
    sup.wait_event(event="supervisor.reload_done", after=mark, halted=[])
    assert not sup.find(event="worker.spawned", worker="web-0", after=mark)  # in place
    sick.touch()
    sup.wait_event(event="worker.liveness_failed", worker="web-0", pid=first, after=mark)
    sick.unlink()
    sup.ready("web-0", after=mark)
    assert sup.stop() == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_an_https_url_whose_certificate_is_refused_restarts_nothing(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """A worker serving HTTPS with a self-signed certificate (ready by sd_notify or at once;
    an https ``ready`` URL would never pass, certificates being verified): its liveness URL
    cannot be asked, which a restart does not mend. Said once (``liveness_probe_failed``),
    not probed again (regression: every probe failed, CERTIFICATE_VERIFY_FAILED, and the
    healthy worker was restarted as hung every few probes, forever)."""
    files = ["-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")]
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            *files,
            "-subj",
            "/CN=localhost",
        ],
        check=True,
        capture_output=True,
    )
    # ready at once: the probes while it binds are refused (not enough in a row to matter)
    live = fast(liveness_url="https://127.0.0.1:{port}/health", liveness_failures=10)
    group = web(tmp_path, 18966, "--tls", str(tmp_path), **live)
    sup = supervisor({"workers": [{**group, "ready": "none"}]})
    sup.ready("web-0")
    failed = sup.wait_event(event="worker.liveness_probe_failed", worker="web-0")
    assert "CERTIFICATE_VERIFY_FAILED" in failed["error"]
    assert not sup.find(event="worker.liveness_failed")
    assert len(sup.find(event="worker.spawned", worker="web-0")) == 1
    assert sup.stop() == 0


def test_a_kept_alive_connection_the_worker_closed_as_it_was_asked_is_no_failure(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """Regression: the probes keep their connection to the worker alive between probes; a
    server closes an idle one after its keep-alive timeout (uvicorn's and Node's: 5 s), and a
    probe sent just as it did ("Server disconnected without sending a response") counted as a
    failed probe: a healthy worker, probed about as often as its keep-alive timeout, was
    restarted as hung. Such a probe is asked once more, on a new connection."""
    group = {
        **web(tmp_path, 18969, **fast(liveness_failures=1)),
        "command": worker_cmd("keepalive_race"),
    }
    sup = supervisor({"workers": [group]})
    sup.ready("web-0")
    seen = len(sup.stdout)
    for _ in range(4):  # the readiness probe's answer, then liveness probes on kept connections
        found = sup.wait_line("[web-0] ", endswith="answered 200", after=seen)
        seen = sup.stdout.index(found, seen) + 1
    assert not sup.find(event="worker.liveness_probe", worker="web-0")
    assert not sup.find(event="worker.liveness_failed")
    assert len(sup.find(event="worker.spawned", worker="web-0")) == 1
    assert sup.stop() == 0


def test_an_https_url_asked_of_a_plain_http_worker_restarts_nothing(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    """``liveness_url`` says https, the worker serves plain HTTP: no probe can get an answer
    (WRONG_VERSION_NUMBER), which a restart does not mend. Said once
    (``liveness_probe_failed``), not probed again (regression: the healthy worker was
    restarted as hung every few probes, forever)."""
    live = fast(liveness_url="https://127.0.0.1:{port}/health", liveness_failures=2)
    sup = supervisor({"workers": [web(tmp_path, 18970, **live)]})
    sup.ready("web-0")
    failed = sup.wait_event(event="worker.liveness_probe_failed", worker="web-0")
    # (WRONG_VERSION_NUMBER; "record layer failure" from OpenSSL 3.2 on)
    assert any(w in failed["error"].lower() for w in ("version", "record layer")), failed
    assert not sup.find(event="worker.liveness_failed")
    assert len(sup.find(event="worker.spawned", worker="web-0")) == 1
    assert sup.stop() == 0
