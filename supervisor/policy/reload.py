"""Reload diff (pure): which groups a new configuration leaves alone, changes, removes or adds."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from supervisor.config import WorkerGroup


@dataclass(frozen=True, slots=True)
class ReloadDiff:
    """Group names by what a reload does to them, each in config order."""

    unchanged: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    added: tuple[str, ...]

    @property
    def is_noop(self) -> bool:
        """True when the reload changes no group."""
        return not (self.changed or self.removed or self.added)


def diff_groups(
    old: Sequence[WorkerGroup], new: Sequence[WorkerGroup], dirty: Collection[str] = ()
) -> ReloadDiff:
    """Compare two group lists by name; a group is changed when any of its settings differ.

    ``dirty``: groups whose workers may not match ``old`` (a rollout that halted part-way:
    some run the definition it rolled out, some the one before), changed whatever the files
    say, so that reloading either definition brings every worker to it."""
    old_by_name = {g.name: g for g in old}
    new_names = {g.name for g in new}
    unchanged: list[str] = []
    changed: list[str] = []
    added: list[str] = []
    for g in new:
        before = old_by_name.get(g.name)
        if before is None:
            added.append(g.name)
        elif before == g and g.name not in dirty:
            unchanged.append(g.name)
        else:
            changed.append(g.name)
    removed = [g.name for g in old if g.name not in new_names]
    return ReloadDiff(tuple(unchanged), tuple(changed), tuple(removed), tuple(added))
