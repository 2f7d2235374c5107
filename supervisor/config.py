"""Configuration: a TOML file plus ``GPU_SUPERVISOR_<SECTION>__<KEY>`` environment overrides.

Validation only, no I/O beyond reading the file. Every error becomes one ``ConfigError`` line
that names the file, the key path and the bad value (``demo.toml: workers[1].stop_timeout_s:
must be >= 0 (got -1)``). Unknown keys are rejected so that typos are caught.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import string
import tomllib
import typing
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from supervisor.errors import ConfigError
from supervisor.model import DEVICE_FATAL_XIDS, WORKER_FATAL_XIDS, parse_cpulist

ENV_PREFIX = "GPU_SUPERVISOR_"
ENV_DELIMITER = "__"

#: Placeholders allowed in ``command``, ``env`` values and the ``ready`` URL.
PLACEHOLDERS = frozenset({"name", "group", "index", "port", "gpus"})

#: Ports handed out to groups that do not set ``port_base``.
DEFAULT_PORT_BASE = 8001
#: The most MiB a memory figure of the config may say (an EiB: no GPU or host has it; beyond
#: about 1.7e302 MiB a byte count is no finite number, and memory.max could not be written).
MAX_MEMORY_MB = float(2**40)
#: The highest TCP port.
MAX_PORT = 65535

#: ``[[workers]] user``: a user (name or number) and optionally ``:`` a group (POSIX portable
#: names, plus the trailing ``$`` of machine accounts and the ``@domain`` of the names SSSD
#: gives directory accounts: ``svc-gpu@corp.example.com``).
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.@-]*\$?(:[A-Za-z0-9_.][A-Za-z0-9_.@-]*\$?)?")
#: The largest user or group number (``uid_t``/``gid_t`` are 32 bits; the top one, -1, means
#: "leave unchanged" to setresuid/setresgid).
MAX_ID = 2**32 - 2
#: Words of letters, digits, '_' and '.' joined by single dashes, the last one no number
#: (``gpen-1`` reads as a worker of a group ``gpen``): ``qwen2-7b``, ``llama-3.1-8b``.
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.]*(-[A-Za-z0-9_][A-Za-z0-9_.]*)*$")
_ENDS_IN_A_NUMBER = re.compile(r"-[0-9]+$")


class _Strict(BaseModel):
    # inf and nan are valid TOML floats, but no setting means anything with them
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False
    )

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        """``postmortem_keep = true`` would be 1: a boolean is no number here."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                if isinstance(value, bool) and field is not None and _numeric(field.annotation):
                    raise ValueError(f"{key}: expected a number, not a boolean (got {value})")
        return data


def _numeric(annotation: object) -> bool:
    """``int``, ``float``, or an optional one (``int | None``): not a bool."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) else (annotation,)
    return bool({int, float} & set(options)) and bool not in options


#: The longest duration any key takes (about 31 years): more is a typo, and past it the
#: arithmetic on it overflows (``watchdog_s = 1e308`` made WATCHDOG_USEC an OverflowError).
MAX_SECONDS = 1e9
#: The shortest watchdog: WATCHDOG_USEC is whole microseconds, and sd_notify libraries take 0
#: as "no watchdog" (the worker would never ping, and be killed as hung at every start).
MIN_WATCHDOG_S = 0.001
NonNegativeSeconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Xid = Annotated[int, Field(ge=1, strict=True)]  # NVML's XID numbers start at 1
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]


#: A Prometheus label name (``__param_<name>`` of a scrape target).
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def metrics_target(metrics_path: str) -> tuple[str, dict[str, str]]:
    """``metrics_path`` as Prometheus scrapes it: the URL path (``__metrics_path__``) and the
    query parameters (``__param_<name>``: one value each, the first). Prometheus puts
    ``__metrics_path__`` in the URL's path, escaping a ``?``: a query must go as params."""
    path, _, query = metrics_path.partition("?")
    params: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        params.setdefault(name, value)
    return path, params


def _signal_name(value: object) -> object:
    """Accept ``SIGTERM``, ``TERM`` or a signal number; return the canonical name."""
    if isinstance(value, bool):
        raise ValueError("expected a signal name such as 'SIGTERM'")
    if isinstance(value, int):
        try:
            return signal.Signals(value).name
        except ValueError:
            raise ValueError(f"unknown signal number {value}") from None
    if isinstance(value, str):
        if value == "":
            return value
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        if name not in signal.Signals.__members__:
            raise ValueError(f"unknown signal {value!r}")
        return name
    raise ValueError("expected a signal name such as 'SIGTERM'")


SignalName = Annotated[str, BeforeValidator(_signal_name)]


def parse_signal(value: str | int) -> str:
    """``SIGTERM``, ``TERM`` or a number as the canonical name (``ValueError`` saying why)."""
    return str(_signal_name(value))


def _gpus_value(value: object) -> object:
    if value in ("auto", "none"):
        return value
    if isinstance(value, list):
        out: list[int | str] = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int | str):
                raise ValueError(f"GPU entries are indices or UUIDs, got {item!r}")
            if isinstance(item, int) and item < 0:
                raise ValueError(f"GPU index must be >= 0, got {item}")
            if isinstance(item, str) and not item.strip():
                raise ValueError("GPU UUID must not be empty")
            out.append(item)
        if not out:
            raise ValueError('empty GPU list: use "none" for no GPU')
        if len(set(out)) != len(out):
            raise ValueError(f"duplicate GPU in {value!r}")
        return tuple(out)
    raise ValueError('expected "auto", "none" or a list of GPU indices or UUIDs')


GpuSelection = Annotated[
    Literal["auto", "none"] | tuple[int | str, ...], BeforeValidator(_gpus_value)
]


def _path_value(value: object) -> object:
    """A path as written, refused where no file can have it: a NUL character (every system
    call on it fails; regression: ``run`` crashed with a traceback, ``check-config`` passed)."""
    if isinstance(value, str) and "\0" in value:
        raise ValueError("contains a NUL character")  # the message adds (got 'the path')
    return value


class SupervisorSection(_Strict):
    """``[supervisor]``."""

    state_dir: Path = Path("/var/lib/gpu-supervisor")

    @field_validator("state_dir", mode="before")
    @classmethod
    def _state_dir_named(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            raise ValueError('an empty path (write "." for the current directory)')
        return _path_value(value)

    shutdown_timeout_s: PositiveSeconds = 30.0
    sample_interval_s: float = Field(default=0.5, ge=0.05, le=60)
    log_max_bytes: int = Field(default=52_428_800, ge=0)
    log_backups: int = Field(default=5, ge=0)
    postmortem_keep: int = Field(default=200, ge=1)
    systemd_ready: Literal["groups", "start"] = "groups"
    #: at most this many workers starting at once (spawned, not yet ready: loading a model),
    #: across groups; the others wait their turn before they are spawned. 0: no limit
    max_starting: int = Field(default=0, ge=0, le=4096)


class GpuSection(_Strict):
    """``[gpu]``."""

    backend: Literal["auto", "nvml", "sim", "none"] = "auto"
    sim_dir: Path = Path("./sim")
    sim_devices: int = Field(default=2, ge=0, le=64)

    @field_validator("sim_dir", mode="before")
    @classmethod
    def _sim_dir_named(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():  # regression: the cwd was the world
            raise ValueError('an empty path (write "." for the current directory)')
        return _path_value(value)

    reserve_mb: float = Field(default=512, ge=0, le=MAX_MEMORY_MB)
    release_timeout_s: NonNegativeSeconds = 10.0
    # Thermal/power: hot = a heat or power clock-event reason, or within thermal_margin_c of the
    # slowdown threshold, for thermal_sustain_s; cool again after thermal_clear_s below it.
    thermal_margin_c: float = Field(default=5.0, ge=0, le=50)
    thermal_sustain_s: NonNegativeSeconds = 10.0
    thermal_clear_s: NonNegativeSeconds = 30.0
    # XID classes (NVML.md section 2); an XID in neither list is counted only.
    xid_worker_fatal: tuple[Xid, ...] = WORKER_FATAL_XIDS
    xid_device_fatal: tuple[Xid, ...] = DEVICE_FATAL_XIDS

    @model_validator(mode="after")
    def _xid_lists_disjoint(self) -> GpuSection:
        both = sorted(set(self.xid_worker_fatal) & set(self.xid_device_fatal))
        if both:
            raise ValueError(
                f"xid_worker_fatal and xid_device_fatal both list {', '.join(map(str, both))}"
            )
        return self


_DEFAULT_LISTEN = "127.0.0.1:9811"


class ApiSection(_Strict):
    """``[api]``: where the HTTP API listens and who may use it."""

    listen: str = _DEFAULT_LISTEN
    token_file: Path | None = None
    auth_read: bool = False
    #: ``Host`` names (without port) a loopback listener accepts besides loopback names and
    #: addresses: a reverse proxy on this machine that forwards its own ``Host``
    allowed_hosts: tuple[str, ...] = ()

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name or any(c.isspace() or c in "/:@" for c in name):
                raise ValueError(f"allowed_hosts: not a host name without port: {name!r}")
        return tuple(n.lower().rstrip(".") for n in value)

    @field_validator("token_file", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else _path_value(value)

    @field_validator("listen")
    @classmethod
    def _listen_shape(cls, value: str) -> str:
        parse_listen(value)
        return value

    @model_validator(mode="after")
    def _no_open_bind_without_token(self) -> ApiSection:
        kind, host, _ = parse_listen(self.listen)
        if kind == "tcp" and not is_loopback(host) and self.token_file is None:
            raise ValueError(
                f"listen: {self.listen!r} is not a loopback address and no token_file is set "
                "(set api.token_file, or listen on 127.0.0.1 or a unix socket)"
            )
        if self.auth_read and self.token_file is None:
            raise ValueError("auth_read: needs api.token_file")
        return self


def parse_listen(value: str) -> tuple[Literal["tcp", "unix", "off"], str, int]:
    """``"127.0.0.1:9811"`` -> ("tcp", host, port); ``"unix:/path"`` -> ("unix", path, 0).

    ``""`` turns the API off; port 0 picks a free port (logged in ``api.listening``). IPv6
    hosts are written in brackets: ``"[::1]:9811"``.
    """
    if value == "":
        return ("off", "", 0)
    if value.startswith("unix:"):
        path = value[len("unix:") :]
        if not path.startswith("/") or len(os.fsencode(path)) > 107:
            raise ValueError(
                f"unix socket path must be absolute and at most 107 bytes (got {value!r})"
            )
        return ("unix", path, 0)
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f'expected "HOST:PORT" or "unix:/path" (got {value!r})')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"missing host before the port (got {value!r})")
    # no name or address has these (a URL, an IPv6 literal with one bracket): refused here,
    # not when `run` fails to resolve it (regression: check-config passed it)
    if any(c.isspace() or c in "[]/@?#" for c in host):
        what = "a host and port, not a URL" if "://" in value else "IPv6 in brackets: [::1]:9811"
        raise ValueError(f'expected "HOST:PORT" or "unix:/path", {what} (got {value!r})')
    return ("tcp", host, int(port))


#: Names for the loopback interface in common ``/etc/hosts`` files (besides ``localhost`` and
#: ``*.localhost``, RFC 6761).
LOOPBACK_NAMES = frozenset(
    {
        "localhost",
        "localhost.localdomain",
        "localhost4",
        "localhost4.localdomain4",
        "localhost6",
        "localhost6.localdomain6",
        "ip6-localhost",
        "ip6-loopback",
    }
)


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (``127.x``, ``::1``): what may be listened on
    without a token (names other than ``localhost`` are resolved at bind time)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_name(host: str) -> bool:
    """A ``Host`` header naming the loopback interface: ``localhost`` and its usual aliases,
    ``*.localhost`` (RFC 6761), a loopback address or an IPv4-mapped one; case and a trailing
    dot do not matter."""
    host = host.lower().rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def token_problem(token: str) -> str | None:
    """What is wrong with a bearer token as a value (None: nothing). A token is sent in an HTTP
    header: printable ASCII without spaces (RFC 6750's characters and a few more); anything else
    could never be sent or matched. The message never contains the token."""
    if not token:
        return "empty"
    if not all("!" <= c <= "~" for c in token):
        return "must be one token of printable ASCII characters (no spaces, no non-ASCII)"
    return None


def redact_url(url: str) -> str:
    """``scheme://host[:port]`` of a URL, for logs and messages: userinfo, path and query may
    hold tokens (a webhook's secret is often its path)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "<invalid url>"
    if not parts.scheme or not host:
        return "<invalid url>"
    netloc = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{netloc}" + (f":{port}" if port is not None else "")


def http_url(value: str, placeholders: bool = False) -> bool:
    """``value`` is an http(s) URL that can be used as it is: a host, a port (if any) that is a
    number of 1-65535, no space. ``placeholders``: ``{port}`` and the like count as a number."""
    if any(c.isspace() for c in value):
        return False
    if placeholders:
        value = re.sub(r"\{[^{}]*\}", "1", value)
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port  # ValueError: not a number, or out of range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


class AlertsSection(_Strict):
    """``[alerts]``."""

    webhook_url: str = ""

    @field_validator("webhook_url")
    @classmethod
    def _url_shape(cls, value: str) -> str:
        if value and not http_url(value):
            raise ValueError("expected an http:// or https:// URL with a host (and a valid port)")
        return value


class RestartSection(_Strict):
    """``[workers.restart]``."""

    delay_s: NonNegativeSeconds = 0.0
    stable_s: NonNegativeSeconds = 10.0
    backoff_initial_s: NonNegativeSeconds = 1.0
    backoff_max_s: NonNegativeSeconds = 60.0
    burst: int = Field(default=5, ge=0)
    interval_s: PositiveSeconds = 120.0

    @model_validator(mode="after")
    def _max_covers_initial(self) -> RestartSection:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s:g}) is below backoff_initial_s "
                f"({self.backoff_initial_s:g})"
            )
        return self


HealAction = Literal["drain", "restart", "alert"]


class HealthSection(_Strict):
    """``[workers.health]``: budgets, watchdog, leak detection and the healing actions."""

    gpu_memory_limit_mb: float = Field(default=0, ge=0, le=MAX_MEMORY_MB)
    host_memory_limit_mb: float = Field(default=0, ge=0, le=MAX_MEMORY_MB)
    watchdog_s: NonNegativeSeconds = 0.0
    leak_warmup_s: NonNegativeSeconds = 60.0
    leak_window_s: float = Field(default=600.0, ge=5, le=86_400)
    leak_min_mb_per_min: float = Field(default=10.0, gt=0)
    oom_horizon_s: NonNegativeSeconds = 300.0
    on_leak: HealAction = "drain"
    on_over_budget: HealAction = "restart"
    on_thermal: Literal["derate", "migrate", "cordon", "alert", "none"] = "derate"
    log_restart_patterns: tuple[str, ...] = (
        "CUDA error: an illegal memory access",
        "device-side assert triggered",
    )
    max_unavailable: int = Field(default=1, ge=1)
    #: a worker ready this long is drained and restarted (0: never), plus up to
    #: ``max_age_jitter_s`` more, drawn for each process (workers started together are not
    #: all due together); ``max_unavailable`` holds, as for healing
    max_age_s: NonNegativeSeconds = 0.0
    max_age_jitter_s: NonNegativeSeconds = 0.0
    #: after ready: an HTTP URL (placeholders allowed) asked every ``liveness_interval_s``;
    #: ``liveness_failures`` in a row without a 2xx within ``liveness_timeout_s`` -> hung ->
    #: restart (as a missing WATCHDOG=1: for servers that do not speak sd_notify)
    liveness_url: str = ""
    liveness_interval_s: PositiveSeconds = 10.0
    liveness_timeout_s: PositiveSeconds = 5.0
    liveness_failures: int = Field(default=3, ge=1, le=1000)
    #: "torch": Python workers report what PyTorch's allocator holds (worker_site/sitecustomize.py)
    in_use_reporter: Literal["none", "torch"] = "none"

    @field_validator("watchdog_s")
    @classmethod
    def _watchdog_measurable(cls, value: float) -> float:
        if 0 < value < MIN_WATCHDOG_S:  # WATCHDOG_USEC would be 0: "no watchdog" to the worker
            raise ValueError(f"0 (off) or at least {MIN_WATCHDOG_S} s")
        return value

    @field_validator("liveness_url")
    @classmethod
    def _liveness_shape(cls, value: str) -> str:
        if value and not http_url(value, placeholders=True):
            raise ValueError(
                'expected "" (off) or an http:// (or https://) health URL with a host (and a '
                "valid port)"
            )
        return value

    @field_validator("log_restart_patterns")
    @classmethod
    def _patterns_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for i, pattern in enumerate(value):
            if not pattern.strip():
                raise ValueError(f"entry {i} is empty (it would match every line)")
        return value


#: The largest finite resource limit (``rlim_t`` is 64 bits; the top value is "unlimited").
MAX_RLIMIT = 2**63 - 1
_UNLIMITED_WORDS = ("unlimited", "infinity")


def _rlimit_one(value: object) -> int | None:
    """A number of the limit's unit, or ``"unlimited"`` (None)."""
    if isinstance(value, str) and value.lower() in _UNLIMITED_WORDS:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        if value > MAX_RLIMIT:
            raise ValueError(f'above {MAX_RLIMIT}: write "unlimited"')
        return value
    raise ValueError('expected a whole number >= 0, "unlimited", or [soft, hard]')


def _rlimit(value: object) -> object:
    """``N`` or ``"unlimited"`` (soft and hard limit alike), or ``[soft, hard]``."""
    if isinstance(value, list | tuple):
        if len(value) != 2:
            raise ValueError("expected [soft, hard]: two values")
        soft, hard = _rlimit_one(value[0]), _rlimit_one(value[1])
        if hard is not None and (soft is None or soft > hard):
            shown = "unlimited" if soft is None else soft
            raise ValueError(f"the soft limit ({shown}) is above the hard limit ({hard})")
        return (soft, hard)
    one = _rlimit_one(value)
    return (one, one)


#: ``(soft, hard)``; None is "unlimited".
RLimit = Annotated[tuple[int | None, int | None], BeforeValidator(_rlimit)]


class LimitsSection(_Strict):
    """``[workers.limits]``: resource limits (``setrlimit``) each worker starts with, soft and
    hard; a limit not set is the supervisor's own, inherited."""

    core: RLimit | None = None  # bytes of a core dump (0: none)
    memlock: RLimit | None = None  # bytes of locked memory (pinned buffers, RDMA)
    nofile: RLimit | None = None  # open files
    nproc: RLimit | None = None  # processes and threads of the workers' user
    stack: RLimit | None = None  # bytes of the main thread's stack

    @model_validator(mode="before")
    @classmethod
    def _not_address_space(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "as" in data:
                raise ValueError(
                    "as: never limited here: CUDA reserves far more address space than it "
                    "uses, and the worker would fail to start on a GPU "
                    "(health.host_memory_limit_mb limits its memory)"
                )
            if "data" in data:
                raise ValueError(
                    "data: not offered: it counts a process's writable mappings, not the "
                    "memory it uses (health.host_memory_limit_mb limits its memory)"
                )
        return data

    @field_validator("nofile")
    @classmethod
    def _files_finite(cls, value: tuple[int | None, int | None] | None) -> object:
        if value is not None and None in value:
            raise ValueError(
                "Linux has no unlimited open files: at most fs.nr_open (1048576 by default)"
            )
        return value

    def items(self) -> tuple[tuple[str, int | None, int | None], ...]:
        """``(name, soft, hard)`` for each limit set, in a fixed order."""
        out = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is not None:
                out.append((name, value[0], value[1]))
        return tuple(out)


class WorkerGroup(_Strict):
    """One ``[[workers]]`` table: a group of identical workers."""

    name: str
    command: tuple[str, ...] = Field(min_length=1)
    replicas: int = Field(default=1, ge=0, le=4096, strict=True)  # not "3", 2.0 or true
    env: dict[str, str] = Field(default_factory=dict)
    #: the workers' working directory (placeholders allowed; relative: to the supervisor's);
    #: "" = the supervisor's own
    cwd: str = ""
    #: who the workers run as: "NAME" or "UID" (its primary and supplementary groups from the
    #: user database), "NAME:GROUP" for another primary group; "" = the supervisor's own user
    user: str = ""
    #: the CPUs the workers may run on: "gpu" (those close to the worker's GPUs: their NUMA
    #: node's), a CPU list ("0-7,16-23"), or "" (the supervisor's own, inherited)
    cpu_affinity: str = ""
    gpus: GpuSelection = "auto"
    gpus_per_worker: int = Field(default=1, ge=1)
    max_workers_per_gpu: int = Field(default=4, ge=1)
    port_base: int | None = Field(default=None, ge=1, le=65535)
    ready: str = "notify"
    metrics_path: str = ""
    log_passthrough: bool = False
    start_timeout_s: PositiveSeconds = 120.0
    stop_signal: SignalName = "SIGTERM"
    stop_timeout_s: NonNegativeSeconds = 10.0
    drain_signal: SignalName = ""
    drain_timeout_s: NonNegativeSeconds = 30.0
    restart: RestartSection = Field(default_factory=RestartSection)
    health: HealthSection = Field(default_factory=HealthSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not _GROUP_NAME.fullmatch(value) or _ENDS_IN_A_NUMBER.search(value) or len(value) > 64:
            raise ValueError(
                "group names are letters, digits, '_', '.' and '-' (not ending in -<number>), "
                "at most 64 characters"
            )
        return value

    @field_validator("command")
    @classmethod
    def _command_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value[0].strip():
            raise ValueError("the program (first element) is empty")
        for arg in value:
            if "\0" in arg:  # exec cannot pass it
                raise ValueError(f"an argument contains a NUL character: {arg!r}")
        return value

    @field_validator("stop_signal")
    @classmethod
    def _stop_signal_set(cls, value: str) -> str:
        if not value:
            raise ValueError("stop_signal must name a signal")
        return value

    @field_validator("ready")
    @classmethod
    def _ready_shape(cls, value: str) -> str:
        if value in ("notify", "none") or http_url(value, placeholders=True):
            return value
        raise ValueError(
            'expected "notify", "none" or an http:// (or https://) health URL with a host '
            "(and a valid port)"
        )

    @field_validator("metrics_path")
    @classmethod
    def _metrics_path_shape(cls, value: str) -> str:
        if value and (not value.startswith("/") or any(c.isspace() for c in value)):
            raise ValueError('expected an absolute URL path such as "/metrics"')
        if "#" in value:
            raise ValueError(f"a URL path has no fragment (got {value!r})")
        _, params = metrics_target(value)
        for name in params:
            if not _LABEL_NAME.fullmatch(name):
                raise ValueError(
                    f"query parameter {name!r}: Prometheus takes only names of letters, digits "
                    f"and '_' (not starting with a digit) as __param_<name> (got {value!r})"
                )
        return value

    @field_validator("cwd")
    @classmethod
    def _cwd_shape(cls, value: str) -> str:
        if "\0" in value:  # exec cannot pass it
            raise ValueError(f"contains a NUL character: {value!r}")
        return value

    @field_validator("user")
    @classmethod
    def _user_shape(cls, value: str) -> str:
        if value and not _USER.fullmatch(value):
            raise ValueError(
                'expected "NAME", "UID", "NAME:GROUP" or "UID:GID" (user and group names of '
                "letters, digits, '_', '.', '-' and '@')"
            )
        for part in value.split(":"):
            if part.isdigit() and int(part) > MAX_ID:
                raise ValueError(f"{part} is above the largest user or group number {MAX_ID}")
        return value

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_affinity_shape(cls, value: str) -> str:
        if value in ("", "gpu"):
            return value
        try:
            parse_cpulist(value)
        except ValueError as exc:
            raise ValueError(
                f'expected "gpu", "" or a CPU list such as "0-7,16-23" ({exc})'
            ) from None
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"invalid environment variable name {key!r}")
        for key, val in value.items():
            if "\0" in val:  # exec cannot pass it
                raise ValueError(f"the value of {key} contains a NUL character: {val!r}")
        return value

    @property
    def ready_mode(self) -> Literal["notify", "http", "none"]:
        """How readiness is detected."""
        if self.ready in ("notify", "none"):
            return "notify" if self.ready == "notify" else "none"
        return "http"

    @property
    def moves_off_heat(self) -> bool:
        """Its workers are migrated off hot GPUs (``on_thermal = "migrate"``; only placed
        groups, ``gpus = "auto"``, can move)."""
        return self.health.on_thermal == "migrate" and self.gpus == "auto"

    def worker_names(self) -> list[str]:
        """``gpen-0``, ``gpen-1``, ..."""
        return [f"{self.name}-{i}" for i in range(self.replicas)]


def _expanded_url_error(group: WorkerGroup, url: str, ports: Sequence[int]) -> str | None:
    """Why ``url`` is no usable URL for one of the group's workers once its placeholders are
    filled in (``http://127.0.0.1:{port}{port}/`` reads as a URL with "1" for each, but no
    worker's is one: every probe failed at run time), or None."""
    if "{" not in url:
        return None
    for index, port in enumerate(ports):
        values = {
            "name": f"{group.name}-{index}",
            "group": group.name,
            "index": str(index),
            "port": str(port),
            "gpus": "",
        }
        expanded = url.format_map(values)
        if not http_url(expanded):
            return f"{expanded!r} (worker {values['name']}) is no http(s) URL with a valid port"
    return None


def _placeholder_errors(text: str) -> str | None:
    """Return a message for the first bad placeholder in ``text``, or None."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        return f"bad placeholder syntax ({exc}); write {{{{ and }}}} for literal braces"
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if field not in PLACEHOLDERS or spec or conversion:
            known = " ".join("{" + p + "}" for p in sorted(PLACEHOLDERS))
            return (
                f"unknown placeholder {{{field}}} (known: {known}; write {{{{ and }}}} for "
                "literal braces)"
            )
    return None


def _taken_ports(
    data: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], listen: object = None
) -> list[range]:
    """The ports a raw config already claims: the API's and the groups' with a ``port_base``.
    ``listen``: the API's address where the environment sets it (None: the file's)."""
    taken: list[range] = []
    api = data.get("api")
    if listen is None:
        listen = api.get("listen", _DEFAULT_LISTEN) if isinstance(api, dict) else _DEFAULT_LISTEN
    with contextlib.suppress(ValueError):  # a bad listen value is reported by its own check
        kind, _, api_port = parse_listen(listen if isinstance(listen, str) else "")
        if kind == "tcp" and api_port:
            taken.append(range(api_port, api_port + 1))  # the API's own port
    for g in groups:
        base, replicas = g.get("port_base"), g.get("replicas", 1)
        if isinstance(base, int) and isinstance(replicas, int) and replicas >= 0:
            taken.append(range(base, base + replicas))
    return taken


def keep_port_bases(
    data: Mapping[str, Any],
    running: Mapping[str, range],
    held: Mapping[str, Sequence[range]] | None = None,
    *,
    listen: str | None = None,
) -> dict[str, Any]:
    """``data`` (a raw config) with each group that has no ``port_base`` given the one it runs
    with (``running``: group -> its ports now) where its ports, as many as its replicas now, are
    free: a reload that scales one group never moves another's ports, and a group keeps its own
    while it fits. Groups that keep or shrink their range go first, then those that grow; one
    that no longer fits gets a free range as usual. ``held``: group -> ports its workers hold
    outside its ``running`` range (a roll-out that stopped part-way): no other group's.
    ``listen``: ``api.listen`` as the environment overrides it (None: the file's)."""
    held = held or {}
    groups = data.get("workers")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return dict(data)
    taken = _taken_ports(data, groups, listen)
    # a name as written: one missing or no string (``name = true``) is the validation's to
    # report (regression: looked up as the text it reads as, KeyError, the supervisor crashed)
    names = {g.get("name") for g in groups if isinstance(g.get("name"), str)}
    wanted: dict[int, range] = {}
    for i, g in enumerate(groups):
        name, replicas = g.get("name"), g.get("replicas", 1)
        now = running.get(name) if isinstance(name, str) else None
        if g.get("port_base") is None and now is not None and isinstance(replicas, int):
            wanted[i] = range(now.start, now.start + max(replicas, 0))
    grows = {i for i, ports in wanted.items() if ports.stop > running[groups[i]["name"]].stop}
    kept: dict[int, int] = {}
    for i in sorted(wanted, key=lambda i: (i in grows, i)):
        # a group that grows must not take ports another group still listens on (its own
        # may have moved, but its workers hold the old ones until they are restarted)
        busy = [r for n, r in running.items() if n in names and n != groups[i]["name"]]
        others = [r for n, rs in held.items() if n != groups[i]["name"] for r in rs]
        if not any(
            _overlaps(wanted[i], r) for r in [*taken, *others, *(busy if i in grows else ())]
        ):
            taken.append(wanted[i])
            kept[i] = wanted[i].start
    # The others get free ranges now, outside every range in use (a group that moves holds
    # its old ports until its rollout has restarted each of its workers).
    taken += running.values()
    taken += [r for rs in held.values() for r in rs]
    for i, g in enumerate(groups):
        replicas = g.get("replicas", 1)
        if i not in kept and g.get("port_base") is None and isinstance(replicas, int):
            kept[i] = _first_free(max(replicas, 0), taken)
            taken.append(range(kept[i], kept[i] + max(replicas, 0)))
    out = [{**g, "port_base": kept[i]} if i in kept else g for i, g in enumerate(groups)]
    return {**data, "workers": out}


def _first_free(replicas: int, taken: Sequence[range]) -> int:
    """The lowest base from ``DEFAULT_PORT_BASE`` whose ``replicas`` ports are not taken, or
    65536 (refused by the validation) when none is below it: a range taken by a group with a
    ``replicas`` typo'd into the billions (refused too) made this search all but endless."""
    base = DEFAULT_PORT_BASE
    while base <= MAX_PORT and any(_overlaps(range(base, base + replicas), r) for r in taken):
        base += 1
    return base


def _ports_of(group: WorkerGroup) -> range:
    assert group.port_base is not None
    return range(group.port_base, group.port_base + group.replicas)


class Settings(BaseSettings):
    """The whole configuration. Build it with ``load_settings(path)``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_DELIMITER,
        extra="forbid",
        case_sensitive=False,
        validate_default=True,
        frozen=True,
    )

    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)
    gpu: GpuSection = Field(default_factory=GpuSection)
    api: ApiSection = Field(default_factory=ApiSection)
    alerts: AlertsSection = Field(default_factory=AlertsSection)
    workers: tuple[WorkerGroup, ...] = ()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's content arrives as init kwargs; the environment overrides it.
        return (env_settings, init_settings)

    @model_validator(mode="before")
    @classmethod
    def _assign_ports(cls, data: Any) -> Any:
        """Give groups without ``port_base`` consecutive free port ranges from 8001 on."""
        if not isinstance(data, dict):
            return data
        groups = data.get("workers")
        if not isinstance(groups, list | tuple) or not all(isinstance(g, dict) for g in groups):
            return data
        taken = _taken_ports(data, groups)
        out = []
        for g in groups:
            if g.get("port_base") is None and isinstance(g.get("replicas", 1), int):
                replicas = max(int(g.get("replicas", 1)), 0)
                base = _first_free(replicas, taken)
                taken.append(range(base, base + replicas))
                g = {**g, "port_base": base}
            out.append(g)
        return {**data, "workers": out}

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        names: dict[str, int] = {}
        for i, group in enumerate(self.workers):
            if group.name in names:
                raise ValueError(
                    f"workers[{i}].name: duplicate group name {group.name!r} "
                    f"(also workers[{names[group.name]}])"
                )
            names[group.name] = i
        all_workers = {w: g.name for g in self.workers for w in g.worker_names()}
        for i, group in enumerate(self.workers):
            if group.name in all_workers:
                raise ValueError(
                    f"workers[{i}].name: group name {group.name!r} is also a worker of group "
                    f"{all_workers[group.name]!r}"
                )
            for j, arg in enumerate(group.command):
                if (msg := _placeholder_errors(arg)) is not None:
                    raise ValueError(f"workers[{i}].command[{j}]: {msg} (got {arg!r})")
            for key, val in group.env.items():
                if (msg := _placeholder_errors(val)) is not None:
                    raise ValueError(f"workers[{i}].env.{key}: {msg} (got {val!r})")
            if group.ready_mode == "http" and (msg := _placeholder_errors(group.ready)):
                raise ValueError(f"workers[{i}].ready: {msg} (got {group.ready!r})")
            live = group.health.liveness_url
            if live and (msg := _placeholder_errors(live)):
                raise ValueError(f"workers[{i}].health.liveness_url: {msg} (got {live!r})")
            if (msg := _placeholder_errors(group.cwd)) is not None:
                raise ValueError(f"workers[{i}].cwd: {msg} (got {group.cwd!r})")
            ports = _ports_of(group)
            if ports and ports[-1] > 65535:
                raise ValueError(
                    f"workers[{i}].port_base: ports {ports[0]}-{ports[-1]} go past 65535"
                )
            for key, url in (
                ("ready", group.ready if group.ready_mode == "http" else ""),
                ("health.liveness_url", live),
            ):
                if (why := _expanded_url_error(group, url, ports)) is not None:
                    raise ValueError(f"workers[{i}].{key}: {why} (got {url!r})")
            kind, _, api_port = parse_listen(self.api.listen)
            if kind == "tcp" and api_port in ports:
                raise ValueError(
                    f"workers[{i}].port_base: ports {ports[0]}-{ports[-1]} of group "
                    f"{group.name!r} include the API's port {api_port} (api.listen)"
                )
        for i, a in enumerate(self.workers):
            for j in range(i + 1, len(self.workers)):
                b = self.workers[j]
                if _overlaps(_ports_of(a), _ports_of(b)):
                    pa, pb = _ports_of(a), _ports_of(b)
                    raise ValueError(
                        f"workers[{j}].port_base: ports {pb[0]}-{pb[-1]} of group {b.name!r} "
                        f"overlap ports {pa[0]}-{pa[-1]} of group {a.name!r}"
                    )
        return self

    def group(self, name: str) -> WorkerGroup | None:
        """The group called ``name``, if any."""
        return next((g for g in self.workers if g.name == name), None)


def _overlaps(a: range, b: range) -> bool:
    return bool(a) and bool(b) and a.start < b.stop and b.start < a.stop


def _loc_path(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def _env_name_for(loc: tuple[int | str, ...], environ: Mapping[str, str]) -> str | None:
    """The environment variable that set ``loc``, if one did (so the message can say so)."""
    for depth in range(len(loc), 0, -1):
        parts = loc[:depth]
        if not all(isinstance(p, str) for p in parts):
            continue
        name = ENV_PREFIX + ENV_DELIMITER.join(str(p) for p in parts).upper()
        if any(k.upper() == name for k in environ):
            return name
        if depth == len(loc) > 1:  # a path below the key (``GPU_SUPERVISOR_GPU__BACKEND__X``)
            deeper = sorted(k for k in environ if k.upper().startswith(name + ENV_DELIMITER))
            if deeper:
                return deeper[0]
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def format_validation_error(
    source: str, exc: ValidationError, environ: Mapping[str, str] | None = None
) -> str:
    """One line: ``file: key.path: message (got value)``, plus how many more errors there are."""
    environ = os.environ if environ is None else environ
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(p for p in first["loc"] if isinstance(p, int | str))
    msg = str(first["msg"])
    kind = first["type"]
    path = _loc_path(loc)
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if msg.startswith("Assertion failed, "):
        msg = msg[len("Assertion failed, ") :]
    msg = msg.replace("Tuple should", "List should").replace("valid tuple", "valid list")
    inner = re.match(r"^([a-z_]+): (.*)$", msg)
    value = first.get("input")
    if inner and kind == "value_error" and isinstance(value, dict) and inner[1] in value:
        # A model-level check about one of its keys: name that key, show its value.
        loc = (*loc, inner[1])
        msg = inner[2]
        value = value[inner[1]]
        first = {**first, "input": value}
        path = _loc_path(loc)
    if kind == "extra_forbidden":
        msg = "unknown key"
    elif kind == "missing":
        msg = "required key is missing"
    line = f"{source}: {path}: {msg}" if path else f"{source}: {msg}"
    whole_section = isinstance(first.get("input"), dict)  # a check of several keys at once
    if kind not in ("missing",) and "(got " not in msg and path and not whole_section:
        shown = first.get("input")
        if path.endswith("webhook_url") and isinstance(shown, str):
            shown = redact_url(shown)  # its path or query is often the secret
        line += f" (got {_short(shown)})"
    env_name = _env_name_for(loc, environ) if loc else None
    if env_name:
        line += f" [from {env_name}]"
    elif whole_section and len(loc) == 1 and isinstance(loc[0], str):
        # a check of several keys of a section: those the environment sets are named
        # (regression: "xid_worker_fatal and xid_device_fatal both list 46" sent the user to a
        # file whose lists did not overlap: one came from GPU_SUPERVISOR_GPU__XID_...)
        prefix = f"{ENV_PREFIX}{loc[0]}{ENV_DELIMITER}".upper()
        names = sorted(k for k in environ if k.upper().startswith(prefix))
        if names:
            line += f" [the environment sets {', '.join(names)}]"
    if len(errors) > 1:
        line += f" (and {len(errors) - 1} more)"
    return line


#: ``GPU_SUPERVISOR_*`` names that start like an override with one underscore but are not one:
#: the client's API token, and the budget every worker gets (a supervisor started from a
#: worker's environment sees it).
NOT_OVERRIDES = frozenset({"GPU_SUPERVISOR_API_TOKEN", "GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB"})


def _check_env_names(source: str, environ: Mapping[str, str]) -> None:
    """An override whose section is misspelled (``GPU_SUPERVISOR_SUPERVISR__STATE_DIR``) or
    that has one underscore where two are due (``GPU_SUPERVISOR_SUPERVISOR_STATE_DIR``) would
    be silently ignored: it is an error, as an unknown key is. (Other ``GPU_SUPERVISOR_*``
    names are the workers' own variables, or the API token: not overrides.)"""
    sections = [name.upper() for name in Settings.model_fields]
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX.upper()):
            continue
        rest = upper[len(ENV_PREFIX) :]
        section, delimiter, _ = rest.partition(ENV_DELIMITER)
        if delimiter and section not in sections:
            known = ", ".join(f"{ENV_PREFIX}{s}{ENV_DELIMITER}..." for s in sections)
            raise ConfigError(
                f"{source}: environment variable {name}: unknown section {section.lower()!r}"
                f" (overrides are {known})"
            )
        if delimiter and section == "WORKERS":  # a list: no keys of its own to reach
            raise ConfigError(
                f"{source}: environment variable {name}: the worker groups are a list, not "
                f"reachable key by key: set {ENV_PREFIX}WORKERS to the whole list as JSON, or "
                "edit the config file"
            )
        if delimiter or upper in NOT_OVERRIDES:
            continue
        for known_section in sections:
            if rest.startswith(known_section + "_"):
                key = rest[len(known_section) + 1 :]
                fixed = f"{ENV_PREFIX}{known_section}{ENV_DELIMITER}{key}"
                raise ConfigError(
                    f"{source}: environment variable {name}: a section and its key are "
                    f"separated by two underscores (did you mean {fixed}?)"
                )


def parse_settings(data: Mapping[str, Any], source: str = "<config>") -> Settings:
    """Validate already-parsed TOML data (environment overrides applied)."""
    _check_env_names(source, os.environ)
    try:
        return Settings(**dict(data))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc)) from None
    except SettingsError as exc:  # an environment override that is not JSON where JSON is due
        raise ConfigError(_env_parse_error(source, exc)) from None


def _env_parse_error(source: str, exc: SettingsError) -> str:
    field = re.search(r'field "([^"]+)"', str(exc))
    section = field.group(1) if field else ""
    name = ENV_PREFIX + section.upper()
    value = next((v for k, v in os.environ.items() if k.upper() == name), None)
    if value is None:  # a key of the section: the one whose value is JSON to be, and is not
        name, value = _bad_json_override(section) or (name, None)
    why = f"not valid JSON ({exc.__cause__})" if exc.__cause__ else str(exc)
    return f"{source}: environment variable {name}: {why} (got {_short(value)})"


def _bad_json_override(section: str) -> tuple[str, str] | None:
    """The ``GPU_SUPERVISOR_<SECTION>__<KEY>`` whose key takes a list or a table (given as
    JSON) and whose value is no JSON."""
    info = Settings.model_fields.get(section)
    model = info.annotation if info is not None else None
    if not isinstance(model, type) or not issubclass(model, BaseModel):
        return None
    prefix = f"{ENV_PREFIX}{section}{ENV_DELIMITER}".upper()
    for name, value in os.environ.items():
        if not name.upper().startswith(prefix):
            continue
        key = model.model_fields.get(name[len(prefix) :].lower())
        if key is None or typing.get_origin(key.annotation) not in (list, tuple, dict, set):
            continue
        try:
            json.loads(value)
        except ValueError:
            return name, value
    return None


def load_settings(
    path: str | os.PathLike[str],
    keep_ports: Mapping[str, range] | None = None,
    held_ports: Mapping[str, Sequence[range]] | None = None,
    *,
    data: Mapping[str, Any] | None = None,
    refuse_empty: bool = False,
) -> Settings:
    """Read and validate the TOML file at ``path``; raise ``ConfigError`` with one line.

    ``keep_ports``: the ports the groups run with (a reload): see ``keep_port_bases``.
    ``data``: the file's TOML as :func:`read_config` read it before (then it is not read
    again: what was checked then is what is applied). ``refuse_empty``: a file with nothing in
    it is refused (a reload: it would remove every group, and is rather a write cut short;
    ``workers = []`` says it on purpose; where the environment names the workers, it would
    still set every key the file sets to its default)."""
    source = str(path)
    data = read_config(path) if data is None else dict(data)
    if refuse_empty and not data:
        if _env_names("workers"):  # the workers stay: what the file set would not
            raise ConfigError(
                f"{source}: the config file is empty (a write cut short?): a reload to it "
                "would set every key the file sets to its default; the workers come from "
                "GPU_SUPERVISOR_WORKERS, which a reload does not change"
            )
        raise ConfigError(
            f"{source}: the config file is empty (a write cut short?): a reload to it would "
            "stop every worker; to remove every group on purpose, write workers = []"
        )
    _check_toml_types(data, Settings, "", source)
    if keep_ports:
        data = keep_port_bases(data, keep_ports, held_ports, listen=_env_listen())
    return parse_settings(data, source)


def _env_overrides() -> dict[str, Any] | None:
    """The top-level keys the environment sets (``GPU_SUPERVISOR_...``), None where they
    cannot be read (the validation says why)."""
    try:
        return dict(EnvSettingsSource(Settings)())
    except (SettingsError, ValueError):
        return None


def _env_names(key: str) -> bool:
    """Whether the environment sets the top-level key ``key`` (``GPU_SUPERVISOR_WORKERS``...)."""
    env = _env_overrides()
    return env is None or key in env  # set, but not readably: the validation says so


def _env_listen() -> str | None:
    """``api.listen`` as the environment overrides it (``GPU_SUPERVISOR_API__LISTEN``, or
    ``GPU_SUPERVISOR_API`` as JSON), None where it does not (or not readably: the validation
    says so): the port the API takes is not a group's to keep on a reload."""
    api = (_env_overrides() or {}).get("api")
    listen = api.get("listen") if isinstance(api, dict) else None
    return listen if isinstance(listen, str) else None


#: What the client commands read of a config file: where the API is and its token
#: (``[api]``), ``state_dir`` (``[supervisor]``), the GPU backend (``[gpu]``).
CLIENT_SECTIONS = ("supervisor", "api", "gpu")


def load_client_settings(path: str | os.PathLike[str]) -> tuple[Settings, str | None]:
    """The settings the client commands (``status``, ``drain``, ``postmortem``...) need, and a
    warning when the file has a mistake elsewhere (a worker group being edited): they only
    read ``CLIENT_SECTIONS``, and ``status`` is most needed right after a file was broken.
    A mistake in those sections, or a file that is no TOML, is still a ``ConfigError``."""
    try:
        return load_settings(path), None
    except ConfigError as full:
        data = read_config(path)
        partial = {k: v for k, v in data.items() if k in CLIENT_SECTIONS}
        try:
            _check_toml_types(partial, Settings, "", str(path))
            settings = parse_settings(partial, str(path))
        except ConfigError:
            raise full from None
        return (
            settings,
            f"{full} (only its {', '.join(f'[{k}]' for k in CLIENT_SECTIONS)} used here)",
        )


def environment_client_settings() -> Settings:
    """The settings a client command run without ``-c FILE`` uses: ``CLIENT_SECTIONS`` as the
    ``GPU_SUPERVISOR_*`` environment sets them, defaults elsewhere. A supervisor configured
    so (a container's environment, which ``docker exec`` passes on) is found where it listens
    (regression: the default ``127.0.0.1:9811`` was asked whatever
    ``GPU_SUPERVISOR_API__LISTEN`` said, and ``gpus`` ignored ``GPU_SUPERVISOR_GPU__*``). An
    override of another section is not read here (a worker group's mistake is ``run``'s)."""
    source = "environment"
    try:
        env = _ClientEnvironment()
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc)) from None
    except SettingsError as exc:  # a section's override that is not JSON where JSON is due
        raise ConfigError(_env_parse_error(source, exc)) from None
    # (its sections validated: no other section's override is read, nor validated again)
    return Settings.model_construct(supervisor=env.supervisor, gpu=env.gpu, api=env.api)


class _ClientApi(ApiSection):
    """``[api]`` as a client reads it from the environment alone: where the API is. Not held
    to what a server needs to listen (a non-loopback address or ``auth_read`` with a token
    file), which the supervisor's config file may complete: the token then comes from
    ``GPU_SUPERVISOR_API_TOKEN`` (regression: exit 2, "no token_file is set")."""

    @model_validator(mode="after")
    def _no_open_bind_without_token(self) -> _ClientApi:
        return self


class _ClientEnvironment(BaseSettings):
    """The sections a client command reads (``CLIENT_SECTIONS``), to read their environment
    overrides alone (``environment_client_settings``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, case_sensitive=False
    )

    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)
    gpu: GpuSection = Field(default_factory=GpuSection)
    api: _ClientApi = Field(default_factory=_ClientApi)


#: A config file is read up to this size (a few kB in practice).
MAX_CONFIG_BYTES = 16 * 2**20


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML of the config file at ``path``, not yet validated (``ConfigError``)."""
    source = str(path)
    try:
        with open(path, "rb") as fh:  # bounded: /dev/zero or a log file by mistake
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{source}: larger than {MAX_CONFIG_BYTES // 2**20} MiB: not a config file"
            )
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: TOML syntax error: {exc}") from None


def _check_toml_types(
    data: Mapping[str, Any], model: type[BaseModel], path: str, source: str
) -> None:
    """TOML has types: a string or a number where a flag is due, or a string where a number is
    due, is a mistake in the file (``log_passthrough = "yes"``, ``shutdown_timeout_s = "30"``),
    refused here. Environment overrides, all strings, are converted as before."""
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            continue  # unknown keys are reported by the validation
        where = f"{path}{key}"
        annotation = field.annotation
        if annotation is bool and not isinstance(value, bool):
            raise ConfigError(f"{source}: {where}: expected true or false (got {value!r})")
        if _numeric(annotation) and isinstance(value, str):
            raise ConfigError(f"{source}: {where}: expected a number, not a string (got {value!r})")
        nested = _model_in(annotation)
        if nested is None:
            continue
        if isinstance(value, dict):
            _check_toml_types(value, nested, f"{where}.", source)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    _check_toml_types(item, nested, f"{where}[{i}].", source)


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The model a field holds, alone or as the items of a tuple (``tuple[WorkerGroup, ...]``)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) else (annotation,)
    for option in options:
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option
    return None
