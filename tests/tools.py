"""External tools that some tests run (promtool, kubernetes-validate, ...).

A missing tool skips the test with the reason, so that a developer without it still gets a
green run of everything else; with ``GPU_SUPERVISOR_REQUIRE_TOOLS=1`` (CI sets it) a missing
tool fails the test instead, so that CI never passes by skipping.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REQUIRE_ENV = "GPU_SUPERVISOR_REQUIRE_TOOLS"


def tools_required() -> bool:
    """True when a missing tool must fail the test rather than skip it."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def find_tool(name: str) -> str | None:
    """The path of executable ``name``: on ``PATH``, else next to this Python (a venv's bin)."""
    found = shutil.which(name)
    if found is None:
        found = shutil.which(name, path=str(Path(sys.executable).parent))
    return found


def require_tool(name: str, install: str = "") -> str:
    """The path of executable ``name``; skip (or fail, when tools are required) without it.

    ``install`` says how to get it (e.g. "apt-get install prometheus"), for the message.
    """
    path = find_tool(name)
    if path is not None:
        return path
    how = f" (install: {install})" if install else ""
    if tools_required():
        pytest.fail(f"{name} is not installed{how} and {REQUIRE_ENV}=1 requires it")
    pytest.skip(f"{name} is not installed{how}; set {REQUIRE_ENV}=1 to make this a failure")
