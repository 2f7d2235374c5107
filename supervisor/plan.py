"""Pure planning: settings -> the launch specs of every worker (argv, env, port, GPUs).

No I/O: the inherited environment and the notify socket path are arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.config import Settings, WorkerGroup
from supervisor.model import LaunchSpec

#: Variables of the supervisor's own service manager that must not leak into workers.
SCRUBBED_ENV = frozenset(
    {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"}
)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The launch specs of one group, plus the group config they came from."""

    group: WorkerGroup
    workers: tuple[LaunchSpec, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """Every group's plan, in config order, and the warnings planning produced."""

    groups: tuple[GroupPlan, ...]
    warnings: tuple[str, ...]

    def worker(self, name: str) -> LaunchSpec | None:
        """The spec of the worker called ``name``, if any."""
        for g in self.groups:
            for w in g.workers:
                if w.name == name:
                    return w
        return None


def gpu_assignment(group: WorkerGroup) -> tuple[str, ...] | None:
    """GPUs for each worker of ``group`` without GPU telemetry (DESIGN.md section 4).

    ``"auto"`` places nothing (None: ``CUDA_VISIBLE_DEVICES`` stays unset), an explicit list is
    passed through as written, ``"none"`` is the empty tuple (``CUDA_VISIBLE_DEVICES=""``).
    """
    if group.gpus == "auto":
        return None
    if group.gpus == "none":
        return ()
    return tuple(str(g) for g in group.gpus)


def _expand(text: str, values: Mapping[str, str]) -> str:
    return text.format_map(values)


def launch_spec(
    group: WorkerGroup,
    index: int,
    inherited_env: Mapping[str, str],
    notify_socket: str | None,
) -> LaunchSpec:
    """The spec of worker ``index`` of ``group``."""
    assert group.port_base is not None  # config assigns every group a port range
    name = f"{group.name}-{index}"
    port = group.port_base + index
    gpus = gpu_assignment(group)
    values = {
        "name": name,
        "group": group.name,
        "index": str(index),
        "port": str(port),
        "gpus": ",".join(gpus or ()),
    }
    argv = tuple(_expand(a, values) for a in group.command)
    env = {k: v for k, v in inherited_env.items() if k not in SCRUBBED_ENV}
    env.update({k: _expand(v, values) for k, v in group.env.items()})
    env.update(
        {
            "PORT": str(port),
            "GPU_SUPERVISOR_WORKER": name,
            "GPU_SUPERVISOR_GROUP": group.name,
            "GPU_SUPERVISOR_INDEX": str(index),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
    )
    if gpus is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    watchdog_s = group.health.watchdog_s
    wants_notify = group.ready_mode == "notify" or watchdog_s > 0
    if wants_notify and notify_socket is not None:
        env["NOTIFY_SOCKET"] = notify_socket
    if watchdog_s > 0:
        env["WATCHDOG_USEC"] = str(int(watchdog_s * 1_000_000))
    ready_url = _expand(group.ready, values) if group.ready_mode == "http" else None
    return LaunchSpec(
        name=name,
        group=group.name,
        index=index,
        argv=argv,
        env=env,
        port=port,
        gpus=gpus,
        ready_url=ready_url,
        notify=group.ready_mode == "notify",
        watchdog_s=watchdog_s,
    )


def build_plan(
    settings: Settings, inherited_env: Mapping[str, str], notify_socket: str | None
) -> Plan:
    """Plan every worker of every group."""
    warnings: list[str] = []
    auto = [g.name for g in settings.workers if g.gpus == "auto" and g.replicas]
    if auto:
        warnings.append(
            'gpus = "auto" without GPU telemetry places nothing: CUDA_VISIBLE_DEVICES is left '
            f"unset for group(s) {', '.join(auto)}"
        )
    groups: list[GroupPlan] = []
    for group in settings.workers:
        specs = tuple(
            launch_spec(group, i, inherited_env, notify_socket) for i in range(group.replicas)
        )
        groups.append(GroupPlan(group=group, workers=specs))
    return Plan(groups=tuple(groups), warnings=tuple(warnings))
