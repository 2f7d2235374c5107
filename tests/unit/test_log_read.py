"""Reading a worker's log back (``RotatingFile.read``): the tail, and a follower that passes
each answer's file and offset back sees every byte once, in order, across rotations; what is
gone is said. Real files, written by the supervisor's own ``RotatingFile``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.output import TAG_XATTR, TRIMMED_MARK, LogChunk, RotatingFile

MAX, BACKUPS = 100, 3


def _log(tmp: Path) -> RotatingFile:
    return RotatingFile(tmp / "w-0.log", MAX, BACKUPS)


def _drain(log: RotatingFile, file: str, offset: int, limit: int) -> tuple[bytes, str, int]:
    """Read until nothing is left; returns what was read and where the follower is."""
    got = b""
    while True:
        chunk = log.read(limit, file, offset)
        assert not chunk.lost
        got += chunk.data
        file, offset = chunk.file, chunk.offset
        if not chunk.data:
            return got, file, offset


def test_the_tail_is_the_last_bytes_of_the_log_across_rotations(tmp_path: Path) -> None:
    log = _log(tmp_path)
    assert log.read(10) == LogChunk(b"", "", 0)  # no output yet
    log.write(b"a" * 60)
    log.write(b"b" * 30)
    tail = log.read(10)
    assert tail.data == b"b" * 10 and tail.offset == 90 and not tail.lost
    log.write(b"c" * 50)  # rotates: the tail goes on into the rotated file
    tail = log.read(60)
    assert tail.data == b"b" * 10 + b"c" * 50 and tail.offset == 50 and tail.file
    assert log.read(1000).data == b"a" * 60 + b"b" * 30 + b"c" * 50
    assert log.read(1000, tail.file, tail.offset).data == b""  # followed on from the newest
    log.close()


@settings(max_examples=60, deadline=None)
@given(
    phases=st.lists(
        st.tuples(
            # writes: each may start a file, so at most BACKUPS of them before the follower
            # reads again (more would rotate its file away: test_a_place_rotated_past_...)
            st.lists(st.integers(1, 120), min_size=0, max_size=BACKUPS),
            st.integers(1, 150),  # the follower's limit
        ),
        min_size=1,
        max_size=12,
    )
)
def test_a_follower_sees_every_byte_once_across_rotations(
    phases: list[tuple[list[int], int]],
) -> None:
    with tempfile.TemporaryDirectory() as where:
        _follow(_log(Path(where)), phases)


def _follow(log: RotatingFile, phases: list[tuple[list[int], int]]) -> None:
    """Write each phase's pieces, then read to the end ``limit`` bytes at a time, as a
    follower: what it read is what was written, every byte once, nothing said lost."""
    written, read = b"", b""
    first = log.read(10)  # a follower that started before any output
    file, offset = first.file, first.offset
    n = 0
    for sizes, limit in phases:
        for size in sizes:
            data = bytes((n + i) % 251 for i in range(size))  # no two the same nearby
            n += size
            log.write(data)
            written += data
        got, file, offset = _drain(log, file, offset, limit)
        read += got
        assert read == written
    log.close()


@settings(max_examples=40, deadline=None)
@given(
    # one write between two reads: with no backups, a second rotation before the follower
    # reads would remove a file it has not read (said as lost: the test below)
    phases=st.lists(st.tuples(st.integers(0, 120), st.integers(1, 150)), min_size=1, max_size=12)
)
def test_without_backups_a_follower_that_read_all_of_a_file_goes_on_in_the_next(
    phases: list[tuple[int, int]],
) -> None:
    """``log_backups = 0``: a rotation removes the file; a follower that had read all of it
    goes on in the new one, nothing said lost. Regression: every rotation read as lost."""
    with tempfile.TemporaryDirectory() as where:
        log = RotatingFile(Path(where) / "w-0.log", MAX, 0)
        _follow(log, [([size], limit) for size, limit in phases])


def test_without_backups_a_file_removed_before_it_was_read_is_said_lost(tmp_path: Path) -> None:
    log = RotatingFile(tmp_path / "w-0.log", MAX, 0)
    log.write(b"a" * 60)
    at = log.read(10)  # read to 60
    log.write(b"b" * 30)  # not read before the rotation below
    log.write(b"c" * 50)  # rotates: "a"s and "b"s are gone
    assert log.read(1000, at.file, at.offset) == LogChunk(b"c" * 50, log.read(1).file, 50, True)
    top = log.read(1000, at.file, at.offset)
    log.write(b"d" * 80)  # rotates again: a follower at the end of the "c"s goes on
    assert log.read(1000, top.file, top.offset).data == b"d" * 80
    assert not log.read(1000, top.file, top.offset).lost
    # two rotations past it: the file after the one it had read is gone too
    log.write(b"e" * 80)
    assert log.read(1000, top.file, top.offset) == LogChunk(b"e" * 80, log.read(1).file, 80, True)
    log.close()


def test_without_backups_a_follower_reading_between_the_removal_and_the_next_file_keeps_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``log_backups = 0``: a reader (another thread) that takes the lock after a rotation
    removed the file and before the writer made the next one finds no file. A follower that
    had read all of the removed one lost nothing: it keeps its place. Regression: said lost,
    its place given back as "" (from the oldest byte kept), so that the bytes of the files
    rotated away before its next read were skipped without a word."""
    log = RotatingFile(tmp_path / "w-0.log", MAX, 0)
    log.write(b"a" * 60)
    at = log.read(1000)  # read all of it
    between: list[LogChunk] = []
    real_open = log._open

    def reader_first() -> BinaryIO:
        if log._fh is None and not between:  # the writer is about to make the next file
            between.append(log.read(1000, at.file, at.offset))
        return real_open()

    monkeypatch.setattr(log, "_open", reader_first)
    log.write(b"b" * 50)  # rotates: "a"s removed, then the next file made
    monkeypatch.undo()
    assert between == [LogChunk(b"", at.file, at.offset)]
    got, _, _ = _drain(log, at.file, at.offset, 1000)
    assert got == b"b" * 50
    # two rotations before it reads again: what it had not read is gone, and said so
    log.write(b"c" * 60)
    log.write(b"d" * 60)
    chunk = log.read(1000, between[0].file, between[0].offset)
    assert chunk.lost and chunk.data == b"d" * 60
    log.close()


def test_a_place_rotated_past_the_last_backup_is_said_and_reading_goes_on(
    tmp_path: Path,
) -> None:
    log = _log(tmp_path)
    log.write(b"0" * 80)
    at = log.read(1000)
    for digit in b"12345":  # 5 rotations: the file at `at` is gone
        log.write(bytes([digit]) * 80)
    chunk = log.read(1000, at.file, at.offset)
    assert chunk.lost and chunk.data == b"2" * 80  # the oldest there is (x.log.3)
    rest, _, _ = _drain(log, chunk.file, chunk.offset, 1000)
    assert rest == b"3" * 80 + b"4" * 80 + b"5" * 80
    # an id no log ever had reads as gone too
    assert log.read(1000, "1-2", 5) == LogChunk(b"2" * 80, chunk.file, 80, lost=True)
    log.close()


def test_a_log_emptied_under_the_follower_is_read_again_from_its_start(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.write(b"w" * 50)
    log.write(b"x" * 90)  # rotated once
    at = log.read(1000)
    assert log._trim()  # a full disk: the backups removed, the current file emptied
    log.write(b"y" * 95)  # grown past where the follower was: still not read from there
    chunk = log.read(1000, at.file, at.offset)
    assert chunk.lost and chunk.file != at.file
    assert chunk.data == TRIMMED_MARK + b"y" * 95
    # an offset past the end of a file (no answer gave it) is read from its start
    assert log.read(1000, chunk.file, 10_000) == LogChunk(
        chunk.data, chunk.file, chunk.offset, True
    )
    log.close()


def test_a_follower_that_started_before_any_output_reads_it_all(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.write(b"a" * 80)
    log.write(b"b" * 80)  # rotated once already
    got, _, _ = _drain(log, "", 0, 7)
    assert got == b"a" * 80 + b"b" * 80
    log.close()


def test_a_link_in_place_of_the_log_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a log")
    os.symlink(secret, tmp_path / "w-0.log")
    assert RotatingFile(tmp_path / "w-0.log", MAX, BACKUPS).read(100).data == b""


def test_a_fifo_or_a_directory_in_place_of_a_file_is_skipped_without_blocking(
    tmp_path: Path,
) -> None:
    log = _log(tmp_path)
    log.write(b"a" * 80)
    os.mkfifo(tmp_path / "w-0.log.3")  # opened O_RDONLY it would block until a writer came
    os.mkdir(tmp_path / "w-0.log.2")
    chunk = log.read(1000, "", 0)
    assert chunk.data == b"a" * 80 and not chunk.lost
    log.close()


def test_a_file_made_by_a_rotation_is_numbered_before_a_reader_can_see_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader (another thread) that saw the new file before the writer numbered it would
    # number it itself; renumbered as new, the reader's answer named a file that no longer
    # existed (X-Log-Lost, every backup read again). The file is made under the readers' lock.
    log = _log(tmp_path)
    log.write(b"a" * 80)
    at = log.read(1000)
    made_under_lock: list[bool] = []
    real_open = os.open

    def watched(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_EXCL:  # the writer makes the file
            made_under_lock.append(log._files_lock.locked())
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", watched)
    log.write(b"b" * 80)  # rotates: x.log made anew
    monkeypatch.undo()
    assert made_under_lock == [True]
    chunk = log.read(1000, at.file, at.offset)
    assert not chunk.lost and chunk.data == b"b" * 80
    log.close()


def test_a_follower_goes_on_across_a_restart_of_the_supervisor(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.write(b"a" * 80)
    at = log.read(1000)
    log.close()
    again = _log(tmp_path)  # the next run: its own numbers; the files are the same
    again.write(b"b" * 10)
    again.write(b"c" * 80)  # and rotated since
    chunk = again.read(1000, at.file, at.offset)
    assert not chunk.lost and chunk.data == b"b" * 10
    rest = again.read(1000, chunk.file, chunk.offset)
    assert not rest.lost and rest.data == b"c" * 80
    again.close()


@pytest.mark.parametrize("read_to", [60, 30])
def test_without_backups_a_follower_across_a_restart_skips_nothing_of_the_next_file(
    tmp_path: Path, read_to: int
) -> None:
    """``log_backups = 0``: the rotation removes the file and the next one is made at once;
    the filesystem may give it the removed file's inode (ext4 does). The next run of the
    supervisor finds a follower's file "again" by inode: a follower of the removed file must
    not be taken for one part-way into the new one. Regression (found in review): it read
    the new file from the removed one's offset, its first bytes skipped, nothing said. (Each
    file is tagged in an extended attribute: where the filesystem keeps none, the inode is
    all there is to go by.)"""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, TAG_XATTR, b"x")
    except OSError as exc:
        pytest.skip(f"no user extended attributes on {tmp_path}: {exc}")
    log = RotatingFile(tmp_path / "w-0.log", MAX, 0)
    log.write(b"a" * 60)
    at = log.read(1000)
    at = log.read(read_to, at.file, 0)  # read to `read_to` of the 60
    log.write(b"b" * 70)  # rotates: the "a"s removed, the "b"s in a new file
    log.close()
    again = RotatingFile(tmp_path / "w-0.log", MAX, 0)  # the next run of the supervisor
    chunk = again.read(1000, at.file, at.offset)
    assert chunk.data == b"b" * 70
    if read_to < 60:  # the "a"s it had not read are gone: said
        assert chunk.lost
    again.close()


def test_a_log_removed_or_renamed_under_the_writer_is_made_anew(tmp_path: Path) -> None:
    """Removed by hand to free space, or renamed by logrotate (``create``): the writer went on
    in the file that was no longer there (the disk space never freed, ``logs`` empty) until
    its own rotation, 50 MB later by default."""
    log = RotatingFile(tmp_path / "w-0.log", 0, 0)  # never rotates by itself
    log.check_every_s = 0.0  # (at most once a second in a supervisor)
    log.write(b"first\n")
    (tmp_path / "w-0.log").unlink()
    log.write(b"second\n")
    assert (tmp_path / "w-0.log").read_bytes() == b"second\n"
    assert log.read(100).data == b"second\n"
    os.rename(tmp_path / "w-0.log", tmp_path / "w-0.log-20261207")
    (tmp_path / "w-0.log").write_bytes(b"")  # logrotate's `create`
    log.write(b"third\n")
    assert (tmp_path / "w-0.log").read_bytes() == b"third\n"
    assert (tmp_path / "w-0.log-20261207").read_bytes() == b"second\n"
    log.close()


def test_a_log_emptied_under_the_writer_rotates_at_its_size_again(tmp_path: Path) -> None:
    """logrotate's ``copytruncate`` empties the file: the writer's count of its size must
    follow, or the next write rotates the nearly empty file, pushing a backup out."""
    log = _log(tmp_path)  # rotates at 100 bytes
    log.check_every_s = 0.0
    log.write(b"a" * 90)
    os.truncate(tmp_path / "w-0.log", 0)
    log.write(b"b" * 20)
    assert (tmp_path / "w-0.log").read_bytes() == b"b" * 20
    assert not (tmp_path / "w-0.log.1").exists()
    log.close()


def test_a_follower_of_a_log_removed_under_the_writer_goes_on_in_the_new_one(
    tmp_path: Path,
) -> None:
    """``logs -f`` while the log is removed by hand (or renamed by logrotate): the follower
    goes on at the start of the file made anew, instead of printing the backups again from
    the oldest; what it had not read of the removed file is said lost."""
    log = _log(tmp_path)
    log.check_every_s = 0.0
    log.write(b"a" * 80)
    log.write(b"b" * 80)  # rotated: the "a"s in w-0.log.1
    at = log.read(1000)  # read to the end of the "b"s
    part = log.read(1000, at.file, 40)  # another follower, half-way into the "b"s
    (tmp_path / "w-0.log").unlink()
    # read before the writer has noticed (at its next write): no more for now, nothing lost
    assert log.read(1000, at.file, at.offset) == LogChunk(b"", at.file, at.offset)
    log.write(b"c" * 10)  # made anew
    assert log.read(1000, at.file, at.offset) == LogChunk(b"c" * 10, log.read(1).file, 10)
    assert log.read(1000, part.file, 40) == LogChunk(b"c" * 10, log.read(1).file, 10, True)
    top = log.read(1000)
    os.rename(tmp_path / "w-0.log", tmp_path / "w-0.log-20261207")  # logrotate's `create`:
    (tmp_path / "w-0.log").write_bytes(b"")  # renamed, and an empty one made in its place
    log.write(b"d" * 20)
    assert log.read(1000, top.file, top.offset) == LogChunk(b"d" * 20, log.read(1).file, 20)
    log.close()


def test_a_log_reached_through_a_link_is_not_taken_for_moved(tmp_path: Path) -> None:
    """``state_dir/logs/w-0.log`` a link to a file elsewhere (another disk): the writer keeps
    its file (it is the one at the path), and does not make it anew each second."""
    target = tmp_path / "elsewhere.log"
    target.write_bytes(b"")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "w-0.log").symlink_to(target)
    log = RotatingFile(tmp_path / "logs" / "w-0.log", 0, 0)
    log.check_every_s = 0.0
    log.write(b"a\n")
    held = log._fh
    log.write(b"b\n")
    assert log._fh is held
    assert target.read_bytes() == b"a\nb\n"
    log.close()


def test_a_log_is_never_written_through_a_link_another_user_put_there(tmp_path: Path) -> None:
    """Regression: a link at a worker's log path was followed whoever made it: a user who could
    write ``logs/`` (the workers' own, where state_dir is theirs) linked ``w-0.log`` to
    ``/etc/passwd`` and a root supervisor appended the worker's output to it. A link is
    followed only when it is the supervisor's own (or root's): one an operator made."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip("needs root to make a link owned by another user")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine's user database has no 'nobody'")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    (tmp_path / "logs").mkdir()
    link = tmp_path / "logs" / "w-0.log"
    link.symlink_to(victim)
    os.lchown(link, nobody.pw_uid, nobody.pw_gid)
    log = RotatingFile(link, 0, 0)
    log.write(b"evil::0:0::/root:/bin/sh\n")
    log.close()
    assert victim.read_bytes() == b"precious\n"
    assert log.failing  # said as a failed write (output.log_write_failed)
