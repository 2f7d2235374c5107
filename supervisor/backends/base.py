"""The ``GpuBackend`` port and what every backend shares (field table, NVML return codes).

Backends are synchronous and may block: the sampler calls ``sample()`` in a dedicated worker
thread and ``wait_xid()`` in another, so nothing here runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from supervisor.errors import BackendUnavailable
from supervisor.model import DeviceIdentity, DeviceSample, GpuProcess, XidEvent

# NVML return codes we act on (nvml.h).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_UNKNOWN = 999

#: The UUID a backend gives a GPU whose UUID it cannot read (``unknown-<index>``).
PLACEHOLDER = "unknown-"
#: The name of a GPU whose name cannot be read (its handle and UUID can).
UNKNOWN_NAME = "unknown"
#: How long a GPU may answer its handle or UUID with a passing error (UNKNOWN, TIMEOUT) and
#: still count as ``unidentified`` (healthy with its readings unknown, to a GPU seen before);
#: then it is lost.
PASSING_FOR_S = 300.0

#: Codes that mean the device is broken: mark it unhealthy (NVML.md section 2).
DEVICE_LOST_CODES = frozenset(
    {
        NVML_ERROR_GPU_IS_LOST,
        NVML_ERROR_RESET_REQUIRED,
        NVML_ERROR_INSUFFICIENT_POWER,
        NVML_ERROR_IRQ_ISSUE,
    }
)
#: Codes that mean NVML itself is gone (shut down, the driver unloaded or replaced by another
#: version): telemetry is unavailable and NVML is initialised again, with backoff.
BACKEND_GONE_CODES = frozenset(
    {NVML_ERROR_UNINITIALIZED, NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIB_RM_VERSION_MISMATCH}
)
#: Codes that mean "this field is not available here": remember and stop asking.
#: DEPRECATED: a call newer drivers no longer answer (regression: asked at every tick).
UNSUPPORTED_CODES = frozenset(
    {
        NVML_ERROR_NOT_SUPPORTED,
        NVML_ERROR_NO_PERMISSION,
        NVML_ERROR_FUNCTION_NOT_FOUND,
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        NVML_ERROR_DEPRECATED,
    }
)

#: What NVML's ``nvmlErrorString`` says for each code (nvml.h; any other: "Unknown Error").
ERROR_STRINGS: Mapping[int, str] = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    5: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    14: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    17: "The operating system has blocked the request.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    19: "In use by another client",
    20: "Insufficient Memory",
    21: "No data",
    22: "vGPU ECC not supported",
    23: "Insufficient resources",
    24: "Frequency not supported",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    NVML_ERROR_DEPRECATED: "Deprecated",
    27: "Not ready",
    28: "GPU not found",
    29: "Invalid state",
    30: "Reset type not supported",
}


def error_string(code: int) -> str:
    """NVML's words for ``code`` (as ``nvmlErrorString``: the sim backend has no library)."""
    return ERROR_STRINGS.get(code, "Unknown Error")


#: The NVML calls that identify a GPU, in the order they are made (fault keys ``rc_<function>``):
#: its handle (either name of the call), then its UUID, then its name.
IDENTITY_FUNCTIONS: Mapping[str, tuple[str, ...]] = {
    "handle": ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"),
    "uuid": ("nvmlDeviceGetUUID",),
    "name": ("nvmlDeviceGetName",),
}


def passing(code: int | None) -> bool:
    """A failure of a GPU's handle or UUID that is neither a lost GPU nor NVML gone (UNKNOWN,
    TIMEOUT: NVML.md section 2, "transient"); for its name, one that leaves the name
    ``UNKNOWN_NAME`` (the name is cosmetic) rather than failing the GPU's identity."""
    return code not in DEVICE_LOST_CODES | BACKEND_GONE_CODES


def handle_failed(code: int | None, description: str) -> BackendUnavailable:
    """NVML gone (``BACKEND_GONE_CODES``) under a GPU's handle, UUID or name while it is opened:
    NVML counts as down (initialised again with backoff), not the GPU as lost."""
    return BackendUnavailable(f"NVML device handle failed: {description}", code)


def placeholder(index: int, why: str) -> DeviceIdentity:
    """The identity of a GPU whose handle or UUID cannot be read: ``unknown-<index>``, named
    by why (which its unhealthy samples give as their error)."""
    return DeviceIdentity(index, f"{PLACEHOLDER}{index}", why)


def unanswered(ident: DeviceIdentity, unidentified: bool) -> DeviceSample:
    """The sample of a GPU without a handle (``placeholder``): unhealthy, no readings."""
    return DeviceSample(
        ident.index,
        ident.uuid,
        ident.name,
        healthy=False,
        error=ident.name,
        unidentified=unidentified,
    )


class PassingErrors:
    """Since when each GPU (by position) has answered its handle or UUID with a passing error:
    ``unidentified`` for ``PASSING_FOR_S`` at most, then taken for lost (NVML.md: escalate)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since: dict[int, float] = {}

    def clear(self) -> None:
        """Forget every GPU (a new open: a GPU lost since is not passing)."""
        self._since = {}

    def failed(self, position: int, code: int | None) -> None:
        """Its handle or UUID failed with ``code`` (now, or still since it first did)."""
        if passing(code):
            self._since.setdefault(position, self._clock())
        else:
            self._since.pop(position, None)

    def answered(self, position: int) -> None:
        """Its handle and UUID were read."""
        self._since.pop(position, None)

    def still(self, position: int) -> bool:
        """It fails with a passing error, for less than ``PASSING_FOR_S``."""
        since = self._since.get(position)
        return since is not None and self._clock() - since < PASSING_FOR_S


#: Each sampled field and the NVML functions that read it (fault keys ``rc_<function>``).
FIELD_FUNCTIONS: Mapping[str, tuple[str, ...]] = {
    "memory": ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"),
    "utilization": ("nvmlDeviceGetUtilizationRates",),
    "temperature": ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"),
    "thresholds": ("nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetFieldValues"),
    "power": ("nvmlDeviceGetPowerUsage",),
    "power_limit": ("nvmlDeviceGetEnforcedPowerLimit",),
    "encoder": ("nvmlDeviceGetEncoderUtilization",),
    "decoder": ("nvmlDeviceGetDecoderUtilization",),
    "clocks": ("nvmlDeviceGetCurrentClocksEventReasons",),
    "ecc": ("nvmlDeviceGetTotalEccErrors",),
    "remapped_rows": ("nvmlDeviceGetRemappedRows",),
    "retired_pages": ("nvmlDeviceGetRetiredPagesPendingStatus",),
    "recovery_action": ("nvmlDeviceGetFieldValues",),
    "cpu_affinity": ("nvmlDeviceGetCpuAffinity",),
    "processes": (
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
    ),
    "graphics_processes": (
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
    ),
    "mps_processes": (
        "nvmlDeviceGetMPSComputeRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    ),
}


def percent(value: float | None) -> float | None:
    """A utilization reading (percent), None outside 0-100: no reading at all, such as an
    unsigned -1 (4294967295) from a driver that has none, is published or routed on."""
    return value if value is None or 0.0 <= value <= 100.0 else None


def one_per_pid(processes: Iterable[GpuProcess]) -> tuple[GpuProcess, ...]:
    """One entry per pid: NVML lists a process with compute and graphics contexts (nvidia-smi's
    "C+G") in both lists with the same memory (an MPS client may be in the compute and the MPS
    clients' lists), so the largest figure counts, not the sum."""
    used: dict[int, float | None] = {}
    for p in processes:
        had = used.get(p.pid)
        mb = p.used_mb
        used[p.pid] = mb if had is None else had if mb is None else max(had, mb)
    return tuple(GpuProcess(pid, mb) for pid, mb in used.items())


class GpuBackend(Protocol):
    """What the supervisor needs from a GPU backend."""

    name: str
    #: How long the sampler lets one ``wait_xid`` call block. Short where ``close()`` must wait
    #: for a wait in progress (NVML); longer for a backend that polls, whose every return is a
    #: round trip through the event loop for nothing (the wait still returns at the first event).
    xid_wait_s: float

    def open(self) -> tuple[DeviceIdentity, ...]:
        """Initialise and return the devices; ``BackendUnavailable`` if there is no GPU API."""
        ...

    def sample(self) -> tuple[DeviceSample, ...]:
        """Read every device once (blocking). Per-device failures come back as unhealthy."""
        ...

    def wait_xid(self, timeout_s: float) -> list[XidEvent]:
        """Block up to ``timeout_s`` for XID events (empty list on timeout)."""
        ...

    def xids_unwatched(self) -> Mapping[str, str]:
        """GPU UUID -> why that GPU's XID events do not reach ``wait_xid`` (empty: every GPU's
        do). A GPU listed here can have XIDs that nothing restarts, drains or quarantines."""
        ...

    def close(self) -> None:
        """Release the library."""
        ...


class NoBackend:
    """``backend = "none"``: no GPU telemetry at all."""

    name = "none"
    xid_wait_s = 1.0

    def open(self) -> tuple[DeviceIdentity, ...]:
        """No devices."""
        return ()

    def sample(self) -> tuple[DeviceSample, ...]:
        """Nothing to sample."""
        return ()

    def wait_xid(self, timeout_s: float) -> list[XidEvent]:
        """Never any events."""
        return []

    def xids_unwatched(self) -> Mapping[str, str]:
        """No GPUs."""
        return {}

    def close(self) -> None:
        """Nothing to release."""
