"""The error tree of gpu-supervisor (a stdlib-only leaf module).

::

    SupervisorError
    ├── ConfigError          bad configuration: exit code 2, one line naming file, key and value
    ├── PlacementError       a plan that cannot be placed on the GPUs at hand
    ├── BackendError         the GPU backend failed
    │   ├── BackendUnavailable  no NVML (library missing, driver not loaded, no permission)
    │   ├── DeviceLost          one device stopped answering ("GPU is lost", reset required)
    │   └── QueryNotSupported   one field is not supported on one device
    ├── WorkerError
    │   ├── SpawnError       the worker's command could not be executed
    │   └── IllegalTransition a lifecycle transition that the state table forbids
    ├── ListenError          the HTTP API cannot listen where configured (address in use...)
    ├── StateDirBusy         another supervisor holds the same state_dir
    ├── ApiClientError       a client command could not reach or use the supervisor's API
    └── UsageError           bad command-line use: exit code 2

Only ``supervisor.__main__`` turns these into exit codes; library code raises them.
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(SupervisorError):
    """The configuration is invalid; ``str()`` is one line naming the file, key and value."""


class UsageError(SupervisorError):
    """The command line is invalid."""


class ListenError(SupervisorError):
    """The API cannot bind its socket (``api.listen``); exit code 1, as it may be transient."""


class StateDirBusy(SupervisorError):
    """Another gpu-supervisor holds ``state_dir`` (its lock file); exit code 1."""


class ApiClientError(SupervisorError):
    """A client command (``status``, ``drain``...) failed at run time: not running, 409, 5xx."""


class PlacementError(ConfigError):
    """The plan cannot be placed (not enough GPUs, memory, ...): a configuration problem."""


class BackendError(SupervisorError):
    """The GPU backend failed; ``code`` is the NVML return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class BackendUnavailable(BackendError):
    """No GPU telemetry: the library or driver is missing, or access is denied.

    ``library_absent``: the GPU library itself is not there (NVML's ``LibraryNotFound``, or a
    library without the functions needed to initialise: a machine without GPUs), as opposed
    to a library that is there but does not answer (driver not loaded yet, version mismatch,
    no permission, a call that hangs): only the first is worth no retry."""

    def __init__(
        self, message: str, code: int | None = None, *, library_absent: bool = False
    ) -> None:
        super().__init__(message, code)
        self.library_absent = library_absent


class DeviceLost(BackendError):
    """A device stopped answering (GPU is lost, reset required, ...)."""


class QueryNotSupported(BackendError):
    """A field is not supported on a device (or not permitted, or not available)."""


class WorkerError(SupervisorError):
    """Something about one worker went wrong."""


class SpawnError(WorkerError):
    """The worker's command could not be started (not found, not executable, ...)."""


class IllegalTransition(WorkerError):
    """A lifecycle transition that ``model.ALLOWED`` does not contain."""


def connection_reason(exc: BaseException) -> str:
    """A failed HTTP connection in a few words (``connection refused``, ``no such socket``),
    else the error's own text."""
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    if "No such file" in text or "Errno 2" in text:
        return "no such socket"
    if "Permission denied" in text or "Errno 13" in text:
        return "permission denied"
    return text
