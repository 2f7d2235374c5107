"""``[[workers]] user``: the config's syntax, the user database lookup, and what a plan makes
of an account (environment, notify socket; a user that cannot be had never starts a worker as
the supervisor's user). The lookups read this machine's user database: every expectation is
taken from ``pwd``/``grp`` here, never written down."""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import processes
from supervisor.config import WorkerGroup, parse_settings
from supervisor.errors import ConfigError, SpawnError
from supervisor.model import Account
from supervisor.plan import launch_spec
from supervisor.processes import resolve_account, spawn, unrunnable

ROOT_ID = (0, 0, frozenset({0}))


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine's user database has no 'nobody'")


def test_a_name_resolves_to_its_entry_and_groups() -> None:
    entry = _nobody()
    account = resolve_account("nobody", current=ROOT_ID, may_switch=True)
    assert isinstance(account, Account)
    assert (account.uid, account.gid, account.name) == (entry.pw_uid, entry.pw_gid, "nobody")
    assert account.groups == tuple(sorted(set(os.getgrouplist("nobody", entry.pw_gid))))
    assert account.home == entry.pw_dir and account.shell == entry.pw_shell
    assert account.switch
    assert account.environ() == {
        "HOME": entry.pw_dir,
        "USER": "nobody",
        "LOGNAME": "nobody",
        "SHELL": entry.pw_shell,
    }


def test_a_number_resolves_like_its_name() -> None:
    entry = _nobody()
    by_number = resolve_account(str(entry.pw_uid), current=ROOT_ID, may_switch=True)
    assert isinstance(by_number, Account)
    assert (by_number.name, by_number.uid, by_number.gid) == ("nobody", entry.pw_uid, entry.pw_gid)


def test_supplementary_groups_come_from_the_group_database() -> None:
    member = next(
        (
            (g.gr_gid, name)
            for g in grp.getgrall()
            for name in g.gr_mem
            if _has_entry(name) and pwd.getpwnam(name).pw_gid != g.gr_gid
        ),
        None,
    )
    if member is None:
        pytest.skip("no user here is a supplementary member of a group")
    gid, name = member
    account = resolve_account(name, current=ROOT_ID, may_switch=True)
    assert isinstance(account, Account)
    assert gid in account.groups and account.gid in account.groups


def _has_entry(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def test_a_group_after_the_colon_is_the_primary_group() -> None:
    entry = _nobody()
    other = next((g for g in grp.getgrall() if g.gr_gid != entry.pw_gid), None)
    if other is None:
        pytest.skip("only one group in this machine's group database")
    account = resolve_account(f"nobody:{other.gr_name}", current=ROOT_ID, may_switch=True)
    assert isinstance(account, Account)
    assert account.gid == other.gr_gid and other.gr_gid in account.groups
    # a number needs no entry in the group database (as chown and setpriv take it)
    numbered = resolve_account("nobody:54321", current=ROOT_ID, may_switch=True)
    assert isinstance(numbered, Account) and numbered.gid == 54321


@pytest.mark.parametrize(
    ("user", "says"),
    [
        ("no-such-user-here", "user 'no-such-user-here': no such user"),
        ("nobody:no-such-group-here", "user 'nobody:no-such-group-here': no such group"),
        ("4000000000", "no such user"),
    ],
)
def test_what_is_not_in_the_database_is_said(user: str, says: str) -> None:
    _nobody()
    result = resolve_account(user, current=ROOT_ID, may_switch=True)
    assert isinstance(result, str) and says in result


def test_switching_without_the_privilege_is_refused() -> None:
    entry = _nobody()
    unprivileged = (entry.pw_uid + 1, entry.pw_gid, frozenset({entry.pw_gid}))
    result = resolve_account("nobody", current=unprivileged, may_switch=False)
    assert isinstance(result, str)
    assert "needs root" in result and f"uid {entry.pw_uid + 1}" in result


def test_the_supervisors_own_user_needs_no_switch_and_no_privilege() -> None:
    entry = _nobody()
    groups = frozenset(os.getgrouplist("nobody", entry.pw_gid)) | {entry.pw_gid}
    same = resolve_account("nobody", current=(entry.pw_uid, entry.pw_gid, groups), may_switch=False)
    assert isinstance(same, Account) and not same.switch
    # with supplementary groups of its own (a unit's SupplementaryGroups=video): its workers
    # keep them (regression: "needs root" for the supervisor's own user and group)
    more = (entry.pw_uid, entry.pw_gid, groups | {44})
    kept = resolve_account("nobody", current=more, may_switch=False)
    assert isinstance(kept, Account) and not kept.switch


@pytest.mark.parametrize("bad", ["a b", "a:b:c", ":wheel", "app:", "-app", "a\0b", "app\n"])
def test_the_config_refuses_a_malformed_user(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"workers": [{"name": "g", "command": ["x"], "user": bad}]}, "c.toml")
    assert "workers[0].user" in str(err.value) and repr(bad)[1:-1][:3] in str(err.value)


@pytest.mark.parametrize(
    "bad", ["root:99999999999999999999", "nobody:4294967296", "nobody:4294967295", "4294967295"]
)
def test_the_config_refuses_a_user_or_group_number_out_of_range(bad: str) -> None:
    """Regression: a group number above the kernel's (``gid_t``, 32 bits) got past the config
    and the user database lookup raised OverflowError: ``check-config`` and ``run`` ended in
    a traceback (exit 1), as would the same lookup at a reload. And 4294967295 is
    (gid_t)-1, "leave unchanged" to setresgid. Now the config refuses them."""
    with pytest.raises(ConfigError) as err:
        parse_settings({"workers": [{"name": "g", "command": ["x"], "user": bad}]}, "c.toml")
    assert "workers[0].user" in str(err.value) and "4294967294" in str(err.value)


@pytest.mark.parametrize("good", ["app", "1000", "app:video", "1000:44", "svc$", "a.b_c-d"])
def test_the_config_takes_a_user(good: str) -> None:
    settings = parse_settings(
        {"workers": [{"name": "g", "command": ["x"], "user": good}]}, "c.toml"
    )
    assert settings.workers[0].user == good


def _group(**fields: object) -> WorkerGroup:
    data = {"name": "g", "command": ["prog", "{port}"], "port_base": 9000, **fields}
    return parse_settings({"workers": [data]}).workers[0]


ACCOUNT = Account(  # noqa: S604 (a login shell, not subprocess's shell=)
    user="app",
    name="app",
    uid=4242,
    gid=4242,
    groups=(44, 4242),
    home="/home/app",
    shell="/bin/sh",
    switch=True,
)
INHERITED = {"HOME": "/root", "USER": "root", "PATH": "/usr/bin"}


def test_a_plan_gives_the_account_its_login_environment_and_the_shared_socket() -> None:
    spec = launch_spec(
        _group(user="app", env={"SHELL": "/bin/bash"}),
        0,
        INHERITED,
        "/var/lib/gpu-supervisor/notify.sock",
        None,
        accounts={"app": ACCOUNT},
        shared_notify_socket="/tmp/gpu-supervisor-shared-x/notify.sock",
    )
    assert spec.account == ACCOUNT
    assert spec.env["HOME"] == "/home/app" and spec.env["USER"] == "app"
    assert spec.env["LOGNAME"] == "app"
    assert spec.env["SHELL"] == "/bin/bash"  # the group's env still wins
    assert spec.env["NOTIFY_SOCKET"] == "/tmp/gpu-supervisor-shared-x/notify.sock"


def test_the_supervisors_own_user_keeps_the_private_socket() -> None:
    own = dataclasses.replace(ACCOUNT, switch=False)
    spec = launch_spec(
        _group(user="app"),
        0,
        INHERITED,
        "/state/notify.sock",
        None,
        accounts={"app": own},
        shared_notify_socket="/tmp/shared/notify.sock",
    )
    assert spec.env["NOTIFY_SOCKET"] == "/state/notify.sock"


def test_without_a_user_nothing_changes() -> None:
    spec = launch_spec(_group(), 0, INHERITED, "/state/notify.sock", None, accounts={})
    assert spec.account is None and spec.env["HOME"] == "/root"


def test_a_user_that_cannot_be_had_never_starts_a_worker() -> None:
    group = _group(user="ghost")
    unresolved = launch_spec(group, 0, INHERITED, "/s", None)  # not looked up at all
    refused = launch_spec(group, 0, INHERITED, "/s", None, accounts={"ghost": "no such user"})
    for spec in (unresolved, refused):
        assert isinstance(spec.account, str)
        assert spec.env["HOME"] == "/root"
        with pytest.raises(SpawnError):
            spawn(spec)
    assert unrunnable([("g", refused)]) == ["group g: no such user"]


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary directory anyone may pass (pytest's own are closed: 0700)."""
    if os.geteuid() != 0:
        pytest.skip("files of another owner need root to make")
    where = Path(tempfile.mkdtemp(prefix="gpu-supervisor-accounts-test-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def test_what_an_account_may_read_goes_by_every_directory_above(open_tmp: Path) -> None:
    tmp_path = open_tmp / "base"
    tmp_path.mkdir()
    site = tmp_path / "open" / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text("")
    for p in (tmp_path, tmp_path / "open", site):
        p.chmod(0o755)
    (site / "sitecustomize.py").chmod(0o644)
    assert processes.unreadable_by(site / "sitecustomize.py", ACCOUNT) is None
    tmp_path.chmod(0o750)  # root's group only
    why = processes.unreadable_by(site / "sitecustomize.py", ACCOUNT)
    assert why == f"{tmp_path} (mode 0750) is closed to uid 4242"
    os.chown(tmp_path, 0, 44)  # a group the account is in
    assert processes.unreadable_by(site / "sitecustomize.py", ACCOUNT) is None
    (site / "sitecustomize.py").chmod(0o600)
    assert "sitecustomize.py (mode 0600) is closed to uid 4242" in str(
        processes.unreadable_by(site / "sitecustomize.py", ACCOUNT)
    )


def test_a_reporter_its_user_cannot_read_is_a_warning(
    open_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = open_tmp / "closed"
    closed.mkdir(mode=0o700)
    monkeypatch.setattr(processes, "WORKER_SITE_DIR", str(closed / "worker_site"))
    group = _group(user="app", health={"in_use_reporter": "torch"})
    spec = launch_spec(group, 0, INHERITED, "/s", None, accounts={"app": ACCOUNT})
    lines = processes.reporters_unreadable([("g", spec)])
    assert lines == [
        f"group g: its workers run as 'app' and cannot read the in-use reporter ({closed} "
        "(mode 0700) is closed to uid 4242): they send no in-use reports (install "
        "gpu-supervisor where that user can read it)"
    ]
    plain = launch_spec(_group(user="app"), 0, INHERITED, "/s", None, accounts={"app": ACCOUNT})
    assert processes.reporters_unreadable([("g", plain)]) == []  # no reporter, nothing to read
