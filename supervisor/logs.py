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
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TextIO

import structlog

LogFormat = Literal["auto", "json", "console"]

#: Errors after which the stream takes no line ever again: its reader is gone, or it is not
#: writable at all. Anything else is taken as passing: the line is dropped, the next one tried.
PERMANENT_ERRORS = frozenset(
    {errno.EPIPE, errno.ESHUTDOWN, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF, errno.EINVAL}
)

#: The event logged (in the stream's own format) before the first line that gets through
#: after a run of failures that was not for good.
RECOVERED_EVENT = "log.write_recovered"


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

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg

    def _put_fd(self, message: str) -> None:
        data = (message + "\n").encode(self._encoding, self._errors)
        fd = self._fd
        assert fd is not None
        written = os.write(fd, data)
        if written < len(data):  # a signal, a non-blocking descriptor, a full disk
            self._put_rest(fd, data, written)

    def _put_rest(self, fd: int, data: bytes, written: int) -> None:
        with memoryview(data) as view:
            while written < len(view):
                try:
                    more = os.write(fd, view[written:])
                except OSError:
                    self._cut = True
                    raise
                if more <= 0:
                    self._cut = True
                    raise OSError(errno.EIO, "the log stream took no more bytes")
                written += more

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
