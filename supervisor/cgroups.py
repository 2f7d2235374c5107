"""Per-worker cgroup v2 cgroups, where the supervisor owns a delegated cgroup v2 subtree.

Under systemd with ``Delegate=yes`` (or in a container with a private, writable cgroup
namespace) the supervisor's cgroup is its own to manage. Two things use that (DESIGN.md
section 2):

- *Containment*: each worker runs in a child cgroup ``gpu-supervisor-<worker>``; when its main
  process exits, ``cgroup.kill`` ends whatever is left of its tree, including descendants that
  left the process group (``setsid``) and were re-parented. It needs ``cgroup.kill`` (Linux >=
  5.14) and a cgroup with no other processes in it (the supervisor's alone: a shared cgroup, such
  as the hierarchy's root, is not ours to divide). Elsewhere the process group and the last seen
  process tree are killed instead (``runtime``).
- *Host memory budgets*: a worker with ``host_memory_limit_mb`` gets ``memory.max`` on that
  cgroup, and the kernel enforces the budget (an OOM kill inside that cgroup, counted in its
  ``memory.events``). Elsewhere (no cgroup v2, not writable, no memory controller) the budget is
  enforced by the RSS watch of the self-healing code alone.

:func:`probe` says which of the two work, and why not.

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
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

PREFIX = "gpu-supervisor-"
NO_BUDGET = "no worker has host_memory_limit_mb"
SELF_LEAF = "gpu-supervisor"
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """Whether per-worker ``memory.max`` can be used, and where."""

    root: Path | None  # the supervisor's own cgroup v2 directory (delegated to it)
    memory: bool  # per-worker memory.max works
    why: str  # why not (empty when it does)
    contain: bool = False  # every worker gets a cgroup of its own, ended with cgroup.kill
    contain_why: str = ""  # why not (empty when it does)

    @property
    def mode(self) -> str:
        """``memory.max`` or ``rss_watch``: how host memory budgets are enforced."""
        return "memory.max" if self.memory else "rss_watch"

    @property
    def containment(self) -> str:
        """``cgroup`` or ``process_tree``: how what is left of a worker's tree is ended."""
        return "cgroup" if self.contain else "process_tree"


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


def probe(
    directory: Path | None = None, *, move_self: bool = True, memory: bool = True
) -> CgroupSupport:
    """Find out whether per-worker cgroups can be used, preparing the subtree if so.

    ``memory``: whether any worker has a host memory budget (else the memory controller is
    left alone). Containment is judged first, while the supervisor is still in ``directory``.
    """
    root = own_cgroup() if directory is None else directory
    if root is None:
        why = "no cgroup v2 hierarchy is mounted"
        return CgroupSupport(None, False, why, False, why)
    contain_why = _contain_why(root)
    contain = not contain_why
    if not memory:
        return CgroupSupport(root, False, NO_BUDGET, contain, contain_why)
    why = _memory_why(root, move_self=move_self)
    return CgroupSupport(root, not why, why, contain, contain_why)


def with_memory(support: CgroupSupport, *, move_self: bool = True) -> CgroupSupport:
    """``support`` with per-worker ``memory.max`` probed now (a reload added the first budget)."""
    if support.memory or support.root is None or support.why != NO_BUDGET:
        return support
    why = _memory_why(support.root, move_self=move_self)
    return replace(support, memory=not why, why=why)


def _contain_why(root: Path) -> str:
    """Why workers cannot get cgroups of their own below ``root`` (empty: they can)."""
    if not (root / "cgroup.type").exists():  # only the root cgroup lacks it
        return f"{root} is the hierarchy's root cgroup: shared by the whole machine"
    if not (root / "cgroup.kill").exists():
        return f"{root} has no cgroup.kill (Linux < 5.14)"
    if not os.access(root, os.W_OK) or not os.access(root / "cgroup.procs", os.W_OK):
        return f"{root} is not delegated to the supervisor (not writable)"
    try:
        pids = {int(p) for p in (root / "cgroup.procs").read_text().split()}
    except (OSError, ValueError) as exc:
        return f"cannot read {root}/cgroup.procs: {exc}"
    others = sorted(pids - {os.getpid()})
    if others:
        shown = " ".join(map(str, others[:5])) + (" ..." if len(others) > 5 else "")
        return (
            f"{root} holds other processes too (pids {shown}): not a cgroup of the "
            "supervisor's own (systemd Delegate=yes, or a container's cgroup namespace)"
        )
    return ""


def _memory_why(root: Path, *, move_self: bool) -> str:
    """Why per-worker ``memory.max`` cannot be used below ``root`` (empty: it can, now)."""
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return f"cannot read {root}/cgroup.controllers: {exc.strerror}"
    if "memory" not in controllers:
        return (
            f"the memory controller is not available in {root} "
            f"(controllers: {' '.join(controllers) or 'none'})"
        )
    if not os.access(root, os.W_OK) or not os.access(root / "cgroup.subtree_control", os.W_OK):
        return f"{root} is not delegated to the supervisor (not writable)"
    try:
        _enable_memory(root, move_self=move_self)
    except OSError as exc:
        return f"cannot enable the memory controller below {root}: {exc.strerror}"
    return ""


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
    """Creates, fills, kills and removes the workers' cgroups.

    Per spawn: :meth:`prepare` (before: the cgroup and its ``memory.max``; the child joins it
    before exec), :meth:`place` (after: makes sure the pid is in it), :meth:`kill` when the main
    process has exited, :meth:`remove` when the worker is gone for good.
    """

    def __init__(self, support: CgroupSupport) -> None:
        self.support = support
        self.log = structlog.get_logger()
        self._failed_once = False
        self._placed: set[str] = set()  # workers whose current process is in their cgroup
        #: workers whose current process was given their cgroup (its OOM-kill count is theirs;
        #: kept past ``kill``, for the post-mortem of the process that died)
        self._given: set[str] = set()
        self._leftover: set[str] = set()  # removed workers whose directory is still there
        #: worker -> the budget (MiB, 0: none) its last spawn was given, where memory.max is used
        self._budgets: dict[str, float] = {}

    def path(self, worker: str) -> Path | None:
        """The worker's cgroup directory (None when not used)."""
        s = self.support
        if not (s.memory or s.contain) or s.root is None:
            return None
        return s.root / f"{PREFIX}{worker}"

    def events_file(self, worker: str) -> Path | None:
        """The worker's ``memory.events`` (its ``oom_kill`` count), when its process was given
        its cgroup and the memory controller counts there (None: the machine's count is the
        one to judge by; a worker without a budget gets no cgroup without containment)."""
        path = self.path(worker)
        if path is None or not self.support.memory or worker not in self._given:
            return None
        return path / "memory.events"

    def prepare(self, worker: str, memory_max_mb: float) -> Path | None:
        """Create the worker's cgroup (with ``memory.max`` when it has a budget) for a spawn.

        None when it gets none: no containment here, and no budget or no memory controller.
        """
        self._placed.discard(worker)
        self._given.discard(worker)
        if self.support.memory:
            self._budgets[worker] = max(memory_max_mb, 0.0)
        path = self.path(worker)
        limited = self.support.memory and memory_max_mb > 0
        if path is None or not (limited or self.support.contain):
            return None
        try:
            path.mkdir(exist_ok=True)
            if self.support.memory:  # "max" too: a reload may have lifted an earlier budget
                limit = str(int(memory_max_mb * MIB)) if memory_max_mb > 0 else "max"
                (path / "memory.max").write_text(limit)
                with contextlib.suppress(OSError):
                    (path / "memory.swap.max").write_text("0" if memory_max_mb > 0 else "max")
        except OSError as exc:
            self._failed(worker, path, exc)
            return None
        self._leftover.discard(worker)
        self._given.add(worker)
        return path

    def budget_differs(self, worker: str, memory_max_mb: float) -> bool:
        """Whether ``worker``'s last spawn was given another ``memory.max`` than a budget of
        ``memory_max_mb`` gives (a process keeps the one it started under); False where
        memory.max is not used."""
        if not self.support.memory:
            return False
        return self._budgets.get(worker, 0.0) != max(memory_max_mb, 0.0)

    def place(self, worker: str, pid: int, memory_max_mb: float | None = None) -> bool:
        """Make sure ``pid`` is in the worker's cgroup (it joins before exec; a failure there
        is mended here); False when it has none. ``memory_max_mb``: :meth:`prepare` first."""
        if memory_max_mb is not None:
            path = self.prepare(worker, memory_max_mb)
        else:  # only the cgroup prepared for this process: not one an earlier budget left
            path = self.path(worker) if worker in self._given else None
        if path is None or not path.is_dir():
            return False
        try:
            (path / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            self._failed(worker, path, exc)
            return False
        self._placed.add(worker)
        return True

    def _failed(self, worker: str, path: Path, exc: OSError) -> None:
        self._given.discard(worker)
        if not self._failed_once:
            self._failed_once = True
            self.log.warning(
                "cgroup.place_failed",
                worker=worker,
                path=os.fspath(path),
                error=exc.strerror or str(exc),
                reason="no cgroup for this worker: the RSS watch enforces its budget, and "
                "what is left of its tree is ended without cgroup.kill",
            )

    def kill(self, worker: str) -> bool:
        """SIGKILL every process left in the worker's cgroup (``cgroup.kill``).

        False when its current process was not placed there (no containment, or placing it
        failed): then the caller ends the tree another way. The kernel signals them all at once,
        forks included, so nothing escapes; the replacement, placed afterwards, is not affected.
        """
        path = self.path(worker)
        if path is None or not self.support.contain or worker not in self._placed:
            return False
        self._placed.discard(worker)
        try:
            (path / "cgroup.kill").write_text("1")
        except OSError as exc:
            self.log.warning(
                "cgroup.kill_failed", worker=worker, path=os.fspath(path), error=exc.strerror
            )
            return False
        return True

    def populated(self, worker: str) -> bool:
        """Whether any process is still in the worker's cgroup (False when it has none)."""
        path = self.path(worker)
        if path is None:
            return False
        try:
            return "populated 1" in (path / "cgroup.events").read_text()
        except OSError:
            return False

    def remove(self, worker: str) -> bool:
        """Remove the worker's cgroup; False when it is still there (killed processes still
        exiting: :meth:`sweep` tries again)."""
        self._placed.discard(worker)
        self._given.discard(worker)
        self._budgets.pop(worker, None)
        path = self.path(worker)
        if path is None:
            return True
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            self._leftover.add(worker)
            return False
        self._leftover.discard(worker)
        return True

    @property
    def leftover(self) -> frozenset[str]:
        """Workers whose directory :meth:`remove` could not remove yet (:meth:`sweep`)."""
        return frozenset(self._leftover)

    def sweep(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove the directories :meth:`remove` could not; the names still there."""
        kept = set(keep)
        for worker in sorted(self._leftover - kept):
            self.remove(worker)
        return sorted(self._leftover - kept)

    def stale(self, known: Iterable[str] = ()) -> dict[str, list[int]]:
        """Kill (and mark for removal) worker cgroups of an earlier run: name -> pids killed.

        Where the supervisor's cgroup is its own, a ``gpu-supervisor-*`` directory it has not
        made (not in ``known``) was left by an earlier instance that died without cleaning up;
        whatever runs in it is a leftover of that instance's workers.
        """
        root = self.support.root
        if root is None or not self.support.contain:  # alone in it: nobody else's directories
            return {}
        names = set(known)
        found: dict[str, list[int]] = {}
        with contextlib.suppress(OSError):
            for entry in sorted(root.glob(f"{PREFIX}*")):
                worker = entry.name[len(PREFIX) :]
                if not entry.is_dir() or worker in names:
                    continue
                try:
                    pids = [int(p) for p in (entry / "cgroup.procs").read_text().split()]
                except (OSError, ValueError):
                    pids = []
                if pids:
                    with contextlib.suppress(OSError):
                        (entry / "cgroup.kill").write_text("1")
                found[worker] = pids
                self._leftover.add(worker)
        return found
