"""The ``gpu-supervisor`` command line. Only this module turns errors into exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 bad usage or bad configuration (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import structlog

from supervisor._version import __version__
from supervisor.config import Settings, load_settings
from supervisor.errors import ConfigError, SupervisorError, UsageError
from supervisor.logs import configure_logging
from supervisor.notify import socket_path_for
from supervisor.plan import Plan, build_plan
from supervisor.runtime import Runtime

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the docs)."""
    parser = _Parser(prog="gpu-supervisor", description="Supervise GPU inference workers.")
    parser.add_argument("--version", action="version", version=f"gpu-supervisor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run in the foreground until SIGTERM/SIGINT")
    run.add_argument("-c", "--config", required=True, help="TOML config file")
    run.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        default="auto",
        help="log format (default: console on a TTY, else JSON lines)",
    )
    run.add_argument("--log-level", default="info", help="debug, info, warning or error")

    check = sub.add_parser("check-config", help="validate a config and print the resolved plan")
    check.add_argument("-c", "--config", required=True, help="TOML config file")
    check.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _plan_rows(plan: Plan) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for gp in plan.groups:
        for w in gp.workers:
            rows.append(
                {
                    "name": w.name,
                    "group": w.group,
                    "index": w.index,
                    "port": w.port,
                    "gpus": None if w.gpus is None else list(w.gpus),
                    "ready": w.ready_url or gp.group.ready,
                    "command": list(w.argv),
                }
            )
    return rows


def check_config(settings: Settings, as_json: bool) -> str:
    """The resolved plan as text or JSON."""
    sup = settings.supervisor
    plan = build_plan(settings, {}, os.fspath(socket_path_for(sup.state_dir)))
    rows = _plan_rows(plan)
    if as_json:
        return json.dumps(
            {"state_dir": str(sup.state_dir), "workers": rows, "warnings": list(plan.warnings)},
            indent=2,
        )
    lines = [
        f"config ok: {len(plan.groups)} groups, {len(rows)} workers, state_dir {sup.state_dir}"
    ]
    header = ("WORKER", "PORT", "GPUS", "READY", "COMMAND")
    table = [header]
    for r in rows:
        gpus = r["gpus"]
        gpu_text = "(unset)" if gpus is None else (",".join(map(str, gpus)) or '""')  # type: ignore[call-overload]
        command = r["command"]
        assert isinstance(command, list)
        table.append(
            (str(r["name"]), str(r["port"]), gpu_text, str(r["ready"]), shlex.join(command))
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        cells = [row[i].ljust(widths[i]) for i in range(len(header) - 1)]
        lines.append("  ".join([*cells, row[-1]]))
    lines.extend(f"warning: {w}" for w in plan.warnings)
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    path = Path(args.config)
    settings = load_settings(path)
    runtime = Runtime(settings, path)
    try:
        return anyio.run(runtime.run)
    except SupervisorError:
        raise
    except Exception as exc:
        structlog.get_logger().exception("supervisor.crashed", error=str(exc))
        return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "check-config":
            print(check_config(load_settings(args.config), args.json))
            return EXIT_OK
        if args.command == "run":
            return _run(args)
        raise UsageError(f"unknown command {args.command!r}")
    except (ConfigError, UsageError) as exc:
        print(
            f"gpu-supervisor: {exc}" if isinstance(exc, ConfigError) else str(exc), file=sys.stderr
        )
        return EXIT_USAGE
    except SupervisorError as exc:
        print(f"gpu-supervisor: {exc}", file=sys.stderr)
        return EXIT_FAILURE
