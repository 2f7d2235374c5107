"""The fake libnvidia-ml.so.1 under the real pynvml, each scenario in a child process.

pynvml finds its library only through the dynamic loader at process start, so every test runs a
small pynvml script in a child (``sys.executable``) with ``LD_LIBRARY_PATH`` pointing at the fake
and ``GPU_SUPERVISOR_SIM_DIR`` at a fresh world; the child prints one JSON line. Waiting happens
inside the child (event waits with a timeout); the parent only bounds it with subprocess timeouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.fakenvml.build import VARIANTS, build_fake_nvml

CHILD_TIMEOUT_S = 30.0
MIB = 1024 * 1024

PRELUDE = """\
import json, os, subprocess, sys, threading, time
import pynvml as nv

def attempt(fn, *args, **kwargs):
    try:
        return {"ok": fn(*args, **kwargs)}
    except Exception as exc:
        return {"error": type(exc).__name__}

def procs(entries):
    return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in entries]

def emit(obj):
    print(json.dumps(obj), flush=True)
"""


class World:
    """A simulated-GPU world directory (DESIGN.md section 7), written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "gpus").mkdir(parents=True)
        (root / "procs").mkdir()

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def gpu(self, index: int, **keys: object) -> None:
        self.write(f"gpus/{index}", "".join(f"{key} {value}\n" for key, value in keys.items()))

    def procs(self, pid: int, *lines: str) -> None:
        self.write(f"procs/{pid}", "".join(f"{line}\n" for line in lines))

    def append_events(self, *lines: str) -> None:
        with (self.root / "events").open("a") as events:
            events.writelines(f"{line}\n" for line in lines)


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path / "world")


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Pids of three live processes (they block on stdin until the test ends)."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        for _ in range(3)
    ]
    try:
        yield [child.pid for child in children]
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
        for child in children:
            child.wait(timeout=CHILD_TIMEOUT_S)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    result = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=CHILD_TIMEOUT_S,
    )
    return int(result.stdout)


def by_pid(used: dict[int, int | None]) -> list[list[int | None]]:
    """Process rows as the child reports them (pid order, no MIG instance ids)."""
    return [[pid, used[pid], 0xFFFFFFFF, 0xFFFFFFFF] for pid in sorted(used)]


def child_env(
    libdir: Path | None, world: World | None, extra: Mapping[str, str | None] | None = None
) -> dict[str, str]:
    """The child's environment; ``extra`` sets variables (None: removes them)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_LIBRARY_PATH", "GPU_SUPERVISOR_SIM_DIR")
    }
    if libdir is not None:
        env["LD_LIBRARY_PATH"] = str(libdir)
    if world is not None:
        env["GPU_SUPERVISOR_SIM_DIR"] = str(world.root)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_child(
    script: str,
    *,
    libdir: Path | None,
    world: World | None,
    extra_env: Mapping[str, str | None] | None = None,
) -> Any:
    """Run PRELUDE + script in a child python; return the JSON of its last stdout line."""
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        env=child_env(libdir, world, extra_env),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"child failed ({result.returncode}):\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Init, identity
# --------------------------------------------------------------------------------------------


def test_identity(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(0, uuid="GPU-0b1e7e57-0000-4000-8000-000000000000", name="NVIDIA H100 80GB HBM3")
    world.gpu(1)
    world.gpu(3)  # gpus/2 is missing: the device list ends at the first gap
    out = run_child(
        """
        nv.nvmlInit()
        count = nv.nvmlDeviceGetCount()
        devs = []
        for i in range(count):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            pci = nv.nvmlDeviceGetPciInfo(h)
            devs.append([nv.nvmlDeviceGetUUID(h), nv.nvmlDeviceGetName(h),
                         nv.nvmlDeviceGetIndex(h), pci.busId])  # str: pynvml decodes
        by_uuid = nv.nvmlDeviceGetHandleByUUID(devs[1][0])
        emit({
            "driver": nv.nvmlSystemGetDriverVersion(),
            "nvml": nv.nvmlSystemGetNVMLVersion(),
            "count": count,
            "devs": devs,
            "by_uuid_index": nv.nvmlDeviceGetIndex(by_uuid),
            "unknown_uuid": attempt(nv.nvmlDeviceGetHandleByUUID, "GPU-nope"),
            "bad_index": attempt(nv.nvmlDeviceGetHandleByIndex, 2),
            "error_string": nv.nvmlErrorString(nv.NVML_ERROR_GPU_IS_LOST),
        })
        nv.nvmlShutdown()
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out["count"] == 2
    assert out["devs"] == [
        [
            "GPU-0b1e7e57-0000-4000-8000-000000000000",
            "NVIDIA H100 80GB HBM3",
            0,
            "00000000:01:00.0",
        ],
        ["GPU-00000000-0000-0000-0000-000000000001", "Simulated GPU", 1, "00000000:02:00.0"],
    ]
    assert out["by_uuid_index"] == 1
    assert out["unknown_uuid"] == {"error": "NVMLError_NotFound"}
    assert out["bad_index"] == {"error": "NVMLError_InvalidArgument"}
    assert out["driver"] == "580.65.06"
    assert out["nvml"] == "13.580.65.06"
    assert out["error_string"] == "GPU is lost"


def test_system_file_overrides_versions(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(0)
    world.write("nvml", "driver_version 535.104.05\nnvml_version 12.535.104.05\n")
    out = run_child(
        """
        nv.nvmlInit()
        emit([nv.nvmlSystemGetDriverVersion(), nv.nvmlSystemGetNVMLVersion()])
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out == ["535.104.05", "12.535.104.05"]


def test_init_lifecycle(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(0)
    out = run_child(
        """
        before = attempt(nv.nvmlDeviceGetCount)
        nv.nvmlInit()
        nv.nvmlInit()
        nv.nvmlShutdown()
        still = attempt(nv.nvmlDeviceGetCount)
        nv.nvmlShutdown()
        after = attempt(nv.nvmlDeviceGetCount)
        extra = attempt(nv.nvmlShutdown)
        emit({"before": before, "still": still, "after": after, "extra": extra})
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out == {
        "before": {"error": "NVMLError_Uninitialized"},  # raised by pynvml: no library yet
        "still": {"ok": 1},  # init is reference-counted
        "after": {"error": "NVMLError_Uninitialized"},  # from the fake, after the last shutdown
        "extra": {"error": "NVMLError_Uninitialized"},
    }


@pytest.mark.parametrize(
    ("init_rc", "expected"),
    [("9", "NVMLError_DriverNotLoaded"), ("18", "NVMLError_LibRmVersionMismatch")],
)
def test_init_rc_fails_init(
    fake_nvml_libdir: Path, world: World, init_rc: str, expected: str
) -> None:
    world.gpu(0)
    world.write("init_rc", f"{init_rc}\n")
    out = run_child("emit(attempt(nv.nvmlInit))", libdir=fake_nvml_libdir, world=world)
    assert out == {"error": expected}


def test_no_world_means_no_driver(fake_nvml_libdir: Path) -> None:
    out = run_child("emit(attempt(nv.nvmlInit))", libdir=fake_nvml_libdir, world=None)
    assert out == {"error": "NVMLError_DriverNotLoaded"}


def test_without_library_path_library_not_found(world: World) -> None:
    world.gpu(0)
    out = run_child(
        """
        import ctypes
        try:
            ctypes.CDLL("libnvidia-ml.so.1")
            emit({"real": True})
        except OSError:
            emit({"real": False, "init": attempt(nv.nvmlInit)})
        """,
        libdir=None,
        world=world,
    )
    if out["real"]:
        pytest.skip("a real libnvidia-ml.so.1 is installed on this machine")
    assert out["init"] == {"error": "NVMLError_LibraryNotFound"}


# --------------------------------------------------------------------------------------------
# Memory and processes
# --------------------------------------------------------------------------------------------


def test_memory_counts_base_and_live_processes(
    fake_nvml_libdir: Path, world: World, sleepers: list[int]
) -> None:
    uuid0 = "GPU-11111111-2222-3333-4444-555555555555"
    world.gpu(0, uuid=uuid0, memory_total_mib=1000, memory_base_mib=100, memory_reserved_mib=50)
    world.gpu(1, memory_total_mib=2000, memory_base_mib=10)
    a, b, c = sleepers
    world.procs(a, "0 200", "1 7")
    world.procs(b, f"{uuid0} 300")
    world.procs(c, "0 na")
    world.procs(dead_pid(), "0 5000", "1 5000")
    world.write("procs/.123.tmp", "0 9999\n")  # a writer's temp file is not a pid
    out = run_child(
        """
        nv.nvmlInit()
        res = []
        for i in range(2):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            v1 = nv.nvmlDeviceGetMemoryInfo(h)
            v2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            res.append({
                "v1": [v1.total, v1.used, v1.free],
                "v2": [v2.version, v2.total, v2.reserved, v2.used, v2.free],
                "procs": procs(nv.nvmlDeviceGetComputeRunningProcesses(h)),
            })
        h = nv.nvmlDeviceGetHandleByIndex(0)
        res.append(attempt(nv.nvmlDeviceGetMemoryInfo, h, version=0x01000028))
        emit(res)
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    gpu0, gpu1, bad_version = out
    assert gpu0["v1"] == [1000 * MIB, 650 * MIB, 350 * MIB]  # used = base + procs + reserved
    assert gpu0["v2"] == [0x02000028, 1000 * MIB, 50 * MIB, 600 * MIB, 350 * MIB]
    none = 0xFFFFFFFF
    assert gpu0["procs"] == by_pid({a: 200 * MIB, b: 300 * MIB, c: None})
    assert gpu1["v1"] == [2000 * MIB, 17 * MIB, 1983 * MIB]
    assert gpu1["procs"] == [[a, 7 * MIB, none, none]]
    assert bad_version == {"error": "NVMLError_ArgumentVersionMismatch"}


def test_world_changes_are_seen_on_the_next_call(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(0, memory_total_mib=1000)
    out = run_child(
        f"""
        def put(text):
            tmp = {str(world.root)!r} + "/procs/.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, {str(world.root)!r} + f"/procs/{{os.getpid()}}")

        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        used = lambda: nv.nvmlDeviceGetMemoryInfo(h).used // (1024 * 1024)
        seen = [used()]
        put("0 100\\n")
        seen.append(used())
        put("0 400\\n")
        seen.append(used())
        grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                      stdin=subprocess.PIPE)
        with open({str(world.root)!r} + f"/procs/{{grandchild.pid}}", "w") as f:
            f.write("0 50\\n")
        seen.append(used())
        listed = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
        grandchild.stdin.close()
        grandchild.wait()
        seen.append(used())
        os.remove({str(world.root)!r} + f"/procs/{{os.getpid()}}")
        seen.append(used())
        emit({{"seen": seen, "listed": listed, "me": os.getpid(), "gc": grandchild.pid}})
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out["seen"] == [0, 100, 400, 450, 400, 0]
    assert out["listed"] == sorted([out["me"], out["gc"]])


#: The fake's revalidation paths: inotify + pidfds (the default), and its two fallbacks.
CACHE_MODES: dict[str, dict[str, str | None]] = {
    "default": {"FAKENVML_NO_INOTIFY": None, "FAKENVML_NO_PIDFD": None},
    "no_inotify": {"FAKENVML_NO_INOTIFY": "1", "FAKENVML_NO_PIDFD": None},
    "no_pidfd": {"FAKENVML_NO_INOTIFY": None, "FAKENVML_NO_PIDFD": "1"},
}


@pytest.mark.parametrize("mode", sorted(CACHE_MODES))
def test_changes_right_after_a_call_are_seen_by_the_next_call(
    fake_nvml_libdir: Path, world: World, mode: str
) -> None:
    """The cache is never stale: each change made just after a call shows in the next one.

    The writes come in fast succession (several within one coarse timestamp tick), replace
    files with ones of the same size, or rewrite them in place, so that neither the directory's
    nor the file's mtime or size need differ from the cached read's: the inotify events and the
    "racy timestamp" rule must catch them. Then a process whose liveness the fake has cached (a
    pidfd) is killed: it is not listed while it is a zombie, nor once reaped. Each mode runs
    one of the fake's revalidation paths (README.md, "How the world is read").
    """
    world.gpu(0, memory_total_mib=100000)
    root = str(world.root)
    out = run_child(
        f"""
        import select
        ROOT = {root!r}
        MIB = 1024 * 1024

        def put(rel, text):  # atomic: write a temp file, rename it over the old one
            path = ROOT + "/" + rel
            tmp = os.path.dirname(path) + "/.tmp-" + os.path.basename(path)
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)

        def put_in_place(rel, text):  # truncate and rewrite the same inode
            with open(ROOT + "/" + rel, "w") as f:
                f.write(text)

        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        listed = lambda: {{p.pid: p.usedGpuMemory // MIB
                           for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}}
        used = lambda: nv.nvmlDeviceGetMemoryInfo(h).used // MIB
        gc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
        misses = []
        try:
            rel = f"procs/{{gc.pid}}"
            for i in range(150):
                mib = 100 + 100 * (i % 2)  # same length: "0 100" / "0 200"
                put(rel, f"0 {{mib}}\\n")
                got = listed().get(gc.pid)
                if got != mib:
                    misses.append(["atomic", i, mib, got])
                put_in_place(rel, f"0 {{mib + 500}}\\n")
                got = used()
                if got != mib + 500:
                    misses.append(["in_place", i, mib + 500, got])
                put_in_place("gpus/0", f"memory_total_mib 100000\\npower_mw {{1000 + i % 2}}\\n")
                got = nv.nvmlDeviceGetPowerUsage(h)
                if got != 1000 + i % 2:
                    misses.append(["gpu_in_place", i, 1000 + i % 2, got])
                os.remove(ROOT + "/" + rel)
                got = listed()
                if got:
                    misses.append(["removed", i, {{}}, got])
            put(rel, "0 42\\n")
            before_kill = listed()
            with open(f"/proc/{{gc.pid}}/stat") as f:
                running_state = f.read().rsplit(")", 1)[1].split()[0]
            gc.kill()
            pidfd = os.pidfd_open(gc.pid)
            exited = bool(select.select([pidfd], [], [], 10.0)[0])  # deadline, no sleep
            os.close(pidfd)
            with open(f"/proc/{{gc.pid}}/stat") as f:
                zombie_state = f.read().rsplit(")", 1)[1].split()[0]
            as_zombie = listed()
            zombie_used = used()
        finally:
            gc.kill()
            gc.wait(timeout=10)
        reaped = listed()
        emit({{"misses": misses, "before_kill": before_kill, "running": running_state,
               "exited": exited, "zombie": zombie_state, "as_zombie": as_zombie,
               "zombie_used": zombie_used, "reaped": reaped, "gc": gc.pid}})
        """,
        libdir=fake_nvml_libdir,
        world=world,
        extra_env=CACHE_MODES[mode],
    )
    assert out["misses"] == []
    assert out["before_kill"] == {str(out["gc"]): 42}
    assert out["running"] in ("R", "S")
    assert out["exited"] is True
    assert out["zombie"] == "Z"  # killed and not yet reaped when the next call ran
    assert out["as_zombie"] == {}
    assert out["zombie_used"] == 0
    assert out["reaped"] == {}


def test_a_forked_child_does_not_take_the_parents_changes(
    fake_nvml_libdir: Path, world: World
) -> None:
    """After fork() the child gets its own watches: it must not drain the parent's events."""
    world.gpu(0, power_mw=1000)
    gpu0 = str(world.root / "gpus" / "0")
    out = run_child(
        f"""
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        first = nv.nvmlDeviceGetPowerUsage(h)
        pid = os.fork()
        if pid == 0:
            with open({gpu0!r}, "w") as f:  # its event must stay in the parent's queue
                f.write("power_mw 2000\\n")
            os._exit(0 if nv.nvmlDeviceGetPowerUsage(h) == 2000 else 1)
        _, status = os.waitpid(pid, 0)
        emit({{"first": first, "child": os.waitstatus_to_exitcode(status),
               "parent": nv.nvmlDeviceGetPowerUsage(h)}})
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out == {"first": 1000, "child": 0, "parent": 2000}


def test_process_list_two_call_protocol(
    fake_nvml_libdir: Path, world: World, sleepers: list[int]
) -> None:
    world.gpu(0)
    world.gpu(1)
    a, b, c = sleepers
    world.procs(a, "0 100", "1 50 mps")
    world.procs(b, "0 200")
    world.procs(c, "0 na", "0 300 graphics")
    out = run_child(
        """
        import ctypes
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        raw = nv._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
        count = ctypes.c_uint(0)
        first = raw(h, ctypes.byref(count), None)
        first_count = count.value
        small = (nv.c_nvmlProcessInfo_v3_t * 2)()
        count.value = 2
        short = raw(h, ctypes.byref(count), small)
        short_count = count.value
        exact = (nv.c_nvmlProcessInfo_v3_t * 3)()
        count.value = 3
        full = raw(h, ctypes.byref(count), exact)
        idle = nv.nvmlDeviceGetHandleByIndex(1)
        emit({
            "raw": [first, first_count, short, short_count, full, count.value],
            "v3": procs(nv.nvmlDeviceGetComputeRunningProcesses(h)),
            "v2": procs(nv.nvmlDeviceGetComputeRunningProcesses_v2(h)),
            "gfx_v3": procs(nv.nvmlDeviceGetGraphicsRunningProcesses_v3(h)),
            "gfx_v2": procs(nv.nvmlDeviceGetGraphicsRunningProcesses_v2(h)),
            "mps_v3": procs(nv.nvmlDeviceGetMPSComputeRunningProcesses_v3(h)),
            "mps_idle_v3": procs(nv.nvmlDeviceGetMPSComputeRunningProcesses_v3(idle)),
            "mps_idle_v2": procs(nv.nvmlDeviceGetMPSComputeRunningProcesses_v2(idle)),
            "idle_used": nv.nvmlDeviceGetMemoryInfo(idle).used,
            "idle": procs(nv.nvmlDeviceGetComputeRunningProcesses(idle)),
            "idle_raw": nv._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")(
                idle, ctypes.byref(count), None),
        })
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    none = 0xFFFFFFFF
    # count 0 + NULL -> INSUFFICIENT_SIZE(7) with the count; too small -> 7 again; enough -> 0
    assert out["raw"] == [7, 3, 7, 3, 0, 3]
    compute = by_pid({a: 100 * MIB, b: 200 * MIB, c: None})
    assert out["v3"] == compute
    assert out["v2"] == compute
    assert out["gfx_v3"] == [[c, 300 * MIB, none, none]]
    assert out["gfx_v2"] == out["gfx_v3"]
    # an MPS client is in the MPS list only (GPU 1: a's client context)
    assert out["mps_v3"] == []
    assert out["mps_idle_v3"] == [[a, 50 * MIB, none, none]]
    assert out["mps_idle_v2"] == out["mps_idle_v3"]
    assert out["idle_used"] == 50 * MIB
    assert out["idle"] == []
    assert out["idle_raw"] == 0


def test_procs_race_fails_that_many_filled_calls(
    fake_nvml_libdir: Path, world: World, sleepers: list[int]
) -> None:
    """`procs_race N`: the next N process-list calls with a buffer answer INSUFFICIENT_SIZE
    (processes started between the count and the list), counted again when N changes."""
    a = sleepers[0]
    world.gpu(0, procs_race=2)
    world.procs(a, "0 100")
    out = run_child(
        f"""
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        first = [attempt(lambda: procs(nv.nvmlDeviceGetComputeRunningProcesses(h)))
                 for _ in range(3)]
        with open({str(world.root / "gpus" / ".0.tmp")!r}, "w") as fh:
            fh.write("procs_race 1\\n")
        os.replace({str(world.root / "gpus" / ".0.tmp")!r}, {str(world.root / "gpus" / "0")!r})
        second = [attempt(lambda: procs(nv.nvmlDeviceGetGraphicsRunningProcesses(h)))
                  for _ in range(2)]
        emit({{"first": first, "second": second}})
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    race = {"error": "NVMLError_InsufficientSize"}
    assert out["first"] == [race, race, {"ok": by_pid({a: 100 * MIB})}]
    # a list with no process is answered by the first call alone: nothing to race
    assert out["second"] == [{"ok": []}, {"ok": []}]


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def test_metrics_match_the_world(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(
        0,
        temperature_c=71,
        temperature_slowdown_c=90,
        temperature_shutdown_c=95,
        utilization_percent=63,
        memory_utilization_percent=12,
        power_mw=312345,
        power_limit_mw=400000,
        clocks_event_reasons=0x44,
        encoder_percent=5,
        decoder_percent=9,
        clock_sm_mhz=1410,
        ecc_uncorrected=2,
    )
    world.gpu(1, temperature_c=-5)
    out = run_child(
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        util = nv.nvmlDeviceGetUtilizationRates(h)
        fields = nv.nvmlDeviceGetFieldValues(h, [
            nv.NVML_FI_DEV_TEMPERATURE_SLOWDOWN_TLIMIT, nv.NVML_FI_DEV_TEMPERATURE_SHUTDOWN_TLIMIT,
            nv.NVML_FI_DEV_MEMORY_TEMP])
        cold = nv.nvmlDeviceGetHandleByIndex(1)
        emit({
            "util": [util.gpu, util.memory],
            "temp": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "temp_v": nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU),
            "cold": [nv.nvmlDeviceGetTemperature(cold, 0), nv.nvmlDeviceGetTemperatureV(cold, 0)],
            "thresholds": [attempt(nv.nvmlDeviceGetTemperatureThreshold, h, t) for t in (0, 1, 2, 3)],
            "fields": [[f.fieldId, f.nvmlReturn, f.valueType, f.value.siVal, f.timestamp > 0]
                       for f in fields],
            "power": [nv.nvmlDeviceGetPowerUsage(h), nv.nvmlDeviceGetEnforcedPowerLimit(h),
                      nv.nvmlDeviceGetPowerManagementLimit(h)],
            "enc": nv.nvmlDeviceGetEncoderUtilization(h),
            "dec": nv.nvmlDeviceGetDecoderUtilization(h),
            "reasons": [nv.nvmlDeviceGetCurrentClocksEventReasons(h),
                        nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)],
            "sm_clock": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "ecc": nv.nvmlDeviceGetTotalEccErrors(h, 1, 0),
            "events": nv.nvmlDeviceGetSupportedEventTypes(h),
        })
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out["util"] == [63, 12]
    assert out["temp"] == 71
    assert out["temp_v"] == 71
    assert out["cold"] == [0, -5]  # the legacy call is unsigned; TemperatureV is signed
    assert out["thresholds"] == [
        {"ok": 95},
        {"ok": 90},
        {"error": "NVMLError_NotSupported"},
        {"ok": 85},
    ]
    assert out["fields"] == [[194, 0, 5, 90, True], [193, 0, 5, 95, True], [82, 3, 5, 0, True]]
    assert out["power"] == [312345, 400000, 400000]
    assert out["enc"] == [5, 1000000]
    assert out["dec"] == [9, 1000000]
    assert out["reasons"] == [0x44, 0x44]
    assert out["sm_clock"] == 1410
    assert out["ecc"] == 2
    assert out["events"] == 0x1 | 0x2 | 0x8


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def test_cpu_affinity_is_the_cpus_key_as_a_mask(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(0, cpus="0-2,70")
    world.gpu(1)  # no cpus: the driver cannot tell
    world.gpu(2, cpus="5-3")
    world.gpu(3, cpus="1", rc_nvmlDeviceGetCpuAffinity=4)
    out = run_child(
        """
        nv.nvmlInit()
        h = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
        def mask(handle, words):
            got = attempt(nv.nvmlDeviceGetCpuAffinity, handle, words)
            return {"ok": list(got["ok"])} if "ok" in got else got
        emit({
            "two": mask(h[0], 2),
            "one": mask(h[0], 1),  # CPU 70 does not fit: left out, as NVML does
            "none": mask(h[1], 2),
            "bad": mask(h[2], 2),
            "rc": mask(h[3], 2),
        })
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out["two"] == {"ok": [0b111, 1 << 6]}
    assert out["one"] == {"ok": [0b111]}
    assert out["none"] == {"error": "NVMLError_NotSupported"}
    assert out["bad"] == {"error": "NVMLError_Unknown"}
    assert out["rc"] == {"error": "NVMLError_NoPermission"}


def test_lost_device_fails_alone(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(0)
    world.gpu(1)
    gpu1 = str(world.root / "gpus" / "1")
    out = run_child(
        f"""
        nv.nvmlInit()
        h0 = nv.nvmlDeviceGetHandleByIndex(0)
        h1 = nv.nvmlDeviceGetHandleByIndex(1)
        uuid1 = nv.nvmlDeviceGetUUID(h1)
        with open({gpu1!r}, "w") as f:
            f.write("lost 1\\n")
        calls = [nv.nvmlDeviceGetUUID, nv.nvmlDeviceGetName, nv.nvmlDeviceGetMemoryInfo,
                 nv.nvmlDeviceGetUtilizationRates, nv.nvmlDeviceGetPowerUsage,
                 nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetIndex]
        emit({{
            "lost": sorted({{attempt(fn, h1).get("error") for fn in calls}}),
            "temp": attempt(nv.nvmlDeviceGetTemperature, h1, 0),
            "healthy": [attempt(fn, h0).get("error") for fn in calls],
            "count": nv.nvmlDeviceGetCount(),
            "by_index": attempt(nv.nvmlDeviceGetHandleByIndex, 1),
            "by_uuid": attempt(nv.nvmlDeviceGetHandleByUUID, uuid1),
        }})
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    lost = {"error": "NVMLError_GpuIsLost"}
    assert out["lost"] == ["NVMLError_GpuIsLost"]
    assert out["temp"] == lost
    assert out["healthy"] == [None] * 7
    assert out["count"] == 2  # a lost device is still counted
    assert out["by_index"] == lost
    assert out["by_uuid"] == lost


def test_rc_keys_inject_faults(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(
        0,
        rc_nvmlDeviceGetPowerUsage=3,
        rc_nvmlDeviceGetMemoryInfo_v2=4,
        rc_nvmlDeviceGetComputeRunningProcesses=999,
        rc_field_194=3,
    )
    world.gpu(1)
    world.write("nvml", "rc_nvmlEventSetCreate 999\n")
    out = run_child(
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        ok = nv.nvmlDeviceGetHandleByIndex(1)
        fields = nv.nvmlDeviceGetFieldValues(h, [194, 193])
        emit({
            "power": attempt(nv.nvmlDeviceGetPowerUsage, h),
            "power_other": attempt(nv.nvmlDeviceGetPowerUsage, ok),
            "mem_v2": attempt(lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2).used),
            "mem_v1": attempt(lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
            "procs_v3": attempt(nv.nvmlDeviceGetComputeRunningProcesses, h),
            "procs_v2": attempt(nv.nvmlDeviceGetComputeRunningProcesses_v2, h),
            "fields": [[f.fieldId, f.nvmlReturn] for f in fields],
            "event_set": attempt(nv.nvmlEventSetCreate),
        })
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out["power"] == {"error": "NVMLError_NotSupported"}
    assert out["power_other"] == {"ok": 60000}
    assert out["mem_v2"] == {"error": "NVMLError_NoPermission"}
    assert out["mem_v1"] == {"ok": 0}
    # an unversioned key applies to every version of the symbol
    assert out["procs_v3"] == {"error": "NVMLError_Unknown"}
    assert out["procs_v2"] == {"error": "NVMLError_Unknown"}
    assert out["fields"] == [[194, 3], [193, 0]]
    assert out["event_set"] == {"error": "NVMLError_Unknown"}


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


def test_xid_events_delivered_once_after_registration(fake_nvml_libdir: Path, world: World) -> None:
    uuid0 = "GPU-abcdef00-0000-0000-0000-000000000000"
    world.gpu(0, uuid=uuid0)
    world.gpu(1)
    world.append_events("0 13", "1 31")  # before the event set exists: never delivered
    events = str(world.root / "events")
    out = run_child(
        f"""
        def append(line):
            with open({events!r}, "a") as f:
                f.write(line + "\\n")

        def wait(s, ms):
            try:
                d = nv.nvmlEventSetWait_v2(s, ms)
                return [nv.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData,
                        d.gpuInstanceId, d.computeInstanceId]
            except nv.NVMLError as exc:
                return type(exc).__name__

        nv.nvmlInit()
        h0 = nv.nvmlDeviceGetHandleByIndex(0)
        s = nv.nvmlEventSetCreate()
        append("0 43")  # after creation, before registration: not delivered
        types = nv.nvmlEventTypeXidCriticalError & nv.nvmlDeviceGetSupportedEventTypes(h0)
        nv.nvmlDeviceRegisterEvents(h0, types, s)
        append("0 79")
        append("1 48")  # device 1 is not registered
        append({uuid0!r} + " 94")  # events may name the device by UUID
        got = [wait(s, 2000), wait(s, 2000)]
        start = time.monotonic()
        got.append(wait(s, 200))
        elapsed = time.monotonic() - start
        late = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h0, types, late)
        late_got = wait(late, 50)
        unsupported = attempt(nv.nvmlDeviceRegisterEvents, h0, nv.nvmlEventTypePState, s)
        nv.nvmlEventSetFree(late)
        nv.nvmlEventSetFree(s)
        emit({{"got": got, "elapsed": elapsed, "late": late_got, "unsupported": unsupported}})
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    none = 0xFFFFFFFF
    assert out["got"] == [[0, 8, 79, none, none], [0, 8, 94, none, none], "NVMLError_Timeout"]
    assert 0.15 <= out["elapsed"] < 5.0
    assert out["late"] == "NVMLError_Timeout"  # a new set does not replay old lines
    assert out["unsupported"] == {"error": "NVMLError_NotSupported"}


def test_event_wait_in_a_thread_sees_a_line_appended_while_waiting(
    fake_nvml_libdir: Path, world: World
) -> None:
    world.gpu(0)
    world.gpu(1)
    script = """
        nv.nvmlInit()
        h1 = nv.nvmlDeviceGetHandleByIndex(1)
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h1, nv.nvmlEventTypeXidCriticalError, s)
        result = {}
        def waiter():
            try:
                d = nv.nvmlEventSetWait_v2(s, 10000)
                result["event"] = [nv.nvmlDeviceGetIndex(d.device), d.eventData]
            except nv.NVMLError as exc:
                result["event"] = type(exc).__name__
        t = threading.Thread(target=waiter)
        t.start()
        # queries while the wait is in progress (the event comes only after "registered"): a
        # wait that held the library's lock would hold these up until its 10 s timeout, and
        # the event appended then would be missed. (Regression, flaky: with the first query
        # made only after "registered", the event could end the wait before it: 0 queries.)
        nv.nvmlDeviceGetMemoryInfo(h1)
        nv.nvmlDeviceGetTemperature(h1, 0)
        queries = 1
        print("registered", flush=True)
        while t.is_alive():
            nv.nvmlDeviceGetMemoryInfo(h1)
            nv.nvmlDeviceGetTemperature(h1, 0)
            queries += 1
        t.join()
        emit({"event": result["event"], "queries": queries})
    """
    with subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        env=child_env(fake_nvml_libdir, world),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        first = child.stdout.readline()  # the child's own wait bounds this (10 s)
        world.append_events("1 109")
        stdout, stderr = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert first.strip() == "registered", stderr
    assert child.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["event"] == [1, 109]
    assert out["queries"] > 0


def test_shutdown_ends_a_pending_wait(fake_nvml_libdir: Path, world: World) -> None:
    world.gpu(0)
    out = run_child(
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, s)
        result = {}
        def waiter():
            start = time.monotonic()
            result["wait"] = attempt(nv.nvmlEventSetWait_v2, s, 20000).get("error")
            result["elapsed"] = time.monotonic() - start
        t = threading.Thread(target=waiter)
        t.start()
        nv.nvmlShutdown()
        t.join()
        emit(result)
        """,
        libdir=fake_nvml_libdir,
        world=world,
    )
    assert out["wait"] == "NVMLError_Uninitialized"
    assert out["elapsed"] < 5.0


# --------------------------------------------------------------------------------------------
# Build variants without a symbol (for a backend's fallbacks)
# --------------------------------------------------------------------------------------------

VARIANT_SCRIPTS = {
    "FAKENVML_NO_PROCESSES_V3": (
        "[attempt(nv.nvmlDeviceGetComputeRunningProcesses, h).get('error'),"
        " attempt(nv.nvmlDeviceGetComputeRunningProcesses_v2, h)]",
        ["NVMLLibraryMismatchError", {"ok": []}],
    ),
    "FAKENVML_NO_MEMORY_V2": (
        "[attempt(lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)).get('error'),"
        " attempt(lambda: nv.nvmlDeviceGetMemoryInfo(h).used)]",
        ["NVMLError_FunctionNotFound", {"ok": 0}],
    ),
    "FAKENVML_NO_TEMPERATURE_V": (
        "[attempt(nv.nvmlDeviceGetTemperatureV, h, 0).get('error'),"
        " attempt(nv.nvmlDeviceGetTemperature, h, 0)]",
        ["NVMLError_FunctionNotFound", {"ok": 40}],
    ),
    "FAKENVML_NO_CLOCKS_EVENT_REASONS": (
        "[attempt(nv.nvmlDeviceGetCurrentClocksEventReasons, h).get('error'),"
        " attempt(nv.nvmlDeviceGetCurrentClocksThrottleReasons, h)]",
        ["NVMLError_FunctionNotFound", {"ok": 0}],
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_without_symbol(
    fake_nvml_libdir: Path, tmp_path: Path, world: World, variant: str
) -> None:
    del fake_nvml_libdir  # only for its skip when gcc is missing
    libdir = build_fake_nvml(tmp_path / "lib", defines=[variant])
    world.gpu(0)
    expression, expected = VARIANT_SCRIPTS[variant]
    out = run_child(
        f"""
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        emit({expression})
        """,
        libdir=libdir,
        world=world,
    )
    assert out == expected
