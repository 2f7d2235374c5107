"""Synthetic GPU-memory traces of one inference worker, as the sampler sees them.

    from bench.leak_traces import generate
    trace = generate(seed=7, duration_s=3600)                      # stable
    trace = generate(seed=7, duration_s=3600, leak_mb_per_min=10)  # leaking

One value (MiB, the worker's per-process NVML figure) every 0.5 s, deterministic by seed (the
parameters and the samples come from two ``random.Random`` seeded with it). Rendering draws
nothing for the leak, so ``render(dataclasses.replace(trace.params, leak_mb_per_min=0.0,
leak_start_s=None))`` is the same trace without its leak (``generate`` with the same seed and no
leak is not: a leak's start is drawn with the parameters, so every later parameter differs).
The worker is a PyTorch-style process with a caching allocator, so what NVML shows is *reserved*
memory, not what the worker really keeps:

- **Start and model load.** The CUDA context (300-600 MiB) appears 0.5-3 s after spawn; weights
  (1-16 GiB unless given) are loaded in 20 MiB-rounded chunks along a random-shaped ramp that
  ends 8-40 s after spawn. Readiness passes somewhere between spawn and the end of the load, so
  the leak warm-up (``ready_at + 60 s``) ends 60-100 s after spawn.
- **Warm-up allocations.** Compilation / autotuning / CUDA-graph pools (0-800 MiB, kept for
  good) are allocated in 20 MiB steps after the load and finish at least 5 s before the warm-up
  ends.
- **Cache fill.** Traffic starts after the load, at most 20 s after readiness unless the load
  ends later, and ramps up as a saturating exponential (time constant 2-8 s, so up to a few
  hundred MiB of the fill can still arrive after the warm-up). Each 0.5 s sees a Poisson
  number of batches (2-30 per second); a batch needs activation memory ``level x peak x d`` with
  ``d`` from a Beta(k, 1) tail (k 1-8: the peak batch comes back every few seconds to every few
  minutes). The allocator keeps the high-water mark, rounded up to 20 MiB segments (large pool;
  peak 100-4000 MiB) and 2 MiB segments (small pool; peak 5-120 MiB): the fill saturates, then
  plateaus.
- **Bigger batches.** Now and then (every 5-60 minutes on average, per trace; in a fifth of the
  traces never) a batch 5-60 % bigger than the usual peak arrives: one step of the cache that
  stays (it is a new high-water mark).
- **Fragmentation creep.** Extra 20 MiB segments at Poisson times whose rate decays as
  ``c / (time since the last release or the traffic start + CREEP_S)`` (c 0-1, ``CREEP_S`` 900 s:
  at most one per 15 minutes at first, about 1.6 c in the first hour): a slow, decelerating
  staircase, reset by releases.
- **Releases.** 40 % of the traces never release; 45 % call something like ``empty_cache()``
  every 1-15 minutes (+-25 % jitter), 15 % every 5-30 s: reserved memory drops to what is in use
  (the true floor), then refills with the next batches.
- **Uncached workers.** 12 % of the traces have no caching allocator: activations show only
  while a batch runs (a sample lands mid-batch with probability 20-80 %).
- **Spikes.** Memory outside the cache (cuDNN / cuBLAS workspaces, NCCL buffers): 20-1500 MiB
  for 0.5-8 s, on average every 20-300 s; never more than the device has free (a workspace that
  does not fit is not taken: the library picks an algorithm that needs less).
- **Noise.** Gaussian, sd 0-10 MiB (unless given), then rounded to whole MiB; 0.2 % of the
  samples are missing (None).
- **Leak.** From ``leak_start_s`` on (default: 0-15 minutes after the warm-up), leaked tensors
  accumulate at ``leak_mb_per_min``: small ones (0.1-1 MiB) from the small pool, growing its
  reserve in 2 MiB segments, or larger ones (1-10 MiB) in 20 MiB large-pool segments (half the
  traces each). Leaked memory is in use, so it survives releases (it raises the true floor), and
  in the large pool it first fills the cache's free space: a leak shows once the leaked memory
  plus a peak batch no longer fit in the high-water mark.

- **Worker reports.** ``reported`` is what the worker would send as ``X_GPU_MEMORY_IN_USE_MB``
  once a second (``torch.cuda.memory_allocated()``): weights, persistent pools and leaked
  tensors, plus 20-100 % of a batch's activations when the report lands while one runs (with
  the trace's busy probability). They draw from a generator of their own, so the NVML readings
  of a seed are the same as without them.

The device has ``device_total_mb`` (default 81559) less a driver reserve of 250-600 MiB; the
trace stops when the device's free memory reaches 0 (``exhausted_at_s``).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

SAMPLE_INTERVAL_S = 0.5
#: The runtime's default ``leak_warmup_s``.
LEAK_WARMUP_S = 60.0
SMALL_SEGMENT_MB = 2.0
LARGE_SEGMENT_MB = 20.0
DEFAULT_DEVICE_MB = 81559.0
#: A worker that reports its own in-use memory (``X_GPU_MEMORY_IN_USE_MB``) does so this often.
REPORT_EVERY_S = 1.0
#: Fragmentation creep: new segments at a rate of ``c / (time since the last release + CREEP_S)``.
CREEP_S = 900.0


@dataclass(frozen=True, slots=True)
class TraceParams:
    """Every value drawn for one trace (for the JSON and for reproducing a case)."""

    seed: int
    duration_s: float
    ready_at_s: float
    warmup_end_s: float
    context_mb: float
    context_at_s: float
    weights_mb: float
    load_end_s: float
    load_shape: float
    persistent_mb: float
    persistent_end_s: float
    traffic_start_s: float
    traffic_level0: float
    fill_tau_s: float
    act_peak_mb: float
    small_peak_mb: float
    batches_per_s: float
    tail_k: float
    big_batch_every_s: float | None
    big_batch_max: float
    creep_c: float
    release: str  # "none" | "periodic" | "frequent"
    release_every_s: float | None
    cached: bool
    busy: float
    spike_every_s: float
    spike_max_mb: float
    noise_sd_mb: float
    dropout_p: float
    leak_mb_per_min: float
    leak_start_s: float | None
    leak_pool: str  # "small" | "large"
    leak_tensor_mb: float
    device_total_mb: float
    driver_mb: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(slots=True)
class Trace:
    """Samples at ``i * SAMPLE_INTERVAL_S``."""

    params: TraceParams
    values: list[float | None]  # what the sampler reports for the worker (MiB; None: missing)
    usage: list[float]  # the same without noise or gaps
    free: list[float]  # the device's free memory (MiB)
    floor: list[float]  # what the worker really keeps in use (context, weights, pools, leak)
    reported: list[float | None]  # what the worker reports itself (REPORT_EVERY_S; None between)
    exhausted_at_s: float | None  # the device ran out of memory here (the trace stops)
    events: list[tuple[float, str, float]]  # (t, what, MiB): cache steps, creep, releases

    @property
    def ready_at_s(self) -> float:
        return self.params.ready_at_s

    @property
    def leak_start_s(self) -> float | None:
        return self.params.leak_start_s

    def time(self, i: int) -> float:
        return i * SAMPLE_INTERVAL_S


def _ceil(x: float, block: float) -> float:
    return math.ceil(x / block - 1e-9) * block if x > 0 else 0.0


def _floor(x: float, block: float) -> float:
    return math.floor(x / block + 1e-9) * block if x > 0 else 0.0


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def draw_params(
    seed: int,
    duration_s: float,
    *,
    leak_mb_per_min: float = 0.0,
    leak_start_s: float | None = None,
    weights_mb: float | None = None,
    device_total_mb: float = DEFAULT_DEVICE_MB,
    noise_sd_mb: float | None = None,
    warmup_s: float = LEAK_WARMUP_S,
    cached: bool | None = None,
) -> TraceParams:
    """Draw one trace's parameters (see the module docstring for the ranges)."""
    rng = random.Random(f"leak-trace-params-{seed}")
    context_at = rng.uniform(0.5, 3.0)
    load_end = rng.uniform(8.0, 40.0)
    ready_at = rng.uniform(0.0, load_end)
    warmup_end = ready_at + warmup_s
    traffic_start = rng.uniform(load_end, max(load_end, ready_at + 20.0))
    persistent_end = rng.uniform(load_end, max(load_end, warmup_end - 5.0))
    release = rng.choices(["none", "periodic", "frequent"], weights=[40, 45, 15])[0]
    release_every = {
        "none": None,
        "periodic": rng.uniform(60.0, 900.0),
        "frequent": rng.uniform(5.0, 30.0),
    }[release]
    big_every = None if rng.random() < 0.2 else rng.uniform(300.0, 3600.0)
    if leak_mb_per_min > 0 and leak_start_s is None:
        leak_start_s = warmup_end + rng.uniform(0.0, 900.0)
    leak_pool = rng.choice(["small", "large"])
    return TraceParams(
        seed=seed,
        duration_s=duration_s,
        ready_at_s=ready_at,
        warmup_end_s=warmup_end,
        context_mb=rng.uniform(300.0, 600.0),
        context_at_s=context_at,
        weights_mb=weights_mb if weights_mb is not None else rng.uniform(1000.0, 16000.0),
        load_end_s=load_end,
        load_shape=rng.uniform(0.6, 1.6),
        persistent_mb=rng.uniform(0.0, 800.0),
        persistent_end_s=persistent_end,
        traffic_start_s=traffic_start,
        traffic_level0=rng.uniform(0.1, 0.6),
        fill_tau_s=rng.uniform(2.0, 8.0),
        act_peak_mb=rng.uniform(100.0, 4000.0),
        small_peak_mb=rng.uniform(5.0, 120.0),
        batches_per_s=rng.uniform(2.0, 30.0),
        tail_k=rng.uniform(1.0, 8.0),
        big_batch_every_s=big_every,
        big_batch_max=rng.uniform(1.05, 1.6),
        creep_c=rng.uniform(0.0, 1.0),
        release=release,
        release_every_s=release_every,
        cached=(rng.random() >= 0.12) if cached is None else cached,
        busy=rng.uniform(0.2, 0.8),
        spike_every_s=rng.uniform(20.0, 300.0),
        spike_max_mb=rng.uniform(20.0, 1500.0),
        noise_sd_mb=noise_sd_mb if noise_sd_mb is not None else rng.uniform(0.0, 10.0),
        dropout_p=0.002,
        leak_mb_per_min=leak_mb_per_min,
        leak_start_s=leak_start_s if leak_mb_per_min > 0 else None,
        leak_pool=leak_pool,
        leak_tensor_mb=rng.uniform(0.1, 1.0) if leak_pool == "small" else rng.uniform(1.0, 10.0),
        device_total_mb=device_total_mb,
        driver_mb=rng.uniform(250.0, 600.0),
    )


def generate(
    seed: int,
    duration_s: float,
    *,
    leak_mb_per_min: float = 0.0,
    leak_start_s: float | None = None,
    weights_mb: float | None = None,
    device_total_mb: float = DEFAULT_DEVICE_MB,
    noise_sd_mb: float | None = None,
    warmup_s: float = LEAK_WARMUP_S,
    cached: bool | None = None,
) -> Trace:
    """One trace of ``duration_s`` seconds (shorter if the device runs out of memory)."""
    p = draw_params(
        seed,
        duration_s,
        leak_mb_per_min=leak_mb_per_min,
        leak_start_s=leak_start_s,
        weights_mb=weights_mb,
        device_total_mb=device_total_mb,
        noise_sd_mb=noise_sd_mb,
        warmup_s=warmup_s,
        cached=cached,
    )
    return render(p)


def render(p: TraceParams) -> Trace:
    """The samples of a trace with parameters ``p`` (deterministic)."""
    rng = random.Random(f"leak-trace-samples-{p.seed}")
    dt = SAMPLE_INTERVAL_S
    n = int(p.duration_s / dt) + 1
    values: list[float | None] = []
    usage: list[float] = []
    free: list[float] = []
    floor: list[float] = []
    reported: list[float | None] = []
    # The worker's own reports draw from a generator of their own: the NVML readings of a seed
    # are the same with or without them.
    report_rng = random.Random(f"leak-trace-reports-{p.seed}")
    report_every = round(REPORT_EVERY_S / dt)
    exhausted: float | None = None
    events: list[tuple[float, str, float]] = []

    reserved_large = 0.0  # cached large-pool segments (activations, leaked large tensors)
    reserved_small = 0.0
    creep = 0.0  # fragmentation: extra large segments since the last release
    last_release = p.traffic_start_s
    next_release = (
        p.traffic_start_s + p.release_every_s * rng.uniform(0.25, 1.25)
        if p.release_every_s
        else math.inf
    )
    spike_until, spike_mb = -1.0, 0.0
    load_dur = max(p.load_end_s - p.context_at_s, dt)
    pers_dur = max(p.persistent_end_s - p.load_end_s, dt)
    leak_per_s = p.leak_mb_per_min / 60.0
    leak_tensor = p.leak_tensor_mb

    for i in range(n):
        t = i * dt
        if t < p.context_at_s:
            values.append(None)
            usage.append(0.0)
            free.append(p.device_total_mb - p.driver_mb)
            floor.append(0.0)
            reported.append(None)
            continue
        frac = min(1.0, (t - p.context_at_s) / load_dur) ** p.load_shape
        weights = min(p.weights_mb, _floor(p.weights_mb * frac, LARGE_SEGMENT_MB))
        if frac >= 1.0:
            weights = p.weights_mb
        pers = 0.0
        if t >= p.load_end_s:
            pf = min(1.0, (t - p.load_end_s) / pers_dur)
            pers = p.persistent_mb if pf >= 1.0 else _floor(p.persistent_mb * pf, LARGE_SEGMENT_MB)
        leaked = 0.0
        if p.leak_start_s is not None and t >= p.leak_start_s:
            leaked = _floor(leak_per_s * (t - p.leak_start_s), leak_tensor)
        leak_small = leaked if p.leak_pool == "small" else 0.0
        leak_large = leaked - leak_small

        transient = inflight = 0.0
        if t >= p.traffic_start_s:
            level = 1.0 - (1.0 - p.traffic_level0) * math.exp(
                -(t - p.traffic_start_s) / p.fill_tau_s
            )
            batches = _poisson(rng, p.batches_per_s * dt)
            act = small = 0.0
            if batches:
                d = rng.random() ** (1.0 / (batches * p.tail_k))
                act = p.act_peak_mb * level * d
                small = p.small_peak_mb * level * rng.random() ** (1.0 / (batches * p.tail_k))
                inflight = act + small
            big = p.big_batch_every_s is not None and rng.random() < dt / p.big_batch_every_s
            if big:
                act = p.act_peak_mb * level * rng.uniform(1.05, p.big_batch_max)
            if p.cached:
                if p.creep_c and rng.random() < p.creep_c * dt / (t - last_release + CREEP_S):
                    creep += LARGE_SEGMENT_MB
                    events.append((t, "creep", LARGE_SEGMENT_MB))
                before = reserved_large
                reserved_large = max(reserved_large, _ceil(leak_large + act, LARGE_SEGMENT_MB))
                if big and reserved_large > before:
                    events.append((t, "big batch", reserved_large - before))
                reserved_small = max(reserved_small, _ceil(leak_small + small, SMALL_SEGMENT_MB))
            else:
                reserved_large = _ceil(leak_large, LARGE_SEGMENT_MB)
                reserved_small = _ceil(leak_small, SMALL_SEGMENT_MB)
                if batches and rng.random() < p.busy:
                    transient = act + small
            if t >= next_release:
                reserved_large = _ceil(leak_large, LARGE_SEGMENT_MB)
                reserved_small = _ceil(leak_small, SMALL_SEGMENT_MB)
                creep = 0.0
                last_release = t
                events.append((t, "release", 0.0))
                assert p.release_every_s is not None
                next_release = t + p.release_every_s * rng.uniform(0.75, 1.25)
        else:
            reserved_large = _ceil(leak_large, LARGE_SEGMENT_MB)
            reserved_small = _ceil(leak_small, SMALL_SEGMENT_MB)

        if t >= spike_until and rng.random() < dt / p.spike_every_s:
            spike_until = t + rng.uniform(0.5, 8.0)
            spike_mb = rng.uniform(20.0, p.spike_max_mb)
        kept = p.context_mb + weights + pers + leaked
        used = p.context_mb + weights + pers + reserved_large + reserved_small + creep + transient
        left = p.device_total_mb - p.driver_mb - used
        if t < spike_until:  # a workspace that does not fit is not taken (smaller algorithm)
            spike = min(spike_mb, max(0.0, left))
            used += spike
        usage.append(used)
        free.append(max(0.0, p.device_total_mb - p.driver_mb - used))
        floor.append(kept)
        if i % report_every:
            reported.append(None)
        else:  # allocated tensors: a report can land while a batch is running
            busy = inflight and report_rng.random() < p.busy
            running = inflight * report_rng.uniform(0.2, 1.0) if busy else 0.0
            reported.append(weights + pers + leaked + running)
        if rng.random() < p.dropout_p:
            values.append(None)
        else:
            values.append(float(round(used + rng.gauss(0.0, p.noise_sd_mb))))
        if left <= 0:
            exhausted = t
            break
    return Trace(p, values, usage, free, floor, reported, exhausted, events)
