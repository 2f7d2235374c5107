"""The sampler's schedule and XID watch, on the sim backend."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from supervisor import sampler as sampler_module
from supervisor.backends.sim import SimBackend
from supervisor.errors import BackendUnavailable
from supervisor.model import DeviceIdentity, DeviceSample, Sample, XidEvent
from supervisor.sampler import Sampler, replaced_gpus


async def test_requested_samples_do_not_postpone_the_regular_ones(tmp_path: Path) -> None:
    """Regression: every tick moved the schedule on by one interval, early ones included, so a
    GPU-release barrier that kept asking pushed the next regular sample minutes away."""
    samples: list[Sample] = []
    got = anyio.Event()

    def on_sample(s: Sample) -> None:
        nonlocal got
        samples.append(s)
        got.set()
        got = anyio.Event()

    sampler = Sampler(
        lambda: SimBackend(tmp_path / "sim", 1),
        interval_s=0.1,
        workers=dict,
        on_sample=on_sample,
        on_xid=lambda e: None,
    )
    assert await sampler.open()
    async with anyio.create_task_group() as tg:
        await tg.start(sampler.serve)
        for _ in range(50):  # 50 samples asked for, back to back: 5 intervals' worth
            waiter = got
            sampler.request()
            await waiter.wait()
        asked = len(samples)
        with anyio.fail_after(1.0):  # the next regular one: within an interval, not 5 s
            await got.wait()
        assert len(samples) == asked + 1
        tg.cancel_scope.cancel()


async def test_xids_are_read_when_the_backend_comes_up_after_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the XID watch was started only if GPUs were known at start, so after NVML
    came up on a retry no XID was ever read (no restart, no quarantine, no count)."""
    monkeypatch.setattr(sampler_module, "REOPEN_INITIAL_S", 0.05)
    monkeypatch.setattr(sampler_module, "HOST_ONLY_INTERVAL_S", 0.1)
    world = tmp_path / "sim"
    opened = 0

    def factory() -> SimBackend:
        nonlocal opened
        opened += 1
        backend = SimBackend(world, 1)
        if opened == 1:  # NVML_ERROR_DRIVER_NOT_LOADED at start-up, then it loads

            def fail() -> tuple[DeviceIdentity, ...]:
                raise BackendUnavailable("NVML init failed: Driver Not Loaded")

            backend.open = fail  # type: ignore[method-assign]
        return backend

    up, xid = anyio.Event(), anyio.Event()
    xids: list[XidEvent] = []

    def on_sample(s: Sample) -> None:
        if s.devices:
            up.set()

    def on_xid(e: XidEvent) -> None:
        xids.append(e)
        xid.set()

    sampler = Sampler(factory, 0.1, dict, on_sample, on_xid)
    assert not await sampler.open()
    async with anyio.create_task_group() as tg:
        await tg.start(sampler.serve)
        with anyio.fail_after(10):
            await up.wait()
        with (world / "events").open("a") as fh:
            fh.write("0 79\n")
        with anyio.fail_after(10):
            await xid.wait()
        tg.cancel_scope.cancel()
    assert [e.xid for e in xids] == [79]


class _Enumerations:
    """A backend whose every open enumerates the next of ``worlds`` ((index, UUID) pairs;
    ``unknown-<i>`` is a GPU whose UUID cannot be read, lost)."""

    name = "stub"
    xid_wait_s = 1.0

    def __init__(self, worlds: list[list[tuple[int, str]]]) -> None:
        self.worlds = worlds
        self.at = -1

    def open(self) -> tuple[DeviceIdentity, ...]:
        self.at += 1
        return tuple(DeviceIdentity(i, u, "n") for i, u in self.worlds[self.at])

    def sample(self) -> tuple[DeviceSample, ...]:
        return tuple(
            DeviceSample(i, u, "n", healthy=not u.startswith("unknown-"))
            for i, u in self.worlds[self.at]
        )

    def close(self) -> None:
        pass

    def wait_xid(self, timeout_s: float) -> list[XidEvent]:
        return []

    def xids_unwatched(self) -> dict[str, str]:
        return {}


async def _names_after(worlds: list[list[tuple[int, str]]]) -> list[tuple[int, str, bool]]:
    stub = _Enumerations(worlds)
    sampler = Sampler(lambda: stub, 1.0, dict, lambda s: None, lambda e: None)
    sample = None
    for _ in worlds:
        assert await sampler.open()
        sample = await sampler.tick()
    assert sample is not None
    return sorted((d.index, d.uuid, d.healthy) for d in sample.devices)


async def test_a_gpu_lost_across_a_reinit_keeps_its_uuid_only_when_that_is_unambiguous() -> None:
    """A placeholder is the GPU last seen at its index and not listed now; when GPUs were
    renumbered (one removed), it stays a placeholder. Regression: a healthy GPU's UUID was
    given to the placeholder, and that GPU was reported lost (and quarantined)."""
    a, b, c = "GPU-A", "GPU-B", "GPU-C"
    assert await _names_after([[(0, a), (1, b)], [(0, a), (1, "unknown-1")]]) == [
        (0, a, True),
        (1, b, False),
    ]
    # b gone, c renumbered to 1, and a GPU at 2 whose UUID cannot be read: c was last seen at
    # index 2, but it is listed at 1 now: the placeholder is not c
    renumbered = [[(0, a), (1, b), (2, c)], [(0, a), (1, c), (2, "unknown-2")]]
    got = await _names_after(renumbered)
    assert (1, c, True) in got and [u for _, u, _ in got].count(c) == 1
    assert (2, "unknown-2", False) in got and (1, b, False) in got  # b: lost, not listed
    # the same, in two re-inits
    twice = [[(0, a), (1, b), (2, c)], [(0, a), (1, c)], [(0, a), (1, c), (2, "unknown-2")]]
    assert await _names_after(twice) == got


def test_a_new_uuid_where_a_gpu_seen_before_is_no_longer_listed_replaced_it() -> None:
    """Regression: a GPU replaced (hot-swap, or another GPU in its slot after a driver
    reload: a UUID never seen, at the index of a GPU seen before and no longer listed) left
    the old one lost for good. Only an unambiguous slot counts: not a placeholder (the old GPU
    itself, its UUID unreadable), not a slot whose GPU seen before is listed elsewhere now
    (renumbered), not a slot two GPUs seen before were last at."""
    a, b, c = (DeviceIdentity(i, u, "n") for i, u in enumerate("ABC"))

    def at(index: int, uuid: str) -> DeviceIdentity:
        return DeviceIdentity(index, uuid, "n")

    seen = {i.uuid: i for i in (a, b, c)}
    new = at(1, "N")
    assert replaced_gpus(seen, [a, new, c]) == [(b, new)]
    assert replaced_gpus(seen, [a, b, c]) == []  # nothing new
    assert replaced_gpus(seen, [a, at(1, "unknown-1"), c]) == []  # a placeholder
    assert replaced_gpus(seen, [a, at(1, c.uuid), at(2, "N")]) == []  # c renumbered
    assert replaced_gpus({**seen, "D": at(1, "D")}, [a, new, c]) == []  # two were at 1
    assert replaced_gpus(seen, [a, new, c, at(3, "M")]) == [(b, new)]  # M: one more GPU


async def test_a_replaced_gpu_is_retired_not_lost_and_not_reopened_for() -> None:
    """GPU 1 is replaced across a re-init (a new UUID at its index). Regression: the old UUID
    stayed lost (in the API, metrics, /readyz, placement) until the supervisor restarted, and
    NVML was opened again every 5 minutes for it, a gap in the other GPUs' telemetry each
    time. It is said once (``gpu.replaced``), and the new GPU is a fresh, healthy one."""
    from structlog.testing import capture_logs

    a, b, n = "GPU-A", "GPU-B", "GPU-N"
    stub = _Enumerations([[(0, a), (1, b)], [(0, a), (1, n)], [(0, a), (1, n)]])
    sampler = Sampler(lambda: stub, 1.0, dict, lambda s: None, lambda e: None)
    with capture_logs() as logs:
        for _ in range(3):
            assert await sampler.open()
            sample = await sampler.tick()
            assert not sampler._misses_seen()  # no reason to open NVML again
    assert sorted((d.index, d.uuid, d.healthy) for d in sample.devices) == [
        (0, a, True),
        (1, n, True),
    ]
    assert [i.uuid for i in sampler.identities] == [a, n]
    said = [
        (e["index"], e["old_uuid"], e["new_uuid"]) for e in logs if e["event"] == "gpu.replaced"
    ]
    assert said == [(1, b, n)]
    assert sampler.replaced == [(b, n)]


async def test_a_gpu_replaced_under_a_backend_that_lists_it_at_a_sample_is_retired(
    tmp_path: Path,
) -> None:
    """The sim backend lists what its world holds at every sample: GPU 1's file now names
    another UUID (a hot-swap) without the backend being opened again. Regression: the old UUID
    was listed lost next to the new one for good, and placement still went by the old one."""
    world = tmp_path / "sim"
    SimBackend(world, 2).open()
    sampler = Sampler(lambda: SimBackend(world, 2), 1.0, dict, lambda s: None, lambda e: None)
    assert await sampler.open()
    old = [i.uuid for i in sampler.identities]
    text = (world / "gpus" / "1").read_text().replace(old[1], "GPU-new")
    (world / "gpus" / "1").write_text(text)
    sample = await sampler.tick()
    assert [(d.uuid, d.healthy) for d in sample.devices] == [(old[0], True), ("GPU-new", True)]
    assert [i.uuid for i in sampler.identities] == [old[0], "GPU-new"]
    assert sampler.replaced == [(old[1], "GPU-new")]


async def test_a_bug_reading_the_gpus_makes_telemetry_unavailable_not_the_supervisor_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any error a backend raises that is no BackendError (a driver's odd answer, a sim
    world's odd file: a bug) makes telemetry unavailable with the reason, and the backend is
    opened again later. Regression: it went up through the sampler's task and the supervisor
    exited, ending every worker (a file named "²" in the sim world's procs/ did it)."""
    monkeypatch.setattr(sampler_module, "REOPEN_INITIAL_S", 0.0)
    monkeypatch.setattr(sampler_module, "XID_WAIT_S", 0.01)
    world = tmp_path / "sim"
    calls = {"open": 0, "sample": 0, "wait_xid": 0}
    waited_again = threading.Event()

    def factory() -> SimBackend:
        backend = SimBackend(world, 1)
        for name in calls:
            real = getattr(backend, name)

            def failing_once(*args: object, _name: str = name, _real: Any = real) -> Any:
                calls[_name] += 1
                if calls[_name] == 1:
                    raise ValueError(f"odd {_name}")
                if _name == "wait_xid":
                    waited_again.set()
                return _real(*args)

            setattr(backend, name, failing_once)
        return backend

    sampler = Sampler(factory, 0.1, dict, lambda s: None, lambda e: None)
    assert not await sampler.open()  # ValueError: odd open
    assert sampler.error is not None and "odd open" in sampler.error
    assert await sampler.open()
    failed = await sampler.tick()
    assert failed is not None and not failed.nvml_available
    assert failed.error is not None and "ValueError('odd sample')" in failed.error
    assert await sampler.open()
    again = await sampler.tick()
    assert again is not None and again.nvml_available and len(again.devices) == 1
    async with anyio.create_task_group() as tg:  # the XID watch goes on after a failed wait
        await tg.start(sampler.serve)
        assert await anyio.to_thread.run_sync(waited_again.wait, 10)
        tg.cancel_scope.cancel()


async def test_auto_kept_on_a_library_that_does_not_initialise_says_it_once() -> None:
    """Regression: ``backend = "auto"`` keeps NVML where its library is there but does not
    initialise (a driver loaded late), and retries it with backoff; on a machine without GPUs
    that has the library installed (a CPU node of a GPU image), that was a ``gpu.unavailable``
    warning every minute for ever, where ``auto`` had said once that it runs without GPU
    telemetry. The same failure is said once; a different one (or ``gpu.backend`` when it
    opens) is said again."""
    from structlog.testing import capture_logs

    errors = iter(["Driver Not Loaded"] * 3 + ["RM Version Mismatch"])

    class Late:
        name = "nvml"

        def open(self) -> tuple[DeviceIdentity, ...]:
            raise BackendUnavailable(f"NVML init failed: {next(errors)}")

    sampler = Sampler(Late, 1.0, dict, lambda s: None, lambda e: None)  # type: ignore[arg-type]
    with capture_logs() as logs:
        assert not await sampler.open(fallback=True)
        assert not await sampler.open()
        assert not await sampler.open()
        assert not await sampler.open()
    said = [e["error"] for e in logs if e["event"] == "gpu.unavailable"]
    assert said == [
        "NVML init failed: Driver Not Loaded",
        "NVML init failed: RM Version Mismatch",
    ], said


async def test_a_gpu_kept_healthy_without_a_handle_after_a_reinit_says_its_xids_are_unwatched() -> (
    None
):
    """NVML is initialised again and GPU 1's UUID answers a passing error (UNKNOWN): it is kept
    healthy (workers may run there) with its readings unknown, but without a handle it is not
    registered for XID events. Regression: it was not in ``xids_unwatched``, so its GPU object
    and ``gpu_xids_watched`` said its XIDs were watched, and no ``gpu.xids_unwatched`` was
    logged, while an XID 79 or 48 on it reached nothing."""
    a, b = "GPU-A", "GPU-B"

    class Reopened(_Enumerations):
        def sample(self) -> tuple[DeviceSample, ...]:
            if self.at == 0:
                return super().sample()
            error = "Unknown Error"  # as NvmlBackend.sample() says a passing handle failure
            return (
                DeviceSample(0, a, "n"),
                DeviceSample(1, "unknown-1", error, False, error=error, unidentified=True),
            )

    stub = Reopened([[(0, a), (1, b)], [(0, a), (1, "unknown-1")]])
    sampler = Sampler(lambda: stub, 1.0, dict, lambda s: None, lambda e: None)
    for _ in range(2):
        assert await sampler.open()
        sample = await sampler.tick()
    assert sorted((d.uuid, d.healthy) for d in sample.devices) == [(a, True), (b, True)]
    sampler._xids_watched(stub)  # what the XID loop does after each wait
    assert list(sampler.xids_unwatched) == [b], sampler.xids_unwatched


@pytest.mark.parametrize("where", ["open", "sample"])
async def test_nvml_down_while_a_gpu_is_missing_is_retried_within_a_minute(
    tmp_path: Path, where: str
) -> None:
    """Regression: while a GPU seen before was missing, the re-opens backed off to every
    5 minutes (``PARTIAL_REOPEN_MAX_S``); when NVML then failed altogether (a re-open that
    failed, or a sample answered UNINITIALIZED: a driver reload), that 5-minute wait was the
    next try, so every GPU went without telemetry and XID watch for up to 5 minutes instead
    of ``REOPEN_MAX_S``."""
    import time

    world = tmp_path / "sim"
    SimBackend(world, 2).open()
    fail = {"open": False, "sample": False}

    def factory() -> SimBackend:
        backend = SimBackend(world, 2)
        real_open, real_sample = backend.open, backend.sample

        def open_() -> tuple[DeviceIdentity, ...]:
            if fail["open"]:
                raise BackendUnavailable("NVML init failed: Driver Not Loaded")
            return real_open()

        def sample() -> tuple[DeviceSample, ...]:
            if fail["sample"]:
                raise BackendUnavailable("NVML is no longer initialised")
            return real_sample()

        backend.open = open_  # type: ignore[method-assign]
        backend.sample = sample  # type: ignore[method-assign]
        return backend

    sampler = Sampler(factory, 0.1, dict, lambda s: None, lambda e: None)
    assert await sampler.open() and len(sampler.identities) == 2
    (world / "gpus" / "1").rename(world / "gpu1.off")
    for _ in range(12):  # GPU 1 missing at every re-open: the wait grows to 5 minutes
        assert await sampler.open() and len(sampler.identities) == 1
    assert (await sampler.tick()).nvml_available
    assert sampler._reopen_at - time.monotonic() > sampler_module.REOPEN_MAX_S
    fail[where] = True
    if where == "open":
        assert not await sampler.open()
    else:
        assert not (await sampler.tick()).nvml_available
    assert not sampler.available
    assert sampler._reopen_at - time.monotonic() <= sampler_module.REOPEN_MAX_S
