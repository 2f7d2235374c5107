"""A stand-in for ``torch`` (see ../README.md): only ``torch.cuda``'s memory calls."""

from . import cuda

__all__ = ["cuda"]
