"""Tick cost of the GPU seam: 8 GPUs x 64 processes through the fake libnvidia-ml.so.1.

    .venv/bin/python bench/tick.py [--ticks 300]

Builds the fake library (tests/fakenvml), writes a sim world with 8 devices and 64 live processes
(64 sleeping children of this script, 8 per GPU), then in a child process (ld.so reads
LD_LIBRARY_PATH only at exec) times, interleaved in one run:

- bare: the pynvml calls one tick needs, called directly (12 per device: 10 before the
  graphics process list was read, 11 before the MPS clients' list was; 15 while the ECC
  counts and the row remapper were read at every tick, before they were read every 5 s);
- backend: ``NvmlBackend.sample()`` (the same calls plus our error mapping and dataclasses);
- tick: the sampler's whole blocking tick (backend + /proc trees of 64 workers + attribution).

Prints medians and the backend/bare ratio. Targets: tick <= 5 ms, backend <= 1.5x bare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor.backends.sim import default_device_text  # noqa: E402
from tests.fakenvml.build import build_fake_nvml  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import pynvml
from supervisor.backends.nvml import NvmlBackend
from supervisor.sampler import Sampler, WorkerRef
ticks = int(sys.argv[2]); pids = json.loads(sys.argv[3])
backend = NvmlBackend(); ids = backend.open()
handles = backend._handles
def bare():
    for h in handles:
        pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
        pynvml.nvmlDeviceGetUtilizationRates(h)
        pynvml.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)
        pynvml.nvmlDeviceGetFieldValues(h, FIELDS)
        pynvml.nvmlDeviceGetPowerUsage(h)
        pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
        pynvml.nvmlDeviceGetEncoderUtilization(h)
        pynvml.nvmlDeviceGetDecoderUtilization(h)
        pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)
        if GRAPHICS:
            pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(h)
        if MPS:
            pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(h)
        if ECC:
            pynvml.nvmlDeviceGetTotalEccErrors(h, 0, 0)
            pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 0)
            pynvml.nvmlDeviceGetRemappedRows(h)
import inspect
_nvml = sys.modules["supervisor.backends.nvml"]
GRAPHICS = hasattr(_nvml, "_processes")
MPS = GRAPHICS and "mps" in inspect.signature(_nvml._processes).parameters
# the ECC counts and the repair flags: at every tick before they were read every 5 s
ECC = hasattr(_nvml, "_ecc_counts") and not hasattr(_nvml, "MEMORY_ERRORS_EVERY_S")
# the recovery action is read in the thresholds' call (one more field, no more calls)
FIELDS = [194, 193, 230] if hasattr(_nvml, "_FI_RECOVERY_ACTION") else [194, 193]
refs = {f"w-{i}": WorkerRef(pid, (ids[i % len(ids)].uuid,)) for i, pid in enumerate(pids)}
sampler = Sampler(lambda: backend, 0.5, lambda: refs, lambda s: None, lambda e: None)
sampler.backend = backend; sampler.available = True; sampler.identities = ids
def tick():
    sampler._tick_blocking(refs, time.monotonic(), sampler._tick_token)
out = {"bare": [], "backend": [], "tick": []}
for fn in (bare, backend.sample, tick):
    fn()  # warm up
for _ in range(ticks):
    for name, fn in (("bare", bare), ("backend", backend.sample), ("tick", tick)):
        t0 = time.perf_counter(); fn(); out[name].append((time.perf_counter() - t0) * 1000)
s = backend.sample()
assert len(s) == 8 and sum(len(d.processes or ()) for d in s) == len(pids), "world not seen"
print(json.dumps({k: statistics.median(v) for k, v in out.items()}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description="GPU tick cost through the fake NVML library")
    parser.add_argument("--ticks", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-tick-") as tmp:
        base = Path(tmp)
        libdir = build_fake_nvml(base / "lib")
        world = base / "sim"
        (world / "gpus").mkdir(parents=True)
        (world / "procs").mkdir()
        for i in range(8):
            (world / "gpus" / str(i)).write_text(default_device_text(i))
        sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(64)]
        try:
            for n, proc in enumerate(sleepers):
                (world / "procs" / str(proc.pid)).write_text(f"{n % 8} {1000 + n}\n")
            env = {
                **os.environ,
                "LD_LIBRARY_PATH": str(libdir),
                "GPU_SUPERVISOR_SIM_DIR": str(world),
            }
            pids = json.dumps([p.pid for p in sleepers])
            result = subprocess.run(
                [sys.executable, "-c", CHILD, str(ROOT), str(args.ticks), pids],
                env=env,
                capture_output=True,
                text=True,
                check=False,
                timeout=600,
            )
        finally:
            for proc in sleepers:
                proc.kill()
                proc.wait()
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return 1
    m = json.loads(result.stdout)
    ratio = m["backend"] / m["bare"]
    print(f"8 GPUs x 64 processes, {args.ticks} interleaved ticks, medians:")
    print("| measure | median |")
    print("|---|---|")
    print(f"| bare pynvml calls of one tick | {m['bare']:.3f} ms |")
    print(f"| NvmlBackend.sample() | {m['backend']:.3f} ms |")
    print(
        f"| whole sampler tick (backend + /proc trees + attribution, 64 workers) | {m['tick']:.3f} ms |"
    )
    print(f"| backend / bare | {ratio:.2f}x |")
    print(
        f"targets: tick <= 5 ms: {'PASS' if m['tick'] <= 5 else 'FAIL'}; "
        f"backend <= 1.5x bare: {'PASS' if ratio <= 1.5 else 'FAIL'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
