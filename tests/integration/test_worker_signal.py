"""``gpu-supervisor signal SIG NAME`` and ``POST /api/v1/workers/{name}/signal`` (and a
group's): the signal reaches the worker's whole process tree now, nothing else happens to it;
bad signals and workers without a process are refused."""

from __future__ import annotations

import sys

import psutil

from tests.conftest import SupervisorFactory
from tests.harness import run_cli as cli

# A worker whose child (in its process group) and grandchild (in a session of its own) say
# which signal they got (each line in one write: the three share the pipe); SIGUSR1 kills none
# of them.
TREE = [
    sys.executable,
    "-c",
    "import os, signal, sys, time\n"
    "def said(s, f): os.write(1, ('got %s %d\\n' % (signal.Signals(s).name, os.getpid())).encode())\n"
    "signal.signal(signal.SIGUSR1, said)\n"
    "signal.signal(signal.SIGUSR2, said)\n"
    "if os.fork() == 0 and os.fork() == 0:\n"
    "    os.setsid()\n"
    "os.write(1, ('up %d\\n' % os.getpid()).encode())\n"
    "while True: time.sleep(60)\n",
]


def test_a_signal_reaches_the_whole_tree_of_a_worker_and_nothing_else_happens(
    supervisor: SupervisorFactory,
) -> None:
    group = {"command": TREE, "ready": "none", "log_passthrough": True, "stop_timeout_s": 2}
    sup = supervisor({"workers": [{"name": "t", **group}, {"name": "s", "replicas": 0, **group}]})
    pid = sup.wait_event(event="worker.spawned", worker="t-0")["pid"]

    def ups() -> set[int] | None:  # the leader, its child and the grandchild that left
        seen = {int(x.split()[2]) for x in sup.stdout if x.startswith("[t-0] up ")}
        return seen if len(seen) == 3 else None

    tree: set[int] = sup.wait_until(ups, "three processes up")
    url = sup.api_url()

    done = cli("signal", "USR1", "t-0", "--url", url)
    assert (done.returncode, done.stdout) == (0, f"t-0: USR1 sent (pid {pid})\n"), done.stderr
    for p in tree:
        sup.wait_line("[t-0] ", contains=f"got SIGUSR1 {p}")
    signalled = sup.wait_event(event="worker.signal", worker="t-0", signal="SIGUSR1")
    assert signalled["reason"] == "operator"
    assert sup.find(event="api.command", command="signal", target="t-0", signal="SIGUSR1")

    done = cli("signal", "12", "t", "--url", url)  # a group, a number (SIGUSR2)
    assert done.stdout == f"t: 12 sent to 1 workers: t-0 (pid {pid})\n", done.stderr
    for p in tree:
        sup.wait_line("[t-0] ", contains=f"got SIGUSR2 {p}")
    assert not sup.find(event="worker.exited")  # nothing else happened to it

    with sup.api() as api:
        bad = api.post("/api/v1/workers/t-0/signal", params={"signal": "SIGNOPE"})
        assert bad.status_code == 422
        assert bad.json() == {
            "error": "query.signal: not a signal of this system (a name such as SIGUSR1 or "
            "USR1, or its number) (got 'SIGNOPE')"
        }
        assert api.post("/api/v1/workers/t-0/signal").status_code == 422  # none given
        assert api.post("/api/v1/workers/nope/signal?signal=USR1").status_code == 404
        assert api.post("/api/v1/groups/nope/signal?signal=USR1").status_code == 404
        stopped = api.post("/api/v1/groups/s/signal?signal=USR1")  # no worker has a process
        assert stopped.status_code == 409
    done = cli("signal", "USR1", "nope", "--url", url)
    assert done.returncode == 2 and "unknown worker or group 'nope'" in done.stderr
    assert sup.stop() == 0


def test_a_worker_an_operator_stopped_with_sigstop_still_stops_gracefully(
    supervisor: SupervisorFactory,
) -> None:
    # its TERM handler runs once it is continued (SIGCONT after the stop signal, as systemd);
    # without it the TERM waited until SIGKILL at stop_timeout_s (30 s here)
    graceful = [
        sys.executable,
        "-c",
        "import os, signal, sys, time\n"
        "def bye(s, f):\n"
        "    os.write(1, b'TERM handled\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "os.write(1, b'up\\n')\n"
        "while True: time.sleep(60)\n",
    ]
    sup = supervisor(
        {
            "workers": [
                {
                    "name": "s",
                    "command": graceful,
                    "ready": "none",
                    "log_passthrough": True,
                    "stop_timeout_s": 30,
                }
            ]
        }
    )
    pid = sup.wait_event(event="worker.spawned", worker="s-0")["pid"]
    sup.wait_line("[s-0] ", contains="up")
    with sup.api() as api:
        assert api.post("/api/v1/workers/s-0/signal?signal=SIGSTOP").status_code == 200
        sup.wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, "stopped")
        assert api.post("/api/v1/workers/s-0/stop").status_code == 202
    exited = sup.wait_event(event="worker.exited", worker="s-0", timeout=10)
    assert (exited["code"], exited["signal"]) == (0, None)
    sup.wait_line("[s-0] ", contains="TERM handled")
    assert sup.stop() == 0
