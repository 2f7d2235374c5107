"""Build ``fakenvml.c`` into ``libnvidia-ml.so.1`` with gcc."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fakenvml.c")
SONAME = "libnvidia-ml.so.1"


class BuildError(RuntimeError):
    """gcc is missing or the build failed."""


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the fake library into ``out_dir``; return ``out_dir`` (for LD_LIBRARY_PATH)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("gcc is not installed: cannot build the fake libnvidia-ml.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        gcc,
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-Wl,-soname,{SONAME}",
        "-o",
        str(out_dir / SONAME),
        str(SOURCE),
        "-lpthread",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    if result.returncode != 0:
        raise BuildError(f"building {SONAME} failed:\n{result.stderr}")
    return out_dir
