"""Errors the event loop reports, and other repeats, as rate-limited JSON lines (logs.py).

Regression: with its descriptors used up, the supervisor's loop failed every ``accept()`` and
asyncio's default exception handler printed a plain-text traceback for each: 460,643 of them,
187 MB of non-JSON stderr in 40 seconds.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog

from supervisor import logs
from supervisor.logs import (
    LoopExceptionHandler,
    RepeatLimiter,
    install_loop_exception_handler,
)

ACCEPT_FAILED = "socket.accept() out of system resource"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Timers:
    """A stand-in for ``loop.call_later``: the callbacks run when the test says."""

    def __init__(self) -> None:
        self.due: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay: float, callback: Callable[[], None]) -> None:
        self.due.append((delay, callback))

    def run(self) -> None:
        due, self.due = self.due, []
        for _, callback in due:
            callback()


def test_a_repeated_message_is_one_line_a_window_and_the_rest_are_counted() -> None:
    clock, timers = Clock(), Timers()
    lines: list[tuple[str, str, dict[str, Any]]] = []
    limiter = RepeatLimiter(every_s=60, clock=clock, emit=lambda *line: lines.append(line))

    def occur(key: str, n: int, call_later: Any = timers) -> None:
        for i in range(n):
            limiter.log(key, "error", "loop.exception", {"message": key, "i": i}, call_later)

    occur("accept", 1000)
    occur("other", 3)
    assert lines == [
        ("error", "loop.exception", {"message": "accept", "i": 0, "suppressed": 0}),
        ("error", "loop.exception", {"message": "other", "i": 0, "suppressed": 0}),
    ]
    assert [delay for delay, _ in timers.due] == [60, 60]  # one timer a key, not one a repeat

    # the window ends: the last repeat held back is told, with the count of the others
    clock.now += 60
    timers.run()
    assert lines[2:] == [
        ("error", "loop.exception", {"message": "accept", "i": 999, "suppressed": 998}),
        ("error", "loop.exception", {"message": "other", "i": 2, "suppressed": 1}),
    ]
    # ... which opened the next window: a repeat within it is held back again
    clock.now += 30
    occur("accept", 5)
    assert len(lines) == 4 and len(timers.due) == 1
    # without a timer (off the loop), the count goes with the key's next line
    clock.now += 31
    occur("accept", 1, call_later=None)
    assert lines[4] == ("error", "loop.exception", {"message": "accept", "i": 0, "suppressed": 5})
    timers.run()  # that window was told already: nothing more
    assert len(lines) == 5
    # every occurrence is accounted for: a line of its own or a count in the next line
    assert len(lines) + sum(f["suppressed"] for _, _, f in lines) == 1000 + 3 + 5 + 1


def test_keys_are_bounded_and_addresses_do_not_make_messages_distinct() -> None:
    clock = Clock()
    lines: list[tuple[str, str, dict[str, Any]]] = []
    limiter = RepeatLimiter(
        every_s=60, max_keys=2, clock=clock, emit=lambda *line: lines.append(line)
    )
    key = logs.repeat_key
    assert key("Exception in callback <Handle 0x7f12ab>") == key(
        "Exception in callback <Handle 0x7e0>"
    )
    for name in ("a", "a", "b", "c"):  # "a" is forgotten when "c" comes: its repeat is told
        limiter.log(key(name), "warning", "x", {"name": name})
    assert [(f["name"], f["suppressed"]) for _, _, f in lines] == [
        ("a", 0),
        ("b", 0),
        ("c", 0),
        ("a", 0),
    ]


@pytest.fixture
def json_log() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """structlog to a buffer (JSON lines); the ``asyncio`` logger and structlog restored after."""
    saved = structlog.get_config()
    asyncio_logger = logging.getLogger("asyncio")
    saved_logger = (asyncio_logger.handlers[:], asyncio_logger.propagate, asyncio_logger.level)
    out = io.StringIO()
    logs.configure_logging("json", "info", stream=out)
    yield lambda: [json.loads(line) for line in out.getvalue().splitlines()]
    structlog.configure(**saved)
    asyncio_logger.handlers, asyncio_logger.propagate, level = saved_logger
    asyncio_logger.setLevel(level)


def emfile() -> OSError:
    try:
        raise OSError(errno.EMFILE, "Too many open files")
    except OSError as exc:
        return exc


def test_the_loop_reports_its_errors_as_json_lines_repeats_limited(
    json_log: Callable[[], list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Half a million failed accepts were half a million tracebacks on stderr; now: one JSON
    line, then one a window with the count."""
    loop = asyncio.new_event_loop()
    try:
        handler = install_loop_exception_handler(loop)
        assert isinstance(handler, LoopExceptionHandler)
        assert loop.get_exception_handler() is handler
        assert install_loop_exception_handler(loop) is handler  # once per loop
        handler.limiter.every_s = 0.2  # the window, short for the test

        started = time.monotonic()
        for _ in range(20000):
            loop.call_exception_handler(
                {"message": ACCEPT_FAILED, "exception": emfile(), "socket": object()}
            )
        took = time.monotonic() - started
        loop.call_exception_handler({"message": "Exception in callback <Handle 0x7f00>"})
        first = json_log()[0]
        assert first["event"] == "loop.exception" and first["level"] == "error"
        assert first["message"] == ACCEPT_FAILED
        assert first["error_type"] == "OSError[EMFILE]"
        assert first["error"] == "OSError(24, 'Too many open files')"
        assert first["suppressed"] == 0
        assert "Traceback" in first["exception"]  # the traceback, as a field of the line
        assert first["socket"].startswith("<object object at 0x")
        [callback] = [e for e in json_log() if e["message"] != ACCEPT_FAILED]
        assert callback["event"] == "loop.exception" and "error_type" not in callback

        def accepts() -> list[dict[str, Any]]:
            return [e for e in json_log() if e["message"] == ACCEPT_FAILED]

        async def all_told() -> None:  # the last window's repeats, on the loop's own timer
            deadline = time.monotonic() + 5
            while sum(1 + e["suppressed"] for e in accepts()) < 20000:
                assert time.monotonic() < deadline, accepts()
                await asyncio.sleep(0.01)

        loop.run_until_complete(all_told())
        # one line a window: the first, then one for each window that had repeats
        assert len(accepts()) <= 2 + took / 0.2
        assert accepts()[-1]["suppressed"] > 0
    finally:
        loop.close()
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_the_asyncio_logger_goes_to_structlog_too(
    json_log: Callable[[], list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    loop = asyncio.new_event_loop()
    try:
        install_loop_exception_handler(loop)
        for _ in range(100):
            logging.getLogger("asyncio").warning("socket.send() raised exception.")
    finally:
        loop.close()
    [line] = json_log()
    assert line["event"] == "loop.log" and line["level"] == "warning"
    assert line["message"] == "socket.send() raised exception." and line["logger"] == "asyncio"
    assert capsys.readouterr().err == ""


def test_a_failing_handler_never_raises_into_the_loop() -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("log stream gone")

    handler = LoopExceptionHandler(RepeatLimiter(emit=broken))
    loop = asyncio.new_event_loop()
    try:
        handler(loop, {"message": "x", "exception": emfile()})
    finally:
        loop.close()


async def test_installing_without_an_asyncio_loop_does_nothing() -> None:
    """Under trio there is no asyncio loop: nothing to install (the runtime may call it
    anyway)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        assert install_loop_exception_handler() is None
    else:  # on asyncio: installed on the running loop (and taken off again)
        loop = asyncio.get_running_loop()
        saved = loop.get_exception_handler()
        asyncio_logger = logging.getLogger("asyncio")
        kept = (asyncio_logger.handlers[:], asyncio_logger.propagate, asyncio_logger.level)
        try:
            assert isinstance(install_loop_exception_handler(), LoopExceptionHandler)
        finally:
            loop.set_exception_handler(saved)
            asyncio_logger.handlers, asyncio_logger.propagate, level = kept
            asyncio_logger.setLevel(level)
