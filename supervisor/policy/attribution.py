"""Per-worker GPU memory from NVML's process lists (pure).

NVML reports host pids. A worker's usage is the sum over every pid of its process tree. Some
drivers list a process in a PID namespace of its own under its pid there: ``aliases`` (from
``NSpid``) maps such a pid to ours, when it is not one of ours already and the worker it names is
placed on that GPU. Where no pid matches (a container without the host PID namespace) usage is
attributed by device when each of the worker's GPUs belongs to that worker alone, and is
otherwise ``unavailable``, never 0.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from supervisor.model import DeviceSample, GpuProcess


@dataclass(frozen=True, slots=True)
class GpuUsage:
    """One worker's GPU memory: total, per GPU UUID, and how it was attributed."""

    total_mb: float | None
    by_gpu: Mapping[str, float]
    attribution: str  # "pid" | "device" | "unavailable" | "none"


def sane_processes(device: DeviceSample) -> tuple[GpuProcess, ...]:
    """Drop impossible entries: pid <= 0, negative use, use above the device's total."""
    out = []
    total = device.memory_total_mb
    for p in device.processes or ():
        if p.pid <= 0:
            continue
        used = p.used_mb
        if used is not None and (used < 0 or (total is not None and used > total)):
            used = None
        out.append(GpuProcess(p.pid, used))
    return tuple(out)


def attribute(
    devices: tuple[DeviceSample, ...],
    trees: Mapping[str, frozenset[int]],
    assigned: Mapping[str, tuple[str, ...] | None],
    visible_pids: frozenset[int],
    aliases: Mapping[int, int] | None = None,
) -> dict[str, GpuUsage]:
    """GPU memory of each worker in ``trees`` (worker -> pids of its whole process tree).

    ``visible_pids`` are the pids that exist in the supervisor's PID namespace: an NVML pid
    outside it belongs to a namespace we cannot see (the case for device attribution).
    ``aliases``: pid in a worker's own PID namespace -> its pid here.
    """
    procs = {d.uuid: sane_processes(d) for d in devices if d.healthy and d.processes is not None}
    listable = {d.uuid for d in devices if d.healthy and d.processes is not None}
    owners: dict[str, list[str]] = {}
    for name, uuids in assigned.items():
        for u in uuids or ():
            owners.setdefault(u, []).append(name)
    known_pids = frozenset().union(*trees.values()) if trees else frozenset()
    if aliases:
        procs = {
            u: _resolve(plist, u, aliases, known_pids, trees, assigned)
            for u, plist in procs.items()
        }
    # Each listed process is looked up once (not every tree scanned for every process).
    trees_of: dict[int, list[str]] = {}
    for name, tree in trees.items():
        for pid in tree:
            trees_of.setdefault(pid, []).append(name)
    found: dict[str, dict[str, float]] = {}  # worker -> GPU -> MiB of its listed processes
    unknown_amount: set[str] = set()
    for uuid, plist in procs.items():
        for p in plist:
            for name in trees_of.get(p.pid, ()):
                by = found.setdefault(name, {})
                if p.used_mb is None:
                    unknown_amount.add(name)
                else:
                    by[uuid] = by.get(uuid, 0.0) + p.used_mb
    out: dict[str, GpuUsage] = {}
    for name in trees:
        gpus = assigned.get(name) or ()
        by_gpu = found.get(name)
        if by_gpu is not None:
            # One process of the tree whose amount NVML does not give makes the total unknown:
            # the sum of the others would understate it (and hide a leak or a budget breach).
            if name in unknown_amount:
                out[name] = GpuUsage(None, {}, "pid")
            elif not all(u in listable for u in gpus):
                # one of its GPUs cannot list its processes (an NVML error this tick, lost):
                # what it holds on the others is not its total (regression: a tensor-parallel
                # worker was reported with half its memory)
                out[name] = GpuUsage(None, {}, "unavailable")
            else:
                out[name] = GpuUsage(sum(by_gpu.values()), by_gpu, "pid")
            continue
        if not gpus:
            out[name] = GpuUsage(None, {}, "none")
            continue
        if not all(u in listable for u in gpus):
            out[name] = GpuUsage(None, {}, "unavailable")
            continue
        foreign = {
            u: [p for p in procs[u] if p.pid not in known_pids and p.pid not in visible_pids]
            for u in gpus
        }
        if not any(foreign.values()):
            out[name] = GpuUsage(
                0.0, dict.fromkeys(gpus, 0.0), "pid"
            )  # listed, and nothing is ours
            continue
        if all(owners.get(u) == [name] for u in gpus):
            amounts = [p.used_mb for u in gpus for p in foreign[u]]
            if any(a is None for a in amounts):
                out[name] = GpuUsage(None, {}, "unavailable")
                continue
            by_dev = {u: sum(p.used_mb or 0.0 for p in foreign[u]) for u in gpus}
            out[name] = GpuUsage(sum(by_dev.values()), by_dev, "device")
            continue
        out[name] = GpuUsage(None, {}, "unavailable")
    return out


def _resolve(
    plist: tuple[GpuProcess, ...],
    uuid: str,
    aliases: Mapping[int, int],
    known: frozenset[int],
    trees: Mapping[str, frozenset[int]],
    assigned: Mapping[str, tuple[str, ...] | None],
) -> tuple[GpuProcess, ...]:
    """``plist`` with namespace-local pids replaced by ours, where that is unambiguous."""
    worker_of = {pid: n for n, t in trees.items() for pid in t}
    out = []
    for p in plist:
        if alias_owner(p.pid, uuid, aliases, worker_of, assigned) is not None:
            p = GpuProcess(aliases[p.pid], p.used_mb)
        out.append(p)
    return tuple(out)


def alias_owner(
    pid: int,
    uuid: str,
    aliases: Mapping[int, int],
    worker_of: Mapping[int, str],
    assigned: Mapping[str, tuple[str, ...] | None],
) -> str | None:
    """The worker that NVML's ``pid`` on GPU ``uuid`` stands for when it is a pid in the
    worker's own PID namespace: not one of ours, an alias of one of ours, and the worker placed
    on that GPU; else None."""
    ours = aliases.get(pid)
    if pid in worker_of or ours is None:
        return None
    owner = worker_of.get(ours)
    return owner if owner is not None and uuid in (assigned.get(owner) or ()) else None


def still_held(
    suspect: Mapping[str, frozenset[int]],
    listed: Mapping[str, frozenset[int] | None],
) -> dict[str, frozenset[int]]:
    """Which of the old pids each suspect GPU waits for are still listed on *that* GPU
    (``listed``: GPU UUID -> the pids NVML lists there now, namespace aliases resolved; None
    or missing: not known this sample, so all are kept). A GPU with none left is released
    (absent from the result). Regression: a pid still listed on another GPU (a worker on two
    GPUs whose stuck process let go of one) kept this one suspect."""
    out: dict[str, frozenset[int]] = {}
    for uuid, pids in suspect.items():
        there = listed.get(uuid)
        held = pids if there is None else pids & there
        if held:
            out[uuid] = held
    return out


def listed_for_suspects(
    devices: Iterable[DeviceSample],
    suspect: Mapping[str, frozenset[int]],
    inner_of: Callable[[frozenset[int]], Mapping[int, Collection[int]]],
) -> dict[str, frozenset[int] | None]:
    """The pids NVML lists now on each suspect GPU (``still_held``'s ``listed``), each old
    pid also found under its pid in a PID namespace of its own: ``inner_of(pids)`` maps
    such inner pids of ``pids`` (still running) to theirs, all of them where several share
    one (each namespace's init is pid 1 there: which one holds the memory cannot be told, so
    each is taken to, while it runs; regression: an ambiguous pid was dropped, and the GPU
    released while their memory was held). Asked GPU by GPU (regression: two stuck namespace
    inits on two GPUs were one lookup, ambiguous). A GPU whose process list is not known is
    left out (kept suspect)."""
    listed: dict[str, frozenset[int] | None] = {}
    for d in devices:
        pids = suspect.get(d.uuid)
        if not pids or d.processes is None:
            continue
        there = {p.pid for p in d.processes}
        inner = inner_of(pids)
        there |= {host for p in there for host in inner.get(p, ())}
        listed[d.uuid] = frozenset(there)
    return listed
