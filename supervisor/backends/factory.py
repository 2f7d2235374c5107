"""Choose the GPU backend from ``[gpu]``."""

from __future__ import annotations

from supervisor.backends.base import GpuBackend, NoBackend
from supervisor.backends.sim import SimBackend
from supervisor.config import GpuSection


def make_backend(gpu: GpuSection, *, create: bool = True) -> GpuBackend:
    """``sim``, ``none``, or NVML for ``nvml`` and ``auto`` (the caller handles the fallback).

    ``create=False``: a sim world is only read, never created (a missing one reads as the
    devices ``run`` would create in it).
    """
    if gpu.backend == "sim":
        return SimBackend(gpu.sim_dir, gpu.sim_devices, create=create)
    if gpu.backend == "none":
        return NoBackend()
    from supervisor.backends.nvml import NvmlBackend  # imports pynvml: only when asked for

    return NvmlBackend()
