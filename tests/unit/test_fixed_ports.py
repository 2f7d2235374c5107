"""Integration tests whose workers bind fixed ports (``port_base``, a health URL) run side by
side under xdist: each such port must belong to one test only (regression: a test given port
18968, which another test used too, failed a CI run when the two ran at the same time). Only
the literal ports are checked: give a group of N replicas a ``port_base`` whose next N - 1
ports no other test names either."""

from __future__ import annotations

import ast
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parent.parent / "integration"
#: Where the suite's fixed ports are: high enough to be no ephemeral port on Linux's default
#: range (32768-60999) and no well-known service's.
LOW, HIGH = 18000, 19999


def _ports_by_test() -> dict[int, set[str]]:
    used: dict[int, set[str]] = {}
    for path in sorted(INTEGRATION.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            for inner in ast.walk(node):  # its body and its decorators (parametrize)
                if (
                    isinstance(inner, ast.Constant)
                    and type(inner.value) is int
                    and LOW <= inner.value <= HIGH
                ):
                    used.setdefault(inner.value, set()).add(f"{path.name}::{node.name}")
    return used


def test_each_fixed_port_belongs_to_one_test() -> None:
    used = _ports_by_test()
    assert used, "no fixed port found: the scan is broken"
    shared = {port: sorted(tests) for port, tests in used.items() if len(tests) > 1}
    assert not shared, f"fixed ports used by more than one test: {shared}"
