"""The in-use memory reporter gpu-supervisor puts in front of a Python worker's ``sitecustomize``.

With ``[workers.health] in_use_reporter = "torch"`` the supervisor starts a group's workers with
this directory first on ``PYTHONPATH``, so every Python process of the worker's tree runs this
file at start-up (as OpenTelemetry's auto-instrumentation does). When the program imports
``torch`` (never before: other processes get no thread) it starts one daemon thread that, once a
second, looks whether PyTorch has initialised CUDA *itself*, and if so reads
``torch.cuda.memory_allocated()`` summed over the process's devices (what its tensors hold,
without the allocator's cache that NVML counts); every 5 s it sends the lowest reading as
``X_GPU_MEMORY_IN_USE_MB=<MiB>`` to the supervisor's notify socket, when it changed or 15 s
after the last one (a steady worker costs the supervisor one datagram per 15 s). The supervisor
sums the reports of a worker's processes and judges its GPU leak by them (docs/healing.md).
A child forked before CUDA was initialised (vLLM forks its ranks so) gets a reporter of its
own; one forked after it reports nothing (PyTorch cannot use CUDA there); spawned ones run this
file again.

It never imports torch, never initialises CUDA and never sends ``READY`` or ``WATCHDOG``: a hung
worker still misses its heartbeats. It then runs the ``sitecustomize`` it shadows (the next one
on ``sys.path``), so a distribution's or the user's own still runs.

Standard library only, and Python 3.8 syntax (3.8 or later): it runs in the worker's
interpreter, not ours.
Settings (from the supervisor): ``GPU_SUPERVISOR_IN_USE_SOCKET`` (where to send; nothing is
sent without it) and ``GPU_SUPERVISOR_IN_USE_EVERY_S`` (seconds between reports, default 5: the
floor interval of the supervisor's leak window).
"""

from __future__ import annotations

import atexit
import importlib.machinery
import importlib.util
import os
import sys
import time
import types

# Every Python process of the worker's tree runs this file: until torch is imported it loads
# nothing the interpreter does not load anyway (``socket``, ``threading``, ``contextlib`` and
# what they bring cost about 10 ms a process); the classes import them when torch is there.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

SOCKET_ENV = "GPU_SUPERVISOR_IN_USE_SOCKET"
EVERY_ENV = "GPU_SUPERVISOR_IN_USE_EVERY_S"
FIELD = "X_GPU_MEMORY_IN_USE_MB"
MIB = 1024 * 1024
DEFAULT_EVERY_S = 5.0


def in_use_mb(modules: Mapping[str, object]) -> float | None:
    """MiB that PyTorch's allocator has handed out in this process (None: nothing to report).

    None until ``torch`` is fully imported and CUDA initialised by the program itself; never
    raises (a torch without these calls, or one failing, reports nothing).
    """
    torch = modules.get("torch")
    if torch is None:
        return None
    spec = getattr(torch, "__spec__", None)
    if getattr(spec, "_initializing", False):  # still being imported (by another thread)
        return None
    try:
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return None
        count = int(cuda.device_count())
        total = sum(int(cuda.memory_allocated(i)) for i in range(count))
    except Exception:
        return None
    return total / MIB


def cuda_initialized(modules: Mapping[str, object]) -> bool:
    """Whether the program has initialised CUDA through ``torch`` (never raises)."""
    try:
        return bool(getattr(modules.get("torch"), "cuda").is_initialized())  # noqa: B009
    except Exception:
        return False


def _address(value: str) -> str:
    return "\0" + value[1:] if value.startswith("@") else value


#: Polls of torch per report interval: a report carries the lowest of them (the floor the
#: supervisor's leak detector wants; a poll can land mid-batch).
POLLS = 5
#: An unchanged figure is sent again after this many report intervals (so it stays fresh: the
#: supervisor holds a report for 6 of its floor intervals, which are one report interval).
RESEND_EVERY = 3


def should_send(
    text: str, last_text: str | None, last_at: float, now: float, every_s: float
) -> bool:
    """Whether a report ``text`` is sent now: when it differs from the last one sent, or the
    last one is ``RESEND_EVERY`` intervals old (a steady worker sends a third as often)."""
    return text != last_text or now - last_at >= RESEND_EVERY * every_s - 1e-9


class Reporter:
    """Sends the in-use reports of this process from a daemon thread.

    Every ``every_s / POLLS`` it reads what torch holds; every ``every_s`` it sends the lowest
    reading of the interval, if it changed or is due again (:func:`should_send`).
    """

    def __init__(self, address: str, every_s: float) -> None:
        import socket  # noqa: F401 - here, not first in the thread (a fork may catch that)
        import threading

        self.address = _address(address)
        self.every_s = every_s
        self.stopped = threading.Event()
        self.low: float | None = None
        self.last_text: str | None = None
        self.last_at = float("-inf")
        self.cuda_at_fork = False

    def poll(self) -> None:
        """Read what torch holds now into the interval's lowest reading."""
        mb = in_use_mb(sys.modules)
        if mb is not None and (self.low is None or mb < self.low):
            self.low = mb

    def flush(self, now: float) -> bool:
        """End the interval: send its lowest reading if due (True when sent)."""
        low, self.low = self.low, None
        if low is None:
            return False
        text = f"{FIELD}={low:.1f}"
        if not should_send(text, self.last_text, self.last_at, now, self.every_s):
            return False
        import socket  # loaded by __init__

        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)  # a supervisor that stalls never holds the thread
                sock.sendto(text.encode(), self.address)
        except OSError:
            return False  # restarting, gone or its queue full: try again next time
        self.last_text, self.last_at = text, now
        return True

    def run(self) -> None:
        polls = 0
        while not self.stopped.wait(self.every_s / POLLS):
            self.poll()
            polls += 1
            if polls % POLLS == 0:
                self.flush(time.monotonic())

    def start(self) -> None:
        import threading

        self.stopped = threading.Event()
        self.low, self.last_text, self.last_at = None, None, float("-inf")
        thread = threading.Thread(target=self.run, name="gpu-supervisor-in-use", daemon=True)
        thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def before_fork(self) -> None:
        self.cuda_at_fork = cuda_initialized(sys.modules)

    def forked(self) -> None:
        """In a child forked from this process, whose thread did not survive the fork: a
        reporter of its own (a rank forked before CUDA was initialised may use it), unless
        CUDA was initialised before the fork (PyTorch cannot use it in the child). The event
        is new either way: the parent's may have been held by its thread at the fork."""
        if self.cuda_at_fork:
            import threading

            self.stopped = threading.Event()
        else:
            self.start()


def _every(value: str | None) -> float:
    try:
        every = float(value or DEFAULT_EVERY_S)
    except ValueError:
        return DEFAULT_EVERY_S
    return every if 0.01 <= every <= 3600 else DEFAULT_EVERY_S


#: A module put in ``sys.modules`` by the first copy of this file a process runs, shared by
#: every copy (plain attributes: each copy has classes of its own): ``dirs``, the real
#: directories of the copies that have run (a second spelling or copy on the path must not
#: chain back to the first), and ``armed``, whether a reporter is armed.
MARK = "_gpu_supervisor_worker_site"


class TorchWatch:
    """A ``sys.meta_path`` entry that starts the reporter once the program has imported
    ``torch``.

    For ``torch`` it returns the spec the other finders find, its loader wrapped so that the
    reporter starts when torch's module has run: a program that only looks whether torch is
    there (``importlib.util.find_spec``, a failed ``import torch``) starts nothing. A process
    that never imports torch never gets a thread (Python 3.12 warns about ``fork()`` in a
    multi-threaded process, and a reporter would have nothing to say there).
    """

    def __init__(self, start: Callable[[], None]) -> None:
        self._start = start

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(name, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _StartAfter(spec.loader, self._started)  # type: ignore[assignment]
            return spec
        return None

    def _started(self) -> None:
        try:  # noqa: SIM105 - contextlib is not loaded for this
            sys.meta_path.remove(self)
        except ValueError:
            pass
        self._start()


class _StartAfter:
    """torch's own loader, which calls ``start`` once torch's module has run (and leaves the
    module with its own loader)."""

    def __init__(self, loader: object, start: Callable[[], None]) -> None:
        self._loader = loader
        self._start = start

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        module: types.ModuleType | None = create(spec) if create is not None else None
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        getattr(self._loader, "exec_module")(module)  # noqa: B009 - the loader is any object
        self._start()

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)


def _arm(mark: types.ModuleType) -> None:
    """Start the reporter once torch is imported (at once if it already is)."""
    address = os.environ.get(SOCKET_ENV)
    if not address or mark.armed:
        return
    setattr(mark, "armed", True)  # noqa: B010 - a bare module's attribute
    every = _every(os.environ.get(EVERY_ENV))

    def start() -> None:
        import threading

        reporter = Reporter(address, every)
        reporter.start()
        os.register_at_fork(before=reporter.before_fork, after_in_child=reporter.forked)
        # Stop before the program's own exit handlers tear torch down, but not while threads
        # it left serve on: threading's hook runs as the main thread returns, before those
        # threads are joined, and registers the stop with atexit, whose handlers run once
        # they are (the last registered runs first). Python 3.8 has only atexit.
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                atexit.register(reporter.stop)
            else:
                register(lambda: atexit.register(reporter.stop))
        except RuntimeError:
            pass  # torch imported during shutdown

    if "torch" in sys.modules:
        start()
    else:
        sys.meta_path.insert(0, TorchWatch(start))


def _chain(mark: types.ModuleType) -> None:
    """Run the ``sitecustomize`` this one shadows, as Python would have without us."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    mark.dirs.append(here)
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) not in mark.dirs]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def main() -> None:
    """What ``site`` runs: arm the reporter (once per process), then chain."""
    mark = sys.modules.get(MARK)
    if mark is None:
        mark = types.ModuleType(MARK)
        setattr(mark, "dirs", [])  # noqa: B010 - a bare module's attributes
        setattr(mark, "armed", False)  # noqa: B010
        sys.modules[MARK] = mark
    _arm(mark)
    _chain(mark)


if __name__ == "sitecustomize":  # run by ``site`` at start-up (not imported by a test)
    main()
