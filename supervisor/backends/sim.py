"""Simulated GPUs: the world directory of DESIGN.md section 7, re-read on every sample.

```
<world>/gpus/<index>   key value lines (uuid, name, memory_total_mib, memory_base_mib, ...,
                       lost 0/1, cpus <cpu list>, rc_<nvml function> <code>: the readings'
                       calls, and the handle, UUID and name ones, answered as the nvml
                       backend takes each code)
<world>/procs/<pid>    "<gpu uuid or index> <used_mib|na> [graphics|mps]" lines; files of dead
                       pids are ignored; a pid with compute, graphics (or MPS client) lines on
                       one GPU is one process (the largest figure), as NVML lists it in each
<world>/events         appended "<gpu index> <xid>" lines, delivered once each
```

The test suite's fake ``libnvidia-ml.so.1`` reads the same directory, so one scenario drives both
the ``sim`` and the ``nvml`` backend.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.backends.base import (
    BACKEND_GONE_CODES,
    DEVICE_LOST_CODES,
    FIELD_FUNCTIONS,
    IDENTITY_FUNCTIONS,
    NVML_ERROR_NO_PERMISSION,
    UNKNOWN_NAME,
    UNSUPPORTED_CODES,
    PassingErrors,
    error_string,
    handle_failed,
    one_per_pid,
    passing,
    percent,
    placeholder,
    unanswered,
)
from supervisor.errors import BackendUnavailable
from supervisor.model import (
    DeviceIdentity,
    DeviceSample,
    GpuProcess,
    RemappedRows,
    XidEvent,
    parse_cpulist,
)

#: Defaults for keys a device file leaves out (the fake NVML library uses the same).
DEFAULTS: Mapping[str, str] = {
    "name": "Simulated GPU",
    "memory_total_mib": "81920",
    "memory_base_mib": "0",
    "temperature_c": "40",
    "temperature_slowdown_c": "87",
    "temperature_shutdown_c": "92",
    "utilization_percent": "0",
    "power_mw": "60000",
    "power_limit_mw": "700000",
    "clocks_event_reasons": "0",
    "encoder_percent": "0",
    "decoder_percent": "0",
    "ecc_corrected": "0",
    "ecc_uncorrected": "0",
    "remapped_rows_correctable": "0",
    "remapped_rows_uncorrectable": "0",
    "remapped_rows_pending": "0",
    "remapped_rows_failure": "0",
    "recovery_action": "0",
    "retired_pages_pending": "0",
    "lost": "0",
}

#: The largest pid Linux hands out (``pid_max`` is at most 2**22): a larger file name in
#: ``procs/`` names no process (and overflows ``kill()``).
MAX_PID = 2**22
#: How ``_read_procs`` keys the lines tagged ``graphics`` (a graphics context).
GRAPHICS = "graphics:"
#: ... and those tagged ``mps`` (a client of the MPS server: NVML's MPS clients' list).
MPS = "mps:"
#: The tag of a ``procs/<pid>`` line -> its key prefix.
_TAGS = {"graphics": GRAPHICS, "mps": MPS}
#: The most digits of a number in ``events`` (a 64-bit one has 20 at most).
MAX_DIGITS = 20
XID_POLL_S = 0.5  # how often wait_xid looks at the events file
#: a device file modified less than this long ago is always read again (see ``_read_devices``)
RACY_WRITE_NS = 20_000_000


def default_uuid(index: int) -> str:
    """The UUID a device file without ``uuid`` gets (deterministic per index)."""
    return f"GPU-00000000-0000-0000-0000-{index:012d}"


def parse_kv(text: str) -> dict[str, str]:
    """``key value`` lines; blank lines and ``#`` comments are ignored."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        out[key] = value.strip()
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def default_device_text(index: int, memory_total_mib: int = 81920) -> str:
    """A complete device file for a new world."""
    keys = {**DEFAULTS, "uuid": default_uuid(index), "memory_total_mib": str(memory_total_mib)}
    return "".join(f"{k} {v}\n" for k, v in keys.items())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it holds no GPU memory.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return True
    return b") Z " not in stat


@dataclass(slots=True)
class _Device:
    index: int
    keys: dict[str, str]

    @property
    def uuid(self) -> str:
        return self.keys.get("uuid") or default_uuid(self.index)

    @property
    def name(self) -> str:
        """Its name; ``UNKNOWN_NAME`` where ``nvmlDeviceGetName`` fails (and the GPU is not
        lost for it: ``identity_rc``), as the nvml backend names it."""
        failed = self.rc_any(IDENTITY_FUNCTIONS["name"]) is not None
        return UNKNOWN_NAME if failed else self.get("name")

    def identity_rc(self) -> int | None:
        """The code that fails this GPU's identity as NVML's open reads it (None: it has one):
        its handle's, else its UUID's, else its name's where the GPU is lost or NVML gone for
        it (any other leaves the name unknown). A lost GPU (``lost 1``) is lost first."""
        if self.get("lost") == "1":
            return None
        for call in ("handle", "uuid"):
            code = self.rc_any(IDENTITY_FUNCTIONS[call])
            if code is not None:
                return code
        code = self.rc_any(IDENTITY_FUNCTIONS["name"])
        return None if passing(code) else code

    def get(self, key: str) -> str:
        return self.keys.get(key, DEFAULTS.get(key, ""))

    def number(self, key: str) -> float | None:
        """The key's value; None where it is not a finite number of 0 or more (every figure
        of a device is: NVML never reports ``inf``, ``nan`` or less than nothing)."""
        text = self.get(key)
        try:
            # a bitmask may be written in hex, as the fake NVML library reads it too
            value = float(int(text, 16)) if text[:2] in ("0x", "0X") else float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) and value >= 0 else None

    def cpus(self) -> tuple[int, ...] | None:
        """``cpus``: the CPUs close to the GPU, a CPU list (``0-7,16-23``); None when the
        world says none (or fails the query), as NVML where it cannot tell."""
        text = self.keys.get("cpus", "")
        if not text or self.rc("cpu_affinity") is not None:
            return None
        try:
            return parse_cpulist(text) or None
        except ValueError:
            return None

    def remapped_rows(self) -> RemappedRows | None:
        """``remapped_rows_*``: the row remapper, as ``nvmlDeviceGetRemappedRows`` reads it."""
        if self.rc("remapped_rows") is not None:
            return None
        counts = [self.number(f"remapped_rows_{k}") for k in ("correctable", "uncorrectable")]
        flags = [self.number(f"remapped_rows_{k}") for k in ("pending", "failure")]
        return RemappedRows(
            int(counts[0] or 0), int(counts[1] or 0), bool(flags[0]), bool(flags[1])
        )

    def rc(self, field: str) -> int | None:
        return self.rc_any(FIELD_FUNCTIONS[field])

    def rc_any(self, functions: Iterable[str]) -> int | None:
        """The code the first of ``functions`` with a fault key fails with (None: none has)."""
        for fn in functions:
            code = self.rc_of(fn)
            if code is not None:
                return code
        return None

    def rc_of(self, fn: str) -> int | None:
        """The code the world makes NVML function ``fn`` fail with (None: it answers)."""
        value = self.keys.get(f"rc_{fn}")
        if value is not None:
            with contextlib.suppress(ValueError):
                return int(value)
        return None


def _per_pid(lines: list[GpuProcess]) -> tuple[GpuProcess, ...]:
    """One entry per pid of one kind (compute or graphics): its lines for a GPU add up (as the
    fake NVML library reads them), ``na`` where none says a number."""
    used: dict[int, float | None] = {}
    for p in lines:
        had = used.get(p.pid)
        used[p.pid] = p.used_mb if had is None else had + (p.used_mb or 0.0)
    return tuple(GpuProcess(pid, mb) for pid, mb in used.items())


class SimBackend:
    """Simulated GPUs backed by a world directory."""

    name = "sim"
    #: ``wait_xid`` polls the events file every ``XID_POLL_S``; each wait's return costs the
    #: event loop a wake-up and a thread hop, so one wait covers several polls.
    xid_wait_s = 5.0

    def __init__(
        self,
        world: Path,
        create_devices: int = 2,
        clock: Callable[[], float] = time.monotonic,
        pid_alive: Callable[[int], bool] = _pid_alive,
        *,
        create: bool = True,
    ) -> None:
        self.world = world
        self.create_devices = create_devices
        #: False: never write to the world; a world that does not exist yet reads as the
        #: ``create_devices`` default devices ``open`` would create (``check-config``).
        self.create = create
        self._clock = clock
        self._pid_alive = pid_alive
        self._events_offset = 0
        self._partial = b""
        #: a closed backend reads no more events (its wait may still be polling in its thread
        #: when the sampler opens the next one, which reads from the file's end at its open)
        self._events_lock = threading.Lock()
        self._closed = False
        self._identities: tuple[DeviceIdentity, ...] = ()
        #: GPU index -> since when its handle or UUID fails with a passing error
        self._passing = PassingErrors(clock)
        #: GPU indices whose handle and UUID were read (at ``open`` or since): not asked again,
        #: as the nvml backend keeps their handles
        self._answered: set[int] = set()
        self._device_cache: dict[str, tuple[tuple[int, int, int], dict[str, str]]] = {}

    # --- world -----------------------------------------------------------------------------

    def _device_files(self) -> list[tuple[int, str]]:
        found = []
        with (
            contextlib.suppress(FileNotFoundError, NotADirectoryError),
            os.scandir(self.world / "gpus") as entries,
        ):
            for entry in entries:
                if entry.name.isascii() and entry.name.isdigit() and entry.is_file():
                    found.append((int(entry.name), entry.path))
        return sorted(found)

    def _read_devices(self) -> list[_Device]:
        """Every device file, parsed; a file unchanged since the last read is not read again.

        Unchanged means same inode, size and mtime, and the mtime older than
        :data:`RACY_WRITE_NS` (a file rewritten in place twice within the clock's granularity
        can keep its mtime; the atomic writers of the contract always make a new inode).
        """
        devices = []
        cache: dict[str, tuple[tuple[int, int, int], dict[str, str]]] = {}
        now = time.time_ns()
        for index, path in self._device_files():
            try:
                st = os.stat(path)
                signature = (st.st_ino, st.st_size, st.st_mtime_ns)
                known = self._device_cache.get(path)
                if (
                    known is not None
                    and known[0] == signature
                    and now - st.st_mtime_ns > RACY_WRITE_NS
                ):
                    keys = known[1]
                else:
                    with open(path, encoding="utf-8") as fh:
                        keys = parse_kv(fh.read())
            except (OSError, UnicodeDecodeError):
                continue
            cache[path] = (signature, keys)
            devices.append(_Device(index, keys))
        self._device_cache = cache
        if not devices and not self.create and not self._device_files():
            return self.preview()
        return devices

    def _listed(self) -> list[tuple[_Device, int | None]]:
        """The devices as NVML lists them, each with the code its identity fails with (None:
        identified; ``_Device.identity_rc``), as the nvml backend takes each code: a GPU that
        answers NO_PERMISSION is left out (not this user's), one that says NVML is gone makes
        the backend unavailable (``BackendUnavailable``), any other is listed unidentified. A
        GPU identified since ``open`` is not asked again (regression: a fault key written
        while it ran dropped it from the sample or made it lost, where NVML keeps its handle)."""
        listed = []
        for dev in self._read_devices():
            code = None if dev.index in self._answered else dev.identity_rc()
            if code == NVML_ERROR_NO_PERMISSION:
                continue
            if code in BACKEND_GONE_CODES:
                raise handle_failed(code, error_string(code))
            listed.append((dev, code))
        return listed

    def has_devices(self) -> bool:
        """The world has device files (``run`` creates them in a world without)."""
        return bool(self._device_files())

    def preview(self) -> list[_Device]:
        """The devices ``open`` creates in a new world."""
        return [_Device(i, parse_kv(default_device_text(i))) for i in range(self.create_devices)]

    def _read_procs(self) -> dict[str, list[GpuProcess]]:
        """Live processes by device key (UUID or index as written)."""
        by_key: dict[str, list[GpuProcess]] = {}
        try:
            with os.scandir(self.world / "procs") as it:
                # ASCII digits only ("²" is a digit to str.isdigit(), not to int()), and
                # regular files only (open() of a FIFO blocks the sample for good)
                entries = [
                    (e.name, e.path)
                    for e in it
                    if e.name.isascii() and e.name.isdigit() and e.is_file()
                ]
        except (FileNotFoundError, NotADirectoryError):
            return by_key
        for name, path in entries:
            pid = int(name)
            if not 0 < pid <= MAX_PID or not self._pid_alive(pid):
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError):
                continue
            for line in text.splitlines():
                parts = line.split()
                if not 2 <= len(parts) <= 3 or parts[0].startswith("#"):
                    continue  # a third word tags the line (`graphics`: a graphics context)
                key, amount = parts[:2]
                used: float | None
                if amount == "na":
                    used = None
                else:
                    try:
                        used = float(amount)
                    except ValueError:
                        continue
                    if not math.isfinite(used) or used < 0:
                        continue
                if len(parts) == 3:
                    key = _TAGS.get(parts[2], "") + key
                by_key.setdefault(key, []).append(GpuProcess(pid, used))
        return by_key

    # --- GpuBackend ------------------------------------------------------------------------

    def open(self) -> tuple[DeviceIdentity, ...]:
        """Create the world (and ``create_devices`` devices if it has none); read identities.

        With ``create=False`` nothing is written: a world without devices reads as the devices
        a ``create=True`` open would write (:meth:`_read_devices`).
        """
        try:
            if self.create:
                (self.world / "gpus").mkdir(parents=True, exist_ok=True)
                procs = self.world / "procs"
                if not procs.is_dir():
                    procs.mkdir(parents=True, exist_ok=True)
                    # workers of any user (``[[workers]] user``) declare their memory here:
                    # writable by all, each removing only its own files (as /tmp)
                    os.chmod(procs, 0o1777)  # noqa: S103 - a simulated world, like /tmp
            if self.create and not self._device_files():
                for i in range(self.create_devices):
                    write_atomic(self.world / "gpus" / str(i), default_device_text(i))
            events = self.world / "events"
            with self._events_lock:
                self._closed = False
                self._events_offset = events.stat().st_size if events.exists() else 0
        except OSError as exc:
            raise BackendUnavailable(f"sim world {self.world}: {exc.strerror or exc}") from exc
        self._passing.clear()
        self._answered = set()
        identities = []
        for d, code in self._listed():
            if code is None:
                self._answered.add(d.index)
                name, total = d.name, d.number("memory_total_mib")
                identities.append(DeviceIdentity(d.index, d.uuid, name, total, d.cpus()))
            else:
                self._passing.failed(d.index, code)
                identities.append(placeholder(d.index, error_string(code)))
        self._identities = tuple(identities)
        return self._identities

    def sample(self) -> tuple[DeviceSample, ...]:
        """Read every device and the live processes."""
        procs = self._read_procs()
        out = []
        for dev, code in self._listed():
            if code is None:
                self._answered.add(dev.index)
                self._passing.answered(dev.index)
                out.append(self._sample_device(dev, procs))
            else:  # no handle: unhealthy, as the nvml backend samples it
                self._passing.failed(dev.index, code)
                ident = placeholder(dev.index, error_string(code))
                out.append(unanswered(ident, self._passing.still(dev.index)))
        return tuple(out)

    def _sample_device(self, dev: _Device, procs: Mapping[str, list[GpuProcess]]) -> DeviceSample:
        uuid, name = dev.uuid, dev.name
        if dev.get("lost") == "1":
            return DeviceSample(dev.index, uuid, name, healthy=False, error="GPU is lost")
        for fname in FIELD_FUNCTIONS:
            code = dev.rc(fname)
            if code in DEVICE_LOST_CODES:
                # NVML's words for it, as the nvml backend's error says
                return DeviceSample(dev.index, uuid, name, healthy=False, error=error_string(code))

        def field(name: str, key: str, scale: float = 1.0) -> float | None:
            if dev.rc(name) is not None:
                return None
            value = dev.number(key)
            return None if value is None else value * scale

        def share(name: str, key: str) -> float | None:
            return percent(field(name, key))

        mine = _per_pid([*procs.get(uuid, []), *procs.get(str(dev.index), [])])
        graphics = _per_pid(
            [*procs.get(GRAPHICS + uuid, []), *procs.get(GRAPHICS + str(dev.index), [])]
        )
        mps = _per_pid([*procs.get(MPS + uuid, []), *procs.get(MPS + str(dev.index), [])])
        total = field("memory", "memory_total_mib")
        used = free = None
        if total is not None:
            base = dev.number("memory_base_mib") or 0.0
            # a process in both lists is one process: its memory counts once
            held = sum(p.used_mb or 0.0 for p in one_per_pid((*mine, *graphics, *mps)))
            used = min(total, base + held)
            free = total - used
        # as NVML is asked: the field values, and the threshold queries where those fail
        # (regression: either one failing made them null here, not through NVML)
        thresholds_ok = any(dev.rc_of(fn) is None for fn in FIELD_FUNCTIONS["thresholds"])
        clocks = field("clocks", "clocks_event_reasons")
        recovery = field("recovery_action", "recovery_action")
        retired = field("retired_pages", "retired_pages_pending")
        rows = dev.remapped_rows()
        corrected = field("ecc", "ecc_corrected")
        uncorrected = field("ecc", "ecc_uncorrected")
        return DeviceSample(
            index=dev.index,
            uuid=uuid,
            name=name,
            memory_total_mb=total,
            memory_used_mb=used,
            memory_free_mb=free,
            utilization_percent=share("utilization", "utilization_percent"),
            temperature_c=field("temperature", "temperature_c"),
            temperature_slowdown_c=dev.number("temperature_slowdown_c") if thresholds_ok else None,
            temperature_shutdown_c=dev.number("temperature_shutdown_c") if thresholds_ok else None,
            power_watts=field("power", "power_mw", 0.001),
            power_limit_watts=field("power_limit", "power_limit_mw", 0.001),
            encoder_percent=share("encoder", "encoder_percent"),
            decoder_percent=share("decoder", "decoder_percent"),
            clocks_event_reasons=None if clocks is None else int(clocks),
            recovery_action=None if recovery is None else int(recovery),
            ecc_errors_corrected=None if corrected is None else int(corrected),
            ecc_errors_uncorrected=None if uncorrected is None else int(uncorrected),
            remapped_rows=rows,
            # as NVML is asked: page retirement only where the GPU has no row remapper
            retired_pages_pending=None if rows is not None or retired is None else bool(retired),
            processes=self._processes(dev, mine, graphics, mps),
            cpus=dev.cpus(),
        )

    @staticmethod
    def _processes(
        dev: _Device,
        compute: Sequence[GpuProcess],
        graphics: Sequence[GpuProcess],
        mps: Sequence[GpuProcess],
    ) -> tuple[GpuProcess, ...] | None:
        # as the NVML backend: a list the GPU does not have (not supported, no permission)
        # leaves the others; one failing otherwise (unknown, timeout) leaves the processes
        # unknown this tick, as the compute one failing does
        if dev.rc("processes") is not None:
            return None
        codes = (dev.rc("graphics_processes"), dev.rc("mps_processes"))
        if any(c is not None and c not in UNSUPPORTED_CODES for c in codes):
            return None
        return one_per_pid(
            (*compute, *(graphics if codes[0] is None else ()), *(mps if codes[1] is None else ()))
        )

    def _read_new_events(self) -> list[XidEvent]:
        path = self.world / "events"
        try:
            st = os.stat(path)
        except OSError:  # none yet
            return []
        # something that is not a file has nothing to read (open() of a FIFO blocks for good)
        if not stat.S_ISREG(st.st_mode) or st.st_size == self._events_offset:
            return []
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self._events_offset:  # truncated: start over
                    self._events_offset = 0
                    self._partial = b""
                fh.seek(self._events_offset)
                data = fh.read()
        except OSError:  # gone meanwhile, or a directory (IsADirectoryError)
            return []
        self._events_offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        uuids: dict[int, str | None] = {}
        out = []
        for raw in lines:
            parts = raw.split()
            if len(parts) != 2 or not all(p.isdigit() and len(p) <= MAX_DIGITS for p in parts):
                continue  # an overlong number: int() refuses thousands of digits
            index = int(parts[0])
            if index not in uuids:
                uuids[index] = self._uuid_at(index)
            out.append(XidEvent(index, uuids[index], int(parts[1]), self._clock()))
        return out

    def _uuid_at(self, index: int) -> str | None:
        """The UUID of the GPU that has ``index`` now (None: no such device file). Regression:
        the index was named from the devices at ``open()``, so after GPUs swapped indices an
        XID went to the GPU that had the index then (its workers restarted, it quarantined)."""
        try:
            with open(self.world / "gpus" / str(index), encoding="utf-8") as fh:
                return _Device(index, parse_kv(fh.read())).uuid
        except (OSError, UnicodeDecodeError):
            return None

    def wait_xid(self, timeout_s: float) -> list[XidEvent]:
        """Wait up to ``timeout_s`` for new lines in ``events``."""
        deadline = self._clock() + timeout_s
        while True:
            with self._events_lock:
                # closed meanwhile (the sampler re-opened): the next backend reads what comes
                # now (regression: both did, and each XID was acted on twice)
                events = [] if self._closed else self._read_new_events()
            if events or self._clock() >= deadline:
                return events
            time.sleep(min(XID_POLL_S, max(0.0, deadline - self._clock())))

    def xids_unwatched(self) -> Mapping[str, str]:
        """Every GPU's XIDs are read from ``events``."""
        return {}

    def close(self) -> None:
        """Read no more events (nothing else to release)."""
        with self._events_lock:
            self._closed = True
