"""The fake libnvidia-ml.so.1 under the real pynvml, in a child process (ld.so reads
LD_LIBRARY_PATH only at exec). Protocol details the backend tests do not reach."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from supervisor.backends.sim import SimBackend


def run_pynvml(libdir: Path, world: Path, body: str) -> Any:
    """Run ``body`` (which sets ``out``) with pynvml initialised; return ``out``."""
    script = (
        "import json, pynvml\nout = None\n" + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(libdir), "GPU_SUPERVISOR_SIM_DIR": str(world)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def world(tmp_path: Path) -> Path:
    w = tmp_path / "sim"
    SimBackend(w, 2).open()
    return w


def test_process_lists_two_call_protocol(fake_nvml_dir: Path, tmp_path: Path) -> None:
    w = world(tmp_path)
    me = os.getpid()
    ppid = os.getppid()
    (w / "procs" / str(me)).write_text("0 100\n1 na\n")
    (w / "procs" / str(ppid)).write_text("GPU-00000000-0000-0000-0000-000000000000 50\n")
    (w / "procs" / "999999999").write_text("0 7\n")  # dead: ignored
    out = run_pynvml(
        fake_nvml_dir,
        w,
        """
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
        v3 = sorted((p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h0))
        v2 = sorted((p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h0))
        na = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h1)]
        mem1 = pynvml.nvmlDeviceGetMemoryInfo(h0)
        mem2 = pynvml.nvmlDeviceGetMemoryInfo(h0, pynvml.nvmlMemory_v2)
        out = {"v3": v3, "v2": v2, "na": na, "used_v1": mem1.used, "used_v2": mem2.used,
               "total": mem2.total}
    """,
    )
    mib = 1024 * 1024
    expected = sorted([[me, 100 * mib], [ppid, 50 * mib]])
    assert out["v3"] == expected
    assert out["v2"] == expected
    assert out["na"] == [[me, None]]
    assert out["used_v2"] == 150 * mib
    assert out["used_v1"] >= out["used_v2"]
    assert out["total"] == 81920 * mib


def test_errors_versions_and_events(fake_nvml_dir: Path, tmp_path: Path) -> None:
    w = world(tmp_path)
    (w / "events").write_text("0 48\n")  # before registration: never delivered
    gpu1 = w / "gpus" / "1"
    gpu1.write_text(gpu1.read_text() + "rc_nvmlDeviceGetPowerUsage 3\n")
    out = run_pynvml(
        fake_nvml_dir,
        w,
        f"""
        import time
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
        out = {{}}
        try:
            pynvml.nvmlDeviceGetPowerUsage(h1)
        except pynvml.NVMLError_NotSupported:
            out["power1"] = "not supported"
        out["power0"] = pynvml.nvmlDeviceGetPowerUsage(h0)
        try:
            pynvml.nvmlDeviceGetMemoryInfo(h0, 0x01000028)
        except pynvml.NVMLError_ArgumentVersionMismatch:
            out["version"] = "mismatch"
        es = pynvml.nvmlEventSetCreate()
        for h in (h0, h1):
            pynvml.nvmlDeviceRegisterEvents(h, 0x8, es)
        t0 = time.monotonic()
        try:
            pynvml.nvmlEventSetWait_v2(es, 100)
        except pynvml.NVMLError_Timeout:
            out["timeout_s"] = time.monotonic() - t0
        with open({str(w / "events")!r}, "a") as fh:
            fh.write("1 79\\n")
        data = pynvml.nvmlEventSetWait_v2(es, 2000)
        out["xid"] = [data.eventData, pynvml.nvmlDeviceGetIndex(data.device), data.eventType]
        try:
            pynvml.nvmlEventSetWait_v2(es, 50)
        except pynvml.NVMLError_Timeout:
            out["once"] = True
        pynvml.nvmlEventSetFree(es)
        pynvml.nvmlShutdown()
    """,
    )
    assert out["power1"] == "not supported"
    assert out["power0"] == 60000
    assert out["version"] == "mismatch"
    assert 0.09 <= out["timeout_s"] < 1.0
    assert out["xid"] == [79, 1, 8]
    assert out["once"] is True


def test_init_failure_and_missing_library(fake_nvml_dir: Path, tmp_path: Path) -> None:
    w = world(tmp_path)
    (w / "init_rc").write_text("9\n")
    body = """
        try:
            pynvml.nvmlInit()
            out = "ok"
        except pynvml.NVMLError as exc:
            out = type(exc).__name__
    """
    assert run_pynvml(fake_nvml_dir, w, body) == "NVMLError_DriverNotLoaded"
    assert run_pynvml(tmp_path, w, body) == "NVMLError_LibraryNotFound"
