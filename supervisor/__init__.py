"""gpu-supervisor: a process supervisor sidecar for GPU inference workers."""

from __future__ import annotations

from supervisor._version import __version__
from supervisor.config import Settings


def run(config_path: str) -> int:
    """Run the supervisor with the config at ``config_path`` until stopped; return the exit code."""
    from supervisor.cli import main

    return main(["run", "-c", config_path])


__all__ = ["Settings", "__version__", "run"]
