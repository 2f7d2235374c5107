"""gpu-supervisor: a process supervisor sidecar for GPU inference workers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from supervisor._version import __version__

if TYPE_CHECKING:
    from supervisor.config import Settings


def __getattr__(name: str) -> Any:
    # Imported on first use: the entry point (supervisor.__main__) must run before pydantic is
    # imported, to hold back signals that would otherwise be lost (see there).
    if name == "Settings":
        from supervisor.config import Settings

        return Settings
    raise AttributeError(f"module 'supervisor' has no attribute {name!r}")


def run(config_path: str) -> int:
    """Run the supervisor with the config at ``config_path`` until stopped; return the exit code."""
    from supervisor.cli import main

    return main(["run", "-c", config_path])


__all__ = ["Settings", "__version__", "run"]
