"""Planning (pure): argv, environment, ports and GPUs of every worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import parse_settings
from supervisor.plan import IN_USE_EVERY_S, WORKER_SITE_DIR, Plan, build_plan, more_room
from supervisor.policy.detect import FLOOR_BUCKET_S


def plan(**group: object) -> Plan:
    g: dict[str, object] = {
        "name": "gpen",
        "command": ["app", "--port", "{port}", "--gpus", "{gpus}", "{name}"],
    }
    g.update(group)
    return build_plan(
        parse_settings({"workers": [g]}),
        {"PATH": "/bin", "NOTIFY_SOCKET": "/sd", "WATCHDOG_USEC": "5"},
        "/n.sock",
    )


def test_argv_env_and_ports() -> None:
    p = plan(replicas=2, port_base=9000, gpus=[1, "GPU-abc"], env={"M": "{group}-{index}"})
    w = p.groups[0].workers[1]
    assert w.argv == ("app", "--port", "9001", "--gpus", "1,GPU-abc", "gpen-1")
    assert w.env["PORT"] == "9001" and w.env["M"] == "gpen-1"
    assert w.env["CUDA_VISIBLE_DEVICES"] == "1,GPU-abc"
    assert w.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert w.env["NOTIFY_SOCKET"] == "/n.sock" and "WATCHDOG_USEC" not in w.env
    assert w.env["PATH"] == "/bin"
    assert p.warnings == ()


def test_auto_without_telemetry_leaves_cuda_unset_and_warns() -> None:
    p = plan()
    assert "CUDA_VISIBLE_DEVICES" not in p.groups[0].workers[0].env
    assert len(p.warnings) == 1


def test_auto_only_keys_with_a_list_are_a_warning() -> None:
    """Every worker gets the whole list: a per-GPU cap or a GPU count set with it does nothing."""
    p = plan(replicas=3, gpus=[0], max_workers_per_gpu=1)
    assert {w.env["CUDA_VISIBLE_DEVICES"] for w in p.groups[0].workers} == {"0"}
    assert p.warnings == (
        'group gpen: max_workers_per_gpu applies to gpus = "auto" only; '
        "with a list every worker gets all of [0]",
    )
    both = plan(gpus=[0, 1], max_workers_per_gpu=4, gpus_per_worker=2).warnings
    assert both[0].startswith("group gpen: gpus_per_worker and max_workers_per_gpu apply to")
    assert plan(gpus=[0, 1]).warnings == ()  # the defaults say nothing


def test_recycling_the_only_worker_of_a_group_is_a_warning() -> None:
    health = {"max_age_s": 86400}
    assert plan(gpus="none", health=health).warnings == (
        "group gpen: max_age_s recycles its only worker: the group serves nothing while it "
        "restarts (with two replicas, one serves meanwhile)",
    )
    assert plan(gpus="none", replicas=2, health=health).warnings == ()


def test_recycling_every_worker_of_a_group_at_once_is_a_warning() -> None:
    """max_unavailable 2 lets a recycle take both of two replicas at once (due together with
    no max_age_jitter_s): the group serves nothing meanwhile, as a group of one does."""
    health = {"max_age_s": 86400, "max_unavailable": 2}
    assert plan(gpus="none", replicas=2, health=health).warnings == (
        "group gpen: max_age_s may recycle all 2 of its workers at once (max_unavailable 2): "
        "the group serves nothing while they restart (keep max_unavailable below replicas)",
    )
    assert plan(gpus="none", replicas=3, health=health).warnings == ()


@pytest.mark.parametrize(
    ("restart", "ready", "storm"),
    [
        ({"backoff_initial_s": 0, "burst": 0}, "notify", True),
        ({"backoff_initial_s": 0}, "notify", False),  # fatal after `burst` failures
        ({"burst": 0}, "notify", False),  # backs off
        ({"stable_s": 0}, "none", True),  # every exit a stable run, restarted at once
        ({"stable_s": 0, "delay_s": 1}, "none", False),
        ({"stable_s": 0}, "notify", False),  # an exit before READY=1 is a failure
    ],
)
def test_a_restart_policy_that_restarts_without_pause_for_ever_is_a_warning(
    restart: dict[str, float], ready: str, storm: bool
) -> None:
    """Regression: a policy that restarts a worker that keeps failing at once and never gives
    up (a restart storm, DESIGN.md: never) passed ``check-config`` without a word."""
    warnings = plan(gpus="none", restart=restart, ready=ready).warnings
    assert any("restart storm" in w for w in warnings) is storm, warnings


def test_the_liveness_url_is_the_workers_and_not_part_of_what_is_launched() -> None:
    health = {"liveness_url": "http://127.0.0.1:{port}/live", "liveness_failures": 5}
    w = plan(gpus="none", port_base=9100, replicas=2, health=health).groups[0].workers[1]
    assert w.liveness is not None
    assert (w.liveness.url, w.liveness.interval_s, w.liveness.failures) == (
        "http://127.0.0.1:9101/live",
        10.0,
        5,
    )
    # a reload that changes only it launches nothing new: applied to the running process
    assert w == plan(gpus="none", port_base=9100, replicas=2).groups[0].workers[1]
    # asked from the start when it is ready at once: said
    assert plan(gpus="none", ready="none", health=health).warnings == (
        'group gpen: liveness_url with ready = "none": asked from the start, while it may '
        "still be loading (no answer then restarts it as hung); set ready to its health URL",
    )


def test_none_hides_all_gpus() -> None:
    assert plan(gpus="none").groups[0].workers[0].env["CUDA_VISIBLE_DEVICES"] == ""


def test_watchdog_and_ready_modes() -> None:
    w = plan(ready="none", health={"watchdog_s": 2.5}).groups[0].workers[0]
    assert w.env["WATCHDOG_USEC"] == "2500000" and w.env["NOTIFY_SOCKET"] == "/n.sock"
    assert not w.notify
    w = plan(ready="none").groups[0].workers[0]
    assert "NOTIFY_SOCKET" not in w.env
    w = plan(ready="http://127.0.0.1:{port}/health", port_base=7000).groups[0].workers[0]
    assert w.ready_url == "http://127.0.0.1:7000/health"


def test_in_use_reporter_goes_first_on_the_pythonpath_once() -> None:
    w = plan(ready="none").groups[0].workers[0]
    assert not {"GPU_SUPERVISOR_IN_USE_SOCKET", "PYTHONPATH"} & set(w.env)  # off by default
    w = (
        plan(
            ready="none",
            env={"PYTHONPATH": f"/app:{WORKER_SITE_DIR}::/lib"},
            health={"in_use_reporter": "torch"},
        )
        .groups[0]
        .workers[0]
    )
    assert w.env["PYTHONPATH"] == f"{WORKER_SITE_DIR}:/app::/lib"  # "" is the cwd: kept
    assert w.env["GPU_SUPERVISOR_IN_USE_SOCKET"] == "/n.sock"
    assert w.env["GPU_SUPERVISOR_IN_USE_EVERY_S"] == "5"  # the floor interval of the window
    assert IN_USE_EVERY_S == FLOOR_BUCKET_S
    assert "NOTIFY_SOCKET" not in w.env  # readiness stays as configured
    assert (Path(WORKER_SITE_DIR) / "sitecustomize.py").is_file()
    short = plan(health={"in_use_reporter": "torch", "leak_window_s": 12}).groups[0].workers[0]
    assert short.env["GPU_SUPERVISOR_IN_USE_EVERY_S"] == "0.1"
    tiny = plan(health={"in_use_reporter": "torch", "leak_window_s": 5}).groups[0].workers[0]
    assert tiny.env["GPU_SUPERVISOR_IN_USE_EVERY_S"] == "0.05"
    assert short.env["PYTHONPATH"] == WORKER_SITE_DIR


def test_inherited_reporter_variables_do_not_leak_into_workers() -> None:
    p = build_plan(
        parse_settings({"workers": [{"name": "g", "command": ["app"]}]}),
        {"GPU_SUPERVISOR_IN_USE_SOCKET": "/outer.sock", "GPU_SUPERVISOR_IN_USE_EVERY_S": "1"},
        "/n.sock",
    )
    assert "GPU_SUPERVISOR_IN_USE_SOCKET" not in p.groups[0].workers[0].env


def test_the_state_dir_marker_is_the_supervisors() -> None:
    """The reclaim's marker comes from the supervisor and a group's env cannot set it."""
    g = {"name": "gpen", "command": ["app"], "env": {"GPU_SUPERVISOR_INSTANCE": "f" * 32}}
    settings = parse_settings({"workers": [g]})
    ours = build_plan(settings, {"GPU_SUPERVISOR_INSTANCE": "a" * 32}, None)
    assert ours.groups[0].workers[0].env["GPU_SUPERVISOR_INSTANCE"] == "a" * 32
    none = build_plan(settings, {}, None)
    assert "GPU_SUPERVISOR_INSTANCE" not in none.groups[0].workers[0].env


def test_an_explicit_index_names_the_listed_gpu_not_a_lost_one() -> None:
    """A GPU no longer listed keeps its old index, which the driver may have given to another
    after a re-init: an explicit index names the listed one."""
    from supervisor.model import DeviceSample
    from supervisor.plan import slot_for

    listed = DeviceSample(0, "GPU-B", "g", memory_total_mb=1000.0, processes=())
    lost = DeviceSample(0, "GPU-A", "g", healthy=False, error="GPU is lost")
    p = build_plan(
        parse_settings({"workers": [{"name": "gpen", "command": ["app"], "gpus": [0]}]}),
        {},
        None,
        [slot_for(listed), slot_for(lost)],
    )
    assert p.groups[0].workers[0].gpus == ("GPU-B",)


@pytest.mark.parametrize(
    ("before", "now", "expected"),
    [
        ((frozenset({"A"}), {"A": 1}), (frozenset({"A"}), {"A": 1}), False),  # as it was
        ((frozenset({"A"}), {"A": 1}), (frozenset({"A", "B"}), {"A": 1}), True),  # B usable
        ((frozenset({"A"}), {"A": 2}), (frozenset({"A"}), {"A": 1}), True),  # one left A
        ((frozenset({"A"}), {"A": 1}), (frozenset({"A"}), {}), True),  # the last left A
        ((frozenset({"A", "B"}), {"A": 1}), (frozenset({"A"}), {"A": 1}), False),  # B lost
        ((frozenset({"A"}), {"A": 1}), (frozenset({"A"}), {"A": 2, "B": 1}), False),  # fuller
        ((frozenset({"A"}), {}), (frozenset({"B"}), {}), True),  # A gone, B back: B is new
    ],
)
def test_more_room_when_a_gpu_became_usable_or_holds_fewer_workers(
    before: tuple[frozenset[str], dict[str, int]],
    now: tuple[frozenset[str], dict[str, int]],
    expected: bool,
) -> None:
    """When workers waiting for a GPU are woken (before their next look)."""
    assert more_room(before, now) is expected


@pytest.mark.parametrize(
    ("budget", "text"),
    [(500, "500"), (1155072, "1155072"), (40960.25, "40960.25"), (0.5, "0.5")],
)
def test_the_budget_a_worker_gets_is_written_as_a_plain_number(budget: float, text: str) -> None:
    """Regression: written with six significant digits, a budget of 1155072 MB (a worker on
    eight 141 GB GPUs) reached the worker as ``1.15507e+06``, which ``int()`` refuses and which
    is not its budget; 40960.25 as ``40960.2``."""
    group = {"name": "a", "command": ["x"], "health": {"gpu_memory_limit_mb": budget}}
    p = build_plan(parse_settings({"workers": [group]}), {}, "/n.sock")
    assert p.groups[0].workers[0].env["GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB"] == text


def test_a_budget_in_the_supervisors_environment_is_not_passed_to_workers_without_one() -> None:
    """``GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB`` is set for workers whose group has a
    ``gpu_memory_limit_mb`` (DESIGN.md section 4: "when set"); one in the supervisor's own
    environment (a supervisor started from a worker's, or a shell that tried a worker out) went
    on to every worker of a group without a budget, which capped itself to a budget nobody set.
    The group's own ``env`` may still set it."""
    settings = parse_settings({"workers": [{"name": "a", "command": ["x"]}]})
    inherited = {"PATH": "/bin", "GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB": "2000"}
    w = build_plan(settings, inherited, "/n.sock").groups[0].workers[0]
    assert "GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB" not in w.env
    budget = {"name": "a", "command": ["x"], "health": {"gpu_memory_limit_mb": 500}}
    p = build_plan(parse_settings({"workers": [budget]}), inherited, "/n.sock")
    assert p.groups[0].workers[0].env["GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB"] == "500"
    own = {"name": "a", "command": ["x"], "env": {"GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB": "700"}}
    p = build_plan(parse_settings({"workers": [own]}), inherited, "/n.sock")
    assert p.groups[0].workers[0].env["GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB"] == "700"


def test_the_api_token_in_the_supervisors_environment_is_not_passed_to_workers() -> None:
    """Regression: ``GPU_SUPERVISOR_API_TOKEN`` (the CLI's bearer token, set in a container's
    or a unit's environment so that ``gpu-supervisor drain`` works there) was inherited by
    every worker: a model server, or a worker running as another user who may not read the
    0600 token file, could stop or restart every worker. The group's own ``env`` may still
    give it on purpose."""
    settings = parse_settings({"workers": [{"name": "a", "command": ["x"]}]})
    inherited = {"PATH": "/bin", "GPU_SUPERVISOR_API_TOKEN": "s3cr3t"}
    w = build_plan(settings, inherited, "/n.sock").groups[0].workers[0]
    assert "GPU_SUPERVISOR_API_TOKEN" not in w.env
    assert w.env["PATH"] == "/bin"
    own = {"name": "a", "command": ["x"], "env": {"GPU_SUPERVISOR_API_TOKEN": "given"}}
    p = build_plan(parse_settings({"workers": [own]}), inherited, "/n.sock")
    assert p.groups[0].workers[0].env["GPU_SUPERVISOR_API_TOKEN"] == "given"  # noqa: S105
