"""The ``gpu-supervisor`` command line. Only this module turns errors into exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 bad usage or bad configuration (one line, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import io
import json
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor import client_args
from supervisor._version import __version__
from supervisor.errors import (
    BackendError,
    ConfigError,
    ListenError,
    SupervisorError,
    UsageError,
)
from supervisor.sigmask import release_held_signals

# Only what every command needs is imported here: the client commands (``status``, ``logs``...,
# run by operators and scripts all day) start without the runtime, the API server, structlog,
# psutil or the GPU backends, and ``run`` without the client (``supervisor.client_args`` builds
# the parser). Each command imports what it uses where it starts, before it does anything (so
# a missing dependency still fails it at once).
if TYPE_CHECKING:
    from supervisor.config import GpuSection, Settings
    from supervisor.model import DeviceSample
    from supervisor.plan import Plan
    from supervisor.records import PostmortemStore
    from supervisor.runtime import Service

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
    run.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=("debug", "info", "warning", "error"),
        help="debug, info, warning or error",
    )

    check = sub.add_parser("check-config", help="validate a config and print the resolved plan")
    check.add_argument("-c", "--config", required=True, help="TOML config file")
    check.add_argument("--json", action="store_true", help="print the plan as JSON")

    gpus = sub.add_parser("gpus", help="one-shot GPU table through the configured backend")
    gpus.add_argument("-c", "--config", help="TOML config file (its [gpu] section)")
    gpus.add_argument(
        "--backend", choices=["auto", "nvml", "sim", "none"], help="override [gpu] backend"
    )
    gpus.add_argument("--sim-dir", help="override [gpu] sim_dir (and read it: backend sim)")
    gpus.add_argument("--json", action="store_true", help="print JSON")

    pm = sub.add_parser("postmortem", help="read post-mortem files")
    pm_sub = pm.add_subparsers(dest="pm_command", required=True, parser_class=_Parser)
    pm_list = pm_sub.add_parser("list", help="post-mortems, newest first")
    pm_show = pm_sub.add_parser("show", help="one post-mortem")
    pm_show.add_argument(
        "id",
        help="post-mortem id (from `postmortem list`), the start of one, or a file's path",
    )
    for p in (pm_list, pm_show):
        p.add_argument(
            "-c",
            "--config",
            help="TOML config file (its [supervisor] state_dir; default: the default "
            "state_dir, /var/lib/gpu-supervisor)",
        )
        p.add_argument("--state-dir", help="the supervisor's state_dir")
        p.add_argument("--json", action="store_true", help="print JSON")
    pm_list.add_argument("--limit", type=int, default=None, help="at most this many")
    client_args.add_commands(sub)
    return parser


def _plan_rows(plan: Plan) -> list[dict[str, object]]:
    from supervisor.model import format_cpulist
    from supervisor.views import redact_argv, redact_url

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
                    "ready": redact_url(w.ready_url) if w.ready_url else gp.group.ready,
                    "liveness": None if w.liveness is None else redact_url(w.liveness.url),
                    "command": redact_argv(w.argv),  # printed: no API keys
                    "cwd": w.cwd,
                    "user": gp.group.user or None,
                    "cpus": None if w.cpus is None else format_cpulist(w.cpus),
                    "limits": {
                        name: [_limit_json(soft), _limit_json(hard)]
                        for name, soft, hard in w.limits
                    },
                }
            )
    return rows


def _limit_json(value: int | None) -> int | str:
    return "unlimited" if value is None else value


def _read_devices(gpu: GpuSection) -> tuple[tuple[DeviceSample, ...], str | None]:
    """One reading of the configured GPU backend (opened and closed again): devices, error.

    Nothing is written: a sim world that does not exist yet reads as the devices ``run`` would
    create in it.
    """
    from supervisor.backends.factory import make_backend

    backend = make_backend(gpu, create=False)
    try:
        backend.open()
        return backend.sample(), None
    except BackendError as exc:
        return (), f"gpu backend {gpu.backend}: {exc}"
    finally:
        with contextlib.suppress(BackendError):
            backend.close()


def _unrunnable(plan: Plan) -> list[str]:
    """A warning per group whose program cannot be executed from here (``run`` would start,
    and report each failed spawn: the program may be installed later, or only at run time)."""
    from supervisor.processes import unrunnable

    firsts = [(g.group.name, g.workers[0]) for g in plan.groups if g.workers]
    return [f"{line} (its workers would fail to start)" for line in unrunnable(firsts)]


def check_config(settings: Settings, as_json: bool) -> str:
    """The resolved plan as text or JSON, placed on the GPUs the configured backend sees now.

    Refused (``ConfigError``: exit 2): what ``run`` refuses (an unusable ``api.token_file``),
    and a plan that cannot be placed on the GPUs seen now (an explicit GPU index or UUID the
    backend does not have, no GPU with room): ``run`` starts the other workers then and fails
    those at their start, a check is for catching it before. A backend that cannot be opened is
    a warning, as at ``run`` (which starts without GPU telemetry and retries).
    """
    from supervisor.listen import load_token
    from supervisor.notify import socket_path_for
    from supervisor.plan import build_plan, slot_for
    from supervisor.processes import allowed_cpus, reporters_unreadable, resolve_accounts

    sup = settings.supervisor
    if settings.api.listen:
        load_token(settings.api)
    devices, error = _read_devices(settings.gpu)
    slots = [slot_for(d) for d in devices]
    plan = build_plan(
        settings,
        {},
        os.fspath(socket_path_for(sup.state_dir, create=False)),
        slots or None,
        accounts=resolve_accounts(g.user for g in settings.workers),
        allowed_cpus=allowed_cpus(),
    )
    firsts = [(g.group.name, g.workers[0]) for g in plan.groups if g.workers]
    warnings = [
        *([error] if error else []),
        *plan.warnings,
        *_unrunnable(plan),
        *reporters_unreadable(firsts),
    ]
    rows = _plan_rows(plan)
    if as_json:
        return json.dumps(
            {
                "state_dir": str(sup.state_dir),
                "gpus": [{"index": d.index, "uuid": d.uuid} for d in devices],
                "workers": rows,
                "warnings": warnings,
            },
            indent=2,
        )
    lines = [
        f"config ok: {len(plan.groups)} groups, {len(rows)} workers, state_dir {sup.state_dir}"
    ]
    users = any(r["user"] for r in rows)  # a USER column only where a group has one
    pinned = any(g.group.cpu_affinity for g in plan.groups)  # a CPUS column likewise
    header = (
        "WORKER",
        "PORT",
        "GPUS",
        *(("CPUS",) if pinned else ()),
        "READY",
        *(("USER",) if users else ()),
        "COMMAND",
    )
    table: list[tuple[str, ...]] = [header]
    for r in rows:
        gpus = r["gpus"]
        gpu_text = "(unset)" if gpus is None else (",".join(map(str, gpus)) or '""')  # type: ignore[call-overload]
        command = r["command"]
        assert isinstance(command, list)
        user = (str(r["user"] or "-"),) if users else ()
        cpus = (str(r["cpus"] or "-"),) if pinned else ()
        table.append(
            (
                str(r["name"]),
                str(r["port"]),
                gpu_text,
                *cpus,
                str(r["ready"]),
                *user,
                shlex.join(command),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        cells = [row[i].ljust(widths[i]) for i in range(len(header) - 1)]
        lines.append("  ".join([*cells, row[-1]]))
    lines.extend(f"warning: {w}" for w in warnings)
    return "\n".join(lines)


def _fmt(value: object, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            return f"{value:.{digits}f}{unit}"
    # a post-mortem of another version, or written by hand: shown as written, not a traceback
    shown = value if isinstance(value, str) else json.dumps(value)
    return f"{shown}{unit}"


def _gpu_health(d: DeviceSample) -> str:
    """The ``gpus`` table's HEALTH cell: a one-shot reading, no healer, so what a supervisor
    would quarantine the GPU for (a failed row remap, a reset or reboot asked for) is said
    here; the rest as ``status`` says it (``client.repair_notes``)."""
    from supervisor import client
    from supervisor.model import recovery_action_name
    from supervisor.policy.heal import RECOVERY_QUARANTINES
    from supervisor.views import device_object

    if not d.healthy:
        return f"UNHEALTHY ({d.error})"
    if d.remapped_rows is not None and d.remapped_rows.failure:
        return "UNHEALTHY (row remap failed)"
    action = recovery_action_name(d.recovery_action)
    if action in RECOVERY_QUARANTINES:
        return f"UNHEALTHY (needs {action})"
    return "ok" + client.repair_notes(device_object(d))


def gpu_table(devices: Sequence[DeviceSample], backend: str, error: str | None) -> str:
    """The ``gpus`` table."""
    from supervisor.model import format_cpulist

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
        "CPUS",
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
                "n/a" if d.cpus is None else format_cpulist(d.cpus),
                _gpu_health(d),
                procs,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _gpus(args: argparse.Namespace) -> int:
    from supervisor import client
    from supervisor.backends.factory import make_backend
    from supervisor.backends.sim import SimBackend
    from supervisor.config import environment_client_settings as env_settings

    gpu = client.client_settings(args.config).gpu if args.config else env_settings().gpu
    if args.sim_dir and args.backend not in (None, "sim"):
        raise UsageError(
            f"gpu-supervisor gpus: --sim-dir goes with --backend sim (not {args.backend!r})"
        )
    if args.sim_dir:  # a sim world named: the sim backend is meant (regression: ignored)
        gpu = gpu.model_copy(update={"sim_dir": Path(args.sim_dir), "backend": "sim"})
    elif args.backend:
        gpu = gpu.model_copy(update={"backend": args.backend})
    backend = make_backend(gpu, create=False)
    error: str | None = None
    devices: tuple[DeviceSample, ...] = ()
    try:
        if isinstance(backend, SimBackend) and not backend.has_devices():
            raise BackendError(
                f"no sim world at {gpu.sim_dir} (`run` creates one with {gpu.sim_devices} devices)"
            )
        backend.open()
        devices = backend.sample()
    except BackendError as exc:
        error = str(exc)
    finally:
        backend.close()
    available = error is None and backend.name != "none"
    if args.json:
        print(
            json.dumps(
                {
                    "backend": backend.name,
                    "nvml_available": available,
                    # as the API's /api/v1/gpu/status says it
                    "error": error
                    if available or error
                    else f"no GPU telemetry (backend {backend.name})",
                    "devices": [device_json(d) for d in devices],
                },
                indent=2,
            )
        )
    else:
        print(gpu_table(devices, backend.name, error))
    return EXIT_OK if error is None or gpu.backend == "auto" else EXIT_FAILURE


def device_json(d: DeviceSample) -> dict[str, Any]:
    """The device object of DESIGN.md section 6 (a one-shot read: no cordons, no worker names)."""
    from supervisor.views import device_object

    return device_object(d)


def _store(args: argparse.Namespace) -> PostmortemStore:
    from supervisor import client
    from supervisor.config import environment_client_settings as env_settings
    from supervisor.records import POSTMORTEM_DIR, PostmortemStore

    if args.state_dir:
        state_dir = Path(args.state_dir)
    elif args.config:
        state_dir = client.client_settings(args.config).supervisor.state_dir
    else:  # where a supervisor started without the key keeps them (its env override too)
        state_dir = env_settings().supervisor.state_dir
    if not state_dir.is_dir():  # regression: "no post-mortems" (exit 0), or a traceback
        why = "no such directory" if not state_dir.exists() else "not a directory"
        raise UsageError(f"gpu-supervisor postmortem: state_dir {str(state_dir)!r}: {why}")
    return PostmortemStore(state_dir / POSTMORTEM_DIR, keep=1)


def _postmortem_id(store: PostmortemStore, given: str) -> str:
    """The id ``given`` names: an id, the file's path (as ``list`` or a shell completes it),
    or the start of exactly one id (``20261205T1903``)."""
    name = Path(given).name
    ident = name[: -len(".json")] if name.endswith(".json") else name
    if not ident:
        return given
    ids = store.ids()
    if ident in ids:
        return ident
    starting = [i for i in ids if i.startswith(ident)]
    if len(starting) > 1:
        raise UsageError(
            f"gpu-supervisor postmortem show: {given!r} is the start of {len(starting)} "
            f"post-mortems ({', '.join(starting[:3])}{', ...' if len(starting) > 3 else ''})"
        )
    return starting[0] if starting else ident


def postmortem_table(rows: Sequence[dict[str, Any]]) -> str:
    """The ``postmortem list`` table."""
    if not rows:
        return "no post-mortems"
    header = ("ID", "WORKER", "REASON", "ENDED", "EXIT")
    table = [header]
    for r in rows:
        ex = _obj(r.get("exit"))  # a file written by hand or by another version: any JSON
        if ex.get("signal_name"):
            exit_text = str(ex["signal_name"])
        elif ex.get("code") is not None:
            exit_text = f"code {ex['code']}"
        else:
            exit_text = "-"
        table.append(
            (str(r["id"]), str(r["worker"]), str(r["reason"]), str(r["ended_at"]), exit_text)
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )


def _obj(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def postmortem_text(doc: dict[str, Any]) -> str:
    """``postmortem show``: the facts first, then evidence, samples and the log tail (a file
    written by hand, or by another version, shows what it has: no part is taken on trust)."""
    w = _obj(doc.get("worker"))
    ex = _obj(doc.get("exit"))
    how = ex.get("signal_name") or (
        f"exit code {ex['code']}" if ex.get("code") is not None else "-"
    )
    lines = [
        f"post-mortem {doc.get('id')}",
        f"  worker    {w.get('name')} (group {w.get('group')}, index {w.get('index')})",
        f"  reason    {doc.get('reason')}",
        f"  exit      {how}",
        f"  pid       {w.get('pid')}",
        f"  started   {w.get('started_at')}",
        f"  ended     {w.get('ended_at')} (uptime {w.get('uptime_s')} s)",
        f"  restarts  {w.get('restarts')}",
        f"  gpus      {', '.join(map(str, _list(w.get('gpus')))) or '-'}",
        f"  port      {w.get('port')}",
        f"  command   {shlex.join(map(str, _list(w.get('command'))))}",
        "evidence:",
    ]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in _obj(doc.get("evidence")).items()]
    samples = [_obj(x) for x in _list(doc.get("samples"))]
    lines.append(f"samples (last {min(len(samples), 10)} of {len(samples)}):")
    for smp in samples[-10:]:
        lines.append(
            f"  {smp.get('t')}  gpu {_fmt(smp.get('gpu_memory_mb'), ' MiB')}  "
            f"rss {_fmt(smp.get('host_rss_mb'), ' MiB', 1)}  "
            f"cpu {_fmt(smp.get('cpu_percent'), '%', 1)}"
        )
    for d in map(_obj, _list(doc.get("devices"))):
        mem = _obj(d.get("memory"))
        lines.append(
            f"gpu {d.get('id')} {d.get('uuid')}: {_fmt(mem.get('used_mb'))}/"
            f"{_fmt(mem.get('total_mb'))} MiB, {_fmt(d.get('temperature_celsius'), 'C')}, "
            f"{'healthy' if d.get('healthy') else 'UNHEALTHY'}"
        )
    tail = _list(doc.get("log_tail"))
    lines.append(f"log tail ({len(tail)} lines):")
    lines += [f"  {line}" for line in tail]
    # the log tail is the worker's output: nothing in it acts on the operator's terminal
    from supervisor import client

    return client.printable("\n".join(lines))


def _postmortem_file(given: str) -> Path | None:
    """``given`` as the path of a post-mortem file (``show`` of a copy kept elsewhere, with no
    ``-c`` or ``--state-dir``), or None when it names none."""
    path = Path(given)
    if (os.sep in given or given.endswith(".json")) and path.is_file():
        return path
    return None


def _postmortem(args: argparse.Namespace) -> int:
    from supervisor.records import read_file

    if args.pm_command == "show" and not (args.config or args.state_dir):
        path = _postmortem_file(args.id)
        if path is not None:
            try:
                doc = json.loads(read_file(path))
            except (OSError, ValueError) as exc:
                raise UsageError(
                    f"gpu-supervisor postmortem show: {args.id!r}: not a post-mortem ({exc})"
                ) from None
            if not isinstance(doc, dict):
                raise UsageError(f"gpu-supervisor postmortem show: {args.id!r}: not a JSON object")
            print(json.dumps(doc, indent=2) if args.json else postmortem_text(doc))
            return EXIT_OK
    store = _store(args)
    if args.pm_command == "list":
        if args.limit is not None and args.limit < 1:
            raise UsageError(
                f"gpu-supervisor postmortem list: --limit must be >= 1 (got {args.limit})"
            )
        try:
            rows = store.summaries(args.limit)
        except OSError as exc:  # not ours to read (not in the service's group): no traceback
            raise UsageError(
                f"gpu-supervisor postmortem list: {str(store.directory)!r}: cannot read it "
                f"({exc.strerror or exc})"
            ) from None
        print(json.dumps(rows, indent=2) if args.json else postmortem_table(rows))
        return EXIT_OK
    try:
        doc = store.read(_postmortem_id(store, args.id))
    except ValueError as exc:
        raise UsageError(f"gpu-supervisor postmortem show: {exc}") from None
    except FileNotFoundError:
        raise UsageError(
            f"gpu-supervisor postmortem show: no post-mortem {args.id!r} in {store.directory}"
        ) from None
    except OSError as exc:  # a directory by that name, unreadable
        raise UsageError(
            f"gpu-supervisor postmortem show: {args.id!r}: cannot read it ({exc.strerror})"
        ) from None
    print(json.dumps(doc, indent=2) if args.json else postmortem_text(doc))
    return EXIT_OK


def _hold_standard_descriptors() -> None:
    """Started with stdin, stdout or stderr closed (``2>&-``): ``/dev/null`` in its place, so
    that no file the supervisor opens (its lock, a socket, a worker's pipe) takes that number,
    where what is written to the stream below Python (a fatal error's message) would land."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_RDWR)  # the lowest number free: this one
                if null != fd:
                    os.dup2(null, fd, inheritable=False)
                    os.close(null)


def _run(args: argparse.Namespace) -> int:
    # everything `run` needs, before it does anything: a missing dependency fails it here
    import logging
    import resource

    import anyio
    import structlog

    from supervisor.config import load_settings
    from supervisor.listen import open_api, serve_api
    from supervisor.logs import configure_logging
    from supervisor.processes import (
        lift_address_space_limit,
        protect_from_oom_killer,
        raise_open_files_limit,
    )
    from supervisor.records import check_state_dir_free
    from supervisor.runtime import Runtime

    _hold_standard_descriptors()
    configure_logging(args.log_format, args.log_level)
    # A supervisor wedged until systemd's watchdog sends SIGABRT (or a fatal signal in C code)
    # leaves every thread's stack on stderr (the journal) instead of nothing. (Started with
    # stderr closed, Python has none: it refused, and the supervisor exited 1 without a word.)
    if sys.stderr is not None:
        faulthandler.enable()
    path = Path(args.config)
    settings = load_settings(path)
    before, after = raise_open_files_limit()
    if after != before:
        structlog.get_logger().debug("supervisor.open_files_limit", before=before, now=after)
    # before any worker is spawned: they inherit it, and CUDA fails under one
    address_space = lift_address_space_limit()
    if address_space is not None:
        was, now = address_space
        lifted = now == resource.RLIM_INFINITY
        structlog.get_logger().log(
            logging.INFO if lifted else logging.WARNING,
            "supervisor.address_space_limit",
            before=was,
            now="unlimited" if lifted else now,
            reason="started under an address-space limit (ulimit -v): lifted for the workers"
            if lifted
            else "its hard limit stays in force in every worker: CUDA fails to initialise "
            "under one (raise it where the supervisor is started: ulimit -v unlimited)",
        )
    # before any worker is spawned: the OOM killer takes a worker, not the supervisor
    oom = protect_from_oom_killer()
    structlog.get_logger().info(
        "supervisor.oom_score_adj",
        before=oom.before,
        now=oom.now,
        workers=oom.workers,
        error=oom.error,
    )
    services: list[Service] = []
    # Bound before anything starts, so a port in use fails here; FastAPI is imported later.
    try:
        bound = open_api(settings.api) if settings.api.listen else None
    except ListenError:
        # a second `run` on the same state_dir (a `docker exec`): that is the error to name
        # (regression: "address already in use", which sent the operator after the port)
        check_state_dir_free(settings.supervisor.state_dir)
        raise
    if bound is not None:
        services.append(functools.partial(serve_api, bound))
    try:
        runtime = Runtime(
            settings,
            path,
            trace_samples=args.log_level.lower() == "debug",
            services=services,
        )
        return anyio.run(runtime.run)
    except SupervisorError:
        raise
    except ExceptionGroup as group:
        # A service that fails to start (the API cannot bind, bad token file) ends the task
        # group: report its error in one line like any other.
        first = _first_supervisor_error(group)
        if first is None:
            structlog.get_logger().exception("supervisor.crashed", error=str(group))
            return EXIT_FAILURE
        raise first from None
    except Exception as exc:
        structlog.get_logger().exception("supervisor.crashed", error=str(exc))
        return EXIT_FAILURE
    finally:
        if bound is not None:
            bound.close()


def _first_supervisor_error(group: BaseExceptionGroup[Any]) -> SupervisorError | None:
    for exc in group.exceptions:
        if isinstance(exc, SupervisorError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_supervisor_error(exc)
            if found is not None:
                return found
    return None


def _write_undecodable_bytes_back() -> None:
    """Standard output writes the bytes of a path that is no UTF-8 as they are (the path
    decoded them as surrogates) rather than failing: with a UTF-8 locale its errors are
    ``strict``, and ``check-config`` with such a ``state_dir`` (given through the environment)
    ended in a UnicodeEncodeError traceback (regression)."""
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        with contextlib.suppress(ValueError, OSError):  # closed, or no stream to reconfigure
            sys.stdout.reconfigure(errors="surrogateescape")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    config: str | None = None
    _write_undecodable_bytes_back()
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), None)  # also for a bad flag
    try:
        args = build_parser().parse_args(words)
        config = getattr(args, "config", None)
        if args.command != "run":
            gc.enable()  # held off by the entry point; `run` turns it on after start-up
            release_held_signals()  # likewise: `run` releases them once it handles them
        if args.command == "check-config":
            from supervisor.config import load_settings

            print(check_config(load_settings(args.config), args.json))
            return EXIT_OK
        if args.command == "run":
            return _run(args)
        if args.command == "gpus":
            return _gpus(args)
        if args.command == "postmortem":
            return _postmortem(args)
        if args.command in client_args.COMMANDS:
            from supervisor import client

            return client.main(args)
        raise UsageError(f"unknown command {args.command!r}")
    except (ConfigError, UsageError) as exc:
        line = str(exc)
        if isinstance(exc, ConfigError) and config and not line.startswith(f"{config}: "):
            line = f"{config}: {line}"  # found on the GPUs or in the token file, not the text
        print(f"gpu-supervisor: {line}" if isinstance(exc, ConfigError) else line, file=sys.stderr)
        # a HEALTHCHECK's 2 is reserved (Docker): unhealthy is 1, whatever the cause
        return EXIT_FAILURE if command == "health" else EXIT_USAGE
    except SupervisorError as exc:
        print(f"gpu-supervisor: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        # Ctrl-C in a client's wait (`reload --wait`, `restart --rolling --wait`) or a slow
        # answer: one line, not a traceback; what the supervisor was asked goes on there
        if command == "logs":  # the way out of `logs -f`: nothing else to say
            return 128 + signal.SIGINT
        goes_on = (
            " (the supervisor goes on with what it was asked)"
            if command in client_args.COMMANDS
            else ""
        )
        print(f"gpu-supervisor: interrupted{goes_on}", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader went away (`gpu-supervisor status | head -3`): no traceback, and none from
        # the interpreter's final flush either (stdout points at /dev/null from here on).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
