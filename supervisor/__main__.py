"""``python -m supervisor`` and the ``gpu-supervisor`` console script."""

from __future__ import annotations

import sys

from supervisor.cli import main as _main


def main() -> None:
    """Console-script entry point."""
    sys.exit(_main())


if __name__ == "__main__":
    main()
