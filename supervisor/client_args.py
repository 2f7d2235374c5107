"""The client commands' arguments (``supervisor.client`` carries them out).

Apart from the client so that every command's parser (``run``'s too) is built without importing
it: ``run`` does not need the client, and the supervisor keeps what it imports (RSS).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 86400.0  # a day: past it the socket layer overflows

#: ``logs``: lines shown first by default.
LOG_LINES = 20

#: The client subcommands and their help lines.
COMMANDS: Mapping[str, str] = {
    "status": "table of GPUs and workers from a running supervisor",
    "drain": "take a worker (or every worker of a group) out of routing and let it stop",
    "restart": "restart a worker or a group (--rolling: one worker at a time)",
    "stop": "stop a worker or a group",
    "start": "start a worker or a group (also clears fatal)",
    "cordon": "place no more workers on a GPU (index or UUID)",
    "uncordon": "allow placing workers on a GPU again",
    "reload": "re-read the supervisor's config file (as SIGHUP) and say whether it took it",
    "signal": "send a signal to a worker's (or every worker of a group's) process tree now",
    "logs": "a worker's output from its log file (-f: follow it, across rotations)",
    "health": "exit 0 while the supervisor answers /healthz (--ready: /readyz), else 1 "
    "(a container HEALTHCHECK that follows api.listen)",
}


def add_commands(sub: Any) -> None:
    """Add the client subcommands to the CLI's subparsers action."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", help="the supervisor's TOML config (for [api])")
    common.add_argument("--url", help="API URL: http://HOST:PORT or unix:/path (overrides -c)")
    common.add_argument(
        "--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, help="seconds per request"
    )
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, parents=[common])
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the raw JSON")
        elif name == "reload":
            p.add_argument(
                "--wait",
                action="store_true",
                help="also wait for the roll-outs it starts: exit 0 done, 1 one halted",
            )
        elif name == "health":
            p.add_argument(
                "--ready",
                action="store_true",
                help="ask /readyz: also 1 while a group has no ready worker (the reasons printed)",
            )
        elif name == "signal":
            p.add_argument("signal", help="signal name (SIGUSR1, USR1) or number")
            p.add_argument("name", help="worker (gpen-1) or group (gpen)")
        elif name == "logs":
            p.add_argument("name", help="worker (gpen-1)")
            p.add_argument(
                "-n",
                "--lines",
                type=_lines,
                default=LOG_LINES,
                help=f"print the last N lines first (default {LOG_LINES}; 0: none)",
            )
            p.add_argument(
                "-f",
                "--follow",
                action="store_true",
                help="then print what the worker writes, until interrupted (exit 1 when the "
                "supervisor goes away)",
            )
        elif name in ("cordon", "uncordon"):
            p.add_argument("gpu", help="GPU index or UUID")
            if name == "uncordon":
                p.add_argument(
                    "--lift-quarantine",
                    action="store_true",
                    help="also take the GPU out of quarantine (a device-fatal XID or lost), "
                    "once it has been reset or repaired",
                )
        else:
            p.add_argument("name", help="worker (gpen-1) or group (gpen)")
            if name == "restart":
                p.add_argument(
                    "--rolling",
                    action="store_true",
                    help="NAME is a group: restart one worker at a time, waiting for readiness",
                )
                p.add_argument(
                    "--wait",
                    action="store_true",
                    help="with --rolling: wait until it is done (exit 0) or halted (exit 1)",
                )


def _seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"expected seconds > 0 and <= {MAX_TIMEOUT_S:g} (got {text!r})"
        )
    return value


def _lines(text: str) -> int:
    """``logs --lines``: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 (got {text!r})")
    return value
