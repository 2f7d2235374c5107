"""Pure planning: settings -> the launch specs of every worker (argv, env, port, GPUs).

No I/O: the inherited environment and the notify socket path are arguments.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.config import Settings, WorkerGroup
from supervisor.errors import PlacementError
from supervisor.model import (
    Account,
    DeviceSample,
    LaunchSpec,
    Liveness,
    format_cpulist,
    parse_cpulist,
)

#: worker name -> GPU UUIDs (None: CUDA_VISIBLE_DEVICES left unset)
Assignment = Mapping[str, tuple[str, ...] | None]

#: Variables of the supervisor's own service manager that must not leak into workers (nor
#: the budget a supervisor started from a worker's environment was given: a worker gets its
#: group's, or none; nor the CLI's API token: a worker could drive the API with it).
SCRUBBED_ENV = frozenset(
    {
        "GPU_SUPERVISOR_API_TOKEN",
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "GPU_SUPERVISOR_IN_USE_SOCKET",
        "GPU_SUPERVISOR_IN_USE_EVERY_S",
        "GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB",
    }
)
#: The directory whose ``sitecustomize.py`` reports a Python worker's in-use GPU memory
#: (``[workers.health] in_use_reporter``): put first on the worker's ``PYTHONPATH``.
WORKER_SITE_DIR = str(Path(__file__).with_name("worker_site"))
#: How often those reporters report for a 600 s leak window (scaled with it): the leak
#: detector's floor interval (``policy.detect.FLOOR_BUCKET_S``; a test keeps them equal).
IN_USE_EVERY_S = 5.0

#: The worker's name in its environment (DESIGN.md section 4); processes that carry it and are
#: re-parented to the supervisor are that worker's leftovers.
WORKER_VAR = "GPU_SUPERVISOR_WORKER"
#: The id of the supervisor's ``state_dir`` (random, kept in ``state_dir/instance``) in every
#: worker's environment: only one running supervisor holds a ``state_dir`` (its lock), so at
#: start-up, before any worker of ours runs, a process that carries ours is a leftover of a
#: killed predecessor (reclaimed). Not the path: containers of one image share it, and with
#: ``--pid=host`` each would take the others' workers for its own leftovers.
INSTANCE_VAR = "GPU_SUPERVISOR_INSTANCE"


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


def _plain(mb: float) -> str:
    """``mb`` as a worker reads it: a whole number in full (no exponent, no ``.0``: what
    ``int()`` takes), else its shortest exact decimal (not rounded to six digits)."""
    return str(int(mb)) if mb.is_integer() else repr(float(mb))


def in_use_reporter_env(pythonpath: str, notify_socket: str, group: WorkerGroup) -> dict[str, str]:
    """The variables that make a Python worker report its in-use GPU memory (torch's).

    ``worker_site/sitecustomize.py`` goes first on ``PYTHONPATH`` (once) and reports to the
    notify socket once per floor interval of the leak window (5 s for the default 600 s window;
    a short window's reporters report more often, at most every 0.05 s).
    """
    # Empty entries stay: Python reads them as the current directory.
    parts = [p for p in pythonpath.split(os.pathsep) if p != WORKER_SITE_DIR] if pythonpath else []
    every = max(0.05, IN_USE_EVERY_S * group.health.leak_window_s / 600.0)
    return {
        "PYTHONPATH": os.pathsep.join([WORKER_SITE_DIR, *parts]),
        "GPU_SUPERVISOR_IN_USE_SOCKET": notify_socket,
        "GPU_SUPERVISOR_IN_USE_EVERY_S": f"{every:g}",
    }


@dataclass(frozen=True, slots=True)
class Cpus:
    """What ``cpu_affinity`` needs to know of the machine: the CPUs close to each GPU (by
    UUID; None: not known) and those the supervisor may run on (its own affinity)."""

    by_gpu: Mapping[str, tuple[int, ...] | None]
    allowed: frozenset[int]


def worker_cpus(
    affinity: str, gpus: tuple[str, ...] | None, cpus: Cpus | None
) -> tuple[tuple[int, ...] | None, str | None]:
    """The CPUs a worker on ``gpus`` is pinned to for ``cpu_affinity = affinity`` (None: it
    inherits the supervisor's), and why ``"gpu"`` pins nothing where it does not."""
    if not affinity:
        return None, None
    if affinity != "gpu":
        return parse_cpulist(affinity), None
    if not gpus or cpus is None:
        return None, "it has no GPU placed by the backend (or no GPU telemetry)"
    close: set[int] = set()
    for uuid in gpus:
        mine = cpus.by_gpu.get(uuid)
        if mine is None:
            return None, f"the backend does not say which CPUs are close to {uuid}"
        close.update(mine)
    usable = close & cpus.allowed
    if not usable:
        return None, (
            f"none of the CPUs close to its GPUs ({format_cpulist(close)}) is one the "
            f"supervisor may use ({format_cpulist(cpus.allowed)})"
        )
    return tuple(sorted(usable)), None


def launch_spec(
    group: WorkerGroup,
    index: int,
    inherited_env: Mapping[str, str],
    notify_socket: str | None,
    gpus: tuple[str, ...] | None,
    *,
    accounts: Mapping[str, Account | str] | None = None,
    shared_notify_socket: str | None = None,
    cpus: Cpus | None = None,
) -> LaunchSpec:
    """The spec of worker ``index`` of ``group`` on ``gpus`` (from ``place``).

    ``accounts``: ``[[workers]] user`` values resolved (``processes.resolve_account``); a
    group whose user is not among them gets a spec that fails to start, never one that runs
    as the supervisor's user. A worker that runs as another user is given
    ``shared_notify_socket`` (one it can reach) where there is one. ``cpus``: see
    :func:`worker_cpus`.
    """
    assert group.port_base is not None  # config assigns every group a port range
    name = f"{group.name}-{index}"
    port = group.port_base + index
    values = {
        "name": name,
        "group": group.name,
        "index": str(index),
        "port": str(port),
        "gpus": ",".join(gpus or ()),
    }
    argv = tuple(_expand(a, values) for a in group.command)
    account: Account | str | None = None
    if group.user:
        account = (accounts or {}).get(group.user, f"user {group.user!r}: not looked up")
    env = {k: v for k, v in inherited_env.items() if k not in SCRUBBED_ENV}
    if isinstance(account, Account):
        env.update(account.environ())
        if account.switch and shared_notify_socket is not None:
            notify_socket = shared_notify_socket
    env.update({k: _expand(v, values) for k, v in group.env.items()})
    if INSTANCE_VAR in inherited_env:  # the supervisor's, never the group's (reclaim)
        env[INSTANCE_VAR] = inherited_env[INSTANCE_VAR]
    else:
        env.pop(INSTANCE_VAR, None)
    env.update(
        {
            "PORT": str(port),
            WORKER_VAR: name,
            "GPU_SUPERVISOR_GROUP": group.name,
            "GPU_SUPERVISOR_INDEX": str(index),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
    )
    if gpus is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if group.health.gpu_memory_limit_mb > 0:
        env["GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB"] = _plain(group.health.gpu_memory_limit_mb)
    watchdog_s = group.health.watchdog_s
    wants_notify = group.ready_mode == "notify" or watchdog_s > 0
    if wants_notify and notify_socket is not None:
        env["NOTIFY_SOCKET"] = notify_socket
    if watchdog_s > 0:
        env["WATCHDOG_USEC"] = str(int(watchdog_s * 1_000_000))
    if group.health.in_use_reporter == "torch" and notify_socket is not None:
        env.update(in_use_reporter_env(env.get("PYTHONPATH", ""), notify_socket, group))
    ready_url = _expand(group.ready, values) if group.ready_mode == "http" else None
    h = group.health
    liveness = (
        Liveness(
            _expand(h.liveness_url, values),
            h.liveness_interval_s,
            h.liveness_timeout_s,
            h.liveness_failures,
        )
        if h.liveness_url
        else None
    )
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
        cwd=_expand(group.cwd, values) or None,
        account=account,
        limits=group.limits.items(),
        cpus=worker_cpus(group.cpu_affinity, gpus, cpus)[0],
        liveness=liveness,
    )


@dataclass(frozen=True, slots=True)
class GpuSlot:
    """A device as placement sees it."""

    index: int
    uuid: str
    total_mb: float | None
    free_mb: float | None = None
    temperature_c: float | None = None
    usable: bool = True  # False when cordoned, unhealthy or suspect
    why_not: str = ""
    cpus: tuple[int, ...] | None = None  # the CPUs close to it (None: not known)
    #: memory held there by processes that are no worker of ours (another supervisor's
    #: workers, the driver): budgets fit under total - max(reserve_mb, others_mb); None: not
    #: known (reserve_mb alone)
    others_mb: float | None = None


#: ``GpuSlot.why_not`` of a GPU that nothing else keeps placements off.
CORDONED = "is cordoned"
#: ``GpuSlot.why_not`` of a GPU where a dead worker's memory is still held (and nothing worse).
SUSPECT = "is suspect (memory of a dead worker still held)"


def may_restart_in_place(
    gpus: Sequence[str], slots: Sequence[GpuSlot], own_suspect: Collection[str] = ()
) -> bool:
    """True when a worker on ``gpus`` may start there again when nothing else fits: none of
    them is unusable for any reason but a cordon (which stops new placements only) or, for the
    GPUs in ``own_suspect``, being suspect because of the worker's own previous process (its
    memory held past ``release_timeout_s``: the worker would otherwise fail every start)."""
    why_not = {s.uuid: s.why_not for s in slots}
    return all(
        why_not.get(u) in ("", CORDONED) or (u in own_suspect and why_not.get(u) == SUSPECT)
        for u in gpus
    )


def slot_for(
    d: DeviceSample, why_not: str | None = None, others_mb: float | None = None
) -> GpuSlot:
    """Device ``d`` as placement sees it; ``why_not``: why nothing may be placed on it now
    (None: only its health counts); ``others_mb``: see ``GpuSlot``."""
    if why_not is None:
        why_not = "" if d.healthy else f"is unhealthy ({d.error})"
    return GpuSlot(
        d.index,
        d.uuid,
        d.memory_total_mb,
        d.memory_free_mb,
        d.temperature_c,
        usable=not why_not,
        why_not=why_not,
        cpus=d.cpus,
        others_mb=others_mb,
    )


def resolve_explicit(group: WorkerGroup, gi: int, devices: Sequence[GpuSlot]) -> tuple[str, ...]:
    """The UUIDs of ``group``'s explicit GPU list (indexes or UUIDs) on ``devices``, the
    ``gi``-th group of the config (``PlacementError`` naming the entry when one is missing)."""
    assert isinstance(group.gpus, tuple)
    by_index: dict[int, str] = {}
    for d in devices:  # the first wins: listed devices come before lost ones no longer listed
        by_index.setdefault(d.index, d.uuid)
    uuids = {d.uuid for d in devices}
    out = []
    for j, entry in enumerate(group.gpus):
        if isinstance(entry, int):
            if entry not in by_index:
                have = ", ".join(str(i) for i in sorted(by_index)) or "none"
                raise PlacementError(
                    f"workers[{gi}].gpus[{j}]: no GPU with index {entry} (GPUs: {have})"
                )
            out.append(by_index[entry])
        elif entry in uuids:
            out.append(entry)
        else:
            raise PlacementError(f"workers[{gi}].gpus[{j}]: no GPU with UUID {entry!r}")
        if out[-1] in out[:-1]:  # one GPU named twice, by its index and its UUID
            first = group.gpus[out.index(out[-1])]
            raise PlacementError(
                f"workers[{gi}].gpus[{j}]: {entry!r} is the GPU of gpus[{out.index(out[-1])}] "
                f"({first!r}) again"
            )
    return tuple(out)


def covering(
    groups: Sequence[WorkerGroup], running: Iterable[tuple[str, int]]
) -> tuple[WorkerGroup, ...]:
    """``groups`` with each one's ``replicas`` raised to cover its workers that still run
    (``running``: ``(group, index)`` of each): a reload that scales a group down removes the
    workers past its new ``replicas`` only at the end of the group's roll-out, and a placement
    meanwhile (one of them restarting off a GPU that became unusable, a migration) places and
    counts them too (regression: ``place`` left such a worker out, KeyError, and the
    supervisor crashed)."""
    top: dict[str, int] = {}
    for name, index in running:
        top[name] = max(top.get(name, 0), index + 1)
    return tuple(
        g.model_copy(update={"replicas": top[g.name]}) if top.get(g.name, 0) > g.replicas else g
        for g in groups
    )


def place(
    groups: Sequence[WorkerGroup],
    devices: Sequence[GpuSlot],
    reserve_mb: float,
    fixed: Assignment | None = None,
    only: set[str] | None = None,
    unplaced: dict[str, str] | None = None,
) -> dict[str, tuple[str, ...] | None]:
    """Assign GPUs to every worker (or to the workers in ``only``, keeping ``fixed`` ones).

    ``unplaced``: when given, a worker that cannot be placed does not raise: why is recorded
    there and the worker gets what it would get without telemetry (:func:`gpu_assignment`: an
    explicit list as written, ``auto`` nothing), to be placed at its start.

    ``gpus = "auto"`` picks, per worker, the usable GPUs with the fewest workers, then the most
    free memory, then the lowest temperature; at most ``max_workers_per_gpu`` workers per GPU;
    with ``gpu_memory_limit_mb`` set, only GPUs where the budgets fit under total - reserve_mb,
    or total less what others hold there where that is more (``GpuSlot.others_mb``).
    Without devices (no telemetry) ``auto`` places nothing (None). Raises ``PlacementError``.
    """
    fixed = dict(fixed or {})
    # One GPU listed twice (two files of a simulated world with one UUID: a copied device
    # file) is one GPU: the first listing stands (regression: gpus_per_worker = 2 put it
    # twice in CUDA_VISIBLE_DEVICES)
    first: dict[str, GpuSlot] = {}
    for d in devices:
        first.setdefault(d.uuid, d)
    devices = list(first.values())
    result: dict[str, tuple[str, ...] | None] = {}
    counts = {d.uuid: 0 for d in devices}
    committed = {d.uuid: 0.0 for d in devices}
    free = {d.uuid: d.free_mb if d.free_mb is not None else d.total_mb for d in devices}

    def take(uuids: tuple[str, ...] | None, budget: float) -> None:
        for u in uuids or ():
            if u in counts:
                counts[u] += 1
                committed[u] += budget
                room = free.get(u)
                if room is not None and budget:
                    free[u] = room - budget

    # Workers that keep their GPUs (not being re-placed) count first.
    for group in groups:
        for i in range(group.replicas):
            name = f"{group.name}-{i}"
            if name in fixed and (only is None or name not in only):
                result[name] = fixed[name]
                take(fixed[name], group.health.gpu_memory_limit_mb)
    # Then the workers on GPUs as listed (explicit lists, "none"): wherever they stand in the
    # config, the auto ones are placed around them (regression: an explicit group after an
    # auto one landed on GPUs the auto workers had filled, budgets over the GPU's memory).
    order = sorted(enumerate(groups), key=lambda item: item[1].gpus == "auto")
    for gi, group in order:
        for i in range(group.replicas):
            name = f"{group.name}-{i}"
            if name in result or (only is not None and name not in only):
                continue
            chosen: tuple[str, ...] | None
            try:
                if group.gpus == "none":
                    chosen = ()
                elif group.gpus != "auto":
                    chosen = (
                        resolve_explicit(group, gi, devices) if devices else gpu_assignment(group)
                    )
                elif not devices:
                    chosen = None
                else:
                    chosen = _pick(group, name, devices, counts, committed, free, reserve_mb)
            except PlacementError as exc:
                if unplaced is None:
                    raise
                unplaced[name] = str(exc)
                chosen = gpu_assignment(group)
            result[name] = chosen
            take(chosen, group.health.gpu_memory_limit_mb)
    return {
        n: result[n]
        for g in groups
        for n in (f"{g.name}-{i}" for i in range(g.replicas))
        if n in result
    }


def _pick(
    group: WorkerGroup,
    name: str,
    devices: Sequence[GpuSlot],
    counts: Mapping[str, int],
    committed: Mapping[str, float],
    free: Mapping[str, float | None],
    reserve_mb: float,
) -> tuple[str, ...]:
    budget = group.health.gpu_memory_limit_mb
    reasons: list[str] = []
    candidates = []
    for d in devices:
        # memory that processes not ours hold there (another supervisor's workers) is not
        # there for our budgets; up to reserve_mb of it is what the reserve is for
        kept = max(reserve_mb, d.others_mb or 0.0)
        if not d.usable:
            reasons.append(f"GPU {d.index} {d.why_not or 'unusable'}")
        elif counts[d.uuid] >= group.max_workers_per_gpu:
            reasons.append(f"GPU {d.index} has {counts[d.uuid]} workers (max_workers_per_gpu)")
        elif budget and (d.total_mb is None or committed[d.uuid] + budget > d.total_mb - kept):
            room = "unknown" if d.total_mb is None else f"{d.total_mb - kept - committed[d.uuid]:g}"
            reasons.append(f"GPU {d.index} has {room} MB left for budgets, needs {budget:g}")
        else:
            candidates.append(d)

    def rank(d: GpuSlot) -> tuple[int, float, float, int]:
        room = free[d.uuid]
        temp = d.temperature_c
        cool = temp if temp is not None else 1e9
        return (counts[d.uuid], -(room if room is not None else -1.0), cool, d.index)

    candidates.sort(key=rank)
    if len(candidates) < group.gpus_per_worker:
        why = "; ".join(reasons) or (f"{len(devices)} GPU(s) in all" if devices else "no GPUs")
        raise PlacementError(
            f"cannot place {name}: needs {group.gpus_per_worker} GPU(s), "
            f"{len(candidates)} available ({why})"
        )
    # the chosen GPUs in index order (nvidia-smi's, PCI bus order), not ranked: the worker's
    # cuda:0 is the lowest of them (regression: the best-ranked first, cuda:0 was GPU 3)
    chosen = sorted(candidates[: group.gpus_per_worker], key=lambda d: d.index)
    return tuple(d.uuid for d in chosen)


def build_plan(
    settings: Settings,
    inherited_env: Mapping[str, str],
    notify_socket: str | None,
    devices: Sequence[GpuSlot] | None = None,
    fixed: Assignment | None = None,
    unplaced: dict[str, str] | None = None,
    *,
    accounts: Mapping[str, Account | str] | None = None,
    shared_notify_socket: str | None = None,
    allowed_cpus: frozenset[int] | None = None,
) -> Plan:
    """Plan every worker of every group; ``devices`` None means no GPU telemetry.

    ``unplaced``: see :func:`place` (without it a worker that cannot be placed raises
    ``PlacementError``). ``accounts``, ``shared_notify_socket``: see :func:`launch_spec`.
    ``allowed_cpus``: the CPUs the supervisor may run on (``cpu_affinity = "gpu"`` pins
    nothing without them)."""
    warnings: list[str] = []
    assignment = place(
        settings.workers, devices or (), settings.gpu.reserve_mb, fixed, unplaced=unplaced
    )
    auto = [g.name for g in settings.workers if g.gpus == "auto" and g.replicas]
    if auto and not devices:
        warnings.append(
            'gpus = "auto" without GPU telemetry places nothing: CUDA_VISIBLE_DEVICES is left '
            f"unset for group(s) {', '.join(auto)}"
        )
    for group in settings.workers:
        ignored = sorted({"gpus_per_worker", "max_workers_per_gpu"} & group.model_fields_set)
        if group.gpus not in ("auto", "none") and ignored:
            warnings.append(
                f"group {group.name}: {' and '.join(ignored)} "
                f'{"apply" if len(ignored) > 1 else "applies"} to gpus = "auto" only; '
                f"with a list every worker gets all of {list(group.gpus)}"
            )
        if group.health.liveness_url and group.ready_mode == "none":
            warnings.append(
                f'group {group.name}: liveness_url with ready = "none": asked from the start, '
                "while it may still be loading (no answer then restarts it as hung); set ready "
                "to its health URL"
            )
        r = group.restart
        if r.burst == 0 and r.backoff_initial_s == 0:
            warnings.append(
                f"group {group.name}: restart.backoff_initial_s = 0 with burst = 0 restarts a "
                "worker that keeps failing at once, for ever (a restart storm): give "
                "backoff_initial_s a length or burst a limit"
            )
        elif r.stable_s == 0 and r.delay_s == 0 and group.ready_mode == "none":
            warnings.append(
                f'group {group.name}: restart.stable_s = 0 with ready = "none" counts every '
                "exit as a stable run, restarted after delay_s = 0: a worker that keeps exiting "
                "is restarted at once, for ever (a restart storm): give stable_s or delay_s "
                "a length"
            )
        if group.health.max_age_s and group.replicas == 1:
            warnings.append(
                f"group {group.name}: max_age_s recycles its only worker: the group serves "
                "nothing while it restarts (with two replicas, one serves meanwhile)"
            )
        elif group.health.max_age_s and 1 < group.replicas <= group.health.max_unavailable:
            warnings.append(
                f"group {group.name}: max_age_s may recycle all {group.replicas} of its "
                f"workers at once (max_unavailable {group.health.max_unavailable}): the group "
                "serves nothing while they restart (keep max_unavailable below replicas)"
            )
    cpus = None if allowed_cpus is None else cpus_of(devices or (), allowed_cpus)
    groups: list[GroupPlan] = []
    for group in settings.workers:
        specs = tuple(
            launch_spec(
                group,
                i,
                inherited_env,
                notify_socket,
                assignment[f"{group.name}-{i}"],
                accounts=accounts,
                shared_notify_socket=shared_notify_socket,
                cpus=cpus,
            )
            for i in range(group.replicas)
        )
        groups.append(GroupPlan(group=group, workers=specs))
        whys = {worker_cpus(group.cpu_affinity, w.gpus, cpus)[1] for w in specs} - {None}
        for why in sorted(w for w in whys if w is not None):
            warnings.append(
                f'group {group.name}: cpu_affinity = "gpu" pins nothing: {why}; its workers '
                "run on the supervisor's CPUs"
            )
    return Plan(groups=tuple(groups), warnings=tuple(warnings))


def cpus_of(devices: Sequence[GpuSlot], allowed: frozenset[int]) -> Cpus:
    """``Cpus`` for placements on ``devices``."""
    return Cpus({d.uuid: d.cpus for d in devices}, allowed)


#: What placement had to go by at a sample: the usable GPUs, and how many worker processes
#: each holds.
Room = tuple[frozenset[str], Mapping[str, int]]


def more_room(before: Room, now: Room) -> bool:
    """True when a GPU may have room now that it had not at ``before``: one became usable
    (back, healthy, released, uncordoned, out of quarantine) or holds fewer worker processes
    (a worker removed, moved or stopped by a reload)."""
    usable_before, held_before = before
    usable_now, held_now = now
    return not usable_now <= usable_before or any(
        held_now.get(u, 0) < n for u, n in held_before.items()
    )
