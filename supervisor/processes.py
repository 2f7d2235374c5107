"""Processes: spawn a worker in its own session, signal or kill its tree, and one reaper for all.

- Each worker starts in a new session (``setsid``), so its process group is its tree unless a
  descendant leaves it with ``setsid()``; ``kill_tree`` also walks the descendants it can see.
- ``PR_SET_PDEATHSIG`` (SIGKILL) is set in the child, so a killed supervisor takes its workers
  with it. Spawning happens on the event loop thread, which is the main thread.
- The kernel's OOM killer should pick the supervisor last (its death ends every worker):
  ``protect_from_oom_killer`` lowers its own ``oom_score_adj`` at start, and ``spawn`` gives each
  worker the score the supervisor started with (never below 0), not the lowered one.
- ``Reaper`` is the only code that calls ``waitpid``: one ``waitpid(-1, WNOHANG)`` loop driven by
  SIGCHLD, dispatching each status by pid. Statuses of pids nobody registered (orphaned
  grandchildren re-parented to us as PID 1 or child subreaper) are reaped and reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import faulthandler
import functools
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import psutil

from supervisor import procfs
from supervisor.errors import SpawnError
from supervisor.model import Account, ExitStatus, LaunchSpec, format_cpulist
from supervisor.plan import WORKER_SITE_DIR

#: Never given a handler by ``pass_on_ignored_signals``: not catchable, the reaper's, reset
#: for each child by ``Popen`` itself (``restore_signals``), or job control.
_KEEP_DISPOSITION = {
    signal.SIGKILL,
    signal.SIGSTOP,
    signal.SIGCHLD,
    signal.SIGPIPE,
    signal.SIGXFSZ,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
}


#: Synchronous faults: a Python-level handler cannot handle one (the C handler returns, the
#: faulting instruction runs again: the process spins for ever instead of dying), and where
#: ``faulthandler`` is enabled its own C handler is in place (``signal.getsignal`` still says
#: SIG_IGN: Python's view from its start), which a handler of ours would replace.
_FAULTS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}


def ignore_signal(signum: int, frame: object) -> None:
    """What an ignored signal does to the supervisor: nothing."""


def pass_on_ignored_signals() -> list[str]:
    """Give every signal this process was started with ignored (``nohup``: SIGHUP; a shell's
    background job: SIGINT and SIGQUIT) a handler that does nothing; return their names.

    An ignored signal stays ignored across ``exec``, a handled one is reset to its default
    action: without this, every worker would ignore it too, and a ``drain_signal`` or
    ``stop_signal`` of SIGQUIT (nginx's graceful stop), or a SIGUSR1 a worker reopens its logs
    on, would do nothing. The supervisor itself goes on ignoring them. Call it before the
    first worker is spawned."""
    passed = []
    for sig in signal.valid_signals():
        if not isinstance(sig, signal.Signals) or sig in _KEEP_DISPOSITION:
            continue
        try:
            if signal.getsignal(sig) is signal.SIG_IGN:
                if sig in _FAULTS:
                    if faulthandler.is_enabled():
                        continue  # its handler is the disposition: the workers get SIG_DFL
                    signal.signal(sig, signal.SIG_DFL)  # never ignorable for a real fault
                else:
                    signal.signal(sig, ignore_signal)
                passed.append(sig.name)
        except (OSError, ValueError):
            continue
    return passed


def unblock_inherited_signals(keep: Collection[int] = ()) -> list[str]:
    """Unblock every signal this thread was started with blocked but those of ``keep``; return
    their names.

    A launcher that blocked signals and did not restore its mask before exec leaves them
    blocked here, and a blocked mask survives fork and exec: with SIGCHLD blocked the reaper
    would never run, and every worker would start with them blocked too (a ``drain_signal`` of
    SIGUSR1 never delivered). Call it before the first worker is spawned."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ()) - set(keep)
    if not blocked:
        return []
    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
    return sorted(s.name if isinstance(s, signal.Signals) else f"signal {s}" for s in blocked)


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# How setpriv's help text names the option (not ``--keep-pdeathsig``), and how much of the
# binary is searched for it (util-linux's is ~80 KiB).
_PDEATHSIG_HELP = re.compile(rb"(?<![\w-])--pdeathsig\b")
MAX_HELPER_BYTES = 4 << 20

_libc: ctypes.CDLL | None = None


def _prctl() -> Callable[..., int]:
    global _libc
    if _libc is None:
        # The C library is loaded already: its symbols are in the global scope (dlopen(NULL)).
        # ctypes.util.find_library("c") would run `ldconfig -p` (~3 ms at every start).
        _libc = ctypes.CDLL(None, use_errno=True)
    fn: Callable[..., int] = _libc.prctl
    return fn


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux >= 3.4). True on success."""
    try:
        return _prctl()(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _child_setup(
    parent_pid: int,
    prctl: Callable[..., int],
    cgroup_procs: str | None = None,
    oom_score_adj: bytes | None = None,
    account: Account | None = None,
    cwd: str | None = None,
    rlimits: Sequence[tuple[str, int, int, int]] = (),
    cpus: Sequence[int] | None = None,
) -> Callable[[], None]:
    def setup() -> None:
        # Runs in the forked child before exec: only async-signal-safe-ish calls here.
        # The cgroup is joined, the score written and the limits set with the supervisor's
        # credentials, then the user is changed (which clears a parent-death signal: it is set
        # after), and the working directory entered as that user (as systemd's
        # WorkingDirectory=).
        if account is None:
            pdeathsig()
        join_and_score()
        for name, res, soft, hard in rlimits:
            try:
                resource.setrlimit(res, (soft, hard))
            except (OSError, ValueError) as exc:  # said in the worker's log, exit 126
                why = getattr(exc, "strerror", None) or exc
                os.write(1, f"gpu-supervisor: cannot set limits.{name}: {why}\n".encode())
                os._exit(126)
        if cpus is not None:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as exc:
                why = f"cannot run on CPUs {cpulist}: {exc.strerror}"
                os.write(1, f"gpu-supervisor: cpu_affinity: {why}\n".encode())
                os._exit(126)
        if account is not None:
            os.setgroups(list(account.groups))
            os.setresgid(account.gid, account.gid, account.gid)
            os.setresuid(account.uid, account.uid, account.uid)
            if cwd is not None:
                try:
                    os.chdir(cwd)
                except OSError as exc:  # said in the worker's log, exit 126 (as a shell)
                    why = f"cannot enter the working directory {cwd!r}: {exc.strerror}"
                    os.write(1, f"gpu-supervisor: {why} (uid {account.uid})\n".encode())
                    os._exit(126)
            pdeathsig()

    cpulist = None if cpus is None else format_cpulist(cpus)  # (formatted before the fork)

    def pdeathsig() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl
            os._exit(1)

    def join_and_score() -> None:
        if oom_score_adj is not None:
            # Raising it is always allowed; a failure leaves the supervisor's (lower) score.
            try:
                fd = os.open(OOM_SCORE_ADJ_SELF, os.O_WRONLY)
                try:
                    os.write(fd, oom_score_adj)
                finally:
                    os.close(fd)
            except OSError:
                pass
        if cgroup_procs is not None:
            # Join the worker's cgroup before exec, so nothing it forks can start outside it.
            # A failure leaves it where it is; the supervisor moves it after the spawn.
            try:
                fd = os.open(cgroup_procs, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
            except OSError:
                pass

    return setup


@dataclass(slots=True)
class Child:
    """A spawned worker process: its pid (= process group id) and the read end of its output."""

    pid: int
    output_fd: int
    popen: subprocess.Popen[bytes]

    def mark_reaped(self, status: ExitStatus) -> None:
        """Tell the Popen object the child is gone, so it never waits for it again."""
        self.popen.returncode = status.code if status.code is not None else -(status.signal or 0)


@functools.cache
def _setpriv() -> str | None:
    """util-linux ``setpriv`` if it supports ``--pdeathsig`` (it lets Popen use vfork).

    Probed once: the binary's own help text names the option (util-linux >= 2.33), which is
    read without starting a process; otherwise ``setpriv --help`` is asked. Call
    ``probe_spawn_helper()`` before the reaper runs (that probe is a child).
    """
    path = shutil.which("setpriv")
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            if _PDEATHSIG_HELP.search(f.read(MAX_HELPER_BYTES)):
                return path
    except OSError:
        pass
    try:
        out = subprocess.run(
            [path, "--help"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return path if _PDEATHSIG_HELP.search(out.stdout.encode()) else None


@functools.cache
def _choom() -> str | None:
    """util-linux ``choom`` (>= 2.33, like ``setpriv --pdeathsig``): sets a worker's
    ``oom_score_adj`` in the worker itself, before its program runs (see ``spawn``)."""
    return shutil.which("choom")


def probe_spawn_helper() -> str | None:
    """Find ``setpriv`` (and ``choom``) now (see ``spawn``); returns setpriv's path or None."""
    _choom()
    return _setpriv()


# --- the OOM killer ----------------------------------------------------------------------

#: The supervisor's own ``oom_score_adj``. The kernel's OOM killer (for a cgroup at its memory
#: limit, or the whole machine) kills the process with the highest badness: its memory plus
#: ``oom_score_adj`` thousandths of the memory it may use. At -900 the supervisor is the last
#: choice in its cgroup, yet killable when nothing else is left (-1000 would exempt it, and a
#: leaking supervisor would take the rest of the machine with it). Killing it kills every worker
#: (PR_SET_PDEATHSIG) and can orphan their children; killing a worker is a restart.
SUPERVISOR_OOM_SCORE_ADJ = -900
#: The lowest ``oom_score_adj`` a worker is given: the kernel's default.
WORKER_OOM_SCORE_ADJ_MIN = 0
OOM_SCORE_ADJ_SELF = "/proc/self/oom_score_adj"

#: What workers get: the supervisor's score as first seen (before it lowered it), at least
#: WORKER_OOM_SCORE_ADJ_MIN. Set by ``protect_from_oom_killer`` or by the first ``spawn``.
_worker_oom_score_adj: int | None = None


@dataclass(frozen=True, slots=True)
class OomProtection:
    """What ``protect_from_oom_killer`` found and did (None: ``/proc`` could not be read)."""

    before: int | None  # the supervisor's oom_score_adj as found
    now: int | None  # and after the call
    workers: int | None  # what workers spawned from now on get
    error: str | None  # why it could not be lowered (then now == before)

    @property
    def changed(self) -> bool:
        return self.now != self.before


def _read_oom_score_adj(path: str = OOM_SCORE_ADJ_SELF) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return int(os.read(fd, 32))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None


def _write_oom_score_adj(path: str, value: int) -> str | None:
    """Write ``value``; None on success, else why not."""
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _remember_worker_score(found: int) -> int:
    global _worker_oom_score_adj
    if _worker_oom_score_adj is None:
        _worker_oom_score_adj = max(found, WORKER_OOM_SCORE_ADJ_MIN)
    return _worker_oom_score_adj


def protect_from_oom_killer(score: int = SUPERVISOR_OOM_SCORE_ADJ) -> OomProtection:
    """Lower this process's ``oom_score_adj`` to ``score`` unless it is that low already (set by
    systemd's ``OOMScoreAdjust=``, ``docker run --oom-score-adj``, Kubernetes' Guaranteed QoS).
    Call it once at start, before any worker is spawned. Never raises.

    Lowering needs ``CAP_SYS_RESOURCE`` (root outside a container; in one, only where granted):
    without it ``error`` says so and nothing changes. Workers spawned afterwards get the score
    found here (not below 0) instead of inheriting the lowered one (see ``spawn``).
    """
    before = _read_oom_score_adj()
    if before is None:
        return OomProtection(None, None, None, f"cannot read {OOM_SCORE_ADJ_SELF}")
    workers = _remember_worker_score(before)
    if before <= score:
        return OomProtection(before, before, workers, None)
    error = _write_oom_score_adj(OOM_SCORE_ADJ_SELF, score)
    if error is not None:
        if "denied" in error or "not permitted" in error:
            error += " (lowering it needs CAP_SYS_RESOURCE)"
        return OomProtection(before, before, workers, error)
    return OomProtection(before, _read_oom_score_adj(), workers, None)


def _oom_score_for_worker() -> int | None:
    """The ``oom_score_adj`` a new worker must be given, or None where it may inherit ours.

    Only ever above the supervisor's current score: raising it needs no privilege."""
    current = _read_oom_score_adj()
    if current is None:
        return None
    wanted = _remember_worker_score(current)
    return wanted if wanted > current else None


#: Capability bits (``capabilities(7)``): to change groups and user; to raise a hard limit.
CAP_SETGID = 6
CAP_SETUID = 7
CAP_SYS_RESOURCE = 24


def _has_capabilities(*bits: int, status_path: str = "/proc/self/status") -> bool:
    """True when this process has every one of the capabilities ``bits`` in its effective set
    (root has them, unless a container dropped them); without ``/proc``, when it is root."""
    try:
        with open(status_path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return all(caps >> bit & 1 for bit in bits)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


#: The identity map of the initial user namespace (``user_namespaces(7)``).
_INITIAL_UID_MAP = ["0", "0", "4294967295"]


def _in_initial_user_namespace(path: str = "/proc/self/uid_map") -> bool:
    """True unless this process is in a user namespace of its own (a rootless or userns-
    remapped container, ``unshare -r``): there its capabilities do not reach what the kernel
    checks against the initial namespace, such as raising a hard resource limit. Without
    ``/proc``: True."""
    try:
        with open(path, encoding="ascii") as f:
            rows = [line.split() for line in f if line.strip()]
    except (OSError, ValueError):
        return True
    return rows == [_INITIAL_UID_MAP]


def _may_switch_user(status_path: str = "/proc/self/status") -> bool:
    """True when this process may change its user and groups (CAP_SETUID and CAP_SETGID)."""
    return _has_capabilities(CAP_SETUID, CAP_SETGID, status_path=status_path)


def _current_identity() -> tuple[int, int, frozenset[int]]:
    egid = os.getegid()
    return os.geteuid(), egid, frozenset([*os.getgroups(), egid])


def resolve_account(
    user: str,
    *,
    current: tuple[int, int, frozenset[int]] | None = None,
    may_switch: bool | None = None,
) -> Account | str:
    """``[[workers]] user`` (``NAME``, ``UID``, ``NAME:GROUP``) from the user database, or a line
    saying why it cannot be had (no such user or group; switching needs privileges this
    process lacks). ``current``/``may_switch``: this process's (euid, egid, groups) and whether
    it may change them (read from the process when None)."""
    import grp
    import pwd

    name, _, group = user.partition(":")
    entry: pwd.struct_passwd | None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        try:
            entry = pwd.getpwuid(int(name)) if name.isdigit() else None
        except (KeyError, OverflowError):
            entry = None
    if entry is None:
        return f"user {user!r}: no such user"
    gid = entry.pw_gid
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            if not group.isdigit():
                return f"user {user!r}: no such group {group!r}"
            gid = int(group)  # a number needs no entry (as chown and setpriv take it)
    try:
        groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, gid))))
    except OSError:
        groups = (gid,)
    euid, egid, _ = current if current is not None else _current_identity()
    # the supervisor's own user and group: its workers keep its groups too (a unit's
    # SupplementaryGroups=), nothing to switch and no privilege needed
    switch = (entry.pw_uid, gid) != (euid, egid)
    if switch and not (may_switch if may_switch is not None else _may_switch_user()):
        return (
            f"user {user!r}: running workers as uid {entry.pw_uid} gid {gid} needs root "
            f"(the supervisor runs as uid {euid} without CAP_SETUID and CAP_SETGID)"
        )
    return Account(
        user=user,
        name=entry.pw_name,
        uid=entry.pw_uid,
        gid=gid,
        groups=groups,
        home=entry.pw_dir or "/",
        shell=entry.pw_shell or "/bin/sh",
        switch=switch,
    )


def unreachable_for(path: Path, uid: int, groups: Collection[int]) -> str | None:
    """Why user ``uid`` (in ``groups``) cannot pass through every directory above ``path``'s
    directory (None: it can), as written and where links lead. The directory itself and
    ``state_dir`` are made passable."""
    state_dir = path.parent.parent
    real = Path(os.path.realpath(state_dir))
    for d in (state_dir, real) if real != state_dir.absolute() else (state_dir,):
        for parent in d.parents:
            if (why := denied(parent, uid, groups, 0o1)) is not None:
                return why
    return None


def denied(path: Path, uid: int, groups: Collection[int], want: int) -> str | None:
    """Why user ``uid`` (in ``groups``) lacks the ``want`` bits (``0o4`` read, ``0o1``
    execute or pass through) on ``path`` by its mode (None: it has them; ACLs not read)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if uid == 0:
        return None
    shift = 6 if st.st_uid == uid else 3 if st.st_gid in groups else 0
    if (st.st_mode >> shift) & want != want and not _has_acl(path):
        return f"{path} (mode {stat.S_IMODE(st.st_mode):04o}) is closed to uid {uid}"
    return None


def _has_acl(path: Path) -> bool:
    """True when ``path`` has a POSIX ACL, which may grant what its mode does not (then the
    mode is not judged: the kernel decides at the start)."""
    try:
        return "system.posix_acl_access" in os.listxattr(path)
    except OSError:
        return False


def unreadable_by(path: Path, account: Account, want: int | None = None) -> str | None:
    """Why ``account`` cannot read ``path`` (a file, or a directory it must also list; or use
    it as ``want`` says) by the modes of it and of every directory above it (None: it can)."""
    groups = account.groups
    if want is None:
        want = 0o5 if path.is_dir() else 0o4
    real = Path(os.path.realpath(path))
    # the path as written, and where its links lead (each must be passable)
    for p in (path, real) if real != path.absolute() else (path,):
        for parent in reversed(p.parents):
            if (why := denied(parent, account.uid, groups, 0o1)) is not None:
                return why
    return denied(path, account.uid, groups, want)


def _closed_to(account: Account, program: str, cwd: str | None) -> str | None:
    """Why ``account`` could not start ``program`` (as ``resolve_program`` found it) in
    ``cwd`` by the modes of the files and directories (None: it could)."""
    base = Path(cwd).absolute() if cwd is not None else Path.cwd()
    if cwd is not None and (why := unreadable_by(base, account, 0o1)) is not None:
        return f"cannot enter its working directory: {why}"
    path = Path(program) if os.path.isabs(program) else base / program
    try:
        with open(path, "rb") as f:
            script = f.read(2) == b"#!"  # the interpreter reads it: read permission too
    except OSError:
        script = False
    return unreadable_by(path, account, 0o5 if script else 0o1)


def reporters_unreadable(specs: Iterable[tuple[str, LaunchSpec]]) -> list[str]:
    """One line per ``(group, spec)`` whose worker runs as another user with an in-use
    reporter (``in_use_reporter``) that user cannot read: Python skips an unreadable
    ``PYTHONPATH`` entry without a word, so the worker would send no reports."""
    out = []
    for group, spec in specs:
        account = spec.account
        if not isinstance(account, Account) or not account.switch:
            continue
        if "GPU_SUPERVISOR_IN_USE_SOCKET" not in spec.env:
            continue
        why = unreadable_by(Path(WORKER_SITE_DIR) / "sitecustomize.py", account)
        if why is not None:
            out.append(
                f"group {group}: its workers run as {account.user!r} and cannot read the "
                f"in-use reporter ({why}): they send no in-use reports (install gpu-supervisor "
                "where that user can read it)"
            )
    return out


def resolve_accounts(users: Iterable[str]) -> dict[str, Account | str]:
    """``resolve_account`` for each distinct non-empty ``user`` value."""
    return {u: resolve_account(u) for u in set(users) if u}


def resolve_program(program: str, env: Mapping[str, str], cwd: str | None) -> str:
    """The executable ``program`` names (as execvpe would find it), or SpawnError (also for a
    working directory that is none)."""
    # Regression: a directory above that this user may not enter (a supervisor run as an
    # ordinary user) was said to hold no such file, and a cwd it may not enter blamed the
    # program: stat's own error is the reason.
    if cwd is not None:
        try:
            is_dir = stat.S_ISDIR(os.stat(cwd).st_mode)
        except OSError as exc:
            why = "no such directory" if exc.errno == errno.ENOENT else exc.strerror or str(exc)
            raise SpawnError(f"cannot start {program!r} in {cwd!r}: {why} (cwd)") from None
        if not is_dir:
            raise SpawnError(f"cannot start {program!r} in {cwd!r}: not a directory (cwd)")
        if not os.access(cwd, os.X_OK):
            raise SpawnError(f"cannot start {program!r} in {cwd!r}: Permission denied (cwd)")
    if "/" in program:
        path = program if cwd is None or os.path.isabs(program) else os.path.join(cwd, program)
        try:
            os.stat(path)
        except OSError as exc:
            raise SpawnError(f"cannot execute {program!r}: {exc.strerror or exc}") from None
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise SpawnError(f"cannot execute {program!r}: Permission denied")
        return program
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise SpawnError(f"cannot execute {program!r}: not found in PATH")
    return found


def unrunnable(specs: Iterable[tuple[str, LaunchSpec]]) -> list[str]:
    """One line per ``(group, spec)`` whose program cannot be executed from here, as
    ``execvpe`` would look for it (its PATH, its working directory), or whose ``user`` cannot
    be had, or could not enter the working directory or execute the program (by the modes),
    or whose ``limits`` this supervisor cannot give."""
    out = []
    for group, spec in specs:
        if isinstance(spec.account, str):
            out.append(f"group {group}: {spec.account}")
            continue
        problem = limits_problem(spec.limits, uid=_switched_uid(spec.account)) or cpus_problem(
            spec.cpus
        )
        if problem is not None:
            out.append(f"group {group}: {problem}")
            continue
        env = {"PATH": os.environ.get("PATH", os.defpath), **spec.env}
        try:
            found = resolve_program(spec.argv[0], env, spec.cwd)
        except SpawnError as exc:
            out.append(f"group {group}: {exc}")
            continue
        account = spec.account
        if account is not None and account.switch:
            why = _closed_to(account, found, spec.cwd)
            if why is not None:
                out.append(f"group {group}: user {account.user!r} cannot start {found!r}: {why}")
    return out


# --- resource limits ([workers.limits]) ----------------------------------------------------


def _switched_uid(account: Account | str | None) -> int | None:
    """The user a worker switches to in its child (RLIMIT_NPROC is checked then), or None."""
    return account.uid if isinstance(account, Account) and account.switch else None


#: ``[workers.limits]`` names and the resources they set.
RLIMITS: Mapping[str, int] = {
    "core": resource.RLIMIT_CORE,
    "memlock": resource.RLIMIT_MEMLOCK,
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
    "stack": resource.RLIMIT_STACK,
}
#: The kernel's most open files a process may be allowed (a higher ``nofile`` fails: EPERM).
NR_OPEN_PATH = "/proc/sys/fs/nr_open"


def _kernel_limits(
    limits: Sequence[tuple[str, int | None, int | None]],
) -> tuple[tuple[str, int, int, int], ...]:
    """``(name, resource, soft, hard)`` as ``setrlimit`` takes them (RLIM_INFINITY)."""
    inf = resource.RLIM_INFINITY
    return tuple(
        (name, RLIMITS[name], inf if soft is None else soft, inf if hard is None else hard)
        for name, soft, hard in limits
    )


def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def _above(a: int, b: int) -> bool:
    """``a > b`` for limits, where RLIM_INFINITY (-1 to Python) is above every number."""
    inf = resource.RLIM_INFINITY
    return a != b and (a == inf or (b != inf and a > b))


def _nr_open(path: str = NR_OPEN_PATH) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def limits_problem(
    limits: Sequence[tuple[str, int | None, int | None]],
    *,
    current: Callable[[int], tuple[int, int]] = resource.getrlimit,
    may_raise: bool | None = None,
    nr_open: int | None = None,
    uid: int | None = None,
    tasks_of: Callable[[int], int | None] | None = None,
) -> str | None:
    """Why a worker could not be given ``limits`` (``LaunchSpec.limits``), or None.

    A hard limit may be raised above this process's own only with ``CAP_SYS_RESOURCE``
    (``may_raise``; read from ``/proc/self/status`` when None); ``nofile`` never above the
    kernel's ``fs.nr_open`` (read when None). Lowering is always allowed."""
    if not limits:
        return None
    if nr_open is None:
        nr_open = _nr_open()
    for name, res, soft, hard in _kernel_limits(limits):
        if name == "nofile" and nr_open is not None and _above(hard, nr_open):
            return (
                f"limits.nofile: {_limit_text(hard)} is above the kernel's most open files "
                f"(fs.nr_open = {nr_open})"
            )
        now = current(res)[1]
        if _above(hard, now):
            where = ""
            if may_raise is None:
                may_raise = _has_capabilities(CAP_SYS_RESOURCE)
                if may_raise and not _in_initial_user_namespace():
                    # setrlimit(2) checks the capability in the initial user namespace
                    may_raise = False
                    where = " in the host's user namespace (this one is a user namespace)"
            if not may_raise:
                return (
                    f"limits.{name}: raising the hard limit from {_limit_text(now)} to "
                    f"{_limit_text(hard)} needs CAP_SYS_RESOURCE{where}"
                )
        if name == "nproc" and uid is not None and uid != 0 and soft != resource.RLIM_INFINITY:
            # RLIMIT_NPROC is checked when the child switches to ``uid``: execve then fails
            # (EAGAIN) while the user has more processes and threads than the soft limit.
            count = (tasks_of or procfs.tasks_of_user)(uid)
            if count is not None and count > soft:
                return (
                    f"limits.nproc: user {uid} has {count} processes and threads already, "
                    f"more than the limit {soft} (the program would not start: EAGAIN)"
                )
    return None


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: a cpuset, ``taskset``, systemd's
    ``CPUAffinity=``); workers inherit it."""
    return frozenset(os.sched_getaffinity(0))


def cpus_problem(cpus: Sequence[int] | None, allowed: Collection[int] | None = None) -> str | None:
    """Why a worker could not be pinned to ``cpus`` (``LaunchSpec.cpus``), or None: a CPU the
    supervisor may not use itself (offline, or outside its cpuset) cannot be given."""
    if cpus is None:
        return None
    allowed = allowed_cpus() if allowed is None else allowed
    missing = set(cpus) - set(allowed)
    if not missing:
        return None
    return (
        f"cpu_affinity: CPUs {format_cpulist(missing)} are not among those this supervisor "
        f"may use ({format_cpulist(allowed)})"
    )


#: The open-files limit the supervisor raises its own soft limit to (where the hard limit
#: allows): two descriptors a worker, the API's connections, /proc reads. Workers inherit it,
#: as under supervisord (``minfds``) and in containers, where soft and hard are one value.
OPEN_FILES_WANTED = 65536
#: Descriptors the supervisor needs besides its workers' (logs, sockets, /proc, the API).
OPEN_FILES_BASE = 64


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` towards ``wanted`` (never above the hard limit, never
    down); return (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return soft, soft
    return soft, target


def lift_address_space_limit() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_AS`` this process was started with to its hard limit (always
    allowed); return (before, after) soft limits, or None when there was none.

    Workers inherit it, and a CUDA process under an address-space limit fails to initialise
    its GPU (DESIGN.md: never ``RLIMIT_AS`` a CUDA process). ``after`` is still a number where
    the hard limit is one (raising that needs CAP_SYS_RESOURCE: the operator's to lift)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        except (OSError, ValueError):
            return soft, soft
    return soft, hard


def open_files_needed(workers: int) -> int:
    """About how many descriptors ``workers`` workers need the supervisor to hold."""
    return OPEN_FILES_BASE + 4 * workers


def spawn(spec: LaunchSpec, cgroup: Path | None = None) -> Child:
    """Start the worker described by ``spec``; raise ``SpawnError`` if it cannot be executed.

    PR_SET_PDEATHSIG is set through ``setpriv --pdeathsig KILL`` where util-linux has it (Popen
    can then vfork: ~0.2 ms instead of ~3 ms for a full fork of the supervisor), else in a
    ``preexec_fn``. ``cgroup``: the worker's cgroup directory, joined in the ``preexec_fn``
    before exec (so a full fork then: the child must run code of ours before exec). A worker
    of another user (``spec.account``) is always switched in the ``preexec_fn``, which then
    enters ``spec.cwd`` as that user. ``spec.limits`` are set in the ``preexec_fn`` as well,
    before any switch (a hard limit above the supervisor's needs its CAP_SYS_RESOURCE); limits
    it cannot give raise ``SpawnError`` before anything is forked (``limits_problem``).

    A supervisor that lowered its ``oom_score_adj`` (``protect_from_oom_killer``, systemd's
    ``OOMScoreAdjust=``) gives the worker its original score back before the worker's program
    runs, so nothing the worker forks inherits the protection: ``choom -n N --`` after setpriv
    (one more exec in the child, ~0.6 ms of the worker's start; none in the supervisor), or a
    write in the ``preexec_fn``. Without choom, the supervisor writes it right after Popen, while
    setpriv is still starting (a child the program forks before that would keep the low score).
    """
    env = dict(spec.env)
    if isinstance(spec.account, str):
        raise SpawnError(f"cannot start {spec.argv[0]!r}: {spec.account}")
    account = spec.account if spec.account is not None and spec.account.switch else None
    program = resolve_program(spec.argv[0], env, spec.cwd)
    # Not for a worker of another user: setpriv keeps its capabilities until the exec, so the
    # program would be found and executed with root's rights to any file; a switch in the
    # preexec_fn drops them before the working directory is entered and the program run.
    uid = None if account is None else account.uid
    problem = limits_problem(spec.limits, uid=uid) or cpus_problem(spec.cpus)
    if problem is not None:
        raise SpawnError(f"cannot start {spec.argv[0]!r}: {problem}")
    # The limits and the CPUs are set in the preexec_fn too (setpriv has no option for them).
    plain = cgroup is None and account is None and not spec.limits and spec.cpus is None
    setpriv = _setpriv() if plain else None
    oom = _oom_score_for_worker()
    oom_after: int | None = None  # written to /proc/<pid>/oom_score_adj once Popen returns
    if setpriv is not None:
        argv = [setpriv, "--pdeathsig", "KILL", "--"]
        if oom is not None:
            choom = _choom()
            if choom is not None:
                argv += [choom, "-n", str(oom), "--"]
            else:
                oom_after = oom
        argv += [program, *spec.argv[1:]]
        preexec = None
    else:
        argv = [program, *spec.argv[1:]]
        procs = None if cgroup is None else os.fspath(cgroup / "cgroup.procs")
        adj = None if oom is None else str(oom).encode()
        preexec = _child_setup(
            os.getpid(),
            _prctl(),
            procs,
            adj,
            account,
            None if account is None else spec.cwd,
            _kernel_limits(spec.limits),
            spec.cpus,
        )
    try:
        read_fd, write_fd = os.pipe()
    except OSError as exc:  # EMFILE/ENFILE: out of file descriptors
        raise SpawnError(f"cannot start {spec.argv[0]!r}: {exc.strerror or exc}") from exc
    try:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=write_fd,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=spec.cwd if account is None else None,  # else entered as the account
            close_fds=True,
            start_new_session=True,
            preexec_fn=preexec,
        )
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        what = exc.strerror or str(exc)
        nproc = next((soft for name, soft, _ in spec.limits if name == "nproc"), None)
        if exc.errno == errno.EAGAIN and account is not None and nproc is not None:
            # execve after the switch: the user has more processes than limits.nproc
            raise SpawnError(
                f"cannot start {spec.argv[0]!r} as user {account.user!r}: limits.nproc: the "
                f"user has more processes and threads than {nproc} ({what})"
            ) from exc
        raise SpawnError(f"cannot execute {spec.argv[0]!r}: {what}") from exc
    except (subprocess.SubprocessError, ValueError) as exc:  # ValueError: a NUL in argv/env
        os.close(read_fd)
        os.close(write_fd)
        as_user = "" if account is None else f" as user {account.user!r}"
        raise SpawnError(f"cannot start {spec.argv[0]!r}{as_user}: {exc}") from exc
    os.close(write_fd)
    if oom_after is not None:
        _write_oom_score_adj(f"/proc/{popen.pid}/oom_score_adj", oom_after)
    os.set_blocking(read_fd, False)
    return Child(pid=popen.pid, output_fd=read_fd, popen=popen)


def descendants(pid: int, table: Mapping[int, Iterable[int]] | None = None) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty if it is gone), from one shared table scan
    (``table``: parent -> children, read once by a caller with many pids to look under)."""
    out: list[psutil.Process] = []
    try:
        table = procfs.TABLE.children() if table is None else table
    except OSError:  # out of file descriptors: the process group is still signalled
        return out
    for child in procfs.tree(pid, table) - {pid}:
        with contextlib.suppress(psutil.Error, OSError):
            out.append(psutil.Process(child))  # remembers the create time: reuse-safe kills
    return out


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def kill_tree(pgid: int, extra: Iterable[psutil.Process] = (), scan: bool = True) -> None:
    """SIGKILL the process group ``pgid`` and the given (previously seen) descendants.

    ``scan``: also walk the descendants of ``pgid`` in the process table. Pointless once that
    leader is reaped: the kernel re-parented its children when it exited (to us, the subreaper),
    so nothing names it as parent any more, and the walk costs a read of all of ``/proc``.
    """
    victims = list(extra) + (descendants(pgid) if scan else [])
    signal_group(pgid, signal.SIGKILL)
    for proc in victims:
        with contextlib.suppress(psutil.Error, OSError):
            proc.kill()  # psutil checks the create time, so a reused pid is never hit


@dataclass(frozen=True, slots=True)
class Reaped:
    """A reaped child: pid and decoded status."""

    pid: int
    status: ExitStatus


class Reaper:
    """The single ``waitpid`` caller. Register a callback per pid; run ``serve()`` in a task."""

    def __init__(self, on_orphan: Callable[[Reaped], None] | None = None) -> None:
        self._callbacks: dict[int, Callable[[Reaped], None]] = {}
        self._on_orphan = on_orphan
        self.orphans_reaped = 0

    def register(self, pid: int, callback: Callable[[Reaped], None]) -> None:
        """Call ``callback`` once when ``pid`` is reaped. Register right after spawning."""
        self._callbacks[pid] = callback

    def reap_now(self) -> int:
        """Reap every exited child without blocking; return how many were reaped."""
        count = 0
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return count
            except OSError as exc:  # pragma: no cover - EINTR is retried by Python
                if exc.errno == errno.EINTR:
                    continue
                raise
            if pid == 0:
                return count
            count += 1
            reaped = Reaped(pid, ExitStatus.from_wait_status(status))
            callback = self._callbacks.pop(pid, None)
            if callback is not None:
                callback(reaped)
            else:
                self.orphans_reaped += 1
                if self._on_orphan is not None:
                    self._on_orphan(reaped)

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Reap on every SIGCHLD until cancelled."""
        with anyio.open_signal_receiver(signal.SIGCHLD) as signals:
            task_status.started()
            self.reap_now()  # children that exited before the handler was installed
            async for _ in signals:
                self.reap_now()
