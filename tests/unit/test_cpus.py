"""``cpu_affinity``: CPU lists, the config's forms, and which CPUs a worker is pinned to
(pure: the CPUs close to each GPU and the supervisor's own are values). On real workers:
tests/integration/test_cpu_affinity.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.config import parse_settings
from supervisor.errors import ConfigError
from supervisor.model import MAX_CPUS, DeviceSample, format_cpulist, parse_cpulist
from supervisor.plan import Cpus, build_plan, slot_for, worker_cpus
from supervisor.processes import cpus_problem

W = {"name": "gpen", "command": ["python", "-m", "app"]}
G0, G1 = "GPU-0", "GPU-1"


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", (0,)),
        ("0-3", (0, 1, 2, 3)),
        ("0-1,8,10-11", (0, 1, 8, 10, 11)),
        (" 3 , 1-2 ", (1, 2, 3)),
        ("2,2,1-2", (1, 2)),
    ],
)
def test_a_cpu_list_reads_as_the_kernel_writes_it(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    "text", ["", "x", "1-", "-1", "3-1", "1,,2", f"{MAX_CPUS}", "0x1", "1_0", "\u0663", "+1"]
)
def test_what_is_no_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpulist(text)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_written_reads_back_the_same(cpus: set[int]) -> None:
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == tuple(sorted(cpus))
    assert len(text.split(",")) <= len(cpus)  # runs are written as ranges


def test_the_config_takes_gpu_a_cpu_list_or_nothing() -> None:
    for value in ("", "gpu", "0-3,8"):
        group = parse_settings({"workers": [{**W, "cpu_affinity": value}]}, "c.toml").workers[0]
        assert group.cpu_affinity == value
    with pytest.raises(ConfigError) as info:
        parse_settings({"workers": [{**W, "cpu_affinity": "3-1"}]}, "c.toml")
    assert str(info.value) == (
        'c.toml: workers[0].cpu_affinity: expected "gpu", "" or a CPU list such as '
        "\"0-7,16-23\" ('3-1': CPUs are numbered 0 to 8191, low to high) (got '3-1')"
    )


CPUS = Cpus({G0: (0, 1, 2, 3), G1: (4, 5, 6, 7), "GPU-x": None}, frozenset(range(6)))


@pytest.mark.parametrize(
    ("affinity", "gpus", "cpus", "expected"),
    [
        ("", (G0,), CPUS, (None, None)),
        ("1,3", None, None, ((1, 3), None)),  # a list needs no GPU
        ("gpu", (G0,), CPUS, ((0, 1, 2, 3), None)),
        # only those the supervisor may use; both GPUs' for a worker on two
        ("gpu", (G1,), CPUS, ((4, 5), None)),
        ("gpu", (G0, G1), CPUS, ((0, 1, 2, 3, 4, 5), None)),
        (
            "gpu",
            (G0, "GPU-x"),
            CPUS,
            (None, "the backend does not say which CPUs are close to GPU-x"),
        ),
        ("gpu", None, CPUS, (None, "it has no GPU placed by the backend (or no GPU telemetry)")),
        ("gpu", (G0,), None, (None, "it has no GPU placed by the backend (or no GPU telemetry)")),
        (
            "gpu",
            (G1,),
            Cpus({G1: (6, 7)}, frozenset({0, 1})),
            (None, "none of the CPUs close to its GPUs (6-7) is one the supervisor may use (0-1)"),
        ),
    ],
)
def test_which_cpus_a_worker_is_pinned_to(
    affinity: str,
    gpus: tuple[str, ...] | None,
    cpus: Cpus | None,
    expected: tuple[tuple[int, ...] | None, str | None],
) -> None:
    assert worker_cpus(affinity, gpus, cpus) == expected


def test_a_plan_pins_each_worker_and_warns_where_gpu_pins_nothing() -> None:
    settings = parse_settings(
        {
            "workers": [
                {**W, "replicas": 2, "cpu_affinity": "gpu"},
                {**W, "name": "x", "gpus": [1], "cpu_affinity": "gpu"},
            ]
        },
        "c.toml",
    )
    # x is counted on GPU-1 first: gpen-0 goes to GPU-0 (fewer workers), gpen-1 to GPU-1
    # (as many workers, more free memory)
    devices = [
        slot_for(DeviceSample(0, G0, "g", memory_total_mb=1000, memory_free_mb=900, cpus=(0,))),
        slot_for(DeviceSample(1, G1, "g", memory_total_mb=1000, memory_free_mb=1000)),
    ]
    plan = build_plan(settings, {}, None, devices, allowed_cpus=frozenset({0, 1}))
    specs = {w.name: w for g in plan.groups for w in g.workers}
    assert (specs["gpen-0"].gpus, specs["gpen-0"].cpus) == ((G0,), (0,))
    assert (specs["gpen-1"].gpus, specs["gpen-1"].cpus) == ((G1,), None)
    assert specs["x-0"].cpus is None
    assert plan.warnings == (
        'group gpen: cpu_affinity = "gpu" pins nothing: the backend does not say which CPUs '
        "are close to GPU-1; its workers run on the supervisor's CPUs",
        'group x: cpu_affinity = "gpu" pins nothing: the backend does not say which CPUs '
        "are close to GPU-1; its workers run on the supervisor's CPUs",
    )


def test_cpus_the_supervisor_may_not_use_cannot_be_given() -> None:
    assert cpus_problem(None, {0}) is None
    assert cpus_problem((0, 1), {0, 1, 2}) is None
    assert cpus_problem((0, 4, 5, 9), {0, 1}) == (
        "cpu_affinity: CPUs 4-5,9 are not among those this supervisor may use (0-1)"
    )
