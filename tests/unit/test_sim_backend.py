"""The sim backend against a real world directory."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from supervisor.backends.sim import RACY_WRITE_NS, SimBackend, default_uuid, write_atomic
from supervisor.model import clock_event_names

T = TypeVar("T")


def world(tmp_path: Path, live: set[int] | None = None) -> SimBackend:
    live = {os.getpid()} if live is None else live
    b = SimBackend(tmp_path, create_devices=2, pid_alive=lambda p: p in live)
    b.open()
    return b


def test_creates_default_devices(tmp_path: Path) -> None:
    b = SimBackend(tmp_path, create_devices=3)
    ids = b.open()
    assert [i.uuid for i in ids] == [default_uuid(i) for i in range(3)]
    assert all(i.memory_total_mb == 81920 for i in ids)
    assert SimBackend(tmp_path, create_devices=5).open() == ids  # existing world is kept
    # workers of any user ([[workers]] user) declare their memory there, as in /tmp
    assert stat.S_IMODE((tmp_path / "procs").stat().st_mode) == 0o1777


def test_memory_is_base_plus_live_processes(tmp_path: Path) -> None:
    b = world(tmp_path, live={100, 101})
    write_atomic(tmp_path / "gpus" / "0", "uuid GPU-a\nmemory_total_mib 1000\nmemory_base_mib 50\n")
    (tmp_path / "procs" / "100").write_text("GPU-a 200\n1 30\n")
    (tmp_path / "procs" / "101").write_text("0 10\n")
    (tmp_path / "procs" / "102").write_text("GPU-a 999\n")  # dead pid: ignored
    d0, d1 = b.sample()
    assert (d0.uuid, d0.memory_used_mb, d0.memory_free_mb) == ("GPU-a", 260.0, 740.0)
    assert sorted((p.pid, p.used_mb) for p in d0.processes or ()) == [(100, 200.0), (101, 10.0)]
    assert d1.memory_used_mb == 30.0
    (tmp_path / "procs" / "100").write_text("GPU-a 400\n")
    assert b.sample()[0].memory_used_mb == 460.0  # re-read every sample


def test_device_changes_are_seen_by_the_next_sample(tmp_path: Path) -> None:
    b = world(tmp_path)
    device = tmp_path / "gpus" / "0"
    write_atomic(device, "temperature_c 40\n")
    assert b.sample()[0].temperature_c == 40.0
    write_atomic(device, "temperature_c 41\n")  # same size, new inode
    assert b.sample()[0].temperature_c == 41.0
    device.write_text("temperature_c 42\n")  # in place, same size, within the mtime granularity
    assert b.sample()[0].temperature_c == 42.0
    old = time.time_ns() - 10 * RACY_WRITE_NS
    os.utime(device, ns=(old, old))  # settled: the parsed file is reused...
    assert b.sample()[0].temperature_c == 42.0
    device.write_text("temperature_c 43\n")  # ...until its mtime moves
    assert b.sample()[0].temperature_c == 43.0
    device.unlink()
    assert [d.index for d in b.sample()] == [1]


def test_not_available_memory_and_faults(tmp_path: Path) -> None:
    b = world(tmp_path, live={7})
    (tmp_path / "procs" / "7").write_text("0 na\n")
    write_atomic(
        tmp_path / "gpus" / "0",
        f"uuid {default_uuid(0)}\nrc_nvmlDeviceGetPowerUsage 3\nrc_nvmlDeviceGetUtilizationRates 4\n",
    )
    write_atomic(tmp_path / "gpus" / "1", f"uuid {default_uuid(1)}\nlost 1\n")
    d0, d1 = b.sample()
    assert d0.healthy
    assert d0.power_watts is None
    assert d0.utilization_percent is None
    assert d0.temperature_c == 40.0
    assert d0.processes is not None
    assert d0.processes[0].used_mb is None
    assert not d1.healthy
    assert d1.error == "GPU is lost"
    assert d1.memory_used_mb is None
    write_atomic(
        tmp_path / "gpus" / "1", f"uuid {default_uuid(1)}\nrc_nvmlDeviceGetMemoryInfo 15\n"
    )
    assert not b.sample()[1].healthy


def test_xid_events_are_delivered_once_and_old_ones_never(tmp_path: Path) -> None:
    (tmp_path / "events").write_text("0 79\n")
    b = world(tmp_path)
    assert b.wait_xid(0.01) == []
    with open(tmp_path / "events", "a") as fh:
        fh.write("1 13\n0 4")  # the last line is not complete yet
    got = b.wait_xid(0.5)
    assert [(e.gpu_index, e.uuid, e.xid) for e in got] == [(1, default_uuid(1), 13)]
    with open(tmp_path / "events", "a") as fh:
        fh.write("8\n")
    assert [e.xid for e in b.wait_xid(0.5)] == [48]
    assert b.wait_xid(0.01) == []


def test_a_closed_backend_reads_no_more_events(tmp_path: Path) -> None:
    """Regression: the sampler re-opens the backend (NVML down, a GPU missing) while the old
    one's XID wait still polls in its thread; the old one went on reading the events file, as
    did the new one from its open on, so each XID after the re-open was delivered twice (a
    worker restarted twice for one XID 13)."""
    old = world(tmp_path)
    with open(tmp_path / "events", "a") as fh:
        fh.write("0 13\n")
    assert [e.xid for e in old.wait_xid(0.5)] == [13]
    old.close()
    new = world(tmp_path)
    with open(tmp_path / "events", "a") as fh:
        fh.write("1 43\n")
    assert old.wait_xid(0.05) == []
    assert [(e.gpu_index, e.xid) for e in new.wait_xid(0.5)] == [(1, 43)]


def test_clock_event_names() -> None:
    assert clock_event_names(None) is None
    assert clock_event_names(0x1 | 0x20 | 0x4000_0000) == (
        "gpu_idle",
        "sw_thermal_slowdown",
        "0x40000000",
    )


def test_figures_that_are_no_numbers_are_not_read_as_any(tmp_path: Path) -> None:
    """Regression: ``inf``, ``nan``, ``1e400`` in a device or process file were published as
    they were, and the supervisor died writing state.json (strict JSON); negative memory was
    published too (a GPU with more free memory than it has). Now such a figure is not there,
    as a field NVML cannot read."""
    b = world(tmp_path, live={7, 8})
    write_atomic(
        tmp_path / "gpus" / "0",
        f"uuid {default_uuid(0)}\nmemory_total_mib inf\ntemperature_c nan\npower_mw 1e400\n",
    )
    write_atomic(
        tmp_path / "gpus" / "1",
        f"uuid {default_uuid(1)}\nmemory_total_mib 1000\nmemory_base_mib -5000\n"
        "utilization_percent -3\n",
    )
    (tmp_path / "procs" / "7").write_text("0 nan\n1 1e400\n1 20\n")
    (tmp_path / "procs" / "8").write_text("1 -inf\n")
    (tmp_path / "procs" / "99999999999999999999999").write_text("1 20\n")  # no such pid
    d0, d1 = b.sample()
    assert (d0.memory_total_mb, d0.temperature_c, d0.power_watts) == (None, None, None)
    assert (d1.memory_used_mb, d1.memory_free_mb, d1.utilization_percent) == (20.0, 980.0, None)
    assert [(p.pid, p.used_mb) for p in d1.processes or ()] == [(7, 20.0)]


def test_an_events_path_that_is_no_file_is_no_events(tmp_path: Path) -> None:
    """Regression: ``mkdir sim/events`` ended the supervisor (IsADirectoryError)."""
    b = world(tmp_path)
    (tmp_path / "events").mkdir()
    assert b.wait_xid(0.01) == []


def test_device_files_are_named_by_ascii_digits_only(tmp_path: Path) -> None:
    """A file named "²" in gpus/ (str.isdigit() says yes, int() says no) is not a device.
    Regression: the backend's listing raised ValueError at every sample."""
    b = world(tmp_path)
    (tmp_path / "gpus" / "\u00b2").write_text("uuid GPU-x\n")
    (tmp_path / "gpus" / "\u0663").write_text("uuid GPU-y\n")  # int() reads it as 3
    assert [d.index for d in b.sample()] == [0, 1]


def test_process_files_are_named_by_ascii_digits_only(tmp_path: Path) -> None:
    """A file named "²" in the world-writable procs/ (str.isdigit() says yes, int() says no)
    is no process. Regression: the sample raised ValueError and the supervisor exited,
    ending every worker."""
    b = world(tmp_path, live={3, 7})
    (tmp_path / "procs" / "\u00b2").write_text("0 100\n")
    (tmp_path / "procs" / "\u0663").write_text("0 100\n")  # int() reads it as 3
    (tmp_path / "procs" / "7").write_text("0 10\n")
    assert [(p.pid, p.used_mb) for p in b.sample()[0].processes or ()] == [(7, 10.0)]


def returns_past_a_fifo(call: Callable[[], T], fifo: Path) -> T:
    """``call()``'s result, which must come within 2 s although ``fifo`` is where it reads
    (if it hangs in open(), the FIFO is opened for writing to let it go, and the test fails)."""
    got: list[T] = []
    thread = threading.Thread(target=lambda: got.append(call()), daemon=True)
    thread.start()
    thread.join(2.0)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(2.0)
        raise AssertionError(f"it hung on the FIFO {fifo}")
    return got[0]


def test_a_process_file_that_is_no_regular_file_does_not_hang_the_sample(tmp_path: Path) -> None:
    """Regression: a FIFO named as a live pid in procs/ (world-writable) blocked the sample
    in open() for good: GPU telemetry down until the supervisor was restarted, and
    ``gpu-supervisor gpus`` never returned."""
    b = world(tmp_path)
    fifo = tmp_path / "procs" / str(os.getpid())
    os.mkfifo(fifo)
    (tmp_path / "procs" / "1").mkdir()
    assert all(d.processes == () for d in returns_past_a_fifo(b.sample, fifo))


def test_an_xid_line_with_an_overlong_number_is_skipped(tmp_path: Path) -> None:
    """Regression: an events line with a number of thousands of digits raised ValueError
    (Python's limit on int() of long strings) out of the XID wait: the supervisor exited.
    Now the line is skipped and the lines after it are delivered."""
    b = world(tmp_path)
    with open(tmp_path / "events", "a") as fh:
        fh.write(f"0 {'9' * 5000}\n{'1' * 5000} 13\n0 79\n")
    assert [(e.gpu_index, e.xid) for e in b.wait_xid(0.5)] == [(0, 79)]


def test_percentages_out_of_range_are_not_read_as_any(tmp_path: Path) -> None:
    """A utilization of 4294967295 % (an unsigned -1: a sentinel, not a reading) was
    published as such: now it is null, as a field that cannot be read."""
    b = world(tmp_path)
    write_atomic(
        tmp_path / "gpus" / "0",
        f"uuid {default_uuid(0)}\nutilization_percent 4294967295\nencoder_percent 101\n"
        "decoder_percent 100\n",
    )
    d0 = b.sample()[0]
    assert (d0.utilization_percent, d0.encoder_percent, d0.decoder_percent) == (None, None, 100.0)


def test_an_events_file_replaced_by_a_fifo_does_not_hang_the_xid_wait(tmp_path: Path) -> None:
    """Regression: an ``events`` file that had lines, replaced by a FIFO, blocked the XID
    wait in open() for good (XIDs no longer watched)."""
    b = world(tmp_path)
    events = tmp_path / "events"
    events.write_text("0 13\n")
    assert [e.xid for e in b.wait_xid(0.01)] == [13]
    events.unlink()
    os.mkfifo(events)
    assert returns_past_a_fifo(lambda: b.wait_xid(0.01), events) == []


def test_identity_faults_written_after_open_leave_an_opened_gpu_as_it_was(tmp_path: Path) -> None:
    """Regression: the sim backend read the handle, UUID and name fault keys at every sample,
    where the nvml backend reads a GPU's handle and UUID once, at ``open()`` (its handle is
    kept; only one that failed there is asked again): a ``rc_nvmlDeviceGetHandleByIndex 4``
    written while the supervisor ran dropped GPU 1 from the sample (taken for lost, unlisted:
    quarantined, its workers drained), a ``rc_nvmlDeviceGetUUID 15`` made it lost, ``999`` an
    ``unknown-1`` placeholder."""
    b = world(tmp_path)
    gpu1 = tmp_path / "gpus" / "1"
    listed = gpu1.read_text()
    for fault in (
        "rc_nvmlDeviceGetHandleByIndex 4",
        "rc_nvmlDeviceGetUUID 15",
        "rc_nvmlDeviceGetUUID 999",
        "rc_nvmlDeviceGetHandleByIndex 9",
    ):
        write_atomic(gpu1, f"{listed}{fault}\n")
        got = [(d.index, d.uuid, d.healthy) for d in b.sample()]
        assert got == [(0, default_uuid(0), True), (1, default_uuid(1), True)], fault
    # a GPU that failed at open is asked again at each sample, and identified once it answers
    write_atomic(gpu1, f"{listed}rc_nvmlDeviceGetUUID 999\n")
    b.close()
    assert [i.uuid for i in b.open()] == [default_uuid(0), "unknown-1"]
    assert b.sample()[1].uuid == "unknown-1"
    write_atomic(gpu1, listed)
    assert b.sample()[1].uuid == default_uuid(1)
    write_atomic(gpu1, f"{listed}rc_nvmlDeviceGetUUID 15\n")
    assert (b.sample()[1].uuid, b.sample()[1].healthy) == (default_uuid(1), True)
