"""Prometheus metrics (DESIGN.md section 9) on an injected registry.

``RuntimeCollector`` reads the runtime's read model at scrape time: nothing is copied into
gauges on every tick. ``sample_duration_seconds`` is a real ``Histogram`` fed by the runtime's
sample listeners. ``Metrics.render()`` keeps the rendered exposition until something it shows
can have changed (a new sample, a worker change, a journal event, a counter move), so a scrape
between two samples costs a dictionary lookup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from supervisor.model import (
    CLOCK_EVENT_REASONS,
    RECOVERY_ACTIONS,
    Sample,
    WorkerState,
    recovery_action_name,
)

if TYPE_CHECKING:
    from supervisor.runtime import Runtime

PREFIX = "gpu_supervisor_"
MIB = 1024 * 1024
#: Sampling takes milliseconds (sim) to tens of milliseconds (NVML with many processes).
SAMPLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Throttle reasons always exported (0/1), so a dashboard sees the series before one fires.
THROTTLE_REASONS = tuple(n for n in CLOCK_EVENT_REASONS.values() if n != "gpu_idle")
#: While a new exposition is being formatted, a previous one at most this old is served.
RENDER_STALE_S = 1.0
#: The files whose writes ``records_writable`` reports.
RECORD_FILES = ("state", "postmortem", "log")

GPU_LABELS = ["gpu", "uuid", "name"]
WORKER_LABELS = ["worker", "group"]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=labels)


class RuntimeCollector(Collector):
    """Every metric of DESIGN.md section 9 except the sample-duration histogram."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry must not call ``collect`` at registration."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Read the runtime's state now."""
        rt = self.runtime
        sample = rt.sampler.last
        # an NVML call that has not returned (a hung driver): the last readings are stale,
        # and the GPUs are reported as the API reports them then, without telemetry
        yield from self._gpus(None if rt.sampler.stuck() is not None else sample)
        yield from self._workers(sample)
        yield from self._supervisor(sample)

    def _gpus(self, sample: Sample | None) -> Iterator[Metric]:
        rt = self.runtime
        util = _gauge("gpu_utilization_percent", "GPU utilization (percent).", GPU_LABELS)
        used = _gauge("gpu_memory_used_bytes", "GPU memory in use (bytes).", GPU_LABELS)
        total = _gauge("gpu_memory_total_bytes", "GPU memory in total (bytes).", GPU_LABELS)
        temp = _gauge("gpu_temperature_celsius", "GPU temperature (degrees Celsius).", GPU_LABELS)
        power = _gauge("gpu_power_watts", "GPU power draw (watts).", GPU_LABELS)
        throttled = _gauge(
            "gpu_throttled", "1 while any clock-event reason other than idle is active.", GPU_LABELS
        )
        reason = _gauge(
            "gpu_throttle_reason",
            "1 while this clock-event reason is active.",
            [*GPU_LABELS, "reason"],
        )
        healthy = _gauge("gpu_healthy", "1 while the GPU answers NVML queries.", GPU_LABELS)
        cordoned = _gauge("gpu_cordoned", "1 while no worker may be placed on the GPU.", GPU_LABELS)
        xids_watched = _gauge(
            "gpu_xids_watched",
            "1 while the GPU's XID errors reach the supervisor (0: not supported, or NVML's event "
            "registration or wait fails: its XIDs restart, drain or quarantine nothing).",
            GPU_LABELS,
        )
        xid = _counter("gpu_xid_errors", "XID errors reported for the GPU.", [*GPU_LABELS, "xid"])
        ecc = _counter(
            "gpu_ecc_errors",
            "ECC errors since the driver loaded (NVML's volatile counters), by type.",
            [*GPU_LABELS, "type"],
        )
        rows = _gauge(
            "gpu_remapped_rows",
            "Rows of GPU memory remapped by the row remapper, by the errors that caused it.",
            [*GPU_LABELS, "type"],
        )
        remap_pending = _gauge(
            "gpu_row_remap_pending",
            "1 while a row remap waits for the GPU's next reset.",
            GPU_LABELS,
        )
        remap_failure = _gauge(
            "gpu_row_remap_failure",
            "1 when a row remap failed (the GPU is quarantined; replace it if it comes again).",
            GPU_LABELS,
        )
        retired = _gauge(
            "gpu_retired_pages_pending",
            "1 while pages retired for ECC errors wait for the GPU's next reset (before Ampere).",
            GPU_LABELS,
        )
        recovery = _gauge(
            "gpu_recovery_action",
            "1 for the recovery action the driver says the GPU needs now (none: 1 when it needs "
            "none).",
            [*GPU_LABELS, "action"],
        )
        quarantined = rt.healer.state.quarantined
        labels_of: dict[str, list[str]] = {}
        for ident in rt.sampler.identities:
            labels_of[ident.uuid] = labels_of[str(ident.index)] = [
                str(ident.index),
                ident.uuid,
                ident.name,
            ]
        for d in sample.devices if sample is not None else ():
            labels = [str(d.index), d.uuid, d.name]
            # the GPU's index now (regression: the one it had when the backend opened, on
            # GPUs renumbered since)
            labels_of[d.uuid] = labels
            _put(util, labels, d.utilization_percent)
            _put(used, labels, None if d.memory_used_mb is None else d.memory_used_mb * MIB)
            _put(total, labels, None if d.memory_total_mb is None else d.memory_total_mb * MIB)
            _put(temp, labels, d.temperature_c)
            _put(power, labels, d.power_watts)
            active = d.throttle_reasons
            if active is not None:
                throttled.add_metric(labels, float(bool(active)))
                for name in (*THROTTLE_REASONS, *(a for a in active if a not in THROTTLE_REASONS)):
                    reason.add_metric([*labels, name], float(name in active))
            healthy.add_metric(labels, float(d.healthy and d.uuid not in quarantined))
            cordoned.add_metric(labels, float(d.uuid in rt.cordoned))
            xids_watched.add_metric(labels, float(d.uuid not in rt.sampler.xids_unwatched))
            if d.retired_pages_pending is not None:
                retired.add_metric(labels, float(d.retired_pages_pending))
            action = recovery_action_name(d.recovery_action)
            if action is not None:
                for name in (
                    *RECOVERY_ACTIONS.values(),
                    *((action,) if action.startswith("code_") else ()),
                ):
                    recovery.add_metric([*labels, name], float(name == action))
            if d.ecc_errors_corrected is not None:
                ecc.add_metric([*labels, "corrected"], d.ecc_errors_corrected)
            if d.ecc_errors_uncorrected is not None:
                ecc.add_metric([*labels, "uncorrected"], d.ecc_errors_uncorrected)
            if d.remapped_rows is not None:
                rows.add_metric([*labels, "correctable"], d.remapped_rows.correctable)
                rows.add_metric([*labels, "uncorrectable"], d.remapped_rows.uncorrectable)
                remap_pending.add_metric(labels, float(d.remapped_rows.pending))
                remap_failure.add_metric(labels, float(d.remapped_rows.failure))
        for (gpu, code), count in sorted(rt.xid_counts.items()):
            labels = labels_of.get(gpu, [gpu, gpu if gpu.startswith("GPU-") else "", ""])
            xid.add_metric([*labels, str(code)], count)
        yield from (util, used, total, temp, power, throttled, reason, healthy, cordoned, xid)
        yield from (xids_watched, ecc, rows, remap_pending, remap_failure, retired, recovery)

    def _workers(self, sample: Sample | None) -> Iterator[Metric]:
        rt = self.runtime
        up = _gauge("worker_up", "1 while the worker has a live process.", WORKER_LABELS)
        ready = _gauge("worker_ready", "1 while the worker is ready.", WORKER_LABELS)
        derated = _gauge(
            "worker_derated",
            "1 while the worker is out of routing because its GPU is hot (on_thermal derate).",
            WORKER_LABELS,
        )
        state = _gauge(
            "worker_state", "1 for the worker's current lifecycle state.", [*WORKER_LABELS, "state"]
        )
        restarts = _counter(
            "worker_restarts", "Restarts of the worker, by reason.", [*WORKER_LABELS, "reason"]
        )
        gpu_mem = _gauge(
            "worker_gpu_memory_bytes",
            "GPU memory held by the worker's process tree (bytes), per GPU.",
            [*WORKER_LABELS, "gpu", "uuid"],
        )
        rss = _gauge(
            "worker_host_rss_bytes", "Host RSS of the worker's process tree (bytes).", WORKER_LABELS
        )
        in_use = _gauge(
            "worker_gpu_memory_in_use_bytes",
            "GPU memory the worker reports it holds (X_GPU_MEMORY_IN_USE_MB: allocated, without "
            "the allocator's cache; absent when it does not report).",
            WORKER_LABELS,
        )
        slope = _gauge(
            "worker_leak_slope_bytes_per_second",
            "GPU memory growth rate seen by the leak detector (bytes per second).",
            WORKER_LABELS,
        )
        oom = _gauge(
            "worker_projected_oom_seconds",
            "Seconds until the worker is projected to hit its budget or the GPU's memory (only "
            "while a leak is suspected).",
            WORKER_LABELS,
        )
        index_of = {i.uuid: str(i.index) for i in rt.sampler.identities}
        # each GPU's index now, also for one added or renumbered since the backend opened
        # (regression: its UUID, or the index it had then)
        index_of.update((d.uuid, str(d.index)) for d in (sample.devices if sample else ()))
        group_of: dict[str, str] = {}
        for runner in rt.workers():
            obj: dict[str, Any] = rt.worker_object(runner)
            labels = [runner.name, runner.spec.group]
            group_of[runner.name] = runner.spec.group
            up.add_metric(labels, float(obj.get("pid") is not None))
            current = runner.state
            ready.add_metric(labels, float(current is WorkerState.READY))
            derated.add_metric(labels, float(bool(obj.get("derated"))))
            for s in WorkerState:
                state.add_metric([*labels, s.value], float(s is current))
            for uuid, mb in sorted((obj.get("gpu_memory_by_gpu") or {}).items()):
                gpu_mem.add_metric([*labels, index_of.get(uuid, uuid), uuid], mb * MIB)
            rss_mb = obj.get("host_rss_mb")
            _put(rss, labels, None if rss_mb is None else rss_mb * MIB)
            in_use_mb = obj.get("gpu_memory_in_use_mb")
            _put(in_use, labels, None if in_use_mb is None else in_use_mb * MIB)
            leak = obj.get("leak") or {}
            per_min = leak.get("slope_mb_per_min")
            _put(slope, labels, None if per_min is None else per_min * MIB / 60.0)
            _put(oom, labels, leak.get("projected_oom_s"))
        for (worker, why), count in sorted(rt.restarts_total.items()):
            if worker in group_of:
                restarts.add_metric([worker, group_of[worker], why], count)
        yield from (up, ready, derated, state, restarts, gpu_mem, rss, in_use, slope, oom)

    def _supervisor(self, sample: Sample | None) -> Iterator[Metric]:
        rt = self.runtime
        nvml = GaugeMetricFamily(
            PREFIX + "nvml_up", "1 while GPU telemetry (NVML or sim) answers.", labels=[]
        )
        up = sample is not None and sample.nvml_available and bool(rt.sampler.identities)
        nvml.add_metric([], float(up and rt.sampler.stuck() is None))
        actions = _counter(
            "actions", "Actions taken (operator and healing), by kind.", ["action", "reason"]
        )
        for (action, why), count in sorted(rt.actions_total.items()):
            actions.add_metric([action, why], count)
        postmortems = _counter(
            "postmortems",
            "Post-mortems made, by reason (written to state_dir as soon as it takes them: see "
            "record_write_errors_total).",
            ["reason"],
        )
        for why, count in sorted(rt.postmortems_total.items()):
            postmortems.add_metric([why], count)
        health = rt.write_health
        errors = _counter(
            "record_write_errors", "Failed writes of records and logs.", ["file", "kind"]
        )
        for (file, kind), count in sorted(health.errors_total.items()):
            errors.add_metric([file, kind], count)
        writable = _gauge("records_writable", "0 while writes of this file fail.", ["file"])
        failing = health.problems()
        for file in RECORD_FILES:
            writable.add_metric([file], float(file not in failing))
        ok, at = rt.last_reload
        reload_ok = _gauge(
            "config_last_reload_successful",
            "1 when the last reload of the config file was applied in full (not rejected, no "
            "roll-out halted); the start counts as one.",
            [],
        )
        reload_ok.add_metric([], float(ok))
        reload_at = _gauge(
            "config_last_reload_success_timestamp_seconds",
            "When the config file was last applied in full (Unix time).",
            [],
        )
        reload_at.add_metric([], at)
        yield from (nvml, actions, postmortems, errors, writable, reload_ok, reload_at)


def _put(family: GaugeMetricFamily, labels: list[str], value: float | None) -> None:
    """Add a sample unless the value is unknown (an unsupported field is absent, never 0)."""
    if value is not None:
        family.add_metric(labels, float(value))


class Metrics:
    """The registry, the histogram and a cached exposition for one runtime."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, runtime: Runtime, registry: CollectorRegistry | None = None) -> None:
        self.runtime = runtime
        self.registry = registry if registry is not None else CollectorRegistry()
        self.sample_duration = Histogram(
            PREFIX + "sample_duration_seconds",
            "Time taken by one sampling tick (GPU backend and host).",
            buckets=SAMPLE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(RuntimeCollector(runtime))
        self._samples = 0
        self._key: tuple[object, ...] | None = None
        self._body = b""
        self._rendered_at = 0.0
        self._inflight: anyio.Event | None = None
        self.renders = 0

    def attach(self) -> None:
        """Start observing samples."""
        self.runtime.sample_listeners.append(self.observe)

    def detach(self) -> None:
        """Stop observing samples."""
        if self.observe in self.runtime.sample_listeners:
            self.runtime.sample_listeners.remove(self.observe)

    def observe(self, sample: Sample) -> None:
        """A sample listener: record how long the tick took."""
        self.sample_duration.observe(sample.duration_s)
        self._samples += 1

    def _cache_key(self) -> tuple[object, ...]:
        return (self._samples, *state_key(self.runtime))

    def render(self) -> bytes:
        """The text exposition (cached until anything it shows can have changed)."""
        key = self._cache_key()
        if key != self._key:
            self._store(key, generate_latest(self.registry))
        return self._body

    async def render_async(self, max_stale_s: float = RENDER_STALE_S) -> bytes:
        """``render()`` for a request handler: the loop is not held while text is formatted.

        Reading the runtime happens here on the loop (``collect``); formatting the text, most
        of the cost, happens in a worker thread. Requests that come while a render is under way
        get the previous exposition if it is at most ``max_stale_s`` old, so a tight scrape
        loop never queues behind a render; anyone else waits for the new one.
        """
        key = self._cache_key()
        if key == self._key:
            return self._body
        if self._inflight is not None:
            if time.monotonic() - self._rendered_at <= max_stale_s:
                return self._body
            await self._inflight.wait()
            return self._body
        done = self._inflight = anyio.Event()
        try:
            families = _Collected(list(self.registry.collect()))
            body = await anyio.to_thread.run_sync(generate_latest, families)
            self._store(key, body)
        finally:
            self._inflight = None
            done.set()
        return self._body

    def _store(self, key: tuple[object, ...], body: bytes) -> None:
        self._body = body
        self._key = key
        self._rendered_at = time.monotonic()
        self.renders += 1


class _Collected:
    """Metric families already collected (on the loop), to be formatted elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def state_key(rt: Runtime) -> tuple[object, ...]:
    """Changes whenever anything the read model shows can have changed.

    A new sample, any worker change (both move ``loop_alive_at``), a journal event, a cordon,
    any counter. What is built from the read model can be reused while this stays the same.
    """
    last = rt.sampler.last
    return (
        None if last is None else last.t,
        rt.sampler.stuck() is not None,  # no sample comes while a call hangs
        rt.loop_alive_at,
        rt.journal.last_seq,
        len(rt.runners),
        len(rt.cordoned),
        sum(rt.xid_counts.values()),
        sum(rt.actions_total.values()),
        sum(rt.restarts_total.values()),
        sum(rt.postmortems_total.values()),
        sum(rt.write_health.errors_total.values()),
        len(rt.write_health.failing),
    )
