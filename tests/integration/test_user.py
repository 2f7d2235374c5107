"""``[[workers]] user``: workers run as another user, for real (the suite runs as root here and
in CI; without CAP_SETUID and CAP_SETGID these tests skip, saying so).

The worker (``tests/workers/whoami.py``) reports its real, effective and saved ids, its groups,
its parent-death signal (changing credentials clears it: it must be set after) and its login
variables, then sends READY=1: through the shared notify socket, since the supervisor's own
socket is its user's alone. The scripts are copied to a directory ``nobody`` may read, and run
by an interpreter ``nobody`` may execute (a probe finds one, else the tests skip).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor import processes
from supervisor.errors import SpawnError
from supervisor.model import Account, LaunchSpec
from supervisor.records import unreadable_why
from tests.conftest import SupervisorFactory
from tests.harness import ROOT, WORKERS, worker_cmd

USER = "nobody"


def _entry() -> pwd.struct_passwd:
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        pytest.skip(f"this machine's user database has no {USER!r}")
    if not processes._may_switch_user():
        pytest.skip("running workers as another user needs CAP_SETUID and CAP_SETGID")
    return entry


def _runs_as(python: str, entry: pwd.struct_passwd, cwd: Path) -> bool:
    try:
        done = subprocess.run(
            [python, "-c", "import ctypes, json"],
            user=entry.pw_uid,
            group=entry.pw_gid,
            extra_groups=[],
            cwd=cwd,
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@pytest.fixture
def world() -> Iterator[tuple[str, Path]]:
    """(an interpreter ``nobody`` may run, a directory with the worker scripts it may read)."""
    entry = _entry()
    where = Path(tempfile.mkdtemp(prefix="gpu-supervisor-user-test-"))
    try:
        where.chmod(0o755)
        for script in ("common.py", "whoami.py"):
            shutil.copy(WORKERS / script, where / script)
            (where / script).chmod(0o644)
        candidates = [os.path.realpath(sys.executable), "/usr/bin/python3"]
        python = next((p for p in candidates if _runs_as(p, entry, where)), None)
        if python is None:
            pytest.skip(f"no Python interpreter here that {USER!r} may run ({candidates})")
        yield python, where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _read_until(fd: int, marker: str, timeout: float = 20.0) -> str:
    """Output of a spawned worker up to the line holding ``marker``."""
    deadline = time.monotonic() + timeout
    buf = b""
    while marker.encode() not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} line in {buf!r}"
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 65536)
            assert chunk, f"output ended before a {marker!r} line: {buf!r}"
            buf += chunk
    line = next(x for x in buf.decode().splitlines() if marker in x)
    return line


def _whoami(line: str) -> dict[str, object]:
    info: dict[str, object] = json.loads(line.split(" whoami ", 1)[1])
    return info


def _whoami_group(
    world: tuple[str, Path], name: str = "u", user: str | None = USER, **extra: object
) -> dict[str, object]:
    """A group running ``whoami.py`` from ``world`` (as ``user``; None: the supervisor's)."""
    python, where = world
    group: dict[str, object] = {
        "name": name,
        "command": [python, str(where / "whoami.py")],
        "cwd": str(where),
        "stop_timeout_s": 2,
        **extra,
    }
    if user is not None:
        group["user"] = user
    return group


def _account() -> Account:
    account = processes.resolve_account(USER)
    assert isinstance(account, Account) and account.switch, account
    return account


def _spec(account: Account, argv: tuple[str, ...], cwd: Path) -> LaunchSpec:
    return LaunchSpec(
        name="u-0",
        group="u",
        index=0,
        argv=argv,
        env={"PATH": os.defpath, "GPU_SUPERVISOR_WORKER": "u-0", **account.environ()},
        port=None,
        gpus=None,
        ready_url=None,
        notify=False,
        watchdog_s=0.0,
        cwd=str(cwd),
        account=account,
    )


def test_spawn_changes_every_id_and_keeps_the_parent_death_signal(
    world: tuple[str, Path],
) -> None:
    python, where = world
    account = _account()
    child = processes.spawn(_spec(account, (python, str(where / "whoami.py")), where))
    try:
        # switched in the preexec_fn, never by setpriv (which keeps root's rights to files
        # until the exec: a program only root may run ran as the account)
        assert isinstance(child.popen.args, list) and child.popen.args[0] == python
        info = _whoami(_read_until(child.output_fd, " whoami "))
        assert info["uid"] == [account.uid] * 3
        assert info["gid"] == [account.gid] * 3
        assert info["groups"] == sorted(account.groups)
        assert info["pdeathsig"] == signal.SIGKILL
        assert info["env"] == {**account.environ(), "NOTIFY_SOCKET": None}
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.popen.wait()
        os.close(child.output_fd)


def test_a_worker_of_another_user_gets_its_groups_limits(world: tuple[str, Path]) -> None:
    python, where = world
    account = _account()
    spec = _spec(account, (python, str(where / "whoami.py")), where)
    limits = (("core", 0, 0), ("nofile", 512, 1024))
    child = processes.spawn(dataclasses.replace(spec, limits=limits))
    try:
        info = _whoami(_read_until(child.output_fd, " whoami "))
        assert info["uid"] == [account.uid] * 3
        # /proc/<pid>/limits: reading another user's limits by prlimit needs CAP_SYS_RESOURCE
        rows = Path(f"/proc/{child.pid}/limits").read_text().splitlines()
        shown = {r[:26].strip(): r[26:].split()[:2] for r in rows}
        assert shown["Max open files"] == ["512", "1024"]
        assert shown["Max core file size"] == ["0", "0"]
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.popen.wait()
        os.close(child.output_fd)


def test_the_account_enters_the_working_directory_and_runs_the_program_with_its_own_rights(
    world: tuple[str, Path],
) -> None:
    python, where = world
    account = _account()
    closed = where / "closed"
    closed.mkdir(mode=0o700)
    rootonly = where / "rootonly"
    shutil.copy("/bin/true", rootonly)
    rootonly.chmod(0o700)
    with pytest.raises(SpawnError, match="Permission denied"):
        processes.spawn(_spec(account, (str(rootonly),), where))
    child = processes.spawn(_spec(account, (python, "-c", "pass"), closed))
    try:
        said = _read_until(child.output_fd, "gpu-supervisor:")
        assert said == (
            f"gpu-supervisor: cannot enter the working directory {str(closed)!r}: "
            f"Permission denied (uid {account.uid})"
        )
        assert child.popen.wait(10) == 126
    finally:
        os.close(child.output_fd)


def test_a_group_runs_as_its_user_and_its_workers_reach_the_notify_socket(
    supervisor: SupervisorFactory, world: tuple[str, Path]
) -> None:
    where = world[1]
    account = _account()
    state_dir = where / "state"  # pytest's tmp_path is closed to other users (0700)
    sup = supervisor(
        {
            "supervisor": {"state_dir": str(state_dir)},
            "workers": [
                _whoami_group(world, log_passthrough=True),
                {"name": "r", "command": worker_cmd("ready_then_sleep"), "stop_timeout_s": 2},
            ],
        }
    )
    shared = Path(sup.wait_event(event="notify.shared")["path"])
    assert shared == state_dir / "shared" / "notify.sock"
    ready = sup.ready("u-0")  # READY=1 came through the shared socket
    sup.ready("r-0")
    info = _whoami(sup.wait_line("[u-0] ", contains=" whoami "))
    assert info["uid"] == [account.uid] * 3 and info["gid"] == [account.gid] * 3
    assert info["groups"] == sorted(account.groups)
    assert info["pdeathsig"] == signal.SIGKILL
    assert info["env"] == {**account.environ(), "NOTIFY_SOCKET": str(shared)}
    assert psutil.Process(ready["pid"]).uids().real == account.uid
    # the shared socket: anyone may send (senders are told apart by pid), nobody may list;
    # state_dir may be passed through, not listed, and its files keep their modes
    assert stat.S_IMODE(shared.stat().st_mode) == 0o666
    assert stat.S_IMODE(shared.parent.stat().st_mode) == 0o711
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o751
    # the private one stays the supervisor's user's alone, and its own workers keep it
    assert stat.S_IMODE((state_dir / "notify.sock").stat().st_mode) == 0o600
    env = psutil.Process(sup.ready("r-0")["pid"]).environ()
    assert env["NOTIFY_SOCKET"] == str(state_dir / "notify.sock")
    assert env.get("USER") == os.environ.get("USER")
    assert sup.stop() == 0
    assert not shared.parent.exists()


def test_a_user_that_cannot_be_had_fails_its_workers_start_and_harms_no_other(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    _entry()
    sup = supervisor(
        {
            "workers": [
                {"name": "ghost", "command": worker_cmd("ready_then_sleep"), "user": "no-such-x"},
                {"name": "r", "command": worker_cmd("ready_then_sleep"), "stop_timeout_s": 2},
            ]
        }
    )
    failed = sup.wait_event(event="worker.spawn_failed", worker="ghost-0")
    assert "user 'no-such-x': no such user" in failed["error"]
    sup.ready("r-0")
    assert not sup.find(event="worker.spawned", worker="ghost-0")
    assert not sup.find(event="notify.shared")  # nobody needs it
    assert sup.stop() == 0


def test_a_reload_moves_a_group_to_another_user_and_refuses_one_that_cannot_be_had(
    supervisor: SupervisorFactory, world: tuple[str, Path]
) -> None:
    where = world[1]
    account = _account()
    # a roll-out waits for the new worker to stay ready stable_s
    group = _whoami_group(world, user=None, log_passthrough=True, restart={"stable_s": 0.2})
    sup = supervisor({"supervisor": {"state_dir": str(where / "state")}, "workers": [group]})
    first = sup.ready("u-0")
    assert psutil.Process(first["pid"]).uids().real == os.geteuid()
    assert not sup.find(event="notify.shared")

    # the shared socket is opened when a reload first needs it, and served at once
    mark, lines = sup.mark(), len(sup.stdout)
    sup.write_config({"workers": [{**group, "user": USER}]})
    sup.signal(signal.SIGHUP)
    sup.wait_event(event="supervisor.reload_done", after=mark, timeout=30)
    shared = sup.wait_event(event="notify.shared", after=mark)["path"]
    moved = sup.ready("u-0", after=mark)
    assert psutil.Process(moved["pid"]).uids().real == account.uid
    # the new process's line (the old one's may be read after the mark: its own stream)
    info = _whoami(sup.wait_line("[u-0] ", after=lines, contains=f" {moved['pid']} whoami "))
    assert info["uid"] == [account.uid] * 3 and info["env"]["NOTIFY_SOCKET"] == shared  # type: ignore[index]

    # a user that cannot be had rejects the reload: nothing is stopped
    rejected = sup.reload_rejected({"workers": [{**group, "user": "no-such-x"}]})
    assert rejected["reason"] == "command"
    assert "group u: user 'no-such-x': no such user" in rejected["error"]
    assert psutil.Process(moved["pid"]).is_running()
    assert sup.stop() == 0


def test_a_state_dir_other_users_cannot_reach_fails_their_start_saying_why(
    supervisor: SupervisorFactory, world: tuple[str, Path], tmp_path: Path
) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    sup = supervisor(
        {
            "supervisor": {"state_dir": str(closed / "state")},
            "workers": [_whoami_group(world), _whoami_group(world, "h", ready="none")],
        }
    )
    failed = sup.wait_event(event="worker.spawn_failed", worker="u-0")
    assert "the notify socket for workers of other users cannot be had" in failed["error"]
    assert f"{closed} (mode 0700) is closed to uid {_account().uid}" in failed["error"]
    # a worker that needs no notify socket (no readiness by it, no watchdog) runs
    sup.wait_event(event="worker.spawned", worker="h-0")
    assert sup.stop() == 0


def test_check_config_shows_the_user_and_warns_of_what_it_cannot_have(
    world: tuple[str, Path],
) -> None:
    python, where = world
    closed = where / "closed"
    closed.mkdir(mode=0o700)
    (closed / "serve").write_text("#!/bin/sh\nexit 0\n")
    (closed / "serve").chmod(0o755)
    (where / "linkprog").symlink_to(closed / "serve")  # reachable as written, not where it leads
    (where / "private").write_text("#!/bin/sh\nexit 0\n")
    (where / "private").chmod(0o711)  # executable, not readable: a script cannot run
    path = where / "c.toml"
    path.write_text(
        "[supervisor]\nstate_dir='/tmp/x'\n[gpu]\nbackend='none'\n"
        f"[[workers]]\nname='u'\ncommand=['{python}','-c','1']\nuser='nobody'\n"
        "[[workers]]\nname='g'\ncommand=['sh','-c','true']\nuser='no-such-x'\n"
        "[[workers]]\nname='r'\ncommand=['sh','-c','true']\n"
        f"[[workers]]\nname='c'\ncommand=['{closed}/serve']\nuser='nobody'\n"
        f"[[workers]]\nname='d'\ncommand=['./serve']\ncwd='{closed}'\nuser='nobody'\n"
        f"[[workers]]\nname='p'\ncommand=['{where}/private']\nuser='nobody'\n"
        f"[[workers]]\nname='l'\ncommand=['{where}/linkprog']\nuser='nobody'\n"
    )
    argv = [sys.executable, "-m", "supervisor", "check-config", "-c", str(path)]
    text = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert rows["WORKER"][4] == "USER"
    assert rows["u-0"][4] == "nobody" and rows["g-0"][4] == "no-such-x" and rows["r-0"][4] == "-"
    warnings = [line for line in text.splitlines() if line.startswith("warning: group")]
    uid = _account().uid
    assert warnings == [
        "warning: group g: user 'no-such-x': no such user (its workers would fail to start)",
        f"warning: group c: user 'nobody' cannot start '{closed}/serve': {closed} (mode 0700) "
        f"is closed to uid {uid} (its workers would fail to start)",
        f"warning: group d: user 'nobody' cannot start './serve': cannot enter its working "
        f"directory: {closed} (mode 0700) is closed to uid {uid} (its workers would fail to "
        "start)",
        f"warning: group p: user 'nobody' cannot start '{where}/private': {where}/private "
        f"(mode 0711) is closed to uid {uid} (its workers would fail to start)",
        f"warning: group l: user 'nobody' cannot start '{where}/linkprog': {closed} (mode "
        f"0700) is closed to uid {uid} (its workers would fail to start)",
    ], text
    plan = json.loads(
        subprocess.run(
            [*argv, "--json"], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
    )
    assert [w["user"] for w in plan["workers"]] == [
        "nobody",
        "no-such-x",
        None,
        "nobody",
        "nobody",
        "nobody",
        "nobody",
    ]


def test_a_state_dir_the_workers_user_could_change_gets_no_shared_socket(
    supervisor: SupervisorFactory, world: tuple[str, Path]
) -> None:
    """A state_dir owned by the workers' user (a container's volume made for an unprivileged
    supervisor, then run as root): such a worker could put a socket of its own in place of
    the shared one and read the others' messages. None is opened there; the workers that
    need it fail to start, saying why."""
    where = world[1]
    account = _account()
    state_dir = where / "state"
    state_dir.mkdir(mode=0o750)
    os.chown(state_dir, account.uid, account.gid)
    sup = supervisor(
        {
            "supervisor": {"state_dir": str(state_dir)},
            "workers": [_whoami_group(world)],
        }
    )
    refused = sup.wait_event(event="notify.shared_failed")
    assert refused["error"] == (
        f"{state_dir} belongs to uid {account.uid}: the socket there could be replaced"
    )
    failed = sup.wait_event(event="worker.spawn_failed", worker="u-0")
    assert "the socket there could be replaced" in failed["error"]
    assert not (state_dir / "shared").exists()
    assert sup.stop() == 0


#: Resolves programs as another user (argv: a directory only root may enter, uid, gid).
RESOLVE_AS = """
import encodings.ascii, json, os, sys  # imported while they can be read
from supervisor.errors import SpawnError
from supervisor.processes import resolve_program
closed = sys.argv[1]
os.setgroups([])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[2]))
out = []
for program, cwd in ((closed + "/serve", None), ("sleep", closed), ("sleep", closed + "/app")):
    try:
        out.append(resolve_program(program, {"PATH": "/usr/bin:/bin"}, cwd))
    except SpawnError as exc:
        out.append(str(exc))
print(json.dumps(out))
"""


def test_a_program_or_cwd_behind_a_closed_directory_is_said_so() -> None:
    """Regression: a supervisor run as an ordinary user (the unit's ``User=``) whose program
    lies below a directory it may not enter (a venv under /root) said "No such file or
    directory", sending the operator after a file that is there; a ``cwd`` it may not enter
    passed the check and failed as "cannot execute 'sleep': Permission denied" (blaming the
    program), or was said to be no such directory. Now each says "Permission denied", naming
    the program or the cwd, at start and in check-config alike."""
    entry = _entry()
    closed = Path(tempfile.mkdtemp(prefix="gpu-supervisor-closed-"))  # 0700, root's
    try:
        (closed / "app").mkdir(mode=0o755)
        (closed / "serve").write_text("#!/bin/sh\n")
        (closed / "serve").chmod(0o755)
        out = subprocess.run(
            [sys.executable, "-c", RESOLVE_AS, str(closed), str(entry.pw_uid), str(entry.pw_gid)],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
            cwd=ROOT,
        )
        assert json.loads(out.stdout) == [
            f"cannot execute '{closed}/serve': Permission denied",
            f"cannot start 'sleep' in '{closed}': Permission denied (cwd)",
            f"cannot start 'sleep' in '{closed}/app': Permission denied (cwd)",
        ]
    finally:
        shutil.rmtree(closed, ignore_errors=True)


#: Says why state.json cannot be used, as another user (argv: the file, uid, gid).
WHY_AS = """
import encodings.ascii, os, sys  # imported while they can be read
from pathlib import Path
from supervisor.records import unreadable_why
os.setgroups([])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[2]))
print(unreadable_why(Path(sys.argv[1])))
"""


def test_a_previous_state_this_user_may_not_read_is_said_so(tmp_path: Path) -> None:
    """Regression: a state.json the supervisor's user may not read (a state_dir left by a run
    as root, the unit's ``User=`` now) was logged as "not a JSON object in a regular file",
    which reads as a corrupt file."""
    entry = _entry()
    (tmp_path / "state.json").write_text('{"schema_version": 1}')
    (tmp_path / "state.json").chmod(0o600)
    (tmp_path / "broken.json").write_text("{")
    tmp_path.chmod(0o755)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            WHY_AS,
            str(tmp_path / "state.json"),
            str(entry.pw_uid),
            str(entry.pw_gid),
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout == "cannot be read (Permission denied)\n"
    assert unreadable_why(tmp_path / "broken.json") == "not a JSON object in a regular file"
