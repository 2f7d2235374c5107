"""JSON documents built from plain values (no I/O): the device object of the API, the
``state.json`` snapshot and the post-mortem file of DESIGN.md sections 6 and 8.

The API, ``state.json``, the post-mortems and the CLI all use these builders, so a field has one
spelling everywhere. Documents with a ``schema_version`` are described by the JSON Schemas in
``docs/schemas/``.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from supervisor.journal import Event, rfc3339
from supervisor.model import DeviceSample, ExitStatus, format_cpulist, recovery_action_name

STATE_SCHEMA_VERSION = 1
POSTMORTEM_SCHEMA_VERSION = 1

#: The post-mortem ``reason`` vocabulary (DESIGN.md section 8).
POSTMORTEM_REASONS = frozenset(
    {
        "exit",
        "signal",
        "cuda_oom",
        "host_oom",
        "hang",
        "leak",
        "gpu_memory_limit",
        "host_memory_limit",
        "thermal",
        "xid",
        "gpu_lost",
        "row_remap_failure",  # moved off a GPU whose row remapper failed (docs/healing.md)
        "recovery_action",  # moved off a GPU the driver says needs a reset (docs/healing.md)
        "log_pattern",  # a sticky-error line; not in DESIGN.md section 8 (docs/healing.md)
        "drain",
        "start_timeout",
    }
)


def device_object(
    d: DeviceSample,
    *,
    cordoned: bool = False,
    suspect: bool = False,
    quarantined: str | None = None,
    hot: bool = False,
    worker_of: Mapping[int, str] | None = None,
    xids_watched: bool | None = None,
) -> dict[str, Any]:
    """The device object of DESIGN.md section 6; unsupported fields are null, never 0.
    ``xids_watched``: whether its XID events reach the supervisor (None: not watched by
    anything, as ``gpu-supervisor gpus`` reads a GPU once)."""
    worker_of = worker_of or {}
    throttle = d.throttle_reasons
    rows = d.remapped_rows
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
        "power_limit_watts": d.power_limit_watts,
        "encoder_util_percent": d.encoder_percent,
        "decoder_util_percent": d.decoder_percent,
        "temperature_slowdown_celsius": d.temperature_slowdown_c,
        "temperature_shutdown_celsius": d.temperature_shutdown_c,
        "throttle_reasons": None if throttle is None else list(throttle),
        "cpu_affinity": None if d.cpus is None else format_cpulist(d.cpus),
        "recovery_action": recovery_action_name(d.recovery_action),
        "ecc_errors": (
            None
            if d.ecc_errors_corrected is None and d.ecc_errors_uncorrected is None
            else {"corrected": d.ecc_errors_corrected, "uncorrected": d.ecc_errors_uncorrected}
        ),
        "remapped_rows": None
        if rows is None
        else {
            "correctable": rows.correctable,
            "uncorrectable": rows.uncorrectable,
            "pending": rows.pending,
            "failure": rows.failure,
        },
        "retired_pages_pending": d.retired_pages_pending,
        "healthy": d.healthy and quarantined is None,
        "error": d.error if quarantined is None else d.error or f"quarantined: {quarantined}",
        "cordoned": cordoned,
        "suspect": suspect,
        "quarantined": quarantined is not None,
        "hot": hot,
        "xids_watched": xids_watched,
        "processes": None
        if d.processes is None
        else [
            {"pid": p.pid, "worker": worker_of.get(p.pid), "used_mb": p.used_mb}
            for p in d.processes
        ],
    }


def exit_object(status: ExitStatus | None) -> dict[str, Any]:
    """``{"code", "signal", "signal_name"}`` (all null when the process never ran)."""
    if status is None:
        return {"code": None, "signal": None, "signal_name": None}
    return {"code": status.code, "signal": status.signal, "signal_name": status.signal_name}


@dataclass(frozen=True, slots=True)
class StateWorker:
    """One worker as ``state.json`` records it."""

    name: str
    group: str
    state: str
    pid: int | None
    pid_create_time: float | None
    gpus: tuple[str, ...] | None
    restarts: int
    port: int | None
    tree: tuple[tuple[int, float], ...] = ()  # (pid, create time) of the whole process tree


def state_doc(
    *,
    written_at: float,
    supervisor_pid: int,
    version: str,
    started_at: float,
    workers: Sequence[StateWorker],
    devices: Sequence[Mapping[str, Any]],
    nvml_available: bool,
    reclaimed: Sequence[Mapping[str, Any]] = (),
    stopped: bool = False,
    boot_time: float | None = None,
    boot_id: str = "",
) -> dict[str, Any]:
    """The ``state.json`` document (DESIGN.md section 8).

    ``boot_time``/``boot_id``: the boot time the create times were computed with (``btime``,
    read once) and the kernel's boot id, so the next supervisor can compare start times in
    kernel ticks however the wall clock was stepped meanwhile.
    """
    return {
        "schema_version": STATE_SCHEMA_VERSION,
        "written_at": rfc3339(written_at),
        "supervisor": {
            "pid": supervisor_pid,
            "version": version,
            "started_at": rfc3339(started_at),
            "stopped": stopped,
            "reclaimed": list(reclaimed),
            "boot_time": boot_time,
            "boot_id": boot_id,
        },
        "workers": [
            {
                "name": w.name,
                "group": w.group,
                "state": w.state,
                "pid": w.pid,
                "pid_create_time": w.pid_create_time,
                "gpus": None if w.gpus is None else list(w.gpus),
                "restarts": w.restarts,
                "port": w.port,
                "tree": [{"pid": pid, "create_time": ct} for pid, ct in w.tree],
            }
            for w in workers
        ],
        "nvml_available": nvml_available,
        "devices": list(devices),
    }


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What a post-mortem says about the worker whose process ended."""

    name: str
    group: str
    index: int
    pid: int | None
    command: tuple[str, ...]
    gpus: tuple[str, ...] | None
    port: int | None
    started_at: float | None  # wall clock
    ended_at: float  # wall clock
    restarts: int
    #: how long the process ran, from the monotonic clock (the wall clock may have been
    #: stepped meanwhile); None: from the wall-clock times
    uptime_s: float | None = None


@dataclass(frozen=True, slots=True)
class SamplePoint:
    """One of the worker's recent samples."""

    at: float  # wall clock
    gpu_memory_mb: float | None
    host_rss_mb: float | None
    cpu_percent: float | None


#: Parts of a flag's or a variable's name that make its value a secret (``--api-key``,
#: ``--hf-token``, ``OPENAI_API_KEY``, ``--db-password``, ``--client_secret``).
_SECRET_WORDS = frozenset(
    {"token", "key", "apikey", "secret", "password", "passwd", "credential", "credentials"}
)
_SECRET_SUFFIXES = ("token", "key", "secret", "password")
_ENV_WORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
#: What a masked value reads as.
MASK = "***"


def _secret_name(name: str) -> bool:
    """``name`` (a flag without its dashes, or a variable) is named like a secret."""
    lowered = name.lower()
    words = re.split(r"[-_.]+", lowered)
    return any(w in _SECRET_WORDS for w in words) or lowered.endswith(_SECRET_SUFFIXES)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` as it may be written down (post-mortems, logs, ``check-config``): the values of
    flags named like a secret (``--api-key X``, ``--hf-token=X``) and of ``NAME=value`` words
    (``env OPENAI_API_KEY=X app``) are ``MASK``. A flag followed by another flag, or by
    nothing, takes no value: nothing is masked after it."""
    shown = list(argv)
    for i, arg in enumerate(shown):
        if any(c.isspace() for c in arg):  # a shell's command (``sh -c "app --api-key X"``)
            shown[i] = _redact_shell(arg)
        elif arg.startswith("-"):
            name, eq, _ = arg.lstrip("-").partition("=")
            if not _secret_name(name):
                continue
            if eq:
                shown[i] = f"{arg[: arg.index('=')]}={MASK}"
            elif i + 1 < len(shown) and not argv[i + 1].startswith("-"):
                shown[i + 1] = MASK
        elif (m := _ENV_WORD.fullmatch(arg)) is not None and _secret_name(m.group(1)):
            shown[i] = f"{m.group(1)}={MASK}"
    return shown


#: In a shell's command line: ``--flag value``, ``--flag=value`` and ``NAME=value`` (a value
#: quoted or not).
_SHELL_PAIR = re.compile(
    r"""(?P<flag>(?<![^\s])--?(?P<fname>[A-Za-z0-9][A-Za-z0-9_.-]*))(?P<sep>=|[ \t]+)"""
    r"""(?P<fvalue>'[^']*'|"[^"]*"|[^\s'"-][^\s]*)"""
    r"""|(?<![^\s])(?P<vname>[A-Za-z_][A-Za-z0-9_]*)=(?P<vvalue>'[^']*'|"[^"]*"|\S*)"""
)


def _redact_shell(text: str) -> str:
    """``text`` (a shell's command line) with the values of secret-named flags and
    variables ``MASK``."""

    def mask(m: re.Match[str]) -> str:
        if m.group("flag") is not None:
            if not _secret_name(m.group("fname")):
                return m.group(0)
            return f"{m.group('flag')}{m.group('sep')}{MASK}"
        if not _secret_name(m.group("vname")):
            return m.group(0)
        return f"{m.group('vname')}={MASK}"

    return _SHELL_PAIR.sub(mask, text)


def redact_url(url: str) -> str:
    """``url`` as it may be shown: a password in it and the values of query parameters named
    like a secret (``?token=X``, ``&api_key=X``) are ``MASK``."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:{MASK}@{netloc.rpartition('@')[2]}"
    query = (
        "&".join(
            f"{name}={MASK}" if sep and _secret_name(name) else f"{name}{sep}{value}"
            for name, sep, value in (item.partition("=") for item in parts.query.split("&"))
        )
        if parts.query
        else ""
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def postmortem_id(ended_at: float, worker: str, reason: str) -> str:
    """``20261203T083644.123456Z-gpen-1-exit``: sortable by time, safe on any filesystem."""
    secs, micro = divmod(round(ended_at * 1_000_000), 1_000_000)
    compact = datetime.fromtimestamp(secs, UTC).strftime("%Y%m%dT%H%M%S") + f".{micro:06d}Z"
    safe_worker = _UNSAFE.sub("_", worker)[:80] or "worker"
    safe_reason = _UNSAFE.sub("_", reason)[:40] or "unknown"
    return f"{compact}-{safe_worker}-{safe_reason}"


def postmortem_doc(
    *,
    id_: str,
    worker: WorkerFacts,
    status: ExitStatus | None,
    reason: str,
    evidence: Mapping[str, Any],
    samples: Iterable[SamplePoint],
    devices: Sequence[Mapping[str, Any]],
    log_tail: Sequence[str],
    events: Iterable[Event],
) -> dict[str, Any]:
    """The post-mortem document (DESIGN.md section 8)."""
    if reason not in POSTMORTEM_REASONS:
        raise ValueError(f"unknown post-mortem reason {reason!r}")
    uptime = worker.uptime_s
    if uptime is None and worker.started_at is not None:
        uptime = max(0.0, worker.ended_at - worker.started_at)
    return {
        "schema_version": POSTMORTEM_SCHEMA_VERSION,
        "id": id_,
        "worker": {
            "name": worker.name,
            "group": worker.group,
            "index": worker.index,
            "pid": worker.pid,
            "command": redact_argv(worker.command),  # no API keys on disk
            "gpus": None if worker.gpus is None else list(worker.gpus),
            "port": worker.port,
            "started_at": None if worker.started_at is None else rfc3339(worker.started_at),
            "ended_at": rfc3339(worker.ended_at),
            "uptime_s": None if uptime is None else round(uptime, 3),
            "restarts": worker.restarts,
        },
        "exit": exit_object(status),
        "reason": reason,
        "evidence": dict(evidence),
        "samples": [
            {
                "t": rfc3339(s.at),
                "gpu_memory_mb": s.gpu_memory_mb,
                "host_rss_mb": None if s.host_rss_mb is None else round(s.host_rss_mb, 3),
                "cpu_percent": None if s.cpu_percent is None else round(s.cpu_percent, 2),
            }
            for s in samples
        ],
        "devices": list(devices),
        "log_tail": list(log_tail),
        "events": [e.to_json() for e in events],
    }
