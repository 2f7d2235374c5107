"""Validate documents against the JSON Schemas shipped in ``docs/schemas/``."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"


@cache
def _registry() -> Registry:
    resources = []
    for path in SCHEMAS.glob("*.schema.json"):
        schema = json.loads(path.read_text())
        resource = Resource.from_contents(schema)
        resources += [(schema["$id"], resource), (path.name, resource)]
    return Registry().with_resources(resources)


def validate(doc: Any, name: str) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` matches ``docs/schemas/<name>``."""
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator(schema, registry=_registry()).validate(doc)
    _check_times(doc)


def _check_times(node: Any, key: str = "") -> None:
    """Every ``*_at``/``t`` string is RFC 3339 UTC (the schema's ``format`` is not enforced)."""
    if isinstance(node, dict):
        for k, v in node.items():
            _check_times(v, k)
    elif isinstance(node, list):
        for v in node:
            _check_times(v, key)
    elif isinstance(node, str) and (key.endswith("_at") or key in ("t", "at")):
        assert node.endswith("Z"), f"{key}: {node!r} is not UTC"
        datetime.fromisoformat(node)


def validate_file(path: Path) -> dict[str, Any]:
    """Parse and validate a ``state.json`` or post-mortem file; return its content."""
    doc = json.loads(path.read_bytes())
    validate(doc, "state.schema.json" if path.name == "state.json" else "postmortem.schema.json")
    assert isinstance(doc, dict)
    return doc
