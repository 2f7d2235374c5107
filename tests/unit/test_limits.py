"""``[workers.limits]``: the config's forms and refusals, what a plan carries, and when the
supervisor cannot give a limit (pure: the current limits, the capability and the kernel's
``fs.nr_open`` are injected). The limits set on real workers: tests/integration/test_limits.py.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor import processes
from supervisor.config import LimitsSection, parse_settings
from supervisor.errors import ConfigError
from supervisor.plan import launch_spec
from supervisor.policy.reload import diff_groups
from supervisor.processes import RLIMITS, limits_problem

W = {"name": "gpen", "command": ["python", "-m", "app"]}
INF = resource.RLIM_INFINITY


def limits(value: dict[str, object]) -> tuple[tuple[str, int | None, int | None], ...]:
    settings = parse_settings({"workers": [{**W, "limits": value}]}, "c.toml")
    return settings.workers[0].limits.items()


def refused(value: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_settings({"workers": [{**W, "limits": value}]}, "c.toml")
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({}, ()),
        ({"nofile": 4096}, (("nofile", 4096, 4096),)),
        ({"memlock": "unlimited"}, (("memlock", None, None),)),
        ({"memlock": "Infinity"}, (("memlock", None, None),)),  # systemd's word
        ({"core": 0}, (("core", 0, 0),)),
        ({"stack": [8388608, "unlimited"]}, (("stack", 8388608, None),)),
        ({"nproc": [100, 100]}, (("nproc", 100, 100),)),
        # in a fixed order, whatever the file's
        ({"stack": 1, "core": 2}, (("core", 2, 2), ("stack", 1, 1))),
    ],
)
def test_the_forms_a_limit_takes(
    value: dict[str, object], expected: tuple[tuple[str, int | None, int | None], ...]
) -> None:
    assert limits(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"core": -1}, 'workers[0].limits.core: expected a whole number >= 0, "unlimited"'),
        ({"core": True}, "workers[0].limits.core: expected a whole number >= 0"),
        ({"core": 1.5}, "workers[0].limits.core: expected a whole number >= 0"),
        ({"core": "64G"}, "(got '64G')"),
        ({"core": 2**63}, 'workers[0].limits.core: above 9223372036854775807: write "unlimited"'),
        ({"core": [1]}, "workers[0].limits.core: expected [soft, hard]: two values (got [1])"),
        (
            {"core": [5, 2]},
            "workers[0].limits.core: the soft limit (5) is above the hard limit (2)",
        ),
        ({"core": ["unlimited", 2]}, "the soft limit (unlimited) is above the hard limit (2)"),
        ({"nofile": "unlimited"}, "workers[0].limits.nofile: Linux has no unlimited open files"),
        ({"nofile": [1024, "unlimited"]}, "limits.nofile: Linux has no unlimited open files"),
        ({"rss": 1}, "c.toml: workers[0].limits.rss: unknown key (got 1)"),
        # a CUDA process reserves far more address space than it uses (DESIGN.md)
        ({"as": 1 << 40}, "workers[0].limits.as: never limited here: CUDA reserves far more"),
        ({"data": 1 << 40}, "workers[0].limits.data: not offered: it counts a process's"),
    ],
)
def test_a_bad_limit_is_one_line_naming_it(value: dict[str, object], expected: str) -> None:
    assert expected in refused(value)


def test_every_limit_the_config_takes_is_one_the_supervisor_sets() -> None:
    assert set(LimitsSection.model_fields) == set(RLIMITS)


def test_a_workers_spec_carries_its_groups_limits() -> None:
    settings = parse_settings(
        {"workers": [{**W, "limits": {"nofile": [1024, 4096], "core": 0}}]}, "c.toml"
    )
    spec = launch_spec(settings.workers[0], 0, {}, None, None)
    assert spec.limits == (("core", 0, 0), ("nofile", 1024, 4096))
    plain = parse_settings({"workers": [W]}, "c.toml").workers[0]
    assert launch_spec(plain, 0, {}, None, None).limits == ()


def _now(values: dict[int, tuple[int, int]]) -> Callable[[int], tuple[int, int]]:
    return lambda res: values[res]


CURRENT = {
    resource.RLIMIT_CORE: (0, INF),
    resource.RLIMIT_MEMLOCK: (8 << 20, 8 << 20),
    resource.RLIMIT_NOFILE: (65536, 524288),
    resource.RLIMIT_NPROC: (1000, 1000),
    resource.RLIMIT_STACK: (8 << 20, INF),
}


@pytest.mark.parametrize(
    ("wanted", "may_raise", "expected"),
    [
        ((), False, None),
        # lowering, and raising a soft limit up to the hard one, need nothing
        ((("nofile", 1024, 1024), ("core", 0, 0)), False, None),
        ((("nofile", 524288, 524288),), False, None),
        ((("core", None, None),), False, None),  # unlimited already
        ((("stack", 16 << 20, None),), False, None),
        # raising a hard limit needs CAP_SYS_RESOURCE
        (
            (("memlock", None, None),),
            False,
            "limits.memlock: raising the hard limit from 8388608 to unlimited needs "
            "CAP_SYS_RESOURCE",
        ),
        ((("memlock", None, None),), True, None),
        (
            (("core", 0, 0), ("nproc", 2000, 2000)),
            False,
            "limits.nproc: raising the hard limit from 1000 to 2000 needs CAP_SYS_RESOURCE",
        ),
        # never above the kernel's most open files, whatever the privilege
        (
            (("nofile", 1024, 2_000_000),),
            True,
            "limits.nofile: 2000000 is above the kernel's most open files (fs.nr_open = 1048576)",
        ),
        ((("nofile", 1048576, 1048576),), True, None),
    ],
)
def test_what_the_supervisor_cannot_give(
    wanted: tuple[tuple[str, int | None, int | None], ...],
    may_raise: bool,
    expected: str | None,
) -> None:
    got = limits_problem(wanted, current=_now(CURRENT), may_raise=may_raise, nr_open=1048576)
    assert got == expected


def test_a_change_of_limits_is_a_change_of_the_group() -> None:
    old = parse_settings({"workers": [W]}, "c.toml").workers
    new = parse_settings({"workers": [{**W, "limits": {"core": 0}}]}, "c.toml").workers
    diff = diff_groups(old, new)
    assert diff.changed == ("gpen",) and diff.scaled == () and diff.same_placement == ("gpen",)


@pytest.mark.parametrize(
    ("uid_map", "initial"),
    [
        ("         0          0 4294967295\n", True),
        ("         0       1000          1\n", False),  # unshare -r
        ("         0     100000      65536\n", False),  # a rootless or userns-remapped container
    ],
)
def test_only_the_initial_user_namespace_lets_capabilities_raise_a_hard_limit(
    tmp_path: Path, uid_map: str, initial: bool
) -> None:
    path = tmp_path / "uid_map"
    path.write_text(uid_map)
    assert processes._in_initial_user_namespace(str(path)) is initial


@pytest.mark.parametrize(
    ("tasks", "uid", "expected"),
    [
        (2, 65534, "limits.nproc: user 65534 has 2 processes and threads already, more than"),
        (1, 65534, None),  # the kernel refuses the exec only above the limit
        (5, None, None),  # no switch: checked at fork, by the worker's own processes
        (5, 0, None),  # root is exempt
    ],
)
def test_nproc_the_workers_user_is_over_already_is_said_before_the_fork(
    tasks: int, uid: int | None, expected: str | None
) -> None:
    got = limits_problem(
        (("nproc", 1, 1),),
        current=_now(CURRENT),
        may_raise=False,
        nr_open=1048576,
        uid=uid,
        tasks_of=lambda _uid: tasks,
    )
    assert got == expected or (expected is not None and got is not None and expected in got)
