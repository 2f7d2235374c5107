"""The dependency floors in pyproject.toml leave out releases known to give wrong answers."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_nvidia_ml_py_floor_leaves_out_the_release_with_the_wrong_process_struct() -> None:
    """Regression: the floor ``>=12.535`` let pip keep nvidia-ml-py 12.535.77, whose process
    entry is 32 bytes (``usedGpuCcProtectedMemory``) where every driver's ``_v3`` list has
    24: PIDs and GPU memory read from the wrong offsets (NVML.md section 3.5), so workers'
    GPU memory, leaks and budgets were judged on garbage. 12.535.108 is the first good one."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (pin,) = (Requirement(d) for d in deps if Requirement(d).name == "nvidia-ml-py")
    assert not pin.specifier.contains("12.535.77")
    assert pin.specifier.contains("12.535.108")
    assert pin.specifier.contains("13.615.71")
