"""Every config key through a reload (pure): each key of a worker group, nested sections
included, and each key of the top-level sections, changed alone, does what the reload contract
says (README, "A change to what only the supervisor uses"): a key a worker's process is
launched with restarts the workers onto it, a key only the supervisor uses applies to the
running workers in place, and a top-level key is either applied or named as read at start."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from pydantic import BaseModel

from supervisor.config import Settings, WorkerGroup, parse_settings
from supervisor.model import LaunchSpec
from supervisor.plan import GpuSlot, Plan, build_plan
from supervisor.policy import lifecycle as lc
from supervisor.policy.reload import (
    applied_by_reload,
    diff_groups,
    placement_of,
    start_only_changes,
)

#: How a reload applies a group key, and another valid value for it (the base is ``BASE``):
#: "launch": the workers' processes are launched with it: a change restarts them;
#: "placement": where the workers go: placed afresh (restarted where their GPUs change);
#: "scale": workers are only added or removed; "identity": another group;
#: "timing": the lifecycle's values (``lc.Timing``), set on the running workers;
#: "liveness": the liveness probe of the running process (``LaunchSpec.liveness``);
#: "passthrough": the output copy of the running workers;
#: "live": read from the settings in force each time it is used.
GROUP_KEYS: dict[str, tuple[str, object]] = {
    "name": ("identity", "b"),
    "command": ("launch", ["y", "{port}"]),
    "replicas": ("scale", 3),
    "env": ("launch", {"A": "1"}),
    "cwd": ("launch", "/tmp"),
    "user": ("launch", "nobody"),
    "cpu_affinity": ("launch", "gpu"),
    "gpus": ("placement", [1]),
    "gpus_per_worker": ("placement", 2),
    "max_workers_per_gpu": ("placement", 1),
    "port_base": ("launch", 9100),
    "ready": ("launch", "http://127.0.0.1:{port}/health"),
    "metrics_path": ("live", "/metrics"),
    "log_passthrough": ("passthrough", True),
    "start_timeout_s": ("timing", 60),
    "stop_signal": ("timing", "SIGINT"),
    "stop_timeout_s": ("timing", 3),
    "drain_signal": ("timing", "SIGUSR1"),
    "drain_timeout_s": ("timing", 5),
    "restart.delay_s": ("timing", 2),
    "restart.stable_s": ("timing", 3),
    "restart.backoff_initial_s": ("timing", 2),
    "restart.backoff_max_s": ("timing", 30),
    "restart.burst": ("timing", 2),
    "restart.interval_s": ("timing", 60),
    "health.gpu_memory_limit_mb": ("placement", 1000),
    # memory.max, written at a spawn (where it is used; with rss_watch, "live": runtime)
    "health.host_memory_limit_mb": ("launch", 2000),
    "health.watchdog_s": ("launch", 5),  # WATCHDOG_USEC
    "health.leak_warmup_s": ("live", 30),
    "health.leak_window_s": ("live", 300),  # launch with in_use_reporter: see below
    "health.leak_min_mb_per_min": ("live", 20),
    "health.oom_horizon_s": ("live", 100),
    "health.on_leak": ("live", "restart"),
    "health.on_over_budget": ("live", "drain"),
    "health.on_thermal": ("live", "migrate"),
    "health.log_restart_patterns": ("live", ["boom"]),
    "health.max_unavailable": ("live", 2),
    "health.max_age_s": ("live", 3600),
    "health.max_age_jitter_s": ("live", 60),
    "health.liveness_url": ("liveness", "http://127.0.0.1:{port}/alive"),
    "health.liveness_interval_s": ("liveness", 2),
    "health.liveness_timeout_s": ("liveness", 1),
    "health.liveness_failures": ("liveness", 5),
    "health.in_use_reporter": ("launch", "torch"),
    "limits.core": ("launch", 0),
    "limits.memlock": ("launch", "unlimited"),
    "limits.nofile": ("launch", [1024, 4096]),
    "limits.nproc": ("launch", 4096),
    "limits.stack": ("launch", 8_388_608),
}

BASE: dict[str, Any] = {
    "name": "a",
    "command": ["x", "{port}"],
    "replicas": 2,
    "port_base": 9000,
    "health": {"liveness_url": "http://127.0.0.1:{port}/live"},
}

#: ``[gpu]`` and ``[alerts]`` keys a reload applies, each read from the settings in force
#: where it is used (the healer, placement, the release barrier, the alert sender); every
#: other key of the top-level sections must be one ``start_only_changes`` names.
LIVE_TOP_KEYS = {
    "supervisor.shutdown_timeout_s",
    "supervisor.max_starting",
    "gpu.reserve_mb",
    "gpu.release_timeout_s",
    "gpu.thermal_margin_c",
    "gpu.thermal_sustain_s",
    "gpu.thermal_clear_s",
    "gpu.xid_worker_fatal",
    "gpu.xid_device_fatal",
    "alerts.webhook_url",
}
#: another valid value of each top-level key
TOP_VALUES: dict[str, object] = {
    "supervisor.state_dir": "/elsewhere",
    "supervisor.shutdown_timeout_s": 5,
    "supervisor.sample_interval_s": 1,
    "supervisor.log_max_bytes": 1000,
    "supervisor.log_backups": 1,
    "supervisor.postmortem_keep": 3,
    "supervisor.systemd_ready": "start",
    "supervisor.max_starting": 2,
    "gpu.backend": "sim",
    "gpu.sim_dir": "/sim",
    "gpu.sim_devices": 4,
    "gpu.reserve_mb": 1024,
    "gpu.release_timeout_s": 3,
    "gpu.thermal_margin_c": 2,
    "gpu.thermal_sustain_s": 3,
    "gpu.thermal_clear_s": 3,
    "gpu.xid_worker_fatal": [13],
    "gpu.xid_device_fatal": [79],
    "api.listen": "127.0.0.1:9999",
    "api.token_file": "/etc/token",
    "api.auth_read": True,
    "api.allowed_hosts": ["proxy"],
    "alerts.webhook_url": "http://127.0.0.1:9/hook",
}

DEVICES = [
    GpuSlot(0, "GPU-0", 80_000.0, 80_000.0, cpus=(0, 1)),
    GpuSlot(1, "GPU-1", 80_000.0, 80_000.0, cpus=(2, 3)),
]


def model_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """The dotted keys of ``model``, those of its nested sections (models) included."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from model_keys(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def with_key(data: Mapping[str, Any], key: str, value: object) -> dict[str, Any]:
    section, _, leaf = key.rpartition(".")
    if not section:
        return {**data, key: value}
    return {**data, section: {**data.get(section, {}), leaf: value}}


def plan(settings: Settings, fixed: Mapping[str, tuple[str, ...] | None] | None = None) -> Plan:
    return build_plan(
        settings,
        {"PATH": "/usr/bin"},
        "/run/notify",
        DEVICES,
        fixed,
        accounts={},
        allowed_cpus=frozenset(range(4)),
    )


def reload(base: Mapping[str, Any], key: str, value: object) -> dict[str, Any]:
    """What a reload from ``base`` to ``base`` with ``key`` set to ``value`` does to group a,
    as the runtime decides it (``_reload_group``, ``_roll_each``): its diff, and for each
    worker kept whether it is restarted, and the old and new spec and timing."""
    old = parse_settings({"workers": [base]})
    new = parse_settings({"workers": [with_key(base, key, value)]})
    diff = diff_groups(old.workers, new.workers)
    before, after = plan(old), plan(new)
    keep = {*diff.unchanged, *diff.scaled, *diff.same_placement}
    fixed = {w.name: w.gpus for g in before.groups if g.group.name in keep for w in g.workers}
    after = plan(new, fixed)
    a, b = old.workers[0], new.workers[0]
    t_old, t_new = lc.timing_for(a), lc.timing_for(b)
    in_place = a.health.host_memory_limit_mb == b.health.host_memory_limit_mb
    restarted: dict[str, bool] = {}
    specs: dict[str, tuple[LaunchSpec, LaunchSpec]] = {}
    for spec in before.groups[0].workers:
        now = after.worker(spec.name)
        if now is None:
            continue
        specs[spec.name] = (spec, now)
        same = (a.name in diff.scaled and (now, t_new) == (spec, t_old)) or (
            in_place and now == spec
        )
        restarted[spec.name] = a.name in diff.changed and not same
    return {
        "diff": diff,
        "old": a,
        "new": b,
        "restarted": restarted,
        "specs": specs,
        "timing": (t_old, t_new),
    }


def test_every_group_key_is_classified() -> None:
    """Guards that nobody adds a group key without saying what a reload does with it: every
    key of ``[[workers]]`` (nested sections included) is in ``GROUP_KEYS``, and no key there
    is gone."""
    keys = list(model_keys(WorkerGroup))
    assert sorted(set(keys) - GROUP_KEYS.keys()) == [], "unclassified: add it to GROUP_KEYS"
    assert sorted(GROUP_KEYS.keys() - set(keys)) == []


@pytest.mark.parametrize("key", list(GROUP_KEYS))
def test_a_reload_of_one_group_key_restarts_exactly_where_the_launch_changes(key: str) -> None:
    """Guards the reload contract key by key: changing one ``[[workers]]`` key alone is a
    change of the group; it restarts the workers where (and only where) what they are launched
    with changes (their LaunchSpec, or the memory.max written at their spawn), and a key only
    the supervisor uses reaches the running workers (their timing, liveness probe, output
    copy) or is read from the settings in force."""
    kind, value = GROUP_KEYS[key]
    if kind == "identity":
        return  # a renamed group is another group: removed and added
    out = reload(BASE, key, value)
    diff, old, new = out["diff"], out["old"], out["new"]
    assert old != new, f"{key}: the new value {value!r} is the base's"
    assert diff.changed == ("a",), f"{key}: a change is not seen by the diff"
    assert (diff.scaled == ("a",)) == (kind == "scale"), key
    placed = placement_of(old) != placement_of(new)
    assert (diff.same_placement == ()) == (kind == "placement"), key
    assert placed == (kind == "placement"), key
    restarted = out["restarted"]
    assert restarted, key
    if kind == "launch":
        assert all(restarted.values()), f"{key}: launched with, yet applied in place"
        return
    if kind == "placement":
        for name, (spec, now) in out["specs"].items():  # restarted where their GPUs change
            assert restarted[name] == (spec != now), f"{key}: {name}"
        return
    assert not any(restarted.values()), f"{key}: only the supervisor uses it, yet restarts"
    (t_old, t_new) = out["timing"]
    changed = {
        "timing": t_old != t_new,
        "liveness": any(s.liveness != n.liveness for s, n in out["specs"].values()),
        "passthrough": old.log_passthrough != new.log_passthrough,
    }
    if kind in changed:
        assert changed[kind], f"{key}: the running workers do not get the new value"
    section, _, leaf = key.rpartition(".")
    applied = applied_by_reload(Settings(), Settings(workers=(new,))).workers[0]
    assert getattr(getattr(applied, section) if section else applied, leaf) == getattr(
        getattr(new, section) if section else new, leaf
    )


def test_the_leak_window_restarts_workers_that_report_their_in_use_memory() -> None:
    """Guards ``health.leak_window_s``: with ``in_use_reporter = "torch"`` the workers are
    launched with the reporting interval it sets (GPU_SUPERVISOR_IN_USE_EVERY_S): restarted."""
    base = with_key(BASE, "health.in_use_reporter", "torch")
    out = reload(base, "health.leak_window_s", 300)
    assert all(out["restarted"].values())


def test_every_top_level_key_is_applied_by_a_reload_or_named_as_read_at_start() -> None:
    """Guards that no key of ``[supervisor]``, ``[gpu]``, ``[api]``, ``[alerts]`` (or a
    section added later) is silently dropped by a reload: each, changed alone, is either
    applied (``applied_by_reload`` has the new value, and it is one of ``LIVE_TOP_KEYS``,
    read where it is used) or named by ``start_only_changes`` (``supervisor.reload_partial``)
    and kept at its running value."""
    sections = [k for k in Settings.model_fields if k != "workers"]
    keys = [k for s in sections for k in model_keys(_model(s), f"{s}.")]
    assert sorted(set(keys) - TOP_VALUES.keys()) == [], "add a value to TOP_VALUES"
    base: dict[str, Any] = {"workers": [{"name": "a", "command": ["x"]}]}
    old = parse_settings(base)
    for key in keys:
        section, leaf = key.split(".")
        data = {**base, section: {leaf: TOP_VALUES[key]}}
        if key == "api.auth_read":  # (it needs a token file)
            data["api"] = {**data["api"], "token_file": TOP_VALUES["api.token_file"]}
        new = parse_settings(data)
        assert getattr(getattr(new, section), leaf) != getattr(getattr(old, section), leaf), key
        named = key in start_only_changes(old, new)
        applied = getattr(getattr(applied_by_reload(old, new), section), leaf)
        if named:
            assert applied == getattr(getattr(old, section), leaf), f"{key}: named, yet applied"
        else:
            assert applied == getattr(getattr(new, section), leaf), f"{key}: silently dropped"
            assert key in LIVE_TOP_KEYS, f"{key}: applied, but read once: or add to LIVE_TOP_KEYS"


def _model(section: str) -> type[BaseModel]:
    annotation = Settings.model_fields[section].annotation
    assert isinstance(annotation, type) and issubclass(annotation, BaseModel), section
    return annotation
