"""Routing: which ready worker of a group should take the next request (pure).

``GET /api/v1/route?group=G[&need_mb=N]`` asks this. A worker is a candidate when it is ready, not
derated, and none of its GPUs is unhealthy. A cordon only stops placing workers on a GPU (DESIGN.md
sections 3 and 6, as ``kubectl cordon``): the ones already there keep serving. Candidates are
ranked by the free memory of their GPUs (most first; for a multi-GPU worker the GPU with the least
free memory counts; for a worker with a GPU budget, ``gpu_memory_limit_mb``, the headroom under the
budget on that GPU where it is less: a request that takes it over its budget gets it restarted),
then by utilization (lowest first; the busiest of its GPUs counts); workers that tie on both
take turns (round robin over the caller's requests). Figures a sample apart tie when they are
close: free memory within :data:`FREE_TIE_MB` or :data:`FREE_TIE_FRACTION` of the best (an
allocator's cache step is not a reason to send one worker every request until the next
sample), utilization within :data:`UTIL_TIE_PERCENT` points. A GPU the supervisor has no
reading for (no telemetry) is not held against a worker: its free memory is unknown, it
ranks after every worker whose free memory is known, and ``need_mb`` cannot refuse it (so too
every GPU while an NVML call hangs: the last readings are stale).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from supervisor.model import WorkerState

#: Free memory this close to the best worker's (MiB, or this fraction of it, whichever is more)
#: ties with it.
FREE_TIE_MB = 256.0
FREE_TIE_FRACTION = 0.02
#: Utilization this close to the lowest of the workers that tie on memory (percentage points)
#: ties with it.
UTIL_TIE_PERCENT = 5.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker of the group, as routing sees it."""

    name: str
    port: int | None
    state: WorkerState
    gpus: tuple[str, ...]  # UUIDs; empty for a worker without GPUs
    derated: bool = False
    #: ``gpu_memory_limit_mb`` (per GPU; 0: none) and what the worker holds on each of its GPUs
    #: at the last sample (None: not known): the room it has is the headroom under its budget
    #: where that is less than the GPU's free memory
    budget_mb: float = 0.0
    used_mb: Mapping[str, float] | None = None


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """One GPU at the last sample."""

    free_mb: float | None
    utilization_percent: float | None
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class Routed:
    """Send the request here."""

    name: str
    port: int | None
    gpu: str | None
    free_mb: float | None


@dataclass(frozen=True, slots=True)
class NoneReady:
    """No worker can take requests now (503)."""

    reason: str


@dataclass(frozen=True, slots=True)
class NoRoom:
    """Workers are ready, but none has ``need_mb`` free (429: retry later)."""

    need_mb: float
    best_free_mb: float


Verdict = Routed | NoneReady | NoRoom


@dataclass(frozen=True, slots=True)
class _Ranked:
    order: int
    worker: Candidate
    gpu: str | None
    free_mb: float | None
    utilization: float | None

    def key(self) -> tuple[int, float, int, float, int]:
        return (
            self.free_mb is None,
            -(self.free_mb or 0.0),
            self.utilization is None,
            self.utilization or 0.0,
            self.order,
        )


def _rank(order: int, w: Candidate, gpus: Mapping[str, GpuLoad]) -> _Ranked | str:
    """The worker's standing, or why it is not a candidate."""
    if w.state is not WorkerState.READY:
        return f"{w.name} is {w.state.value}"
    if w.derated:
        return f"{w.name} is derated"
    free: float | None = None
    tightest: str | None = w.gpus[0] if w.gpus else None
    util: float | None = None
    unknown_free = False
    for uuid in w.gpus:
        load = gpus.get(uuid)
        if load is None:
            unknown_free = True
            continue
        if not load.healthy:
            return f"{w.name} is on unhealthy GPU {uuid}"
        room = load.free_mb
        if w.budget_mb > 0 and w.used_mb is not None:
            left = max(0.0, w.budget_mb - w.used_mb.get(uuid, 0.0))
            room = left if room is None else min(room, left)
        if room is None:
            unknown_free = True
        elif free is None or room < free:
            free, tightest = room, uuid
        if load.utilization_percent is not None:
            util = max(util or 0.0, load.utilization_percent)
    return _Ranked(order, w, tightest, None if unknown_free else free, util)


@dataclass(frozen=True, slots=True)
class Ranking:
    """A group's candidates, best first, and why each of the others is none (what
    :func:`pick` needs: one ranking serves every request until the state changes)."""

    ranked: tuple[_Ranked, ...]
    why: tuple[str, ...]


def rank(workers: Sequence[Candidate], gpus: Mapping[str, GpuLoad]) -> Ranking:
    """The group's candidates ranked (see the module docstring for the rules)."""
    ranked: list[_Ranked] = []
    why: list[str] = []
    for order, w in enumerate(workers):
        r = _rank(order, w, gpus)
        if isinstance(r, str):
            why.append(r)
        else:
            ranked.append(r)
    ranked.sort(key=_Ranked.key)
    return Ranking(tuple(ranked), tuple(why))


def pick(ranking: Ranking, need_mb: float | None = None, turn: int = 0) -> Verdict:
    """The best candidate of ``ranking`` for the next request.

    ``turn``: how many times the caller asked before; candidates that tie on free memory and
    utilization (identical workers on identical GPUs, or no telemetry at all) take turns
    instead of the first in config order taking every request until the next sample."""
    ranked: Sequence[_Ranked] = ranking.ranked
    if not ranked:
        detail = "; ".join(ranking.why) if ranking.why else "the group has no workers"
        return NoneReady(f"no ready worker ({detail})")
    if need_mb is not None:
        fitting = [r for r in ranked if r.free_mb is None or r.free_mb >= need_mb]
        if not fitting:
            best = max(r.free_mb or 0.0 for r in ranked)
            return NoRoom(need_mb, best)
        ranked = fitting
    ties = _ties(ranked)
    best_r = ties[turn % len(ties)]
    return Routed(best_r.worker.name, best_r.worker.port, best_r.gpu, best_r.free_mb)


def choose(
    workers: Sequence[Candidate],
    gpus: Mapping[str, GpuLoad],
    need_mb: float | None = None,
    turn: int = 0,
) -> Verdict:
    """The best candidate for the next request: :func:`pick` of :func:`rank`."""
    return pick(rank(workers, gpus), need_mb, turn)


def _ties(ranked: Sequence[_Ranked]) -> list[_Ranked]:
    """The candidates that tie with the best of ``ranked`` (sorted by :meth:`_Ranked.key`)."""
    top = ranked[0]
    if top.free_mb is None:  # no free memory known for any: utilization alone
        on_memory = list(ranked)
    else:
        floor = top.free_mb - max(FREE_TIE_MB, FREE_TIE_FRACTION * top.free_mb)
        on_memory = [r for r in ranked if r.free_mb is not None and r.free_mb >= floor]
    known = [r.utilization for r in on_memory if r.utilization is not None]
    if not known:
        return on_memory
    low = min(known)
    return sorted(
        (
            r
            for r in on_memory
            if r.utilization is not None and r.utilization <= low + UTIL_TIE_PERCENT
        ),
        key=lambda r: r.order,
    )
