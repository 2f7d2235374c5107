"""structlog set-up: JSON lines by default, a console renderer on a TTY.

The lines go to stderr through a ``LogSink``, which never lets a write error reach the code that
logs: logging is on every path of supervision (a crash, a restart, a stop), and the reader of
stderr can go away at any time (``2>fifo`` whose reader dies, ``| tee``/``| head`` that exit, a
container log shim or a journald stream that restarts). A broken log stream must not end the
supervisor, or leave its workers without a stop signal.

* A reader that is gone never comes back (``EPIPE``, ``ECONNRESET``...; also ``EBADF``,
  ``EINVAL``: a descriptor that takes no writes): the sink is *broken*. It discards every later
  line without a system call, and points the descriptor at ``/dev/null`` (not after ``EBADF``:
  that number may be someone else's by now), so that whatever else writes there
  (``print(file=sys.stderr)``, the interpreter's final flush, a C library) succeeds instead of
  raising ``BrokenPipeError`` or ending the process with a failure code.
* Any other error (``ENOSPC``, ``EDQUOT``, ``EIO`` on a file; ``EAGAIN`` on a non-blocking
  stderr shared with someone else) may clear up: that line is dropped, and the next line tries
  again (one failed system call per line: cheap). The first line that gets through is preceded
  by one ``log.write_recovered`` notice that says how many lines were lost and why.

``LogSink.on_health`` (as ``output.RotatingFile.on_health``) is called with the error at the
start of each run of failures, and with ``None`` when lines get through again: where the stream
is gone for good, it is the one place left to tell (an exception from it is ignored).
``LogSink.dropped`` counts the lost lines, ``LogSink.broken`` says the stream is gone.

Errors that repeat (the event loop failing every ``accept()`` once the descriptors are used up,
a server warning for every bad request) must not flood the stream either: ``RepeatLimiter``
logs one line per distinct message per minute and counts the rest, and
``install_loop_exception_handler`` puts the event loop's exception handler (asyncio's default
prints a plain-text traceback per call) and the ``asyncio`` logger behind one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import structlog

from supervisor.streams import STALL_WAIT_S, UnblockedWriter

LogFormat = Literal["auto", "json", "console"]

#: Errors after which the stream takes no line ever again: its reader is gone, or it is not
#: writable at all. Anything else is taken as passing: the line is dropped, the next one tried.
PERMANENT_ERRORS = frozenset(
    {errno.EPIPE, errno.ESHUTDOWN, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF, errno.EINVAL}
)

#: The event logged (in the stream's own format) before the first line that gets through
#: after a run of failures that was not for good.
RECOVERED_EVENT = "log.write_recovered"
#: The error of a line that found the stream full for ``STALL_WAIT_S``.
STALLED = "the reader stopped reading: the stream is full"


def _fileno(stream: TextIO | None) -> int | None:
    if stream is None:
        return None
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.StringIO, pytest's capsys, closed
        return None


class LogSink:
    """The logger that structlog's bound loggers write rendered lines to (one for all of them).

    With a file descriptor behind the stream (stderr), each line is one ``os.write`` of the
    encoded line and its newline: nothing is held in the text stream's buffer, so a line that
    fails is dropped whole, and nothing stale is left for a later flush. A stream without a
    descriptor (``io.StringIO``) is written and flushed as ``structlog.WriteLogger`` does.
    Thread-safe: a lock keeps the lines of threads apart, as ``WriteLogger``'s does.
    """

    __slots__ = (
        "_cut",
        "_encoding",
        "_errors",
        "_fd",
        "_lock",
        "_put",
        "_unreported",
        "_writer",
        "broken",
        "dropped",
        "fault",
        "healthy",
        "on_health",
        "render_notice",
        "stream",
    )

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self._fd = _fileno(stream)
        self._encoding: str = getattr(stream, "encoding", None) or "utf-8"
        self._errors: str = getattr(stream, "errors", None) or "backslashreplace"
        self._put: Callable[[str], None] = self._put_fd if self._fd is not None else self._put_text
        self._writer = UnblockedWriter(self._fd) if self._fd is not None else None
        self._lock = threading.Lock()
        #: False during a run of failures (and for good once broken): the fast path is off.
        self.healthy = stream is not None
        #: True once the stream is gone for good: every line is discarded.
        self.broken = stream is None
        #: The first error of the current run of failures (None while lines get through).
        self.fault: OSError | None = None
        #: Lines lost in all.
        self.dropped = 0
        self._unreported = 0  # lines lost in the current run, for the recovery notice
        self._cut = False  # a line was cut short: the next write starts a new line first
        #: Called with the error at the start of a run of failures (and again if the stream
        #: then turns out to be gone for good), with None when lines get through again; in the
        #: thread that logged, outside the sink's lock (it may log).
        self.on_health: Callable[[OSError | None], None] | None = None
        #: Renders the recovery notice's event dict as a line (set by ``configure_logging``).
        self.render_notice: Callable[[dict[str, Any]], str] = _render_json

    def msg(self, message: str) -> None:
        """Write ``message`` and a newline; never raises."""
        if self.healthy:
            try:
                with self._lock:
                    self._put(message)
            except OSError as exc:
                self._failed(exc)
        elif not self.broken:
            self._retry(message)
        else:
            self.dropped += 1  # approximate under threads: no lock on the discarding path

    def close(self) -> None:
        """Release the sink's own description of the stream (the stream is the caller's): a
        reader of the pipe sees its end once every writer is gone, this one included."""
        if self._writer is not None:
            with self._lock:
                self._writer.close()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg

    def _put_fd(self, message: str) -> None:
        data = (message + "\n").encode(self._encoding, self._errors)
        fd = self._fd
        assert fd is not None
        # A reader that stopped reading must not stop supervision: a line waits for room at
        # most STALL_WAIT_S, and not at all while the stream is known to be stalled.
        assert self._writer is not None
        written = self._writer.write(data, STALL_WAIT_S if self.healthy else 0.0)
        if written < len(data):
            if written:
                self._cut = True  # the next line that gets through starts a new line first
            raise OSError(errno.EAGAIN, STALLED)

    def _put_text(self, message: str) -> None:
        stream = self.stream
        assert stream is not None
        try:
            stream.write(message + "\n")
            stream.flush()
        except ValueError as exc:  # a closed stream: gone for good
            raise OSError(errno.EBADF, str(exc)) from None

    def _failed(self, exc: OSError) -> None:
        with self._lock:
            self.dropped += 1
            self._unreported += 1
            self.healthy = False
            first = self.fault is None
            if first:
                self.fault = exc
            gone = exc.errno in PERMANENT_ERRORS and not self.broken
            if gone:
                self.broken = True
                self.fault = exc
                if exc.errno != errno.EBADF:  # a closed descriptor's number is not ours now
                    self._silence()
        if first or gone:
            self._tell(exc)

    def _tell(self, exc: OSError | None) -> None:
        # Advisory: a failing callback must not turn a log call into an error either.
        if self.on_health is not None:
            with contextlib.suppress(Exception):
                self.on_health(exc)

    def _silence(self) -> None:
        """Point the descriptor at /dev/null: later writes by anyone there (the interpreter's
        final flush of ``sys.stderr`` included) succeed instead of failing."""
        fd = self._fd
        if fd is None:
            return
        with contextlib.suppress(OSError):
            inheritable = os.get_inheritable(fd)
            devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.dup2(devnull, fd, inheritable=inheritable)
            finally:
                os.close(devnull)
        if self._writer is not None:  # its own description of the stream that is gone
            self._writer.close()

    def _retry(self, message: str) -> None:
        """A line after a failure that was not for good: the notice of what was lost, then it."""
        try:
            with self._lock:
                if self.healthy:  # another thread got through meanwhile
                    self._put(message)
                    return
                fault = self.fault
                notice = self.render_notice(
                    {
                        "event": RECOVERED_EVENT,
                        "dropped": self._unreported,
                        "error": _describe(fault),
                        "errno": _errno_name(fault),
                    }
                )
                lead = "\n" if self._cut else ""  # ends the line cut short
                self._put(f"{lead}{notice}\n{message}")
                self._cut = False
                self._unreported = 0
                self.fault = None
                self.healthy = True
        except OSError as exc:
            self._failed(exc)
            return
        self._tell(None)


def _describe(exc: OSError | None) -> str:
    if exc is None:
        return "unknown"
    return exc.strerror or str(exc)


def _errno_name(exc: OSError | None) -> str | None:
    if exc is None or exc.errno is None:
        return None
    return errno.errorcode.get(exc.errno, str(exc.errno))


def _render_json(event: dict[str, Any]) -> str:
    return json.dumps(event)


def _renderer_of(
    processors: Sequence[structlog.typing.Processor],
) -> Callable[[dict[str, Any]], str]:
    """Render an event dict through ``processors`` as a ``warning`` (for the sink's notice)."""

    def render(event: dict[str, Any]) -> str:
        result: Any = event
        for processor in processors:
            result = processor(None, "warning", result)
        return result if isinstance(result, str) else json.dumps(event, default=str)

    return render


_sink: LogSink | None = None


def log_sink() -> LogSink | None:
    """The sink configured last (None before ``configure_logging``): to hook ``on_health``."""
    return _sink


def configure_logging(
    fmt: LogFormat = "auto", level: str = "info", stream: TextIO | None = None
) -> LogSink:
    """Configure structlog to write to ``stream`` (default: stderr) through a ``LogSink``."""
    global _sink
    if stream is None:
        stream = sys.stderr  # None where the process was started with descriptor 2 closed
    tty = False
    if stream is not None:
        with contextlib.suppress(OSError, ValueError):
            tty = stream.isatty()
            stream.flush()  # what was written through the stream before goes out first
    if fmt == "auto":
        fmt = "console" if tty else "json"
    renderer: structlog.typing.Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=tty)
    else:
        renderer = structlog.processors.JSONRenderer()
    if _sink is not None:  # replaced: its own description of its stream goes
        _sink.close()
    sink = LogSink(stream)
    stamp: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    sink.render_notice = _renderer_of([*stamp, renderer])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=lambda *_: sink,
        cache_logger_on_first_use=True,
    )
    _sink = sink
    return sink


# --- repeated lines -------------------------------------------------------------------------

#: A message that repeats is logged at most once in this long; the repeats are counted.
REPEAT_WINDOW_S = 60.0
#: Distinct messages remembered at most (past that, the longest-unseen one is forgotten).
REPEAT_KEYS = 256
#: The event of the loop's exception handler (``install_loop_exception_handler``).
LOOP_EXCEPTION_EVENT = "loop.exception"
#: The event of the ``asyncio`` logger's own warnings and errors.
ASYNCIO_LOG_EVENT = "loop.log"

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_KEY_CHARS = 200
_REPR_CHARS = 300

#: ``call_later(delay, callback)`` of an event loop.
CallLater = Callable[[float, Callable[[], None]], object]
#: What a limiter writes through: ``emit(level, event, fields)``.
Emit = Callable[[str, str, dict[str, Any]], None]


def repeat_key(text: str) -> str:
    """``text`` as a key of ``RepeatLimiter``: object addresses (``0x7f...``) masked, so that the
    same error from another object is the same message, and cut short."""
    return _ADDRESS.sub("0x?", text)[:_KEY_CHARS]


def _structlog_emit(level: str, event: str, fields: dict[str, Any]) -> None:
    getattr(structlog.get_logger(), level)(event, **fields)


@dataclass(slots=True)
class _Window:
    start: float
    held: int = 0  # occurrences since the last line, without a line of their own
    last: tuple[str, str, dict[str, Any]] | None = None  # the last of them
    flush_due: bool = False


class RepeatLimiter:
    """At most one line per key every ``every_s`` seconds; what it holds back is counted.

    The first occurrence of a key is logged at once and opens a window of ``every_s``; the
    occurrences within it are held back. When the window ends (with ``call_later``: a timer on
    the event loop; without: at the key's next occurrence), the last of them is logged, and a
    new window opens. Every line carries ``suppressed``: the occurrences of its key since the
    line before that got no line of their own. So ``occurrences = lines + sum(suppressed)``, and
    a flood of half a million identical errors is two lines a minute at most.

    Thread-safe; ``emit`` is called outside the lock.
    """

    def __init__(
        self,
        *,
        every_s: float = REPEAT_WINDOW_S,
        max_keys: int = REPEAT_KEYS,
        clock: Callable[[], float] = time.monotonic,
        emit: Emit = _structlog_emit,
    ) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        self._clock = clock
        self._emit = emit
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}  # oldest window first

    def log(
        self,
        key: str,
        level: str,
        event: str,
        fields: dict[str, Any],
        call_later: CallLater | None = None,
    ) -> bool:
        """Log ``event`` now, or count it; True if a line was written now."""
        now = self._clock()
        lines: list[tuple[str, str, dict[str, Any]]] = []
        schedule: _Window | None = None
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.start < self.every_s:
                window.held += 1
                window.last = (level, event, fields)
                if call_later is not None and not window.flush_due:
                    window.flush_due = True
                    schedule = window
            else:
                held = window.held if window is not None else 0
                self._windows.pop(key, None)
                self._windows[key] = _Window(now)
                lines.append((level, event, {**fields, "suppressed": held}))
                while len(self._windows) > self.max_keys:
                    oldest = next(iter(self._windows))
                    dropped = self._windows.pop(oldest)
                    if dropped.held and dropped.last is not None:
                        lines.append(_held_line(dropped))
        if schedule is not None and call_later is not None:
            delay = max(0.0, schedule.start + self.every_s - now)
            try:
                call_later(delay, lambda: self._flush(key, schedule))
            except Exception:  # a closed loop: told with the next occurrence instead
                schedule.flush_due = False
        for line in lines:
            self._emit(*line)
        return bool(lines)

    def _flush(self, key: str, window: _Window) -> None:
        """The end of ``window``: the last occurrence it held back, with the count of the rest."""
        with self._lock:
            window.flush_due = False
            if self._windows.get(key) is not window or not window.held or window.last is None:
                return
            line = _held_line(window)
            window.start = self._clock()
            window.held = 0
            window.last = None
        self._emit(*line)


def _held_line(window: _Window) -> tuple[str, str, dict[str, Any]]:
    assert window.last is not None
    level, event, fields = window.last
    return level, event, {**fields, "suppressed": window.held - 1}


def _short(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # a repr that fails must not lose the error being reported
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _REPR_CHARS else text[: _REPR_CHARS - 3] + "..."


def _error_kind(exc: BaseException) -> str:
    kind = type(exc).__name__
    if isinstance(exc, OSError) and exc.errno is not None:
        kind += f"[{errno.errorcode.get(exc.errno, exc.errno)}]"
    return kind


def _loop_call_later() -> CallLater | None:
    """The running event loop's ``call_later`` (None off the loop's thread)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later


class LoopExceptionHandler:
    """An asyncio exception handler that logs ``loop.exception`` through structlog.

    asyncio's default handler prints a plain-text traceback to stderr for every call: with the
    descriptors used up, the loop calls it on every failed ``accept()``, hundreds of thousands
    of times a minute. This one writes one JSON line per distinct message (and error type) per
    ``REPEAT_WINDOW_S``, with ``suppressed`` counting the repeats (``RepeatLimiter``); the
    traceback, when there is one, is a field of that line. It never raises.
    """

    def __init__(self, limiter: RepeatLimiter | None = None) -> None:
        self.limiter = limiter if limiter is not None else RepeatLimiter()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            message = str(context.get("message") or "unhandled exception in event loop")
            fields: dict[str, Any] = {"message": message}
            kind = ""
            exc = context.get("exception")
            if isinstance(exc, BaseException):
                kind = _error_kind(exc)
                fields["error"] = _short(exc)
                fields["error_type"] = kind
                if exc.__traceback__ is not None:
                    fields["exc_info"] = exc
            for name in ("task", "future", "handle", "protocol", "transport", "socket"):
                if name in context:
                    fields[name] = _short(context[name])
            call_later = None if loop.is_closed() else loop.call_later
            key = repeat_key(f"{message}|{kind}")
            self.limiter.log(key, "error", LOOP_EXCEPTION_EVENT, fields, call_later)


class RepeatLimitedHandler(logging.Handler):
    """A stdlib logger's records as structlog events named ``event`` (``message``, ``logger``,
    ``error``), each message at most once per window (``RepeatLimiter``)."""

    def __init__(self, event: str, limiter: RepeatLimiter | None = None) -> None:
        super().__init__()
        self.event = event
        self.limiter = limiter if limiter is not None else RepeatLimiter()

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            fields: dict[str, Any] = {"message": record.getMessage(), "logger": record.name}
            if record.exc_info and record.exc_info[1] is not None:
                fields["error"] = _short(record.exc_info[1])
            level = "error" if record.levelno >= logging.ERROR else "warning"
            key = repeat_key(f"{record.name}|{record.msg}")
            self.limiter.log(key, level, self.event, fields, _loop_call_later())


def route_stdlib_logger(name: str, event: str, level: int = logging.WARNING) -> logging.Logger:
    """Send the stdlib logger ``name`` (from ``level`` up) to structlog as ``event``, repeats
    limited, instead of to the root logger's handlers (plain text on stderr)."""
    logger = logging.getLogger(name)
    logger.setLevel(level)
    logger.propagate = False
    logger.handlers = [RepeatLimitedHandler(event)]
    return logger


def install_loop_exception_handler(
    loop: asyncio.AbstractEventLoop | None = None,
) -> LoopExceptionHandler | None:
    """Make ``loop`` (default: the running asyncio loop) report its unhandled errors through
    ``LoopExceptionHandler``, and the ``asyncio`` logger's own warnings through structlog
    (``loop.log``), both with repeats limited. Once per loop: a second call returns the
    handler in place. None where there is no asyncio loop (under trio): nothing to do.
    """
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
    current = loop.get_exception_handler()
    if isinstance(current, LoopExceptionHandler):
        return current
    handler = LoopExceptionHandler()
    loop.set_exception_handler(handler)
    route_stdlib_logger("asyncio", ASYNCIO_LOG_EVENT)
    return handler
