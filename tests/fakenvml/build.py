"""Compile the fake ``libnvidia-ml.so.1`` (``fakenvml.c``) for tests that load the real pynvml.

``build_fake_nvml(out_dir)`` returns the directory to put on ``LD_LIBRARY_PATH`` of a child
process; pynvml then finds the fake by its SONAME. Variants that lack a symbol (to exercise a
backend's fallbacks) are built with ``defines``, one directory per variant.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fakenvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"

#: Compile-time switches understood by fakenvml.c, each removing the named C symbols.
VARIANTS = {
    "FAKENVML_NO_PROCESSES_V3": (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
    ),
    "FAKENVML_NO_MEMORY_V2": ("nvmlDeviceGetMemoryInfo_v2",),
    "FAKENVML_NO_TEMPERATURE_V": ("nvmlDeviceGetTemperatureV",),
    "FAKENVML_NO_CLOCKS_EVENT_REASONS": ("nvmlDeviceGetCurrentClocksEventReasons",),
}


class FakeNvmlBuildError(RuntimeError):
    """The fake library could not be built (no C compiler, or the compile failed)."""


def find_compiler() -> str | None:
    """Path of ``gcc``, or None when it is not installed."""
    return shutil.which("gcc")


def compile_command(
    out_dir: Path, *, compiler: str = "gcc", defines: Sequence[str] = ()
) -> list[str]:
    """The gcc command line that builds ``out_dir/libnvidia-ml.so.1``."""
    unknown = sorted(set(defines) - VARIANTS.keys())
    if unknown:
        raise FakeNvmlBuildError(f"unknown fakenvml variant(s): {', '.join(unknown)}")
    return [
        compiler,
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-Wextra",
        *(f"-D{name}" for name in defines),
        "-Wl,-soname," + LIBRARY_NAME,
        "-o",
        str(out_dir / LIBRARY_NAME),
        str(SOURCE),
        "-lpthread",
    ]


def build_fake_nvml(out_dir: Path, *, defines: Sequence[str] = ()) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1``; return ``out_dir``.

    Raises FakeNvmlBuildError when gcc is missing, or when it fails or emits any warning
    (the source is kept warning-free, so a warning means something is wrong).
    """
    compiler = find_compiler()
    if compiler is None:
        raise FakeNvmlBuildError("gcc is not installed: cannot build the fake libnvidia-ml.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        compile_command(out_dir, compiler=compiler, defines=defines),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0 or result.stderr.strip():
        raise FakeNvmlBuildError(
            f"building {SOURCE.name} failed (exit {result.returncode}):\n{result.stderr}"
        )
    return out_dir


#: Older name of FakeNvmlBuildError, kept for callers that import it.
BuildError = FakeNvmlBuildError
