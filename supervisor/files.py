"""Directories made for the supervisor's records, whatever its umask."""

from __future__ import annotations

from pathlib import Path

#: The mode of a missing parent of ``state_dir`` made along with it: searchable, never
#: writable by others (``Path.mkdir(parents=True)`` makes parents ``0o777`` less the umask:
#: with a umask of 0, anyone could swap ``state_dir`` for a directory of theirs).
PARENT_MODE = 0o755


def make_dir(path: Path, mode: int) -> None:
    """Make ``path`` (``mode``, less the umask) and its missing parents (``PARENT_MODE``);
    nothing where it is a directory already (``FileExistsError`` where it is something else)."""
    parent = path.parent
    if parent != path and not parent.is_dir():
        make_dir(parent, PARENT_MODE)
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        if not path.is_dir():
            raise
