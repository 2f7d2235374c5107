"""procfs.owner_of: whose worker a notify sender is, on stated /proc reads (the races of a
chain that changes under the walk are made by the reads given)."""

from __future__ import annotations

from collections.abc import Callable

from supervisor.procfs import ANCESTORS_MAX, WALK_RESTARTS, ProcStat, owner_of

ME = 100
LAUNCHER = 200  # a worker's main process
MIDDLE = 300  # the process between a double-forked daemon and its launcher
DAEMON = 400


def stat(pid: int, ppid: int, start: int = 1000) -> ProcStat:
    return ProcStat(pid=pid, ppid=ppid, cpu_s=0.0, rss_mb=0.0, start_ticks=start, zombie=False)


def reads(
    table: dict[int, list[ProcStat | None]],
) -> tuple[Callable[[int], ProcStat | None], list[int]]:
    """A reader answering, for each pid, its listed reads in turn (the last one after them)."""
    asked: list[int] = []

    def read(pid: int) -> ProcStat | None:
        asked.append(pid)
        answers = table.get(pid, [None])
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return read, asked


def adopt_as(owner: str, calls: list[tuple[int, int]]) -> Callable[[int, int], str | None]:
    def adopt(pid: int, start_ticks: int) -> str | None:
        calls.append((pid, start_ticks))
        return owner

    return adopt


def test_a_main_process_is_its_workers_without_a_read() -> None:
    read, asked = reads({})
    assert owner_of(LAUNCHER, {LAUNCHER: "w-0"}, ME, adopt_as("x", []), read) == "w-0"
    assert asked == []


def test_a_descendant_is_its_ancestors_worker() -> None:
    read, _ = reads({DAEMON: [stat(DAEMON, MIDDLE)], MIDDLE: [stat(MIDDLE, LAUNCHER)]})
    assert owner_of(DAEMON, {LAUNCHER: "w-0"}, ME, adopt_as("x", []), read) == "w-0"


def test_a_process_re_parented_to_us_is_what_adoption_says() -> None:
    calls: list[tuple[int, int]] = []
    read, _ = reads({DAEMON: [stat(DAEMON, ME, start=4242)]})
    assert owner_of(DAEMON, {LAUNCHER: "w-0"}, ME, adopt_as("w-0", calls), read) == "w-0"
    assert calls == [(DAEMON, 4242)]


def test_the_middle_process_exiting_during_the_walk_does_not_lose_the_sender() -> None:
    """Regression (CI, a loaded machine): a double-forked daemon sent READY=1 while the process
    between it and its launcher still lived; the walk read the daemon (parent: the middle one),
    then the middle one exited and its launcher reaped it before the walk read it. The datagram
    was dropped as no worker's, and the worker never became ready. By then the daemon was
    re-parented to us: a walk started again finds it."""
    calls: list[tuple[int, int]] = []
    read, asked = reads(
        {DAEMON: [stat(DAEMON, MIDDLE), stat(DAEMON, ME, start=77)], MIDDLE: [None]}
    )
    assert owner_of(DAEMON, {LAUNCHER: "w-0"}, ME, adopt_as("w-0", calls), read) == "w-0"
    assert asked == [DAEMON, MIDDLE, DAEMON]
    assert calls == [(DAEMON, 77)]


def test_a_gone_sender_is_nobodys_at_once() -> None:
    read, asked = reads({})
    assert owner_of(DAEMON, {LAUNCHER: "w-0"}, ME, adopt_as("x", []), read) is None
    assert asked == [DAEMON]


def test_a_chain_that_keeps_breaking_ends() -> None:
    """A sender whose parent is always gone by the time it is read: the walk gives up after
    its restarts (a few reads), nobody's."""
    read, asked = reads({DAEMON: [stat(DAEMON, MIDDLE)], MIDDLE: [None]})
    assert owner_of(DAEMON, {LAUNCHER: "w-0"}, ME, adopt_as("x", []), read) is None
    assert asked.count(MIDDLE) == WALK_RESTARTS + 1


def test_a_foreign_process_and_a_loop_are_nobodys() -> None:
    read, _ = reads({DAEMON: [stat(DAEMON, 1)], 1: [stat(1, 0)]})
    assert owner_of(DAEMON, {LAUNCHER: "w-0"}, ME, adopt_as("x", []), read) is None
    read, _ = reads({DAEMON: [stat(DAEMON, DAEMON)]})
    assert owner_of(DAEMON, {LAUNCHER: "w-0"}, ME, adopt_as("x", []), read) is None


def test_a_deep_tree_is_walked_so_far() -> None:
    """Each process's parent is the next pid up; the worker's main process is past the bound."""
    top = 1000 + ANCESTORS_MAX + WALK_RESTARTS + 5
    table: dict[int, list[ProcStat | None]] = {p: [stat(p, p + 1)] for p in range(1000, top)}
    read, asked = reads(table)
    assert owner_of(1000, {top: "w-0"}, ME, adopt_as("x", []), read) is None
    assert len(asked) == ANCESTORS_MAX + WALK_RESTARTS
    near: dict[int, list[ProcStat | None]] = {p: [stat(p, p + 1)] for p in range(1000, 1010)}
    read, _ = reads(near)
    assert owner_of(1000, {1010: "w-0"}, ME, adopt_as("x", []), read) == "w-0"
