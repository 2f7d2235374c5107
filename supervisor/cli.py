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
from supervisor.backends.factory import make_backend
from supervisor.config import GpuSection, Settings, load_settings
from supervisor.errors import BackendError, ConfigError, SupervisorError, UsageError
from supervisor.logs import configure_logging
from supervisor.model import DeviceSample
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

    gpus = sub.add_parser("gpus", help="one-shot GPU table through the configured backend")
    gpus.add_argument("-c", "--config", help="TOML config file (its [gpu] section)")
    gpus.add_argument(
        "--backend", choices=["auto", "nvml", "sim", "none"], help="override [gpu] backend"
    )
    gpus.add_argument("--sim-dir", help="override [gpu] sim_dir")
    gpus.add_argument("--json", action="store_true", help="print JSON")
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


def _fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def gpu_table(devices: Sequence[DeviceSample], backend: str, error: str | None) -> str:
    """The ``gpus`` table."""
    if not devices:
        return f"no GPUs (backend {backend}{': ' + error if error else ''})"
    header = (
        "GPU",
        "UUID",
        "NAME",
        "MEMORY (MiB)",
        "UTIL",
        "TEMP",
        "POWER",
        "THROTTLE",
        "HEALTH",
        "PROCS",
    )
    rows = [header]
    for d in devices:
        mem = f"{_fmt(d.memory_used_mb)}/{_fmt(d.memory_total_mb)}"
        throttle = d.throttle_reasons
        procs = (
            "n/a"
            if d.processes is None
            else ",".join(f"{p.pid}:{_fmt(p.used_mb)}" for p in d.processes) or "-"
        )
        rows.append(
            (
                str(d.index),
                d.uuid,
                d.name,
                mem,
                _fmt(d.utilization_percent, "%"),
                _fmt(d.temperature_c, "C"),
                _fmt(d.power_watts, "W"),
                "n/a" if throttle is None else (",".join(throttle) or "-"),
                "ok" if d.healthy else f"UNHEALTHY ({d.error})",
                procs,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _gpus(args: argparse.Namespace) -> int:
    gpu = load_settings(args.config).gpu if args.config else GpuSection()
    if args.backend:
        gpu = gpu.model_copy(update={"backend": args.backend})
    if args.sim_dir:
        gpu = gpu.model_copy(update={"sim_dir": Path(args.sim_dir)})
    backend = make_backend(gpu)
    error: str | None = None
    devices: tuple[DeviceSample, ...] = ()
    try:
        backend.open()
        devices = backend.sample()
    except BackendError as exc:
        error = str(exc)
    finally:
        backend.close()
    if args.json:
        print(
            json.dumps(
                {
                    "backend": backend.name,
                    "nvml_available": error is None,
                    "error": error,
                    "devices": [device_json(d) for d in devices],
                },
                indent=2,
            )
        )
    else:
        print(gpu_table(devices, backend.name, error))
    return EXIT_OK if error is None or gpu.backend == "auto" else EXIT_FAILURE


def device_json(d: DeviceSample) -> dict[str, object]:
    """The device object of DESIGN.md section 6 (processes without worker names)."""
    return {
        "id": d.index,
        "uuid": d.uuid,
        "name": d.name,
        "temperature_celsius": d.temperature_c,
        "utilization_percent": d.utilization_percent,
        "memory": {
            "used_mb": d.memory_used_mb,
            "total_mb": d.memory_total_mb,
            "free_mb": d.memory_free_mb,
        },
        "power_watts": d.power_watts,
        "encoder_util_percent": d.encoder_percent,
        "decoder_util_percent": d.decoder_percent,
        "throttle_reasons": None if d.throttle_reasons is None else list(d.throttle_reasons),
        "healthy": d.healthy,
        "processes": None
        if d.processes is None
        else [{"pid": p.pid, "used_mb": p.used_mb} for p in d.processes],
    }


def _run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    path = Path(args.config)
    settings = load_settings(path)
    runtime = Runtime(settings, path, trace_samples=args.log_level.lower() == "debug")
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
        if args.command == "gpus":
            return _gpus(args)
        raise UsageError(f"unknown command {args.command!r}")
    except (ConfigError, UsageError) as exc:
        print(
            f"gpu-supervisor: {exc}" if isinstance(exc, ConfigError) else str(exc), file=sys.stderr
        )
        return EXIT_USAGE
    except SupervisorError as exc:
        print(f"gpu-supervisor: {exc}", file=sys.stderr)
        return EXIT_FAILURE
