"""Choose the GPU backend from ``[gpu]``."""

from __future__ import annotations

from collections.abc import Mapping

from supervisor.backends.base import GpuBackend, NoBackend
from supervisor.backends.sim import SimBackend
from supervisor.config import GpuSection
from supervisor.errors import BackendUnavailable
from supervisor.model import DeviceIdentity, DeviceSample, XidEvent


def make_backend(gpu: GpuSection, *, create: bool = True) -> GpuBackend:
    """``sim``, ``none``, or NVML for ``nvml`` and ``auto`` (the caller handles the fallback).

    ``create=False``: a sim world is only read, never created (a missing one reads as the
    devices ``run`` would create in it).
    """
    if gpu.backend == "sim":
        return SimBackend(gpu.sim_dir, gpu.sim_devices, create=create)
    if gpu.backend == "none":
        return NoBackend()
    try:
        from supervisor.backends.nvml import NvmlBackend  # imports pynvml: only when asked for
    except (ImportError, AttributeError) as exc:  # no nvidia-ml-py, or another pynvml
        return UnusableNvml(f"NVML bindings unusable: {exc}")
    return NvmlBackend()


class UnusableNvml:
    """``nvml``/``auto`` where the ``pynvml`` module cannot be used (not installed, or a legacy
    ``pynvml`` package shadowing nvidia-ml-py's): every open fails, saying why, as a machine
    without the NVML library does (``auto`` runs without GPU telemetry). Regression: the
    import's error escaped, ending ``run`` at its start."""

    name = "nvml"
    xid_wait_s = 1.0

    def __init__(self, why: str) -> None:
        self.why = why

    def open(self) -> tuple[DeviceIdentity, ...]:
        """Never opens."""
        raise BackendUnavailable(self.why, library_absent=True)

    def sample(self) -> tuple[DeviceSample, ...]:
        """Never opened."""
        raise BackendUnavailable(self.why, library_absent=True)

    def wait_xid(self, timeout_s: float) -> list[XidEvent]:
        """Never any events."""
        return []

    def xids_unwatched(self) -> Mapping[str, str]:
        """No GPUs."""
        return {}

    def close(self) -> None:
        """Nothing to release."""
