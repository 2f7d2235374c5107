"""Per-worker cgroup v2 ``memory.max``, where the supervisor owns a delegated cgroup v2 subtree.

Under systemd with ``Delegate=yes`` (or in a container with a private, writable cgroup
namespace) the supervisor's cgroup is its own to manage. Then each worker with
``host_memory_limit_mb`` gets a child cgroup ``gpu-supervisor-<worker>`` with ``memory.max`` set,
and the kernel enforces the budget (an OOM kill inside that cgroup, counted in its
``memory.events``). Elsewhere (no cgroup v2, not writable, no memory controller) the budget is
enforced by the RSS watch of the self-healing code alone; :func:`probe` says why.

cgroup v2's "no internal processes" rule: controllers can only be enabled for the children of a
cgroup that has no processes of its own (the root excepted), so the supervisor first moves itself
into a leaf ``gpu-supervisor`` beside its workers' cgroups.

A worker is moved into its cgroup right after it is spawned (the spawn path cannot do it in the
child); what it forks afterwards inherits the cgroup.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

PREFIX = "gpu-supervisor-"
SELF_LEAF = "gpu-supervisor"
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """Whether per-worker ``memory.max`` can be used, and where."""

    root: Path | None  # the supervisor's own cgroup v2 directory (delegated to it)
    memory: bool  # per-worker memory.max works
    why: str  # why not (empty when it does)

    @property
    def mode(self) -> str:
        """``memory.max`` or ``rss_watch``: how host memory budgets are enforced."""
        return "memory.max" if self.memory else "rss_watch"


def own_cgroup(proc_self: Path = Path("/proc/self")) -> Path | None:
    """The supervisor's cgroup v2 directory (None without a mounted cgroup v2 hierarchy)."""
    try:
        lines = (proc_self / "cgroup").read_text().splitlines()
        mountinfo = (proc_self / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if rel is None:
        return None
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            fields = left.split()
            root, mount = fields[3], fields[4]
            inside = os.path.relpath(rel, root) if root != "/" else rel.lstrip("/")
            return Path(mount) / ("" if inside == "." else inside)
    return None


def probe(directory: Path | None = None, *, move_self: bool = True) -> CgroupSupport:
    """Find out whether per-worker ``memory.max`` can be used, preparing the subtree if so."""
    root = own_cgroup() if directory is None else directory
    if root is None:
        return CgroupSupport(None, False, "no cgroup v2 hierarchy is mounted")
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return CgroupSupport(root, False, f"cannot read {root}/cgroup.controllers: {exc.strerror}")
    if "memory" not in controllers:
        return CgroupSupport(
            root,
            False,
            f"the memory controller is not available in {root} "
            f"(controllers: {' '.join(controllers) or 'none'})",
        )
    if not os.access(root, os.W_OK) or not os.access(root / "cgroup.subtree_control", os.W_OK):
        return CgroupSupport(
            root, False, f"{root} is not delegated to the supervisor (not writable)"
        )
    try:
        _enable_memory(root, move_self=move_self)
    except OSError as exc:
        return CgroupSupport(
            root, False, f"cannot enable the memory controller below {root}: {exc.strerror}"
        )
    return CgroupSupport(root, True, "")


def _enable_memory(root: Path, *, move_self: bool) -> None:
    control = root / "cgroup.subtree_control"
    if "memory" in control.read_text().split():
        return
    try:
        control.write_text("+memory")
    except OSError as exc:
        if exc.errno != errno.EBUSY or not move_self:
            raise
        # Processes in our own cgroup block it: move ourselves into a leaf first.
        leaf = root / SELF_LEAF
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
        control.write_text("+memory")


class WorkerCgroups:
    """Creates, fills and removes the workers' cgroups."""

    def __init__(self, support: CgroupSupport) -> None:
        self.support = support
        self.log = structlog.get_logger()
        self._failed_once = False

    def path(self, worker: str) -> Path | None:
        """The worker's cgroup directory (None when not used)."""
        if not self.support.memory or self.support.root is None:
            return None
        return self.support.root / f"{PREFIX}{worker}"

    def events_file(self, worker: str) -> Path | None:
        """The worker's ``memory.events`` (its ``oom_kill`` count), when it has a cgroup."""
        path = self.path(worker)
        return None if path is None else path / "memory.events"

    def place(self, worker: str, pid: int, memory_max_mb: float) -> bool:
        """Move ``pid`` into the worker's cgroup with ``memory.max``; False when not used."""
        path = self.path(worker)
        if path is None or memory_max_mb <= 0:
            return False
        try:
            path.mkdir(exist_ok=True)
            (path / "memory.max").write_text(str(int(memory_max_mb * MIB)))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
            (path / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            if not self._failed_once:
                self._failed_once = True
                self.log.warning(
                    "cgroup.place_failed",
                    worker=worker,
                    path=os.fspath(path),
                    error=exc.strerror or str(exc),
                    reason="memory.max not applied; the RSS watch still enforces the budget",
                )
            return False
        return True

    def remove(self, worker: str) -> None:
        """Remove the worker's (empty) cgroup."""
        path = self.path(worker)
        if path is not None:
            with contextlib.suppress(OSError):
                path.rmdir()
