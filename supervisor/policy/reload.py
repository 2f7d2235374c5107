"""Reload diff (pure): which groups a new configuration leaves alone, changes, removes or adds."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from supervisor.config import Settings, WorkerGroup


@dataclass(frozen=True, slots=True)
class ReloadDiff:
    """Group names by what a reload does to them, each in config order."""

    unchanged: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    added: tuple[str, ...]
    #: the changed groups whose only change is their number of replicas: their workers that
    #: run what the new plan says are left alone (only workers are added or removed)
    scaled: tuple[str, ...] = ()
    #: the changed groups whose placement settings are as before: their workers keep their
    #: GPUs (a new command or env is no reason to move a worker to another GPU)
    same_placement: tuple[str, ...] = ()

    @property
    def is_noop(self) -> bool:
        """True when the reload changes no group."""
        return not (self.changed or self.removed or self.added)


def diff_groups(
    old: Sequence[WorkerGroup],
    new: Sequence[WorkerGroup],
    dirty: Collection[str] = (),
    rolled: Mapping[str, Collection[WorkerGroup]] | None = None,
) -> ReloadDiff:
    """Compare two group lists by name; a group is changed when any of its settings differ.

    ``dirty``: groups whose workers may not match ``old`` (a rollout that halted part-way:
    some run the definition it rolled out, some the one before), changed whatever the files
    say, so that reloading either definition brings every worker to it. ``rolled``: group ->
    the definitions such roll-outs rolled onto some of its workers: the group keeps its
    workers on their GPUs only where their placement is the new one's too (regression: a
    halted roll-out moved a worker onto a GPU, the old file reloaded left it there, on a GPU
    its group's ``gpus`` no longer named)."""
    rolled = rolled or {}
    old_by_name = {g.name: g for g in old}
    new_names = {g.name for g in new}
    unchanged: list[str] = []
    changed: list[str] = []
    added: list[str] = []
    scaled: list[str] = []
    same_placement: list[str] = []
    for g in new:
        before = old_by_name.get(g.name)
        if before is None:
            added.append(g.name)
        elif before == g and g.name not in dirty:
            unchanged.append(g.name)
        else:
            changed.append(g.name)
            if g.name not in dirty and before.model_copy(update={"replicas": g.replicas}) == g:
                scaled.append(g.name)
            ran = [before, *rolled.get(g.name, ())]
            if all(placement_of(r) == placement_of(g) for r in ran):
                same_placement.append(g.name)
    removed = [g.name for g in old if g.name not in new_names]
    return ReloadDiff(
        tuple(unchanged),
        tuple(changed),
        tuple(removed),
        tuple(added),
        tuple(scaled),
        tuple(same_placement),
    )


def placement_of(group: WorkerGroup) -> tuple[object, ...]:
    """What a group's placement on the GPUs depends on (``plan.place``)."""
    return (
        group.gpus,
        group.gpus_per_worker,
        group.max_workers_per_gpu,
        group.health.gpu_memory_limit_mb,
    )


#: ``[gpu]`` keys read once, when the GPU backend is opened; the others apply at a reload.
GPU_AT_START = ("backend", "sim_dir", "sim_devices")
#: ``[supervisor]`` keys a reload applies; the others are read once, at start.
SUPERVISOR_LIVE = ("shutdown_timeout_s", "max_starting")


def start_only_changes(old: Settings, new: Settings) -> tuple[str, ...]:
    """The keys ``new`` changes that only a restart applies (``[supervisor]`` but
    ``shutdown_timeout_s`` and ``max_starting``, the whole ``[api]``: its listener and token
    are set up once, and ``[gpu]``'s backend), as dotted paths in declaration order."""
    out: list[str] = []
    for section, keys in (
        ("supervisor", [k for k in type(old.supervisor).model_fields if k not in SUPERVISOR_LIVE]),
        ("api", list(type(old.api).model_fields)),
        ("gpu", list(GPU_AT_START)),
    ):
        before, after = getattr(old, section), getattr(new, section)
        out += [f"{section}.{k}" for k in keys if getattr(before, k) != getattr(after, k)]
    return tuple(out)


def applied_by_reload(old: Settings, new: Settings) -> Settings:
    """``new`` with the start-only keys (``start_only_changes``) kept at ``old``'s values: the
    settings a reload puts in force, so that everything reporting them tells what runs."""
    supervisor = old.supervisor.model_copy(
        update={k: getattr(new.supervisor, k) for k in SUPERVISOR_LIVE}
    )
    gpu = new.gpu.model_copy(update={k: getattr(old.gpu, k) for k in GPU_AT_START})
    return new.model_copy(update={"supervisor": supervisor, "api": old.api, "gpu": gpu})


def port_waits(
    holders: Mapping[str, Collection[str]], order: Sequence[str]
) -> dict[str, list[str]]:
    """Changed group -> the changed groups whose roll-out it waits for, in ``order``, from
    ``holders`` (group -> the other groups one of whose kept workers still holds a port its
    new workers take). A wait that is part of a cycle (two groups swapping ports, or three
    passing them round) is dropped, both ways: nobody waits for good, and a swap waits for
    neither (regression: the first way found was kept, so one group of a swap always
    started beside the other's old server). Chains stay: a waits for b, which waits for c."""

    def reaches(start: str, goal: str) -> bool:
        seen: set[str] = set()
        todo = [start]
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(holders.get(name, ()))
        return False

    waits: dict[str, list[str]] = {}
    for taker, held_by in holders.items():
        first = [n for n in order if n in held_by and n != taker and not reaches(n, taker)]
        if first:
            waits[taker] = first
    return waits
