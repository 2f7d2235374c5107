"""A real worker prints a 100 kB line: the supervisor's stdout (log_passthrough) has all of it,
and a sticky-error pattern at the start of such a line still restarts the worker."""

from __future__ import annotations

import json
import sys
from typing import Any

from supervisor.output import MAX_LINE
from tests.conftest import SupervisorFactory

LONG = "L0 " + "z" * 100_000 + " END"
ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"


def printer(text: str) -> list[str]:
    """A worker that prints ``text`` in one write, then waits for its stop signal."""
    code = (
        "import signal, sys\n"
        f"sys.stdout.write({text!r})\n"
        "sys.stdout.flush()\n"
        "while True:\n"
        "    signal.pause()\n"
    )
    return [sys.executable, "-c", code]


def group(text: str) -> dict[str, Any]:
    return {
        "gpu": {"backend": "none"},
        "workers": [
            {
                "name": "big",
                "command": printer(text),
                "ready": "none",
                "log_passthrough": True,
                "stop_timeout_s": 2,
            }
        ],
    }


def test_a_100kb_line_is_passed_through_whole(supervisor: SupervisorFactory) -> None:
    sup = supervisor(group(f"before\n{LONG}\nafter\n"))
    sup.wait_line("[big-0] after")
    assert sup.stop() == 0
    lines = [line.removeprefix("[big-0] ") for line in sup.stdout if line.startswith("[big-0] ")]
    start = lines.index("before") + 1
    end = lines.index("after")
    pieces = lines[start:end]
    assert pieces[0].startswith("L0 ")
    assert all(len(p) <= MAX_LINE for p in pieces)
    assert "".join(pieces) == LONG
    log = (sup.state_dir / "logs" / "big-0.log").read_text()
    assert f"before\n{LONG}\nafter\n" in log


def test_a_sticky_error_at_the_start_of_a_long_line_restarts(
    supervisor: SupervisorFactory,
) -> None:
    sup = supervisor(group(ERROR + " " + "z" * 100_000 + "\n"))
    action = sup.wait_event(event="heal.action", worker="big-0")
    assert (action["action"], action["reason"]) == ("restart", "log_pattern")
    event = sup.wait_event(event="records.postmortem", reason="log_pattern")
    doc = json.loads((sup.state_dir / "postmortems" / f"{event['id']}.json").read_text())
    assert doc["evidence"]["log_line"].startswith(ERROR)
    cut = [line for line in doc["log_tail"] if line.startswith(ERROR)]
    assert len(cut) == 1 and "[... line cut: " in cut[0], doc["log_tail"]
    assert sup.stop() == 0
