"""``python -m supervisor`` and the ``gpu-supervisor`` console script."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

# Held back until `run` has installed its handlers (supervisor.sigmask.HELD_SIGNALS; every
# other command releases them at once): as a container's PID 1 the kernel drops a signal that
# has no handler, so a `docker stop` in the first half second would otherwise be lost and
# end, after the grace period, in a SIGKILL. Blocked, it waits and is handled.
signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))

# Start-up allocates many objects and no garbage worth collecting: the collector is turned on
# again (after a gc.freeze) once the runtime has spawned its workers, or at once by any other
# command (supervisor.cli.main).
gc.disable()

from supervisor.cli import main as _main  # noqa: E402


def main() -> None:
    """Console-script entry point.

    After the command has returned, everything worth keeping is written: the streams are
    flushed and the process ends with ``os._exit``. Tearing down the interpreter's modules
    (FastAPI, pydantic...) would add ~50 ms to every stop, which systemd and the operator wait
    for, and nothing in it does anything.
    """
    code = _main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with it closed (``>&-``): nothing to flush
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            code = code or 1
    os._exit(code)


if __name__ == "__main__":
    main()
