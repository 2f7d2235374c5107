"""The signals the entry point holds back until ``run`` handles them (a stdlib-only leaf module).

Apart from ``supervisor.processes`` (which re-exports them) so that the client commands, which
release them at once, do not import what ``run`` needs (psutil, anyio, the config models).
"""

from __future__ import annotations

import signal

#: Blocked by the entry point (``supervisor.__main__``) until ``run`` handles them.
HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def release_held_signals() -> None:
    """Unblock ``HELD_SIGNALS`` in this thread: one that arrived meanwhile is delivered now.

    Called once their handlers are in place (``run``) or at once (every other command); before
    any worker is spawned, as a child inherits the signal mask of the thread that forks it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
