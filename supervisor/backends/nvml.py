"""The NVML backend (``nvidia-ml-py``'s ``pynvml``): the only module that imports ``pynvml``.

- One long-lived ``nvmlInit``; identities (UUID, name, total memory) cached at ``open()``; a
  GPU whose handle or UUID cannot be read then is asked again every ``HANDLE_RETRY_S``, but
  one that answers NO_PERMISSION (not this user's or cgroup's) is left out.
- Versioned entry points are probed once: memory ``_v2`` (else v1), the process lists (compute
  and graphics) ``_v3`` (else ``_v2``), ``TemperatureV`` (else the deprecated
  ``GetTemperature``), slowdown/shutdown thresholds through field values 194/193 (else
  ``GetTemperatureThreshold``).
- Errors are mapped here (NVML.md section 2): not supported / no permission / function not found /
  version mismatch / deprecated -> the field is None and is not asked again on that device; GPU
  lost, reset required, insufficient power, IRQ issue -> the device is unhealthy this tick;
  uninitialised, driver not loaded, driver/library version mismatch -> ``BackendUnavailable``
  (initialised again with backoff); anything else -> the field is None this tick. An init
  failure is ``BackendUnavailable``. A name that cannot be read is ``UNKNOWN_NAME``.
- Calls block: the sampler runs ``sample()`` in one dedicated thread and ``wait_xid()`` in
  another (a bounded ``nvmlEventSetWait_v2``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import pynvml

from supervisor.backends.base import (
    BACKEND_GONE_CODES,
    DEVICE_LOST_CODES,
    NVML_ERROR_DEPRECATED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    UNKNOWN_NAME,
    UNSUPPORTED_CODES,
    PassingErrors,
    handle_failed,
    one_per_pid,
    passing,
    percent,
    placeholder,
    unanswered,
)
from supervisor.errors import BackendError, BackendUnavailable, DeviceLost
from supervisor.model import DeviceIdentity, DeviceSample, GpuProcess, RemappedRows, XidEvent


def _legacy_package(module: Any) -> bool:
    """``module`` is the legacy PyPI package ``pynvml`` before 12 (a ``pynvml/`` package
    whose ``__version__`` is 11 or less), not nvidia-ml-py's single ``pynvml.py``. A package
    of another version is let be: a later layout of nvidia-ml-py must not be refused."""
    if not hasattr(module, "__path__"):
        return False
    major = str(getattr(module, "__version__", "")).split(".")[0]
    return major.isdigit() and int(major) < 12


if _legacy_package(pynvml):
    raise ImportError(
        f"the pynvml found ({pynvml.__path__[0]}) is the legacy PyPI package `pynvml` (before "
        "12), which shadows nvidia-ml-py's and lacks what the supervisor uses: "
        "pip uninstall pynvml (or upgrade it to 12 or later, which leaves nvidia-ml-py's)"
    )

T = TypeVar("T")
MIB = 1024 * 1024
_XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
#: What a call answers where its entry point or struct version does not exist (or the device
#: does not do that version, or no longer does: DEPRECATED): the older version is asked instead.
VERSION_CODES = frozenset(
    {
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        NVML_ERROR_DEPRECATED,
    }
)
#: An XID event set that could not be made is tried again this often (``wait_xid``).
EVENTS_RETRY_S = 30.0
#: Why a GPU's XIDs are not watched where it reports none (MIG instances, some vGPUs).
XIDS_NOT_SUPPORTED = "the GPU reports no XID events to NVML (not supported)"
#: A GPU whose handle or UUID could not be read is asked again this often (``sample``);
#: one that answers a passing error for ``PASSING_FOR_S`` (base.py) is taken for lost.
HANDLE_RETRY_S = 30.0
_FI_SHUTDOWN = 193
_FI_SLOWDOWN = 194
#: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvml.h, R550 and later)
_FI_RECOVERY_ACTION = 230
#: How often the memory-error counters and flags (ECC, row remapper, page retirement) are read
#: (s); the sim backend reads its world at every sample.
MEMORY_ERRORS_EVERY_S = 5.0
#: How many times a process list is asked for when it answers INSUFFICIENT_SIZE: processes
#: started between pynvml's two calls (the count, then the list) and outgrew its buffer.
LIST_TRIES = 3


#: init failures that mean no usable NVML library on the machine (not retried under ``auto``)
LIBRARY_ABSENT_CODES = (NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_FUNCTION_NOT_FOUND)


class _NoMismatchError(Exception):
    """Stands in for ``pynvml.NVMLLibraryMismatchError`` where the bindings have none: never
    raised."""


#: What nvidia-ml-py 12.550 and later raise for a versioned wrapper whose symbol the library
#: lacks (not an ``NVMLError``); earlier releases have no such class.
_MISMATCH: type[Exception] = getattr(pynvml, "NVMLLibraryMismatchError", _NoMismatchError)


def _binding(name: str) -> Callable[..., Any]:
    """pynvml's wrapper ``name``. One the installed nvidia-ml-py lacks
    (``nvmlDeviceGetTemperatureV`` before 12.570, the ``_v2`` process lists before 12.550)
    raises FUNCTION_NOT_FOUND, as a symbol the library lacks does: the older call is asked,
    or that field is unknown. Regression: an AttributeError failed the open or the sample."""
    fn: Callable[..., Any] | None = getattr(pynvml, name, None)
    if fn is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    return fn


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _describe(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # pynvml's __str__ calls into the library
        return f"NVML error {_code(exc)}"


def _listed(fn: Callable[[], T]) -> T:
    """``fn()`` (a process list), asked again while the list grew between NVML's two calls
    (NVML.md section 2: "retry"). Regression: one such race made the list unknown for the
    tick (the device's processes null, its workers' GPU memory "unavailable", and the
    GPU-release barrier, which cannot tell then, let a restart through)."""
    for _ in range(LIST_TRIES - 1):
        try:
            return fn()
        except pynvml.NVMLError as exc:
            if _code(exc) != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                raise
    return fn()


_SLOWDOWN = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
_SHUTDOWN = pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN


def _replaced(
    identities: tuple[DeviceIdentity, ...], position: int, ident: DeviceIdentity
) -> tuple[DeviceIdentity, ...]:
    return (*identities[:position], ident, *identities[position + 1 :])


def _processes(compute: Any, graphics: Any, mps: Any = ()) -> tuple[GpuProcess, ...]:
    """The compute, graphics and MPS clients' lists as one: a process that renders only
    (EGL/Vulkan, some video pipelines) is in the graphics list alone, and a CUDA process that
    is a client of the MPS server (workers sharing a GPU under MPS) in the MPS list (the
    compute one may show the server); their memory is their worker's as much as CUDA's is."""
    listed = []
    for p in (*compute, *graphics, *mps):
        pid, used = int(p.pid), p.usedGpuMemory
        if pid > 0:
            listed.append(GpuProcess(pid, None if used is None else float(used) / MIB))
    return one_per_pid(listed) if graphics or mps else tuple(listed)


#: ``nvmlValue_t``'s member for each ``nvmlValueType_t`` (double, uint, ulong, ulonglong,
#: slonglong, sint, ushort).
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


#: Words of 64 CPUs asked of ``nvmlDeviceGetCpuAffinity`` (at least 1024 CPUs).
_AFFINITY_WORDS = max(16, (os.cpu_count() or 1) // 64 + 1)


def _cpu_affinity(handle: Any) -> tuple[int, ...] | None:
    """The CPUs close to the GPU (NVML's "ideal" affinity: its NUMA node's), None where NVML
    cannot tell (not supported, a virtual machine without NUMA, an empty mask)."""
    try:
        words = pynvml.nvmlDeviceGetCpuAffinity(handle, _AFFINITY_WORDS)
    except pynvml.NVMLError:
        return None
    cpus = tuple(
        64 * i + bit for i, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1
    )
    return cpus or None


def _field_value(fv: Any) -> float | None:
    """The number of a field value that was answered (``nvmlReturn`` 0)."""
    kind = int(fv.valueType)
    if not 0 <= kind < len(_VALUE_MEMBERS):
        return None
    return float(getattr(fv.value, _VALUE_MEMBERS[kind]))  # only the member it is


def _ecc_counts(handle: Any) -> tuple[int, int]:
    """Corrected and uncorrected ECC errors since the driver loaded (volatile counters)."""
    return (
        int(
            pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        ),
        int(
            pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        ),
    )


class NvmlBackend:
    """GPU telemetry through NVML."""

    name = "nvml"
    xid_wait_s = 1.0  # close() waits for a wait in progress (the event set is freed after it)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._handles: list[Any] = []
        self._identities: tuple[DeviceIdentity, ...] = ()
        self._unsupported: set[tuple[int, str]] = set()
        self._memory_v2 = True
        self._procs_v3 = True
        self._temperature_v = True
        self._threshold_fields = True
        self._clocks_event = True  # nvmlDeviceGetCurrentClocksEventReasons is there
        self._older: set[tuple[int, str]] = set()  # (GPU, field) answered by the older call
        #: GPU -> when its memory-error readings are due again, and the last ones
        self._memory_read: dict[int, tuple[float, tuple[Any, Any, Any]]] = {}
        #: GPU -> the field ids its field-values call asks for (those not found unsupported)
        self._field_ids: dict[int, list[int]] = {}
        self._event_set: Any = None
        #: Why no event set could be made (None: made, or no GPU supports XID events), and
        #: when to try again: a passing failure must not leave XIDs unwatched for good.
        self._events_error: str | None = None
        self._events_retry_at = 0.0
        #: GPU UUID -> why its XID events are not watched (replaced whole, never changed:
        #: read by the sampler without the lock)
        self._unwatched: dict[str, str] = {}
        self._initialized = False
        self._lock = threading.Lock()
        self._handle_retry_at: dict[int, float] = {}  # position -> when to ask again
        #: positions whose handle or UUID fails with a passing error (not a lost GPU)
        self._passing = PassingErrors(clock)

    # --- lifecycle -------------------------------------------------------------------------

    def open(self) -> tuple[DeviceIdentity, ...]:
        """``nvmlInit``, cache identities, probe versions, register for XID events."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            # no library, or one without nvmlInitWithFlags: no NVML on this machine (``auto``
            # runs without it); any other failure is a library that is there but does not
            # answer yet (driver not loaded, RM version mismatch, no permission): retried
            code = _code(exc)
            raise BackendUnavailable(
                f"NVML init failed: {_describe(exc)}",
                code,
                library_absent=code in LIBRARY_ABSENT_CODES,
            ) from exc
        except OSError as exc:  # pragma: no cover - pynvml maps this to LibraryNotFound
            raise BackendUnavailable(
                f"NVML library not loadable: {exc}", library_absent=True
            ) from exc
        self._initialized = True
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self.close()
            raise BackendUnavailable(f"NVML device count failed: {_describe(exc)}") from exc
        handles: list[Any] = []
        identities: list[DeviceIdentity] = []
        retry_at = self._clock() + HANDLE_RETRY_S
        self._passing.clear()  # of this open's positions (a GPU lost since is not passing)
        for index in range(count):
            try:
                handle, ident = self._identify(index)
            except pynvml.NVMLError as exc:
                if _code(exc) == pynvml.NVML_ERROR_NO_PERMISSION:
                    # counted, but not this user's or cgroup's to open (nvml.h): not one of
                    # its GPUs. Regression: listed as lost (a false alarm for good).
                    continue
                if _code(exc) in BACKEND_GONE_CODES:
                    # NVML itself is gone (the driver unloading under the open): not this
                    # GPU's failure. Regression: the GPU was taken for lost and quarantined.
                    self.close()
                    raise handle_failed(_code(exc), _describe(exc)) from exc
                self._handle_retry_at[len(handles)] = retry_at  # by position
                self._passing.failed(len(handles), _code(exc))
                handles.append(None)
                identities.append(placeholder(index, _describe(exc)))
                continue
            handles.append(handle)
            identities.append(ident)
        self._handles = handles
        self._identities = tuple(identities)
        self._probe()
        self._register_events()
        return self._identities

    @staticmethod
    def _identify(index: int) -> tuple[Any, DeviceIdentity]:
        """The handle and identity of GPU ``index`` (``NVMLError`` when either cannot be read)."""
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        try:
            name = pynvml.nvmlDeviceGetName(handle)
        except pynvml.NVMLError as exc:
            # the name is cosmetic (regression: NOT_SUPPORTED or UNKNOWN here alone made a GPU
            # whose handle and UUID read fine an unhealthy placeholder); a lost GPU stays lost
            if not passing(_code(exc)):
                raise
            name = UNKNOWN_NAME
        total: float | None = None
        try:
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total / MIB
        except pynvml.NVMLError:
            total = None
        return handle, DeviceIdentity(index, str(uuid), str(name), total, _cpu_affinity(handle))

    def _retry_handle(self, position: int) -> Any:
        """The handle of a GPU whose handle or UUID could not be read (at ``open()`` or since),
        asked again every ``HANDLE_RETRY_S``: a GPU that failed with UNKNOWN or TIMEOUT while
        the driver was still bringing it up was otherwise unusable until NVML was opened
        again, i.e. for good on a host whose other GPUs answer. None while it still fails."""
        now = self._clock()
        if now < self._handle_retry_at.get(position, 0.0):
            return None
        self._handle_retry_at[position] = now + HANDLE_RETRY_S
        old = self._identities[position]
        try:
            handle, ident = self._identify(old.index)
        except pynvml.NVMLError as exc:
            if _code(exc) in BACKEND_GONE_CODES:  # NVML is gone, not this GPU (as _query)
                raise BackendUnavailable(f"NVML: {_describe(exc)}", _code(exc)) from exc
            failed = replace(old, name=_describe(exc))  # the sample says why it is unhealthy
            self._identities = _replaced(self._identities, position, failed)
            self._passing.failed(position, _code(exc))
            return None
        del self._handle_retry_at[position]
        self._passing.answered(position)
        self._handles[position] = handle
        self._identities = _replaced(self._identities, position, ident)
        self._watch(position, handle)
        return handle

    def _watch(self, position: int, handle: Any) -> None:
        """Register a GPU that answers only now for XID events."""
        if self._event_set is None:
            with self._lock:  # wait_xid reads the set under it
                if self._event_set is None and self._events_error is None:
                    self._register_events()  # no GPU could be watched before: maybe this one
            return  # a set that failed is made again, with every handle, by wait_xid
        refused = self._register(handle, self._event_set)
        unwatched = dict(self._unwatched)
        unwatched.pop(self._identities[position].uuid, None)
        if refused is not None:
            why, for_good = refused
            unwatched[self._identities[position].uuid] = why
            if not for_good:
                self._events_failed(why)
        self._unwatched = unwatched

    @staticmethod
    def _register(handle: Any, event_set: Any) -> tuple[str, bool] | None:
        """Register ``handle`` for XID events in ``event_set``; why not and whether for good
        (None: registered). Refused for good (not supported, no permission, ...: the codes of
        a field not available here) is not tried again. Regression: NO_PERMISSION on every GPU
        made the set again every ``EVENTS_RETRY_S`` and failed every wait, for ever."""
        try:
            mask = _XID_EVENT & int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
            if not mask:
                return XIDS_NOT_SUPPORTED, True
            pynvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
        except pynvml.NVMLError as exc:
            code = _code(exc)
            if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
                return XIDS_NOT_SUPPORTED, True
            return f"nvmlDeviceRegisterEvents: {_describe(exc)}", code in UNSUPPORTED_CODES
        return None

    def xids_unwatched(self) -> Mapping[str, str]:
        """GPU UUID -> why its XID events do not reach :meth:`wait_xid` (not supported, its
        registration failed, no event set could be made)."""
        return self._unwatched

    def _first_handle(self) -> Any:
        return next((h for h in self._handles if h is not None), None)

    def _probe(self) -> None:
        h = self._first_handle()
        if h is None:
            return
        self._memory_v2 = self._works(
            lambda: pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
        )
        self._procs_v3 = self._works(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h))
        self._temperature_v = self._works(
            lambda: _binding("nvmlDeviceGetTemperatureV")(h, pynvml.NVML_TEMPERATURE_GPU)
        )
        self._threshold_fields = self._works(
            lambda: pynvml.nvmlDeviceGetFieldValues(h, [_FI_SLOWDOWN, _FI_SHUTDOWN])
        )

    @staticmethod
    def _works(fn: Callable[[], object]) -> bool:
        """False only for "this entry point or struct version does not exist here": not for
        NOT_SUPPORTED, the first GPU's own answer (regression: every GPU was then read through
        the older call, or not at all; ``_query_versions`` falls back GPU by GPU)."""
        try:
            fn()
        except _MISMATCH:
            return False
        except pynvml.NVMLError as exc:
            return _code(exc) not in VERSION_CODES - {pynvml.NVML_ERROR_NOT_SUPPORTED}
        return True

    def _register_events(self) -> None:
        """Make the XID event set; on a failure other than "not supported", say why in
        ``_events_error`` and try again after ``EVENTS_RETRY_S`` (``wait_xid``)."""
        self._events_error = None
        answering = [
            i.uuid for i, h in zip(self._identities, self._handles, strict=True) if h is not None
        ]
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            failed = f"nvmlEventSetCreate: {_describe(exc)}"
            self._events_failed(failed)
            self._unwatched = dict.fromkeys(answering, failed)
            return
        registered = 0
        failure = None
        unwatched: dict[str, str] = {}
        for ident, handle in zip(self._identities, self._handles, strict=True):
            if handle is None:
                continue
            refused = self._register(handle, event_set)
            if refused is None:
                registered += 1
                continue
            why, for_good = refused
            unwatched[ident.uuid] = why
            if not for_good:  # NOT_SUPPORTED leaves the set usable
                failure = why
        self._unwatched = unwatched
        if registered:
            self._event_set = event_set
        else:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(event_set)
            if failure is not None:
                self._events_failed(failure)

    def _events_failed(self, why: str) -> None:
        self._events_error = why
        self._events_retry_at = self._clock() + EVENTS_RETRY_S

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        with self._lock:
            if self._event_set is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(self._event_set)
                self._event_set = None
            if self._initialized:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
                self._initialized = False

    # --- sampling --------------------------------------------------------------------------

    def _query_versions(
        self,
        index: int,
        field: str,
        newer_exists: bool,
        newer: Callable[[], T],
        older: Callable[[], T],
    ) -> T | None:
        """``_query`` of the newer version of a call, else of the older one, GPU by GPU: the
        versions are probed on the first GPU, and on a host with GPUs of different generations
        another may have only the older (regression: its field was then null for good)."""

        def ask() -> T:
            if newer_exists and (index, field) not in self._older:
                try:
                    return newer()
                except _MISMATCH:
                    pass
                except pynvml.NVMLError as exc:
                    if _code(exc) not in VERSION_CODES:
                        raise
                self._older.add((index, field))
            return older()

        return self._query(index, field, ask)

    def _clock_reasons(self, handle: Any) -> int:
        """The clock-event reasons; drivers before the call's new name (R535) have only
        ``nvmlDeviceGetCurrentClocksThrottleReasons``, which gives the same bits."""
        if self._clocks_event:
            try:
                return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
            except pynvml.NVMLError as exc:
                if _code(exc) != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                self._clocks_event = False
        return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    def _query(self, index: int, field: str, fn: Callable[[], T]) -> T | None:
        if (index, field) in self._unsupported:
            return None
        try:
            return fn()
        except _MISMATCH:
            self._unsupported.add((index, field))
            return None
        except pynvml.NVMLError as exc:
            code = _code(exc)
            if code in DEVICE_LOST_CODES:
                raise DeviceLost(_describe(exc), code) from exc
            if code == NVML_ERROR_UNINITIALIZED:
                raise BackendUnavailable("NVML is no longer initialised", code) from exc
            if code in BACKEND_GONE_CODES:  # the driver unloaded or upgraded under us
                raise BackendUnavailable(f"NVML: {_describe(exc)}", code) from exc
            if code in UNSUPPORTED_CODES:
                self._unsupported.add((index, field))
            return None

    def sample(self) -> tuple[DeviceSample, ...]:
        """Read every device once."""
        if not self._initialized:
            raise BackendUnavailable("NVML is not initialised")
        out = []
        for position, handle in enumerate(self._handles):
            if handle is None:
                handle = self._retry_handle(position)
            ident = self._identities[position]
            if handle is None:
                out.append(unanswered(ident, self._passing.still(position)))
                continue
            try:
                out.append(self._sample_device(ident, handle))
            except DeviceLost as exc:
                out.append(
                    DeviceSample(ident.index, ident.uuid, ident.name, healthy=False, error=str(exc))
                )
        return tuple(out)

    def _sample_device(self, ident: DeviceIdentity, h: Any) -> DeviceSample:
        i = ident.index
        q = self._query
        v = self._query_versions
        mem = v(
            i,
            "memory",
            self._memory_v2,
            lambda: pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2),
            lambda: pynvml.nvmlDeviceGetMemoryInfo(h),
        )
        util = q(i, "utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        temp = v(
            i,
            "temperature",
            self._temperature_v,
            lambda: _binding("nvmlDeviceGetTemperatureV")(h, pynvml.NVML_TEMPERATURE_GPU),
            lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        )
        slowdown, shutdown, recovery = self._field_values(i, h)
        power = q(i, "power", lambda: pynvml.nvmlDeviceGetPowerUsage(h))
        limit = q(i, "power_limit", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h))
        enc = q(i, "encoder", lambda: pynvml.nvmlDeviceGetEncoderUtilization(h))
        dec = q(i, "decoder", lambda: pynvml.nvmlDeviceGetDecoderUtilization(h))
        clocks = q(i, "clocks", lambda: self._clock_reasons(h))
        ecc, rows, retired = self._memory_errors(i, h)
        procs = v(
            i,
            "processes",
            self._procs_v3,
            lambda: _listed(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)),
            lambda: _listed(lambda: _binding("nvmlDeviceGetComputeRunningProcesses_v2")(h)),
        )
        graphics = mps = None
        if procs is not None:
            graphics = v(
                i,
                "graphics_processes",
                self._procs_v3,
                lambda: _listed(lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(h)),
                lambda: _listed(lambda: _binding("nvmlDeviceGetGraphicsRunningProcesses_v2")(h)),
            )
            mps = v(
                i,
                "mps_processes",
                self._procs_v3,
                lambda: _listed(lambda: pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(h)),
                lambda: _listed(lambda: _binding("nvmlDeviceGetMPSComputeRunningProcesses_v2")(h)),
            )
        total = used = free = None
        if mem is not None:
            total, used, free = mem.total / MIB, mem.used / MIB, mem.free / MIB
        processes = None
        # a list that failed this tick (not one the GPU does not have): the processes are not
        # known (regression: they were the others' alone, an MPS worker's memory 0)
        if procs is not None and all(
            got is not None or (i, field) in self._unsupported
            for got, field in ((graphics, "graphics_processes"), (mps, "mps_processes"))
        ):
            processes = _processes(procs, graphics or (), mps or ())
        return DeviceSample(
            index=i,
            uuid=ident.uuid,
            name=ident.name,
            memory_total_mb=total,
            memory_used_mb=used,
            memory_free_mb=free,
            utilization_percent=None if util is None else percent(float(util.gpu)),
            temperature_c=None if temp is None else float(temp),
            temperature_slowdown_c=slowdown,
            temperature_shutdown_c=shutdown,
            power_watts=None if power is None else power / 1000.0,
            power_limit_watts=None if limit is None else limit / 1000.0,
            encoder_percent=None if enc is None else percent(float(enc[0])),
            decoder_percent=None if dec is None else percent(float(dec[0])),
            clocks_event_reasons=None if clocks is None else int(clocks),
            recovery_action=recovery,
            ecc_errors_corrected=None if ecc is None else ecc[0],
            ecc_errors_uncorrected=None if ecc is None else ecc[1],
            remapped_rows=(
                None
                if rows is None
                else RemappedRows(int(rows[0]), int(rows[1]), bool(rows[2]), bool(rows[3]))
            ),
            retired_pages_pending=None if retired is None else bool(retired),
            processes=processes,
            cpus=ident.cpus,
        )

    def _memory_errors(self, i: int, h: Any) -> tuple[Any, Any, Any]:
        """ECC counts, the row remapper and (before Ampere) page retirement: read at the first
        sample and then every ``MEMORY_ERRORS_EVERY_S`` (they change once in months; three or
        four driver calls a GPU at every tick would cost more than all they tell), the last
        readings kept in between. The flags they carry are acted on by healing; the XIDs that
        come with the errors themselves are delivered at once."""
        now = self._clock()
        kept = self._memory_read.get(i)
        if kept is not None and now < kept[0]:
            return kept[1]
        q = self._query
        ecc = q(i, "ecc", lambda: _ecc_counts(h))
        rows = q(i, "remapped_rows", lambda: pynvml.nvmlDeviceGetRemappedRows(h))
        retired = (
            None  # Ampere and later remap rows instead: not asked
            if rows is not None
            else q(i, "retired_pages", lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h))
        )
        self._memory_read[i] = (now + MEMORY_ERRORS_EVERY_S, (ecc, rows, retired))
        return ecc, rows, retired

    def _field_values(self, i: int, h: Any) -> tuple[float | None, float | None, int | None]:
        """Slowdown and shutdown temperatures and the GPU recovery action, in one
        ``nvmlDeviceGetFieldValues`` call: the temperatures from their fields where the driver
        has them, else (older GPUs answer those fields NOT_SUPPORTED) from the threshold
        queries; the recovery action (R550 and later: what the driver says the GPU needs
        after an error) None where the field is not there. A field answered NOT_SUPPORTED is
        not asked for again (every tick pays for this call: kept lean)."""
        slowdown = shutdown = action = None
        ids = self._field_ids.get(i)
        if ids is None:
            ids = self._field_ids[i] = [
                *(
                    (_FI_SLOWDOWN, _FI_SHUTDOWN)
                    if (i, "threshold_fields") not in self._unsupported
                    else ()
                ),
                *(
                    (_FI_RECOVERY_ACTION,)
                    if (i, "recovery_action") not in self._unsupported
                    else ()
                ),
            ]
        if self._threshold_fields and ids:
            values = self._query(i, "field_values", lambda: pynvml.nvmlDeviceGetFieldValues(h, ids))
            unsupported: list[int] = []
            # pynvml fills an array laid out in the order of ``ids`` (each entry's fieldId is
            # set from them before the call): read by position, each attribute once (every
            # attribute of these structs goes through pynvml's __getattribute__)
            for fid, v in zip(ids, values or (), strict=False):
                rc = v.nvmlReturn
                if rc:
                    if int(rc) in UNSUPPORTED_CODES:
                        unsupported.append(fid)
                elif fid == _FI_SLOWDOWN:
                    slowdown = _field_value(v)
                elif fid == _FI_SHUTDOWN:
                    shutdown = _field_value(v)
                else:
                    action = _field_value(v)
            if unsupported:
                if _FI_SLOWDOWN in unsupported and _FI_SHUTDOWN in unsupported:
                    self._unsupported.add((i, "threshold_fields"))  # the queries from now on
                if _FI_RECOVERY_ACTION in unsupported:
                    self._unsupported.add((i, "recovery_action"))
                # dropped once, the others kept (regression: one threshold field alone not
                # supported had the list made again, with it, at every tick)
                self._field_ids[i] = [fid for fid in ids if fid not in unsupported]
        if slowdown is None:
            slowdown = self._threshold(i, h, "threshold_slowdown", _SLOWDOWN)
        if shutdown is None:
            shutdown = self._threshold(i, h, "threshold_shutdown", _SHUTDOWN)
        return slowdown, shutdown, None if action is None else int(action)

    def _threshold(self, i: int, h: Any, field: str, which: int) -> float | None:
        value = self._query(i, field, lambda: pynvml.nvmlDeviceGetTemperatureThreshold(h, which))
        return None if value is None else float(value)

    # --- events ----------------------------------------------------------------------------

    def _index_of(self, device: Any) -> int | None:
        address = ctypes.cast(device, ctypes.c_void_p).value
        for index, handle in enumerate(self._handles):
            if handle is not None and ctypes.cast(handle, ctypes.c_void_p).value == address:
                return index
        return None

    def wait_xid(self, timeout_s: float) -> list[XidEvent]:
        """One bounded ``nvmlEventSetWait_v2``; TIMEOUT is the normal "nothing happened"."""
        with self._lock:  # close() waits for a wait in progress instead of freeing under it
            if (
                self._event_set is None
                and self._events_error is not None
                and self._initialized
                and self._clock() >= self._events_retry_at
            ):
                self._register_events()
            if self._event_set is None and self._events_error is not None:
                # said by the sampler (gpu.xid_wait_failed, once a minute), tried again later
                raise BackendError(f"XIDs are not watched: {self._events_error}")
            event_set = self._event_set
            if event_set is None:
                data = None
            else:
                try:
                    data = pynvml.nvmlEventSetWait_v2(event_set, max(1, int(timeout_s * 1000)))
                except pynvml.NVMLError as exc:
                    data = exc
        if data is None:
            time.sleep(timeout_s)
            return []
        if isinstance(data, pynvml.NVMLError):
            if _code(data) == NVML_ERROR_TIMEOUT:
                return []
            raise BackendError(f"NVML event wait failed: {_describe(data)}", _code(data)) from data
        if int(data.eventType) & _XID_EVENT == 0:
            return []
        position = self._index_of(data.device)
        ident = self._identities[position] if position is not None else None
        return [
            XidEvent(
                ident.index if ident is not None else -1,
                ident.uuid if ident is not None else None,
                int(data.eventData),
                self._clock(),
            )
        ]
