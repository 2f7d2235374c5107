"""Lines longer than ``MAX_LINE`` through the real ``WorkerOutput``: passthrough and the log file
lose no byte, the tail and ``on_line`` keep the line's start, and memory stays bounded."""

from __future__ import annotations

import fcntl
import os
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.output import (
    _READ_SIZE,
    CUT_MARK,
    END_PIECE,
    MATCH_OVERLAP,
    MAX_LINE,
    WorkerOutput,
)

PREFIX = b"[w-0] "
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


def chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


Make = Callable[..., WorkerOutput]


@pytest.fixture(name="make")
def fixture_make(tmp_path: Path) -> Iterator[Make]:
    """``make(stdout=None)``: a ``WorkerOutput`` logging to ``tmp_path/w.log`` (passthrough to
    ``stdout`` when one is given); closed after the test."""
    made: list[WorkerOutput] = []

    def make(stdout: Callable[[bytes], object] | None = None) -> WorkerOutput:
        log = tmp_path / "w.log"
        made.append(WorkerOutput("w-0", log, 0, 0, passthrough=stdout is not None, stdout=stdout))
        return made[-1]

    yield make
    for out in made:
        out.close()


def payloads(seen: list[bytes]) -> list[bytes]:
    """What the worker printed, one entry per passthrough line, from what was written to stdout
    (every write whole lines, every line prefixed)."""
    assert all(write.endswith(b"\n") for write in seen)
    lines = b"".join(seen).split(b"\n")[:-1]
    assert all(line.startswith(PREFIX) for line in lines)
    return [line[len(PREFIX) :] for line in lines]


@pytest.mark.parametrize("size", [_READ_SIZE, 4096, 100_001, 10**7])
def test_passthrough_loses_nothing_of_long_lines(make: Make, tmp_path: Path, size: int) -> None:
    """The defect: 50 lines of 100 kB came out as fragments without their start. Now every
    byte comes out, in order, in prefixed pieces of at most MAX_LINE bytes, the same however
    the pipe's reads fall; the log file has every byte too."""
    lines = [b"L%03d " % i + b"z" * 100_000 + b" END" for i in range(50)]
    data = b"".join(line + b"\n" for line in lines)
    seen: list[bytes] = []
    out = make(seen.append)
    for chunk in chunks(data, size):
        out.feed(chunk)
    assert len(seen) <= -(-len(data) // size)  # one write per chunk at most
    got = payloads(seen)
    assert all(len(p) <= MAX_LINE for p in got)
    assert b"".join(got) == b"".join(lines)
    starts = [i for i, p in enumerate(got) if p.startswith(b"L0")]
    assert len(starts) == 50
    rebuilt = [b"".join(got[a:b]) for a, b in zip(starts, [*starts[1:], len(got)], strict=True)]
    assert rebuilt == lines
    assert got[:7] == [lines[0][i : i + MAX_LINE] for i in range(0, len(lines[0]), MAX_LINE)]
    assert (tmp_path / "w.log").read_bytes() == data


def test_the_tail_keeps_the_start_of_a_long_line_marked_as_cut(make: Make) -> None:
    out = make()
    long = b"2024-05-01 ERROR boom " + b"z" * 100_000 + b" END"
    for chunk in chunks(b"before\n" + long + b"\nafter\n", _READ_SIZE):
        out.feed(chunk)
    head = long[:MAX_LINE].decode()
    assert out.lines() == [
        "before",
        head + CUT_MARK.format(total=len(long)) + " ..." + long[-END_PIECE:].decode(),
        "after",
    ]


def test_a_long_complete_line_in_one_read_is_cut_for_the_tail_too(make: Make) -> None:
    """A long line that arrives whole in one read is held to MAX_LINE in the tail as well."""
    out = make()
    long = b"x" * (3 * MAX_LINE)
    out.feed(long + b"\n")
    assert out.lines() == [
        long[:MAX_LINE].decode() + CUT_MARK.format(total=len(long)) + " ..." + "x" * END_PIECE
    ]


def test_on_line_sees_the_start_of_a_long_line_once_and_early(make: Make) -> None:
    """Sticky-error patterns are matched on the start of the line, as soon as it is in (and
    on its end when it ends)."""
    seen: list[str] = []
    out = make()
    out.on_line = seen.append
    error = "RuntimeError: CUDA error: an illegal memory access was encountered"
    data = (error + " " + "z" * 100_000 + "\nnext\n").encode()
    first, *rest = chunks(data, _READ_SIZE)
    out.feed(first)
    assert seen[0].startswith(error)  # then the middle read so far, in windows
    assert len(seen[0].encode()) == MAX_LINE
    for chunk in rest:
        out.feed(chunk)
    assert seen[-2:] == ["z" * END_PIECE, "next"]
    # and its middle in between, in overlapping windows
    assert all(set(s) == {"z"} and len(s) <= MAX_LINE for s in seen[1:-2]), seen[1:-2]


@pytest.mark.parametrize("size", [_READ_SIZE, 997])
def test_on_line_sees_the_end_of_a_long_line(make: Make, size: int) -> None:
    """Regression: on_line got only a long line's first MAX_LINE bytes, so a sticky CUDA error
    at the end of a JSON record holding a whole traceback never restarted the worker. Now it
    gets the line's last END_PIECE bytes too when the line ends (a carriage return ends a
    segment alike); memory stays bounded."""
    seen: list[str] = []
    out = make()
    out.on_line = seen.append
    error = "CUDA error: an illegal memory access was encountered"
    data = ("z" * 20_000 + " " + error + "\n" + "é" * 30_000 + "\r" + error + "\n").encode()
    for chunk in chunks(data, size):
        out.feed(chunk)
    end = ("z" * 20_000 + " " + error)[-END_PIECE:]
    at = seen.index(end)  # the first line's start, its middle (overlapping the end), its end
    assert seen[0] == "z" * MAX_LINE and all(set(s) == {"z"} for s in seen[1:at]), seen[1:at]
    assert seen[at + 1] == "é" * (MAX_LINE // 2)
    assert seen[-2:] == ["é" * (END_PIECE // 2), error]
    # the middle of the second (windows cut where they fall: a character cut is replaced)
    assert all(set(s) <= {"é", "\ufffd"} for s in seen[at + 2 : -2]), seen[at + 2 : -2]


@settings(max_examples=60, deadline=None)
@given(
    at=st.integers(min_value=0, max_value=100_000),
    size=st.sampled_from([_READ_SIZE, 4096, 997, 100_060]),
    cr=st.booleans(),
)
def test_on_line_sees_a_sticky_error_anywhere_in_a_long_line(at: int, size: int, cr: bool) -> None:
    """Regression: ``on_line`` got a long line's first MAX_LINE bytes and its last END_PIECE
    only, so a sticky CUDA error in the middle of a long record (a JSON log line whose message
    comes after a long field and before another) never restarted the worker. Now the middle
    is told too, in windows that overlap by MATCH_OVERLAP bytes: the error is seen wherever it
    is, however the reads fall, in a line or in a segment before a carriage return."""
    error = "CUDA error: an illegal memory access was encountered"
    line = ("z" * at + error + "y" * (100_000 - at)).encode()
    data = line + (b"\rprogress" if cr else b"") + b"\nnext\n"
    seen: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = WorkerOutput("w-0", Path(tmp) / "w.log", 0, 0, passthrough=False)
        out.on_line = seen.append
        try:
            for chunk in chunks(data, size):
                out.feed(chunk)
        finally:
            out.close()
    assert any(error in s for s in seen), (at, size)
    assert all(len(s.encode()) <= MAX_LINE for s in seen)
    assert seen[-1] == "next"


@pytest.mark.parametrize("windows", [0, 1, 3])
@pytest.mark.parametrize("size", [_READ_SIZE, 997])
def test_on_line_sees_a_sticky_error_where_the_end_piece_meets_what_was_told(
    make: Make, windows: int, size: int
) -> None:
    """Regression: where the end piece (the last END_PIECE bytes) began less than MATCH_OVERLAP
    bytes after what had been told of the line (its start, or the last window of its middle),
    a sticky error across that place was in neither: the untold middle was told only when it
    was longer than END_PIECE + MATCH_OVERLAP, though the end piece no longer overlapped it
    from END_PIECE on."""
    error = "CUDA error: an illegal memory access was encountered"
    # the line ends a little less than END_PIECE bytes past the last byte told (its first
    # MAX_LINE bytes, then ``windows`` windows of the middle), the error across that byte
    told = MAX_LINE + windows * (MAX_LINE - MATCH_OVERLAP)
    length = told + END_PIECE - 6
    start = told - 20
    line = ("z" * start + error).encode()
    line += b"y" * (length - len(line))
    seen: list[str] = []
    out = make()
    out.on_line = seen.append
    for chunk in chunks(line + b"\nnext\n", size):
        out.feed(chunk)
    assert any(error in s for s in seen), [len(s) for s in seen]
    assert all(len(s.encode()) <= MAX_LINE for s in seen)


@pytest.mark.parametrize("length", [MAX_LINE - 1, MAX_LINE, MAX_LINE + 1, 2 * MAX_LINE + 1])
def test_line_lengths_at_the_limit(make: Make, length: int) -> None:
    """Up to MAX_LINE bytes a line is one passthrough line and whole in the tail; past it, it
    is cut (and marked); either way the bytes all come out."""
    seen: list[bytes] = []
    out = make(seen.append)
    line = b"a" * length
    for byte_at_a_time in chunks(line + b"\n", 997):
        out.feed(byte_at_a_time)
    got = payloads(seen)
    assert b"".join(got) == line
    assert len(got) == -(-length // MAX_LINE)
    tail = out.lines()[0]
    if length <= MAX_LINE:
        assert tail == line.decode()
    else:
        end = "a" * min(length - MAX_LINE, END_PIECE)  # its end, past the start kept
        assert tail == "a" * MAX_LINE + CUT_MARK.format(total=length) + " ..." + end


def test_pieces_are_cut_between_utf8_characters(make: Make) -> None:
    """A piece never ends inside a character, so each passthrough line is valid UTF-8 and the
    tail's start of the line has no replacement character."""
    seen: list[bytes] = []
    out = make(seen.append)
    line = ("a" + "é€😀" * 10_000).encode()  # 2-, 3- and 4-byte characters, 90 kB
    for chunk in chunks(line + b"\n", _READ_SIZE):
        out.feed(chunk)
    got = payloads(seen)
    assert b"".join(got) == line
    assert all(len(p) <= MAX_LINE for p in got)
    decoded = [p.decode("utf-8") for p in got]  # strict: raises on a cut character
    assert "".join(decoded) == line.decode()
    assert "\ufffd" not in out.lines()[0]
    assert out.lines()[0].startswith("aé€😀")


def test_bytes_that_are_not_utf8_are_still_passed_whole(make: Make) -> None:
    seen: list[bytes] = []
    out = make(seen.append)
    line = b"\x80" * (3 * MAX_LINE + 5)  # continuation bytes only: no character boundary
    out.feed(line + b"\n")
    got = payloads(seen)
    assert b"".join(got) == line
    assert [len(p) for p in got] == [MAX_LINE, MAX_LINE, MAX_LINE, 5]


def test_an_endless_line_is_passed_on_with_bounded_memory(make: Make, tmp_path: Path) -> None:
    """Output without a newline (a progress bar redrawn with \\r, say) is passed through as it
    comes and never accumulates; when the pipe closes the rest comes out too."""
    first: list[bytes] = []
    total = 0

    def count(data: bytes) -> None:
        nonlocal total
        got = payloads([data])
        total += sum(map(len, got))
        if not first:
            first.append(got[0])

    out = make(count)
    chunk = b"\r 42%|" + b"#" * (_READ_SIZE - 6)
    rounds = 200  # 12.5 MiB
    out.feed(chunk)
    tracemalloc.start()
    try:
        for _ in range(rounds - 1):
            out.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * _READ_SIZE, peak
    out.flush_partial()
    assert total == rounds * len(chunk)
    assert first == [chunk[:MAX_LINE]]
    # the tail has what a terminal shows: the last update (each began with \r), cut
    shown = chunk[1:]
    assert out.lines() == [
        shown[:MAX_LINE].decode()
        + CUT_MARK.format(total=len(shown))
        + " ..."
        + shown[-END_PIECE:].decode()
    ]
    assert (tmp_path / "w.log").stat().st_size == rounds * len(chunk)


def test_an_error_at_the_end_of_a_long_line_is_in_the_tail_and_judged(make: Make) -> None:
    """Regression: a line longer than MAX_LINE was kept cut to its start, so an error at its
    end (a JSON log record whose ``exc_info`` holds a long traceback, the exception's message
    last) was in no line the death was judged by: a CUDA OOM 100 kB into the line was
    classified ``exit``. The tail now keeps the line's end too (bounded: END_PIECE bytes)."""
    from supervisor.model import ExitReason, ExitStatus
    from supervisor.output import this_run
    from supervisor.policy.classify import classify

    out = make()
    error = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    frames = "".join(f'  File \\"/app/m{i}.py\\", line {i}, in f\\n' for i in range(2000))
    record = f'{{"level": "error", "exc_info": "Traceback:\\n{frames}{error}", "pid": 7}}'
    long = record.encode()
    assert len(long) > 5 * MAX_LINE
    out.mark("started pid 7")
    for chunk in chunks(long + b"\nbye\n", 3000):
        out.feed(chunk)
    out.mark("exited: exit code 1")
    cut = out.lines()[1]
    assert cut.startswith('{"level": "error"') and cut.endswith(error + '", "pid": 7}')
    assert len(cut.encode()) <= MAX_LINE + END_PIECE + len(CUT_MARK) + 20
    found = classify(ExitReason.EXIT, ExitStatus(1, None), this_run(out.lines()), failure=True)
    assert found is not None and found.reason == "cuda_oom"
    assert error in found.evidence["log_line"]


def test_a_marker_ends_a_long_line_in_progress(make: Make) -> None:
    """The worker exits in the middle of a long line: its rest is passed through, the tail
    has its start, then the marker; what comes after starts a new line."""
    seen: list[bytes] = []
    out = make(seen.append)
    long = b"S" + b"y" * (2 * MAX_LINE)
    out.feed(long)
    out.mark("exited: code 1")
    out.feed(b"late\n")
    assert b"".join(payloads(seen)[:-1]) == long
    assert payloads(seen)[-1] == b"late"
    assert out.lines() == [
        "S" + "y" * (MAX_LINE - 1) + CUT_MARK.format(total=len(long)) + " ..." + "y" * END_PIECE,
        "--- gpu-supervisor: exited: code 1 ---",
        "late",
    ]


# --- carriage returns: the tail is what a terminal shows -----------------------------------


def test_the_error_after_a_progress_bar_is_the_tail_s_last_line(make: Make, tmp_path: Path) -> None:
    """The defect: 3000 progress updates without a newline, then the error, made one line of
    225 kB whose first 16 KiB (the bar) was all the tail and the patterns saw; the error was
    lost and the death filed as a plain exit. Now the tail has what a terminal shows (the
    error over the start of the last update) and on_line gets the error as it was printed."""
    seen: list[str] = []
    out = make()
    out.on_line = seen.append
    bar = b"".join(b"\r%5.1f%%|%-50s| %d/3000" % (i / 30, b"#" * (i // 60), i) for i in range(3000))
    error = "RuntimeError: CUDA error: out of memory"
    data = b"loading\n" + bar + b"\r" + error.encode() + b"\n"
    for chunk in chunks(data, 4096):
        out.feed(chunk)
    last_update = bar.rsplit(b"\r", 1)[1].decode()
    assert out.lines() == ["loading", error + last_update[len(error) :]]
    assert seen[0] == "loading" and seen[-1] == error and len(seen) == 3001 + 1
    assert (tmp_path / "w.log").read_bytes() == data  # the file keeps every byte


def test_a_crlf_split_between_reads_is_a_line_end(make: Make) -> None:
    out = make()
    for chunk in (b"hello\r", b"\nworld\r\n", b"a\rb\r", b"\n", b"x\r", b"y\n", b"abc\r", b"\r\n"):
        out.feed(chunk)
    assert out.lines() == ["hello", "world", "b", "y", "abc"]


def _lines(data: bytes) -> list[bytes]:
    """``data``'s lines without their ends (a CRLF end included); an unterminated last one."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [line.removesuffix(b"\r") for line in lines]


def _shown(line: bytes) -> str:
    """The oracle: what a terminal shows of ``line``: each carriage return goes back to the
    start, and what follows overwrites as far as it goes."""
    screen = b""
    for segment in line.split(b"\r"):
        screen = segment + screen[len(segment) :]
    return screen.decode("utf-8", errors="replace")


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from([b"a", b"bc", b"\r", b"\n", b"\r\n", b"\xc3\xa9"]), max_size=40),
    size=st.integers(1, 7),
)
def test_the_tail_is_the_terminal_view_however_reads_fall(parts: list[bytes], size: int) -> None:
    """Whatever the reads: the tail is what a terminal shows of each line, and on_line gets
    every stretch of text between carriage returns (an error a progress bar overwrote too)."""
    told: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = WorkerOutput("w-0", Path(tmp) / "w.log", 0, 0)
        out.on_line = told.append
        data = b"".join(parts)
        for chunk in chunks(data, size):
            out.feed(chunk)
        out.flush_partial()
        out.close()
    lines = _lines(data)
    expected = [_shown(line) for line in lines]
    if data and not data.endswith(b"\n") and expected and not expected[-1]:
        expected.pop()  # an unterminated last line that shows nothing is no line
    assert out.lines() == expected
    segments = [seg for line in lines for seg in line.split(b"\r") if seg]
    assert [t for t in told if t] == [seg.decode("utf-8", errors="replace") for seg in segments]


# --- the pipe -----------------------------------------------------------------------------


async def test_pump_lets_others_run_while_the_pipe_is_never_empty(make: Make) -> None:
    """The defect: a worker writing flat out kept the event loop in ``pump`` (it only waited
    when a read found the pipe empty): API answers and crash detection were seconds late."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, 1024 * 1024)
    except OSError:
        pytest.skip("cannot grow a pipe to 1 MiB here")
    os.set_blocking(r, False)
    size = fcntl.fcntl(w, F_GETPIPE_SZ)
    os.write(w, (b"x" * 1023 + b"\n") * (size // 1024))  # a full pipe: every read finds data
    os.close(w)
    out = make()
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await out.pump(r)
        turns_during = turns
        done = True
    assert len(out.lines()) == 200
    assert turns_during >= size // _READ_SIZE - 1, (turns_during, size)


async def test_drain_takes_the_last_words_before_the_exit_is_judged(make: Make) -> None:
    """The defect: a death was recorded before its last output was read (1 in 32 deaths of
    workers writing fast): its traceback missed the tail and the reason was a plain exit."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = make()
    serving = anyio.Event()
    out.on_line = lambda line: serving.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(out.pump, r)
        os.write(w, b"serving\n")
        with anyio.fail_after(5):
            await serving.wait()
        # the exit is handled before the pump's next read: drain takes what the pipe holds
        os.write(
            w, b"Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory\n"
        )
        out.drain()
        assert out.lines()[-1] == "torch.OutOfMemoryError: CUDA out of memory"
        os.close(w)
    assert out.lines()[-1] == "torch.OutOfMemoryError: CUDA out of memory"  # nothing twice
    assert len(out.lines()) == 3


def test_a_too_long_segment_is_told_once_and_overwritten_as_a_terminal_does(make: Make) -> None:
    told: list[str] = []
    out = make()
    out.on_line = told.append
    data = b"x" * 20_000 + b"\rshort\r\n"
    for chunk in chunks(data, 3000):
        out.feed(chunk)
    # its start, its middle up to where the end piece overlaps it, its end; then the next
    assert told[0] == "x" * MAX_LINE and told[-2:] == ["x" * END_PIECE, "short"], told
    assert all(set(t) == {"x"} for t in told[1:-2]) and len(told) <= 4, told
    assert out.lines() == [
        "short"
        + "x" * (MAX_LINE - 5)
        + CUT_MARK.format(total=20_000)
        + " ..."
        + "x" * (20_000 - MAX_LINE)
    ]


def test_passthrough_turned_off_by_a_reload_passes_nothing_more(make: Make) -> None:
    """A reload turns ``log_passthrough`` off while a line is in progress (a progress bar):
    what was held of it was still written to stdout when the worker next exited or restarted,
    and came back in front of the next line passed through if it was turned on again."""
    seen: list[bytes] = []
    out = make(seen.append)
    out.feed(b"loading 10%\rloading 20%")
    out.passthrough = False  # WorkerRunner.reconfigure
    out.feed(b"\rloading 30%")
    out.mark("exited: code 1")
    assert seen == []
    out.passthrough = True
    out.feed(b"next\n")
    assert payloads(seen) == [b"next"]
