"""The sampler's schedule: samples asked for early do not postpone the regular ones."""

from __future__ import annotations

from pathlib import Path

import anyio

from supervisor.backends.sim import SimBackend
from supervisor.model import Sample
from supervisor.sampler import Sampler


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
