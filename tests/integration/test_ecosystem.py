"""The ecosystem artifacts in examples/ (Prometheus, Grafana, Kubernetes, KEDA), each checked by
its own ecosystem's tool where one is at hand, and all of them against a real ``/metrics`` scrape.

- ``promtool`` (Debian package ``prometheus``) checks the scrape config and the rules and runs the
  rules' unit tests; it also parses every dashboard and KEDA expression (as recording rules).
- ``kubernetes-validate`` (PyPI) checks the Deployment and ConfigMap against the Kubernetes
  OpenAPI schemas (strict: no unknown fields). It has no schema for KEDA's ScaledObject, which
  is checked structurally here.
- A supervisor on simulated GPUs, with a crashing worker, an XID and an operator drain (run by
  the Deployment's own preStop script), is scraped: every metric name and label that the
  dashboard, the alert rules and the KEDA query use must be in that exposition.

Missing tools skip their test unless ``GPU_SUPERVISOR_REQUIRE_TOOLS=1`` (tests/tools.py).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from supervisor.backends.sim import SimBackend
from supervisor.config import Settings, parse_listen, parse_settings
from supervisor.errors import ConfigError
from tests.conftest import SupervisorFactory
from tests.harness import ROOT, worker_cmd
from tests.tools import require_tool

EXAMPLES = ROOT / "examples"
PROMETHEUS = EXAMPLES / "prometheus"
DASHBOARD = EXAMPLES / "grafana" / "dashboard.json"
DEPLOYMENT = EXAMPLES / "k8s" / "deployment.yaml"
SCALEDOBJECT = EXAMPLES / "k8s" / "keda-scaledobject.yaml"
PROMTOOL_INSTALL = "apt-get install prometheus"

#: Labels that Prometheus itself adds to every scraped series (``job``, ``instance``) or that a
#: Kubernetes pod job's relabelling adds (``namespace``, ``pod``): never in the exposition.
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
#: Families that have no sample until the leak detector has a verdict (a window of samples,
#: more than the 20 s this test may take): their labels are the worker ones of DESIGN.md §9.
UNSAMPLED_UNTIL_JUDGED = {
    "gpu_supervisor_worker_leak_slope_bytes_per_second": {"worker", "group"},
    "gpu_supervisor_worker_projected_oom_seconds": {"worker", "group"},
}
#: The alerts that rules_test.yml must exercise (each with a case where it fires).
TESTED_ALERTS = {
    "GpuSupervisorWorkerFatal",
    "GpuSupervisorWorkerRestartingOften",
    "GpuSupervisorWorkerProjectedOom",
    "GpuSupervisorDown",
    "GpuSupervisorNvmlDown",
}

METRIC = re.compile(r"\bgpu_supervisor_[a-z_]+")
SELECTOR = re.compile(r"\b(gpu_supervisor_[a-z_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"\"")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
AGGREGATOR = re.compile(
    r"\b(sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)"
    r"\s*(?:(by|without)\s*\(([^)]*)\)\s*)?\("
)
GROUPING_AFTER = re.compile(r"\s*(by|without)\s*\(([^)]*)\)")
VECTOR_MATCHING = re.compile(r"\b(on|ignoring|group_left|group_right)\s*\(")
LABEL_VALUES = re.compile(r"^label_values\((gpu_supervisor_[a-z_]+)(?:\{[^}]*\})?\s*,\s*(\w+)\)$")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
TEMPLATE_LABEL = re.compile(r"\$labels\.(\w+)")


# --- PromQL, as far as these artifacts use it ------------------------------------------------


def _labels(names: str) -> set[str]:
    return {n.strip() for n in names.split(",") if n.strip()}


def _closing(text: str, open_at: int) -> int:
    """The index of the parenthesis that closes the one at ``open_at``."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise AssertionError(f"unbalanced parentheses in {text!r}")


@dataclass
class Aggregation:
    """One aggregation: its ``by``/``without`` labels and the text it aggregates."""

    grouping: str | None
    labels: set[str]
    argument: str


def aggregations(expr: str) -> list[Aggregation]:
    """Every aggregation in ``expr``, outermost first (both ``sum by (l) (x)`` and ``sum(x) by (l)``)."""
    found = []
    for m in AGGREGATOR.finditer(expr):
        open_at = m.end() - 1
        close = _closing(expr, open_at)
        grouping, labels = m.group(2), m.group(3)
        if grouping is None and (after := GROUPING_AFTER.match(expr, close + 1)):
            grouping, labels = after.group(1), after.group(2)
        found.append(Aggregation(grouping, _labels(labels or ""), expr[open_at + 1 : close]))
    return found


@dataclass
class Usage:
    """What one expression asks of the exposition."""

    where: str
    expr: str
    metrics: set[str] = field(default_factory=set)
    #: (metric, label) pairs the expression needs to exist
    labels: set[tuple[str, str]] = field(default_factory=set)
    #: labels its result has (None: any label of its metrics)
    output: set[str] | None = None


def analyse(where: str, expr: str) -> Usage:
    """The metric names and labels an expression uses, and the labels of its result."""
    assert not VECTOR_MATCHING.search(expr), (
        f"{where}: vector matching (on/ignoring/group_*) is not checked here: {expr}"
    )
    bare = QUOTED.sub('""', expr)
    use = Usage(where, expr, set(METRIC.findall(bare)))
    for metric, matchers in SELECTOR.findall(bare):
        use.labels |= {(metric, label) for label in MATCHER.findall(matchers)}
    aggs = aggregations(bare)
    for agg in aggs:
        for metric in METRIC.findall(agg.argument):
            use.labels |= {(metric, label) for label in agg.labels}
    if aggs:
        outer = aggs[0]
        use.output = outer.labels if outer.grouping == "by" else set()
        if "histogram_quantile" in bare:
            use.output.discard("le")
    return use


# --- the artifacts -------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(PROMETHEUS / "rules.yml")
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def dashboard_panels(doc: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in doc["panels"]:
        yield panel
        yield from panel.get("panels", [])


def scaled_object() -> dict[str, Any]:
    (doc,) = load_yaml_all(SCALEDOBJECT)
    return doc


def k8s_objects() -> dict[str, dict[str, Any]]:
    """``{kind: object}`` of deployment.yaml (one object of each kind)."""
    objects = load_yaml_all(DEPLOYMENT)
    by_kind = {o["kind"]: o for o in objects}
    assert len(by_kind) == len(objects), "one object of each kind expected"
    return by_kind


def usages() -> list[Usage]:
    """Every PromQL expression of the dashboard, the alert rules, the KEDA trigger, and the
    series that the rules' unit tests feed."""
    out = []
    for rule in alert_rules():
        use = analyse(f"rules.yml {rule['alert']}", rule["expr"])
        out.append(use)
    doc = dashboard()
    for panel in dashboard_panels(doc):
        for target in panel.get("targets", []):
            use = analyse(f"dashboard panel {panel['title']!r}", target["expr"])
            out.append(use)
    for var in doc["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = LABEL_VALUES.match(var["definition"])
        assert m, f"dashboard variable {var['name']}: not label_values(metric, label)"
        use = analyse(f"dashboard variable {var['name']}", var["definition"])
        use.labels.add((m.group(1), m.group(2)))
        out.append(use)
    for trigger in scaled_object()["spec"]["triggers"]:
        out.append(analyse("keda trigger", trigger["metadata"]["query"]))
    # the rules' unit tests feed series that must look like the real ones
    for test in load_yaml(PROMETHEUS / "rules_test.yml")["tests"]:
        for series in test["input_series"]:
            out.append(analyse("rules_test.yml input series", series["series"]))
    return out


def as_recording_rules(exprs: Mapping[str, str]) -> str:
    """A rule file with each expression as a recording rule, Grafana variables filled in."""

    def fill(expr: str) -> str:
        expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
        return re.sub(r"\$\{?\w+\}?", ".*", expr)

    rules = [{"record": name, "expr": fill(expr)} for name, expr in exprs.items()]
    return yaml.safe_dump({"groups": [{"name": "artifacts", "rules": rules}]}, sort_keys=False)


def promtool(*args: str | Path, cwd: Path = PROMETHEUS) -> str:
    exe = require_tool("promtool", PROMTOOL_INSTALL)
    done = subprocess.run(
        [exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{out}"
    return out


# --- Prometheus ----------------------------------------------------------------------------


def test_prometheus_config_is_valid() -> None:
    """promtool accepts the scrape config, and through its rule_files, the rules."""
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS" in out and "1 rule files found" in out
    doc = load_yaml(PROMETHEUS / "prometheus.yml")
    assert doc["rule_files"] == ["rules.yml"]
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    sup = jobs["gpu-supervisor"]
    assert sup["metrics_path"] == "/metrics"
    assert sup["static_configs"] == [{"targets": ["127.0.0.1:9811"]}]
    (sd,) = jobs["gpu-supervisor-workers"]["http_sd_configs"]
    assert sd["url"] == "http://127.0.0.1:9811/api/v1/targets"
    text = (PROMETHEUS / "prometheus.yml").read_text()
    assert "credentials_file:" in text  # the bearer token, commented out


def test_alert_rules_are_valid_and_documented() -> None:
    """promtool accepts the rules; each has ``for``, a severity, a summary and a description."""
    out = promtool("check", "rules", "rules.yml")
    rules = alert_rules()
    assert f"SUCCESS: {len(rules)} rules found" in out
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        used = set(TEMPLATE_LABEL.findall(" ".join(rule["annotations"].values())))
        assert used, f"{rule['alert']}: annotations name no label"
    exprs = " ".join(r["expr"] for r in rules)
    for needed in (
        "gpu_supervisor_gpu_throttled",
        "gpu_supervisor_gpu_throttle_reason",
        "gpu_supervisor_gpu_temperature_celsius",
        'increase(gpu_supervisor_worker_restarts_total{reason!~"restart|reload|max_age"}[15m])',
        "gpu_supervisor_worker_leak_slope_bytes_per_second",
        "gpu_supervisor_worker_projected_oom_seconds < 600",
        'gpu_supervisor_worker_state{state="fatal"} == 1',
        "gpu_supervisor_nvml_up == 0",
        "gpu_supervisor_gpu_healthy == 0",
        'up{job="gpu-supervisor"} == 0',
        "gpu_supervisor_records_writable == 0",
    ):
        assert needed in exprs, needed


def test_alert_rules_unit_tests_pass() -> None:
    """``promtool test rules`` passes, and it covers the alerts that matter most."""
    out = promtool("test", "rules", "rules_test.yml")
    assert "SUCCESS" in out
    doc = load_yaml(PROMETHEUS / "rules_test.yml")
    firing = {
        case["alertname"]
        for test in doc["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert firing >= TESTED_ALERTS, TESTED_ALERTS - firing
    quiet = {
        case["alertname"]
        for test in doc["tests"]
        for case in test["alert_rule_test"]
        if not case.get("exp_alerts")
    }
    assert "GpuSupervisorWorkerRestartingOften" in quiet


def test_dashboard_and_keda_expressions_parse(tmp_path: Path) -> None:
    """promtool parses every dashboard and KEDA expression (as recording rules)."""
    exprs: dict[str, str] = {}
    for panel in dashboard_panels(dashboard()):
        for target in panel.get("targets", []):
            exprs[f"dashboard:panel{panel['id']}_{target['refId']}"] = target["expr"]
    for i, trigger in enumerate(scaled_object()["spec"]["triggers"]):
        exprs[f"keda:trigger{i}"] = trigger["metadata"]["query"]
    path = tmp_path / "artifact_exprs.yml"
    path.write_text(as_recording_rules(exprs))
    out = promtool("check", "rules", path, cwd=tmp_path)
    assert f"SUCCESS: {len(exprs)} rules found" in out


# --- Grafana -------------------------------------------------------------------------------


def test_dashboard_structure() -> None:
    """Unique panel ids, every panel queries through the datasource variable, gpu/worker vars."""
    doc = dashboard()
    assert 36 <= doc["schemaVersion"] <= 41
    assert doc["uid"] and doc["title"]
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    ds_vars = [v for v in variables.values() if v["type"] == "datasource"]
    assert len(ds_vars) == 1 and ds_vars[0]["query"] == "prometheus"
    ds_ref = "${" + ds_vars[0]["name"] + "}"
    for name in ("gpu", "worker"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == ds_ref
    panels = list(dashboard_panels(doc))
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    titles = [p["title"] for p in panels]
    assert len(set(titles)) == len(titles)
    exprs = []
    for panel in panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": ds_ref}, panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']}: no targets"
        ref_ids = [t["refId"] for t in targets]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in targets:
            assert target["expr"].strip(), panel["title"]
            assert target.get("datasource", panel["datasource"]) == panel["datasource"]
            exprs.append(target["expr"])
    every = " ".join(exprs)
    for metric in (
        "gpu_supervisor_gpu_utilization_percent",
        "gpu_supervisor_gpu_memory_used_bytes",
        "gpu_supervisor_gpu_memory_total_bytes",
        "gpu_supervisor_gpu_temperature_celsius",
        "gpu_supervisor_gpu_throttled",
        "gpu_supervisor_gpu_throttle_reason",
        "gpu_supervisor_worker_gpu_memory_bytes",
        "gpu_supervisor_worker_host_rss_bytes",
        "gpu_supervisor_worker_restarts_total",
        "gpu_supervisor_worker_leak_slope_bytes_per_second",
        "gpu_supervisor_worker_projected_oom_seconds",
        "gpu_supervisor_actions_total",
        "gpu_supervisor_worker_state",
        "gpu_supervisor_gpu_xids_watched",
    ):
        assert metric in every, metric
    assert '$gpu"' in every and '$worker"' in every  # the variables are used


FILTER_ON_ZERO = re.compile(r"==\s*0\s*$")


def test_dashboard_panels_show_problems_as_problems() -> None:
    """A problem plotted at 0 and colours Grafana picks by itself mislead.

    - A time-series target filtered with ``== 0`` (GPUs whose ``gpu_healthy`` is 0) plots each
      match at 0: on the axis, with a legend that reads "unhealthy 0", beside series that show
      their problems at 1. Such a target must map the match to a value above 0.
    - A stat panel coloured by value (``colorMode`` background or value) without thresholds of
      its own gets Grafana's default ones, red from 80: a fleet's "Ready workers" turned red
      once 80 of them were ready. Each such panel sets its thresholds (and "derated" its own).
    """
    for panel in dashboard_panels(dashboard()):
        if panel["type"] == "timeseries":
            for target in panel["targets"]:
                assert not FILTER_ON_ZERO.search(target["expr"]), (panel["title"], target["expr"])
        if panel["type"] == "stat" and panel["options"].get("colorMode") in (
            None,
            "value",
            "background",
        ):
            config = panel["fieldConfig"]
            assert "thresholds" in config["defaults"], panel["title"]
            steps = config["defaults"]["thresholds"]["steps"]
            assert steps[0]["value"] is None, panel["title"]
    (ready,) = [p for p in dashboard_panels(dashboard()) if p["title"] == "Ready workers"]
    assert [s["color"] for s in ready["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [
        "green"
    ]
    (derated,) = [t for t in ready["targets"] if "worker_derated" in t["expr"]]
    (override,) = [
        o
        for o in ready["fieldConfig"]["overrides"]
        if o["matcher"] == {"id": "byFrameRefID", "options": derated["refId"]}
    ]
    (steps,) = [p["value"]["steps"] for p in override["properties"] if p["id"] == "thresholds"]
    assert steps[0] == {"color": "green", "value": None} and steps[1]["value"] == 1, steps


def test_dashboard_shows_each_gpu_whose_xids_are_not_watched() -> None:
    """Regression: the dashboard did not show ``gpu_xids_watched``, so a GPU whose XIDs act on
    nothing looked like any other. A stat panel in the GPUs row shows each such GPU now (an
    instant query: a GPU watched again leaves it), in the warning colour, by host and index."""
    doc = dashboard()
    (panel,) = [
        p
        for p in dashboard_panels(doc)
        if any("gpu_xids_watched" in t["expr"] for t in p.get("targets", []))
    ]
    (gpus_row,) = [p for p in doc["panels"] if p["type"] == "row" and p["title"] == "GPUs"]
    (next_row,) = [p for p in doc["panels"] if p["type"] == "row" and p["title"] == "Workers"]
    assert gpus_row["gridPos"]["y"] < panel["gridPos"]["y"] < next_row["gridPos"]["y"]
    assert panel["type"] == "stat"
    (target,) = panel["targets"]
    assert target["expr"] == (
        '1 - gpu_supervisor_gpu_xids_watched{instance=~"$instance", gpu=~"$gpu"} > 0'
    )
    assert target["instant"] is True and target["range"] is False
    assert set(LEGEND_LABEL.findall(target["legendFormat"])) == {"instance", "gpu"}
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["thresholds"]["steps"] == [
        {"color": "green", "value": None},
        {"color": "orange", "value": 1},
    ]
    assert defaults["mappings"] == [
        {"type": "value", "options": {"1": {"text": "XIDs not watched"}}}
    ]
    assert defaults["noValue"]
    assert panel["options"]["colorMode"] == "background"
    # no panel overlaps another (the rows below moved down to make room)
    cells: set[tuple[int, int]] = set()
    for p in dashboard_panels(doc):
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, p["title"]
        cells |= mine


# --- Kubernetes ----------------------------------------------------------------------------


def embedded_config() -> tuple[dict[str, Any], Settings]:
    """The ConfigMap's config.toml: raw TOML data and validated settings."""
    data = k8s_objects()["ConfigMap"]["data"]
    raw = tomllib.loads(data["config.toml"])
    return raw, parse_settings(raw, "examples/k8s/deployment.yaml ConfigMap config.toml")


def container_of(deployment: Mapping[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def port_number(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return int(named[port])


def mounted_volume(pod: Mapping[str, Any], container: Mapping[str, Any], path: Path) -> Any:
    """The volume whose mount holds ``path`` (the deepest mount)."""
    best: tuple[int, str] | None = None
    for mount in container["volumeMounts"]:
        root = Path(mount["mountPath"])
        if (path == root or root in path.parents) and (best is None or len(root.parts) > best[0]):
            best = (len(root.parts), mount["name"])
    assert best is not None, f"nothing is mounted at {path}"
    (volume,) = [v for v in pod["volumes"] if v["name"] == best[1]]
    return volume


PRESTOP_DRAIN = re.compile(r"gpu-supervisor drain -c (\S+) (\S+)")


def prestop_script(container: Mapping[str, Any]) -> str:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3
    return str(command[2])


def test_k8s_deployment_matches_its_config() -> None:
    """Entrypoint, probes on the API port, token Secret, drain hook, grace period, GPU, state."""
    objects = k8s_objects()
    assert set(objects) == {"ConfigMap", "Deployment"}
    deployment = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    raw, settings = embedded_config()

    # the supervisor is the entrypoint, on the ConfigMap's file
    command = container["command"]
    assert command[:3] == ["gpu-supervisor", "run", "-c"]
    config_path = Path(command[3])
    config_volume = mounted_volume(pod, container, config_path)
    assert config_volume["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    assert config_path.name == "config.toml"

    # probes reach the API: a non-loopback listen (so it needed a token_file to validate)
    kind, host, port = parse_listen(settings.api.listen)
    assert (kind, host) == ("tcp", "0.0.0.0") and port > 0  # noqa: S104 - what the pod must do
    assert settings.api.token_file is not None
    assert settings.api.auth_read is False, "probes and the scrape carry no token"
    no_token = {**raw, "api": {k: v for k, v in raw["api"].items() if k != "token_file"}}
    with pytest.raises(ConfigError, match="not a loopback address and no token_file"):
        parse_settings(no_token, "without token_file")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert port_number(container, get["port"]) == port, probe

    # the token: a Secret file nobody else can read, and no fsGroup to add group bits
    token_volume = mounted_volume(pod, container, settings.api.token_file)
    assert "secretName" in token_volume["secret"]
    assert token_volume["secret"]["defaultMode"] & 0o077 == 0
    assert "fsGroup" not in pod.get("securityContext", {})
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts[token_volume["name"]].get("readOnly") is True

    # preStop drains every group of the config, through the same config file
    script = prestop_script(container)
    drains = PRESTOP_DRAIN.findall(script)
    assert drains, f"preStop does not drain: {script}"
    assert {Path(c) for c, _ in drains} == {config_path}
    assert {g for _, g in drains} == {g.name for g in settings.workers}

    # the drain (drain_timeout_s, then stop_timeout_s) and then the graceful stop
    # (shutdown_timeout_s) fit in the grace period
    grace = pod["terminationGracePeriodSeconds"]
    shutdown = settings.supervisor.shutdown_timeout_s
    drain = max(g.drain_timeout_s + g.stop_timeout_s for g in settings.workers)
    assert grace > shutdown
    assert grace >= drain + shutdown
    # the wait for the drain is bounded in seconds (a deadline), not in passes of a loop
    # whose every pass starts the CLI (~2 s each: 30 passes were about a minute)
    loop_bound = re.search(r"end=\$\(\(\$\(date \+%s\) \+ (\d+)\)\)", script)
    assert loop_bound and int(loop_bound.group(1)) + shutdown < grace, script
    assert '"$(date +%s)" -lt "$end"' in script, script
    # docs/operations.md quotes the grace period and the preStop wait as the file has them
    operations = (ROOT / "docs" / "operations.md").read_text()
    quoted = re.findall(r"`terminationGracePeriodSeconds` \((\d+)\)", operations)
    assert quoted and {int(q) for q in quoted} == {grace}, (quoted, grace)
    assert f"waits for it, at most {loop_bound.group(1)} s" in operations

    # one GPU, state_dir on a volume, Prometheus annotations on the API port
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    state_volume = mounted_volume(pod, container, settings.supervisor.state_dir)
    assert state_volume["name"] not in (config_volume["name"], token_volume["name"])
    assert mounts[state_volume["name"]].get("readOnly") is not True
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == port
    assert notes["prometheus.io/path"] == "/metrics"

    # the selector matches the pod template
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_keda_scaledobject_targets_the_deployment() -> None:
    doc = scaled_object()
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
    deployment = k8s_objects()["Deployment"]
    ref = doc["spec"]["scaleTargetRef"]
    assert ref["name"] == deployment["metadata"]["name"]
    assert ref.get("kind", "Deployment") == "Deployment"
    assert ref.get("apiVersion", "apps/v1") == "apps/v1"
    assert 1 <= doc["spec"]["minReplicaCount"] <= doc["spec"]["maxReplicaCount"]
    (trigger,) = doc["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["serverAddress"].startswith("http")
    assert "gpu_supervisor_gpu_utilization_percent" in meta["query"]
    assert f'pod=~"{ref["name"]}-' in meta["query"], "the query is not limited to its pods"
    assert isinstance(meta["threshold"], str) and float(meta["threshold"]) > 0
    assert trigger.get("metricType", "AverageValue") in {"AverageValue", "Value"}


def test_k8s_manifests_validate_against_kubernetes_schemas() -> None:
    """kubernetes-validate (strict) accepts the ConfigMap and the Deployment."""
    exe = require_tool("kubernetes-validate", "pip install kubernetes-validate")
    done = subprocess.run(
        [exe, "--strict", str(DEPLOYMENT)], capture_output=True, text=True, timeout=60, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for kind in ("configmap", "deployment"):
        assert re.search(rf"passed for resource {kind}/", out), out


# --- against a real scrape -----------------------------------------------------------------


@dataclass
class Exposition:
    """Sample names of a scrape with the labels seen on them."""

    labels: dict[str, set[str]]
    #: sample names of families that had no sample
    unsampled: set[str]


def exposition(text: str) -> Exposition:
    out = Exposition({}, set())
    for family in text_string_to_metric_families(text):
        if not family.samples:
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            out.unsampled |= {family.name + s for s in suffixes.get(family.type, [""])}
        for sample in family.samples:
            out.labels.setdefault(sample.name, set()).update(sample.labels)
    out.unsampled -= set(out.labels)
    return out


def problems_with(uses: list[Usage], scrape: Exposition) -> list[str]:
    """What the expressions ask for that the scrape does not have."""
    problems = []
    for use in uses:
        for metric in sorted(use.metrics):
            if metric in scrape.labels:
                continue
            if metric in scrape.unsampled and metric in UNSAMPLED_UNTIL_JUDGED:
                continue
            why = "has no samples" if metric in scrape.unsampled else "is not exposed"
            problems.append(f"{use.where}: {metric} {why} ({use.expr})")
        have: dict[str, set[str]] = {}
        for metric in use.metrics:
            have[metric] = scrape.labels.get(metric) or UNSAMPLED_UNTIL_JUDGED.get(metric, set())
        for metric, label in sorted(use.labels):
            if label not in have.get(metric, set()) | TARGET_LABELS:
                problems.append(f"{use.where}: {metric} has no label {label!r} ({use.expr})")
    return problems


def output_problems(where: str, use: Usage, wanted: set[str], scrape: Exposition) -> list[str]:
    """Labels that a legend or an annotation shows but the expression's result lacks."""
    if use.output is not None:
        available = use.output
    else:
        available = set().union(
            *(scrape.labels.get(m) or UNSAMPLED_UNTIL_JUDGED.get(m, set()) for m in use.metrics)
        )
        available |= TARGET_LABELS
        available.discard("le")
    missing = wanted - available
    return [f"{where}: shows {sorted(missing)} that {use.expr!r} does not have"] if missing else []


def run_prestop(script: str, url: str, config_path: str, group: str, test_group: str) -> float:
    """Run the Deployment's preStop script against ``url`` for ``test_group``; its duration."""
    cli = f"{shlex.quote(sys.executable)} -m supervisor"
    drain = f"gpu-supervisor drain -c {config_path} {group}"
    assert drain in script
    local = script.replace(drain, f"gpu-supervisor drain -c {config_path} {test_group}")
    local = local.replace(f"-c {config_path}", f"--url {url}")
    assert "gpu-supervisor status --url" in local
    local = local.replace("gpu-supervisor ", f"{cli} ")
    assert "gpu-supervisor" not in local
    started = time.monotonic()
    done = subprocess.run(
        ["/bin/sh", "-c", local], capture_output=True, text=True, timeout=40, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{test_group}: drain requested" in done.stdout, done.stdout + done.stderr
    return time.monotonic() - started


def test_artifacts_match_a_real_scrape(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    """Every metric and label of the dashboard, the rules and KEDA is in a real exposition; the
    Deployment's preStop script drains a group of a running supervisor."""
    sim_dir = tmp_path / "sim"
    SimBackend(sim_dir, 2).open()
    with open(sim_dir / "gpus" / "1", "a") as fh:  # a GPU from before Ampere: no row remapper
        fh.write("rc_nvmlDeviceGetRemappedRows 3\n")
    common = {"stop_timeout_s": 2, "log_passthrough": True, "restart": {"stable_s": 0.1}}
    sup = supervisor(
        {
            "supervisor": {"sample_interval_s": 0.1},
            "gpu": {"backend": "sim", "sim_dir": str(sim_dir), "release_timeout_s": 1},
            "workers": [
                # reports what its tensors hold (X_GPU_MEMORY_IN_USE_MB) besides its NVML claim
                {
                    **common,
                    "name": "g",
                    "command": worker_cmd("sim_worker", "500", "--in-use", "300"),
                },
                {
                    **common,
                    "name": "crash",
                    "gpus": "none",
                    "command": worker_cmd("crash_after", "0.3"),
                },
                {
                    **common,
                    "name": "d",
                    "gpus": "none",
                    "drain_timeout_s": 2,
                    "command": worker_cmd("ready_then_sleep"),
                },
            ],
        }
    )
    for worker in ("g-0", "d-0"):
        sup.ready(worker)
    # an XID (63: counted only), once the backend watches the events file
    with open(sim_dir / "events", "a") as fh:
        fh.write("0 63\n")
    sup.wait_event(event="gpu.xid", xid=63)
    # a crash: post-mortem and restart counters
    sup.wait_event(event="records.postmortem", worker="crash-0")
    sup.wait_events(2, event="worker.spawned", worker="crash-0")
    url = sup.api_url()

    # the preStop hook, as the Deployment has it, drains group d (an operator action)
    container = container_of(k8s_objects()["Deployment"])
    script = prestop_script(container)
    (config_path, group), *_ = PRESTOP_DRAIN.findall(script)
    took = run_prestop(script, url, config_path, group, "d")
    assert took < 30
    with httpx.Client(base_url=url, timeout=10) as http:
        state = http.get("/api/v1/workers/d-0").json()["state"]
        assert state == "stopped", "preStop returned before the drain had finished"
        text = http.get("/metrics").text
    scrape = exposition(text)
    for sample in (
        "gpu_supervisor_worker_restarts_total",
        "gpu_supervisor_postmortems_total",
        "gpu_supervisor_actions_total",
        "gpu_supervisor_gpu_xid_errors_total",
        "gpu_supervisor_worker_gpu_memory_bytes",
        "gpu_supervisor_worker_gpu_memory_in_use_bytes",
    ):
        assert sample in scrape.labels, f"{sample} has no samples in this scrape"

    uses = usages()
    problems = problems_with(uses, scrape)
    by_where = {u.where: u for u in uses}
    for rule in alert_rules():
        use = by_where[f"rules.yml {rule['alert']}"]
        wanted = set(TEMPLATE_LABEL.findall(" ".join(rule["annotations"].values())))
        problems += output_problems(f"rules.yml {rule['alert']}", use, wanted, scrape)
    for panel in dashboard_panels(dashboard()):
        for target in panel.get("targets", []):
            use = analyse(f"dashboard panel {panel['title']!r}", target["expr"])
            wanted = set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
            problems += output_problems(use.where, use, wanted, scrape)
    assert not problems, "\n".join(problems)
    assert sup.stop() == 0
