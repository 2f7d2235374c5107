"""``python -m supervisor`` and the ``gpu-supervisor`` console script."""

from __future__ import annotations

import gc
import sys

# Start-up allocates many objects and no garbage worth collecting: the collector is turned on
# again (after a gc.freeze) once the runtime has spawned its workers, or at once by any other
# command (supervisor.cli.main).
gc.disable()

from supervisor.cli import main as _main  # noqa: E402


def main() -> None:
    """Console-script entry point."""
    sys.exit(_main())


if __name__ == "__main__":
    main()
