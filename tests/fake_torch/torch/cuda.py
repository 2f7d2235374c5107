"""The ``torch.cuda`` calls the in-use reporter makes, over allocations set by the test worker."""

from __future__ import annotations

import os

_initialized = False
_allocated: dict[int, int] = {}


def _after_fork() -> None:
    """As PyTorch: CUDA cannot be used in a child forked after it was initialised."""
    global _initialized
    _initialized = False


os.register_at_fork(after_in_child=_after_fork)


def init() -> None:
    """What the program's first CUDA call does in PyTorch (the reporter waits for it)."""
    global _initialized
    _initialized = True


def is_initialized() -> bool:
    return _initialized


def device_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d]) if visible else 1


def memory_allocated(device: int | None = None) -> int:
    """Bytes held by tensors on ``device`` (0 before init, as PyTorch's own stats)."""
    return _allocated.get(device or 0, 0) if _initialized else 0


def set_allocated(device: int, nbytes: int) -> None:
    """Test hook: the worker's tensors on ``device`` now hold ``nbytes``."""
    _allocated[device] = nbytes
