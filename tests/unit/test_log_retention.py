"""The logs of workers no longer configured: which go (``policy.retention``, pure, table-driven
and a hypothesis property) and their removal from a real ``logs/`` directory
(``records.retain_worker_logs``). With a real supervisor and reloads:
tests/integration/test_records.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.policy.retention import WorkerLogs, budget, to_remove, worker_of
from supervisor.records import LogsRemoved, retain_worker_logs


@pytest.mark.parametrize(
    ("filename", "worker"),
    [
        ("llm-0.log", "llm-0"),
        ("llm-12.log.1", "llm-12"),
        ("llm-v1-0.log.5", "llm-v1-0"),
        ("a.log-0.log", "a.log-0"),  # a group named with ".log" in it
        ("a.log-0.log.2", "a.log-0"),
        ("llm.log", None),  # no index: not a worker's
        ("llm-0.log.0", None),  # rotated files count from 1
        ("llm-0.log.01", None),
        ("llm-01.log", None),
        ("llm-0.log.1.tmp", None),
        ("llm-0.txt", None),
        (".hidden-0.log", None),
        ("-0.log", None),
        ("llm-0.log.", None),
    ],
)
def test_which_files_are_a_workers_log(filename: str, worker: str | None) -> None:
    assert worker_of(filename) == worker


@pytest.mark.parametrize(
    ("workers", "max_bytes", "backups", "expected"),
    [
        (3, 100, 5, 1800),
        (0, 100, 5, 0),  # none configured: only the last written is kept
        (2, 100, 0, 200),
        (4, 0, 5, None),  # log_max_bytes = 0: never rotated, no bound
    ],
)
def test_the_budget_is_what_the_configured_workers_logs_may_hold(
    workers: int, max_bytes: int, backups: int, expected: int | None
) -> None:
    assert budget(workers, max_bytes, backups) == expected


def _w(name: str, mtime: float, size: int) -> WorkerLogs:
    return WorkerLogs(name, mtime, size)


@pytest.mark.parametrize(
    ("logs", "limit", "configured", "expected"),
    [
        pytest.param([], 100, set(), [], id="nothing"),
        pytest.param([_w("a-0", 1, 40), _w("b-0", 2, 60)], 100, set(), [], id="within budget"),
        pytest.param(
            [_w("b-0", 2, 60), _w("a-0", 1, 60), _w("c-0", 3, 60)],
            100,
            set(),
            ["a-0", "b-0"],
            id="oldest first down to the budget",
        ),
        pytest.param(
            [_w("a-0", 1, 10), _w("b-0", 2, 85), _w("c-0", 3, 10)],
            100,
            set(),
            ["a-0"],
            id="just enough: the rest fit",
        ),
        pytest.param(
            [_w("a-0", 1, 10), _w("b-0", 2, 500)], 100, set(), ["a-0"], id="newest kept over it"
        ),
        pytest.param([_w("a-0", 1, 10), _w("b-0", 2, 10)], 0, set(), ["a-0"], id="budget 0"),
        pytest.param(
            [_w("a-0", 1, 500), _w("b-0", 2, 500), _w("c-0", 3, 10)],
            100,
            {"a-0"},
            ["b-0"],
            id="configured never",
        ),
        pytest.param([_w("a-0", 1, 500)], 100, {"a-0"}, [], id="only configured"),
        pytest.param(
            [_w("b-0", 1, 60), _w("a-0", 1, 60)], 100, set(), ["a-0"], id="same time: by name"
        ),
        pytest.param([_w("a-0", 1, 10**12)], None, set(), [], id="no bound"),
    ],
)
def test_which_workers_logs_are_removed(
    logs: list[WorkerLogs], limit: int | None, configured: set[str], expected: list[str]
) -> None:
    assert to_remove(logs, limit, configured) == expected


_NAMES = [f"g{i}-0" for i in range(12)]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(_NAMES),
            st.floats(min_value=0, max_value=1e9, allow_nan=False),
            st.integers(min_value=0, max_value=10**6),
        ),
        unique_by=lambda t: t[0],
        max_size=12,
    ),
    st.integers(min_value=0, max_value=3 * 10**6),
    st.sets(st.sampled_from(_NAMES), max_size=6),
)
def test_what_is_kept_fits_the_budget_and_goes_oldest_first(
    entries: list[tuple[str, float, int]], limit: int, configured: set[str]
) -> None:
    logs = [WorkerLogs(*e) for e in entries]
    removed = to_remove(logs, limit, configured)
    assert len(set(removed)) == len(removed)
    assert not set(removed) & configured  # never a configured worker's
    candidates = [w for w in logs if w.name not in configured]
    kept = [w for w in candidates if w.name not in removed]
    size = {w.name: w.total_bytes for w in logs}
    # within the budget, or only the most recently written one kept
    assert sum(w.total_bytes for w in kept) <= limit or len(kept) == 1
    assert bool(kept) == bool(candidates)  # the most recently written always stays
    order = {w.name: (w.newest_mtime, w.name) for w in logs}
    # the least recently written first: every removed one is older than every kept one
    assert [order[n] for n in removed] == sorted(order[n] for n in removed)
    if removed and kept:
        assert max(order[n] for n in removed) < min(order[w.name] for w in kept)
        # and no more than needed: keeping the last removed one would pass the budget
        assert sum(w.total_bytes for w in kept) + size[removed[-1]] > limit


# --- on disk -----------------------------------------------------------------------------


def _log(directory: Path, name: str, size: int, mtime: float) -> Path:
    path = directory / name
    path.write_bytes(b"x" * size)
    os.utime(path, (mtime, mtime))
    return path


def test_the_oldest_removed_workers_logs_go_whole_and_nothing_else(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    outside = tmp_path / "outside-0.log"
    outside.write_bytes(b"y" * 5000)
    os.utime(outside, (10, 10))
    # old-0 was written last at 100 (its .log.1 is older), mid-0 at 200, new-0 at 300
    old = [_log(logs, "old-0.log", 300, 100), _log(logs, "old-0.log.1", 400, 50)]
    mid = [_log(logs, "mid-0.log", 300, 200)]
    new = [_log(logs, "new-0.log", 300, 300), _log(logs, "new-0.log.2", 300, 250)]
    live = [_log(logs, "live-0.log", 9000, 1), _log(logs, "live-0.log.1", 9000, 1)]
    running = [_log(logs, "going-0.log", 9000, 2)]
    others = [_log(logs, "notes.txt", 9000, 1), _log(logs, "old-0.log.1.bak", 10, 1)]
    (logs / "link-0.log").symlink_to(outside)  # a link: neither counted nor followed
    (logs / "dir-0.log").mkdir()  # a directory named like a log

    done = retain_worker_logs(logs, 1000, {"live-0"}, lambda name: name == "going-0")

    assert done.workers == ["old-0"]
    assert done.bytes == 700
    assert done.failed == {}
    assert not any(p.exists() for p in old)
    assert all(p.exists() for p in [*mid, *new, *live, *running, *others])
    assert (logs / "link-0.log").is_symlink() and outside.read_bytes() == b"y" * 5000
    assert (logs / "dir-0.log").is_dir()
    # within the budget now: nothing more goes, until the stopping worker is forgotten
    assert retain_worker_logs(logs, 1000, {"live-0"}, lambda name: name == "going-0") == (
        LogsRemoved()
    )
    done = retain_worker_logs(logs, 1000, {"live-0"}, lambda name: False)
    assert (done.workers, done.bytes) == (["going-0"], 9000)
    assert all(p.exists() for p in [*mid, *new, *live])


def test_a_worker_back_meanwhile_keeps_its_logs(tmp_path: Path) -> None:
    """``kept`` is asked again right before a worker's files go: one that a reload brought
    back while the directory was read keeps them."""
    logs = tmp_path / "logs"
    logs.mkdir()
    _log(logs, "a-0.log", 600, 1)
    _log(logs, "b-0.log", 600, 2)
    asked: list[str] = []

    def kept(name: str) -> bool:
        asked.append(name)
        return asked.count(name) > 1  # not while listing, but when removing

    done = retain_worker_logs(logs, 1000, set(), kept)
    assert done.workers == [] and done.bytes == 0
    assert (logs / "a-0.log").exists() and (logs / "b-0.log").exists()


def test_no_bound_and_no_directory_do_nothing(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    assert retain_worker_logs(logs, 0, set(), lambda name: False).workers == []
    logs.mkdir()
    _log(logs, "a-0.log", 600, 1)
    _log(logs, "b-0.log", 600, 2)
    assert retain_worker_logs(logs, None, set(), lambda name: False).workers == []
    link = tmp_path / "link"
    link.symlink_to(logs)  # logs/ a symbolic link: not followed
    assert retain_worker_logs(link, 0, set(), lambda name: False).workers == []
    assert (logs / "a-0.log").exists()
