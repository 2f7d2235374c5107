"""Suite-wide fixtures: a real supervisor child process, and a check that no test leaks one."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.harness import Supervisor

SupervisorFactory = Callable[..., Supervisor]


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background by a non-interactive shell (`make test &`, a CI
    runner's job) inherits SIGINT ignored, and so would every child: the tests that press
    Ctrl-C on a client would wait for ever. Children get SIGINT's default action back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Iterator[None]:
    """A test that leaves a child (zombie or alive) of the test process fails."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(leftovers, timeout=3)
    assert not alive, f"test left processes behind: {[(p.pid, p.name()) for p in alive]}"


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[SupervisorFactory]:
    """Start supervisors with ``supervisor(config)``; all are killed and checked afterwards."""
    started: list[Supervisor] = []

    def make(config: Mapping[str, Any], **kwargs: Any) -> Supervisor:
        sup = Supervisor(tmp_path, config, **kwargs)
        started.append(sup)
        return sup.start()

    yield make
    survivors: list[int] = []
    for sup in started:
        survivors += sup.close()
    assert not survivors, f"processes outlived their supervisor: {survivors}"


@pytest.fixture(scope="session")
def fake_nvml_libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fake ``libnvidia-ml.so.1``: put it on ``LD_LIBRARY_PATH``."""
    from tests.fakenvml.build import build_fake_nvml, find_compiler

    if find_compiler() is None:
        pytest.skip("gcc is not installed: the fake libnvidia-ml.so.1 cannot be built")
    return build_fake_nvml(tmp_path_factory.mktemp("fakenvml"))
