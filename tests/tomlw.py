"""A minimal TOML writer for test configs (strings, numbers, bools, lists, tables)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def _table(prefix: str, table: Mapping[str, Any], lines: list[str], header: str) -> None:
    lines.append(header)
    subtables = []
    for k, v in table.items():
        if isinstance(v, Mapping) and k != "env":
            subtables.append((k, v))
        else:
            lines.append(f"{k} = {_value(v)}")
    for k, v in subtables:
        _table(f"{prefix}.{k}", v, lines, f"[{prefix}.{k}]")


def dumps(config: Mapping[str, Any]) -> str:
    """Serialize ``{"supervisor": {...}, "workers": [{...}]}``-shaped configs."""
    lines: list[str] = []
    for key, value in config.items():
        if isinstance(value, list) and value and all(isinstance(x, Mapping) for x in value):
            for item in value:
                _table(key, item, lines, f"[[{key}]]")
        elif isinstance(value, Mapping):
            _table(key, value, lines, f"[{key}]")
        else:
            lines.insert(0, f"{key} = {_value(value)}")
    return "\n".join(lines) + "\n"
