"""Records without a supervisor: atomic writes, the post-mortem store, write-failure tracking,
the journal, crash classification and the orphan verdicts."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import psutil
import pytest
from structlog.testing import capture_logs

from supervisor import procfs
from supervisor.journal import Journal, rfc3339
from supervisor.model import DeviceSample, ExitReason, ExitStatus, GpuProcess
from supervisor.policy.classify import classify
from supervisor.policy.reclaim import Candidate, Live, Verdict, candidates, judge, marked
from supervisor.records import (
    TMP_PREFIX,
    PostmortemStore,
    Recorder,
    WriteHealth,
    atomic_write,
    failure_kind,
    lock_state_dir,
    read_quarantine,
    remove_temp_files,
    write_lock_pid,
    write_quarantine,
)
from supervisor.views import (
    SamplePoint,
    StateWorker,
    WorkerFacts,
    device_object,
    postmortem_doc,
    postmortem_id,
    redact_argv,
    state_doc,
)
from tests.schemas import validate

T0 = 1_796_000_000.25


def test_atomic_write_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    atomic_write(target, b"old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_atomic_write_failure_keeps_nothing_half_written(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "gone" / "state.json", b"x")
    assert not (tmp_path / "gone").exists()


def test_atomic_write_where_directories_cannot_be_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: on a filesystem whose directories cannot be fsynced (EINVAL: some network,
    FUSE and shared-folder filesystems) every write raised after its rename, so a post-mortem
    in place counted as failed and was written again every 5 s under a new name."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "state.json"
    atomic_write(target, b"new\n")
    assert target.read_bytes() == b"new\n"

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="I/O error"):  # a real failure still is one
        atomic_write(target, b"newer\n")


def test_remove_temp_files_only_removes_ours(tmp_path: Path) -> None:
    (tmp_path / f"{TMP_PREFIX}state.json.123.tmp").write_text("torn")
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "notes.tmp").write_text("not ours")
    assert remove_temp_files(tmp_path) == 1
    assert sorted(os.listdir(tmp_path)) == ["notes.tmp", "state.json"]


def _pm(ended: float, worker: str = "gpen-1", reason: str = "exit") -> dict[str, Any]:
    return postmortem_doc(
        id_=postmortem_id(ended, worker, reason),
        worker=WorkerFacts(
            worker, "gpen", 1, 42, ("python", "x.py"), ("GPU-a",), 8002, ended - 5, ended, 3
        ),
        status=ExitStatus(code=None, signal=signal.SIGSEGV),
        reason=reason,
        evidence={"signal": "SIGSEGV"},
        samples=[
            SamplePoint(ended - 1, 100.0, 50.5, 12.0),
            SamplePoint(ended - 0.5, None, None, None),
        ],
        devices=[],
        log_tail=["a", "b"],
        events=Journal().since(0),
    )


def _exit_4(worker: WorkerFacts) -> dict[str, Any]:
    """The post-mortem of ``worker`` (``w-0``) ended by exit code 4 at ``T0``, nothing else."""
    return postmortem_doc(
        id_=postmortem_id(T0, "w-0", "exit"),
        worker=worker,
        status=ExitStatus(code=4, signal=None),
        reason="exit",
        evidence={},
        samples=[],
        devices=[],
        log_tail=[],
        events=Journal().since(0),
    )


def test_postmortem_document_matches_its_schema() -> None:
    doc = _pm(T0)
    validate(doc, "postmortem.schema.json")
    assert doc["worker"]["uptime_s"] == 5.0
    assert doc["exit"] == {"code": None, "signal": 11, "signal_name": "SIGSEGV"}


def test_postmortem_uptime_is_the_monotonic_one() -> None:
    """Regression: uptime_s was ended_at - started_at on the wall clock: 0 after a step back
    of the clock while the process ran, hours after a step forward."""
    stepped = WorkerFacts("w-0", "w", 0, 42, ("x",), None, None, T0, T0 - 3600, 0, uptime_s=6.0)
    doc = _exit_4(stepped)
    assert doc["worker"]["uptime_s"] == 6.0


def test_postmortem_rejects_unknown_reason() -> None:
    with pytest.raises(ValueError, match="unknown post-mortem reason"):
        _pm(T0, reason="stop")


@pytest.mark.parametrize(
    "worker",
    ["gpen-1", 'a/b\\c:d*e?f"g<h>i|j', "x" * 300, "Ünïcødé-0", "..", ""],
)
def test_postmortem_ids_are_safe_file_names(worker: str) -> None:
    id_ = postmortem_id(T0, worker, "exit")
    assert id_.startswith("20261130T0053")  # sortable UTC time first
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in id_)
    assert len(id_) < 200 and "/" not in id_
    PostmortemStore(Path("/nonexistent"), 1).path_of(id_)  # accepted by the store


def test_postmortem_id_rounds_microseconds_without_overflow() -> None:
    assert postmortem_id(1_796_000_000.9999999, "w", "exit").startswith("20261130T0053") and (
        ".000000Z" in postmortem_id(1_796_000_000.9999999, "w", "exit")
    )


def test_store_keeps_the_newest_and_lists_newest_first(tmp_path: Path) -> None:
    store = PostmortemStore(tmp_path / "pm", keep=3)
    with pytest.raises(FileNotFoundError):  # the recorder makes the directory, and says so
        store.write(_pm(T0))
    store.directory.mkdir()
    ids = [store.write(_pm(T0 + i)) for i in range(5)]
    assert store.ids() == list(reversed(ids[2:]))
    assert [s["id"] for s in store.summaries()] == list(reversed(ids[2:]))
    assert store.summaries(limit=1)[0]["reason"] == "exit"


def test_pruning_never_deletes_the_post_mortem_just_written(tmp_path: Path) -> None:
    """Post-mortems dated later (written before the clock was set back) do not make every new
    one vanish as it is written; the directory still holds ``keep``."""
    store = PostmortemStore(tmp_path, keep=3)
    later = [store.write(_pm(T0 + 10_000 + i)) for i in range(3)]
    new = store.write(_pm(T0))
    assert new in store.ids() and len(store.ids()) == 3
    assert set(store.ids()) == {new, *later[1:]}


HOUR = 3600.0


def _files(store: PostmortemStore) -> set[str]:
    return {p.name[: -len(".json")] for p in store.directory.glob("*.json")}


def test_a_clock_stepped_back_does_not_make_pruning_delete_the_newest(tmp_path: Path) -> None:
    """Regression: pruning went by the wall-clock time in the ids, so with the clock set back
    an hour the post-mortems written since sorted oldest and were deleted (all but the one
    just written) while older ones stayed."""
    store = PostmortemStore(tmp_path, keep=3)
    before = [store.write(_pm(T0 + i)) for i in range(3)]
    after = [store.write(_pm(T0 - HOUR + i, worker=f"w-{i}")) for i in range(3)]  # stepped
    assert store.ids() == list(reversed(after))  # newest first, in the order written
    assert _files(store) == set(after) and not _files(store) & set(before)
    assert [s["id"] for s in store.summaries()] == store.ids()  # the API's listing


def test_a_clock_stepped_forward_does_not_outrank_later_post_mortems(tmp_path: Path) -> None:
    """Regression: files written while the clock was an hour ahead outranked every later
    one for an hour after the clock was corrected, and the later ones were deleted."""
    store = PostmortemStore(tmp_path, keep=3)
    ahead = [store.write(_pm(T0 + HOUR + i)) for i in range(2)]
    corrected = [store.write(_pm(T0 + i, worker=f"w-{i}")) for i in range(4)]
    assert store.ids() == list(reversed(corrected[1:]))
    assert _files(store) == set(corrected[1:]) and not _files(store) & set(ahead)
    assert store.summaries(limit=1)[0]["id"] == corrected[-1]


def test_post_mortems_of_an_earlier_run_rank_below_this_runs(tmp_path: Path) -> None:
    """Files found on disk (an earlier supervisor's) are older than any this store wrote,
    ordered by their ids among themselves, and are the first to be pruned."""
    earlier = PostmortemStore(tmp_path, keep=10)
    old = [earlier.write(_pm(t)) for t in (T0 + HOUR, T0 - HOUR, T0 + 2 * HOUR)]
    store = PostmortemStore(tmp_path, keep=4)  # the next supervisor, its clock set back
    assert store.ids() == sorted(old, reverse=True)  # by name: no write order known
    new = [store.write(_pm(T0 - 2 * HOUR + i, worker="n")) for i in range(2)]
    assert store.ids() == [*reversed(new), old[2], old[0]]  # old[1] (named oldest) pruned
    new.append(store.write(_pm(T0 - 3 * HOUR, worker="n")))
    assert store.ids() == [*reversed(new), old[2]]
    assert _files(store) == {*new, old[2]}


def test_store_never_overwrites_a_same_named_post_mortem(tmp_path: Path) -> None:
    store = PostmortemStore(tmp_path, keep=10)
    first, second = store.write(_pm(T0)), store.write(_pm(T0))
    assert second == first + "-2"
    assert store.read(second)["id"] == second


async def test_an_entry_pruning_cannot_remove_does_not_hold_up_the_post_mortems(
    tmp_path: Path,
) -> None:
    """Something in postmortems/ named like an old post-mortem that cannot be deleted (a
    directory, an immutable file). Regression: the write that pruned it was taken for a failed
    one: the post-mortem stayed queued and was written again under a new name every 5 s,
    and every later post-mortem waited behind it for ever."""
    (tmp_path / "postmortems").mkdir()
    stuck = tmp_path / "postmortems" / "20200101T000000.000000Z-x-exit.json"
    stuck.mkdir()
    recorder = Recorder(tmp_path, 2, WriteHealth(), snapshot=dict)
    ids = [postmortem_id(T0 + i, "w-0", "exit") for i in range(3)]
    with capture_logs() as logs:
        for id_ in ids:
            recorder.postmortem({"id": id_})
            await recorder._write_postmortems()
    assert recorder._pending == [] and recorder.health.problems() == {}
    assert recorder.store.ids() == [ids[2], ids[1], stuck.stem]
    said = [e for e in logs if e["event"] == "records.postmortem_not_pruned"]
    assert len(said) == 1 and said[0]["path"] == str(stuck), logs


def test_store_read_refuses_paths_and_skips_unreadable_files(tmp_path: Path) -> None:
    store = PostmortemStore(tmp_path, keep=10)
    good = store.write(_pm(T0))
    (tmp_path / "20261130T000000.000000Z-bad-exit.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a post-mortem id"):
        store.read("../state")
    with pytest.raises(FileNotFoundError):
        store.read("20261130T000000.000000Z-none-exit")
    assert [s["id"] for s in store.summaries()] == [good]


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (errno.ENOSPC, "disk_full"),
        (errno.EDQUOT, "disk_full"),
        (errno.EROFS, "read_only"),
        (errno.ENOENT, "missing"),
        (errno.EACCES, "permission"),
        (errno.EIO, "other"),
    ],
)
def test_failure_kinds(code: int, kind: str) -> None:
    assert failure_kind(OSError(code, os.strerror(code))) == kind


def test_write_failures_are_logged_once_per_kind_and_recover() -> None:
    health = WriteHealth()
    full = OSError(errno.ENOSPC, "No space left on device")
    with capture_logs() as logs:
        for _ in range(5):
            health.failed("state", full)
        health.failed("state", OSError(errno.EROFS, "Read-only file system"))
        health.ok("state")
        health.ok("state")
    assert [(e["event"], e.get("kind")) for e in logs] == [
        ("records.write_failed", "disk_full"),
        ("records.write_failed", "read_only"),
        ("records.write_recovered", "read_only"),
    ]
    assert health.errors_total == {("state", "disk_full"): 5, ("state", "read_only"): 1}
    assert health.problems() == {}


def test_write_failure_duration_ignores_a_step_of_the_wall_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``records.write_recovered``'s ``failed_for_s`` was the difference of two
    wall-clock readings: NTP stepping the clock back an hour while the disk was full made a
    2 s failure read -3598 s (a step forward, hours). It is measured on the monotonic clock;
    ``since`` (when it began, for people) stays wall-clock time."""
    clocks = {"wall": T0, "mono": 500.0}
    fake_time = SimpleNamespace(time=lambda: clocks["wall"], monotonic=lambda: clocks["mono"])
    monkeypatch.setattr("supervisor.records.time", fake_time)
    health = WriteHealth()
    with capture_logs() as logs:
        health.failed("state", OSError(errno.ENOSPC, "No space left on device"))
        assert health.problems()["state"]["since"] == T0
        clocks["wall"] -= 3600.0  # chrony steps the clock back
        clocks["mono"] += 2.0
        health.ok("state")
    recovered = [e for e in logs if e["event"] == "records.write_recovered"]
    assert [e["failed_for_s"] for e in recovered] == [2.0]


def test_write_failures_taking_turns_between_kinds_are_each_said_once_a_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk failing now full, now with I/O errors, in turn: each kind said once a minute,
    the flaps between them at debug (they were each said at error: only the last kind said
    was remembered)."""
    clock = {"mono": 100.0}
    monkeypatch.setattr(
        "supervisor.records.time", SimpleNamespace(time=lambda: T0, monotonic=lambda: clock["mono"])
    )
    health = WriteHealth()
    full = OSError(errno.ENOSPC, "No space left on device")
    broken = OSError(errno.EIO, "Input/output error")
    with capture_logs() as logs:
        for _ in range(20):  # 20 s of taking turns
            health.failed("state", full)
            clock["mono"] += 0.5
            health.failed("state", broken)
            clock["mono"] += 0.5
    loud = [
        e["kind"]
        for e in logs
        if e["event"] == "records.write_failed" and e["log_level"] != "debug"
    ]
    assert loud == ["disk_full", "other"], loud


def test_a_write_failure_that_comes_and_goes_is_said_once_a_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: on a full state_dir where something keeps taking the space back (a worker's
    log giving up its space, then filling it again), state.json's writes failed and worked in
    turn: records.write_failed (error) and records.write_recovered twice a second for as long
    as the disk stayed full. A failure of the same file and kind within a minute of the last
    one said is now said at debug (with its recovery); one that lasts is said again, at error,
    a minute after the last; another kind is said at once."""
    clock = {"mono": 100.0}
    monkeypatch.setattr(
        "supervisor.records.time", SimpleNamespace(time=lambda: T0, monotonic=lambda: clock["mono"])
    )
    health = WriteHealth()
    full = OSError(errno.ENOSPC, "No space left on device")
    with capture_logs() as logs:
        for _ in range(100):  # 50 s of failing and working in turn
            health.failed("state", full)
            clock["mono"] += 0.25
            health.ok("state")
            clock["mono"] += 0.25
        assert health.problems() == {}
        health.failed("state", full)  # and now it lasts
        assert "state" in health.problems()
        clock["mono"] += 30.0
        health.failed("state", full)  # a minute after the last said: said again
        health.failed("state", OSError(errno.EROFS, "Read-only file system"))  # another kind
        health.ok("state")
        clock["mono"] += 120.0
        health.failed("log", full)
        health.ok("log")
        health.failed("log", full)  # back within the minute, and it lasts with no new write:
        clock["mono"] += 59.0
        health.lasting("log")  # (the runtime's retries say so)
        clock["mono"] += 1.0
        health.lasting("log")
        health.lasting("log")
    loud = [(e["event"], e.get("kind")) for e in logs if e["log_level"] != "debug"]
    assert loud == [
        ("records.write_failed", "disk_full"),
        ("records.write_recovered", "disk_full"),
        ("records.write_failed", "disk_full"),
        ("records.write_failed", "read_only"),
        ("records.write_recovered", "read_only"),
        ("records.write_failed", "disk_full"),
        ("records.write_recovered", "disk_full"),
        ("records.write_failed", "disk_full"),
    ]
    quiet = [e for e in logs if e["log_level"] == "debug"]
    assert len(quiet) == 2 * 99 + 1 + 1
    assert health.errors_total == {
        ("state", "disk_full"): 102,
        ("state", "read_only"): 1,
        ("log", "disk_full"): 2,
    }


async def test_post_mortems_left_unwritten_at_exit_are_said(tmp_path: Path) -> None:
    """A state_dir that takes no post-mortem by the time the supervisor exits (full, read-only):
    what is still queued is logged with its ids, not lost silently."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "postmortems").write_text("not a directory")  # every post-mortem write fails
    recorder = Recorder(state, 10, WriteHealth(), snapshot=dict)
    ids = [postmortem_id(T0, "w-0", "exit"), postmortem_id(T0 + 1, "w-0", "exit")]
    for id_ in ids:
        recorder.postmortem({"id": id_})
    with capture_logs() as logs:
        await recorder.flush()
        assert recorder.report_unwritten() == 2
    said = [e for e in logs if e["event"] == "records.postmortems_unwritten"]
    assert said and said[0]["count"] == 2 and said[0]["ids"] == ids


async def test_a_burst_of_post_mortems_on_a_writable_disk_is_written_whole(
    tmp_path: Path,
) -> None:
    """Regression: the queue of post-mortems waiting to be written dropped its oldest beyond
    100 even on a disk that took every write ("too many post-mortems waiting for a writable
    state_dir"): 64 workers crash-looping together (a bad deploy, a host-wide fault) queue
    more than that before the writer thread catches up, and about two thirds of their
    post-mortems, the first crash's among them, were lost. The bound holds only while the
    disk fails; on a working disk only what retention (``postmortem_keep``) would prune at
    once is left out."""
    state = tmp_path / "state"
    state.mkdir()
    recorder = Recorder(state, 200, WriteHealth(), snapshot=dict)
    ids = [postmortem_id(T0 + i / 1000, f"w-{i}", "exit") for i in range(150)]
    with capture_logs() as logs:
        for id_ in ids:  # one loop turn: the writer has not run yet
            recorder.postmortem({"id": id_})
        await recorder.flush()
    assert [e for e in logs if e["event"] == "records.postmortem_dropped"] == []
    assert sorted(p.stem for p in (state / "postmortems").glob("*.json")) == sorted(ids)
    # beyond postmortem_keep the oldest go, as retention would delete them once written
    recorder = Recorder(tmp_path / "small", 5, WriteHealth(), snapshot=dict)
    (tmp_path / "small").mkdir()
    for id_ in ids[:20]:
        recorder.postmortem({"id": id_})
    await recorder.flush()
    assert sorted(p.stem for p in (tmp_path / "small" / "postmortems").glob("*.json")) == ids[15:20]


async def test_a_post_mortem_dropped_while_the_oldest_is_written_is_the_one_said(
    tmp_path: Path,
) -> None:
    """Regression: when the queue was full while the writer thread wrote its oldest
    post-mortem, that one (being written, and then written) was the one dropped and said
    (``records.postmortem_dropped``); the writer then took the next one off the queue as the
    one it had written, so that one was lost without a word."""
    import threading

    state = tmp_path / "state"
    state.mkdir()
    recorder = Recorder(state, 100, WriteHealth(), snapshot=dict)
    writing, release = threading.Event(), threading.Event()
    write = recorder._write_postmortem

    def slow_write(doc: dict[str, Any]) -> bool:
        if not writing.is_set():
            writing.set()
            release.wait(2.0)
        return write(doc)

    recorder._write_postmortem = slow_write  # type: ignore[method-assign]
    ids = [postmortem_id(T0 + i / 1000, f"w-{i}", "exit") for i in range(101)]
    recorder.postmortem({"id": ids[0]})
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(recorder._write_postmortems)
            assert await anyio.to_thread.run_sync(writing.wait, 2.0)
            for id_ in ids[1:]:  # the queue fills while the oldest is being written
                recorder.postmortem({"id": id_})
            release.set()
        await recorder.flush()
    dropped = {e["id"] for e in logs if e["event"] == "records.postmortem_dropped"}
    written = {p.stem for p in (state / "postmortems").glob("*.json")}
    assert len(dropped) == 1
    assert not dropped & written
    assert written | dropped == set(ids)


async def test_post_mortems_waiting_for_a_failing_disk_stay_bounded(tmp_path: Path) -> None:
    """While post-mortem writes fail, at most 100 wait in memory (the oldest are dropped, and
    said)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "postmortems").write_text("not a directory")  # every post-mortem write fails
    recorder = Recorder(state, 1000, WriteHealth(), snapshot=dict)
    recorder.postmortem({"id": postmortem_id(T0, "w-0", "exit")})
    await recorder.flush()
    assert "postmortem" in recorder.health.failing
    with capture_logs() as logs:
        for i in range(150):
            recorder.postmortem({"id": postmortem_id(T0 + 1 + i, "w-0", "exit")})
    assert len(recorder._pending) == 100
    assert len([e for e in logs if e["event"] == "records.postmortem_dropped"]) == 51


def test_a_state_dir_made_again_behind_the_recorders_back_counts_as_recreated(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    recreated: list[bool] = []
    recorder = Recorder(
        state, 10, WriteHealth(), snapshot=dict, on_dir_recreated=lambda: recreated.append(True)
    )
    with capture_logs() as logs:  # never seen with its post-mortem directory: made, no alarm
        assert recorder._check_dir() is False and (state / "postmortems").is_dir()
    assert logs == []
    assert recorder._check_dir() is False
    shutil.rmtree(state)
    (state / "logs").mkdir(parents=True)  # a worker's log file creates its directory first
    with capture_logs() as logs:
        assert recorder._check_dir() is True
    assert [e["event"] for e in logs] == ["records.state_dir_recreated"]
    assert (state / "postmortems").is_dir()
    recorder._after_thread()
    assert recreated == [True]  # the runtime binds the notify socket again
    assert recorder._check_dir() is False
    shutil.rmtree(state)  # plainly removed
    assert recorder._check_dir() is True and state.is_dir()


async def test_a_state_dir_that_cannot_be_looked_at_is_a_failed_write_not_a_crash(
    tmp_path: Path,
) -> None:
    """Regression: the recorder's check of state_dir (every 5 s) let an error other than "no
    such file" out of ``stat`` (EACCES: state_dir's mode or owner changed under a supervisor
    that does not run as root; EIO: a failing disk), and the supervisor crashed, taking every
    worker with it. It is a failed write of ``state`` now, said and retried. (A name too long
    for the filesystem gives such an error here, where the tests may run as root.)"""
    state = tmp_path / ("x" * 300)
    recorder = Recorder(state, 10, WriteHealth(), snapshot=dict)
    with capture_logs() as logs:
        await recorder._step()
    assert recorder.health.problems()["state"]["kind"] == "other", logs
    assert [e["event"] for e in logs] == ["records.write_failed"]


def test_journal_sequence_and_per_worker_view() -> None:
    j = Journal(size=3)
    for i in range(5):
        j.append(T0 + i, "worker.state", f"w-{i % 2}", new="ready")
    assert [e.seq for e in j.since(0)] == [3, 4, 5]
    assert [e.seq for e in j.since(4)] == [5]
    assert [e.seq for e in j.for_worker("w-0", 5)] == [3, 5]
    assert j.since(3, limit=1)[0].to_json() == {
        "seq": 4,
        "at": rfc3339(T0 + 3),
        "type": "worker.state",
        "worker": "w-1",
        "new": "ready",
    }


CLASSIFY_ROWS = [
    # reason, status, tail, expected reason (None: no post-mortem)
    (ExitReason.EXIT, ExitStatus(3, None), ["bye"], "exit"),
    (ExitReason.SIGNAL, ExitStatus(None, 11), [], "signal"),
    (
        ExitReason.EXIT,
        ExitStatus(1, None),
        ["torch.OutOfMemoryError: CUDA out of memory. Tried"],
        "cuda_oom",
    ),
    (ExitReason.SIGNAL, ExitStatus(None, 6), ["CUDA error: out of memory"], "cuda_oom"),
    (ExitReason.HANG, ExitStatus(None, 15), [], "hang"),
    (ExitReason.START_TIMEOUT, ExitStatus(None, 9), [], "start_timeout"),
    # an operator's drain is no death (regression: a preStop drain wrote one per pod stop),
    # unless the worker died otherwise while it drained; one forced after drain_timeout_s is
    (ExitReason.DRAIN, ExitStatus(0, None), [], None),
    (ExitReason.DRAIN, ExitStatus(None, 10), [], None),  # its drain signal (SIGUSR1) ended it
    (ExitReason.DRAIN, ExitStatus(None, 11), [], "signal"),  # a SIGSEGV while it drained
    (ExitReason.DRAIN, ExitStatus(1, None), ["CUDA error: out of memory"], "cuda_oom"),
    (ExitReason.STOP, ExitStatus(0, None), [], None),
    (ExitReason.SHUTDOWN, ExitStatus(None, 15), [], None),
    (ExitReason.RELOAD, ExitStatus(0, None), [], None),
    (ExitReason.RESTART, ExitStatus(0, None), [], None),
    (ExitReason.SPAWN_FAILED, None, [], None),
]


@pytest.mark.parametrize(("reason", "status", "tail", "want"), CLASSIFY_ROWS)
def test_classify(
    reason: ExitReason, status: ExitStatus | None, tail: list[str], want: str | None
) -> None:
    found = classify(
        reason,
        status,
        tail,
        failure=False,
        timing={"watchdog_s": 2.0},
        silent_for_s=2.5,
        drain_signal=10,
    )
    assert (found and found.reason) == want
    if reason is ExitReason.DRAIN and found is not None:
        assert found.evidence["while"] == "drain"
    if want == "cuda_oom":
        assert found is not None and "out of memory" in found.evidence["log_line"]
    if want == "hang":
        assert found is not None and found.evidence["watchdog_s"] == 2.0
        assert found.evidence["silent_for_s"] == 2.5


def test_a_drain_forced_after_its_timeout_gets_a_drain_post_mortem() -> None:
    found = classify(
        ExitReason.DRAIN,
        ExitStatus(None, 15),
        [],
        failure=False,
        timing={"drain_timeout_s": 30.0},
        drain_timed_out=True,
    )
    assert found is not None and found.reason == "drain"
    assert found.evidence["drain_timeout_s"] == 30.0


def test_reclaim_candidates_skip_malformed_entries() -> None:
    doc = {
        "workers": [
            {
                "name": "a-0",
                "pid": 10,
                "pid_create_time": 5.0,
                "tree": [{"pid": 11, "create_time": 6.0}, {"pid": "x"}],
            },
            {"name": "b-0", "pid": None, "pid_create_time": None},
            {"name": "c-0", "pid": True, "pid_create_time": 1.0},
            {"name": "d-0", "pid": 1, "pid_create_time": 1.0},
            {"pid": 12, "pid_create_time": 1.0},
            "garbage",
        ]
    }
    assert candidates(doc) == [Candidate("a-0", 10, 5.0, True), Candidate("a-0", 11, 6.0, False)]
    assert candidates({"workers": "nope"}) == []


@pytest.mark.parametrize(
    ("live", "verdict"),
    [
        (None, Verdict.GONE),
        (Live(10, 100.0, 1), Verdict.END),
        (Live(10, 100.01, 1), Verdict.END),  # one clock tick of rounding
        (Live(10, 101.0, 1), Verdict.REUSED),
        (Live(10, 99.0, 1), Verdict.REUSED),
        (Live(10, 100.0, 777), Verdict.OURS),  # our child
        (Live(777, 100.0, 1), Verdict.OURS),  # ourselves
    ],
)
def test_reclaim_verdicts(live: Live | None, verdict: Verdict) -> None:
    assert judge(Candidate("w-0", 10, 100.0, True), live, own_pid=777) is verdict


@pytest.mark.parametrize(
    ("cand", "live", "verdict"),
    [
        # the wall clock was stepped 3 s between the two readings: the ticks decide
        (Candidate("w-0", 10, 100.0, True, start_ticks=5000), Live(10, 103.0, 1, 5000), "end"),
        (Candidate("w-0", 10, 100.0, True, start_ticks=5000), Live(10, 100.0, 1, 5300), "reused"),
        (Candidate("w-0", 10, 100.0, True, start_ticks=5000), Live(10, 100.0, 1, 5001), "end"),
        # our marker in its environment: one of ours whatever the times say
        (Candidate("w-0", 10, 100.0, True), Live(10, 103.0, 1, None, marked=True), "end"),
        (Candidate("w-0", 10, 100.0, True, other_boot=True), Live(10, 100.0, 1), "gone"),
        (
            Candidate("w-0", 10, 100.0, True, other_boot=True),
            Live(10, 100.0, 1, marked=True),
            "end",
        ),
        (Candidate("w-0", 10, 100.0, True), Live(10, 100.0, 777, marked=True), "ours"),
    ],
)
def test_reclaim_verdicts_survive_clock_steps(cand: Candidate, live: Live, verdict: str) -> None:
    """Regression: a clock step while the killed supervisor ran (its boot time read once,
    psutil's read again) made every recorded orphan "reused", left running with its GPU memory
    and port, and the marker in its environment was not looked at for recorded pids."""
    assert judge(cand, live, own_pid=777).value == verdict


def test_reclaim_candidates_carry_ticks_from_the_records_boot_time() -> None:
    doc = {
        "supervisor": {"boot_time": 1000.0, "boot_id": "b1"},
        "workers": [{"name": "a-0", "pid": 10, "pid_create_time": 1050.25}],
    }
    assert candidates(doc, "b1", hz=100) == [Candidate("a-0", 10, 1050.25, True, 5025)]
    assert candidates(doc, "b2", hz=100) == [Candidate("a-0", 10, 1050.25, True, None, True)]
    assert candidates(doc, "", hz=100) == [Candidate("a-0", 10, 1050.25, True)]  # unknown now


def test_reclaim_candidates_never_fail_on_numbers_out_of_range() -> None:
    """Regression: a state.json with a create time or boot time that is no finite number of
    ticks (``1e308``, ``NaN``, ``Infinity``: JSON parsers take them; a bit flipped on disk)
    raised OverflowError in the start-up reclaim: the supervisor crashed with a traceback at
    every start, a crash loop until someone removed the file."""
    doc: dict[str, Any] = {
        "supervisor": {"boot_time": 1000.0, "boot_id": "b1"},
        "workers": [
            {"name": "a-0", "pid": 10, "pid_create_time": 1e308},
            {"name": "b-0", "pid": 11, "pid_create_time": float("nan")},
            {"name": "c-0", "pid": 12, "pid_create_time": 10**400},
            {"name": "d-0", "pid": 13, "pid_create_time": 1050.25},
        ],
    }
    assert candidates(doc, "b1", hz=100) == [
        Candidate("a-0", 10, 1e308, True, None),
        Candidate("d-0", 13, 1050.25, True, 5025),
    ]
    for bad in (float("nan"), float("inf"), -1e308):
        doc["supervisor"]["boot_time"] = bad
        assert [c.pid for c in candidates(doc, "b1", hz=100)] == [10, 13]


def test_procfs_create_time_is_psutils() -> None:
    assert procfs.create_time(os.getpid()) == psutil.Process().create_time()
    assert procfs.create_time(2**22 + 12345) is None


def test_state_document_matches_its_schema() -> None:
    device = DeviceSample(
        0,
        "GPU-a",
        "Sim",
        memory_total_mb=1000,
        memory_used_mb=10,
        memory_free_mb=990,
        processes=(GpuProcess(42, 10.0),),
    )
    doc = state_doc(
        written_at=T0,
        supervisor_pid=1234,
        version="0.1",
        started_at=T0 - 10,
        workers=[
            StateWorker("gpen-0", "gpen", "ready", 42, T0 - 5, ("GPU-a",), 0, 8001, ((43, T0 - 4),))
        ],
        devices=[device_object(device, worker_of={42: "gpen-0"})],
        nvml_available=True,
    )
    validate(doc, "state.schema.json")
    assert doc["workers"][0]["tree"] == [{"pid": 43, "create_time": T0 - 4}]
    assert doc["devices"][0]["processes"] == [{"pid": 42, "worker": "gpen-0", "used_mb": 10.0}]
    assert json.loads(json.dumps(doc)) == doc


def test_processes_found_by_the_environment_marker() -> None:
    """Not recorded, not us, not our child: judged like a recorded tree member."""
    recorded = [Candidate("w-0", 100, 5.0, leader=True)]
    found = {
        100: ("w-0", 5.0, 1),  # recorded already
        200: ("w-0", 6.0, 1),  # a daemon of w-0
        300: ("", 7.0, 50),  # no worker name: still ours to end
        400: ("w-1", 8.0, 42),  # a child of ours (pid 42)
        42: ("w-1", 8.0, 1),  # us
    }
    got = marked(found, recorded, own_pid=42)
    assert got == [Candidate("w-0", 200, 6.0, False), Candidate("?", 300, 7.0, False)]


def test_a_state_dirs_instance_id(tmp_path: Path) -> None:
    """Made once and kept; written back with ``keep`` when state_dir was recreated; None when
    it can be neither read nor written."""
    from supervisor.records import instance_id

    first = instance_id(tmp_path)
    assert first is not None and len(first) == 32 and instance_id(tmp_path) == first
    assert instance_id(tmp_path / "other") is None  # no such directory
    (tmp_path / "instance").unlink()
    assert instance_id(tmp_path, keep=first) == first
    assert (tmp_path / "instance").read_text().strip() == first
    (tmp_path / "instance").write_text("not an id\n")
    assert instance_id(tmp_path) not in (None, first)  # a damaged file gets a new id


def test_an_instance_id_in_another_spelling_is_kept_and_a_replaced_one_is_said(
    tmp_path: Path,
) -> None:
    """Regression: an ``instance`` file the format check rejected (a UUID with dashes or in
    upper case, written by hand or by another tool) was replaced by a new id without a word,
    and the leftovers carrying the old id were never reclaimed. A UUID in any spelling is the
    same id (written back as the workers carry it: 32 lower-case hex digits); anything else is
    still replaced, with a warning that names the file and what was found."""
    from supervisor.records import instance_id

    path = tmp_path / "instance"
    path.write_text("01234567-89AB-cdef-0123-456789ABCDEF\n")
    with capture_logs() as logs:
        assert instance_id(tmp_path) == "0123456789abcdef0123456789abcdef"
    assert logs == []
    assert path.read_text() == "0123456789abcdef0123456789abcdef\n"
    path.write_text("not an id\nsecond line\n" + "x" * 1000)
    with capture_logs() as logs:
        new = instance_id(tmp_path)
    assert new is not None and len(new) == 32 and path.read_text() == f"{new}\n"
    assert [(e["event"], e["log_level"], e["path"]) for e in logs] == [
        ("records.instance_replaced", "warning", os.fspath(path))
    ]
    assert "\n" not in logs[0]["found"] and len(logs[0]["found"]) < 100
    assert logs[0]["found"].startswith("'not an id\\nsecond line\\nxxx")
    with capture_logs() as logs:
        assert instance_id(tmp_path) == new  # kept, nothing said
    assert logs == []


def test_an_instance_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    """Regression: ``state_dir/instance`` was read through a symbolic link, so a link planted
    there to a file holding another supervisor's id made this one take that id, and end that
    supervisor's workers as its own leftovers. The link is not followed: one warning, a new
    id in a file of its own (the link replaced), the file it named untouched."""
    from supervisor.records import instance_id

    other = tmp_path / "other"
    other.write_text("0123456789abcdef0123456789abcdef\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "instance").symlink_to(other)
    with capture_logs() as logs:
        new = instance_id(state)
    assert new is not None and new != "0123456789abcdef0123456789abcdef"
    assert [(e["event"], e["log_level"], e["path"]) for e in logs] == [
        ("records.instance_link", "warning", os.fspath(state / "instance"))
    ]
    assert not (state / "instance").is_symlink()
    assert (state / "instance").read_text() == f"{new}\n"
    assert other.read_text() == "0123456789abcdef0123456789abcdef\n"


def test_records_are_read_only_from_regular_files(tmp_path: Path) -> None:
    """A FIFO, a directory or an oversized file in a record's place is an OSError at once
    (never a blocked open, never a whole disk read into memory); a regular file is read."""
    from supervisor.records import read_file

    (tmp_path / "file").write_bytes(b"x" * 100)
    assert read_file(tmp_path / "file") == b"x" * 100
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="not a regular file") as fifo:
        read_file(tmp_path / "fifo")
    assert fifo.value.errno == errno.EINVAL
    with pytest.raises(OSError, match="not a regular file"):
        read_file(tmp_path)
    with pytest.raises(OSError, match="larger than") as big:
        read_file(tmp_path / "file", limit=99)
    assert big.value.errno == errno.EFBIG
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "missing")


async def test_state_json_removed_by_hand_is_written_again(tmp_path: Path) -> None:
    """Regression: with state_dir (or state.json alone) removed, state.json came back only at
    the next change of the document: on a quiet fleet (sim, backend none) never. A figure that
    is no number (NaN) is written as null, not an error that ends the supervisor."""
    state = tmp_path / "state"
    doc: dict[str, Any] = {"workers": [], "gpu": {"temperature_c": float("nan")}}
    recorder = Recorder(state, 10, WriteHealth(), snapshot=lambda: doc)
    recorder._check_dir()
    await recorder.write_state()
    assert json.loads(recorder.state_path.read_text())["gpu"] == {"temperature_c": None}
    recorder.state_path.unlink()
    recorder._last_at -= 1  # the last write is not just now (writes are spaced out)
    await recorder._step()  # the periodic check (CHECK_EVERY_S), as the writer task runs it
    assert recorder.state_path.exists()
    shutil.rmtree(state)
    recorder._next_check = 0.0
    recorder._last_at -= 1
    await recorder._step()
    assert json.loads(recorder.state_path.read_text())["workers"] == []


def test_records_and_logs_are_not_for_everyone_to_read(tmp_path: Path) -> None:
    """Post-mortems hold command lines and log tails, logs what the workers print: 0640
    (regression: 0644, readable by every user of the host)."""
    from supervisor.output import RotatingFile

    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "state.json", b"{}")
        log = RotatingFile(tmp_path / "logs" / "w-0.log", 0, 0)
        log.write(b"secret\n")
        log.close()
    finally:
        os.umask(old)
    assert (tmp_path / "state.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "logs" / "w-0.log").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "logs").stat().st_mode & 0o777 == 0o750


def test_a_lock_taken_read_only_names_its_holder_once_it_can(tmp_path: Path) -> None:
    """The lock of a state_dir that was read-only at start is held through a read-only
    descriptor; our pid is written through a writable one of the same file."""
    (tmp_path / "lock").write_text("12345\n")
    fd = os.open(tmp_path / "lock", os.O_RDONLY)
    try:
        assert write_lock_pid(fd)
        assert (tmp_path / "lock").read_text() == f"{os.getpid()}\n"
    finally:
        os.close(fd)


def test_a_refused_second_supervisor_names_the_holder_in_one_line(tmp_path: Path) -> None:
    """Regression: a ``lock`` file of several lines (edited by hand, written by another tool)
    made the "in use by another gpu-supervisor" error span several lines; every error is one
    line. Only the first line is shown, bounded."""
    from supervisor.errors import StateDirBusy

    for content, holder in [
        ("4242\nleft by another tool\n", "pid 4242)"),
        ("\n\nfrom a hand\x1b[2J, and more than fits\n", "pid '"),
        ("\n \n", "pid unknown)"),
    ]:
        (tmp_path / "lock").write_text(content)
        held = os.open(tmp_path / "lock", os.O_RDONLY)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(StateDirBusy) as err:
                lock_state_dir(tmp_path)
        finally:
            os.close(held)
        message = str(err.value)
        assert message.isprintable() and len(message) < 300, message
        assert holder in message and "left by another tool" not in message, message


def test_the_lock_file_is_never_opened_through_a_link(tmp_path: Path) -> None:
    """A lock that is a link (put there by whoever could write state_dir) is not followed:
    the supervisor's pid would be written into the file it names."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "lock").symlink_to(victim)
    assert lock_state_dir(state_dir) is None  # records.not_locked, as without locks
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize(
    "line",
    [
        # cuBLAS could not allocate its workspace (the first matmul of a full GPU)
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        # NCCL's own allocation (tensor-parallel workers), old and new wording
        "ncclUnhandledCudaError: Call to CUDA function failed. Last error: Cuda failure 'out of "
        "memory'",
        "h100:1:1 [0] include/alloc.h:103 NCCL WARN Cuda failure 2 'out of memory'",
        # JAX / XLA on a full GPU, as jaxlib raises it and as older versions did
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying "
        "to allocate 7406166528 bytes.",
        "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes.",
        "RuntimeError: Resource exhausted: Out of memory while trying to allocate 12582912 bytes.",
        "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB "
        "(2147483648B) on device ordinal 0",
        # TensorFlow's GPU allocator
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating "
        "tensor with shape[8192,8192] and type float on /job:localhost/replica:0/task:0/"
        "device:GPU:0 by allocator GPU_0_bfc",
        "ResourceExhaustedError: failed to allocate memory [Op:AddV2]",
    ],
)
def test_library_allocation_failures_are_cuda_oom(line: str) -> None:
    """Regression: a worker that died because cuBLAS, cuDNN or NCCL could not allocate GPU
    memory (the way a full GPU fails inside those libraries) was classified ``exit``: the
    post-mortem, ``last_exit.reason`` and ``worker_restarts_total`` hid the out-of-memory.
    So was a TensorFlow or JAX worker that died of a full GPU (XLA's ``RESOURCE_EXHAUSTED:
    Out of memory``, TensorFlow's ``OOM when allocating tensor``)."""
    tail = ["Traceback (most recent call last):", line, "--- gpu-supervisor: exited ---"]
    found = classify(ExitReason.EXIT, ExitStatus(1, None), tail, failure=True)
    assert found is not None and found.reason == "cuda_oom"
    assert found.evidence["log_line"] == line


@pytest.mark.parametrize(
    "line",
    [
        # TensorFlow's host (CPU) allocator: host memory, not the GPU's
        "W tensorflow/core/framework/op_kernel.cc:1763] OP_REQUIRES failed at cast_op.cc:109 : "
        "Resource exhausted: OOM when allocating tensor with shape[1,559,512,3] and type float "
        "on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu",
        # a quota or a gRPC message size: resources, not memory
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: Received message larger "
        "than max (8388608 vs. 4194304)",
        "grpc._channel._InactiveRpcError: StatusCode.RESOURCE_EXHAUSTED",
        "MemoryError: Unable to allocate 184. MiB for an array",
    ],
)
def test_host_memory_and_other_exhausted_resources_are_not_cuda_oom(line: str) -> None:
    """The TensorFlow/JAX wording is matched narrowly: an exhausted host allocator, a gRPC
    limit or a quota (also ``ResourceExhaustedError``) is no CUDA out-of-memory."""
    found = classify(ExitReason.EXIT, ExitStatus(1, None), [line], failure=True)
    assert found is not None and found.reason == "exit"


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        # PyTorch 2.1+, C10_CUDA_DRIVER_CHECK (expandable_segments: cuMemCreate)
        ("RuntimeError: CUDA driver error: out of memory", "CUDA driver error"),
        # ONNX Runtime 1.16-1.20 CUDA EP, cuda_call.cc (logged, and raised from the session)
        (
            "2024-05-01 10:00:00.1 [E:onnxruntime:Default, cuda_call.cc:118 CudaCall] CUDA "
            "failure 2: out of memory ; GPU=0 ; hostname=h ; file=/onnxruntime_src/onnxruntime/"
            "core/providers/cuda/cuda_allocator.cc ; line=47 ; expr=cudaMalloc((void**)&p, size);",
            "CUDA failure 2",
        ),
        (
            "onnxruntime.capi.onnxruntime_pybind11_state.Fail: [ONNXRuntimeError] : 1 : FAIL : "
            "/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_call.cc:121 onnxruntime::"
            "CudaCall CUDA failure 2: out of memory ; GPU=0 ; hostname=h ; file=/onnxruntime_src/"
            "onnxruntime/core/providers/cuda/cuda_stream_handle.cc ; line=175 ; "
            "expr=cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);",
            "CUDA failure 2",
        ),
        # llama.cpp (b4000+), ggml-cuda.cu: a model or KV cache that does not fit
        (
            "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9866.00 MiB on device 1: "
            "cudaMalloc failed: out of memory",
            "cudaMalloc failed",
        ),
        # TensorRT-LLM 0.7-0.18, common/cudaUtils.h check() (the failed call in between)
        (
            "RuntimeError: [TensorRT-LLM][ERROR] CUDA runtime error in ::cudaMallocAsync(ptr, n, "
            "mCudaStream->get()): out of memory (/app/tensorrt_llm/cpp/tensorrt_llm/runtime/"
            "tllmBuffers.h:118)",
            "CUDA runtime error in ::cudaMallocAsync",
        ),
        (
            "RuntimeError: [TensorRT-LLM][ERROR] CUDA runtime error in error: out of memory "
            "(/app/tensorrt_llm/cpp/tensorrt_llm/runtime/ipcUtils.cpp:48)",
            "CUDA runtime error in error",
        ),
        # FasterTransformer (Triton's fastertransformer_backend), allocator.h
        (
            "  what():  [FT][ERROR] CUDA runtime error: out of memory /workspace/build/"
            "fastertransformer_backend/build/_deps/repo-ft-src/src/fastertransformer/utils/"
            "allocator.h:220",
            "CUDA runtime error: out of memory",
        ),
        # TensorRT 8.6/10 (Torch-TensorRT, trtexec, Triton's TensorRT backend)
        (
            "[05/08/2024-20:47:56] [TRT] [E] 1: [defaultAllocator.cpp::allocate::19] Error Code "
            "1: Cuda Runtime (out of memory)",
            "Cuda Runtime (out of memory)",
        ),
        # CuPy 9-13, cupy/cuda/memory.pyx (its memory pool)
        (
            "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,073,741,824 bytes "
            "(allocated so far: 0 bytes).",
            "cupy.cuda.memory.OutOfMemoryError",
        ),
        # TensorFlow 2.11+ eager ops
        (
            "tensorflow.python.framework.errors_impl.ResourceExhaustedError: {{function_node "
            "__wrapped__AddV2_device_/job:localhost/replica:0/task:0/device:GPU:0}} failed to "
            "allocate memory [Op:AddV2]",
            "ResourceExhaustedError",
        ),
        # the same in a JSON log record, with ANSI colours (Python 3.13 tracebacks)
        (
            '{"level": "error", "exception": "Traceback (most recent call last):\\n  ...\\n'
            '\x1b[1;35mRuntimeError\x1b[0m: \x1b[35mCUDA driver error: out of memory\x1b[0m"}',
            "CUDA driver error",
        ),
    ],
)
def test_framework_out_of_memory_messages_are_cuda_oom(line: str, shown: str) -> None:
    """Regression: a worker that died because ONNX Runtime, llama.cpp, TensorRT(-LLM),
    FasterTransformer, CuPy's memory pool, PyTorch's driver API calls or a TensorFlow 2.11+
    eager op could not allocate GPU memory was classified ``exit``: those print the
    out-of-memory in words of their own, none of which the classifier knew."""
    tail = ["Traceback (most recent call last):", line, "--- gpu-supervisor: exited ---"]
    found = classify(ExitReason.EXIT, ExitStatus(1, None), tail, failure=True)
    assert found is not None and found.reason == "cuda_oom"
    assert found.evidence["log_line"] == line and shown in found.evidence["log_line"]


@pytest.mark.parametrize(
    "line",
    [
        # TensorFlow 2.x / XLA (jaxlib) stream_executor cuda_driver.cc HostAllocate: pinned
        # host memory; they go on without it
        "2020-12-28 20:52:34.381683: E tensorflow/stream_executor/cuda/cuda_driver.cc:851] "
        "failed to alloc 4294967296 bytes on host: CUDA_ERROR_OUT_OF_MEMORY: out of memory",
        "E0501 10:00:00.000000 1234 cuda_driver.cc:1040] failed to alloc 1073741824 bytes on "
        "host: CUDA_ERROR_OUT_OF_MEMORY: out of memory",
        # the TensorFlow 2.11+ eager wording, for an op on the CPU
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: {{function_node "
        "__wrapped__AddV2_device_/job:localhost/replica:0/task:0/device:CPU:0}} failed to "
        "allocate memory [Op:AddV2]",
        # a TensorRT-LLM error that is not an out-of-memory, however long the line after it
        "RuntimeError: [TensorRT-LLM][ERROR] CUDA runtime error in cudaSetDevice(device): "
        "invalid device ordinal (/app/sessionUtils.cpp:34)" + " x" * 400 + ": out of memory",
    ],
)
def test_pinned_host_memory_is_not_cuda_oom(line: str) -> None:
    """Regression: TensorFlow's and XLA's line for pinned *host* memory the CUDA driver could
    not allocate (``failed to alloc N bytes on host: CUDA_ERROR_OUT_OF_MEMORY``, after which
    they go on without it) made the worker's later death ``cuda_oom``: one the kernel's OOM
    killer ended (SIGKILL while its OOM-kill count went up) was not reported ``host_oom``."""
    tail = [line, "INFO serving", "--- gpu-supervisor: exited ---"]
    found = classify(ExitReason.SIGNAL, ExitStatus(None, 9), tail, failure=True, oom_kills=1)
    assert found is not None and found.reason == "host_oom"
    found = classify(ExitReason.EXIT, ExitStatus(1, None), tail, failure=True)
    assert found is not None and found.reason == "exit"


def test_a_recovered_cuda_oom_long_before_the_death_is_not_its_reason(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Regression: a worker that caught a CUDA out-of-memory error (a server that halves its
    batch, a warm-up that probes the largest batch), went on serving and ended an hour later
    for another reason (an exit 0, a SIGTERM from outside, a SIGKILL of the kernel's OOM
    killer) was classified ``cuda_oom`` by that old line still in its tail. Only a line that
    came shortly before the death is its reason now (the tail keeps the old one as context)."""
    from supervisor.clock import FakeClock
    from supervisor.output import WorkerOutput, this_run
    from supervisor.policy.classify import CUDA_OOM_FRESH_S

    clock = FakeClock()
    out = WorkerOutput("w-0", tmp_path / "w-0.log", 0, 0, now=clock.now)
    request.addfinalizer(out.close)
    out.mark("started pid 10")
    out.feed(b"WARNING torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    out.feed(b"INFO retrying with batch size 4\n")
    clock.advance(3600)
    out.feed(b"INFO shutting down\n")
    out.mark("exited: exit code 0")

    def judge(status: ExitStatus, oom_kills: int = 0) -> str | None:
        lines = this_run(out.lines_since(clock.now() - CUDA_OOM_FRESH_S))
        kind = ExitReason.SIGNAL if status.signal else ExitReason.EXIT
        found = classify(kind, status, lines, failure=False, oom_kills=oom_kills)
        return None if found is None else found.reason

    assert judge(ExitStatus(0, None)) == "exit"
    assert judge(ExitStatus(None, 15)) == "signal"
    assert judge(ExitStatus(None, 9), oom_kills=1) == "host_oom"
    assert any("CUDA out of memory" in line for line in out.lines())  # still shown
    # one that came just before the death is its reason, however long the process ran
    out.feed(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB\n")
    clock.advance(1)
    out.mark("exited: exit code 1")
    assert judge(ExitStatus(1, None)) == "cuda_oom"
    # and only this process's lines count, however recent the earlier one's
    out.mark("started pid 11")
    clock.advance(1)
    out.feed(b"Segmentation fault\n")
    assert judge(ExitStatus(None, 11)) == "signal"


def test_atomic_write_never_writes_through_a_link_at_its_temp_name(tmp_path: Path) -> None:
    """Regression: the temporary file was opened with O_CREAT|O_TRUNC, following a link put at
    its (predictable) name by whoever could write state_dir: a root supervisor truncated and
    overwrote the file it named (``/etc/passwd``) with the state. Now the link is replaced,
    never followed."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    target = state_dir / "state.json"
    (state_dir / f"{TMP_PREFIX}state.json.{os.getpid()}.tmp").symlink_to(victim)
    atomic_write(target, b"new")
    assert victim.read_text() == "precious\n"
    assert target.read_bytes() == b"new"
    assert not target.is_symlink()
    assert os.listdir(state_dir) == ["state.json"]


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (
            ["vllm", "serve", "m", "--api-key", "sk-1", "--port", "8001"],
            ["vllm", "serve", "m", "--api-key", "***", "--port", "8001"],
        ),
        (["app", "--hf-token=hf_x", "--apiKey", "k"], ["app", "--hf-token=***", "--apiKey", "***"]),
        (
            ["app", "--db-password", "p", "--client_secret=s"],
            ["app", "--db-password", "***", "--client_secret=***"],
        ),
        (
            ["env", "OPENAI_API_KEY=sk-2", "HF_TOKEN=hf", "MODEL=x", "app"],
            ["env", "OPENAI_API_KEY=***", "HF_TOKEN=***", "MODEL=x", "app"],
        ),
        # a flag that takes no value is followed by the next flag: nothing to hide
        (["app", "--use-auth-token", "--port", "1"], ["app", "--use-auth-token", "--port", "1"]),
        # not secrets: token counts, tokenizers, key files are paths
        (
            ["app", "--max-tokens", "512", "--tokenizer", "t", "--ssl-keyfile", "/k.pem"],
            ["app", "--max-tokens", "512", "--tokenizer", "t", "--ssl-keyfile", "/k.pem"],
        ),
        (["app", "--api-key"], ["app", "--api-key"]),
        # a shell's command line (``sh -c``): regression, it was kept whole
        (
            ["sh", "-c", "OPENAI_API_KEY=sk-3 exec app --api-key 'k 1' --hf-token=t --port 8"],
            ["sh", "-c", "OPENAI_API_KEY=*** exec app --api-key *** --hf-token=*** --port 8"],
        ),
        (
            ["bash", "-lc", 'app --max-tokens 512 --auth-token "a b" MODEL=x --use-auth-token'],
            ["bash", "-lc", "app --max-tokens 512 --auth-token *** MODEL=x --use-auth-token"],
        ),
    ],
)
def test_secret_values_in_a_command_line_are_masked(argv: list[str], shown: list[str]) -> None:
    """What a worker's command line shows where it is written down (post-mortems, the
    ``worker.spawned`` log line, ``check-config``): the values of flags and ``NAME=value``
    words named like a secret are ``***``."""
    assert redact_argv(argv) == shown


def test_a_postmortem_does_not_keep_the_workers_secrets() -> None:
    """Regression: a post-mortem's ``worker.command`` held the command line as written, API
    keys included (``--api-key sk-...``): readable by the service's group on disk and by anyone
    who can reach the API (``GET /api/v1/postmortems/{id}`` needs no token without
    ``auth_read``; the Kubernetes example listens on 0.0.0.0). Their values are masked now."""
    facts = WorkerFacts(
        "w-0",
        "w",
        0,
        42,
        ("srv", "--api-key", "sk-live-1", "--port", "8001"),
        None,
        None,
        T0,
        T0 + 5,
        0,
        uptime_s=5.0,
    )
    doc = _exit_4(facts)
    validate(doc, "postmortem.schema.json")
    assert doc["worker"]["command"] == ["srv", "--api-key", "***", "--port", "8001"]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://127.0.0.1:8001/health", "http://127.0.0.1:8001/health"),
        (
            "http://127.0.0.1:8001/health?token=abc&verbose=1",
            "http://127.0.0.1:8001/health?token=***&verbose=1",
        ),
        ("https://u:pw@10.0.0.1/h?api_key=k", "https://u:***@10.0.0.1/h?api_key=***"),
        ("http://127.0.0.1:8/h?flag", "http://127.0.0.1:8/h?flag"),
    ],
)
def test_secrets_in_a_health_url_are_masked_where_it_is_shown(url: str, shown: str) -> None:
    """Regression: a token in a readiness or liveness URL (``/health?token=X``) was shown
    whole by ``check-config`` and in the worker object's ``liveness.url``, which the API
    serves without a token unless ``auth_read`` is on."""
    from supervisor.views import redact_url

    assert redact_url(url) == shown


async def test_the_post_mortems_waiting_stay_bounded_under_a_huge_postmortem_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: on a disk that is not failing, the queue was bounded by ``postmortem_keep``
    alone, which has no upper bound: with ``postmortem_keep = 100000`` and a disk that hangs
    rather than fails (a stuck NFS mount: no write fails, none ends), crash loops queued
    documents of up to a few hundred KiB each without limit. At most
    ``MAX_PENDING_BURST`` wait, whatever ``postmortem_keep`` says."""
    from supervisor import records

    # a smaller burst (still over the failing disk's limit): the flush writes each one
    assert records.MAX_PENDING_BURST > records.MAX_PENDING_POSTMORTEMS + 50
    burst = records.MAX_PENDING_POSTMORTEMS + 50
    monkeypatch.setattr(records, "MAX_PENDING_BURST", burst)
    state = tmp_path / "state"
    state.mkdir()
    recorder = Recorder(state, 100_000, WriteHealth(), snapshot=dict)
    n = burst + 5
    with capture_logs() as logs:
        for i in range(n):  # one loop turn: the writer has not run yet
            recorder.postmortem({"id": postmortem_id(T0 + i / 1000, f"w-{i}", "exit")})
    assert len(recorder._pending) == burst
    assert len([e for e in logs if e["event"] == "records.postmortem_dropped"]) == 5
    await recorder.flush()


GPU_A = "GPU-00000000-0000-0000-0000-00000000000a"


@pytest.mark.parametrize(
    ("saved_boot", "boot", "kept"),
    [("b1", "b1", True), ("b0", "b1", False), ("", "b1", True), ("b1", "", True)],
)
def test_quarantines_are_kept_in_the_boot_that_made_them(
    tmp_path: Path, saved_boot: str, boot: str, kept: bool
) -> None:
    """A quarantine outlives a restart of the supervisor, not a reboot (which resets the
    GPUs); where a boot id is unknown (no /proc), it is kept: a GPU that failed is not put
    back to work on a guess."""
    write_quarantine(tmp_path, saved_boot, {GPU_A: "XID 79"})
    got = read_quarantine(tmp_path, boot)
    assert got.unreadable is None
    assert (got.gpus, got.dropped) == (({GPU_A: "XID 79"}, {}) if kept else ({}, {GPU_A: "XID 79"}))


def test_no_quarantine_left_removes_the_file(tmp_path: Path) -> None:
    write_quarantine(tmp_path, "b", {GPU_A: "lost"})
    write_quarantine(tmp_path, "b", {})
    assert not (tmp_path / "quarantine").exists()
    write_quarantine(tmp_path, "b", {})  # none there: nothing to remove, no error
    assert read_quarantine(tmp_path, "b") == read_quarantine(tmp_path / "nowhere", "b")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "not JSON"),
        (b'["GPU-x"]', "not {"),
        (b'{"gpus": {"GPU-x": "lost"}}', "not {"),
        (b'{"boot_id": "b", "gpus": ["GPU-x"]}', "not {"),
    ],
)
def test_a_quarantine_file_that_cannot_be_read_is_said(
    tmp_path: Path, content: bytes, why: str
) -> None:
    (tmp_path / "quarantine").write_bytes(content)
    got = read_quarantine(tmp_path, "b")
    assert not got.gpus and got.unreadable is not None and got.unreadable.startswith(why)


def test_a_quarantine_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    """A link planted in state_dir must not choose which GPUs are taken out of service."""
    planted = tmp_path / "planted"
    write_quarantine(tmp_path, "b", {GPU_A: "XID 79"})
    (tmp_path / "quarantine").rename(planted)
    (tmp_path / "quarantine").symlink_to(planted)
    got = read_quarantine(tmp_path, "b")
    assert not got.gpus and got.unreadable is not None and "symbolic link" in got.unreadable


def test_lifts_kept_while_a_flag_stays_on_are_read_back(tmp_path: Path) -> None:
    """Regression: an operator's lift while a GPU's flag stayed on (a failed row remap, the
    driver's recovery action) was not recorded, so the next supervisor quarantined the GPU
    again. It is kept in the file (with no quarantine left, the file stays for it); what a
    newer version wrote there that this one does not understand is not taken for a lift."""
    write_quarantine(tmp_path, "b", {}, {GPU_A: {"row_remap_failure": 1, "recovery_action": 2}})
    got = read_quarantine(tmp_path, "b")
    assert (got.gpus, got.unreadable) == ({}, None)
    assert got.lifted == {GPU_A: {"recovery_action": 2, "row_remap_failure": 1}}
    assert read_quarantine(tmp_path, "another-boot").lifted == {}
    (tmp_path / "quarantine").write_text(
        json.dumps(
            {
                "boot_id": "b",
                "gpus": {GPU_A: "XID 79"},
                "lifted": {"GPU-x": ["row_remap_failure"], "GPU-y": {"flag": "on", "n": True}},
                "schema_version": 2,
            }
        )
    )
    got = read_quarantine(tmp_path, "b")
    assert (got.gpus, got.lifted, got.unreadable) == ({GPU_A: "XID 79"}, {}, None)


@pytest.mark.timeout(10)
def test_the_state_dir_check_before_an_api_error_does_not_hang_on_a_fifo(tmp_path: Path) -> None:
    """Regression: a FIFO at ``state_dir/lock`` made the look at the lock (a second ``run``
    whose API address is taken) block in its read-only open, for ever. It opens without
    blocking; a lock held by another process is still reported."""
    from supervisor.errors import StateDirBusy
    from supervisor.records import check_state_dir_free, lock_state_dir

    os.mkfifo(tmp_path / "lock")
    check_state_dir_free(tmp_path)  # returns: nothing holds it
    held = tmp_path / "held"
    held.mkdir()
    fd = lock_state_dir(held)
    assert fd is not None
    try:
        with pytest.raises(StateDirBusy, match=f"pid {os.getpid()}"):
            check_state_dir_free(held)
    finally:
        os.close(fd)
    check_state_dir_free(held)


def test_post_mortems_dropped_on_a_full_disk_are_said_once_a_minute_per_worker(
    tmp_path: Path,
) -> None:
    """Regression: on a full disk each post-mortem dropped beyond the 100 waiting had its own
    ``records.postmortem_dropped`` line at error: a crash loop on a disk that stayed full
    flooded the log. Now one line a minute per worker says it, with how many were dropped
    since the last said (``dropped``); the others are at debug."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "postmortems").write_text("not a directory")  # every post-mortem write fails
    clock = [1000.0]
    recorder = Recorder(state, 1000, WriteHealth(), snapshot=dict, now=lambda: clock[0])
    recorder.health.failed("postmortem", OSError(errno.ENOSPC, "No space left on device"))

    def crash(i: int, worker: str) -> None:
        doc = {"id": postmortem_id(T0 + i, worker, "exit"), "worker": {"name": worker}}
        recorder.postmortem(doc)

    with capture_logs() as logs:
        for i in range(130):
            crash(i, "a-0" if i % 2 else "b-0")
        clock[0] += 61.0
        for i in range(130, 140):
            crash(i, "a-0")
        # what was dropped at debug and not said since is said at exit
        recorder.report_unwritten()
    dropped = [e for e in logs if e["event"] == "records.postmortem_dropped"]
    loud = [e for e in dropped if e["log_level"] != "debug"]
    assert len([e for e in dropped if e["id"]]) == 40  # each has its line, with its id
    assert [(e["worker"], e["dropped"]) for e in loud] == [
        ("b-0", 1),
        ("a-0", 1),
        ("b-0", 15),  # 14 at debug in the first minute, and this one
        ("a-0", 15),
        ("a-0", 4),  # at exit: those at debug since
        ("b-0", 4),
    ]
    assert sum(e["dropped"] for e in loud) == 40
